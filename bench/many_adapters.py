"""Many adapters: throughput and latency over HTTP as the number of distinct LoRA adapters grows (1 .. 1000).

Stack, all in this process: `loramux` Services with default Settings apart from float32 on CPU and a temp data
dir (SQLite registry, file store; LORAMUX_MAX_LORA_RANK is raised to 64 only when lower, so that the rank-64
adapters upload; `--max-loras` sets LORAMUX_MAX_LORAS only when given), the embedded SmolLM2-135M-Instruct and
the real uvicorn server on 127.0.0.1. One premium tenant (no rate limits) owns every adapter and sends the load.

Adapters: random PEFT LoRA adapters, float16 safetensors, non-zero B, each from its own seed, uploaded through
POST /admin/adapters incrementally (the 8-adapter set is a prefix of the 1000-adapter one). Generated files are
cached under ~/.cache/loramux-bench/many_adapters/ by spec. Two sets:
  table  rank 8 on q,k,v,o: one adapter for every request, uniform over 8 and over 64, against the base model;
  mixed  seeded ranks 8/16/32/64 (weights 4:3:2:1) on {q,v} / {q,k,v,o} / all seven projections (3:2:1), for the
         sweep N in 1, 8, 64, 256, 1000 with uniform and Zipf(1.0) popularity (seeded popularity order).

Load: closed loop. `--clients` streaming clients each repeat: pick an adapter by the scenario's popularity, send a
streamed /v1/completions (a short prompt from a fixed set, max_tokens 32, ignore_eos, seeded sampling), read it
to the end. A scenario ramps the clients up (client c starts when the first request has streamed c/clients of its
tokens, so that equal-length requests do not run in lockstep waves), warms up `--warmup` s more, then runs
`--rounds` windows of `--duration` s back to back (medians over the rounds are reported; default 1 round);
requests still running at the end are cancelled. Each client's first request (sent during the ramp, cold
starts included) stays out of the latency figures. A window should span a few request cycles: here 16 clients
x 32 tokens at about 40-60 tok/s is a 10-15 s cycle, so 30 s windows hold a few dozen requests.
Per window: output tok/s = tokens streamed inside the window / window length; TTFT (send -> first text chunk),
inter-token gaps (between text chunks) over the requests that ended inside it. Every request must end with
finish_reason "length" and exactly max_tokens completion tokens: a non-200, a stream error or a short output is
a failure, counted (over the whole scenario) and reported. Server counters come from GET /admin/stats at the
window's edges: device adapter loads and evictions per second, adapter cache hits by tier (ram / disk / store).
Clients and server share this process (and its GIL), as in serve_load.py.

Prints the machine (CPU model, SIMD flags, torch, threads), progress as it goes (uploads, each scenario's start,
warm-up and end, with the elapsed seconds), a table per scenario, writes `--json` and a plot (`--plot`: mixed set,
tok/s and TTFT p99 against N) and ends with the FIGURE lines adapters_64_vs_base_tok_s,
adapters_64_ttft_p50_ratio, adapters_1000_vs_8_tok_s, adapters_1000_ttft_p99_ms (`--quick`: the largest N it
ran stands in for 64 and 1000, the smallest other N for 8; it says so; `--smoke`: --quick on a tiny random model,
what the tests run).

Default: only the four scenarios behind the FIGURE lines (base, table-uniform-64, mixed-zipf-8, mixed-zipf-1000),
same load, warm-up and window as the full sweep, no plot unless `--plot` (about 4-5 minutes with the adapter
files cached; the first run also generates them, 5 GB). `--full`: all 13 scenarios (table 1 / 8 / 64, mixed N
1 .. 1000 uniform and Zipf) and the plot docs/many_adapters.png, as in docs/performance.md (about 13 minutes).
"""
from __future__ import annotations

import argparse
import asyncio
import fnmatch
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from many_adapters_plot import mixed_points, plot
from smoke import SMOKE_HELP, tiny_model

from loramux.testing import LiveServer, describe_cpu, percentile, write_peft_adapter

TABLE_NS = (1, 8, 64)
MIXED_NS = (1, 8, 64, 256, 1000)
FIGURE_SCENARIOS = "base,table-uniform-64,mixed-zipf-8,mixed-zipf-1000"  # the default run: what the FIGUREs need
T_START = time.perf_counter()
TABLE_RANK, TABLE_TARGETS = 8, ("q_proj", "k_proj", "v_proj", "o_proj")
MIXED_RANKS, MIXED_RANK_WEIGHTS = (8, 16, 32, 64), (4, 3, 2, 1)
MIXED_TARGETS = (("q_proj", "v_proj"), TABLE_TARGETS,
                 ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
MIXED_TARGET_WEIGHTS = (3, 2, 1)
B_STD = 0.05  # B non-zero: every adapter changes the output
WEIGHT_DTYPE, WEIGHT_BYTES = "float16", 2
FAMILY_SEED_OFFSET = {"table": 0, "mixed": 500_000}
GENERATOR_VERSION = 1  # bump when the generated files change: part of the cache key
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loramux-bench" / "many_adapters"
ZIPF_S = 1.0
MAX_TOKENS, TEMPERATURE = 32, 0.8
PROMPTS = ("What is the capital of France?", "Name three fruits.", "Say hello in Spanish.", "What is 12 times 12?",
           "Give me a synonym for happy.", "Who wrote Hamlet?", "What colour is grass?", "Define gravity briefly.")
TENANT = "bench"
REQUEST_TIMEOUT_S = 300.0


def progress(message: str) -> None:
    print(f"  {message} [{time.perf_counter() - T_START:.0f} s]", flush=True)


# --- adapters -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdapterSpec:
    family: str  # "table" or "mixed"
    index: int
    rank: int
    targets: tuple[str, ...]
    seed: int

    @property
    def name(self) -> str:
        label = "all" if len(self.targets) == 7 else "".join(t[0] for t in self.targets)
        return f"{self.family}-{self.index:04d}-r{self.rank}-{label}"


def adapter_specs(family: str, n: int, seed: int) -> list[AdapterSpec]:
    """The first n adapters of a set; a prefix of every longer set (one seeded draw per index)."""
    specs = []
    for i in range(n):
        adapter_seed = seed * 1_000_003 + FAMILY_SEED_OFFSET[family] + i  # distinct across sets and indices
        if family == "table":
            specs.append(AdapterSpec(family, i, TABLE_RANK, TABLE_TARGETS, adapter_seed))
        else:
            rng = random.Random(adapter_seed)
            rank = rng.choices(MIXED_RANKS, MIXED_RANK_WEIGHTS)[0]
            specs.append(AdapterSpec(family, i, rank, rng.choices(MIXED_TARGETS, MIXED_TARGET_WEIGHTS)[0],
                                     adapter_seed))
    return specs


def adapter_dir(spec: AdapterSpec, base_cfg, generate: bool = True) -> Path | None:
    """The PEFT files of `spec` for this base model, generated once into the cache (written aside, then renamed);
    None when not cached and not `generate`."""
    from loramux.adapters.formats.peft import projection_shapes

    shapes = projection_shapes(base_cfg)
    key = json.dumps([GENERATOR_VERSION, spec.rank, spec.targets, spec.seed, WEIGHT_DTYPE, B_STD,
                      base_cfg.num_layers, sorted(shapes.items())])
    path = CACHE_DIR / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    cached = (path / "adapter_model.safetensors").is_file()
    if cached or not generate:
        return path if cached else None
    tmp = Path(tempfile.mkdtemp(dir=CACHE_DIR.parent, prefix=".gen-"))
    write_peft_adapter(tmp, base_cfg, spec.rank, list(spec.targets), spec.seed, b_std=B_STD, dtype=WEIGHT_DTYPE)
    try:
        tmp.rename(path)
    except OSError:  # another run made it meanwhile
        pass
    return path


# --- the server -----------------------------------------------------------------------------------------

class Stack:
    """Services + uvicorn on 127.0.0.1 in a thread; an admin key for the admin API."""

    def __init__(self, data_dir: Path, max_loras: int | None):
        from loramux.names import base_model_id
        from loramux.server.app import create_app
        from loramux.services.container import Services
        from loramux.settings import Settings

        overrides = {"data_dir": data_dir, "database_url": "", "store_url": "", "dtype": "float32", "device": "cpu"}
        default = Settings()
        if default.max_lora_rank < max(MIXED_RANKS):
            overrides["max_lora_rank"] = max(MIXED_RANKS)
        if max_loras is not None:
            overrides["max_loras"] = max_loras
        t0 = time.perf_counter()
        self.services = Services.from_settings(Settings(**overrides))
        self.load_s = time.perf_counter() - t0
        self.settings, self.base_cfg = self.services.settings, self.services.registry.base_config
        self.model_id = base_model_id(self.settings.model)
        self.admin = {"Authorization": f"Bearer {self.services.admin_keys.create('many_adapters bench')[1]}"}
        self.server = LiveServer(create_app(lambda: self.services)).__enter__()
        self.url = self.server.url
        self.uploaded: dict[AdapterSpec, int] = {}  # spec -> bytes uploaded
        self.gen_s = self.upload_s = 0.0

    def close(self) -> None:
        self.server.__exit__(None, None, None)
        self.services.shutdown()


async def admin_call(client, stack: Stack, method: str, path: str, **kw) -> dict:
    resp = await client.request(method, f"{stack.url}/admin{path}", headers=stack.admin, **kw)
    if resp.status_code >= 300:
        raise RuntimeError(f"{method} /admin{path}: {resp.status_code} {resp.text[:300]}")
    return resp.json()


def weight_bytes(spec: AdapterSpec, base_cfg) -> int:
    from loramux.adapters.formats.peft import projection_shapes

    shapes = projection_shapes(base_cfg)
    return sum(sum(shapes[t]) for t in spec.targets) * spec.rank * base_cfg.num_layers * WEIGHT_BYTES


def check_disk(stack: Stack, specs: set[AdapterSpec]) -> None:
    """Exit early when the adapters cannot fit: bench cache + the server's object store + its disk cache."""
    total = sum(weight_bytes(s, stack.base_cfg) for s in specs)
    need = total + min(total, stack.settings.disk_cache_bytes) + sum(  # the store, the disk cache, new files
        weight_bytes(s, stack.base_cfg) for s in specs if not adapter_dir(s, stack.base_cfg, generate=False))
    free = min(shutil.disk_usage(CACHE_DIR).free, shutil.disk_usage(stack.settings.data_dir).free)
    print(f"disk: {len(specs)} adapters, {total / 1e9:.2f} GB of weights; needs about {need / 1e9:.1f} GB more, "
          f"{free / 1e9:.0f} GB free; file cache {CACHE_DIR}")
    if need > free:
        sys.exit("not enough disk space for these adapters (use --n to run fewer)")


async def upload(client, stack: Stack, specs: list[AdapterSpec], concurrency: int = 1) -> None:
    """Upload the specs not uploaded yet, generating the files that are not cached first; `concurrency` uploads
    in flight at a time (the server validates each on a worker thread), before the scenario that needs them."""
    todo = [s for s in specs if s not in stack.uploaded]
    if not todo:
        return
    every = max(1, len(todo) // 4)  # a progress line about every quarter
    t0 = time.perf_counter()
    missing = sum(adapter_dir(s, stack.base_cfg, generate=False) is None for s in todo)
    paths = []
    for k, spec in enumerate(todo):
        paths.append(adapter_dir(spec, stack.base_cfg))
        if missing and ((k + 1) % every == 0 or k + 1 == len(todo)):
            progress(f"adapter files: {k + 1}/{len(todo)} ready ({missing} not cached, generated)")
    t1 = time.perf_counter()
    gate, done = asyncio.Semaphore(max(1, concurrency)), [0]

    async def one(spec: AdapterSpec, path: Path) -> None:
        async with gate:
            config = (path / "adapter_config.json").read_bytes()
            weights = (path / "adapter_model.safetensors").read_bytes()
            await admin_call(client, stack, "POST", "/adapters", data={"tenant_id": TENANT, "name": spec.name},
                             files={"adapter_config": ("adapter_config.json", config, "application/json"),
                                    "adapter_model": ("adapter_model.safetensors", weights,
                                                      "application/octet-stream")})
        stack.uploaded[spec] = len(config) + len(weights)
        done[0] += 1
        if done[0] % every == 0 or done[0] == len(todo):
            progress(f"uploaded {done[0]}/{len(todo)} adapters ({len(stack.uploaded)} in all)")

    await asyncio.gather(*(one(spec, path) for spec, path in zip(todo, paths)))
    stack.gen_s += t1 - t0
    stack.upload_s += time.perf_counter() - t1


def counters(stats: dict) -> dict[str, float]:
    """The cumulative counters this bench reads from /admin/stats (keys read defensively)."""
    lora = stats.get("lora") or {}
    hits = (stats.get("adapter_cache") or {}).get("hits") or {}
    return {"loads": lora.get("loads", stats.get("adapter_slot_loads", 0)) or 0,
            "evictions": lora.get("evictions", 0) or 0,
            **{f"hits_{tier}": hits.get(tier, 0) or 0 for tier in ("ram", "disk", "store")}}


# --- load -----------------------------------------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    n: int
    popularity: str  # uniform or zipf
    specs: list[AdapterSpec] = field(default_factory=list)

    def weights(self, seed: int) -> list[float]:
        """Request share of each adapter: uniform, or Zipf(ZIPF_S) over a seeded popularity order."""
        if self.popularity == "uniform":
            return [1.0] * max(1, self.n)
        order = random.Random(seed).sample(range(self.n), self.n)
        weights = [0.0] * self.n
        for rank, i in enumerate(order):
            weights[i] = 1 / (rank + 1) ** ZIPF_S
        return weights


def all_scenarios(seed: int, table_ns, mixed_ns) -> list[Scenario]:
    out = [Scenario("base", 0, "uniform")]
    for n in table_ns:
        out.append(Scenario("table-1" if n == 1 else f"table-uniform-{n}", n, "uniform",
                            adapter_specs("table", n, seed)))
    for n in mixed_ns:
        for pop in ("uniform",) if n == 1 else ("uniform", "zipf"):  # one adapter: every popularity is the same
            out.append(Scenario(f"mixed-{pop}-{n}", n, pop, adapter_specs("mixed", n, seed)))
    return out


@dataclass
class Result:
    model: str
    first: bool = False  # a client's first request: sent during the ramp, left out of the latency figures
    sent: float = 0.0
    end: float | None = None  # None: still running when the scenario ended (cancelled)
    ttft_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    status: str = "ok"


async def send(client, url: str, key: str, r: Result, prompt: str, max_tokens: int, seed: int) -> None:
    """One streamed /v1/completions request, recorded into `r` as it streams; every outcome ends in r.status."""
    import httpx

    r.sent = time.perf_counter()
    body = {"model": r.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": TEMPERATURE, "seed": seed}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                r.status = f"http_{resp.status_code}"
            elif await read_events(resp, r) != "length" or r.tokens != max_tokens:
                r.status = r.status if r.status != "ok" else "short_output"  # ignore_eos: max_tokens, always
    except (httpx.HTTPError, TimeoutError) as exc:
        r.status = type(exc).__name__
    r.end = time.perf_counter()


async def read_events(resp, r: Result) -> str | None:
    """Read an SSE stream into `r` (chunk times, TTFT, completion tokens); returns the finish reason."""
    finish = None
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            r.status = "stream_error"
        for choice in event.get("choices") or []:
            if choice.get("text"):
                now = time.perf_counter()
                r.ttft_s = now - r.sent if r.ttft_s is None else r.ttft_s
                r.chunk_times.append(now)
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            r.tokens = event["usage"].get("completion_tokens", 0)
    return finish


async def client_loop(client, url: str, key: str, models: list[str], cum: list[float], rng: random.Random,
                      max_tokens: int, results: list[Result]) -> None:
    """One closed-loop client: request after request until cancelled."""
    for i in itertools.count():
        r = Result(rng.choices(models, cum_weights=cum)[0], first=i == 0)
        results.append(r)
        await send(client, url, key, r, rng.choice(PROMPTS), max_tokens, rng.randrange(2**31))


async def run_scenario(client, stack: Stack, key: str, sc: Scenario, args) -> list[dict]:
    """Ramp the clients up, warm up, then --rounds windows back to back under the same closed loop; requests still
    running at the end are cancelled. One summary per window."""
    models = [s.name for s in sc.specs] or [stack.model_id]
    cum = list(itertools.accumulate(sc.weights(args.seed)))
    results: list[Result] = []
    start, tasks = time.perf_counter(), []
    for c in range(args.clients):
        # Client c starts once the first request has streamed c/clients of its tokens: equal-length requests
        # started together would finish together, in lockstep waves, every window seeing a wave or none.
        while c and (len(results[0].chunk_times) < c * args.max_tokens / args.clients and results[0].end is None):
            await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(client_loop(client, stack.url, key, models, cum,
                                                     random.Random(args.seed * 7919 + c), args.max_tokens, results)))
        await asyncio.sleep(0)  # let it send (client 0's first request is results[0])
    progress(f"{sc.name}: {args.clients} clients running after {time.perf_counter() - start:.1f} s; warm-up "
             f"{args.warmup:g} s, then {args.rounds} x {args.duration:g} s")
    t0 = time.perf_counter() + args.warmup
    edges = [t0 + k * args.duration for k in range(args.rounds + 1)]
    snapshots = []
    for edge in edges:
        await asyncio.sleep(max(0.0, edge - time.perf_counter()))
        snapshots.append(counters(await admin_call(client, stack, "GET", "/stats")))
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    failures: dict[str, int] = {}  # of the whole scenario, ramp and warm-up included
    for r in results:
        if r.end is not None and r.status != "ok":
            failures[r.status] = failures.get(r.status, 0) + 1
    return [{**summarize(results, lo, hi, snapshots[k], snapshots[k + 1]), "warmup_s": t0 - start,
             "failures": failures} for k, (lo, hi) in enumerate(zip(edges, edges[1:]))]


def summarize(results: list[Result], lo: float, hi: float, before: dict, after: dict) -> dict:
    """Throughput from the tokens streamed in [lo, hi); latency of the requests that ended in it, but for each
    client's first (sent while the clients ramped up)."""
    tokens = 0.0  # a chunk carries its request's share of completion tokens (about one; still running: one)
    for r in results:
        if r.chunk_times:
            per_chunk = r.tokens / len(r.chunk_times) if r.tokens else 1.0
            tokens += per_chunk * sum(lo <= t < hi for t in r.chunk_times)
    ended = [r for r in results if r.end is not None and lo <= r.end < hi and not r.first]
    ok = [r for r in ended if r.status == "ok"]
    ttft = [r.ttft_s for r in ok]
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    seconds = hi - lo
    delta = {k: after[k] - before[k] for k in after}
    return {"requests": len(ended), "ok": len(ok), "tok_s": tokens / seconds,
            "ttft_p50_ms": percentile(ttft, 50) * 1000, "ttft_p99_ms": percentile(ttft, 99) * 1000,
            "itl_p99_ms": percentile(gaps, 99) * 1000, "loads_per_s": delta["loads"] / seconds,
            "evictions_per_s": delta["evictions"] / seconds,
            **{k: int(v) for k, v in delta.items() if k.startswith("hits_")}}


def median_of(rounds: list[dict]) -> dict:
    """Medians of the numeric fields over rounds (the failures are the scenario's, the same in every round)."""
    return {**{k: statistics.median(r[k] for r in rounds) for k, v in rounds[0].items() if isinstance(v, (int, float))},
            "failures": rounds[0]["failures"]}


async def check_adapters_apply(client, stack: Stack, key: str, spec: AdapterSpec) -> None:
    """Greedy, with logprobs: an adapter must change the base model's token logprobs (B is non-zero)."""
    outs = []
    for model in (stack.model_id, spec.name):
        resp = await client.post(f"{stack.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": model, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                       "logprobs": 0})
        if resp.status_code != 200:
            raise RuntimeError(f"sanity check: {model}: {resp.status_code} {resp.text[:300]}")
        outs.append(resp.json()["choices"][0]["logprobs"]["token_logprobs"])
    if outs[0] == outs[1]:
        raise RuntimeError(f"sanity check failed: {spec.name} gives the base model's logprobs {outs[0]}")


# --- report ---------------------------------------------------------------------------------------------

def print_table(rows: dict[str, dict]) -> None:
    print(f"\n{'scenario':<20}{'req':>6}{'fail':>5}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}"
          f"{'loads/s':>9}{'evict/s':>9}{'ram':>7}{'disk':>6}{'store':>6}")
    for name, m in rows.items():
        print(f"{name:<20}{m['requests']:>6.0f}{sum(m['failures'].values()):>5}{m['tok_s']:>8.1f}"
              f"{m['ttft_p50_ms']:>10.0f}{m['ttft_p99_ms']:>10.0f}{m['itl_p99_ms']:>9.0f}{m['loads_per_s']:>9.2f}"
              f"{m['evictions_per_s']:>9.2f}{m['hits_ram']:>7.0f}{m['hits_disk']:>6.0f}{m['hits_store']:>6.0f}")
    print("(ms; tok/s = output tokens streamed in the window / window; ram/disk/store = adapter cache hits by tier "
          "in the window)")
    for name, m in rows.items():
        if m["failures"]:
            print(f"FAILURES in {name}: {m['failures']}")
        if not m["ok"]:
            print(f"({name}: no request ended inside the window, so no latency figures: a request cycle is longer "
                  "than --duration here)")


def figures(rows: dict[str, dict], quick: bool) -> list[str]:
    """The four FIGURE lines; in --quick mode the largest N run stands in for 64 / 1000, the smallest for 8."""
    table = sorted(int(n.rsplit("-", 1)[1]) for n in rows if n.startswith("table-uniform-"))
    zipf = mixed_points(rows, "zipf")
    big_t, big_z, small_z = 64, 1000, 8
    if quick and table and zipf:
        big_t, big_z, small_z = table[-1], max(zipf), min(zipf)
        print(f"(quick: table uniform over {big_t} stands in for 64; mixed Zipf N={big_z} vs N={small_z} for 1000 "
              "vs 8)")
    nan = {"tok_s": math.nan, "ttft_p50_ms": math.nan, "ttft_p99_ms": math.nan}
    t64, base = rows.get(f"table-uniform-{big_t}", nan), rows.get("base", nan)
    z_big, z_small = zipf.get(big_z, nan), zipf.get(small_z, nan)

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.nan

    return [f"FIGURE adapters_64_vs_base_tok_s {ratio(t64['tok_s'], base['tok_s']):.3f}",
            f"FIGURE adapters_64_ttft_p50_ratio {ratio(t64['ttft_p50_ms'], base['ttft_p50_ms']):.3f}",
            f"FIGURE adapters_1000_vs_8_tok_s {ratio(z_big['tok_s'], z_small['tok_s']):.3f}",
            f"FIGURE adapters_1000_ttft_p99_ms {z_big['ttft_p99_ms']:.0f}"]


# --- main -----------------------------------------------------------------------------------------------

async def bench(args, stack: Stack, scenarios: list[Scenario]) -> dict[str, dict]:
    """Upload what each scenario needs (incrementally), check once that adapters apply, run it; medians per name."""
    import httpx

    check_disk(stack, {spec for sc in scenarios for spec in sc.specs})
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30), limits=limits) as client:
        await admin_call(client, stack, "POST", "/tenants", json={"name": TENANT, "tier": "premium"})
        key = (await admin_call(client, stack, "POST", f"/tenants/{TENANT}/keys"))["key"]
        rows: dict[str, dict] = {}
        for k, sc in enumerate(scenarios):
            if sc.specs:
                checked = bool(stack.uploaded)
                await upload(client, stack, sc.specs, args.upload_concurrency)
                if not checked:
                    await check_adapters_apply(client, stack, key, sc.specs[0])
            progress(f"scenario {k + 1}/{len(scenarios)}: {sc.name}")
            m = rows[sc.name] = median_of(await run_scenario(client, stack, key, sc, args))
            progress(f"{sc.name}: {m['tok_s']:.1f} tok/s, TTFT p50 {m['ttft_p50_ms']:.0f} ms, "
                     f"{sum(m['failures'].values())} failed")
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per measured window")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds after the clients ramped up")
    ap.add_argument("--rounds", type=int, default=1, help="windows per scenario (medians reported)")
    ap.add_argument("--clients", type=int, default=16, help="closed-loop streaming clients")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--scenarios", default=None, help="comma-separated glob patterns over scenario names, e.g. "
                    f"'base,table-*,mixed-zipf-*' (default: {FIGURE_SCENARIOS}; --full and --quick: '*')")
    ap.add_argument("--n", default=",".join(map(str, MIXED_NS)), help="adapter counts of the mixed sweep")
    ap.add_argument("--max-loras", type=int, help="set LORAMUX_MAX_LORAS (default: the engine's own default)")
    ap.add_argument("--quick", action="store_true", help="short run: 2 clients, 8 tokens, 4 s windows, N 1 and 8")
    ap.add_argument("--smoke", action="store_true", help=f"--quick on the tiny model: {SMOKE_HELP}")
    ap.add_argument("--full", action="store_true", help="every scenario and the plot docs/many_adapters.png "
                    "(the long sweep of docs/performance.md)")
    ap.add_argument("--upload-concurrency", type=int, default=2, help="adapter uploads in flight at a time, before "
                    "the scenario that needs them (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", type=Path, help="write all results here")
    ap.add_argument("--plot", type=Path, help="plot path (--full: docs/many_adapters.png by default; otherwise none)")
    args = ap.parse_args()
    mixed_ns, table_ns = [int(n) for n in args.n.split(",") if n], TABLE_NS
    args.quick = args.quick or args.smoke
    if args.quick:
        args.duration, args.warmup, args.clients, args.max_tokens = 4.0, 1.0, 2, 8
        mixed_ns, table_ns = [n for n in mixed_ns if n <= 8], (1, 8)
    if args.smoke:
        tiny_model()
    elif args.plot is None and args.full:
        args.plot = Path(__file__).resolve().parents[1] / "docs" / "many_adapters.png"
    if args.scenarios is None:
        args.scenarios = "*" if args.quick or args.full else FIGURE_SCENARIOS
    patterns = args.scenarios.split(",")
    scenarios = [s for s in all_scenarios(args.seed, table_ns, mixed_ns)
                 if any(fnmatch.fnmatchcase(s.name, p.strip()) for p in patterns)]
    if not scenarios:
        sys.exit("no scenario matches --scenarios / --n")

    import torch

    torch.set_num_threads(args.threads)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    machine = describe_cpu()
    title = f"{machine.splitlines()[0]}; {args.threads} torch threads"  # the JSON's and the plot's
    print(machine)
    print(f"torch threads: {args.threads}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), args.max_loras)
        try:
            s = stack.settings
            print(f"{stack.model_id} float32 on cpu; model load {stack.load_s:.1f} s; settings: max_loras "
                  f"{s.max_loras}, max_lora_rank {s.max_lora_rank}, max_num_seqs {s.max_num_seqs}, host cache "
                  f"{s.host_cache_bytes / 2**30:g} GiB, disk cache {s.disk_cache_bytes / 2**30:g} GiB")
            print(f"load: {args.clients} closed-loop clients, /v1/completions streamed, {args.max_tokens} tokens "
                  f"(ignore_eos), warm-up {args.warmup:g} s, {args.rounds} x {args.duration:g} s windows; "
                  f"scenarios: {', '.join(sc.name for sc in scenarios)}", flush=True)
            rows = asyncio.run(bench(args, stack, scenarios))
        finally:
            stack.close()
    uploads = {"adapters": len(stack.uploaded), "bytes": sum(stack.uploaded.values()),
               "generate_s": round(stack.gen_s, 1), "upload_s": round(stack.upload_s, 1),
               "mixed_ranks": {r: sum(sp.family == "mixed" and sp.rank == r for sp in stack.uploaded)
                               for r in MIXED_RANKS}}
    print(f"\nuploaded {uploads['adapters']} adapters through the admin API, {uploads['bytes'] / 1e6:.1f} MB, in "
          f"{uploads['upload_s']:.1f} s (+ {uploads['generate_s']:.1f} s generating files not cached); mixed set "
          f"ranks {uploads['mixed_ranks']}")
    print_table(rows)
    if args.json:
        finite = {name: {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in m.items()}
                  for name, m in rows.items()}  # strict JSON: no NaN
        args.json.write_text(json.dumps({"machine": title, "args": {k: str(v) for k, v in vars(args).items()},
                                         "uploads": uploads, "scenarios": finite}, indent=1))
    if args.plot:
        plot(rows, args.plot, title)
    print(f"(whole run {time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    print(machine)
    for line in figures(rows, args.quick):
        print(line)


if __name__ == "__main__":
    main()
