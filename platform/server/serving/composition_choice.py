"""The composite adapter a request with `adapters` runs with: each component resolved for the tenant (404
naming the one it cannot see), checked against the limits (400), then the composite from host RAM, or built
once from the components brought into host RAM through the adapter cache (`CompositionCache`: bounded in
bytes by the host RAM budget, on its own threads, a few builds per tenant at a time). The request holds the
composite's lease until it ends, like an adapter's.

No fallback: a component that cannot be loaded within the deadline is a 503 (`adapter_unavailable`), as for
a tenant without a fallback; serving something else than the combination asked for would be a silent change.
No room for the composite within the deadline is a 503 (`composition_capacity`, Retry-After); a composite
larger than the whole host RAM budget a 400 (`composition_too_large`) naming LORAMUX_HOST_CACHE_BYTES.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from fastapi.concurrency import run_in_threadpool

from loramux.adapters.composition.cache import CompositionCache, CompositionCapacityError, CompositionTooLargeError
from loramux.adapters.composition.weighted import CompositionError, compose, composition_digest, refusal_reason
from loramux.adapters.formats.dtype_range import check_fits
from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.residency.cache_levels import Acquired, AdapterLoadError
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterRegistry, AdapterVersionInfo
from loramux.server.http.errors import ApiError
from loramux.server.intake.composition import Component
from loramux.tenancy.tenants import TenantContext


@dataclass(frozen=True)
class Composition:
    """What a request with `adapters` runs: the composite, and its components as resolved."""

    adapter: LoRAAdapter
    components: list[Component]
    versions: list[AdapterVersionInfo]
    lease: Acquired  # the composite's lease in host RAM, given back once when the request ends

    def ledger(self) -> list[dict]:
        """The ledger row's `composition`: [{"adapter_id", "version", "digest", "weight"}, ...]."""
        return [{"adapter_id": v.adapter_id, "version": v.version, "digest": v.digest, "weight": c.weight}
                for c, v in zip(self.components, self.versions)]

    def extension(self) -> list[dict]:
        """The response's `loramux.composition`: each component as asked and as served."""
        return [{"model": c.model, "adapter_id": v.adapter_id, "name": v.name, "version": v.version,
                 "weight": c.weight} for c, v in zip(self.components, self.versions)]


def component_rank(version: AdapterVersionInfo) -> int:
    """A component's rank in the composite's sum, as PEFT counts it: its r, or its largest module rank under
    a rank_pattern (from the version's summary, recorded at upload)."""
    modules = (version.summary or {}).get("modules") or {}
    return max([version.rank, *(int(m.get("rank_max", 0)) for m in modules.values())])


def _summary_refusal(version: AdapterVersionInfo) -> str | None:
    """Why the version cannot be combined, from its upload summary (before loading anything); None when the
    summary has nothing against it (the loaded adapter is checked again: `refusal_reason`)."""
    summary = version.summary or {}
    if summary.get("dora"):
        return "it is a DoRA adapter (use_dora), whose magnitude rescaling does not add up across adapters"
    if summary.get("embedding"):
        return "it has a LoRA on the embedding (embed_tokens), which a composition cannot stack"
    if summary.get("heads"):
        return ("it trains heads or whole modules (modules_to_save, trainable_token_indices), which a weighted "
                "sum of deltas cannot combine")
    return None


def _cannot_combine(component: Component, reason: str) -> ApiError:
    return ApiError(400, f"adapter {component.model!r} cannot be combined: {reason}", code="unsupported_adapter",
                    param="adapters")


async def resolve_components(registry: AdapterRegistry, tenant: TenantContext, components: list[Component],
                             max_rank: int, max_lora_rank: int, base_model_id: str) -> list[AdapterVersionInfo]:
    """Each component's latest version for the tenant, checked: visible (404 naming it), listed once, of a
    format `cat` combines, and a summed rank within the limits (400s)."""
    versions = []
    for i, component in enumerate(components):
        try:
            version = await run_in_threadpool(registry.resolve, tenant.tenant_id, component.model)
        except AdapterNotFoundError:
            raise ApiError(404, f"adapters[{i}].model {component.model!r} not found: name an adapter listed by "
                                f"GET /v1/models (the base model {base_model_id!r} is what `model` names)",
                           code="model_not_found", param="adapters") from None
        for j, seen in enumerate(versions):
            if seen.adapter_id == version.adapter_id:
                raise ApiError(400, f"adapters[{j}] and adapters[{i}] both name adapter {version.name!r}: list each "
                                    "adapter once, with the sum of its weights", code="invalid_adapters",
                               param="adapters")
        reason = _summary_refusal(version)
        if reason is not None:
            raise _cannot_combine(component, reason)
        versions.append(version)
    ranks = [component_rank(v) for v in versions]
    limit, setting = min((max_rank, "LORAMUX_COMPOSITION_MAX_RANK"), (max_lora_rank, "LORAMUX_MAX_LORA_RANK"))
    if sum(ranks) > limit:
        shown = " + ".join(f"{c.model} {r}" for c, r in zip(components, ranks))
        raise ApiError(400, f"the combined rank is {sum(ranks)} ({shown}); this server combines adapters up to a "
                            f"summed rank of {limit} ({setting}): combine fewer or smaller adapters",
                       code="composition_too_large", param="adapters")
    return versions


async def acquire_composition(registry: AdapterRegistry, compositions: CompositionCache, tenant: TenantContext,
                              components: list[Component], time_left: float, *, max_rank: int, max_lora_rank: int,
                              base_model_id: str, dtype: torch.dtype = torch.float32) -> Composition:
    """The request's composite, leased in host RAM (the request gives it back when it ends: `Composition.lease`;
    see the module docstring), its values within what the adapter pool's `dtype` holds (400 naming the module
    otherwise: a float16 pool turns a weighted A of 1e5 into inf). Raises ApiError with nothing held."""
    versions = await resolve_components(registry, tenant, components, max_rank, max_lora_rank, base_model_id)
    digest = composition_digest([(v.digest, c.weight) for c, v in zip(components, versions)])
    weights = [c.weight for c in components]

    def check(loaded: list[LoRAAdapter]) -> None:
        for component, adapter in zip(components, loaded):
            reason = refusal_reason(adapter)
            if reason is not None:
                raise _cannot_combine(component, reason)

    def build(loaded: list[LoRAAdapter]) -> LoRAAdapter:
        composite = compose(list(zip(loaded, weights)), f"composition-{digest[:16]}", digest)
        check_fits(composite, dtype)
        return composite

    try:
        composite = await compositions.acquire(digest, tenant.tenant_id, versions, check, build,
                                               time.monotonic() + time_left)
    except AdapterLoadError as exc:
        raise ApiError(503, str(exc), retry_after_s=5.0, code="adapter_unavailable", param="adapters") from None
    except TimeoutError:
        raise ApiError(503, "the combined adapters could not be loaded within the request's deadline",
                       retry_after_s=5.0, code="adapter_unavailable", param="adapters") from None
    except CompositionCapacityError as exc:
        raise ApiError(503, str(exc), retry_after_s=2.0, code="composition_capacity", param="adapters") from None
    except (CompositionTooLargeError, CompositionError) as exc:
        code = "composition_too_large" if isinstance(exc, CompositionTooLargeError) else "invalid_adapters"
        raise ApiError(400, str(exc), code=code, param="adapters") from None
    return Composition(composite, list(components), versions,
                       Acquired(composite, "ram", 0.0))
