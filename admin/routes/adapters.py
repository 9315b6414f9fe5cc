"""Adapters of every tenant: upload, list, show, visibility, delete, and warming or pinning them in host RAM
(the operations are `loramux.services.adapters`)."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ConfigDict, Field

from loramux.adapters.composition.merge import MergeBusy
from loramux.adapters.storage.registry import AdapterVersionInfo
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
from loramux.server.http.errors import ApiError
from loramux.services import adapter_merges as merges
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


class MergeComponentBody(RequestBody):
    model_config = ConfigDict(extra="forbid")
    adapter: str = Field(max_length=300, description="an adapter id (ad_...) or a name the tenant can use "
                                                     "(its own, or owner/name of a public adapter)")
    version: int | None = Field(default=None, ge=1, le=999_999_999, description="default: the latest version")
    weight: float = Field(default=1.0, allow_inf_nan=False)


class MergeBody(RequestBody):
    model_config = ConfigDict(extra="forbid")
    tenant_id: str = Field(max_length=200, description="the new adapter's owner, an id or a name")
    name: str = Field(max_length=200, description="the new adapter's name; an existing one gets a new version")
    visibility: Literal["private", "public"] = "private"
    method: str = Field(max_length=40, description="cat, linear, ties, dare_linear, dare_ties or svd")
    parameters: dict[str, Any] = Field(default_factory=dict, description=(
        "density (ties, dare_*), majority_sign_method (ties, dare_ties), seed (dare_*), svd_rank and svd_clamp (svd)"))
    components: list[MergeComponentBody] = Field(max_length=64)


@router.post("/merge", status_code=201, response_model=UploadedAdapter)
async def merge_adapters(body: MergeBody, services: ServicesDep) -> AdapterVersionInfo:
    """Merge adapters with PEFT's add_weighted_adapter into a new adapter (or a new version of `name`), stored
    like an upload, with its provenance (method, parameters, components with their versions and digests)."""
    components = [merges.ComponentRef(c.adapter, c.version, c.weight) for c in body.components]
    try:
        return await run_in_threadpool(merges.merge_adapters, services, body.tenant_id, body.name, components,
                                       body.method, body.parameters, body.visibility)
    except MergeBusy as exc:  # every merge worker busy: nothing ran (a bound too large is a 413, as any adapter)
        raise ApiError(503, str(exc), retry_after_s=services.settings.merge_timeout_s, code="merge_busy") from None


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
