"""Fixed-shape LoRA for captured decode steps (BGMV, as vLLM punica's `token_lora_mapping`).

The segment ops (`loramux.kernels.ops`) take Python segment lists built per step, and their launch grids
follow the number of segments: a CUDA graph cannot replay them for another mix of adapters. Here every row
carries its own slot in a per-token index tensor of fixed length (one per rank bucket; -1 = the row has no
adapter in that bucket, or is padding), and the ops' shapes depend only on the row count:

    bgmv_shrink: v[t] = x[t] @ A[slots[t]]^T                                   (0 where slots[t] < 0)
    bgmv_expand: y[t, off:off+d_out] += (v[t] @ B[slots[t]]^T) * scale[slots[t]]  (rows with slots[t] >= 0)
    then, DoRA buckets only: y[t] = g[slots[t]] * (y[t] - bias) + bias             (rows with slots[t] >= 0)

the same semantics as `lora_shrink` / `lora_expand` with the per-token slot map. Triton on CUDA
(`loramux.kernels.triton_ops`), the gather + batched mat-vec below otherwise; both are capturable.
`StaticLoRA` applies them with the LoRA wrapper's semantics (see `loramux.kernels.wrapper`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.kernels.dora import dora_rescale_torch


def bgmv_shrink_torch(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """v [T, rows] in x's dtype. x [T, d_in], A [n_slots, rows, d_in] (any strides), slots [T] long."""
    v = torch.bmm(a.index_select(0, slots.clamp(min=0)), x.unsqueeze(2)).squeeze(2)
    return v * (slots >= 0).unsqueeze(1).to(v.dtype)


def bgmv_expand_torch(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                      col_offset: int = 0) -> None:
    """In place on y's columns [col_offset, col_offset + d_out). v [T, R], B [n_slots, d_out, R], scale [n_slots]."""
    rows = slots.clamp(min=0)
    factor = scale.index_select(0, rows) * (slots >= 0).to(scale.dtype)
    delta = torch.bmm(b.index_select(0, rows), (v * factor.unsqueeze(1).to(v.dtype)).unsqueeze(2)).squeeze(2)
    y[:, col_offset:col_offset + b.shape[1]] += delta.to(y.dtype)


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """See the module docstring; `impl` "triton" or "torch". v is float32 from Triton, x's dtype from torch."""
    if impl == "triton":
        from loramux.kernels.triton_ops import bgmv_shrink_triton

        return bgmv_shrink_triton(x, a, slots)
    return bgmv_shrink_torch(x, a, slots)


def bgmv_expand(y: torch.Tensor, v: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                col_offset: int = 0, impl: str = "torch") -> None:
    if impl == "triton":
        from loramux.kernels.triton_ops import bgmv_expand_triton

        bgmv_expand_triton(y, v, b, scale, slots, col_offset)
        return
    bgmv_expand_torch(y, v, b, scale, slots, col_offset)


def bgmv_shrink_expand(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], offsets: list[int],
                       scale: torch.Tensor, slots: torch.Tensor, impl: str = "torch") -> None:
    """Stacked slices (as `lora_shrink_expand`): one shrink against A = [n_slots, R_0 + R_1 + ..., d_in], then
    one expand per slice B_i [n_slots, d_out_i, R_i] into y's columns offsets[i]...; `scale` [n_slots], or
    [n_slices, n_slots] for a scale per slice."""
    columns = [sum(b.shape[2] for b in bs[:i]) for i in range(len(bs))]
    scales = [scale if scale.dim() == 1 else scale[i] for i in range(len(bs))]
    if impl == "triton":
        from loramux.kernels.triton_ops import bgmv_expand_triton, bgmv_shrink_triton

        v = bgmv_shrink_triton(x, a, slots)
        for b, offset, column, s in zip(bs, offsets, columns, scales):
            bgmv_expand_triton(y, v, b, s, slots, offset, v_col=column)
        return
    v = bgmv_shrink_torch(x, a, slots)
    for b, offset, column, s in zip(bs, offsets, columns, scales):
        bgmv_expand_torch(y, v[:, column:column + b.shape[2]], b, s, slots, offset)


def dora_rescale_rows(y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                      impl: str = "torch") -> None:
    """DoRA's rescale over a per-token slot index (loramux.kernels.dora); capturable either way."""
    if impl == "triton":
        from loramux.kernels.dora_triton import dora_rescale_triton

        dora_rescale_triton(y, g, bias, slots)
        return
    dora_rescale_torch(y, g, bias, slots)


class StaticLoRA:
    """The LoRA wrapper's `apply` over fixed-shape metadata, for a decode step run from static buffers.

    `slots`: (bucket, per-token slot index [T]) for every rank bucket the step may use, set by the caller
    (`loramux.engine.cuda_graphs`) before the forward. Every listed bucket runs for every projection it
    covers, whatever adapters the step holds (rows outside it read -1 and do nothing), so the launches
    depend only on T. `weights_of(bucket, key)` is the device pool's lookup, as the wrapper's.
    """

    def __init__(self, weights_of: Callable, impl: str):
        self.weights_of = weights_of
        self.impl = impl
        self.slots: list[tuple[object, torch.Tensor]] = []

    def apply(self, y: torch.Tensor, x: torch.Tensor, key) -> torch.Tensor:
        for bucket, slots in self.slots:
            weights = self.weights_of(bucket, key)
            if weights is not None:
                bgmv_shrink_expand(y, x, weights.a, weights.b, weights.offsets, weights.scale, slots, self.impl)
                if weights.dora_g is not None:  # DoRA buckets (see loramux.kernels.dora)
                    dora_rescale_rows(y, weights.dora_g, weights.dora_bias, slots, self.impl)
        return y
