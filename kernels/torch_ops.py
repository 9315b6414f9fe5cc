"""CPU (and fallback) implementations of the LoRA shrink / expand ops in plain torch.

Semantics (shared with the Triton kernels):
    lora_shrink: v[t, :]  = x[t, :] @ A[slot[t]]^T                     for rows in a segment, else 0
    lora_expand: y[t, o:o+d_out] += (v[t, :] @ B[slot[t]]^T) * scale[slot[t]]   for rows in a segment
with A: [n_slots, R, d_in], B: [n_slots, d_out, R] (PEFT's lora_A / lora_B per slot, zero-padded to the
pool's max rank R) and scale: [n_slots].

Three strategies, picked per call from the segment shape (bench/multi_lora.py measures them):
  * loop:   one GEMM pair per segment; best for few or long segments (prefill, one adapter).
  * dense:  for many short segments (decode with many adapters): one GEMM against the A matrices of
            slots 0..max_slot stacked, each row keeping its own slot's block, then one GEMM against
            the stacked B matrices with every other block zeroed. Reads each active slot's weights
            once and copies none of them; the wasted multiply-adds (x max_slot) are cheap at decode
            sizes.
  * gather: each row gathers its slot's matrices and runs a batched mat-vec (large batches of
            short segments, where dense would waste too much compute).
"""
from __future__ import annotations

import torch

from loramux.kernels.segments import Segments

# Loop when there are at most this many segments, or segments average at least LOOP_MIN_AVG_SEGMENT rows.
LOOP_MAX_SEGMENTS = 2
LOOP_MIN_AVG_SEGMENT = 8
# Dense only while rows x stacked slots stays small (the wasted work grows with both).
DENSE_MAX_ROWS_X_SLOTS = 2048


def pick_strategy(seg: Segments) -> str:
    if seg.num_segments <= LOOP_MAX_SEGMENTS or seg.num_tokens >= LOOP_MIN_AVG_SEGMENT * seg.num_segments:
        return "loop"
    if seg.num_tokens * (seg.max_slot + 1) <= DENSE_MAX_ROWS_X_SLOTS:
        return "dense"
    return "gather"


def _stacked_t(a: torch.Tensor, k: int) -> torch.Tensor:
    """A of slots 0..k-1 as one [d_in, k * rows] operand: a view for the slot pool's CPU layout
    ([d_in, slots, rows] seen through a permute), a copy otherwise."""
    return a[:k].permute(2, 0, 1).reshape(a.shape[2], k * a.shape[1])


def _row_mask(slot_map: torch.Tensor, num_slots: int, dtype) -> torch.Tensor:
    """[T, num_slots] one-hot of each row's slot (all zero for base-only rows)."""
    return (slot_map.unsqueeze(1) == torch.arange(num_slots, device=slot_map.device)).to(dtype)


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, seg: Segments, slot_map: torch.Tensor,
                      strategy: str | None = None) -> torch.Tensor:
    """v [T, R] (dtype of x); rows outside segments are zero. `slot_map` [T] long, -1 = no adapter."""
    num_tokens, rank = x.shape[0], a.shape[1]
    if not seg.has_lora:
        return x.new_zeros(num_tokens, rank)
    strategy = strategy or pick_strategy(seg)
    if strategy == "loop":
        v = x.new_zeros(num_tokens, rank)
        for start, length, slot in zip(seg.starts, seg.lengths, seg.slots):
            torch.matmul(x[start:start + length], a[slot].t(), out=v[start:start + length])
        return v
    if strategy == "dense":
        k = seg.max_slot + 1
        v_all = (x @ _stacked_t(a, k)).view(num_tokens, k, rank)
        return (v_all * _row_mask(slot_map, k, x.dtype).unsqueeze(2)).sum(1)
    rows = slot_map.clamp(min=0)
    v = torch.bmm(a.index_select(0, rows), x.unsqueeze(2)).squeeze(2)  # [T, R]
    if seg.num_tokens != sum(seg.lengths):  # some rows are base-only: zero them
        v = v * (slot_map >= 0).unsqueeze(1).to(v.dtype)
    return v


def lora_expand_torch(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, seg: Segments,
                      slot_map: torch.Tensor, col_offset: int = 0, strategy: str | None = None) -> None:
    """In place: y[:, col_offset:col_offset + d_out] += (v @ B[slot]^T) * scale[slot] on segment rows."""
    d_out, rank = b.shape[1], b.shape[2]
    if not seg.has_lora:
        return
    target = y[:, col_offset:col_offset + d_out]
    strategy = strategy or pick_strategy(seg)
    if strategy == "loop":
        for start, length, slot in zip(seg.starts, seg.lengths, seg.slots):
            target[start:start + length].addmm_(v[start:start + length], b[slot].t(), alpha=float(scale[slot]))
        return
    if strategy == "dense":
        k = seg.max_slot + 1
        weights = _row_mask(slot_map, k, v.dtype) * scale[:k].to(v.dtype)  # [T, k]: scale on the row's slot
        spread = (weights.unsqueeze(2) * v.unsqueeze(1)).reshape(v.shape[0], k * rank)
        # b is [slots, d_out, R]; its transpose [slots, R, d_out] is contiguous in the slot pool's layout.
        target.addmm_(spread, b[:k].transpose(1, 2).reshape(k * rank, d_out))
        return
    rows = slot_map.clamp(min=0)
    factor = scale.index_select(0, rows) * (slot_map >= 0).to(scale.dtype)
    delta = torch.bmm(b.index_select(0, rows), (v * factor.unsqueeze(1).to(v.dtype)).unsqueeze(2)).squeeze(2)
    target.add_(delta)


def shrink_expand_dense(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                        offsets: list[int], row_weights: torch.Tensor, seg: Segments) -> None:
    """Fused dense shrink + expand for stacked slices: x @ A of slots 0..k at once, each row's own slot
    block kept (times its scale) by `row_weights` [T, k], then one GEMM per slice against B of slots 0..k."""
    k = seg.max_slot + 1
    num_tokens = x.shape[0]
    rank = bs[0].shape[2]
    n_slices = len(bs)
    v_all = (x @ _stacked_t(a, k)).view(num_tokens, k, n_slices, rank)
    v_all.mul_(row_weights.unsqueeze(2).unsqueeze(3))
    for i, (b, offset) in enumerate(zip(bs, offsets)):
        d_out = b.shape[1]
        spread = v_all[:, :, i].reshape(num_tokens, k * rank)
        y[:, offset:offset + d_out].addmm_(spread, b[:k].transpose(1, 2).reshape(k * rank, d_out))


def lora_shrink_reference(x, a, slot_map):
    """Float64 reference of lora_shrink, one row at a time (tests and bench/gpu_check.py)."""
    x64, a64 = x.double().cpu(), a.double().cpu()
    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slot_map.tolist()):
        if slot >= 0:
            v[t] = x64[t] @ a64[slot].t()
    return v


def lora_expand_reference(y, v, b, scale, slot_map, col_offset=0):
    """Float64 reference of lora_expand, one row at a time; returns a new tensor."""
    out = y.double().cpu().clone()
    v64, b64, scale64 = v.double().cpu(), b.double().cpu(), scale.double().cpu()
    d_out = b.shape[1]
    for t, slot in enumerate(slot_map.tolist()):
        if slot >= 0:
            out[t, col_offset:col_offset + d_out] += (v64[t] @ b64[slot].t()) * scale64[slot]
    return out
