"""The one LoRA entry point for model layers (as vLLM's punica wrapper).

Semantics, for every row i of the step's flat batch and every slice of a merged projection:
    y[i, slice] += (x[i] @ A_slice[slot[i]]^T) @ B_slice[slot[i]]^T * scale[slot[i]]
where slot[i] = -1 (base model only) leaves the row untouched. The engine sets the per-token slot map
once per step; every layer then calls `apply` with its own stacked buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.kernels.ops import LoRABatch, lora_shrink_expand, resolve_lora_impl


@dataclass
class LoRALayerWeights:
    """Stacked adapter-slot buffers of one merged projection.

    a: [n_slots, n_slices * R, d_in]: the slices' A matrices stacked so one shrink serves them all.
    b: one [n_slots, d_out_slice, R] per slice; offsets: the slice's first output column.
    scale: [n_slots] (the adapter's alpha / r). Unused slices or slots hold zeros.
    """

    a: torch.Tensor
    b: list[torch.Tensor]
    offsets: list[int]
    scale: torch.Tensor
    names: list[str]  # slice names, e.g. ["q", "k", "v"]

    @property
    def rank(self) -> int:
        return self.b[0].shape[2]


class LoRAWrapper:
    def __init__(self, impl: str = "auto", device: torch.device | str = "cpu") -> None:
        """`impl`: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch"; resolved once, here."""
        self.impl = resolve_lora_impl(impl, device)
        self.batch: LoRABatch | None = None

    def set_batch(self, slot_map: list[int] | None, device: torch.device | str = "cpu") -> None:
        """Per step: the adapter slot of every row (-1 = none), or None when no row uses an adapter."""
        self.batch = None if slot_map is None or max(slot_map, default=-1) < 0 else \
            LoRABatch.from_slot_map(slot_map, device)

    def apply(self, y: torch.Tensor, x: torch.Tensor, weights: LoRALayerWeights | None) -> torch.Tensor:
        """Add the LoRA deltas of this step's adapters to y = base(x), in place; returns y."""
        if self.batch is None or weights is None:
            return y
        lora_shrink_expand(y, x, weights.a, weights.b, weights.offsets, weights.scale, self.batch, impl=self.impl)
        return y
