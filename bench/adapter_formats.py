"""Adapter formats at decode: what DoRA costs next to plain LoRA of the same rank, on SmolLM2 (float32).

Two engines side by side in one process, same prompts, same threads: one serving 8 DoRA adapters, one
serving 8 plain LoRA adapters with the same A / B (rank --rank on all 7 projections); 8 requests, one per
adapter, exactly --new-tokens tokens each (EOS ignored). Decode throughput counts the tokens of the steps
after every request has its first token (prefill excluded). Rounds alternate between the two; medians.
Then (unless --no-heads) bench/adapter_heads.py's comparison in the same run: 4 adapters with a full trained
lm_head against the same 4 without, batch 8.
Ends with FIGURE dora_vs_lora_b8 (DoRA decode tokens/s / LoRA decode tokens/s; target >= 0.85) and FIGURE
heads_vs_lora_b8 (heads / no heads, recorded).
Adapters are random, written in PEFT's format (DoRA: a lora_magnitude_vector per module).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loramux.testing import describe_cpu, write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_dora(path: Path, cfg, seed: int) -> Path:
    """Turn a PEFT LoRA adapter directory into a DoRA one: use_dora and a random magnitude per module."""
    from safetensors.torch import load_file, save_file

    from loramux.adapters.formats.validation import projection_shapes

    tensors = load_file(path / "adapter_model.safetensors")
    shapes, g = projection_shapes(cfg), torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(".lora_A.weight")]:
        target = name.split(".")[-3]
        tensors[name.replace(".lora_A.weight", ".lora_magnitude_vector")] = \
            torch.rand(shapes[target][1], generator=g) + 0.5
    save_file(tensors, path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return path


def decode_tokens_per_s(engine, prompts, names, new_tokens: int) -> float:
    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}-{time.perf_counter_ns()}", prompt, params, adapter=name)
    started, tokens, seen = None, 0, set()
    while engine.has_unfinished():
        outs = engine.step()
        if started is not None:
            tokens += sum(len(o.new_token_ids) for o in outs)
        seen.update(o.request_id for o in outs)
        if started is None and len(seen) == len(prompts):
            started = time.perf_counter()
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-heads", action="store_true", help="skip the lm_head comparison (adapter_heads.py)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine
    from loramux.model.loader import build_model, end_of_turn_ids, read_model_config, resolve_model_dir
    from loramux.settings import DEFAULT_MODEL, Settings

    print(describe_cpu())
    smol = resolve_model_dir(DEFAULT_MODEL, Path(Settings().cache_dir))
    tokenizer = AutoTokenizer.from_pretrained(smol)
    cfg, _ = read_model_config(smol)
    questions = ["What is the capital of France?", "Write a haiku about snow.", "Name three colours.",
                 "Why is the sky blue?", "Give me a word that rhymes with cat.", "What is 2 + 2?",
                 "Describe a cat in one sentence.", "Name a large river."]
    engines, names = {}, [f"a{i}" for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("lora", "dora"):
            model, _ = build_model(smol, torch.float32, torch.device("cpu"))
            engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=400, max_num_seqs=16,
                                                              max_lora_rank=args.rank),
                               end_of_turn_ids(tokenizer, cfg, smol))
            for i, name in enumerate(names):
                path = write_peft_adapter(Path(tmp) / kind / name, cfg, args.rank, ALL, seed=i)
                engine.load_adapter_dir(add_dora(path, cfg, i) if kind == "dora" else path, name)
            engines[kind] = engine
        prompts = [engines["lora"].encode_chat([{"role": "user", "content": q}]) for q in questions]
        for engine in engines.values():  # warm-up: loads the adapters, one short run
            decode_tokens_per_s(engine, prompts, names, 4)
        rates: dict[str, list[float]] = {"lora": [], "dora": []}
        for round_index in range(args.rounds):
            order = ("lora", "dora") if round_index % 2 == 0 else ("dora", "lora")
            for kind in order:
                rates[kind].append(decode_tokens_per_s(engines[kind], prompts, names, args.new_tokens))
                print(f"round {round_index + 1} {kind}: {rates[kind][-1]:.1f} decode tokens/s", flush=True)
    lora, dora = statistics.median(rates["lora"]), statistics.median(rates["dora"])
    print(f"batch 8, rank {args.rank} on all 7 projections: LoRA {lora:.1f} tokens/s, DoRA {dora:.1f} tokens/s")
    engines.clear()
    heads = None
    if not args.no_heads:
        import adapter_heads

        print("\nadapters with a trained lm_head (bench/adapter_heads.py):", flush=True)
        heads = adapter_heads.main(["--rounds", str(args.rounds), "--rank", str(args.rank)], figure=False)
    print(f"\nFIGURE dora_vs_lora_b8 {dora / lora:.2f}")
    if heads is not None:
        print(f"FIGURE heads_vs_lora_b8 {heads:.2f}")


if __name__ == "__main__":
    main()
