"""Stored merges of adapters: several versions merged by PEFT's add_weighted_adapter (adapters/composition/merge.py)
into a
new adapter, or a new version of an existing name, stored through the upload path (validation, blob, rows: a
failure leaves neither rows nor a blob) with its provenance. The admin API, the console and the CLI call
`merge_adapters`, so all three accept and refuse alike."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loramux.adapters.composition.merge import (
    MergeComponent,
    MergeLimits,
    MergeTooLarge,
    check_components,
    check_request,
    merge,
)
from loramux.adapters.storage.blob import unpack
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterVersionInfo
from loramux.names import check_name
from loramux.services.container import Services


@dataclass(frozen=True)
class ComponentRef:
    """One component as asked: an adapter id (ad_...) or a name the target tenant sees (its own, owner/name of a
    public one), optionally a version (default: the latest), and its weight in the merge."""

    adapter: str
    version: int | None = None
    weight: float = 1.0


def parse_components(text: str) -> list[ComponentRef]:
    """Components written one a line (or comma-separated) as `ADAPTER[@VERSION][=WEIGHT]`, as the console's form
    and the CLI take them (MergeError naming the line)."""
    from loramux.adapters.composition.merge import MergeError

    out = []
    for item in (part.strip() for line in text.splitlines() for part in line.split(",")):
        if not item:
            continue
        ref, _, weight = item.partition("=")
        ref, _, version = ref.strip().partition("@")
        try:
            out.append(ComponentRef(ref, int(version) if version else None, float(weight) if weight else 1.0))
        except ValueError:
            raise MergeError(f"components[{len(out)}]", f"component {item[:80]!r}: write ADAPTER[@VERSION][=WEIGHT], "
                                                        "the version a whole number and the weight a number") from None
    return out


def merge_adapters(services: Services, tenant_ref: str, name: str, components: Sequence[ComponentRef], method: str,
                   parameters: Mapping | None = None, visibility: str = "private") -> AdapterVersionInfo:
    """Merge `components` with `method` into the next version of the tenant's adapter `name` and return it.
    Checks the request, then that the tenant may use every component (AdapterNotFoundError naming it), then
    the method's preconditions on the components (MergeError), before merging. Runs on a worker thread.

    Bounded by LORAMUX_MERGE_* (`MergeLimits`): components whose stored size could not be held in memory are
    refused before they are loaded, a merge whose estimated peak is above the memory bound before it starts
    (MergeTooLarge, a 413 naming the bound); ties, dare_* and svd run in a worker process
    (adapters/composition/merge.py)
    killed past the time limit, so a refused, stopped or failed merge stores nothing."""
    import peft
    import torch

    torch.set_num_threads(1)  # as an upload: no second OpenMP team contending with the engine's
    check_name(name)
    params = check_request(method, parameters, [c.weight for c in components])
    tenant = services.tenancy.tenant(tenant_ref)
    registry = services.registry
    versions = [_resolve(services, tenant.id, tenant.name, i, c) for i, c in enumerate(components)]
    limits = MergeLimits.from_settings(services.settings)
    stored = sum(v.size_bytes for v in versions)
    if 2 * stored > limits.memory_bytes:  # float32 in memory: twice a 16-bit blob's bytes
        raise MergeTooLarge("components", f"the components' stored weights are {stored} bytes (up to twice that "
                                          f"in memory), above half this server's merge memory limit of "
                                          f"{limits.memory_bytes} bytes (LORAMUX_MERGE_MEMORY_BYTES); merge fewer "
                                          "or smaller components, or raise LORAMUX_MERGE_MEMORY_BYTES")
    loaded = [MergeComponent(f"{v.name}@{v.version}", unpack(registry.store.get(v.storage_key), v.name, v.digest),
                             float(c.weight)) for v, c in zip(versions, components)]
    check_components(method, params, loaded, registry.base_config, registry.limits.max_rank)
    merged = merge(method, params, loaded, registry.base_config, limits)
    del loaded
    provenance = {"method": method, "parameters": params, "peft_version": peft.__version__,
                  "components": [{"adapter_id": v.adapter_id, "version": v.version, "digest": v.digest,
                                  "weight": float(c.weight)} for v, c in zip(versions, components)]}
    return registry.register(tenant.id, name, merged.files(), visibility, provenance=provenance)


def _resolve(services: Services, tenant_id: str, tenant_name: str, index: int, c: ComponentRef) -> AdapterVersionInfo:
    """The component's version, as the tenant would resolve it in a request (its own adapters and public ones);
    a 404 naming the component otherwise (unknown, deleted, or another tenant's private adapter alike)."""
    ref = c.adapter if c.version is None else f"{c.adapter.partition('@')[0]}@{c.version}"
    try:
        return services.registry.resolve(tenant_id, ref)
    except AdapterNotFoundError:
        raise AdapterNotFoundError(f"components[{index}]: adapter {ref[:200]!r} not found for tenant {tenant_name!r} "
                                   "(unknown, deleted, or another tenant's private adapter); give an adapter id or "
                                   "name the tenant can use, and an existing version") from None
