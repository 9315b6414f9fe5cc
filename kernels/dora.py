"""DoRA's per-row rescale, applied by the LoRA wrapper after a DoRA bucket's LoRA deltas are added:

    y[t, :] = g[slot[t], :] * (y[t, :] - bias) + bias      for rows with slot[t] >= 0
    (bias: the layer's bias, or none: y[t, :] *= g[slot[t], :]); rows with slot -1 are left untouched.

computed as g * y + (1 - g) * bias, so that a column whose g is 1 (a slice the adapter does not cover) keeps
its value bit for bit.

g [n_slots, d_out] is each slot's fixed DoRA scale m / ||W + s·B·A||_row (loramux.adapters.formats.dora; 1 on output
columns its adapter does not cover). With y = W x + b + s·B A x this is PEFT's DoRA output exactly.
One elementwise op per bucket: `dora_rescale_torch` (the reference, also what fixed-shape decode steps use:
capturable, shapes depend only on the row count), `dora_rescale_triton` (loramux.kernels.dora_triton) beside
it, and `dora_rescale`, which dispatches as the LoRA ops do and takes the torch path's grouped layout fast
when the rows already sit in it.
"""
from __future__ import annotations

import torch

from loramux.kernels.ops import LoRABatch, _use_triton


def dora_rescale_torch(y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor) -> None:
    """In place on y [T, d_out]: rows with slots[t] >= 0 get g[slots[t]] * (y - bias) + bias. slots [T] long."""
    live = (slots >= 0).unsqueeze(1)
    gs = g.index_select(0, slots.clamp(min=0)).to(y.dtype)
    out = y * gs if bias is None else torch.addcmul(y * gs, 1 - gs, bias)
    y.copy_(torch.where(live, out, y))


def dora_rescale(y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, batch: LoRABatch,
                 impl: str | None = None) -> None:
    """In place, for the rows of one bucket's `batch` (see the module docstring)."""
    if _use_triton(y, impl):
        from loramux.kernels.dora_triton import dora_rescale_triton

        dora_rescale_triton(y, g, bias, batch.slot_map)
        return
    rows = batch.rows
    groups = rows.groups
    if not groups.num_rows:
        return
    if rows.strategy == "bmm" and groups.span is not None:  # decode: rows already [groups, count] by slot
        view = y[groups.span[0]:groups.span[1]].view(groups.num_groups, groups.max_count, y.shape[1])
        gs = rows.per_group(g).unsqueeze(1)
        view.mul_(gs)
        if bias is not None:
            view.add_((1 - gs) * bias)
        return
    dora_rescale_torch(y, g, bias, batch.slot_map)


def dora_rescale_reference(y: torch.Tensor, g: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor
                           ) -> torch.Tensor:
    """Float64, one row at a time; returns a new tensor (tests)."""
    out = y.double().cpu().clone()
    g64 = g.double().cpu()
    b64 = None if bias is None else bias.double().cpu()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] = out[t] * g64[slot] if b64 is None else out[t] * g64[slot] + (1 - g64[slot]) * b64
    return out
