"""Serving under load: an open-loop Poisson load over HTTP on the embedded SmolLM2, mixed adapters, tiers,
prompt and output lengths; client-side TTFT, inter-token latency, throughput and goodput.

Stack, all in this process: `loramux` Services with default settings (SQLite registry and file store in a
temp dir, embedded SmolLM2-135M-Instruct) and the real uvicorn server on 127.0.0.1. One tenant owns 4
public random PEFT adapters (ranks 8 and 16 on a few projections); one tenant per tier (free, standard,
premium) sends the load with its own key. The tiers keep their seeded limits: requests refused with 429
are counted on their own line, not retried, and count against goodput.

Load: open loop. Arrival times follow a Poisson process at `--rate` requests/s, fixed before the run from
`--seed` and independent of completions (a slow server does not slow the arrivals: queueing shows up as
TTFT). Each request draws, from seeded distributions: a tier, a model (the base or one of the adapters), a
prompt (short / medium / long, from a fixed set), max_tokens (16..128, `ignore_eos` so every request
generates exactly that many) and the route (/v1/chat/completions or /v1/completions, streamed).
Before the measured window, one request per model warms the adapters into host RAM and the engine.

Per request the client measures TTFT (send -> first chunk with text), the gaps between text chunks
(inter-token latency; a chunk carries one token, except when the detokeniser holds back an incomplete
character, which then arrives with the next one), end-to-end time, output tokens (the final chunk's
usage) and how it ended (429, 503, client timeout, a finish other than `length` count as failures).
Goodput = requests per second that finished and met the SLO (TTFT <= --slo-ttft-ms and the request's
own inter-token p99 <= --slo-itl-ms). Throughput = output tokens of all requests / wall time (start of
the arrival window -> last completion, at least --duration). Ends with FIGURE ttft_p50_ms and
FIGURE throughput_tok_s.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TIERS = ("free", "standard", "premium")
TIER_WEIGHTS = (0.3, 0.4, 0.3)
# (name, rank, targets): a mix of ranks and target sets.
ADAPTERS = (("support-r8", 8, ["q_proj", "v_proj"]),
            ("legal-r16", 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("code-r8", 8, ["q_proj", "v_proj", "down_proj"]),
            ("chat-r16", 16, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]))
BASE_WEIGHT = 0.2  # share of requests to the base model; the rest spread evenly over the adapters
PROMPT_KINDS = ("short", "medium", "long")
PROMPT_WEIGHTS = (0.5, 0.3, 0.2)
MAX_TOKENS = (16, 32, 64, 128)
MAX_TOKEN_WEIGHTS = (0.25, 0.3, 0.3, 0.15)
CHAT_SHARE = 0.5
DEFAULT_RATE = 0.4  # sustainable on the shared 2-vCPU VM: 0.5 is near its knee, 0.65 queues (see docs/performance.md)

_FACTS = [
    "The sky looks blue because air molecules scatter short wavelengths more than long ones.",
    "At sunset light crosses much more air, so most of the blue is scattered away before it reaches us.",
    "Rivers carry sediment from mountains to the sea and build deltas where they slow down.",
    "A balanced diet includes vegetables, fruit, whole grains, protein and enough water.",
    "Compilers turn source code into machine code through parsing, analysis, optimisation and code generation.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside chloroplasts.",
    "The printing press made books cheaper and helped ideas spread quickly across Europe.",
    "Bees communicate the direction and distance of flowers with a waggle dance.",
    "Glaciers move slowly downhill under their own weight and carve U-shaped valleys.",
    "A hash table finds items quickly by turning each key into an index in an array.",
]
SHORT = ["What is the capital of France?", "Name three fruits.", "Say hello in Spanish.", "What is 12 times 12?",
         "Give me a synonym for happy.", "Who wrote Hamlet?", "What colour is grass?", "Define gravity briefly."]
MEDIUM_Q = ["Explain this to a ten-year-old.", "Summarise the main idea in one sentence.",
            "Write a short poem inspired by it.", "List two questions a student might ask about it."]
LONG_Q = ["Summarise these notes as a bulleted list.", "Write a short quiz based on these notes.",
          "Which of these facts is the most surprising, and why?", "Turn these notes into a short story."]


def make_prompts(seed: int) -> dict[str, list[str]]:
    """A fixed, seeded set of prompts per length class (about 10, 60 and 250 tokens)."""
    rng = random.Random(seed)
    medium = [" ".join(rng.sample(_FACTS, 2)) + " " + q for q in MEDIUM_Q]
    long = []
    for q in LONG_Q:
        facts = [rng.choice(_FACTS) for _ in range(12)]
        long.append("Notes:\n" + "\n".join(f"- {f}" for f in facts) + "\n\n" + q)
    return {"short": SHORT, "medium": medium, "long": long}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class Planned:
    at: float  # seconds after the start of the window
    tier: str
    model: str
    prompt_kind: str
    prompt: str
    max_tokens: int
    chat: bool
    seed: int


@dataclass
class Result:
    plan: Planned
    status: str = "ok"  # ok, or why not: rate_limited (429), overloaded (503), http_<code>, timeout, ...
    sent: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of every text chunk
    end: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    server: dict = field(default_factory=dict)  # the `loramux` extension of the final chunk
    detail: str = ""

    @property
    def gaps_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def itl_p99_s(self) -> float:
        return pct(self.gaps_s, 99) if len(self.chunk_times) > 1 else 0.0


class Stack:
    """Services + uvicorn on 127.0.0.1, tenants per tier with keys, public adapters of tenant `acme`."""

    def __init__(self, tmp: Path, seed: int):
        import uvicorn

        from conftest import write_peft_adapter
        from loramux.server.app import create_app
        from loramux.services import Services
        from loramux.settings import Settings

        t0 = time.perf_counter()
        self.services = Services.from_settings(Settings(data_dir=tmp / "data"))
        self.load_s = time.perf_counter() - t0
        self.settings = self.services.settings
        tenancy, registry = self.services.tenancy, self.services.registry
        tenancy.create_tenant("acme", tier="standard")
        acme = tenancy.tenant("acme").id
        cfg = self.services.engine.engine.model.config
        self.adapters = []
        for i, (name, rank, targets) in enumerate(ADAPTERS):
            path = write_peft_adapter(tmp / "src" / name, cfg, rank, targets, seed=seed + i)
            files = {f: path / f for f in ("adapter_config.json", "adapter_model.safetensors")}
            registry.register(acme, name, files, visibility="public")
            self.adapters.append(f"acme/{name}")
        self.keys = {}
        for tier in TIERS:
            tenancy.create_tenant(f"{tier}-co", tier=tier)
            self.keys[tier] = tenancy.create_key(f"{tier}-co")[1]
        self.tiers = {t.name: t for t in tenancy.tiers()}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(lambda: self.services), host="127.0.0.1",
                                                    port=self.port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.services.shutdown()


def plan_load(args, models: list[str]) -> list[Planned]:
    rng = random.Random(args.seed)
    prompts = make_prompts(args.seed)
    model_weights = [BASE_WEIGHT] + [(1 - BASE_WEIGHT) / (len(models) - 1)] * (len(models) - 1)
    plans, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            return plans
        kind = rng.choices(PROMPT_KINDS, PROMPT_WEIGHTS)[0]
        tier, model = rng.choices(TIERS, TIER_WEIGHTS)[0], rng.choices(models, model_weights)[0]
        plans.append(Planned(at=t, tier=tier, model=model, prompt_kind=kind, prompt=rng.choice(prompts[kind]),
                             max_tokens=rng.choices(MAX_TOKENS, MAX_TOKEN_WEIGHTS)[0],
                             chat=rng.random() < CHAT_SHARE, seed=rng.randrange(2**31)))


async def send(client, stack: Stack, plan: Planned, timeout_s: float) -> Result:
    """One streamed request; every outcome becomes a Result (never raises)."""
    import httpx

    result = Result(plan)
    body = {"model": plan.model, "max_tokens": plan.max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.8, "seed": plan.seed}
    if plan.chat:
        body["messages"] = [{"role": "user", "content": plan.prompt}]
        url = f"{stack.url}/v1/chat/completions"
    else:
        body["prompt"] = plan.prompt
        url = f"{stack.url}/v1/completions"
    headers = {"Authorization": f"Bearer {stack.keys[plan.tier]}"}
    result.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    result.status = {429: "rate_limited", 503: "overloaded"}.get(resp.status_code,
                                                                                  f"http_{resp.status_code}")
                    result.detail = resp.text[:200]
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.status, result.detail = "stream_error", str(event["error"])[:200]
                        continue
                    for choice in event.get("choices") or []:
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            now = time.perf_counter()
                            if result.ttft_s is None:
                                result.ttft_s = now - result.sent
                            result.chunk_times.append(now)
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                    if event.get("usage"):
                        result.output_tokens = event["usage"]["completion_tokens"]
                    if event.get("loramux"):
                        result.server = event["loramux"]
    except TimeoutError:
        result.status = "client_timeout"
    except httpx.HTTPError as exc:
        result.status, result.detail = "connection_error", f"{type(exc).__name__}: {exc}"[:200]
    result.end = time.perf_counter()
    if result.status == "ok" and result.finish_reason != "length":
        # ignore_eos: every request should run to max_tokens; anything else (timeout, error) is a failure
        result.status = f"finish_{result.finish_reason}"
    return result


async def warm_up(client, stack: Stack, models: list[str]) -> None:
    prompts = make_prompts(0)
    for model in models:
        plan = Planned(0, "premium", model, "short", prompts["short"][0], 8, False, 0)
        r = await send(client, stack, plan, 120)
        if r.status != "ok":
            raise RuntimeError(f"warm-up request to {model} failed: {r.status} {r.detail}")


async def run_load(stack: Stack, plans: list[Planned], timeout_s: float) -> tuple[list[Result], float, float]:
    """Fire `plans` at their arrival times (open loop), wait for all; returns results, start, wall end."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), limits=limits) as client:
        await warm_up(client, stack, [stack.model_id, *stack.adapters])
        tasks = []
        start = time.perf_counter()
        for plan in plans:
            delay = start + plan.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, stack, plan, timeout_s)))
        results = await asyncio.gather(*tasks)
    end = max([r.end or start for r in results] + [start + plans[-1].at if plans else start])
    return results, start, end


def scrape_metrics(url: str) -> dict:
    """The server's own view from /metrics: outcomes and histogram percentiles (bucket upper bounds)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"outcomes": {}, "hist": {}}
    for fam in text_string_to_metric_families(text):
        if fam.name == "loramux_requests":
            for s in fam.samples:
                if s.name.endswith("_total") and s.value:
                    key = s.labels.get("outcome", "?")
                    out["outcomes"][key] = out["outcomes"].get(key, 0) + int(s.value)
        elif fam.type == "histogram" and fam.name in ("loramux_queue_seconds", "loramux_ttft_seconds",
                                                       "loramux_inter_token_seconds", "loramux_e2e_seconds"):
            buckets: dict[float, float] = {}
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0) + s.value
            out["hist"][fam.name] = sorted(buckets.items())
    return out


def hist_pct(buckets: list[tuple[float, float]], q: float) -> str:
    if not buckets or buckets[-1][1] == 0:
        return "-"
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q / 100 * total:
            return f"<= {le * 1000:g} ms" if math.isfinite(le) else "> max bucket"
    return "-"


def fmt_ms(value_s: float) -> str:
    return "-" if value_s is None or math.isnan(value_s) else f"{value_s * 1000:.0f}"


def report(args, stack: Stack, plans: list[Planned], results: list[Result], wall_s: float, metrics: dict) -> None:
    ok = [r for r in results if r.status == "ok"]
    reasons: dict[str, int] = {}
    for r in results:
        if r.status != "ok":
            reasons[r.status] = reasons.get(r.status, 0) + 1
    slo_ttft, slo_itl = args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft and r.itl_p99_s <= slo_itl]
    good_ids = {id(r) for r in good}
    tokens = sum(r.output_tokens for r in results)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    e2e = [r.end - r.sent for r in ok]

    print(f"\nOpen-loop Poisson load at {args.rate:g} requests/s for {args.duration:g} s "
          f"(arrivals fixed by seed {args.seed}, independent of completions); wall time {wall_s:.1f} s "
          "(start of the window -> last completion, at least the window)")
    print(f"requests: sent {len(results)}, ok {len(ok)}, failed {len(results) - len(ok)}"
          + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")" if reasons else ""))
    for r in results:
        if r.status != "ok" and r.detail:
            print(f"  e.g. {r.status}: {r.detail}")
            break
    print(f"\n{'':<10}{'n':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'e2e p50':>9}"
          f"{'SLO met':>9}   (ms; ok requests)")
    groups = [("all", ok)] + [(t, [r for r in ok if r.plan.tier == t]) for t in TIERS]
    for name, rs in groups:
        t = [r.ttft_s for r in rs if r.ttft_s is not None]
        g = [x for r in rs for x in r.gaps_s]
        met = sum(1 for r in rs if id(r) in good_ids)
        print(f"{name:<10}{len(rs):>5}{fmt_ms(pct(t, 50)):>10}{fmt_ms(pct(t, 99)):>10}{fmt_ms(pct(g, 50)):>9}"
              f"{fmt_ms(pct(g, 99)):>9}{fmt_ms(pct([r.end - r.sent for r in rs], 50)):>9}"
              f"{(f'{100 * met / len(rs):.0f} %' if rs else '-'):>9}")
    print("by prompt length, TTFT p50 (ms): " + ", ".join(
        f"{k} {fmt_ms(pct([r.ttft_s for r in ok if r.plan.prompt_kind == k], 50))}" for k in PROMPT_KINDS))
    print("by model, TTFT p50 (ms): " + ", ".join(
        f"{m} {fmt_ms(pct([r.ttft_s for r in ok if r.plan.model == m], 50))}"
        for m in [stack.model_id, *stack.adapters]))
    queue = [r.server["queue_ms"] / 1000 for r in ok if r.server.get("queue_ms") is not None]
    sttft = [r.server["ttft_ms"] / 1000 for r in ok if r.server.get("ttft_ms") is not None]
    print(f"server's timings (loramux field): queue p50 {fmt_ms(pct(queue, 50))} / p99 {fmt_ms(pct(queue, 99))} ms, "
          f"TTFT p50 {fmt_ms(pct(sttft, 50))} / p99 {fmt_ms(pct(sttft, 99))} ms")
    if metrics:
        hist = metrics["hist"]
        print("server /metrics: outcomes " + ", ".join(f"{k} {v}" for k, v in sorted(metrics["outcomes"].items()))
              + f"; TTFT p50 {hist_pct(hist.get('loramux_ttft_seconds', []), 50)}, "
              f"p99 {hist_pct(hist.get('loramux_ttft_seconds', []), 99)}; inter-token p99 "
              f"{hist_pct(hist.get('loramux_inter_token_seconds', []), 99)} (histogram buckets, warm-up included)")
    print(f"\noutput tokens {tokens}; throughput {tokens / wall_s:.1f} tok/s; "
          f"request throughput {len(ok) / wall_s:.2f} req/s (ok) of {len(plans) / args.duration:.2f} offered")
    print(f"all ok requests: TTFT p50 {fmt_ms(pct(ttfts, 50))} ms, p99 {fmt_ms(pct(ttfts, 99))} ms; "
          f"inter-token p50 {fmt_ms(pct(gaps, 50))} ms, p99 {fmt_ms(pct(gaps, 99))} ms; "
          f"e2e p50 {fmt_ms(pct(e2e, 50))} ms")
    print(f"goodput {len(good) / wall_s:.2f} req/s ({len(good)} of {len(results)} requests met the SLO: "
          f"TTFT <= {args.slo_ttft_ms:g} ms and own inter-token p99 <= {args.slo_itl_ms:g} ms)")
    late = sum(1 for r in ok if r.ttft_s is None or r.ttft_s > slo_ttft)
    jerky = sum(1 for r in ok if r.itl_p99_s > slo_itl)
    print(f"SLO misses among ok requests: TTFT {late}, inter-token {jerky} (a request can miss both)")
    print(f"\nFIGURE ttft_p50_ms {pct(ttfts, 50) * 1000:.0f}" if ttfts else "\nFIGURE ttft_p50_ms nan")
    print(f"FIGURE throughput_tok_s {tokens / wall_s:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE, help="mean arrivals per second (Poisson)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals after the warm-up")
    ap.add_argument("--quick", action="store_true", help="smoke run: --duration 5 --rate 1 (4 requests at seed 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=500.0)
    ap.add_argument("--timeout", type=float, default=180.0, help="client-side limit per request, seconds")
    ap.add_argument("--dump", type=Path, help="write one JSON line per request (plan, status, timings) here")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    if args.quick:
        args.duration, args.rate = 5.0, 1.0

    import torch

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), args.seed)
        from loramux.services import base_model_id

        stack.model_id = base_model_id(stack.settings.model)
        s = stack.settings
        limits = "; ".join(f"{t.name}: priority {t.priority}, {t.requests_per_min or 'unlimited'} req/min, "
                           f"{t.tokens_per_min or 'unlimited'} tok/min, {t.max_concurrent or 'unlimited'} concurrent"
                           for t in stack.tiers.values() if t.name in TIERS)
        runner = stack.services.engine.engine.runner
        print(f"{stack.model_id} {str(runner.kv.k.dtype).removeprefix('torch.')} on {runner.device}, "
              f"{args.threads} torch threads, default settings "
              f"(max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}, max_loras "
              f"{s.max_loras}, max_lora_rank {s.max_lora_rank}); model load {stack.load_s:.1f} s")
        print("adapters (public, tenant acme): " + ", ".join(f"{n} r{r} {'+'.join(t)}" for n, r, t in ADAPTERS))
        print(f"tiers (seeded limits kept; 429s are counted, not retried): {limits}")
        print(f"mix: tiers {dict(zip(TIERS, TIER_WEIGHTS))}; base {BASE_WEIGHT:.0%}, the rest spread over the "
              f"adapters; prompts {dict(zip(PROMPT_KINDS, PROMPT_WEIGHTS))}; max_tokens "
              f"{dict(zip(MAX_TOKENS, MAX_TOKEN_WEIGHTS))} (ignore_eos); chat {CHAT_SHARE:.0%} / completions "
              f"{1 - CHAT_SHARE:.0%}; all streamed")
        plans = plan_load(args, [stack.model_id, *stack.adapters])
        try:
            results, start, end = asyncio.run(run_load(stack, plans, args.timeout))
            try:
                metrics = scrape_metrics(stack.url)
            except Exception as exc:  # noqa: BLE001 - the server's view is a bonus
                print(f"(could not read /metrics: {exc})")
                metrics = {}
            report(args, stack, plans, results, max(end - start, args.duration), metrics)
            if args.dump:
                with open(args.dump, "w") as f:
                    for r in results:
                        f.write(json.dumps({**r.plan.__dict__, "status": r.status, "detail": r.detail,
                                            "sent_s": r.sent - start, "ttft_s": r.ttft_s,
                                            "chunk_s": [t - r.sent for t in r.chunk_times],
                                            "e2e_s": None if r.end is None else r.end - r.sent,
                                            "output_tokens": r.output_tokens, "finish_reason": r.finish_reason,
                                            "server": r.server}) + "\n")
        finally:
            stack.close()
    print(f"(whole run {time.perf_counter() - t_start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
