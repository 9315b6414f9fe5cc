"""CPU (and fallback) implementations of the LoRA shrink / expand ops in plain torch.

Semantics (shared with the Triton kernels):
    lora_shrink: v[t, :]  = x[t, :] @ A[slot[t]]^T                     for rows in a segment, else 0
    lora_expand: y[t, o:o+d_out] += (v[t, :] @ B[slot[t]]^T) * scale[slot[t]]   for rows in a segment
with A: [n_slots, R, d_in], B: [n_slots, d_out, R] (PEFT's lora_A / lora_B per slot, zero-padded to the
pool's max rank R) and scale: [n_slots].

Two strategies, picked per call from the segment shape (thresholds measured by bench/multi_lora.py):
  * segment loop: one GEMM pair per segment; best when segments are long (prefill).
  * gather + bmm: each row gathers its slot's matrices and does a batched mat-vec; best when most
    segments are a token or two (decode), where a loop would pay per-call overhead per token.
"""
from __future__ import annotations

import torch

from loramux.kernels.segments import Segments

# Use the segment loop when segments average at least this many rows (measured on CPU).
LOOP_MIN_AVG_SEGMENT = 8


def _use_loop(seg: Segments) -> bool:
    return seg.num_tokens >= LOOP_MIN_AVG_SEGMENT * max(1, seg.num_segments)


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, seg: Segments, slot_map: torch.Tensor) -> torch.Tensor:
    """v [T, R] (dtype of x); rows outside segments are zero. `slot_map` [T] long, -1 = no adapter."""
    num_tokens, rank = x.shape[0], a.shape[1]
    if _use_loop(seg):
        v = x.new_zeros(num_tokens, rank)
        for start, length, slot in zip(seg.starts, seg.lengths, seg.slots):
            torch.matmul(x[start:start + length], a[slot].t(), out=v[start:start + length])
        return v
    rows = slot_map.clamp(min=0)
    v = torch.bmm(a.index_select(0, rows), x.unsqueeze(2)).squeeze(2)  # [T, R]
    if seg.num_tokens != sum(seg.lengths):  # some rows are base-only: zero them
        v = v * (slot_map >= 0).unsqueeze(1).to(v.dtype)
    return v


def lora_expand_torch(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, seg: Segments,
                      slot_map: torch.Tensor, col_offset: int = 0) -> None:
    """In place: y[:, col_offset:col_offset + d_out] += (v @ B[slot]^T) * scale[slot] on segment rows."""
    d_out = b.shape[1]
    target = y[:, col_offset:col_offset + d_out]
    if _use_loop(seg):
        for start, length, slot in zip(seg.starts, seg.lengths, seg.slots):
            target[start:start + length].addmm_(v[start:start + length], b[slot].t(), alpha=float(scale[slot]))
        return
    rows = slot_map.clamp(min=0)
    factor = scale.index_select(0, rows) * (slot_map >= 0).to(scale.dtype)
    delta = torch.bmm(b.index_select(0, rows), (v * factor.unsqueeze(1).to(v.dtype)).unsqueeze(2)).squeeze(2)
    target.add_(delta)


def lora_shrink_reference(x, a, slot_map):
    """Row-by-row float64 reference of lora_shrink (tests only)."""
    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slot_map.tolist()):
        if slot >= 0:
            v[t] = x[t].double() @ a[slot].double().t()
    return v


def lora_expand_reference(y, v, b, scale, slot_map, col_offset=0):
    """Row-by-row float64 reference of lora_expand (tests only); returns a new tensor."""
    out = y.double().clone()
    d_out = b.shape[1]
    for t, slot in enumerate(slot_map.tolist()):
        if slot >= 0:
            out[t, col_offset:col_offset + d_out] += (v[t].double() @ b[slot].double().t()) * float(scale[slot])
    return out
