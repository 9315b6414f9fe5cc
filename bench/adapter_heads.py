"""Decode throughput of adapters that carry a fully trained lm_head (PEFT modules_to_save=["lm_head"]) against
plain LoRA adapters of the same rank, on the embedded SmolLM2-135M-Instruct.

Batch 8 (`--batch`): 4 adapters (`--adapters`), each r=16 on all 7 projections, 2 rows each. The "heads"
engine's adapters also carry their own lm_head (the base head plus noise, as a fine-tune leaves it), so every
row's logits come from its adapter's head (49152 x 576 per adapter: the base head does not run at all);
the "lora" engine's adapters are the same LoRAs without heads. Both engines side by side in one process,
their steps alternating (bench/quantization.py's `decode_runs`), exactly `--decode-tokens` per request,
tok/s over pure decode steps, medians over rounds. Speculation off.
Ends with FIGURE heads_vs_lora_b8 (heads tok/s / lora tok/s).

    .venv/bin/python bench/adapter_heads.py [--rounds 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from quantization import ALL, decode_runs, prompts

from loramux.testing import describe_cpu, write_peft_adapter


def make_engine(rank: int):
    from loramux.engine.engine import LLMEngine
    from loramux.settings import Settings

    return LLMEngine.from_settings(Settings(dtype="float32", device="cpu", max_lora_rank=rank,
                                            kv_cache_bytes=256 * 1024**2, adapter_pool_bytes=2 * 1024**3,
                                            speculative_tokens=0))


def add_head(path: Path, base_head: torch.Tensor, seed: int) -> Path:
    """Turn the PEFT adapter at `path` into one with modules_to_save=["lm_head"] (base head + noise)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "adapter_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    tensors["base_model.model.lm_head.weight"] = base_head + torch.randn(base_head.shape, generator=g) * 0.01
    save_file(tensors, path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    return path


def main(argv: list[str] | None = None, figure: bool = True) -> float:
    """Run the comparison; returns heads tok/s / lora tok/s (and prints its FIGURE line when `figure`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps the ratio stable on a shared VM)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(describe_cpu())
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, {time.strftime('%Y-%m-%d %H:%M')}",
          flush=True)
    engines = {"lora": make_engine(args.rank), "heads": make_engine(args.rank)}
    cfg = engines["lora"].model.config
    model = engines["lora"].model
    base_head = (model.embed_tokens.weight if model.embed_tokens is not None else model.lm_head.weight.t()).detach()
    tmp = Path(tempfile.mkdtemp(prefix="loramux-heads-bench-"))
    names = [f"ad{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        plain = write_peft_adapter(tmp / "lora" / name, cfg, args.rank, ALL, seed=i, b_std=0.02)
        engines["lora"].load_adapter_dir(plain, name)
        headed = add_head(write_peft_adapter(tmp / "heads" / name, cfg, args.rank, ALL, seed=i, b_std=0.02),
                          base_head.float().contiguous(), seed=100 + i)
        engines["heads"].load_adapter_dir(headed, name)
    from loramux.engine.sampling.params import SamplingParams

    rows = [names[j % len(names)] for j in range(args.batch)]
    texts = prompts(args.batch)
    chats = {n: [e.encode_chat([{"role": "user", "content": t}]) for t in texts] for n, e in engines.items()}
    decode_runs(engines, chats, rows, SamplingParams(max_tokens=8, min_tokens=8), list(engines))  # warm-up
    params = SamplingParams(max_tokens=args.decode_tokens, min_tokens=args.decode_tokens)
    tps: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for r in range(args.rounds):
        totals = decode_runs(engines, chats, rows, params, order[r % 2:] + order[:r % 2])
        for name, (tokens, seconds) in totals.items():
            tps[name].append(tokens / seconds)
            print(f"  round {r + 1}/{args.rounds}: {name} {tps[name][-1]:.1f} decode tok/s ({tokens} tokens in "
                  f"{seconds:.1f} s)", flush=True)
    med = {name: statistics.median(v) for name, v in tps.items()}
    for name, value in med.items():
        print(f"  {name}: {value:.1f} decode tok/s at batch {args.batch}, {args.adapters} r={args.rank} adapters")
    head_bytes = cfg.vocab_size * cfg.hidden_size * 4
    print(f"each head adds {head_bytes / 2**20:.0f} MiB to its adapter's device slot; done "
          f"[{time.perf_counter() - t_start:.0f} s]")
    if figure:
        print(f"FIGURE heads_vs_lora_b{args.batch} {med['heads'] / med['lora']:.2f}")
    return med["heads"] / med["lora"]


if __name__ == "__main__":
    main()
