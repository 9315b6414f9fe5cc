"""vLLM's adapter endpoints, for sidecars and controllers (AIBrix, llm-d) that roll adapters out by calling them:
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`.

They need an admin key (the ingress treats these two paths as admin routes). `lora_path` is an `s3://` URL or a
directory under LORAMUX_ADAPTER_IMPORT_ROOTS; the adapter is validated and registered as an upload would be
(`loramux.services.adapter_imports`), for the tenant the `X-Loramux-Tenant` header names (an id or a name), else
LORAMUX_ADAPTER_IMPORT_TENANT. Answers follow vLLM's: 200 with a text line on success; errors in the server's
usual JSON shape (400 for a bad name, path or adapter, naming the problem; 404 for an unknown tenant or, on
unload, adapter; 503 when the store cannot be reached).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict, Field

from loramux.adapters.storage.adapter_source import SourceInvalid, SourceNotFound, SourceUnavailable
from loramux.admin.deps import get_admin
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.server.http.errors import ApiError
from loramux.services import adapter_imports as imports

router = APIRouter(prefix="/v1", tags=["admin"], dependencies=[Depends(get_admin)])
TenantHeader = Annotated[str | None, Header(alias="X-Loramux-Tenant", max_length=200,
                                            description="the tenant the adapter is for: an id or a name")]


class LoadLoraAdapterBody(RequestBody):
    model_config = ConfigDict(extra="ignore")  # vLLM's clients may send fields of newer vLLM versions
    lora_name: str = Field(max_length=200, description="the adapter's name for the tenant (its `model`)")
    lora_path: str = Field(max_length=2048, description="s3://bucket/prefix/ or a directory under "
                                                         "LORAMUX_ADAPTER_IMPORT_ROOTS")
    load_inplace: bool = Field(default=False, description="replace a loaded adapter of that name (a new version)")


class UnloadLoraAdapterBody(RequestBody):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=200)
    lora_int_id: int | None = Field(default=None, description="vLLM's; ignored here")


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterBody, services: ServicesDep, tenant: TenantHeader = None
                            ) -> PlainTextResponse:
    """Fetch, validate and register the adapter at `lora_path` as `lora_name` (vLLM's load)."""
    try:
        owner = await run_in_threadpool(imports.import_tenant, services, tenant)
        version = await run_in_threadpool(imports.load_adapter, services, owner, body.lora_name, body.lora_path,
                                          body.load_inplace)
    except (imports.AdapterAlreadyLoaded, imports.ImportTenantMissing, SourceInvalid) as exc:
        raise ApiError(400, str(exc), code="invalid_lora_adapter", param="lora_path"
                       if isinstance(exc, SourceInvalid) else "lora_name") from None
    except SourceNotFound as exc:
        raise ApiError(404, str(exc), code="lora_adapter_not_found", param="lora_path") from None
    except SourceUnavailable as exc:
        raise ApiError(503, str(exc), retry_after_s=5.0, code="store_unavailable") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                             headers={"X-Loramux-Adapter-Id": version.adapter_id,
                                      "X-Loramux-Adapter-Version": str(version.version)})


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterBody, services: ServicesDep, tenant: TenantHeader = None
                              ) -> PlainTextResponse:
    """Soft-delete the tenant's adapter `lora_name` (vLLM's unload): new requests get 404, running ones finish,
    then its host RAM and device copies are dropped."""
    try:
        owner = await run_in_threadpool(imports.import_tenant, services, tenant)
    except imports.ImportTenantMissing as exc:
        raise ApiError(400, str(exc), code="invalid_lora_adapter", param="lora_name") from None
    await run_in_threadpool(imports.unload_adapter, services, owner, body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
