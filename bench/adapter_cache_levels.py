"""Adapter cache levels on the embedded SmolLM2: time to first token with the adapter cold in S3, on disk, in
host RAM and already in a device slot; and how much a cold load disturbs the streams already running.

Setup, all in this process except S3: a moto S3 server in a subprocess (a remote service does not
share our GIL), `loramux` Services (SQLite registry, S3 store, disk + RAM caches) and the real HTTP
server (uvicorn) on 127.0.0.1. Adapters: random PEFT LoRA, rank 16 on all 7 projections (about 20 MB
float32 each), uploaded through the registry.

TTFT: a streamed `POST /generate` (24-token prompt, 4 new tokens), time to the first text event,
median over rounds; each round uses a fresh adapter and pushes it down one tier at a time.

Inter-token latency: 4 long streams (base and two slot-resident adapters, exact per-token times from
the engine) while 3 short requests arrive over HTTP. Steady state: the arrivals use adapters already
in host RAM (they still need a slot load and a prefill). Cold: the arrivals use adapters cold in S3.
The ratio of the streams' p99 inter-token latency, cold / steady, isolates the cost of loading.
Ends with FIGURE cold_load_itl_p99_ratio and FIGURE cold_s3_ttft_ms.

Default: 3 rounds (about 2 minutes on a quiet 2-vCPU machine; 5 rounds took 4.6 min under a load average of
4-8); `--full`: 5 rounds, as in docs/performance.md; `--smoke`: one round of 12-token streams on a tiny random
model (bench/smoke.py), what the tests run. Each round prints its figures and the elapsed seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import LiveServer, describe_cpu, percentile, start_moto_process, write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Summarise in one sentence why the sky looks blue during the day and red at sunset."
CREDS = {"s3_access_key_id": "bench", "s3_secret_access_key": "bench"}
T_START = time.perf_counter()


class Bench:
    def __init__(self, args, tmp: Path, endpoint: str):
        import boto3

        from loramux.server.app import create_app
        from loramux.services.container import LOCAL_TENANT, Services
        from loramux.settings import Settings

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                     aws_secret_access_key="bench").create_bucket(Bucket="bench")
        settings = Settings(data_dir=tmp / "data", store_url="s3://bench/adapters", s3_endpoint_url=endpoint,
                            s3_region="us-east-1", max_loras=8, max_lora_rank=args.rank, **CREDS)
        self.services = Services.from_settings(settings)
        self.args, self.tmp = args, tmp
        self.tenant = self.services.tenancy.ensure_tenant(LOCAL_TENANT)[0].id
        self.services.tenancy.create_tenant("bench", tier="premium")
        self.key = self.services.tenancy.create_key("bench")[1]
        self.cfg = self.services.engine.engine.model.config
        self.server = LiveServer(create_app(lambda: self.services)).__enter__()
        self.seed = 0

    def progress(self, what: str) -> None:
        print(f"  {what} [{time.perf_counter() - T_START:.0f} s]", flush=True)

    def new_adapter(self, name: str):
        self.seed += 1
        path = write_peft_adapter(self.tmp / f"src-{self.seed}", self.cfg, self.args.rank, ALL, seed=self.seed)
        files = {f: path / f for f in ("adapter_config.json", "adapter_model.safetensors")}
        return self.services.registry.register(self.tenant, name, files, visibility="public")

    def ttft_ms(self, adapter: str | None, max_tokens: int = 4) -> tuple[float, dict]:
        """Time to the first text event of a streamed request over HTTP, and its final event."""
        import httpx

        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        if adapter:
            body["adapter"] = adapter
        start = time.perf_counter()
        first, final = None, {}
        with httpx.stream("POST", f"{self.server.url}/generate", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {self.key}"}) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                if first is None and event.get("text"):
                    first = (time.perf_counter() - start) * 1000
                if "finish_reason" in event:
                    final = event
        return first, final

    def evict(self, digest: str, ram: bool) -> None:
        """Push an idle adapter out of its device slot (and out of host RAM when `ram`)."""
        self.services.engine.evict_adapter(digest)
        if ram:
            self.services.adapter_cache.host.discard(digest)

    def tier_ttfts(self) -> dict[str, list[float]]:
        results = {"base": [], "store": [], "disk": [], "ram": [], "slot": []}
        self.ttft_ms(None)  # warm-up
        for round_ in range(self.args.rounds):
            version = self.new_adapter(f"ttft-{round_}")
            results["base"].append(self.ttft_ms(None)[0])
            for tier in ("store", "disk", "ram", "slot"):
                ms, final = self.ttft_ms(version.name)
                served = final.get("adapter_tier")
                expected = "ram" if tier == "slot" else tier
                assert served == expected, f"expected the {expected} tier, the server used {served}"
                results[tier].append(ms)
                if tier == "store":
                    self.evict(version.digest, ram=True)
                elif tier == "disk":
                    self.evict(version.digest, ram=False)
            self.progress(f"TTFT round {round_ + 1}/{self.args.rounds}: " + ", ".join(
                f"{tier} {values[-1]:.0f} ms" for tier, values in results.items()))
        return results

    async def _streams_with_arrivals(self, arrival_adapters: list[str]) -> list[float]:
        """Inter-token gaps (ms) of the long streams while `arrival_adapters` requests arrive over HTTP."""
        from loramux.engine.request import EngineRequest
        from loramux.engine.sampling.params import SamplingParams

        engine, cache = self.services.engine, self.services.adapter_cache
        long_adapters = [None, self.warm[0], None, self.warm[1]]
        leases = [cache.acquire_blocking(v) if v else None for v in long_adapters]
        gaps: list[float] = []
        started = asyncio.Event()
        running = [0]

        async def long_stream(i: int):
            params = SamplingParams(max_tokens=self.args.tokens, ignore_eos=True)
            last = None
            adapter = leases[i].adapter if leases[i] else None
            request = EngineRequest(f"long-{time.monotonic_ns()}-{i}", PROMPT, params, adapter=adapter)
            async for out in engine.generate(request):
                now = time.perf_counter()
                if last is not None and len(out.new_token_ids) == 1:
                    gaps.append((now - last) * 1000)
                last = now
                if len(out.token_ids) == 8:
                    running[0] += 1
                    if running[0] == len(long_adapters):
                        started.set()

        async def arrivals():
            await started.wait()
            for name in arrival_adapters:
                await asyncio.to_thread(self.ttft_ms, name, 2)

        await asyncio.gather(*(long_stream(i) for i in range(len(long_adapters))), arrivals())
        for lease in leases:
            if lease:
                cache.release(lease.adapter.digest)
        return gaps

    def itl_ratio(self) -> tuple[list[float], list[float]]:
        self.warm = [self.new_adapter(f"warm-{i}") for i in range(2)]
        asyncio.run(self._streams_with_arrivals([]))  # warm-up, puts the warm adapters in slots
        steady_p99, cold_p99 = [], []
        for round_ in range(self.args.rounds):
            # Steady: arrivals for adapters already in host RAM (each still takes a slot load and a prefill).
            ram_names = []
            for i in range(3):
                v = self.new_adapter(f"ram-{round_}-{i}")
                lease = self.services.adapter_cache.acquire_blocking(v)
                self.services.adapter_cache.release(lease.adapter.digest)
                ram_names.append(v.name)
            steady_p99.append(percentile(asyncio.run(self._streams_with_arrivals(ram_names)), 99))
            cold_names = [self.new_adapter(f"cold-{round_}-{i}").name for i in range(3)]
            cold_p99.append(percentile(asyncio.run(self._streams_with_arrivals(cold_names)), 99))
            self.progress(f"ITL round {round_ + 1}/{self.args.rounds}: p99 arrivals in RAM {steady_p99[-1]:.0f} ms, "
                          f"cold in S3 {cold_p99[-1]:.0f} ms")
        return steady_p99, cold_p99

    def close(self) -> None:
        self.server.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --full: 5)")
    ap.add_argument("--full", action="store_true", help="the long run: 5 rounds")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens of each long stream")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--smoke", action="store_true", help=f"1 round, 12-token streams, the tiny model: {SMOKE_HELP}")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.tokens = 1, 12
        tiny_model()
    if args.rounds is None:
        args.rounds = 5 if args.full else 3

    import torch

    torch.set_num_threads(args.threads)
    print(describe_cpu())
    moto, endpoint = start_moto_process()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench = Bench(args, Path(tmp), endpoint)
            size = bench.new_adapter("size-probe").size_bytes
            print(f"{model_label(args.smoke)} fp32, {args.threads} threads, rank {args.rank} on 7 projections "
                  f"({size / 2**20:.1f} MiB per adapter blob), {args.rounds} rounds, S3 = moto in a subprocess",
                  flush=True)
            ttfts = bench.tier_ttfts()
            print("\nTTFT, streamed over HTTP (ms, median of rounds):")
            for tier, values in ttfts.items():
                print(f"  {tier:<6} {statistics.median(values):8.1f}   (all: {', '.join(f'{v:.0f}' for v in values)})")
            steady, cold = bench.itl_ratio()
            print(f"\nInter-token latency p99 of 4 running streams ({args.tokens} tokens each), "
                  "3 arrivals per round:")
            print(f"  arrivals in host RAM: {statistics.median(steady):7.1f} ms  (rounds: "
                  f"{', '.join(f'{v:.0f}' for v in steady)})")
            print(f"  arrivals cold in S3:  {statistics.median(cold):7.1f} ms  (rounds: "
                  f"{', '.join(f'{v:.0f}' for v in cold)})")
            ratio = statistics.median(c / s for c, s in zip(cold, steady))
            print(f"\nFIGURE cold_load_itl_p99_ratio {ratio:.2f}")
            print(f"FIGURE cold_s3_ttft_ms {statistics.median(ttfts['store']):.0f}")
            bench.close()
    finally:
        moto.terminate()
        moto.wait(timeout=10)


if __name__ == "__main__":
    main()
