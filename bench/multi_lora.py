"""Mixed-adapter batches: loramux vs PEFT on SmolLM2, r=16 on all 7 projections, 64 new tokens.

Side by side in one process, same prompts and weights (float32), same threads, one warm-up per
configuration, exactly `--new-tokens` tokens per request on every side (EOS suppressed: min_tokens /
min_new_tokens), rounds alternating between configurations, medians reported.

Configurations per batch size B (8 and 16):
  loramux base-only; loramux with U = 1, 2, 4, 8, B distinct adapters (rows spread round-robin);
  PEFT mixed-batch generate (`adapter_names=`, U = B); PEFT single-adapter batch (U = 1).
First (--full or --kernels), a kernel micro-benchmark: LoRA op time / base matmul time per decoder layer at
SmolLM2 shapes. Ends with FIGURE mixed_vs_peft_b8 (U=B=8, loramux / PEFT mixed) and FIGURE mixed_vs_base_b8
(U=B=8, loramux / loramux base-only), and the same for b16.

Default (about 4-5 minutes on a quiet 2-vCPU machine): only the configurations behind the FIGURE lines
(loramux base-only, loramux U=B, PEFT mixed U=B), 3 rounds, the warm-up of each configuration a short run
(--warmup-tokens, same batch, same prompts, same adapters: the same prefill and decode shapes). `--full`: every
configuration above, the kernel micro-benchmark and full-length warm-ups (docs/performance.md; about 15 min).
The order of the configurations rotates from round to round. Progress (batch, round, configuration, elapsed
seconds) is printed as it goes.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loramux.testing import describe_cpu, median_seconds, write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def kernel_microbench(cfg, num_slots: int = 8, rank: int = 16, rows: int = 8) -> None:
    """One decoder layer's four projections: base matmuls vs the LoRA ops of each CPU strategy."""
    from loramux.kernels import LoRABatch, torch_ops
    from loramux.kernels.ops import lora_shrink_expand
    from loramux.kernels.segments import build_groups
    from loramux.kernels.wrapper import LoRALayerWeights

    h, i = cfg.hidden_size, cfg.intermediate_size
    modules = {"qkv": (h, [cfg.q_size, cfg.kv_size, cfg.kv_size]), "o": (cfg.q_size, [h]),
               "gate_up": (h, [i, i]), "down": (i, [h])}
    # Distinct weights per layer so the timing streams weights like a real step (30 layers' worth).
    layers = 30
    base = [{n: torch.randn(d_in, sum(outs)) for n, (d_in, outs) in modules.items()} for _ in range(layers)]
    # The slot pool's CPU layouts: A as [slots, d_in, rows] and B as [slots, R, d_out], seen as the kernels' views.
    lora = [{n: LoRALayerWeights(a=(torch.randn(num_slots, d_in, len(outs) * rank) * 0.01).transpose(1, 2),
                                 b=[torch.randn(num_slots, rank, o).transpose(1, 2) for o in outs],
                                 offsets=[sum(outs[:j]) for j in range(len(outs))],
                                 scale=torch.ones(num_slots), names=[str(j) for j in range(len(outs))],
                                 targeted=[True] * num_slots)
             for n, (d_in, outs) in modules.items()} for _ in range(layers)]
    xs = {d: torch.randn(rows, d) for d in {h, i, cfg.q_size}}
    print(f"kernel micro-benchmark: {layers} layers x 4 projections, {rows} decode rows, {num_slots} slots, r={rank}")

    def run_base():
        return [xs[w.shape[0]] @ w for layer in base for w in layer.values()]

    base_s = median_seconds(run_base, 10)
    print(f"  base matmuls                      {base_s * 1e3:7.2f} ms")
    strategies = ("bmm", "grouped") if torch_ops.grouped_mm_available() else ("bmm",)
    for layout_name, slot_map in (("U=8 (one adapter per row)", list(range(rows))),
                                  ("U=1 (all rows one adapter)", [0] * rows)):
        chosen = torch_ops.pick_strategy(build_groups(slot_map))
        for strategy in strategies:
            batch = LoRABatch.from_slot_map(slot_map)
            batch._rows = torch_ops.GroupedRows(build_groups(slot_map), "cpu", strategy=strategy)
            ys = run_base()

            def run_lora(batch=batch, ys=ys):
                k = 0
                for layer in lora:
                    for w in layer.values():
                        lora_shrink_expand(ys[k], xs[w.a.shape[2]], w.a, w.b, w.offsets, w.scale, batch)
                        k += 1

            lora_s = median_seconds(run_lora, 10)
            print(f"  LoRA {layout_name:28s} {strategy:7s} {lora_s * 1e3:7.2f} ms  = {lora_s / base_s:5.2f} x base"
                  f"{'   <- chosen' if strategy == chosen else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="tokens of each configuration's warm-up run (default 8; --full: --new-tokens)")
    ap.add_argument("--kernels", action="store_true", help="run the kernel micro-benchmark (on with --full)")
    ap.add_argument("--full", action="store_true", help="every configuration, the kernel micro-benchmark and "
                    "full-length warm-ups (the long run of docs/performance.md)")
    # At most 2 by default: what the figures were recorded with (importing tests/conftest used to cap it).
    ap.add_argument("--threads", type=int, default=min(2, torch.get_num_threads()))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.full:
        args.kernels, args.warmup_tokens = True, args.new_tokens
    args.warmup_tokens = min(args.warmup_tokens, args.new_tokens)
    t_start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - t_start:.0f} s]"

    from engine_throughput import PROMPTS
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.settings import Settings

    batches = [int(b) for b in args.batches.split(",")]
    print(describe_cpu())
    engine = LLMEngine.from_settings(Settings(dtype="float32", device="cpu", max_lora_rank=args.rank))
    cfg = engine.model.config
    print(f"SmolLM2-135M-Instruct float32, threads={torch.get_num_threads()}, r={args.rank} on all 7 projections, "
          f"{args.new_tokens} new tokens, rounds={args.rounds} (median), warm-up {args.warmup_tokens} tokens, "
          f"{'every configuration' if args.full else 'the FIGURE configurations'}, {time.strftime('%Y-%m-%d')} "
          f"{elapsed()}", flush=True)
    if args.kernels:
        kernel_microbench(cfg, rank=args.rank)
        print(f"kernel micro-benchmark done {elapsed()}", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="loramux-bench-"))
    names = [f"ad{i}" for i in range(max(batches))]
    for i, name in enumerate(names):
        engine.load_adapter_dir(write_peft_adapter(tmp / name, cfg, args.rank, ALL, seed=i, b_std=0.02), name)
    tok = engine.tokenizer
    peft = None
    if not args.skip_peft:
        hf = AutoModelForCausalLM.from_pretrained(tok.name_or_path, dtype=torch.float32).eval()
        peft = PeftModel.from_pretrained(hf, tmp / names[0], adapter_name=names[0])
        for name in names[1:]:
            peft.load_adapter(tmp / name, adapter_name=name)
        peft.eval()
    print(f"{len(names)} adapters written and loaded{' (loramux and PEFT)' if peft is not None else ''} {elapsed()}",
          flush=True)
    tok.padding_side = "left"
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else sorted(engine.eos_token_ids)[0]
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens)
    warm_params = SamplingParams(max_tokens=args.warmup_tokens, min_tokens=args.warmup_tokens)

    figures = {}
    for batch in batches:
        chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in (PROMPTS * 4)[:batch]]
        padded = tok.pad({"input_ids": chats}, return_tensors="pt")

        def loramux_run(u: int | None, batch=batch, chats=chats):
            def run(warmup: bool = False) -> int:
                ids = [f"r{time.monotonic_ns()}-{j}" for j in range(batch)]
                for j, (rid, prompt) in enumerate(zip(ids, chats)):
                    engine.add_request(rid, prompt, warm_params if warmup else params,
                                       adapter=None if u is None else names[j % u])
                total = 0
                while engine.has_unfinished():
                    total += sum(len(o.new_token_ids) for o in engine.step())
                return total
            return run

        def peft_run(adapter_names: list[str], batch=batch, padded=padded):
            def run(warmup: bool = False) -> int:
                n = args.warmup_tokens if warmup else args.new_tokens
                with torch.inference_mode():
                    if len(set(adapter_names)) == 1:
                        peft.set_adapter(adapter_names[0])
                        out = peft.generate(**padded, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                            pad_token_id=pad_id)
                    else:
                        out = peft.generate(**padded, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                            pad_token_id=pad_id, adapter_names=adapter_names)
                return (out.shape[1] - padded["input_ids"].shape[1]) * batch
            return run

        configs = {"loramux base-only": loramux_run(None)}
        for u in sorted({1, 2, 4, 8, batch}) if args.full else [batch]:
            configs[f"loramux U={u}"] = loramux_run(u)
        if peft is not None:
            configs[f"PEFT mixed U={batch}"] = peft_run([names[j] for j in range(batch)])
            if args.full:
                configs["PEFT single adapter"] = peft_run([names[0]] * batch)
        t0 = time.perf_counter()
        for fn in configs.values():
            fn(warmup=True)
        print(f"batch {batch}: warm-up of {len(configs)} configurations ({args.warmup_tokens} tokens) "
              f"{time.perf_counter() - t0:.1f} s {elapsed()}", flush=True)
        tps: dict[str, list[float]] = {k: [] for k in configs}
        order = list(configs)
        for r in range(args.rounds):
            shift = r % len(order)
            for name in order[shift:] + order[:shift]:
                t0 = time.perf_counter()
                n = configs[name]()
                tps[name].append(n / (time.perf_counter() - t0))
                print(f"  batch {batch} round {r + 1}/{args.rounds}: {name} {tps[name][-1]:.1f} tok/s "
                      f"({time.perf_counter() - t0:.1f} s) {elapsed()}", flush=True)
        med = {k: statistics.median(v) for k, v in tps.items()}
        base = med["loramux base-only"]
        print(f"batch {batch}: {elapsed()}")
        for name, value in med.items():
            print(f"  {name:22s} {value:7.1f} tok/s   {value / base:5.2f} x loramux base-only")
        mixed = med[f"loramux U={batch}"]
        figures[f"mixed_vs_base_b{batch}"] = mixed / base
        if peft is not None:
            figures[f"mixed_vs_peft_b{batch}"] = mixed / med[f"PEFT mixed U={batch}"]
    for name in sorted(figures, key=lambda n: (not n.endswith("_b8"), "base" in n, n)):
        print(f"FIGURE {name} {figures[name]:.2f}")


if __name__ == "__main__":
    main()
