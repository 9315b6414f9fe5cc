"""DoRA's fixed per-output-channel scale g of one (adapter, module), computed once when the adapter is
written into the device pool.

PEFT (peft/tuners/lora/dora.py, DoraLinearLayer) computes, for a DoRA module with base weight W [d_out, d_in],
bias b, LoRA A [r, d_in], B [d_out, r], scale s and stored magnitude m [d_out]:

    y = g ⊙ (W x) + b + g ⊙ (s · B A x),   g = m / ||W + s·B·A||_row   (norm over d_in, per output channel)

g does not depend on x, so the engine keeps one g per (adapter, module) and a DoRA row's output is the
shared W x + b plus its scaled LoRA delta, then `g ⊙ (y - b) + b` (kernels/dora.py). Where the layer still
holds W, the norm is taken on W + s·B·A directly (PEFT's float32 formula); where W was packed for oneDNN it
is expanded, ||W_o||² + 2 s <W_o, (BA)_o> + s² ||(BA)_o||², with ||W_o|| kept from model load and the cross
term read through the base layer applied to A's rows. Both match PEFT's float32 norm within float32
rounding. int8 layers have no float W to take the norm of: DoRA is refused there (`unservable_reason`).
"""
from __future__ import annotations

import torch

from loramux.model.llama import MergedLinear


def dora_scale(module: MergedLinear, slice_name: str, a: torch.Tensor, b: torch.Tensor, scale: float,
               magnitude: torch.Tensor) -> torch.Tensor:
    """g [d_out of the slice], float32 on the module's device: m / ||W_slice + scale·B·A|| per output channel.
    a [r, d_in], b [d_out, r], magnitude [d_out] (any float dtype, any device)."""
    if module.column_norms is not None:
        device = module.column_norms.device
    else:
        assert module.weight is not None  # only int8 drops W without norms, and unservable_reason refuses it
        device = module.weight.device
    a, b = a.to(device, torch.float32), b.to(device, torch.float32)
    lo, hi = module.slice_range(slice_name)
    delta = b @ a  # [d_out, d_in]
    if module.weight is not None:
        norm = torch.linalg.norm(module.weight[:, lo:hi].t().float() + scale * delta, dim=1)
    else:
        cross = (module.weight_matmul(a)[:, lo:hi].t() * b).sum(1)  # <W_o, (BA)_o> = sum_r B[o, r] (A W^T)[r, o]
        squared = module.weight_column_norms()[lo:hi].square() + 2 * scale * cross + scale**2 * delta.square().sum(1)
        norm = squared.clamp_min(0).sqrt()
    return magnitude.to(device, torch.float32) / norm


def unservable_reason(module: MergedLinear) -> str | None:
    """Why DoRA cannot be served exactly on this layer, or None."""
    if module.int8 is not None:
        return ("the base model's weights are int8-quantized here, and DoRA's weight norm must be taken on the "
                "float weights the adapter was trained on; serve DoRA adapters from a float (non-int8) engine, or "
                "merge the adapter into the base weights")
    return None
