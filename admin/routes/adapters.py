"""Adapters of every tenant: upload, list, show, visibility, delete, and warming or pinning them in host RAM
(the operations are `loramux.services.adapters`)."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from loramux.adapters.registry import AdapterVersionInfo
from loramux.admin.routes.schemas import (
    AdapterDetail,
    AdapterList,
    AdapterVersion,
    DeletedAdapter,
    PinState,
    UploadedAdapter,
    WarmedAdapter,
)
from loramux.admin.uploads import receive_upload
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import adapters as ops

router = APIRouter(prefix="/adapters")


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
        ops.check_upload_fields(fields)
        return await run_in_threadpool(ops.register_upload, services, fields, files)


@router.get("", response_model=AdapterList)
def list_adapters(services: ServicesDep, tenant_id: str | None = None) -> dict:
    return {"adapters": ops.list_adapters(services, tenant_id)}


@router.get("/{adapter_id}", response_model=AdapterDetail)
def show_adapter(adapter_id: str, services: ServicesDep) -> dict:
    """Versions and pin state, where the latest version is now (device, host RAM, disk, store) and how many
    requests this server started with the adapter lately."""
    return ops.adapter_detail(services, adapter_id)


@router.patch("/{adapter_id}", response_model=AdapterVersion)
def patch_adapter(adapter_id: str, body: AdapterPatch, services: ServicesDep) -> AdapterVersionInfo:
    return ops.set_visibility(services, adapter_id, body.visibility)


@router.delete("/{adapter_id}")
def delete_adapter(adapter_id: str, services: ServicesDep) -> DeletedAdapter:
    """Soft delete: later requests get 404, running ones finish; blobs no live version uses are removed."""
    gone = ops.delete_adapter(services, adapter_id)
    return DeletedAdapter(id=adapter_id, deleted_versions=[v.version for v in gone])


@router.post("/{adapter_id}/warm")
async def warm_adapter(adapter_id: str, services: ServicesDep) -> WarmedAdapter:
    """Bring the latest version into host RAM now (it stays until the RAM cache needs the room)."""
    version = await run_in_threadpool(ops.latest_version, services, adapter_id)
    warmed = await ops.warm_adapter(services, version)
    return WarmedAdapter(id=adapter_id, version=warmed.version, loaded_from=warmed.loaded_from,
                         load_ms=warmed.load_ms)


@router.post("/{adapter_id}/pin")
async def pin_adapter(adapter_id: str, services: ServicesDep) -> PinState:
    """Keep the latest version in host RAM until unpinned (pinned adapters are never evicted)."""
    version = await run_in_threadpool(ops.latest_version, services, adapter_id)
    await ops.pin_adapter(services, version)
    return PinState(id=adapter_id, pinned=True)


@router.delete("/{adapter_id}/pin")
def unpin_adapter(adapter_id: str, services: ServicesDep) -> PinState:
    ops.unpin_adapter(services, adapter_id)
    return PinState(id=adapter_id, pinned=False)
