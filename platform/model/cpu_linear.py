"""oneDNN-packed weights for CPU matmuls, used where a measurement on this machine says they win.

Small-batch decode on CPU is bound by reading weights; oneDNN's blocked layout reads them about 20-30%
faster than a strided GEMM at batch 8 on the machines we measured (docs/performance.md). The choice is
made per weight shape by timing both on the machine itself, so a CPU where it does not pay keeps the
plain path.
"""
from __future__ import annotations

import time
from functools import lru_cache

import torch


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight_in_out: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """weight [in, out] -> opaque oneDNN weight for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_in_out.t().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _time(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@lru_cache(maxsize=None)
def packing_pays(in_features: int, out_features: int, dtype: torch.dtype, batch_hint: int) -> bool:
    """Time plain vs packed matmul for this shape at `batch_hint` rows; True when packed is faster."""
    if not onednn_available():
        return False
    # Several distinct weights, so the timing is not served from cache like a lone small matrix.
    copies = max(1, min(8, (64 * 1024**2) // max(1, in_features * out_features * 4)))
    weights = [torch.randn(in_features, out_features, dtype=dtype) for _ in range(copies)]
    try:
        packed = [pack(w, batch_hint) for w in weights]
    except RuntimeError:
        return False
    x = torch.randn(batch_hint, in_features, dtype=dtype)
    plain_s = _time(lambda: [x @ w for w in weights])
    packed_s = _time(lambda: [packed_linear(x, p, None) for p in packed])
    return packed_s < 0.95 * plain_s
