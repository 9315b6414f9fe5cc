"""Triton kernel of DoRA's per-row rescale (GPU; also runs on CPU under TRITON_INTERPRET=1).

Same semantics as `loramux.kernels.dora.dora_rescale_torch`: each program takes a [BLOCK_M, BLOCK_N] tile of
y, reads each row's slot from the per-row index (-1: untouched) and writes g[slot] * y + (1 - g[slot]) * bias
in float32 arithmetic. The grid depends only on the row count, so the same kernel serves segmented steps and
fixed-shape (graph-captured) decode steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dora_rescale_kernel(y_ptr, g_ptr, bias_ptr, slots_ptr, num_rows, d_out, stride_ym, stride_yn, stride_gs,
                         stride_gn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_rows
    n_mask = offs_n < d_out
    slots = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
    mask = (m_mask & (slots >= 0))[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + slots[:, None] * stride_gs + offs_n[None, :] * stride_gn, mask=mask, other=1.0)
    g = g.to(tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = y * g + (1.0 - g) * b
    else:
        out = y * g
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


def dora_rescale_triton(y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                        block_m: int = 16, block_n: int = 128) -> None:
    """In place on y [T, d_out] (any strides): rows with slots[t] >= 0 get g[slots[t]] * (y - bias) + bias.
    g [n_slots, d_out], bias [d_out] or None, slots [T] (int32 or int64) on y's device."""
    num_rows, d_out = y.shape
    if num_rows == 0:
        return
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(d_out, block_n))
    _dora_rescale_kernel[grid](y, g, bias if bias is not None else y, slots, num_rows, d_out, y.stride(0),
                               y.stride(1), g.stride(0), g.stride(1), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                               BLOCK_N=block_n)
