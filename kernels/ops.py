"""One dispatch for the LoRA ops: Triton on CUDA tensors, the torch path on CPU.

`LoRABatch` is the per-step metadata, built once per step and shared by every layer: the segments and
their device tensors for Triton, the rows grouped by slot for the torch path.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from loramux.kernels import torch_ops
from loramux.kernels.segments import Segments, build_groups, build_segments
from loramux.kernels.torch_ops import GroupedRows, lora_expand_torch, lora_shrink_torch


@dataclass
class LoRABatch:
    segments: Segments
    slot_map: torch.Tensor  # [T] long, -1 = base model only
    seg_tensors: tuple | None = None  # (starts, lengths, slots) int32 on the device, for Triton
    _slot_list: tuple[int, ...] = ()
    _rows: GroupedRows | None = None

    @property
    def rows(self) -> GroupedRows:
        """The rows grouped by slot, for the torch path (built on first use, once per step)."""
        if self._rows is None:
            self._rows = GroupedRows(build_groups(self._slot_list), self.slot_map.device)
        return self._rows

    @classmethod
    def from_slot_map(cls, slot_map: list[int], device: torch.device | str = "cpu") -> LoRABatch:
        seg = build_segments(slot_map)
        tensors = None
        if torch.device(device).type == "cuda" and seg.has_lora:
            tensors = tuple(torch.tensor(v, dtype=torch.int32, device=device)
                            for v in (seg.starts, seg.lengths, seg.slots))
        return cls(seg, torch.tensor(slot_map, dtype=torch.long, device=device), tensors, tuple(slot_map))


@dataclass
class LoRACost:
    """What the LoRA path has touched so far, counted from the shapes each op is given (not timed):
    multiply-adds and bytes of adapter weights read. Tests use it to check that an adapter costs its own
    rank; `lora_shrink_expand` adds to the one it is handed."""

    macs: int = 0
    weight_bytes: int = 0

    def reset(self) -> None:
        self.macs = self.weight_bytes = 0


def _count(cost: LoRACost, batch: LoRABatch, triton: bool, a: torch.Tensor, bs: list[torch.Tensor]) -> None:
    """Each active slot's matrices are read once; each adapter row costs its own rank, and on the torch
    path's bmm strategy so does each padding row of a group shorter than the longest."""
    per_row = a.shape[1] * a.shape[2] + sum(b.shape[1] * b.shape[2] for b in bs)  # shrink + each slice's expand
    seg = batch.segments
    rows = sum(seg.lengths)
    if not triton and batch.rows.strategy == "bmm":
        rows = batch.rows.groups.num_groups * batch.rows.groups.max_count
    cost.macs += rows * per_row
    cost.weight_bytes += len(seg.active_slots) * per_row * a.element_size()


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
    if impl == "torch" or impl == "triton":  # already resolved: the per-layer path asks ~100 times a step
        return impl == "triton"
    return resolve_lora_impl(impl or "auto", x.device) == "triton"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch, impl: str | None = None) -> torch.Tensor:
    """v[t] = x[t] @ A[slot[t]]^T (zero for base-only rows). x [T, d_in], A [n_slots, R, d_in] -> [T, R]."""
    if _use_triton(x, impl):
        from loramux.kernels.triton_ops import lora_shrink_triton

        return lora_shrink_triton(x, a, batch.segments, batch.seg_tensors)
    return lora_shrink_torch(x, a, batch.rows)


def lora_expand(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, batch: LoRABatch,
                col_offset: int = 0, impl: str | None = None) -> None:
    """In place: y[t, off:off+d_out] += (v[t] @ B[slot[t]]^T) * scale[slot[t]]. B [n_slots, d_out, R]."""
    if _use_triton(y, impl):
        from loramux.kernels.triton_ops import lora_expand_triton

        lora_expand_triton(y, v, b, scale, batch.segments, col_offset, batch.seg_tensors)
        return
    lora_expand_torch(y, v, b, scale, batch.rows, col_offset)


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                       offsets: list[int], scale: torch.Tensor, batch: LoRABatch, impl: str | None = None,
                       cost: LoRACost | None = None, operand_cache: dict | None = None) -> None:
    """Stacked slices: one shrink against A = [n_slots, R_0 + R_1 + ..., d_in] (slice i's rows after those of
    the slices before it), then one expand per slice (B_i [n_slots, d_out_i, R_i] into columns offsets[i]...).
    `scale` is [n_slots] (every slice) or [n_slices, n_slots] (slice i scaled by scale[i]). Same result as
    lora_shrink + lora_expand.
    `cost`, when given, is charged with what the op touches (see LoRACost). `operand_cache`: a dict that
    belongs to these very stacks (LoRALayerWeights holds one), where the torch path keeps operand views
    across steps; never share one between different stacks."""
    triton = _use_triton(x, impl)
    if cost is not None:
        _count(cost, batch, triton, a, bs)
    if not triton:
        torch_ops.shrink_expand_torch(y, x, a, bs, offsets, scale, batch.rows, operand_cache)
        return
    v = lora_shrink(x, a, batch, impl)
    column = 0
    for i, (b, offset) in enumerate(zip(bs, offsets)):
        rank = b.shape[2]
        lora_expand(y, v[:, column:column + rank], b, scale if scale.dim() == 1 else scale[i], batch,
                    col_offset=offset, impl=impl)
        column += rank
