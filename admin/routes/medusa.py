"""Medusa speculative-decoding heads for the base model or an adapter version: upload, list, delete (the
operations are `loramux.services.medusa`)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from loramux.adapters.storage.medusa_registry import MedusaHeadsInfo
from loramux.admin.routes.schemas import MedusaHeads, MedusaHeadsList
from loramux.admin.uploads import MEDUSA_FIELD_NAMES, MEDUSA_HINT, receive_upload
from loramux.server.deps import ServicesDep
from loramux.services import medusa as ops

router = APIRouter(prefix="/medusa")


@router.post("", status_code=201, response_model=MedusaHeads)
async def upload_heads(request: Request, services: ServicesDep) -> MedusaHeadsInfo:
    """multipart/form-data: files `medusa_config` (medusa_config.json) and `medusa_heads`
    (medusa_heads.safetensors), as `loramux medusa train` writes them; optional `adapter` (an adapter name of
    `tenant_id`, or an adapter id ad_...) and `version` (default: its latest). With an adapter the heads serve
    that adapter version's requests, else the base model's (and every version without heads of its own). They
    replace the target's active heads. Validated against the served model: 400 with what to fix. On a
    scaled-out (Ray Serve) deployment, whose replicas run no registry heads yet: 409, nothing stored."""
    cap = services.settings.max_upload_bytes + 1024 * 1024  # the weights, the config and the multipart framing
    async with receive_upload(request, cap, MEDUSA_FIELD_NAMES, MEDUSA_HINT) as (fields, files):
        # After the body is read (it is only spooled to a temporary folder): a client still sending it would
        # see a broken connection instead of the answer.
        ops.check_heads_served(services)
        ops.check_medusa_fields(fields)
        return await run_in_threadpool(ops.upload_heads, services, fields, files)


@router.get("", response_model=MedusaHeadsList)
def list_heads(services: ServicesDep, adapter: str | None = None, tenant_id: str | None = None,
               base: bool = False, include_deleted: bool = False) -> dict:
    """Live heads, newest first; `adapter` (a name of `tenant_id`, or ad_...): only that adapter's versions';
    `tenant_id` alone: that tenant's adapters'; `base=true`: only the base model's; `include_deleted=true`:
    deleted and replaced ones too."""
    return {"heads": ops.list_heads(services, tenant_id, adapter, base, include_deleted)}


@router.delete("/{heads_id}", response_model=MedusaHeads)
def delete_heads(heads_id: str, services: ServicesDep) -> MedusaHeadsInfo:
    """Soft delete: later requests use the base model's heads (or none); running ones keep theirs."""
    return ops.delete_heads(services, heads_id)
