"""int8 base weights (LORAMUX_QUANTIZATION=int8) against float32 on the embedded SmolLM2-135M-Instruct.

1. Greedy agreement: 100 chat prompts, exactly `--new-tokens` (32) greedy tokens each (EOS suppressed with
   min_tokens), through the float32 and the int8 engine; reports the fraction of prompts whose outputs are
   identical and the mean fraction of tokens that match up to the first divergence.
2. Decode throughput at batch 8 with 8 distinct r=16 adapters on all 7 projections, one per row: both
   engines side by side in one process, each round one batch per engine with their steps alternating
   (which engine leads alternates by round), exactly `--decode-tokens` per request, tok/s counted over
   pure decode steps (after the last prefill), medians over rounds. Alternating single steps (not whole
   runs) keeps bursts of other load on a shared VM from landing on one side only; it is conservative for
   int8, whose 135 MB of weights could otherwise stay in a large L3 between its own steps.
Both engines: `LLMEngine.from_settings(Settings(dtype="float32", device="cpu", quantization=...))`, with
speculative decoding off so that the outputs differ only by the weights.
Ends with FIGURE int8_greedy_agreement and FIGURE int8_vs_fp32_b8 (int8 / fp32 decode tok/s).

    .venv/bin/python bench/quantization.py [--prompts 100] [--rounds 5] [--threads 1]
    .venv/bin/python bench/quantization.py --smoke   # 3 prompts, 4 tokens, batch 2, 1 round, a tiny random model
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import describe_cpu, write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["the sea", "volcanoes", "bread baking", "the Roman empire", "photosynthesis", "chess", "jazz music",
          "the moon", "electric cars", "honey bees", "mountain hiking", "the internet", "coffee", "glaciers",
          "recycling", "dinosaurs", "solar panels", "the human heart", "origami", "rainforests"]
TASKS = ["Explain {} in two sentences.", "Write a short poem about {}.", "List three facts about {}.",
         "What is the history of {}?", "Give a beginner some advice about {}."]


def prompts(n: int) -> list[str]:
    """n distinct chat prompts: every task for every topic (20 x 5 = 100)."""
    return [task.format(topic) for topic in TOPICS for task in TASKS][:n]


def make_engine(quantization: str, rank: int):
    from loramux.engine.engine import LLMEngine
    from loramux.settings import Settings

    return LLMEngine.from_settings(Settings(dtype="float32", device="cpu", quantization=quantization,
                                            max_lora_rank=rank, kv_cache_bytes=256 * 1024**2, speculative_tokens=0))


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions that match before the first divergence."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def greedy_agreement(engines: dict, texts: list[str], new_tokens: int, chunk: int = 20) -> tuple[float, float]:
    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens)
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    for start in range(0, len(texts), chunk):
        for name, engine in engines.items():
            chats = [engine.encode_chat([{"role": "user", "content": t}]) for t in texts[start:start + chunk]]
            outputs[name] += [o.token_ids for o in engine.generate(chats, params)]
        print(f"  greedy: {min(start + chunk, len(texts))}/{len(texts)} prompts", flush=True)
    ref, got = outputs["fp32"], outputs["int8"]
    identical = sum(a == b for a, b in zip(ref, got)) / len(ref)
    return identical, statistics.mean(agreement(a, b) for a, b in zip(ref, got))


def decode_runs(engines: dict, chats: dict, adapters: list[str], params, order: list[str]) -> dict:
    """Run one batch per engine to the end, stepping the engines in turn (so a burst of other load on the
    machine hits both alike); {engine: (tokens, seconds)} over the steps after every request of that
    engine had its first token."""
    ids = {name: [f"{name}-{time.monotonic_ns()}-{j}" for j in range(len(adapters))] for name in engines}
    for name, engine in engines.items():
        for rid, chat, adapter in zip(ids[name], chats[name], adapters):
            engine.add_request(rid, chat, params, adapter=adapter)
    started: dict[str, set[str]] = {name: set() for name in engines}
    totals = {name: (0, 0.0) for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for name in order:
            engine = engines[name]
            if not engine.has_unfinished():
                continue
            decoding = len(started[name]) == len(adapters)
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            started[name].update(o.request_id for o in outs if o.new_token_ids)
            if decoding:
                tokens, seconds = totals[name]
                totals[name] = (tokens + sum(len(o.new_token_ids) for o in outs), seconds + dt)
    return totals


def throughput(engines: dict, batch: int, rank: int, decode_tokens: int, rounds: int) -> dict[str, float]:
    from loramux.engine.sampling.params import SamplingParams

    tmp = Path(tempfile.mkdtemp(prefix="loramux-int8-bench-"))
    names = [f"ad{i}" for i in range(batch)]
    cfg = engines["fp32"].model.config
    for i, name in enumerate(names):
        path = write_peft_adapter(tmp / name, cfg, rank, ALL, seed=i, b_std=0.02)
        for engine in engines.values():
            engine.load_adapter_dir(path, name)
    texts = prompts(batch)
    params = SamplingParams(max_tokens=decode_tokens, min_tokens=decode_tokens)
    warm = SamplingParams(max_tokens=8, min_tokens=8)
    chats = {n: [e.encode_chat([{"role": "user", "content": t}]) for t in texts] for n, e in engines.items()}
    decode_runs(engines, chats, names, warm, list(engines))
    tps: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for r in range(rounds):
        totals = decode_runs(engines, chats, names, params, order[r % 2:] + order[:r % 2])  # alternate the lead
        for name, (tokens, seconds) in totals.items():
            tps[name].append(tokens / seconds)
            print(f"  batch {batch} round {r + 1}/{rounds}: {name} {tps[name][-1]:.1f} decode tok/s "
                  f"({tokens} tokens in {seconds:.1f} s)", flush=True)
    return {name: statistics.median(v) for name, v in tps.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-vCPU VM, other jobs make 2-thread OpenMP "
                         "barriers wait for descheduled threads, 5-10x slower and noisy; 1 thread keeps the "
                         "ratio stable)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"3 prompts, 4 tokens, batch 2, 1 round, the tiny model: {SMOKE_HELP}")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.decode_tokens, args.rounds, args.batch = 3, 4, 4, 1, 2
        tiny_model()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(describe_cpu())
    print(f"{model_label(args.smoke)}; torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    engines = {"fp32": make_engine("none", args.rank), "int8": make_engine("int8", args.rank)}
    layer = engines["int8"].model.lm_head.int8
    print(f"engines loaded; int8 kernel {layer.kernel!r}, activation passes of {layer.qmax.bit_length() + 1} bits "
          f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
    identical, matched = greedy_agreement(engines, prompts(args.prompts), args.new_tokens)
    print(f"greedy agreement over {args.prompts} prompts x {args.new_tokens} tokens: identical {identical:.3f}, "
          f"mean matching prefix {matched:.3f} [{time.perf_counter() - t_start:.0f} s]", flush=True)
    med = throughput(engines, args.batch, args.rank, args.decode_tokens, args.rounds)
    for name, value in med.items():
        print(f"  {name}: {value:.1f} decode tok/s at batch {args.batch}, {args.batch} distinct r={args.rank} adapters")
    print(f"done [{time.perf_counter() - t_start:.0f} s]")
    print(f"FIGURE int8_greedy_agreement {identical:.3f}")
    print(f"FIGURE int8_vs_fp32_b{args.batch} {med['int8'] / med['fp32']:.2f}")


if __name__ == "__main__":
    main()
