"""Medusa-1 heads on the device: K residual SiLU blocks over the model's final hidden state, sharing its LM
head (see `loramux.adapters.formats.medusa` for the file format and the semantics).

`residuals(h)` gives the K inputs to the LM head for every row of h; the model runner projects them in the
same LM-head call as the step's own logits rows, so the heads cost one [rows * K, H] x [H, H] product per
head and a few more LM-head rows, not another pass over the LM head's weights.
"""
from __future__ import annotations

import torch
from torch import nn

from loramux.adapters.formats.medusa import MedusaHeadsWeights

__all__ = ["MedusaHeads"]


class MedusaHeads(nn.Module):
    """Heads made from validated weights: `weight` [K, H, H] (out, in), `bias` [K, H]."""

    weight: torch.Tensor  # [K, H, H] and [K, H] buffers (registered in __init__)
    bias: torch.Tensor

    def __init__(self, weights: MedusaHeadsWeights, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.digest = weights.digest
        self.num_heads = weights.num_heads
        w = torch.stack([w for w, _ in weights.blocks]).to(device=device, dtype=dtype)
        b = torch.stack([b for _, b in weights.blocks]).to(device=device, dtype=dtype)
        self.register_buffer("weight", w, persistent=False)
        self.register_buffer("bias", b, persistent=False)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.bias.numel() * self.bias.element_size()

    @torch.inference_mode()
    def residuals(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] final hidden states -> [n, K, H]: row (i, k) = h_i + silu(W_k h_i + b_k), head k's LM-head
        input (its logits predict the token k + 1 places after the one h_i's own logits predict)."""
        h = hidden.to(self.weight.dtype)
        z = torch.einsum("nh,koh->nko", h, self.weight) + self.bias
        return h[:, None, :] + torch.nn.functional.silu(z)
