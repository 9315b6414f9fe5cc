"""A request's `adapters` extension: several adapters combined with weights (see
`loramux.adapters.composition.weighted`), parsed here into 400s that name what to fix, before anything is admitted.

    "model": "<the base model id>" (or "base"),
    "adapters": [{"model": "tone", "weight": 0.7}, {"model": "legal", "weight": 0.3}]

Rules (docs/tenant-api.md "Combining adapters per request"): with `adapters`, `model` (the native API's
`adapter_id`) is the base model; 1 to LORAMUX_COMPOSITION_MAX_ADAPTERS objects, each exactly
`{"model": <adapter reference>, "weight": <number>}`; a weight is a finite number in
[-MAX_WEIGHT, MAX_WEIGHT] (0 and negative weights are allowed, as PEFT allows them). Naming one adapter
twice is refused once the references are resolved (two names of one adapter included): give it once, with
the sum of the weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from loramux.server.http.errors import ApiError
from loramux.server.intake.params import has_control_chars

# A sanity bound on |w|. It cannot by itself keep w * scale * A finite in a float16 pool (that depends on the
# component's scale and A): `loramux.adapters.formats.dtype_range.check_fits` checks the built composite against the
# pool's dtype.
MAX_WEIGHT = 1000.0
MAX_REFERENCE_CHARS = 256
_SHAPE = 'adapters must be a list of {"model": "<adapter>", "weight": <number>} objects'


@dataclass(frozen=True)
class Component:
    """One adapter of a composition, as the request named it."""

    model: str
    weight: float


def _bad(message: str, code: str = "invalid_adapters") -> ApiError:
    return ApiError(400, message, code=code, param="adapters")


def parse_adapters(raw: object, max_adapters: int) -> list[Component] | None:
    """The components `raw` (the request's `adapters`, as parsed JSON) lists, or None when it is absent;
    ApiError 400 (param `adapters`) for anything else than 1..`max_adapters` well-formed objects."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad(f"{_SHAPE}; got {type(raw).__name__}")
    if not raw:
        raise _bad("adapters is empty: list at least one adapter, or leave the field out")
    if len(raw) > max_adapters:
        raise _bad(f"adapters lists {len(raw)} adapters; this server combines at most {max_adapters} "
                   "(LORAMUX_COMPOSITION_MAX_ADAPTERS)", code="too_many_items")
    components = []
    for i, item in enumerate(raw):
        where = f"adapters[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where}: {_SHAPE}; got {type(item).__name__}")
        extra = sorted(set(item) - {"model", "weight"})
        if extra:
            raise _bad(f"{where}: unknown field {extra[0]!r}; each entry has exactly `model` and `weight`")
        model, weight = item.get("model"), item.get("weight")
        if not isinstance(model, str) or not model.strip():
            raise _bad(f"{where}.model must be a non-empty string: an adapter name, ad_<id> or owner/name")
        if len(model) > MAX_REFERENCE_CHARS or has_control_chars(model):
            raise _bad(f"{where}.model must be at most {MAX_REFERENCE_CHARS} characters without control characters")
        if "weight" not in item:
            raise _bad(f"{where}.weight is required (a number; 1 = the adapter as trained)")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise _bad(f"{where}.weight must be a number, got {type(weight).__name__}")
        # abs() first: math.isfinite(10**400) raises OverflowError (an int of any length is valid JSON)
        if abs(weight) > MAX_WEIGHT or not math.isfinite(weight):
            shown = repr(weight)
            if len(shown) > 24:  # an int of hundreds of digits
                shown = f"{shown[:12]}...({len(str(abs(weight)))} digits)"
            raise _bad(f"{where}.weight must be a finite number in [-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}], got {shown}")
        components.append(Component(model, float(weight)))
    return components


def check_base(model: str | None, is_base: bool, base_model_id: str) -> None:
    """With `adapters`, the request's model must be the base model (the adapters say what runs on it)."""
    if not is_base:
        raise ApiError(400, f"with `adapters`, `model` must be the base model ({base_model_id!r} or 'base'), got "
                            f"{model!r}: list every adapter to combine in `adapters`", code="invalid_adapters",
                       param="model")
