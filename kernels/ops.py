"""One dispatch for the LoRA ops: Triton on CUDA tensors, the torch path on CPU.

`LoRABatch` is the per-step metadata (segments + the per-token slot map on the device), built once
per step and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from loramux.kernels import torch_ops
from loramux.kernels.segments import Segments, build_segments
from loramux.kernels.torch_ops import lora_expand_torch, lora_shrink_torch


@dataclass
class LoRABatch:
    segments: Segments
    slot_map: torch.Tensor  # [T] long, -1 = base model only
    seg_tensors: tuple | None = None  # (starts, lengths, slots) int32 on the device, for Triton
    _row_weights: dict = field(default_factory=dict)

    def row_weights(self, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, max_slot + 1]: scale[slot] at each row's own slot, zero elsewhere (built once per step)."""
        key = (id(scale), dtype)
        if key not in self._row_weights:
            k = self.segments.max_slot + 1
            onehot = self.slot_map.unsqueeze(1) == torch.arange(k, device=self.slot_map.device)
            self._row_weights[key] = (onehot * scale[:k]).to(dtype)
        return self._row_weights[key]

    @classmethod
    def from_slot_map(cls, slot_map: list[int], device: torch.device | str = "cpu") -> LoRABatch:
        seg = build_segments(slot_map)
        tensors = None
        if torch.device(device).type == "cuda" and seg.has_lora:
            tensors = tuple(torch.tensor(v, dtype=torch.int32, device=device)
                            for v in (seg.starts, seg.lengths, seg.slots))
        return cls(seg, torch.tensor(slot_map, dtype=torch.long, device=device), tensors)


@dataclass
class LoRACost:
    """What the LoRA path has touched so far, counted from the shapes each op is given (not timed):
    multiply-adds and bytes of adapter weights read. Tests use it to check that an adapter costs its own
    rank; `lora_shrink_expand` adds to the one it is handed."""

    macs: int = 0
    weight_bytes: int = 0

    def reset(self) -> None:
        self.macs = self.weight_bytes = 0


def _count(cost: LoRACost, strategy: str, seg: Segments, a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    """loop / Triton: each segment's rows times its own slot's matrices, each active slot read once;
    dense: every row of the batch times slots 0..max_slot (each read once); gather: one copy per row."""
    rank = bs[0].shape[2]
    per_row = rank * (a.shape[1] // rank * a.shape[2] + sum(b.shape[1] for b in bs))  # shrink + expands
    element = a.element_size()
    if strategy == "dense":
        k = seg.max_slot + 1
        cost.macs += seg.num_tokens * k * per_row
        cost.weight_bytes += k * per_row * element
    elif strategy == "gather":
        rows = sum(seg.lengths)
        cost.macs += rows * per_row
        cost.weight_bytes += rows * per_row * element
    else:
        cost.macs += sum(seg.lengths) * per_row
        cost.weight_bytes += len(seg.active_slots) * per_row * element


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


LORA_IMPLS = ("auto", "triton", "torch")


def resolve_lora_impl(impl: str, device: torch.device | str) -> str:
    """"triton" or "torch" for `impl` on `device`: "auto" picks Triton on CUDA when it is installed."""
    if impl not in LORA_IMPLS:
        raise ValueError(f"LoRA implementation must be one of {', '.join(LORA_IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    return impl


def _use_triton(x: torch.Tensor, impl: str | None) -> bool:
    """`impl` None = decide by the tensor's device (as "auto")."""
    return resolve_lora_impl(impl or "auto", x.device) == "triton"


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


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                       offsets: list[int], scale: torch.Tensor, batch: LoRABatch, impl: str | None = None,
                       cost: LoRACost | None = None) -> None:
    """Stacked slices: one shrink against A = [n_slots, n_slices * R, d_in], then one expand per slice
    (B_i [n_slots, d_out_i, R] into columns offsets[i]...). Same result as lora_shrink + lora_expand;
    on CPU with many short segments it fuses them (see torch_ops.shrink_expand_dense). `cost`, when
    given, is charged with what the op touches (see LoRACost)."""
    triton = _use_triton(x, impl)
    strategy = "triton" if triton else torch_ops.pick_strategy(batch.segments)
    if cost is not None:
        _count(cost, strategy, batch.segments, a, bs)
    if strategy == "dense":
        torch_ops.shrink_expand_dense(y, x, a, bs, offsets, batch.row_weights(scale, x.dtype), batch.segments)
        return
    v = lora_shrink(x, a, batch, impl)
    rank = bs[0].shape[2]
    for i, (b, offset) in enumerate(zip(bs, offsets)):
        lora_expand(y, v[:, i * rank:(i + 1) * rank], b, scale, batch, col_offset=offset, impl=impl)
