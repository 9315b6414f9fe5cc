"""The loramux server for bench/serve_load.py, in its own process (as vLLM is), so that the load generator never
shares the server's GIL.

`python bench/serve_stack.py --data-dir D --adapters-dir A --port P --threads 2` builds `Services` from Settings
(SQLite registry and file store in D, the embedded SmolLM2-135M-Instruct, float32 on CPU, max_loras and
max_lora_rank from the command line), registers every PEFT directory under A as a public adapter of tenant `acme`
(the same directories vLLM gets as --lora-modules), creates one tenant with an API key per tier (free, standard,
premium; and a second standard one, key "standard-2") and lifts those tiers' request, token and concurrency
limits (0 = unlimited; priorities and timeouts stay), so that a sweep measures the engine and not the rate
limiter. The process is pinned to the first `--threads` cores it may run on, as bench/vllm_peer.py pins vLLM.
It prints one JSON line on stdout once uvicorn is up, {"url", "keys", "base_model", "adapters", "settings"}, and
serves until SIGTERM / SIGINT.

`LoramuxServer` is the other side: it starts that process in its own process group, waits for the JSON line
(no fixed sleeps) and stops the whole group on exit.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH_TIERS = ("free", "standard", "premium")


# --- the server process ----------------------------------------------------------------------------------------

def setup_tenants(services, adapters_dir: Path) -> tuple[dict[str, str], list[str]]:
    """Public adapters of `acme` from every subdirectory of `adapters_dir`, a keyed tenant per tier, tier limits
    lifted. Returns ({tier: key}, ["acme/<name>", ...])."""
    from dataclasses import replace

    tenancy, registry = services.tenancy, services.registry
    acme = tenancy.create_tenant("acme", tier="standard").id
    adapters = []
    for path in sorted(p for p in adapters_dir.iterdir() if p.is_dir()):
        files = {f: path / f for f in ("adapter_config.json", "adapter_model.safetensors")}
        registry.register(acme, path.name, files, visibility="public")
        adapters.append(f"acme/{path.name}")
    keys = {}
    for tier in BENCH_TIERS:
        tenancy.upsert_tier(replace(tenancy.tier(tier), requests_per_min=0, tokens_per_min=0, max_concurrent=0))
        tenancy.create_tenant(f"{tier}-co", tier=tier)
        keys[tier] = tenancy.create_key(f"{tier}-co")[1]
    tenancy.create_tenant("standard-co-2", tier="standard")  # a second tenant of one tier (bench/fairness.py)
    keys["standard-2"] = tenancy.create_key("standard-co-2")[1]
    return keys, adapters


async def serve(server, info: dict) -> None:
    """Run uvicorn; print `info` as one JSON line once it accepts connections."""
    import asyncio

    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.02)
    print(json.dumps(info), flush=True)
    await task


def server_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--adapters-dir", type=Path, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    args = ap.parse_args(argv)

    import asyncio

    import torch
    import uvicorn

    from loramux.names import base_model_id
    from loramux.server.app import create_app
    from loramux.services.container import Services
    from loramux.settings import Settings

    cpus = sorted(os.sched_getaffinity(0))[:args.threads]  # the cores vllm_peer pins vLLM to, for the same machine
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    settings = Settings(data_dir=args.data_dir, database_url="", store_url="", dtype="float32", device="cpu",
                        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    services = Services.from_settings(settings)
    keys, adapters = setup_tenants(services, args.adapters_dir)
    s = services.settings
    info = {"url": f"http://{args.host}:{args.port}", "keys": keys, "base_model": base_model_id(s.model),
            "adapters": adapters, "load_s": round(time.perf_counter() - t0, 2),
            "settings": {"threads": args.threads, "cpus": cpus, "dtype": "float32", "max_num_seqs": s.max_num_seqs,
                         "max_num_batched_tokens": s.max_num_batched_tokens, "max_loras": s.max_loras,
                         "max_lora_rank": s.max_lora_rank, "kv_cache_bytes": s.kv_cache_bytes,
                         "step_target_ms": getattr(s, "step_target_ms", None)},
            "tiers": {t.name: {"priority": t.priority, "requests_per_min": t.requests_per_min,
                               "tokens_per_min": t.tokens_per_min, "max_concurrent": t.max_concurrent,
                               "default_timeout_s": t.default_timeout_s}
                      for t in services.tenancy.tiers() if t.name in BENCH_TIERS}}
    config = uvicorn.Config(create_app(lambda: services), host=args.host, port=args.port, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    asyncio.run(serve(uvicorn.Server(config), info))  # the app's lifespan shuts the services down


# --- the launcher (bench side; imports neither torch nor loramux) -----------------------------------------------

class ServerStartError(RuntimeError):
    pass


class LoramuxServer:
    """`with LoramuxServer(...) as info:` runs serve_stack.py in its own process group; `info` is its JSON line
    (plus `startup_s`). Its stderr goes to `log_path`."""

    def __init__(self, data_dir: Path, adapters_dir: Path, port: int, log_path: Path, threads: int = 2,
                 max_loras: int = 8, max_lora_rank: int = 16, start_timeout_s: float = 300):
        self.cmd = [sys.executable, str(HERE / "serve_stack.py"), "--data-dir", str(data_dir),
                    "--adapters-dir", str(adapters_dir), "--port", str(port), "--threads", str(threads),
                    "--max-loras", str(max_loras), "--max-lora-rank", str(max_lora_rank)]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        self.log_path, self.start_timeout_s = log_path, start_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> dict:
        t0 = time.perf_counter()
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.log, env=self.env,
                                     start_new_session=True, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:  # reads stdout to the end, so that the pipe never fills
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                try:
                    line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise ServerStartError(f"loramux server not up after {self.start_timeout_s:.0f} s "
                                           f"(log: {self.log_path})") from None
                if line is None:
                    raise ServerStartError(f"loramux server exited with {self.proc.wait()} before it was up: "
                                           f"{self._log_tail()}")
                if line.startswith("{"):
                    info = json.loads(line)
                    info["startup_s"] = time.perf_counter() - t0
                    return info
        except BaseException:
            self.__exit__()
            raise

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace").strip().splitlines()[-1][:300]
        except (OSError, IndexError):
            return "(no log)"

    def __exit__(self, *exc) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


if __name__ == "__main__":
    server_main()
