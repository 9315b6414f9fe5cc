"""Engine vs HF transformers `generate`: same prompts, greedy, up to 64 new tokens, batch 8 and 16.

Both sides get the same weights (float32), the same chat-templated token ids, the same thread count
and a warm-up run; rounds alternate between them (who goes first alternates too) and the median is
reported.

Default (about 3-4 minutes on a quiet 2-vCPU machine): 3 rounds; one warm-up run per side and batch size,
in the eos workload (it visits every batch shape the fixed workload uses: all B rows, then fewer as rows
finish). `--full`: 5 rounds and a warm-up run before every workload and batch size (docs/performance.md).
Progress (workload, batch, round, elapsed seconds) is printed as it goes.

Two workloads, both printed:
  * eos   - each request generates until its end-of-turn token or 64 new tokens, as a real request
            does. Throughput counts the tokens each request actually produced (identical on both
            sides: the script checks the outputs token for token). HF's static batch keeps computing
            finished rows until the longest one ends; the engine drops them at once. This is the
            headline figure (FIGURE engine_vs_hf_b8 / _b16).
  * fixed - EOS suppressed (min_tokens / min_new_tokens), exactly 64 tokens per request: the
            per-step efficiency alone
            (FIGURE engine_vs_hf_fixed_b8 / _b16).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from loramux.testing import describe_cpu

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; --full: 5)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--full", action="store_true",
                    help="the long run: 5 rounds, a warm-up before every workload and batch size")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.full else 3
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - t_start:.0f} s]"

    from transformers import AutoModelForCausalLM

    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.settings import Settings

    engine = LLMEngine.from_settings(Settings(dtype="float32", device="cpu"))
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(tok.name_or_path, dtype=torch.float32).eval()
    tok.padding_side = "left"
    eos_ids = sorted(engine.eos_token_ids)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    print(describe_cpu())
    print(f"model SmolLM2-135M-Instruct float32, threads={args.threads}, up to {args.new_tokens} new tokens, "
          f"rounds={args.rounds} (median), {time.strftime('%Y-%m-%d')}, load {time.perf_counter() - t_start:.1f} s",
          flush=True)

    figures = {}
    warmed: set[int] = set()  # batch sizes warmed up
    for mode in ("eos", "fixed"):
        for batch in [int(b) for b in args.batches.split(",")]:
            chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in (PROMPTS * 4)[:batch]]
            padded = tok.pad({"input_ids": chats}, return_tensors="pt")
            fixed = mode == "fixed"
            params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens if fixed else 0)

            def run_engine(chats=chats, params=params) -> list[list[int]]:
                return [o.token_ids for o in engine.generate(chats, params)]

            def run_hf(padded=padded, fixed=fixed) -> list[list[int]]:
                with torch.inference_mode():
                    out = hf.generate(**padded, max_new_tokens=args.new_tokens, do_sample=False,
                                      eos_token_id=eos_ids, pad_token_id=pad_id,
                                      min_new_tokens=args.new_tokens if fixed else None)
                rows = out[:, padded["input_ids"].shape[1]:].tolist()
                if fixed:
                    return rows
                # Keep each row up to and including its first end-of-turn token, as the engine does.
                return [row[: next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))] for row in rows]

            outputs: dict[str, list[list[int]]] = {}
            if args.full or batch not in warmed:  # warm-up, and the outputs must agree
                t0 = time.perf_counter()
                outputs = {"loramux": run_engine(), "hf": run_hf()}
                warmed.add(batch)
                print(f"[{mode:5s}] batch {batch:2d}: warm-up {time.perf_counter() - t0:.1f} s {elapsed()}",
                      flush=True)
            tps = {"loramux": [], "hf": []}
            for r in range(args.rounds):
                order = (("loramux", run_engine), ("hf", run_hf))
                for name, fn in order if r % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    rows = fn()
                    n = sum(len(row) for row in rows)
                    tps[name].append(n / (time.perf_counter() - t0))
                    outputs.setdefault(name, rows)  # no warm-up here: the first round's outputs are checked
                print(f"[{mode:5s}] batch {batch:2d}: round {r + 1}/{args.rounds} loramux {tps['loramux'][-1]:.1f} "
                      f"tok/s, HF {tps['hf'][-1]:.1f} tok/s {elapsed()}", flush=True)
            ours, theirs = outputs["loramux"], outputs["hf"]
            same = sum(a == b for a, b in zip(ours, theirs))
            med = {k: statistics.median(v) for k, v in tps.items()}
            ratio = med["loramux"] / med["hf"]
            lengths = [len(r) for r in ours]
            print(f"[{mode:5s}] batch {batch:2d}: loramux {med['loramux']:6.1f} tok/s  HF generate {med['hf']:6.1f} "
                  f"tok/s  ratio {ratio:.2f}  | outputs identical {same}/{batch}, tokens per request "
                  f"min {min(lengths)} max {max(lengths)} | rounds loramux {[round(x) for x in tps['loramux']]} "
                  f"hf {[round(x) for x in tps['hf']]} {elapsed()}", flush=True)
            figures[f"engine_vs_hf{'_fixed' if fixed else ''}_b{batch}"] = ratio
    for name in sorted(figures, key=lambda n: ("fixed" in n, n)):
        print(f"FIGURE {name} {figures[name]:.2f}")


if __name__ == "__main__":
    main()
