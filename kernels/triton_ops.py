"""Triton SGMV kernels for LoRA shrink / expand (GPU; also run on CPU under TRITON_INTERPRET=1).

Same semantics as `torch_ops` (see there). The grid is (segment, row block[, column block]): each program
multiplies one tile of a segment's rows by that segment's adapter matrices with `tl.dot`, so a long
prefill segment is a real GEMM and a decode token a 16-row tile with one live row (as Punica's SGMV).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux.kernels.segments import Segments

BLOCK_M = 16


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, v_ptr, starts_ptr, lengths_ptr, slots_ptr, d_in, rank,
                   stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_vm, stride_vr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    seg = tl.program_id(0)
    block = tl.program_id(1)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lengths_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < length  # programs past the segment's end load nothing and store nothing
    rows = (start + offs_m).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=m_mask[:, None] & (k[None, :] < d_in), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + k[:, None] * stride_ak,
                    mask=(offs_r[None, :] < rank) & (k[:, None] < d_in), other=0.0)  # A^T tile [K, R]
        if IEEE:  # float32 inputs: true fp32 products (the default would round them to TF32)
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(v_ptr + rows[:, None] * stride_vm + offs_r[None, :] * stride_vr, acc.to(v_ptr.dtype.element_ty),
             mask=m_mask[:, None] & (offs_r[None, :] < rank))


@triton.jit
def _expand_kernel(v_ptr, b_ptr, scale_ptr, y_ptr, starts_ptr, lengths_ptr, slots_ptr, d_out, rank, col_offset,
                   stride_vm, stride_vr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    seg = tl.program_id(0)
    block = tl.program_id(1)
    col_block = tl.program_id(2)
    start = tl.load(starts_ptr + seg)
    length = tl.load(lengths_ptr + seg)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    scale = tl.load(scale_ptr + slot).to(tl.float32)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < length
    n_mask = offs_n < d_out
    rows = (start + offs_m).to(tl.int64)
    v = tl.load(v_ptr + rows[:, None] * stride_vm + offs_r[None, :] * stride_vr,
                mask=m_mask[:, None] & (offs_r[None, :] < rank), other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                mask=(offs_r[:, None] < rank) & n_mask[None, :], other=0.0)  # B^T tile [R, N]
    if IEEE:
        delta = tl.dot(v, b, input_precision="ieee") * scale
    else:
        delta = tl.dot(v, b) * scale
    y_ptrs = y_ptr + rows[:, None] * stride_ym + (col_offset + offs_n)[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot needs every dimension >= 16


def _segment_tensors(seg: Segments, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(seg.starts), as_tensor(seg.lengths), as_tensor(seg.slots)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, seg: Segments, seg_tensors=None) -> torch.Tensor:
    v = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    if not seg.has_lora:
        return v
    starts, lengths, slots = seg_tensors or _segment_tensors(seg, x.device)
    rank, d_in = a.shape[1], a.shape[2]
    grid = (seg.num_segments, triton.cdiv(seg.max_length, BLOCK_M))
    _shrink_kernel[grid](x, a, v, starts, lengths, slots, d_in, rank, x.stride(0), x.stride(1), a.stride(0),
                         a.stride(1), a.stride(2), v.stride(0), v.stride(1), BLOCK_M=BLOCK_M,
                         BLOCK_R=_block_r(rank), BLOCK_K=64, IEEE=x.dtype == torch.float32)
    return v


def lora_expand_triton(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, seg: Segments,
                       col_offset: int = 0, seg_tensors=None, block_n: int = 64) -> None:
    if not seg.has_lora:
        return
    starts, lengths, slots = seg_tensors or _segment_tensors(seg, y.device)
    d_out, rank = b.shape[1], b.shape[2]
    grid = (seg.num_segments, triton.cdiv(seg.max_length, BLOCK_M), triton.cdiv(d_out, block_n))
    _expand_kernel[grid](v, b, scale, y, starts, lengths, slots, d_out, rank, col_offset, v.stride(0), v.stride(1),
                         b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1), BLOCK_M=BLOCK_M,
                         BLOCK_R=_block_r(rank), BLOCK_N=block_n, IEEE=v.dtype == torch.float32)
