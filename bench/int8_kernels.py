"""Per-op timings of int8 linear kernels against the float32 oneDNN path at SmolLM2-135M shapes.

Each candidate holds 30 layers of its own weights (as the real model does, so weights stream from memory
instead of sitting in cache) plus the tied 576x49152 LM head; one round runs qkv, o, gate_up and down
through all 30 layers and then the head, timing every call. Candidates alternate round by round; the
table shows per-call times (decoder shapes: mean over the 30 layers). The weight-only kernels that are
an order of magnitude slower (`_weight_int8pack_mm`, dequantise-and-matmul) are timed on a single layer.

Candidates: fp32_onednn (the float32 path, model/cpu_linear.py); onednn and fbgemm (the production
two-pass int8 kernels, model/quantization.py); onednn_1pass and fbgemm_1pass (one int8 pass per row,
activations rounded to 8 bits: cheaper, and less accurate); fbgemm_per_tensor (fbgemm's own dynamic
quantization, one grid for the whole batch); int8pack; dequant.

    .venv/bin/python bench/int8_kernels.py [--batches 8,32,128] [--rounds 7] [--threads 2] [--stat min]
    .venv/bin/python bench/int8_kernels.py --smoke   # batch 2, 1 round, 1 layer, no slow kernels
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from loramux.model import cpu_linear
from loramux.model.quantization import QMAX, Int8Linear, activation_qmax
from loramux.testing import describe_cpu

LAYERS = 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
HEAD = (576, 49152)
STREAMED = ["fp32_onednn", "onednn", "fbgemm", "onednn_1pass", "fbgemm_1pass", "fbgemm_per_tensor"]
SLOW = ["int8pack", "dequant"]


def one_pass(layer: Int8Linear):
    """The layer's integer matmul on a single 8-bit pass per row (no residual row)."""
    def run(x):
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
        if layer.kernel == "onednn":
            ints = torch.div(x, peak).mul_(layer.qmax).round_().to(torch.int8)
            y = torch.ops.onednn.qlinear_pointwise(ints, 1.0, 0, layer.packed, layer.kernel_scales,
                                                   layer.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        else:
            ints = torch.cat([torch.div(x, peak).mul_(layer.qmax).round_(), layer.pin[None]])
            y = torch.ops.quantized.linear_dynamic(ints, layer.packed, layer.qmax < QMAX)[:x.shape[0]]
        return y.mul_(peak)
    return run


def make_layer(kind: str, w: torch.Tensor):
    if kind == "fp32_onednn":
        packed = cpu_linear.pack(w, 8)  # the engine packs with batch hint 8
        return lambda x: cpu_linear.packed_linear(x, packed, None)
    if kind.endswith("_1pass"):
        return one_pass(Int8Linear(w, None, kind.removesuffix("_1pass")))
    if kind == "fbgemm_per_tensor":
        packed = Int8Linear(w, None, "fbgemm").packed
        return lambda x: torch.ops.quantized.linear_dynamic(x, packed, activation_qmax() < QMAX)
    return Int8Linear(w, None, kind)


def build(kind: str, layers: int) -> dict[str, list]:
    gen = torch.Generator().manual_seed(0)
    dims = {name: [shape] * layers for name, shape in SHAPES.items()} | {"lm_head": [HEAD]}
    return {name: [make_layer(kind, torch.randn(k, n, generator=gen) / k**0.5) for k, n in shapes]
            for name, shapes in dims.items()}


def measure(batch: int, kinds: list[str], layers: int, rounds: int, stat) -> dict[str, dict[str, float]]:
    built = {kind: build(kind, layers) for kind in kinds}
    xs = {name: torch.randn(batch, k) for name, (k, _) in (SHAPES | {"lm_head": HEAD}).items()}
    samples: dict[str, dict[str, list[float]]] = {kind: {} for kind in kinds}
    for r in range(rounds + 1):
        for kind in kinds:
            for name, fns in built[kind].items():
                t0 = time.perf_counter()
                for fn in fns:
                    fn(xs[name])
                if r:  # round 0 warms up
                    samples[kind].setdefault(name, []).append((time.perf_counter() - t0) / len(fns))
    return {kind: {name: stat(v) for name, v in per.items()} for kind, per in samples.items()}


def print_table(res: dict[str, dict[str, float]]) -> None:
    """Per-call times; the last column is a 30-layer step (decoder shapes x 30 + the head)."""
    names = [*SHAPES, "lm_head"]
    print("| kernel | " + " | ".join(f"{n} us" for n in names) + " | 30 layers + head |")
    print("|---" * (len(names) + 2) + "|")
    base = res["fp32_onednn"]

    def step(per):
        return sum(per[n] * LAYERS for n in SHAPES) + per["lm_head"]

    for kind, per in res.items():
        cells = [f"{per[n] * 1e6:.0f} ({base[n] / per[n]:.2f}x)" for n in names]
        print(f"| {kind} | " + " | ".join(cells) + f" | {step(per) * 1e3:.1f} ms ({step(base) / step(per):.2f}x) |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="per-call statistic over rounds (min resists other load on a shared machine)")
    ap.add_argument("--skip-slow", action="store_true", help="leave out int8pack and dequant")
    ap.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of weights per candidate")
    ap.add_argument("--smoke", action="store_true", help="smoke run (what the tests run): --batches 2 --rounds 1 "
                    "--layers 1 --skip-slow, in seconds; its times mean nothing")
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.rounds, args.layers, args.skip_slow = "2", 1, 1, True
    torch.set_num_threads(args.threads)
    stat = statistics.median if args.stat == "median" else min
    print(describe_cpu())  # the int8 kernels depend on VNNI / AMX
    print(f"torch {torch.__version__}, {args.threads} threads, activation qmax {activation_qmax()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"\nbatch {batch}: {args.stat} per call over {args.rounds} rounds (x = speed-up over fp32_onednn)",
              flush=True)
        res = measure(batch, STREAMED, args.layers, args.rounds, stat)
        if not args.skip_slow:
            res |= measure(batch, SLOW, 1, 2, stat)
        print_table(res)


if __name__ == "__main__":
    main()
