"""Triton SGMV and BGMV kernels for LoRA shrink / expand (GPU; also run on CPU under TRITON_INTERPRET=1).

Same semantics as `torch_ops` (see there).

SGMV (`lora_shrink_triton`, `lora_expand_triton`): the grid is (segment, row block[, column block]): each
program multiplies one tile of a segment's rows by that segment's adapter matrices with `tl.dot`, so a long
prefill segment is a real GEMM and a decode token a 16-row tile with one live row (as Punica's SGMV).

BGMV (`bgmv_shrink_triton`, `bgmv_expand_triton`): the grid is over tokens (row by row, each reading its own
slot from a per-token index, -1 = skip), so it depends only on the token count, never on how the tokens
group into adapters: a CUDA graph captured once per batch size serves any mix (vLLM punica's
`token_lora_mapping`). Each program is a mat-vec with `tl.sum` (decode rows share no adapter matrix tile).
The torch version is `loramux.kernels.bgmv`.
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


# -- BGMV: one row per program, the row's slot read from a per-token index (fixed-shape, graph-capturable) ---
BGMV_TARGET_PROGRAMS = 512  # split the shrink's reduction until about this many programs run
BGMV_MIN_SPLIT_K = 512  # ... but give each program at least this many input columns (untuned: no GPU measured)


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, slots_ptr, v_ptr, d_in, rows, stride_xm, stride_xk, stride_as, stride_ar,
                        stride_ak, stride_vs, stride_vm, stride_vr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    t = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: the row has no adapter in this bucket (or is padding); its v row stays zero
        offs_k = tl.arange(0, BLOCK_K)
        r_mask = offs_r < rows
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(tl.program_id(2) * BLOCK_K, d_in, BLOCK_K * SPLIT_K):
            k = k0 + offs_k
            k_mask = k < d_in
            x = tl.load(x_ptr + t * stride_xm + k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + k[None, :] * stride_ak,
                        mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        # Each split stores its own partial sum (summed by the caller): deterministic, unlike atomics, so a
        # replayed graph gives the eager run's numbers exactly.
        tl.store(v_ptr + tl.program_id(2) * stride_vs + t * stride_vm + offs_r * stride_vr, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(v_ptr, b_ptr, scale_ptr, slots_ptr, y_ptr, d_out, rank, v_col, col_offset, stride_vm,
                        stride_vr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        n_mask = offs_n < d_out
        v = tl.load(v_ptr + t * stride_vm + (v_col + offs_r) * stride_vr, mask=r_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                    mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)  # B tile [N, R]
        delta = tl.sum(b * v[None, :], axis=1) * tl.load(scale_ptr + slot).to(tl.float32)
        y_ptrs = y_ptr + t * stride_ym + (col_offset + offs_n) * stride_yn
        y = tl.load(y_ptrs, mask=n_mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def bgmv_split_k(num_tokens: int, rows: int, d_in: int, block_r: int) -> int:
    """How many programs share one row's shrink reduction (partial sums added atomically)."""
    programs = num_tokens * triton.cdiv(rows, block_r)
    return max(1, min(d_in // BGMV_MIN_SPLIT_K, BGMV_TARGET_PROGRAMS // max(1, programs)))


def bgmv_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, split_k: int | None = None
                       ) -> torch.Tensor:
    """v [T, rows] float32: v[t] = x[t] @ A[slots[t]]^T, zero where slots[t] < 0. A [n_slots, rows, d_in]."""
    num_tokens, (rows, d_in) = x.shape[0], a.shape[1:]
    block_r = min(64, max(16, triton.next_power_of_2(rows)))
    split_k = split_k or bgmv_split_k(num_tokens, rows, d_in, block_r)
    v = torch.zeros(split_k, num_tokens, rows, dtype=torch.float32, device=x.device)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(rows, block_r), split_k)
        _bgmv_shrink_kernel[grid](x, a, slots, v, d_in, rows, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
                                  a.stride(2), v.stride(0), v.stride(1), v.stride(2), BLOCK_R=block_r, BLOCK_K=64,
                                  SPLIT_K=split_k)
    return v[0] if split_k == 1 else v.sum(0)


def bgmv_expand_triton(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                       col_offset: int = 0, v_col: int = 0) -> None:
    """In place: y[t, off:off+d_out] += (v[t, v_col:v_col+R] @ B[slots[t]]^T) * scale[slots[t]] where slots[t] >= 0.
    B [n_slots, d_out, R] (any strides)."""
    num_tokens, (d_out, rank) = y.shape[0], b.shape[1:]
    if num_tokens == 0:
        return
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = 128 if block_r <= 32 else 64
    grid = (num_tokens, triton.cdiv(d_out, block_n))
    _bgmv_expand_kernel[grid](v, b, scale, slots, y, d_out, rank, v_col, col_offset, v.stride(0), v.stride(1),
                              b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
                              BLOCK_N=block_n, BLOCK_R=block_r)
