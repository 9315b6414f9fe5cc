"""oneDNN-packed weights for CPU matmuls.

Small-batch decode on CPU is bound by reading weights; oneDNN's blocked layout reads them about 20-30%
faster than a strided GEMM at batch 8 on the machines we measured (docs/performance.md).
"""
from __future__ import annotations

from functools import cache

import torch


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight_in_out: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """weight [in, out] -> opaque oneDNN weight for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_in_out.t().contiguous(), batch_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@cache
def can_pack(in_features: int, out_features: int, dtype: torch.dtype, batch_hint: int) -> bool:
    """Whether to pack this shape: oneDNN is present and its packed matmul agrees with the plain one.

    A per-shape timing at load was tried first; on a shared VM its verdicts flipped from run to run
    while an A/B of whole decode steps showed packing everything at least as fast as any mix
    (docs/performance.md), so the choice is now deterministic.
    """
    if not onednn_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    w = torch.randn(in_features, out_features, dtype=dtype)
    x = torch.randn(batch_hint, in_features, dtype=dtype)
    try:
        packed = packed_linear(x, pack(w, batch_hint), None)
    except RuntimeError:
        return False
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    return torch.allclose(packed.float(), (x @ w).float(), atol=tol * in_features**0.5, rtol=tol)
