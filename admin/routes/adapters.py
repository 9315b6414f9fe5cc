"""Adapters of every tenant: upload, list, show, visibility, delete, and warming or pinning them in host RAM."""
from __future__ import annotations

from typing import Literal

import torch
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from loramux.adapters.registry import AdapterVersionInfo
from loramux.adapters.tiers import Acquired
from loramux.admin.routes.schemas import (
    AdapterDetail,
    AdapterList,
    AdapterVersion,
    DeletedAdapter,
    PinState,
    UploadedAdapter,
    WarmedAdapter,
)
from loramux.admin.uploads import UploadError, receive_upload
from loramux.server.bodies import RequestBody, reject_lone_surrogates
from loramux.server.deps import ServicesDep
from loramux.server.errors import ApiError
from loramux.services import Services

router = APIRouter(prefix="/adapters")

LOAD_TIMEOUT_S = 120


class AdapterPatch(RequestBody):
    visibility: Literal["private", "public"]


@router.post("", status_code=201, response_model=UploadedAdapter)
async def upload_adapter(request: Request, services: ServicesDep) -> AdapterVersionInfo:
    """multipart/form-data: `tenant_id`, `name`, optional `visibility` (private|public), optional
    `allow_base_mismatch` (true|false, default false: accept a config whose base_model_name_or_path names
    another hub model, when you know the shapes and weights match), files `adapter_config`
    (adapter_config.json) and `adapter_model` (adapter_model.safetensors)."""
    cap = services.settings.max_upload_bytes + 1024 * 1024  # the weights, the config and the multipart framing
    async with receive_upload(request, cap) as (fields, files):
        _check_form_fields(fields)
        return await run_in_threadpool(_register, services, fields, files)


def _check_form_fields(fields: dict) -> None:
    missing = [f for f in ("tenant_id", "name") if not fields.get(f)]
    if missing:
        raise UploadError(400, f"missing form field(s): {', '.join(missing)}")
    try:
        reject_lone_surrogates(fields)
    except ValueError as exc:
        raise UploadError(400, f"form fields {exc}") from None
    _flag(fields, "allow_base_mismatch")


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def _flag(fields: dict, name: str) -> bool:
    value = fields.get(name) or ""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in _TRUE + _FALSE:
        raise UploadError(400, f"form field {name} must be true or false")
    return text in _TRUE


def _register(services: Services, fields: dict, files: dict) -> AdapterVersionInfo:
    # Validation converts and checks tensors on this worker thread: with one intra-op thread, so no second
    # OpenMP team is left to contend with the engine's for the cores (see loramux.adapters.device_pool).
    torch.set_num_threads(1)
    tenant = services.tenancy.tenant(fields["tenant_id"])  # an id or a name
    return services.registry.register(tenant.id, fields["name"], files, fields.get("visibility") or "private",
                                      allow_base_mismatch=_flag(fields, "allow_base_mismatch"))


@router.get("", response_model=AdapterList)
def list_adapters(services: ServicesDep, tenant_id: str | None = None) -> dict:
    if tenant_id is not None:
        tenant_id = services.tenancy.tenant(tenant_id).id
    return {"adapters": services.registry.list_all(tenant_id)}


@router.get("/{adapter_id}", response_model=AdapterDetail)
def show_adapter(adapter_id: str, services: ServicesDep) -> dict:
    """Versions and pin state, where the latest version is now (device, host RAM, disk, store) and how many
    requests this server started with the adapter lately."""
    owner = services.registry.owner_of(adapter_id)
    versions = services.registry.versions(owner, adapter_id)
    return {"id": adapter_id, "tenant_id": owner, "versions": versions, "pinned": adapter_id in services.admin_pins,
            "residency": _residency(services, versions[-1]) if versions else None,
            "recent_requests": services.request_rates.recent(adapter_id)}


_DEVICE_STATES = {"device": "resident", "loading": "loading"}  # the engine's answer -> the API's; else "absent"


def _residency(services: Services, version: AdapterVersionInfo) -> dict:
    cache = services.adapter_cache
    return {"version": version.version,
            "device": _DEVICE_STATES.get(services.engine.adapter_residency(version.digest), "absent"),
            "ram": cache.has_in_ram(version.digest), "disk": cache.has_on_disk(version.digest), "store": True}


@router.patch("/{adapter_id}", response_model=AdapterVersion)
def patch_adapter(adapter_id: str, body: AdapterPatch, services: ServicesDep) -> AdapterVersionInfo:
    return services.registry.set_visibility(services.registry.owner_of(adapter_id), adapter_id, body.visibility)


@router.delete("/{adapter_id}")
def delete_adapter(adapter_id: str, services: ServicesDep) -> DeletedAdapter:
    """Soft delete: later requests get 404, running ones finish; blobs no live version uses are removed."""
    owner = services.registry.owner_of(adapter_id)
    _unpin(services, adapter_id)
    gone = services.registry.delete(owner, adapter_id)
    return DeletedAdapter(id=adapter_id, deleted_versions=[v.version for v in gone])


@router.post("/{adapter_id}/warm")
async def warm_adapter(adapter_id: str, services: ServicesDep) -> WarmedAdapter:
    """Bring the latest version into host RAM now (it stays until the RAM cache needs the room)."""
    version = await run_in_threadpool(_latest, services, adapter_id)
    lease = await _acquire(services, version)
    services.adapter_cache.release(version.digest)
    return WarmedAdapter(id=adapter_id, version=version.version, loaded_from=lease.tier,
                         load_ms=round(lease.load_ms, 1))


@router.post("/{adapter_id}/pin")
async def pin_adapter(adapter_id: str, services: ServicesDep) -> PinState:
    """Keep the latest version in host RAM until unpinned (pinned adapters are never evicted)."""
    version = await run_in_threadpool(_latest, services, adapter_id)
    if adapter_id not in services.admin_pins:
        await _acquire(services, version)
        # No await from here on: a concurrent pin call that recorded its pin while this one loaded wins,
        # and this call gives its cache pin back, so each recorded pin holds exactly one.
        if adapter_id in services.admin_pins:
            services.adapter_cache.release(version.digest)
        else:
            services.admin_pins[adapter_id] = version.digest
    return PinState(id=adapter_id, pinned=True)


@router.delete("/{adapter_id}/pin")
def unpin_adapter(adapter_id: str, services: ServicesDep) -> PinState:
    services.registry.owner_of(adapter_id)
    _unpin(services, adapter_id)
    return PinState(id=adapter_id, pinned=False)


def _latest(services: Services, adapter_id: str) -> AdapterVersionInfo:
    """The latest version of a live adapter of any tenant (AdapterNotFoundError: 404)."""
    return services.registry.resolve(services.registry.owner_of(adapter_id), adapter_id)


def _unpin(services: Services, adapter_id: str) -> None:
    digest = services.admin_pins.pop(adapter_id, None)  # one atomic step, also from a worker thread
    if digest is not None:
        services.adapter_cache.release(digest)


async def _acquire(services: Services, version: AdapterVersionInfo) -> Acquired:
    """The version pinned in host RAM (AdapterLoadError: 503 with Retry-After, as is a load that takes too long)."""
    try:
        return await services.adapter_cache.acquire(version, timeout=LOAD_TIMEOUT_S)
    except TimeoutError as exc:
        raise ApiError(503, str(exc), retry_after_s=5, code="adapter_unavailable") from None
