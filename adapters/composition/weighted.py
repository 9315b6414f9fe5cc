"""Weighted composition of LoRA adapters, exactly PEFT's `add_weighted_adapter(..., combination_type="cat")`.

The composite of components (adapter_i, w_i) adds the weighted sum of their deltas to every module:

    delta(x) = sum_i w_i * s_i * B_i A_i x        (s_i: component i's own scale of that module)

as one LoRA of the summed rank: per (layer, projection), A is the components' A stacked (component order),
each multiplied by `w_i * s_i` in that order (`A_i * w_i * s_i`, PEFT's own expression, so the tensors
are PEFT's to the bit), and B is their Bs side by side. The composite runs at scale 1 (r = lora_alpha, no
rsLoRA). Each component's scale is its own per module: alpha / r, alpha / sqrt(r) with rsLoRA, or its
rank_pattern / alpha_pattern entry. A module only some components cover gets only their rows (PEFT pads
the others with zero rows, which add exactly nothing), so per-module ranks differ and the composite is laid
out per module in the device pool (`pool_layout`), each module at the rank it really has.

Where PEFT differs and loramux does not follow it (both written in docs/tenant-api.md):
* one component: PEFT switches to its "linear" combination (sqrt(w*s) on A and on B: the same product up to
  rounding, a math error for a negative weight); here one component is `cat` of one, w*s on A.
* the composite's config is the first component's with r = lora_alpha = summed rank, so when that first
  component uses rsLoRA, PEFT scales the composite by sqrt(summed rank) instead of 1; here it is always 1,
  the weighted sum its documentation promises.

Refused (`CompositionError`, naming the component): what `cat` cannot combine into a LoRA of the decoder's
projections — DoRA magnitudes, LoRA on the embedding, trained heads / modules_to_save, LoRA on the routed
experts of a mixture-of-experts base.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

from loramux.adapters.formats.peft import LoRAAdapter
from loramux.model.llama import PROJECTION_SLICES

__all__ = ["CompositionError", "compose", "composite_nbytes", "composition_digest", "refusal_reason"]

_TARGET_ORDER = {target: i for i, target in enumerate(PROJECTION_SLICES)}
_KIND = "loramux.composition/cat/v1"  # keeps composite digests apart from any adapter version's digest


class CompositionError(ValueError):
    """Adapters that cannot be combined; `component` is the index of the one at fault (None: the whole)."""

    def __init__(self, message: str, component: int | None = None):
        super().__init__(message)
        self.component = component


def composition_digest(parts: Sequence[tuple[str, float]]) -> str:
    """The composite's identity: sha256 of a canonical JSON of its components' digests and weights, in
    request order (order changes the stacked layout, not the sum, but keeps the tensors PEFT's)."""
    for _, weight in parts:
        if not math.isfinite(weight):
            raise CompositionError(f"weight {weight!r} is not a finite number")
    body = {"kind": _KIND, "components": [{"digest": d, "weight": float(w)} for d, w in parts]}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def refusal_reason(adapter: LoRAAdapter) -> str | None:
    """Why PEFT's `cat` cannot combine `adapter` with others into a plain LoRA, or None when it can."""
    if adapter.magnitudes:
        return "it is a DoRA adapter (use_dora), whose magnitude rescaling does not add up across adapters"
    if adapter.embedding is not None:
        return "it has a LoRA on the embedding (embed_tokens), which a composition cannot stack"
    if adapter.heads:
        return ("it trains heads or whole modules (modules_to_save, trainable_token_indices), which a weighted "
                "sum of deltas cannot combine")
    if adapter.experts:
        return "it has LoRA on routed experts; composition of expert LoRA is not supported"
    return None


def composite_nbytes(components: Sequence[LoRAAdapter]) -> int:
    """The exact size of the composite of `components` (`compose`'s float32 A and B), known before building
    it: every module's A and B hold each covering component's rows and columns once."""
    return sum((a.numel() + b.numel()) * 4 for adapter in components for a, b in adapter.weights.values())


def compose(components: Sequence[tuple[LoRAAdapter, float]], name: str, digest: str | None = None) -> LoRAAdapter:
    """The composite of `components` ((adapter, weight) pairs, request order) as one float32 LoRAAdapter at
    scale 1, named `name`, with `digest` (default: `composition_digest` of the components). See the module
    docstring for the exact arithmetic. Raises CompositionError for an empty list, a non-finite weight or a
    component `refusal_reason` refuses."""
    if not components:
        raise CompositionError("a composition needs at least one adapter")
    for i, (adapter, weight) in enumerate(components):
        if not math.isfinite(weight):
            raise CompositionError(f"weight {weight!r} is not a finite number", i)
        reason = refusal_reason(adapter)
        if reason is not None:
            raise CompositionError(f"adapter {adapter.name!r} cannot be combined: {reason}", i)
    keys = sorted({key for adapter, _ in components for key in adapter.weights},
                  key=lambda k: (k[0], _TARGET_ORDER[k[1]]))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key in keys:
        a_parts, b_parts = [], []
        for adapter, weight in components:
            if key in adapter.weights:
                a, b = adapter.weights[key]
                # PEFT's expression (lora/model.py, add_weighted_adapter, "cat"), in its order: A * w * s.
                a_parts.append(a.float() * weight * adapter.scale_of(key))
                b_parts.append(b.float())
        a = torch.cat(a_parts, dim=0).contiguous()
        if not torch.isfinite(a).all():
            raise CompositionError(f"the weights overflow: a weighted A of module {key} is not finite")
        weights[key] = (a, torch.cat(b_parts, dim=1).contiguous())
    rank = max(a.shape[0] for a, _ in weights.values())
    targets = tuple(t for t in PROJECTION_SLICES if any(k[1] == t for k in weights))
    if digest is None:
        digest = composition_digest([(adapter.digest, weight) for adapter, weight in components])
    # alpha = r: scale exactly 1.0; every module's own scale is already in its A rows.
    return LoRAAdapter(name=name, rank=rank, alpha=float(rank), use_rslora=False, target_modules=targets,
                       weights=weights, digest=digest)

