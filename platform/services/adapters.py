"""Adapters of every tenant, as operators manage them: upload (validated against the base model by the
registry), list, show with where each version is now, visibility, delete, and warming or pinning the latest
version in host RAM (where a version is, and the pins, live in `loramux.adapters.residency.pins`). The admin
API and the console call these, so both accept and refuse exactly alike."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loramux.adapters.residency.cache_levels import Acquired
from loramux.adapters.residency.pins import where_is
from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.services.billing import usage_last_hour
from loramux.services.container import Services
from loramux.text import reject_lone_surrogates

LOAD_TIMEOUT_S = 120
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


class UploadError(Exception):
    """An upload refused before its adapter is validated (a missing or malformed form field, a body too
    large or of the wrong type): `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class AdapterUnavailableError(RuntimeError):
    """An adapter could not be brought into host RAM in time (answered as a 503 with Retry-After)."""


@dataclass(frozen=True)
class Warmed:
    """The latest version was brought into host RAM: from which level (store, disk, ram) and how fast."""
    adapter_id: str
    version: int
    loaded_from: str
    load_ms: float


@dataclass
class AdapterOverview:
    """One adapter version in the operators' list: owner's name, residency, pin state, last hour's usage."""
    version: AdapterVersionInfo
    tenant: str
    where: dict
    pinned: bool
    usage: dict = field(default_factory=lambda: {"requests": 0, "tokens": 0})


def check_upload_fields(fields: dict) -> None:
    """The form fields of an upload: tenant_id and name present, text without lone surrogates, and
    allow_base_mismatch a boolean word (UploadError 400 naming the field)."""
    missing = [f for f in ("tenant_id", "name") if not fields.get(f)]
    if missing:
        raise UploadError(400, f"missing form field(s): {', '.join(missing)}")
    try:
        reject_lone_surrogates(fields)
    except ValueError as exc:
        raise UploadError(400, f"form fields {exc}") from None
    _flag(fields, "allow_base_mismatch")


def _flag(fields: dict, name: str) -> bool:
    value = fields.get(name) or ""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in _TRUE + _FALSE:
        raise UploadError(400, f"form field {name} must be true or false")
    return text in _TRUE


def register_upload(services: Services, fields: dict, files: dict[str, Path]) -> AdapterVersionInfo:
    """Validate and store an uploaded adapter as the next version of (tenant, name); `files` maps the file
    names to validate to their temporary paths. Runs on a worker thread (it converts and checks tensors)."""
    import torch

    # With one intra-op thread, so no second OpenMP team is left to contend with the engine's for the cores
    # (see loramux.adapters.residency.device_pool).
    torch.set_num_threads(1)
    check_upload_fields(fields)
    tenant = services.tenancy.tenant(fields["tenant_id"])  # an id or a name
    return services.registry.register(tenant.id, fields["name"], files, fields.get("visibility") or "private",
                                      allow_base_mismatch=_flag(fields, "allow_base_mismatch"))


def list_adapters(services: Services, tenant_ref: str | None = None) -> list[AdapterVersionInfo]:
    """The latest version of every live adapter (of one tenant, by id or name, when given)."""
    tenant_id = services.tenancy.tenant(tenant_ref).id if tenant_ref is not None else None
    return services.registry.list_all(tenant_id)


def residency(services: Services, version: AdapterVersionInfo) -> dict:
    """Where `version` is now (`loramux.adapters.residency.pins.where_is`)."""
    return where_is(version, services.adapter_cache, services.engine.adapter_residency)


def adapter_detail(services: Services, adapter_id: str) -> dict:
    """Versions and pin state, where the latest version is now and how many requests this server started
    with the adapter lately (AdapterNotFoundError)."""
    owner = services.registry.owner_of(adapter_id)
    versions = services.registry.versions(owner, adapter_id)
    return {"id": adapter_id, "tenant_id": owner, "versions": versions, "pinned": adapter_id in services.pinned,
            "residency": residency(services, versions[-1]) if versions else None,
            "recent_requests": services.request_rates.recent(adapter_id)}


def adapter_overview(services: Services) -> list[AdapterOverview]:
    """Every tenant's adapters with their owners' names, residency, pins and the last hour's usage."""
    tenants = {t.id: t.name for t in services.tenancy.list_tenants()}
    usage = usage_last_hour(services)
    return [AdapterOverview(version, tenants.get(version.tenant_id, version.tenant_id), residency(services, version),
                            version.adapter_id in services.pinned,
                            usage.get(version.adapter_id, {"requests": 0, "tokens": 0}))
            for version in services.registry.list_all(None)]


def set_visibility(services: Services, adapter_id: str, visibility: str) -> AdapterVersionInfo:
    return services.registry.set_visibility(services.registry.owner_of(adapter_id), adapter_id, visibility)


def delete_adapter(services: Services, adapter_id: str) -> list[AdapterVersionInfo]:
    """Soft delete: later requests get 404, running ones finish; blobs no live version uses are removed.
    Returns the versions deleted."""
    owner = services.registry.owner_of(adapter_id)
    services.pinned.unpin(adapter_id)
    gone = services.registry.delete(owner, adapter_id)
    if services.medusa is not None:  # the Medusa heads of its versions go with it (their blobs too)
        services.medusa.retire_for_adapter(adapter_id)
    return gone


def latest_version(services: Services, adapter_id: str) -> AdapterVersionInfo:
    """The latest version of a live adapter of any tenant (AdapterNotFoundError)."""
    return services.registry.resolve(services.registry.owner_of(adapter_id), adapter_id)


async def warm_adapter(services: Services, version: AdapterVersionInfo) -> Warmed:
    """Bring `version` into host RAM now (it stays until the RAM cache needs the room)."""
    lease = await _acquire(services, version)
    services.adapter_cache.release(version.digest)
    return Warmed(version.adapter_id, version.version, lease.level, round(lease.load_ms, 1))


async def pin_adapter(services: Services, version: AdapterVersionInfo) -> None:
    """Keep `version` (an adapter's latest) in host RAM until unpinned (pinned adapters are never evicted;
    AdapterLoadError, or AdapterUnavailableError when it takes too long)."""
    try:
        await services.pinned.pin(version, timeout=LOAD_TIMEOUT_S)
    except TimeoutError as exc:
        raise AdapterUnavailableError(str(exc)) from None


def unpin_adapter(services: Services, adapter_id: str) -> None:
    services.registry.owner_of(adapter_id)
    services.pinned.unpin(adapter_id)


async def _acquire(services: Services, version: AdapterVersionInfo) -> Acquired:
    """The version leased in host RAM (AdapterLoadError, or AdapterUnavailableError when it takes too long)."""
    try:
        return await services.adapter_cache.acquire(version, timeout=LOAD_TIMEOUT_S)
    except TimeoutError as exc:
        raise AdapterUnavailableError(str(exc)) from None
