"""Adapters: every tenant's, with where each one's latest version is now (S3/store, disk, RAM, device) and
its requests and tokens in the last hour; upload (with a progress bar; the validator's message on a
refusal), merge (PEFT's add_weighted_adapter, `loramux.services.adapter_merges`), versions with the provenance
of merged ones, visibility, delete, warm and pin.

Every operation is the admin API's own (`loramux.services.adapters`, uploads through `receive_upload`), so
the console accepts and refuses exactly what the API does, and a refused upload stores nothing.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse

from loramux.adapters.formats.validation_common import AdapterFormatError
from loramux.adapters.storage.registry import AdapterNotFoundError, RegistryError
from loramux.admin.uploads import receive_upload
from loramux.console.deps import CheckedForm, CsrfRejected, Operator, render
from loramux.console.session import CSRF_FIELD, csrf_matches
from loramux.names import InvalidNameError
from loramux.server.deps import ServicesDep
from loramux.server.http.errors import ApiError
from loramux.services import adapter_merges as merges
from loramux.services import adapters as ops
from loramux.services import tenants
from loramux.tenancy.tenants import TenancyError, TenantNotFoundError

router = APIRouter(prefix="/adapters")


@router.get("")
async def adapters_page(request: Request, operator: Operator, services: ServicesDep, notice: str | None = None):
    rows = await run_in_threadpool(ops.adapter_overview, services)
    tenant_list = await run_in_threadpool(tenants.list_tenants, services.tenancy)
    return render(request, "adapters.html", operator, rows=rows, tenants=tenant_list, notice=notice,
                  max_upload_bytes=services.settings.max_upload_bytes)


@router.post("/upload")
async def upload(request: Request, operator: Operator, services: ServicesDep):
    """multipart: csrf_token, tenant_id, name, visibility, adapter_config, adapter_model. JSON answer for the
    page's script ({"ok": true, "adapter": ...} or {"ok": false, "message": the validator's words})."""
    cap = services.settings.max_upload_bytes + 1024 * 1024
    header = request.headers.get("x-csrf-token")
    if header is not None and not csrf_matches(operator[0], header):  # checked before a byte is read
        raise CsrfRejected
    checked = header is not None
    try:
        async with receive_upload(request, cap) as (fields, files):
            if not checked and not csrf_matches(operator[0], fields.get(CSRF_FIELD)):
                raise CsrfRejected
            checked = True
            fields.pop(CSRF_FIELD, None)
            ops.check_upload_fields(fields)
            version = await run_in_threadpool(ops.register_upload, services, fields, files)
    except (ops.UploadError, AdapterFormatError, RegistryError, ApiError) as exc:
        if not checked:  # a form without the token learns nothing about its body
            raise CsrfRejected from None
        status = getattr(exc, "status", None) or (413 if getattr(exc, "code", "") == "too_large" else 400)
        return JSONResponse({"ok": False, "message": str(exc)}, status_code=status)
    return JSONResponse({"ok": True, "adapter": {"id": version.adapter_id, "name": version.name,
                                                 "version": version.version, "digest": version.digest}},
                        status_code=201)


_MERGE_PARAMETERS = {"density": float, "majority_sign_method": str, "seed": int, "svd_rank": int, "svd_clamp": float}


@router.post("/merge")
async def merge(request: Request, operator: Operator, form: CheckedForm, services: ServicesDep):
    """Form: tenant_id, name, visibility, method, components (one `ADAPTER[@VERSION][=WEIGHT]` a line) and the
    method's parameters (empty ones left out). The merged adapter's page on success; the refusal's words else."""
    try:
        parameters = {}
        for key, kind in _MERGE_PARAMETERS.items():
            text = (form.get(key) or "").strip()
            if text:
                try:
                    parameters[key] = kind(text)
                except ValueError:
                    raise ApiError(400, f"parameters.{key} must be a {kind.__name__}, got {text[:40]!r}") from None
        components = merges.parse_components(form.get("components") or "")
        version = await run_in_threadpool(merges.merge_adapters, services, form.get("tenant_id") or "",
                                          form.get("name") or "", components, form.get("method") or "", parameters,
                                          form.get("visibility") or "private")
    except (AdapterFormatError, RegistryError, ApiError, InvalidNameError, TenancyError) as exc:
        status = 404 if isinstance(exc, (AdapterNotFoundError, TenantNotFoundError)) else 400
        return render(request, "error.html", operator, status_code=status, message=str(exc))
    return RedirectResponse(f"/console/adapters/{version.adapter_id}?notice=merged", status_code=303)


@router.get("/{adapter_id}")
async def adapter_page(request: Request, adapter_id: str, operator: Operator, services: ServicesDep,
                       notice: str | None = None):
    detail = await run_in_threadpool(ops.adapter_detail, services, adapter_id)
    return render(request, "adapter.html", operator, adapter_id=adapter_id, versions=detail["versions"],
                  where=detail["residency"], pinned=detail["pinned"], notice=notice)


@router.post("/{adapter_id}/visibility")
async def set_visibility(request: Request, adapter_id: str, operator: Operator, form: CheckedForm,
                         services: ServicesDep):
    visibility = form.get("visibility")
    if visibility not in ("private", "public"):
        return render(request, "error.html", operator, status_code=400, message="visibility is private or public")
    await run_in_threadpool(ops.set_visibility, services, adapter_id, visibility)
    return RedirectResponse(f"/console/adapters/{adapter_id}?notice=saved", status_code=303)


@router.post("/{adapter_id}/delete")
async def delete(request: Request, adapter_id: str, operator: Operator, form: CheckedForm, services: ServicesDep):
    await run_in_threadpool(ops.delete_adapter, services, adapter_id)
    return RedirectResponse("/console/adapters?notice=deleted", status_code=303)


@router.post("/{adapter_id}/warm")
async def warm(request: Request, adapter_id: str, operator: Operator, form: CheckedForm, services: ServicesDep):
    await ops.warm_adapter(services, await run_in_threadpool(ops.latest_version, services, adapter_id))
    return RedirectResponse(f"/console/adapters/{adapter_id}?notice=warmed", status_code=303)


@router.post("/{adapter_id}/pin")
async def pin(request: Request, adapter_id: str, operator: Operator, form: CheckedForm, services: ServicesDep):
    if form.get("pinned") == "false":
        await run_in_threadpool(ops.unpin_adapter, services, adapter_id)
    else:
        await ops.pin_adapter(services, await run_in_threadpool(ops.latest_version, services, adapter_id))
    return RedirectResponse(f"/console/adapters/{adapter_id}?notice=saved", status_code=303)
