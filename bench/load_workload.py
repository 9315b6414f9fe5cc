"""The workload of bench/serve_load.py: seeded mixed requests, one streamed HTTP request, two load drivers and
the summary of a window.

Workload: each request draws, from seeded distributions, a tier (free / standard / premium, each with its own
API key where the server has keys), a model (the base, or one of 4 LoRA adapters of ranks 8 and 16 on a few
projections), a prompt (short / medium / long, about 10, 60 and 250 tokens, from a fixed set), max_tokens (16..128,
`ignore_eos`, so every request generates exactly that many) and the route (/v1/chat/completions or
/v1/completions). Every request is streamed with usage (`stream_options.include_usage`), temperature 0.8 and its own
seed. An `Endpoint` maps the workload's model names ("base", "support-r8", ...) to the names one server knows them
by, so that the same plan drives loramux and vLLM.

Drivers:
  open loop    arrival times follow a Poisson process at a given rate, fixed before the run by the seed and
               independent of completions: a slow server does not slow the arrivals, so queueing shows up as TTFT
               (and, past saturation, as failures). The same seed gives the same request sequence at every rate,
               only compressed in time (exponential gaps scale with 1 / rate).
  closed loop  C clients, each sending its next request (from its own seeded stream) when the previous one ends,
               for a warm-up and then a measured window; requests still running at the end are cut.

Per request the client measures TTFT (send -> first chunk with text), the gaps between text chunks (inter-token
latency, ITL: a chunk carries one token, except when the detokeniser holds back an incomplete character, which then
arrives with the next one; these requests are seeded with temperature > 0, which keeps loramux's speculative
decoding off), end-to-end time, output tokens (the usage chunk) and how it ended. A request is `ok` only when it
returned 200, streamed without error, finished with `length` and its usage says exactly max_tokens completion tokens
(429, 503, client timeouts and short outputs are failures, the same rule for every engine).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from loramux.testing import percentile

TIERS = ("free", "standard", "premium")
TIER_WEIGHTS = (0.3, 0.4, 0.3)
BASE = "base"  # the workload's name for the base model; Endpoint.models maps it to the served name
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
TEMPERATURE = 0.8

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


def workload_models() -> list[str]:
    return [BASE, *(name for name, _, _ in ADAPTERS)]


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # time to first token, at most
    itl_s: float  # the request's own inter-token p99, at most


@dataclass(frozen=True)
class Endpoint:
    """One server under test: its base URL, API key per tier (None: no Authorization header) and model names."""

    engine: str
    url: str
    models: dict[str, str]  # workload model ("base" or an adapter name) -> the name this server serves it as
    keys: dict[str, str] | None = None

    def headers(self, tier: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tier]}"} if self.keys else {}


@dataclass
class Planned:
    at: float  # seconds after the start of the window (open loop) or of the run (closed loop)
    tier: str
    model: str  # a workload model name
    prompt_kind: str
    prompt: str
    max_tokens: int
    chat: bool
    seed: int


@dataclass
class Result:
    plan: Planned
    status: str = "ok"  # ok, or why not: rate_limited (429), overloaded (503), http_<code>, client_timeout, cut, ...
    sent: float = 0.0  # perf_counter at send
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of every text chunk
    end: float | None = None
    output_tokens: int = 0  # from the usage chunk
    finish_reason: str | None = None
    server: dict = field(default_factory=dict)  # loramux's `loramux` extension of the final chunk (absent elsewhere)
    detail: str = ""

    @property
    def gaps_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def itl_p99_s(self) -> float:
        return percentile(self.gaps_s, 99) if len(self.chunk_times) > 1 else 0.0

    @property
    def tokens(self) -> int:
        """Output tokens: the usage count, or the text chunks seen when no usage arrived (cut, timed out)."""
        return self.output_tokens or len(self.chunk_times)

    def meets(self, slo: SLO) -> bool:
        return self.status == "ok" and self.ttft_s is not None and self.ttft_s <= slo.ttft_s \
            and self.itl_p99_s <= slo.itl_s


# --- planning --------------------------------------------------------------------------------------------------

def draw(rng: random.Random, prompts: dict[str, list[str]], models: list[str], at: float) -> Planned:
    """One request's attributes from `rng` (the order of the draws is part of the seeded workload)."""
    model_weights = [BASE_WEIGHT] + [(1 - BASE_WEIGHT) / (len(models) - 1)] * (len(models) - 1)
    kind = rng.choices(PROMPT_KINDS, PROMPT_WEIGHTS)[0]
    tier, model = rng.choices(TIERS, TIER_WEIGHTS)[0], rng.choices(models, model_weights)[0]
    return Planned(at=at, tier=tier, model=model, prompt_kind=kind, prompt=rng.choice(prompts[kind]),
                   max_tokens=rng.choices(MAX_TOKENS, MAX_TOKEN_WEIGHTS)[0], chat=rng.random() < CHAT_SHARE,
                   seed=rng.randrange(2**31))


def plan_open(rate: float, duration_s: float, seed: int) -> list[Planned]:
    """Poisson arrivals at `rate` per second over `duration_s`, fixed by `seed`."""
    rng, prompts, models = random.Random(seed), make_prompts(seed), workload_models()
    plans, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return plans
        plans.append(draw(rng, prompts, models, t))


def request_body(plan: Planned, served_model: str) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request."""
    body = {"model": served_model, "max_tokens": plan.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": TEMPERATURE,
            "seed": plan.seed}
    if plan.chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": plan.prompt}]}
    return "/v1/completions", {**body, "prompt": plan.prompt}


# --- one request -----------------------------------------------------------------------------------------------

def take_event(result: Result, event: dict, now: float) -> None:
    """Fold one server-sent event into `result`."""
    if "error" in event:
        result.status, result.detail = "stream_error", str(event["error"])[:200]
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            if result.ttft_s is None:
                result.ttft_s = now - result.sent
            result.chunk_times.append(now)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    if event.get("usage"):
        result.output_tokens = event["usage"].get("completion_tokens") or 0
    if event.get("loramux"):
        result.server = event["loramux"]


def final_status(result: Result) -> str:
    """`ok` only for a complete output: finish `length` and exactly max_tokens completion tokens (ignore_eos)."""
    if result.status != "ok":
        return result.status
    if result.finish_reason != "length":
        return f"finish_{result.finish_reason}"
    if result.output_tokens != result.plan.max_tokens:
        return "no_usage" if not result.output_tokens else "wrong_token_count"
    return "ok"


async def send(client, ep: Endpoint, plan: Planned, timeout_s: float, result: Result | None = None) -> Result:
    """One streamed request; every outcome becomes a Result (never raises, except when cancelled: then the
    Result passed in says `cut`)."""
    import httpx

    result = result or Result(plan)
    path, body = request_body(plan, ep.models[plan.model])
    result.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", ep.url + path, json=body, headers=ep.headers(plan.tier)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    result.status = {429: "rate_limited", 503: "overloaded"}.get(resp.status_code,
                                                                                  f"http_{resp.status_code}")
                    result.detail = resp.text[:200]
                else:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            take_event(result, json.loads(line[6:]), time.perf_counter())
    except TimeoutError:
        result.status = "client_timeout"
    except httpx.HTTPError as exc:
        result.status, result.detail = "connection_error", f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        result.status, result.end = "cut", time.perf_counter()
        raise
    result.end = time.perf_counter()
    result.status = final_status(result)
    return result


def make_client(timeout_s: float):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30), limits=limits)


async def warm_up(client, ep: Endpoint, timeout_s: float = 300) -> None:
    """One short request per model and route (adapters into memory, first calls paid), then all models and prompt
    lengths at once (batched steps with mixed adapters and a long prefill); raises if one fails."""
    prompts = make_prompts(0)
    seq = [Planned(0, "premium", m, "short", prompts["short"][0], 8, chat, i)
           for i, m in enumerate(workload_models()) for chat in (False, True)]
    burst = [Planned(0, "premium", m, kind, prompts[kind][i % len(prompts[kind])], 16, i % 2 == 0, 100 + i)
             for i, (m, kind) in enumerate((m, k) for m in workload_models() for k in PROMPT_KINDS)]
    results = [await send(client, ep, plan, timeout_s) for plan in seq]
    results += await asyncio.gather(*(send(client, ep, plan, timeout_s) for plan in burst))
    bad = next((r for r in results if r.status != "ok"), None)
    if bad is not None:
        raise RuntimeError(f"{ep.engine}: warm-up request to {bad.plan.model} failed: {bad.status} {bad.detail}")


# --- drivers ---------------------------------------------------------------------------------------------------

async def run_open(client, ep: Endpoint, plans: list[Planned], duration_s: float,
                   timeout_s: float) -> tuple[list[Result], float]:
    """Fire `plans` at their arrival times (open loop) and wait for all; returns the results and the wall time
    (start of the window -> last completion, at least the window)."""
    tasks = []
    start = time.perf_counter()
    for plan in plans:
        delay = start + plan.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(client, ep, plan, timeout_s)))
    results = list(await asyncio.gather(*tasks))
    end = max([r.end or start for r in results], default=start)
    return results, max(end - start, duration_s)


async def run_closed(client, ep: Endpoint, clients: int, warmup_s: float, duration_s: float, seed: int,
                     timeout_s: float) -> tuple[list[Result], float, float]:
    """`clients` concurrent clients, each sending its next request when the previous one ends; client c starts
    c / clients of a second-or-so after the first (so that equal requests do not run in lockstep), the window
    [lo, hi] follows `warmup_s`. Returns all results (those running at `hi` are `cut`), lo and hi."""
    prompts, models = make_prompts(seed), workload_models()
    t0 = time.perf_counter()
    lo, hi = t0 + warmup_s, t0 + warmup_s + duration_s
    results: list[Result] = []

    async def client_loop(c: int) -> None:
        rng = random.Random(seed * 1_000_003 + c)
        await asyncio.sleep(min(2.0, warmup_s / 2) * c / clients)
        while time.perf_counter() < hi:
            r = Result(draw(rng, prompts, models, time.perf_counter() - t0))
            results.append(r)
            await send(client, ep, r.plan, timeout_s, r)
            if r.status != "ok":
                await asyncio.sleep(0.5)  # a refusal comes back at once: no busy loop of failures

    tasks = [asyncio.create_task(client_loop(c)) for c in range(clients)]
    await asyncio.sleep(max(0.0, hi - time.perf_counter()))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return results, lo, hi


# --- summaries -------------------------------------------------------------------------------------------------

def tokens_in_window(results: list[Result], lo: float, hi: float) -> int:
    """Text chunks (about one token each) that arrived inside [lo, hi]."""
    return sum(1 for r in results for t in r.chunk_times if lo <= t <= hi)


def ended_in_window(results: list[Result], lo: float, hi: float) -> list[Result]:
    return [r for r in results if r.status != "cut" and r.end is not None and lo <= r.end <= hi]


def _ms(value_s: float) -> float:
    return value_s * 1000 if value_s is not None and not math.isnan(value_s) else math.nan


def summarise(results: list[Result], wall_s: float, slo: SLO, tokens: int | None = None) -> dict:
    """Everything one window says. `tokens` overrides the output-token count (closed loop: tokens in the window).

    throughput = output tokens / wall time and ok requests / wall time; goodput = requests that were ok and met
    the SLO (TTFT and own inter-token p99) per second, and as a fraction of the requests sent; TTFT and ITL
    percentiles over ok requests (ITL over all their gaps); queue time from the server's per-request field
    where it has one (loramux), else NaN."""
    ok = [r for r in results if r.status == "ok"]
    good = [r for r in ok if r.meets(slo)]
    tokens = sum(r.tokens for r in results) if tokens is None else tokens
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    queue = [r.server["queue_ms"] / 1000 for r in ok if r.server.get("queue_ms") is not None]
    short_chat = [r.ttft_s for r in ok if r.plan.prompt_kind == "short" and r.plan.chat and r.ttft_s is not None]
    return {
        "sent": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "failures": dict(sorted(Counter(r.status for r in results if r.status != "ok").items())),
        "wall_s": wall_s, "output_tokens": tokens,
        "tok_s": tokens / wall_s if wall_s > 0 else math.nan,
        "req_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "goodput_req_s": len(good) / wall_s if wall_s > 0 else math.nan,
        "goodput_frac": len(good) / len(results) if results else math.nan,
        "slo_miss_ttft": sum(1 for r in ok if r.ttft_s is None or r.ttft_s > slo.ttft_s),
        "slo_miss_itl": sum(1 for r in ok if r.itl_p99_s > slo.itl_s),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)), "itl_p99_ms": _ms(percentile(gaps, 99)),
        "e2e_p50_ms": _ms(percentile([r.end - r.sent for r in ok], 50)),
        "queue_p50_ms": _ms(percentile(queue, 50)), "queue_p99_ms": _ms(percentile(queue, 99)),
        "short_chat_ttft_p50_ms": _ms(percentile(short_chat, 50)),
        "ttft_p50_ms_by_kind": {k: _ms(percentile([r.ttft_s for r in ok if r.plan.prompt_kind == k], 50))
                                for k in PROMPT_KINDS},
        "ttft_p50_ms_by_tier": {t: _ms(percentile([r.ttft_s for r in ok if r.plan.tier == t], 50)) for t in TIERS},
    }


def median_of(dicts: list[dict]) -> dict:
    """Key by key median of summaries over rounds: numbers (NaNs ignored unless all are NaN; a count missing from
    one round's dict, such as a failure reason, is 0 there), nested dicts recursively, other values from the first
    dict that has them."""
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    out = {}
    for key in keys:
        values = [d[key] for d in dicts if key in d]
        first = values[0]
        if isinstance(first, dict):
            out[key] = median_of([v for v in values if isinstance(v, dict)])
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            nums = [d.get(key, 0) for d in dicts]
            nums = [v for v in nums if isinstance(v, (int, float)) and not math.isnan(v)]
            median = statistics.median(nums) if nums else math.nan
            whole = all(isinstance(v, int) for v in nums) and not math.isnan(median) and median == int(median)
            out[key] = int(median) if whole else median
        else:
            out[key] = first
    return out
