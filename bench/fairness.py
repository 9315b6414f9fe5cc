"""Fair share within a tier on the real server: does a light tenant's latency depend on a heavy one's load?

Tenant A (standard tier) keeps `--streams` (32) streaming requests in flight, closed loop; tenant B (the same
tier) sends one request every `--interval` (2) s. Measured side by side in one run, each phase `--duration` s:
B alone, A alone, A and B together, then A at saturation and B: A keeps `--saturation-streams` (128) in
flight, twice the server's 64-sequence batch, so 64 of A's run and 64 wait whenever B's request arrives. Both
send the same kind of request (a chat of one user message, 53 prompt tokens with the template, `--max-tokens`
new tokens, greedy, ignore_eos so every request is the same work), streamed over HTTP to the server of
bench/serve_stack.py (its own process, pinned to `--threads` cores, the embedded SmolLM2-135M). TTFT is until
the first chunk with content, which is the first token: the model answers with text at once. (Until
2026-12-04 the bench sent the message as a raw /v1/completions prompt, whose first token is `<|im_end|>`,
which has no text: its TTFT was the second token's, one decode step later.)

Then fan-out: one request sent to 8 adapters (`"models": [...]`) against the same 8 requests sent separately
and concurrently, output tok/s of each.

Prints the machine, a line per phase and round, medians over `--rounds`, draws each tenant's cumulative
output tokens over time in the shared phase (docs/fairness.png with --plot), and ends with:
  FIGURE light_tenant_ttft_ratio <x>   B's TTFT p50 under A's load / B's TTFT p50 alone (target <= 1.5)
  FIGURE queue_ttft_ratio <x>          B's TTFT p50 with A at saturation / with A's 32 streams (target <= 1.5)
  FIGURE heavy_tenant_tok_s_ratio <x>  A's output tok/s with B / A alone (recorded)
  FIGURE fanout8_vs_single_tok_s <x>   tok/s of one fan-out to 8 adapters / 8 separate requests (recorded)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve_stack import LoramuxServer

from loramux.testing import describe_cpu, free_port, percentile, write_peft_adapter

REPO = Path(__file__).resolve().parents[1]
PROMPT = ("You are a helpful assistant. Explain in a few sentences why the sky is blue, and mention Rayleigh "
          "scattering.")
FANOUT = 8


@dataclass
class Stream:
    """One streamed request: when it was sent, and when each chunk with text arrived (monotonic seconds)."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the chunk)
    queue_ms: float | None = None  # the server's own account: how long it waited to be scheduled

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None


async def stream_completion(client, key: str, body: dict) -> Stream:
    """POST /v1/chat/completions with stream=True; every content chunk counted as one token (the server sends
    a chunk per token here: no stop strings, no coalescing on a reader that keeps up)."""
    result = Stream(sent=time.monotonic())
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if isinstance(event.get("loramux"), dict):
                result.queue_ms = event["loramux"].get("queue_ms")
            texts = [c["delta"]["content"] for c in event.get("choices", []) if (c.get("delta") or {}).get("content")]
            if texts:
                result.chunks.append((time.monotonic(), len(texts)))
    return result


def body(model: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


async def heavy_load(client, key: str, model: str, streams: int, max_tokens: int, until: float,
                     done: list[Stream]) -> None:
    """`streams` closed-loop workers, each sending its next request as soon as the last one ended."""
    async def worker() -> None:
        while time.monotonic() < until:
            done.append(await stream_completion(client, key, body(model, max_tokens)))

    await asyncio.gather(*(worker() for _ in range(streams)))


async def light_load(client, key: str, model: str, interval_s: float, max_tokens: int, until: float,
                     done: list[Stream]) -> None:
    """One request every `interval_s`, open loop (each on its own task, so a slow one never delays the next)."""
    tasks = []
    while time.monotonic() < until:
        tasks.append(asyncio.create_task(stream_completion(client, key, body(model, max_tokens))))
        await asyncio.sleep(interval_s)  # the offered load's schedule, not synchronisation
    done.extend(await asyncio.gather(*tasks))


def tok_s(streams: list[Stream], start: float, end: float) -> float:
    """Output tokens that arrived in [start, end) per second."""
    return sum(n for s in streams for at, n in s.chunks if start <= at < end) / (end - start)


async def phase(url: str, keys: dict, model: str, args, heavy: bool, light: bool, streams: int | None = None) -> dict:
    """One phase: A's `streams` (default `--streams`) closed-loop streams if `heavy`, B's requests if `light`."""
    import httpx

    streams = streams or args.streams
    limits = httpx.Limits(max_connections=streams + 64, max_keepalive_connections=streams + 64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.monotonic()
        until = start + args.duration
        heavy_done: list[Stream] = []
        light_done: list[Stream] = []
        jobs = []
        if heavy:
            jobs.append(heavy_load(client, keys["standard"], model, streams, args.max_tokens, until, heavy_done))
        if light:
            jobs.append(light_load(client, keys["standard-2"], model, args.interval, args.max_tokens, until,
                                   light_done))
        await asyncio.gather(*jobs)
    ttfts = [s.ttft_s * 1000 for s in light_done if s.ttft_s is not None]
    queued = [s.queue_ms for s in light_done if s.queue_ms is not None]
    return {"light_ttft_p50_ms": percentile(ttfts, 50) if ttfts else None, "light_requests": len(light_done),
            "light_queue_p50_ms": percentile(queued, 50) if queued else None,
            "heavy_tok_s": tok_s(heavy_done, start, until) if heavy else None,
            "light_tok_s": tok_s(light_done, start, until) if light else None,
            "start": start, "heavy": heavy_done, "light": light_done}


async def fanout_vs_single(url: str, key: str, adapters: list[str], base: str, max_tokens: int) -> dict:
    """One fan-out request to `adapters` vs the same requests sent separately at once: output tok/s of each."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.monotonic()
        fan = await stream_completion(client, key, {**body(base, max_tokens), "models": adapters})
        fan_s = time.monotonic() - t0
        t0 = time.monotonic()
        singles = await asyncio.gather(*(stream_completion(client, key, body(a, max_tokens)) for a in adapters))
        single_s = time.monotonic() - t0
    fan_tokens = sum(n for _, n in fan.chunks)
    single_tokens = sum(n for s in singles for _, n in s.chunks)
    return {"fanout_tok_s": fan_tokens / fan_s, "single_tok_s": single_tokens / single_s,
            "fanout_tokens": fan_tokens, "single_tokens": single_tokens}


def write_adapters(root: Path) -> Path:
    """8 random rank-8 PEFT adapters of the embedded model (q_proj, v_proj) for the fan-out comparison."""
    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.settings import Settings

    settings = Settings()
    cfg = read_model_config(resolve_model_dir(settings.model, Path(settings.cache_dir)))[0]
    for i in range(FANOUT):
        write_peft_adapter(root / f"fan-{i}", cfg, 8, ["q_proj", "v_proj"], seed=100 + i, alpha=16, b_std=0.05)
    return root


def plot(phases: list[tuple[str, dict]], path: Path, title: str) -> None:
    """Each tenant's cumulative output tokens over each shared phase ((A's label, phase result) pairs), side
    by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(phases), figsize=(6 * len(phases), 4), squeeze=False)
    for ax, (label, shared) in zip(axes[0], phases):
        for name, streams in ((label, shared["heavy"]), ("B (1 request / 2 s)", shared["light"])):
            arrivals = sorted((at - shared["start"], n) for s in streams for at, n in s.chunks)
            total, xs, ys = 0, [], []
            for at, n in arrivals:
                total += n
                xs.append(at)
                ys.append(total)
            ax.step(xs, ys, where="post", label=name)
        ax.set_yscale("symlog")
        ax.set_xlabel("seconds into the phase")
        ax.set_ylabel("output tokens received (cumulative)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32, help="tenant A's concurrent streams")
    ap.add_argument("--saturation-streams", type=int, default=128,
                    help="tenant A's concurrent streams in the saturation phase (the batch holds 64)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between tenant B's requests")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 round of 8 s phases, 4 streams (a smoke run)")
    ap.add_argument("--no-fanout", action="store_true", help="skip the fan-out comparison")
    ap.add_argument("--plot", type=Path, default=None, help="draw the shared phase here (e.g. docs/fairness.png)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration, args.streams, args.saturation_streams, args.interval = 1, 8.0, 4, 8, 1.0
    print(describe_cpu(), flush=True)
    rows: dict[str, list[dict]] = {"light_alone": [], "heavy_alone": [], "shared": [], "saturated": []}
    fanouts = []
    with tempfile.TemporaryDirectory() as tmp:
        adapters_dir = write_adapters(Path(tmp) / "adapters")
        with LoramuxServer(Path(tmp) / "data", adapters_dir, free_port(), Path(tmp) / "server.log",
                           threads=args.threads, max_loras=FANOUT, max_lora_rank=8) as info:
            url, keys, base = info["url"], info["keys"], info["base_model"]
            print(f"server: {json.dumps(info['settings'])}", flush=True)
            asyncio.run(phase(url, keys, base, argparse.Namespace(**{**vars(args), "duration": 4.0}),
                              heavy=True, light=True))  # warm-up: every code path once
            for r in range(args.rounds):
                for name, heavy, light, streams in (("light_alone", False, True, None),
                                                    ("heavy_alone", True, False, None), ("shared", True, True, None),
                                                    ("saturated", True, True, args.saturation_streams)):
                    result = asyncio.run(phase(url, keys, base, args, heavy, light, streams))
                    rows[name].append(result)
                    ttft = result["light_ttft_p50_ms"] or float("nan")
                    queue = result["light_queue_p50_ms"] or float("nan")
                    print(f"round {r} {name:<12} B TTFT p50 {ttft:8.1f} ms, queued p50 {queue:6.1f} ms "
                          f"({result['light_requests']} requests)  A {result['heavy_tok_s'] or 0:7.1f} tok/s",
                          flush=True)
                if not args.no_fanout:
                    result = asyncio.run(fanout_vs_single(url, keys["standard"], info["adapters"], base,
                                                          args.max_tokens))
                    fanouts.append(result)
                    print(f"round {r} fan-out 8: {result['fanout_tok_s']:.1f} tok/s, separate: "
                          f"{result['single_tok_s']:.1f} tok/s ({result['fanout_tokens']} / "
                          f"{result['single_tokens']} tokens)", flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[name])

    ttft_ratio = median("shared", "light_ttft_p50_ms") / median("light_alone", "light_ttft_p50_ms")
    queue_ratio = median("saturated", "light_ttft_p50_ms") / median("shared", "light_ttft_p50_ms")
    heavy_ratio = median("shared", "heavy_tok_s") / median("heavy_alone", "heavy_tok_s")
    print(f"B TTFT p50: alone {median('light_alone', 'light_ttft_p50_ms'):.1f} ms, "
          f"under A's load {median('shared', 'light_ttft_p50_ms'):.1f} ms; "
          f"A: alone {median('heavy_alone', 'heavy_tok_s'):.1f} tok/s, with B {median('shared', 'heavy_tok_s'):.1f}")
    queued = [r["light_queue_p50_ms"] for r in rows["saturated"] if r["light_queue_p50_ms"] is not None]
    print(f"B TTFT p50 with A at saturation ({args.saturation_streams} streams): "
          f"{median('saturated', 'light_ttft_p50_ms'):.1f} ms, queued p50 "
          f"{statistics.median(queued) if queued else float('nan'):.1f} ms "
          f"({sum(r['light_requests'] for r in rows['saturated'])} requests); "
          f"A {median('saturated', 'heavy_tok_s'):.1f} tok/s")
    if args.plot is not None:
        plot([(f"A ({args.streams} streams)", rows["shared"][-1]),
              (f"A ({args.saturation_streams} streams)", rows["saturated"][-1])],
             args.plot, describe_cpu().splitlines()[0][:200])
    print(f"FIGURE light_tenant_ttft_ratio {ttft_ratio:.2f}")
    print(f"FIGURE queue_ttft_ratio {queue_ratio:.2f}")
    print(f"FIGURE heavy_tenant_tok_s_ratio {heavy_ratio:.2f}")
    if fanouts:
        ratio = statistics.median(f["fanout_tok_s"] / f["single_tok_s"] for f in fanouts)
        print(f"FIGURE fanout8_vs_single_tok_s {ratio:.2f}")


if __name__ == "__main__":
    main()
