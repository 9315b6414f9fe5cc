"""Triton kernels of the grouped MoE ops (GPU; also run on CPU under TRITON_INTERPRET=1). Same semantics as
`loramux.kernels.moe` (see there).

grouped_matmul: one launch for every expert of a step. The grid is (row tile, column tile, segment), a
segment being one present expert's run of sorted pairs, as SGMV's segments are an adapter's run of rows:
each program multiplies a [BLOCK_M, d_in] tile of its expert's rows by a [d_in, BLOCK_N] tile of that
expert's weight with `tl.dot` (fp32 accumulate). Row tiles past a segment's end exit at once. Row tiles vary
fastest, so the programs that share a weight tile run together.

expert_lora: the SGMV shrink / expand kernels of `triton_ops` on the plan's runs (an index per virtual slot
is all they read), directly on x and y when each v's rows are one run, else on the live rows gathered in v
order and added back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux.kernels.triton_ops import lora_expand_triton, lora_shrink_triton

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _grouped_mm_kernel(  # noqa: PLR0913 (a Triton kernel takes its pointers, sizes and strides one by one)
        x_ptr, w_ptr, bias_ptr, out_ptr, starts_ptr, lengths_ptr, experts_ptr, d_in, d_out, stride_xm, stride_xk,
        stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_om, stride_on, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    block = tl.program_id(0)
    col_block = tl.program_id(1)
    seg = tl.program_id(2)
    length = tl.load(lengths_ptr + seg)
    if block * BLOCK_M < length:
        start = tl.load(starts_ptr + seg)
        expert = tl.load(experts_ptr + seg).to(tl.int64)
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < length
        n_mask = offs_n < d_out
        rows = (start + offs_m).to(tl.int64)
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < d_in
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_base + k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:  # float32 inputs: true fp32 products (the default would round them to TF32)
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + offs_n * stride_bn, mask=n_mask, other=0.0
                           ).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_m(max_count: int) -> int:
    """16 rows (tl.dot's least) for decode-sized runs, up to 64 for prefill's long ones."""
    return min(64, max(16, triton.next_power_of_2(max(max_count, 1))))


def grouped_matmul_triton(x: torch.Tensor, w: torch.Tensor, groups, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
    num_pairs, d_in = x.shape
    d_out = w.shape[2]
    out = torch.empty(num_pairs, d_out, dtype=x.dtype, device=x.device)
    if not groups.present:
        return out
    starts, lengths, experts = groups.seg_tensors(x.device)
    block_m = _block_m(groups.max_count)
    grid = (triton.cdiv(groups.max_count, block_m), triton.cdiv(d_out, BLOCK_N), len(groups.present))
    bias_arg = bias if bias is not None else out  # never read without HAS_BIAS
    _grouped_mm_kernel[grid](x, w, bias_arg, out, starts, lengths, experts, d_in, d_out, x.stride(0), x.stride(1),
                             w.stride(0), w.stride(1), w.stride(2), bias_arg.stride(0), bias_arg.stride(-1),
                             out.stride(0), out.stride(1), HAS_BIAS=bias is not None, BLOCK_M=block_m,
                             BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return out


def expert_lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                       plan) -> None:
    seg = plan.segments()
    if plan.order is None:
        lora_expand_triton(y, lora_shrink_triton(x, a, seg), b, scale, seg)
        return
    xs = x.index_select(0, plan.order)
    delta = torch.zeros(plan.num_live, y.shape[1], dtype=y.dtype, device=y.device)
    lora_expand_triton(delta, lora_shrink_triton(xs, a, seg), b, scale, seg)
    y.index_add_(0, plan.order, delta)
