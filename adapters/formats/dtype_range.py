"""Whether an adapter's weights survive the cast to the device pool's dtype.

A composite is built in float32 (`loramux.adapters.composition.weighted.compose`) and checked finite there, but the
pool may hold float16, whose largest value is 65504: a weighted A row `w * s * A` of 1e5 is finite in
float32 and `inf` once copied into the slot, and every token of the request then decodes from NaN. The
request's weight bound (`loramux.server.intake.composition.MAX_WEIGHT`) cannot prevent it alone, since the
product depends on the component's scale and its A. `check_fits` is the check: call it on the built
composite with the pool's dtype, before the composite is cached or served.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from loramux.adapters.composition.weighted import CompositionError
from loramux.adapters.formats.peft import LoRAAdapter

__all__ = ["check_fits", "first_out_of_range"]


def dtype_max(dtype: torch.dtype) -> float:
    """The largest finite magnitude `dtype` holds (float32's for a non-float dtype)."""
    return float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).max)


def first_out_of_range(weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                       dtype: torch.dtype) -> tuple[tuple[int, str], str, float] | None:
    """(module, "A" or "B", its largest magnitude) of the first tensor of `weights` (module -> (A, B), in
    their order) holding a value beyond what `dtype` holds (NaN and inf included), or None when all fit."""
    limit = dtype_max(dtype)
    for key, pair in weights.items():
        for name, tensor in zip(("A", "B"), pair):
            if tensor.numel() == 0:
                continue
            peak = float(tensor.detach().abs().amax())
            if not peak <= limit:  # NaN compares false
                return key, name, peak
    return None


def check_fits(adapter: LoRAAdapter, dtype: torch.dtype) -> None:
    """CompositionError naming the module when a value of `adapter` (a built composite) overflows `dtype`."""
    found = first_out_of_range(adapter.weights, dtype)
    if found is None:
        return
    (layer, target), name, peak = found
    raise CompositionError(f"the weights overflow this server's {str(dtype).removeprefix('torch.')} adapter "
                           f"pool: the weighted {name} of layer {layer} {target} reaches {peak:.3g}, above "
                           f"{dtype_max(dtype):.6g}; lower the weights (|weight| x scale x |A| must stay below it)")
