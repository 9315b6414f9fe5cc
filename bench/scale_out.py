"""Throughput of 1 vs 2 engine replicas on Ray Serve, same workload: `FIGURE ray_two_replica_speedup`.

Workload: the embedded SmolLM2-135M-Instruct (float32, CPU), 8 random r=16 PEFT adapters on all 7
projections plus base-model requests (1 in 9), chat prompts from bench/engine_throughput.py, at most 32 new
tokens each (the OpenAI API has no min_tokens: tokens are counted from each response's usage), `--clients`
closed-loop clients through the official `openai` package, greedy.
Each configuration gets its own Serve application on one local Ray cluster (SQLite registry, file store, a
private redis-server), a warm-up, then `--rounds` timed rounds, alternating the configurations' order.

The thread split is the point of the figure on a small machine: with C cores, one replica runs C torch
threads, two replicas run C/2 each (`cluster_threads_per_replica`). On this 2-core VM the figure says
whether two half-size engines serve more than one full-size engine on the same cores (batching within an
engine against parallelism across engines, plus the cost of the Serve hop); it does NOT say how far loramux
scales with more machines: each added replica there brings its own cores or GPU, and the shared state
(PostgreSQL, Redis, S3) is touched a few times per request, not per token. docs/capacity.md turns the
per-replica numbers into a sizing model.

    python bench/scale_out.py [--rounds 2] [--requests 48] [--clients 16] [--quick | --smoke]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import describe_cpu, free_port, start_redis_server, write_peft_adapter

ADMIN_KEY = "lmxa-scale-out-bench-0123456789abcdefghijkl"
RANK = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def start_redis() -> tuple[str, subprocess.Popen | None]:
    """A private redis-server (url, process); without the binary, LORAMUX_REDIS_URL (default db 14 on 6379)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return os.environ.get("LORAMUX_REDIS_URL", "redis://127.0.0.1:6379/14"), None
    server = start_redis_server(binary)
    return server.url, server.process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=48, help="requests per timed round")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="short run: 1 round of 8 requests, 4 clients, 4 tokens")
    parser.add_argument("--smoke", action="store_true", help=f"--quick on the tiny model: {SMOKE_HELP}")
    args = parser.parse_args(argv)
    if args.smoke:
        tiny_model()
    if args.quick or args.smoke:
        args.rounds, args.requests, args.clients, args.new_tokens = 1, 8, 4, 4

    import httpx
    import openai
    import ray
    from engine_throughput import PROMPTS
    from ray import serve

    from loramux.cluster import app as cluster_app
    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.settings import Settings

    cores = len(os.sched_getaffinity(0))
    print(f"scale-out on Ray Serve: {model_label(args.smoke)} float32, {args.requests} requests per round "
          f"({args.clients} closed-loop clients, {args.new_tokens} new tokens), 8 r={RANK} adapters + base; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(describe_cpu())
    print(f"cores this process may run on: {cores}")
    configs = [(1, cores), (2, max(1, cores // 2))]
    print("configurations: " + "; ".join(f"{n} replica(s) x {t} torch thread(s)" for n, t in configs))

    tmp = Path(tempfile.mkdtemp(prefix="loramux-scale-out-"))
    redis_url, redis_proc = start_redis()
    model_dir = resolve_model_dir(Settings().model, Path(Settings().cache_dir))
    model_cfg, _ = read_model_config(model_dir)
    adapter_dirs = [write_peft_adapter(tmp / f"ad{i}", model_cfg, RANK, ALL, seed=i, b_std=0.02) for i in range(8)]
    ray.init(num_cpus=max(4, cores + 2), include_dashboard=False, log_to_driver=False)
    results: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    try:
        deployments, port = {}, free_port()  # Serve keeps the HTTP port of its first start
        for n, threads in configs:  # one database for both: tenants and adapters set up once
            deployments[(n, threads)] = Settings(
                data_dir=tmp / "data", redis_url=redis_url, ray_replicas=n, cluster_threads_per_replica=threads,
                host="127.0.0.1", port=port, admin_key=ADMIN_KEY, speculative_tokens=0, json_logs=False,
                max_lora_rank=RANK, adapter_pool_bytes=256 * 2**20)
        keys, adapters = None, None

        def deploy(cfg):
            nonlocal keys, adapters
            settings = deployments[cfg]
            started = time.perf_counter()
            cluster_app.run(settings, blocking=False)
            url = f"http://127.0.0.1:{settings.port}"
            if keys is None:
                keys, adapters = set_up(httpx, url, adapter_dirs)
            log(f"deployed {cfg[0]} replica(s) x {cfg[1]} thread(s) in {time.perf_counter() - started:.1f} s")
            return url

        def one_round(url: str, count: int) -> float:
            client = openai.OpenAI(base_url=url + "/v1", api_key=keys, max_retries=0, timeout=300)

            def call(i: int) -> int:
                model_id = "base" if i % 9 == 8 else adapters[i % len(adapters)]
                resp = client.chat.completions.create(
                    model=model_id, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    max_tokens=args.new_tokens, temperature=0)
                return resp.usage.completion_tokens

            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                tokens = sum(pool.map(call, range(count)))
            return tokens / (time.perf_counter() - started)

        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for cfg in order:
                url = deploy(cfg)  # fresh replicas each round: warm them up
                log(f"warm-up {cfg}: {one_round(url, args.clients):.1f} tok/s")
                tps = one_round(url, args.requests)
                results[cfg].append(tps)
                log(f"round {r + 1}/{args.rounds} {cfg[0]} replica(s) x {cfg[1]} thread(s): {tps:.1f} tok/s")
                serve.delete(cluster_app.APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
        if redis_proc is not None:
            redis_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)

    medians = {cfg: statistics.median(v) for cfg, v in results.items()}
    for (n, t), value in medians.items():
        print(f"{n} replica(s) x {t} thread(s): median {value:.1f} tok/s over {len(results[(n, t)])} round(s) "
              f"({', '.join(f'{v:.1f}' for v in results[(n, t)])})")
    print(f"FIGURE ray_two_replica_speedup {medians[configs[1]] / medians[configs[0]]:.2f}")
    return 0


def set_up(httpx, url: str, adapter_dirs: list[Path]) -> tuple[str, list[str]]:
    """A premium tenant with no limits in the way and the 8 adapters, through the admin API."""
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120)
    unlimited = {"priority": 10, "requests_per_min": 0, "tokens_per_min": 0, "max_concurrent": 0,
                 "default_timeout_s": 300, "max_timeout_s": 600, "max_choices": 16}
    admin.put("/admin/tiers/bench", json=unlimited).raise_for_status()
    tenant = admin.post("/admin/tenants", json={"name": "bench", "tier": "bench"})
    tenant.raise_for_status()
    key = admin.post(f"/admin/tenants/{tenant.json()['id']}/keys").json()["key"]
    ids = []
    for i, directory in enumerate(adapter_dirs):
        files = {"adapter_config": ("adapter_config.json", (directory / "adapter_config.json").read_bytes()),
                 "adapter_model": ("adapter_model.safetensors", (directory / "adapter_model.safetensors").read_bytes())}
        resp = admin.post("/admin/adapters", data={"tenant_id": tenant.json()["id"], "name": f"ad{i}",
                                                   "visibility": "private"}, files=files)
        resp.raise_for_status()
        ids.append(resp.json()["id"])
    return key, ids


if __name__ == "__main__":
    sys.exit(main())
