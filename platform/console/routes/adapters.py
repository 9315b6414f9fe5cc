"""Adapters: every tenant's, with where each one's latest version is now (S3/store, disk, RAM, device) and
its requests and tokens in the last hour; upload (with a progress bar; the validator's message on a
refusal), versions, visibility, delete, warm and pin.

Uploads go through the admin API's own path (`receive_upload` and the registry's validation), so the
console accepts and refuses exactly what the API does, and a refused upload stores nothing.
"""
from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse

from loramux.adapters.registry import RegistryError
from loramux.adapters.validation_common import AdapterFormatError
from loramux.admin.billing import Period, summary
from loramux.admin.routes import adapters as admin_adapters
from loramux.admin.uploads import UploadError, receive_upload
from loramux.console.deps import CheckedForm, CsrfRejected, Operator, render
from loramux.console.session import CSRF_FIELD, csrf_matches
from loramux.db.models import utcnow
from loramux.server.errors import ApiError

router = APIRouter(prefix="/adapters")


def _last_hour(services) -> dict[str, dict]:
    """adapter id -> requests and tokens in the last hour (the ledger's billing summary)."""
    now = utcnow()
    services.ledger.flush(5.0)
    lines = summary(services.db, None, Period(now - timedelta(hours=1), None))["adapters"]
    usage: dict[str, dict] = {}
    for line in lines:
        if line["adapter_id"] is not None:
            seen = usage.setdefault(line["adapter_id"], {"requests": 0, "tokens": 0})
            seen["requests"] += line["requests"]
            seen["tokens"] += line["prompt_tokens"] + line["completion_tokens"]
    return usage


def _listing(services) -> list[dict]:
    tenants = {t.id: t.name for t in services.tenancy.list_tenants()}
    usage = _last_hour(services)
    rows = []
    for version in services.registry.list_all(None):
        rows.append({"version": version, "tenant": tenants.get(version.tenant_id, version.tenant_id),
                     "where": admin_adapters._residency(services, version),
                     "pinned": version.adapter_id in services.admin_pins,
                     "usage": usage.get(version.adapter_id, {"requests": 0, "tokens": 0})})
    return rows


@router.get("")
async def adapters_page(request: Request, operator: Operator, notice: str | None = None):
    services = request.app.state.services
    rows = await run_in_threadpool(_listing, services)
    tenants = await run_in_threadpool(services.tenancy.list_tenants)
    return render(request, "adapters.html", operator, rows=rows, tenants=tenants, notice=notice,
                  max_upload_bytes=services.settings.max_upload_bytes)


@router.post("/upload")
async def upload(request: Request, operator: Operator):
    """multipart: csrf_token, tenant_id, name, visibility, adapter_config, adapter_model. JSON answer for the
    page's script ({"ok": true, "adapter": ...} or {"ok": false, "message": the validator's words})."""
    services = request.app.state.services
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
            admin_adapters._check_form_fields(fields)
            version = await run_in_threadpool(admin_adapters._register, services, fields, files)
    except (UploadError, AdapterFormatError, RegistryError, ApiError) as exc:
        if not checked:  # a form without the token learns nothing about its body
            raise CsrfRejected from None
        status = getattr(exc, "status", None) or (413 if getattr(exc, "code", "") == "too_large" else 400)
        return JSONResponse({"ok": False, "message": str(exc)}, status_code=status)
    return JSONResponse({"ok": True, "adapter": {"id": version.adapter_id, "name": version.name,
                                                 "version": version.version, "digest": version.digest}},
                        status_code=201)


@router.get("/{adapter_id}")
async def adapter_page(request: Request, adapter_id: str, operator: Operator, notice: str | None = None):
    services = request.app.state.services
    owner = await run_in_threadpool(services.registry.owner_of, adapter_id)
    versions = await run_in_threadpool(services.registry.versions, owner, adapter_id)
    where = await run_in_threadpool(admin_adapters._residency, services, versions[-1]) if versions else None
    return render(request, "adapter.html", operator, adapter_id=adapter_id, versions=versions, where=where,
                  pinned=adapter_id in services.admin_pins, notice=notice)


@router.post("/{adapter_id}/visibility")
async def set_visibility(request: Request, adapter_id: str, operator: Operator, form: CheckedForm):
    services = request.app.state.services
    visibility = form.get("visibility")
    if visibility not in ("private", "public"):
        return render(request, "error.html", operator, status_code=400, message="visibility is private or public")
    owner = await run_in_threadpool(services.registry.owner_of, adapter_id)
    await run_in_threadpool(services.registry.set_visibility, owner, adapter_id, visibility)
    return RedirectResponse(f"/console/adapters/{adapter_id}?notice=saved", status_code=303)


@router.post("/{adapter_id}/delete")
async def delete(request: Request, adapter_id: str, operator: Operator, form: CheckedForm):
    services = request.app.state.services
    owner = await run_in_threadpool(services.registry.owner_of, adapter_id)
    admin_adapters._unpin(services, adapter_id)
    await run_in_threadpool(services.registry.delete, owner, adapter_id)
    return RedirectResponse("/console/adapters?notice=deleted", status_code=303)


@router.post("/{adapter_id}/warm")
async def warm(request: Request, adapter_id: str, operator: Operator, form: CheckedForm):
    await admin_adapters.warm_adapter(adapter_id, request.app.state.services)
    return RedirectResponse(f"/console/adapters/{adapter_id}?notice=warmed", status_code=303)


@router.post("/{adapter_id}/pin")
async def pin(request: Request, adapter_id: str, operator: Operator, form: CheckedForm):
    services = request.app.state.services
    if form.get("pinned") == "false":
        admin_adapters.unpin_adapter(adapter_id, services)
    else:
        await admin_adapters.pin_adapter(adapter_id, services)
    return RedirectResponse(f"/console/adapters/{adapter_id}?notice=saved", status_code=303)
