"""Engine vs HF transformers `generate`: same prompts, greedy, 64 new tokens, batch 8 and 16.

Both sides get the same model weights (float32), the same token ids, the same thread count, one
warm-up run, and exactly `--new-tokens` tokens per prompt (EOS ignored by both) so the work is equal.
Reports the median of `--rounds` timed rounds, run alternately, and ends with FIGURE lines.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a transformer language model generates text, step by step, for a curious beginner.",
    "What is the capital of France?",
    "List three uses of copper in electrical engineering and explain why copper is chosen for each.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Translate 'good morning, how are you today?' into Spanish and German.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue? Answer like a physics teacher talking to high-school students, with an example.",
    "Describe a cat.",
    "What are the main differences between Python lists and tuples, and when should each be used?",
    "Tell me a joke about programmers.",
    "How do vaccines train the immune system?",
    "Write a haiku about autumn leaves falling in a quiet park at dusk.",
    "What is 17 times 23?",
    "Suggest five names for a bakery that specialises in sourdough bread and pastries.",
    "Explain recursion to a five year old.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling_params import SamplingParams
    from loramux.settings import Settings

    engine = LLMEngine.from_settings(Settings(dtype="float32", device="cpu"))
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(tok.name_or_path, dtype=torch.float32).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    print(f"model SmolLM2-135M-Instruct float32, threads={args.threads}, new tokens={args.new_tokens}, "
          f"rounds={args.rounds}")

    figures = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in (PROMPTS * 4)[:batch]]

        def run_engine() -> int:
            outs = engine.generate(chats, params)
            return sum(len(o.token_ids) for o in outs)

        padded = tok.pad({"input_ids": chats}, return_tensors="pt")

        def run_hf() -> int:
            with torch.inference_mode():
                out = hf.generate(**padded, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  do_sample=False, pad_token_id=tok.pad_token_id)
            return (out.shape[1] - padded["input_ids"].shape[1]) * batch

        run_engine(), run_hf()  # warm-up
        tps = {"loramux": [], "hf": []}
        for _ in range(args.rounds):
            for name, fn in (("loramux", run_engine), ("hf", run_hf)):
                t0 = time.perf_counter()
                n = fn()
                tps[name].append(n / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in tps.items()}
        ratio = med["loramux"] / med["hf"]
        print(f"batch {batch:2d}: loramux {med['loramux']:7.1f} tok/s   HF generate {med['hf']:7.1f} tok/s   "
              f"ratio {ratio:.2f}   (rounds: loramux {[round(x) for x in tps['loramux']]}, "
              f"hf {[round(x) for x in tps['hf']]})")
        figures[f"engine_vs_hf_b{batch}"] = ratio
    for name, value in figures.items():
        print(f"FIGURE {name} {value:.2f}")


if __name__ == "__main__":
    main()
