"""One dispatch for the LoRA ops: Triton on CUDA tensors, the torch path on CPU.

`LoRABatch` is the per-step metadata (segments + the per-token slot map on the device), built once
per step and shared by every layer.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from loramux.kernels.segments import Segments, build_segments
from loramux.kernels.torch_ops import lora_expand_torch, lora_shrink_torch


@dataclass
class LoRABatch:
    segments: Segments
    slot_map: torch.Tensor  # [T] long, -1 = base model only
    seg_tensors: tuple | None = None  # (starts, lengths, slots) int32 on the device, for Triton

    @classmethod
    def from_slot_map(cls, slot_map: list[int], device: torch.device | str = "cpu") -> "LoRABatch":
        seg = build_segments(slot_map)
        tensors = None
        if torch.device(device).type == "cuda" and seg.has_lora:
            tensors = tuple(torch.tensor(v, dtype=torch.int32, device=device)
                            for v in (seg.starts, seg.lengths, seg.slots))
        return cls(seg, torch.tensor(slot_map, dtype=torch.long, device=device), tensors)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(x: torch.Tensor, impl: str | None) -> bool:
    impl = impl or os.environ.get("LORAMUX_LORA_IMPL", "auto")
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    return x.is_cuda and triton_available()


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, impl: str | None = None) -> torch.Tensor:
    """v[t] = x[t] @ A[slot[t]]^T (zero for base-only rows). x [T, d_in], A [n_slots, R, d_in] -> [T, R]."""
    if _use_triton(x, impl):
        from loramux.kernels.triton_ops import lora_shrink_triton

        return lora_shrink_triton(x, a, batch.segments, batch.seg_tensors)
    return lora_shrink_torch(x, a, batch.segments, batch.slot_map)


def lora_expand(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, batch: LoRABatch,
                col_offset: int = 0, impl: str | None = None) -> None:
    """In place: y[t, off:off+d_out] += (v[t] @ B[slot[t]]^T) * scale[slot[t]]. B [n_slots, d_out, R]."""
    if _use_triton(y, impl):
        from loramux.kernels.triton_ops import lora_expand_triton

        lora_expand_triton(y, v, b, scale, batch.segments, col_offset, batch.seg_tensors)
        return
    lora_expand_torch(y, v, b, scale, batch.segments, batch.slot_map, col_offset)
