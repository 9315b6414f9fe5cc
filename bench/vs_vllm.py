"""loramux vs vLLM (CPU build) on the same model files, adapters, prompts and lengths: base-only and mixed batches.

Workload: SmolLM2-135M-Instruct float32, greedy, exactly --new-tokens (64) new tokens per request with EOS
ignored (vLLM: SamplingParams(temperature=0, max_tokens=64, ignore_eos=True); loramux: min_tokens = max_tokens =
64), chat-templated prompts from bench/engine_throughput.py as token ids, distinct random r=16 PEFT adapters on
all 7 projections (q,k,v,o,gate,up,down), written once into a temp dir; both engines load the same directories
and the same model directory (loramux's converted safetensors).

vLLM runs from its bench-only virtualenv (bench/vllm_peer.py builds it; never a loramux dependency) as a worker
process (bench/vs_vllm_worker.py, VLLM_ENABLE_V1_MULTIPROCESSING=0, cwd outside the repo) that builds one
`vllm.LLM` and answers generate commands on stdin; loramux runs in this process. Both are pinned to the same
cores with the same thread count (taskset + VLLM_CPU_OMP_THREADS_BIND there, sched_setaffinity +
torch.set_num_threads here); when one runs the other is idle. Prefix caching is off on both (rounds repeat the
same prompts) and loramux's prompt-lookup speculation is off (vLLM runs without a speculator).

Every configuration is warmed up once on both sides (same batch, prompts and adapters, --warmup-tokens = 16
tokens per request); then rounds alternate which engine goes first (and so do configurations within a round);
medians are reported. The default run starts no round after the first that would end past --budget-s (300 s).
Every request must produce exactly --new-tokens tokens on both sides (else it fails loudly); the greedy outputs
of the two engines (first round) are compared token by token as a sanity check.

Configurations (U = distinct adapters in the batch, rows spread round-robin):
  default (~5 min on 2 cores): b8 base-only, b8 U=8, b32 base-only, b32 U=8 (2-3 rounds),
                               plus loramux int8 b8 U=8 when Settings has `quantization`
  --full:                      b8 and b32 x base-only, U=1, U=8, U=B (5 rounds, no budget), plus the int8 one
  --loramux-only --quick:      a short run without vLLM (b8 base-only, U=8 and int8 U=8, 4 new tokens, 1 round)
  --smoke:                     --quick on a tiny random model (bench/smoke.py), what the tests run
Ends with FIGURE lines: vs_vllm_base_b8 and vs_vllm_mixed_b8 (loramux / vLLM tok/s, base-only and U=8),
mixed_vs_base_b8 (loramux U=8 / loramux base-only), the same three for b32 (mixed: U=8), and int8_vs_fp32_b8
(loramux int8 / fp32, U=8 b8). Figures against vLLM are left out when vLLM is unavailable (the reason is
printed).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import vllm_peer
from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import describe_cpu, write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 16
ADAPTER_BYTES = 19_600_000  # one r=16 all-projection SmolLM2 adapter in float32 (~19.5 MB)
WORKER = Path(__file__).resolve().parent / "vs_vllm_worker.py"
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# --- machine -----------------------------------------------------------------------------------------------


def print_machine(threads: int, cpus: list[int]) -> None:
    print(describe_cpu())
    print(f"{threads} threads per engine on cores {cpus}")


# --- configurations ----------------------------------------------------------------------------------------


@dataclass
class Config:
    batch: int
    u: int | None  # distinct adapters; None = base-only
    variant: str = "fp32"  # loramux engine: fp32 or int8 (int8 runs loramux alone)
    lmx: list[float] = field(default_factory=list)  # loramux tok/s per round
    vllm: list[float] = field(default_factory=list)
    lmx_ids: list[list[int]] | None = None  # the first round's outputs, for the agreement check
    vllm_ids: list[list[int]] | None = None

    @property
    def name(self) -> str:
        return f"b{self.batch} {'base-only' if self.u is None else f'U={self.u}'}" + \
            ("" if self.variant == "fp32" else f" {self.variant}")

    @property
    def with_vllm(self) -> bool:
        return self.variant == "fp32"


def plan(args, has_quant: bool) -> list[Config]:
    configs = []
    for batch in args.batches:
        us = [None, 1, 8, batch] if args.full else [None, min(8, batch)]
        configs += [Config(batch, u) for u in dict.fromkeys(us)]
    if has_quant and 8 in args.batches:
        configs.append(Config(8, 8, "int8"))
    return configs


# --- loramux -----------------------------------------------------------------------------------------------


def make_engine(args, variant: str, num_adapters: int):
    from loramux.engine.engine import LLMEngine
    from loramux.settings import Settings

    extra = {"quantization": variant} if variant != "fp32" else {}
    settings = Settings(dtype="float32", device="cpu", max_lora_rank=RANK, prefix_caching=False,
                        speculative_tokens=0, adapter_pool_bytes=max(num_adapters, 1) * ADAPTER_BYTES + 64 * 2**20,
                        **extra)
    return LLMEngine.from_settings(settings, load_adapters=False)


def loramux_generate(engine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
                     ) -> tuple[float, list[list[int]]]:
    """One batch to completion: (seconds, token ids per request in prompt order)."""
    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    ids = [f"vs-{time.monotonic_ns()}-{j}" for j in range(len(prompts))]
    final: dict[str, list[int]] = {}
    start = time.perf_counter()
    for rid, prompt, adapter in zip(ids, prompts, adapters):
        engine.add_request(rid, prompt, params, adapter=adapter)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
    elapsed = time.perf_counter() - start
    return elapsed, [final.get(rid, []) for rid in ids]


# --- vLLM worker -------------------------------------------------------------------------------------------


class VLLMWorker:
    """bench/vs_vllm_worker.py in the vLLM venv: one LLM, JSON commands on stdin, answers on stdout."""

    def __init__(self, model_dir: Path, adapters: dict[str, Path], *, max_loras: int, threads: int,
                 cpus: list[int], kv_cache_gib: int, max_num_seqs: int, max_model_len: int, log_path: Path,
                 startup_timeout_s: float = 600):
        self.adapters = {name: str(Path(p).resolve()) for name, p in adapters.items()}
        # vllm_peer's server environment (venv, KV cache size, OpenMP bind list, no inherited OMP_NUM_THREADS),
        # with the engine in this one process instead of its multiprocess engine core.
        peer = vllm_peer.VLLMServer(model_dir, adapters, max_loras=max_loras, max_lora_rank=RANK,
                                    max_cpu_loras=max_loras, threads=threads, kv_cache_gib=kv_cache_gib, cpus=cpus)
        self.cpus = peer.cpus
        env = {**peer.environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
        python = vllm_peer.ensure_venv(peer.venv)
        cfg = {"model": str(Path(model_dir).resolve()), "max_loras": max_loras, "max_lora_rank": RANK,
               "max_cpu_loras": max_loras, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
               "prefix_caching": False}
        cmd = [str(python), "-P", str(WORKER), json.dumps(cfg)]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", ",".join(map(str, self.cpus)), *cmd]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, start_new_session=True, cwd=peer.venv)
        try:
            self.info = self._read(startup_timeout_s)
        except BaseException:
            self.close()
            raise
        if "error" in self.info or not self.info.get("ready"):
            self.close()
            raise vllm_peer.VLLMUnavailable(f"{self.info.get('error', self.info)}; log {log_path}:\n"
                                            f"{vllm_peer.log_tail(log_path)}")

    def _read(self, timeout_s: float | None = None) -> dict:
        if timeout_s is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            if not ready:
                raise vllm_peer.VLLMUnavailable(f"vLLM worker silent for {timeout_s:.0f} s; log {self.log_path}:\n"
                                                f"{vllm_peer.log_tail(self.log_path)}")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise vllm_peer.VLLMUnavailable(f"vLLM worker exited with {self.proc.returncode}; log {self.log_path}:\n"
                                            f"{vllm_peer.log_tail(self.log_path)}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
                 ) -> tuple[float, list[list[int]]]:
        used = {a for a in adapters if a is not None}
        self.proc.stdin.write(json.dumps({"cmd": "generate", "prompts": prompts, "adapters": adapters,
                                          "paths": {a: self.adapters[a] for a in used},
                                          "max_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"vLLM generate failed: {answer['error']} (log {self.log_path})")
        return answer["elapsed_s"], answer["token_ids"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # start_new_session: the worker leads its own group
            except ProcessLookupError:
                break
            time.sleep(1)
        self.proc.wait()
        self._log.close()


def worker_log_path() -> Path:
    """A log file for the worker that outlives the run (its path is printed with the results)."""
    fd, name = tempfile.mkstemp(prefix="vs-vllm-worker-", suffix=".log")
    os.close(fd)
    return Path(name)


# --- checks ------------------------------------------------------------------------------------------------


def check_counts(side: str, cfg: Config, outputs: list[list[int]], new_tokens: int) -> None:
    counts = [len(o) for o in outputs]
    if counts != [new_tokens] * cfg.batch:
        raise RuntimeError(f"{side} {cfg.name}: requests produced {counts} tokens, expected {new_tokens} each")


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    first = sum(x[:1] == y[:1] for x, y in zip(a, b))
    same = sum(x == y for x, y in zip(a, b))
    prefix = [len(os.path.commonprefix([x, y])) for x, y in zip(a, b)]
    return (f"first token agrees {first}/{len(a)}, identical {same}/{len(a)}, "
            f"mean common prefix {statistics.mean(prefix):.1f}/{len(a[0]) if a else 0} tokens")


# --- main --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the long sweep: U=1/8/B at b8 and b32, 5 rounds")
    ap.add_argument("--quick", action="store_true", help="short run: b8 only, 4 new tokens (2 in the warm-up), 1 round")
    ap.add_argument("--smoke", action="store_true", help=f"--quick on the tiny model: {SMOKE_HELP}")
    ap.add_argument("--loramux-only", action="store_true", help="do not start vLLM")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 8,32; --quick: 8)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3, --full 5, --quick 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64, --quick 4)")
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="tokens per request of the warm-up run of each configuration (default 16)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no round after the first that would end past this many seconds from start "
                         "(default 300; --full: 0 = no limit)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads (and cores) per engine (default: all allowed cores)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    args = ap.parse_args(argv)
    args.quick = args.quick or args.smoke
    args.batches = [int(b) for b in (args.batches or ("8" if args.quick else "8,32")).split(",")]
    args.rounds = args.rounds or (1 if args.quick else 5 if args.full else 3)
    args.new_tokens = args.new_tokens or (4 if args.quick else 64)
    args.warmup_tokens = min(args.warmup_tokens or (2 if args.quick else 16), args.new_tokens)
    args.budget_s = (0 if args.full else 300) if args.budget_s is None else args.budget_s
    return args


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # run the cleanup (the vLLM worker, the adapters' temp dir)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    import torch
    from engine_throughput import PROMPTS

    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.settings import Settings

    cpus = vllm_peer.pick_cpus(args.threads)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    has_quant = "quantization" in Settings.model_fields
    configs = plan(args, has_quant)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full" if args.full else "default"
    if args.smoke:
        tiny_model()
    print(f"loramux vs vLLM ({mode}): {model_label(args.smoke)} float32, greedy, {args.new_tokens} new tokens per "
          f"request (EOS ignored), r={RANK} on all 7 projections; one warm-up per configuration and engine "
          f"({args.warmup_tokens} tokens per request), then up to {args.rounds} round(s) (median), alternating which "
          f"engine goes first" + (f", none started that would end past {args.budget_s:g} s" if args.budget_s else "")
          + f"; {time.strftime('%Y-%m-%d %H:%M')}")
    print_machine(args.threads, cpus)
    print(f"configurations: {', '.join(c.name for c in configs)}")
    if not has_quant:
        print("int8: skipped (loramux Settings has no `quantization` field)")

    model_dir = resolve_model_dir(Settings().model, Path(Settings().cache_dir))
    model_cfg, _ = read_model_config(model_dir)
    num_adapters = max((c.u or 0) for c in configs)
    names = [f"ad{i}" for i in range(num_adapters)]
    tmp = Path(tempfile.mkdtemp(prefix="loramux-vs-vllm-"))
    worker, interrupted, r = None, None, 0
    try:
        log(f"writing {num_adapters} random r={RANK} adapters into {tmp}")
        paths = {name: write_peft_adapter(tmp / name, model_cfg, RANK, ALL, seed=i, b_std=0.02)
                 for i, name in enumerate(names)}

        vllm_reason = "--loramux-only" if args.loramux_only else None
        if vllm_reason is None:
            log("starting the vLLM worker (its own venv, in-process engine)")
            try:
                worker = VLLMWorker(model_dir, paths, max_loras=max(num_adapters, 1), threads=args.threads,
                                    cpus=cpus, kv_cache_gib=args.kv_cache_gib, max_num_seqs=64,
                                    max_model_len=4096, log_path=worker_log_path())
                i = worker.info
                log(f"vLLM {i['vllm']} (torch {i['torch']}) up in {i['startup_s']:.1f} s: max_num_seqs "
                    f"{i['max_num_seqs']}, max_num_batched_tokens {i['max_num_batched_tokens']}, compilation mode "
                    f"{i['compilation_mode']}, OpenMP bind {i['omp_bind']}, LD_PRELOAD {i['ld_preload'] or '-'}; "
                    f"log {worker.log_path}")
            except (vllm_peer.VLLMUnavailable, OSError, ValueError) as exc:
                vllm_reason = str(exc)
                print(f"vLLM unavailable, measuring loramux alone: {vllm_reason}", flush=True)

        log("building the loramux engine(s)")
        engines = {"fp32": make_engine(args, "fp32", num_adapters)}
        for name, path in paths.items():
            engines["fp32"].load_adapter_dir(path, name)
        if any(c.variant == "int8" for c in configs):
            try:
                engines["int8"] = make_engine(args, "int8", num_adapters)
                for name, path in paths.items():
                    engines["int8"].load_adapter_dir(path, name)
            except Exception as exc:  # noqa: BLE001 - a feature in progress elsewhere must not sink the run
                print(f"int8: skipped (the int8 engine failed: {type(exc).__name__}: {exc})", flush=True)
                configs = [c for c in configs if c.variant != "int8"]
        chats = [engines["fp32"].encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        lens = [len(c) for c in chats]
        print(f"prompts: {len(chats)} chat-templated prompts, {min(lens)}-{max(lens)} tokens, cycled to fill the "
              f"batch; loramux threads {torch.get_num_threads()}, vLLM threads {args.threads if worker else '-'}")

        def inputs(cfg: Config):
            prompts = [chats[j % len(chats)] for j in range(cfg.batch)]
            adapters = [None if cfg.u is None else names[j % cfg.u] for j in range(cfg.batch)]
            return prompts, adapters

        def run(side: str, cfg: Config, new_tokens: int) -> tuple[float, list[list[int]]]:
            prompts, adapters = inputs(cfg)
            if side == "loramux":
                elapsed, out = loramux_generate(engines[cfg.variant], prompts, adapters, new_tokens)
            else:
                elapsed, out = worker.generate(prompts, adapters, new_tokens)
            check_counts(side, cfg, out, new_tokens)
            return cfg.batch * new_tokens / elapsed, out

        def sides(cfg: Config, r: int) -> list[str]:
            """Who goes first alternates from round to round and from configuration to configuration."""
            order = ["loramux", "vllm"] if worker and cfg.with_vllm else ["loramux"]
            return order if (r + configs.index(cfg)) % 2 == 0 else order[::-1]

        for cfg in configs:
            for side in sides(cfg, 0):
                tps, _ = run(side, cfg, args.warmup_tokens)
                log(f"warm-up {cfg.name:16s} {side:8s} {tps:7.1f} tok/s ({args.warmup_tokens} tokens per request)")
        started = time.perf_counter()
        try:
            for r in range(args.rounds):
                for cfg in configs:
                    for side in sides(cfg, r):
                        tps, out = run(side, cfg, args.new_tokens)
                        (cfg.lmx if side == "loramux" else cfg.vllm).append(tps)
                        if r == 0:
                            setattr(cfg, "lmx_ids" if side == "loramux" else "vllm_ids", out)
                        log(f"round {r + 1}/{args.rounds} {cfg.name:16s} {side:8s} {tps:7.1f} tok/s")
                per_round = (time.perf_counter() - started) / (r + 1)
                if args.budget_s and r + 1 < args.rounds and time.perf_counter() - T0 + per_round > args.budget_s:
                    log(f"stopping after {r + 1} of {args.rounds} rounds: another ({per_round:.0f} s a round) would "
                        f"end past --budget-s {args.budget_s:g}")
                    break
        except (KeyboardInterrupt, SystemExit) as exc:  # report the rounds done so far, then exit non-zero
            interrupted = exc
            log(f"interrupted ({type(exc).__name__} {getattr(exc, 'code', '') or ''}) in round {r + 1}")
    finally:
        if worker is not None:
            worker.close()
        shutil.rmtree(tmp, ignore_errors=True)

    complete = all(c.lmx and (c.vllm or not (worker and c.with_vllm)) for c in configs)
    if interrupted is not None and not complete:
        print("interrupted before every configuration had a timed round on each engine: no figures; done so far: "
              + "; ".join(f"{c.name} loramux {c.lmx} vLLM {c.vllm}" for c in configs), flush=True)
        raise interrupted
    report(args, configs, worker is not None, vllm_reason, cpus, worker.log_path if worker else None)
    if interrupted is not None:
        print(f"(interrupted in round {r + 1}: the medians above are over the rounds completed)", flush=True)
        return interrupted.code if isinstance(interrupted, SystemExit) else 130
    return 0


def vllm_warnings(log_path: Path) -> list[str]:
    """vLLM's distinct WARNING messages (without the pid / timestamp prefix), in first-seen order."""
    seen: dict[str, None] = {}
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if " WARNING " in line and "]" in line:
            seen.setdefault(line.split("]", 2)[-1].strip()[:200], None)
    return list(seen)


def report(args, configs: list[Config], with_vllm: bool, vllm_reason: str | None, cpus: list[int],
           vllm_log: Path | None) -> None:
    med = {c.name: (statistics.median(c.lmx), statistics.median(c.vllm) if c.vllm else None) for c in configs}

    def spread(values: list[float]) -> str:
        return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else ""

    print(f"\n{'config':18s}{'loramux tok/s':>15s}{'(range)':>11s}{'vLLM tok/s':>13s}{'(range)':>11s}"
          f"{'loramux/vLLM':>14s}")
    for c in configs:
        lmx, vl = med[c.name]
        ratio = f"{lmx / vl:14.2f}" if vl else f"{'-':>14s}"
        vls = f"{vl:13.1f}{spread(c.vllm):>11s}" if vl else f"{'-':>13s}{'':>11s}"
        print(f"{c.name:18s}{lmx:15.1f}{spread(c.lmx):>11s}{vls}{ratio}")
    for c in configs:
        if c.u is None and c.vllm_ids is not None:
            print(f"greedy agreement, {c.name} (loramux vs vLLM, fp32): {agreement(c.lmx_ids, c.vllm_ids)}")
    for c in configs:
        if c.u is not None and c.vllm_ids is not None:
            print(f"greedy agreement, {c.name} (loramux vs vLLM, fp32): {agreement(c.lmx_ids, c.vllm_ids)}")
    if vllm_log is not None:
        warnings = vllm_warnings(vllm_log)
        print(f"vLLM log {vllm_log}: {len(warnings)} distinct warning(s)")
        for w in warnings:
            print(f"  vLLM warning: {w}")
    if not with_vllm:
        print(f"figures vs vLLM not printed: {vllm_reason}")
    print(f"total runtime {time.perf_counter() - T0:.0f} s")
    print_machine(args.threads, cpus)

    figures: list[tuple[str, float]] = []
    for batch in args.batches:
        base, mixed = med.get(f"b{batch} base-only"), med.get(f"b{batch} U={min(8, batch)}")
        if base and mixed:
            if with_vllm:
                figures += [(f"vs_vllm_base_b{batch}", base[0] / base[1]),
                            (f"vs_vllm_mixed_b{batch}", mixed[0] / mixed[1])]
            figures.append((f"mixed_vs_base_b{batch}", mixed[0] / base[0]))
    if "b8 U=8 int8" in med and "b8 U=8" in med:
        figures.append(("int8_vs_fp32_b8", med["b8 U=8 int8"][0] / med["b8 U=8"][0]))
    for name, value in figures:
        print(f"FIGURE {name} {value:.2f}")


if __name__ == "__main__":
    sys.exit(main())
