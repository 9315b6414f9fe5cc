"""The admin API under /admin: tenants, keys, adapters, tiers, prices and billing. Every route needs an
admin key (AdminDep); tenant keys get 403 here, and admin keys get 403 on tenant routes."""
from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import iterate_in_threadpool, run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from loramux.adapters.registry import (AdapterNotFoundError, AdapterVersionInfo, InvalidNameError, TenantExistsError,
                                       TenantNotFoundError)
from loramux.adapters.validation import AdapterFormatError
from loramux.admin.deps import AdminDep
from loramux.admin.uploads import UploadError, receive_upload
from loramux.server.bodies import RequestBody, reject_lone_surrogates
from loramux.server.deps import ServicesDep
from loramux.tenancy import TenancyError, TenantLookupError, TierInfo

router = APIRouter(prefix="/admin", tags=["admin"])


def _tenant_json(t) -> dict:
    return {"id": t.id, "name": t.name, "tier": t.tier, "status": t.status, "fallback": t.fallback,
            "created_at": t.created_at.isoformat()}


def _key_json(k) -> dict:
    return {"id": k.id, "prefix": k.prefix, "created_at": k.created_at.isoformat(),
            "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}


def _version_json(v: AdapterVersionInfo) -> dict:
    return {"id": v.adapter_id, "tenant_id": v.tenant_id, "name": v.name, "visibility": v.visibility,
            "version": v.version, "digest": v.digest, "size_bytes": v.size_bytes, "rank": v.rank, "alpha": v.alpha,
            "use_rslora": v.use_rslora, "target_modules": list(v.target_modules), "base_model": v.base_model,
            "created_at": v.created_at.isoformat()}


async def _tenant_or_404(services, tenant_id: str):
    try:
        return await run_in_threadpool(services.tenancy.tenant, tenant_id)
    except TenantLookupError as exc:
        raise HTTPException(404, str(exc)) from None


# -- tenants and keys ----------------------------------------------------------------------------------
class TenantCreate(RequestBody):
    name: str = Field(min_length=1, max_length=128)
    tier: str = "standard"


class TenantPatch(RequestBody):
    tier: str | None = None
    status: Literal["active", "suspended"] | None = None
    fallback: str | None = Field(default=None, max_length=200)


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, services: ServicesDep, admin: AdminDep) -> dict:
    try:
        tenant = await run_in_threadpool(services.tenancy.create_tenant, body.name, body.tier)
    except TenantExistsError as exc:
        raise HTTPException(409, str(exc)) from None
    except (InvalidNameError, TenancyError) as exc:
        raise HTTPException(400, str(exc)) from None
    return _tenant_json(tenant)


@router.get("/tenants")
async def list_tenants(services: ServicesDep, admin: AdminDep) -> dict:
    return {"tenants": [_tenant_json(t) for t in await run_in_threadpool(services.tenancy.list_tenants)]}


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    return _tenant_json(await _tenant_or_404(services, tenant_id))


@router.patch("/tenants/{tenant_id}")
async def patch_tenant(tenant_id: str, body: TenantPatch, services: ServicesDep, admin: AdminDep) -> dict:
    tenant = await _tenant_or_404(services, tenant_id)
    try:
        tenant = await run_in_threadpool(lambda: services.tenancy.set_tenant(
            tenant.id, tier=body.tier, status=body.status, fallback=body.fallback))
    except TenancyError as exc:
        raise HTTPException(400, str(exc)) from None
    return _tenant_json(tenant)


@router.post("/tenants/{tenant_id}/keys", status_code=201)
async def create_key(tenant_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    tenant = await _tenant_or_404(services, tenant_id)
    info, raw = await run_in_threadpool(services.tenancy.create_key, tenant.id)
    return {"id": info.id, "key": raw, "prefix": info.prefix}


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    tenant = await _tenant_or_404(services, tenant_id)
    return {"keys": [_key_json(k) for k in await run_in_threadpool(services.tenancy.list_keys, tenant.id)]}


@router.post("/tenants/{tenant_id}/keys/{key_id}/rotate", status_code=201)
async def rotate_key(tenant_id: str, key_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    """A new key replaces `key_id`, which is revoked at once."""
    tenant = await _tenant_or_404(services, tenant_id)
    try:
        old = await run_in_threadpool(services.tenancy.revoke_key, tenant.id, key_id)
    except TenantLookupError as exc:
        raise HTTPException(404, str(exc)) from None
    info, raw = await run_in_threadpool(services.tenancy.create_key, tenant.id)
    return {"id": info.id, "key": raw, "prefix": info.prefix, "revoked": old.id}


@router.delete("/tenants/{tenant_id}/keys/{key_id}")
async def revoke_key(tenant_id: str, key_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    tenant = await _tenant_or_404(services, tenant_id)
    try:
        return _key_json(await run_in_threadpool(services.tenancy.revoke_key, tenant.id, key_id))
    except TenantLookupError as exc:
        raise HTTPException(404, str(exc)) from None


# -- adapters ------------------------------------------------------------------------------------------
@router.post("/adapters", status_code=201)
async def upload_adapter(request: Request, services: ServicesDep, admin: AdminDep):
    """multipart/form-data: `tenant_id`, `name`, optional `visibility` (private|public), files
    `adapter_config` (adapter_config.json) and `adapter_model` (adapter_model.safetensors)."""
    settings = services.settings
    cap = settings.max_upload_bytes + 1024 * 1024  # the weights, the config and the multipart framing
    try:
        async with receive_upload(request, cap) as (fields, files):
            missing = [f for f in ("tenant_id", "name") if not fields.get(f)]
            if missing:
                raise UploadError(400, f"missing form field(s): {', '.join(missing)}")
            try:
                reject_lone_surrogates(fields)
            except ValueError as exc:
                raise UploadError(400, f"form fields {exc}") from None
            tenant = await _tenant_or_404(services, fields["tenant_id"])
            version = await run_in_threadpool(services.registry.register, tenant.id, fields["name"], files,
                                              fields.get("visibility") or "private")
    except UploadError as exc:
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": None,
                                       "code": "upload_rejected"}}, status_code=exc.status)
    except AdapterFormatError as exc:
        code = getattr(exc, "code", "invalid_adapter")
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": None,
                                       "code": code}}, status_code=413 if code == "too_large" else 400)
    except (InvalidNameError, TenantNotFoundError) as exc:
        raise HTTPException(404 if isinstance(exc, TenantNotFoundError) else 400, str(exc)) from None
    return {"id": version.adapter_id, "name": version.name, "version": version.version, "digest": version.digest,
            "tenant_id": version.tenant_id, "size_bytes": version.size_bytes}


@router.get("/adapters")
async def list_adapters(services: ServicesDep, admin: AdminDep, tenant_id: str | None = None) -> dict:
    if tenant_id is not None:
        tenant_id = (await _tenant_or_404(services, tenant_id)).id
    return {"adapters": [_version_json(v) for v in await run_in_threadpool(services.registry.list_all, tenant_id)]}


async def _owner(services, adapter_id: str) -> str:
    try:
        return await run_in_threadpool(services.registry.owner_of, adapter_id)
    except AdapterNotFoundError as exc:
        raise HTTPException(404, str(exc)) from None


@router.get("/adapters/{adapter_id}")
async def show_adapter(adapter_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    owner = await _owner(services, adapter_id)
    versions = await run_in_threadpool(services.registry.versions, owner, adapter_id)
    return {"id": adapter_id, "tenant_id": owner, "versions": [_version_json(v) for v in versions],
            "pinned": adapter_id in request_pins(services)}


class AdapterPatch(RequestBody):
    visibility: Literal["private", "public"]


@router.patch("/adapters/{adapter_id}")
async def patch_adapter(adapter_id: str, body: AdapterPatch, services: ServicesDep, admin: AdminDep) -> dict:
    owner = await _owner(services, adapter_id)
    return _version_json(await run_in_threadpool(services.registry.set_visibility, owner, adapter_id, body.visibility))


@router.delete("/adapters/{adapter_id}")
async def delete_adapter(adapter_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    """Soft delete: later requests get 404, running ones finish; blobs no live version uses are removed."""
    owner = await _owner(services, adapter_id)
    await _unpin(services, adapter_id)
    gone = await run_in_threadpool(services.registry.delete, owner, adapter_id)
    return {"id": adapter_id, "deleted_versions": [v.version for v in gone]}


@router.post("/adapters/{adapter_id}/warm")
async def warm_adapter(adapter_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    """Bring the latest version into host RAM now (it stays until the RAM cache needs the room)."""
    owner = await _owner(services, adapter_id)
    version = await run_in_threadpool(services.registry.resolve, owner, adapter_id)
    lease = await _acquire(services, version)
    services.adapter_cache.release(version.digest)
    return {"id": adapter_id, "version": version.version, "loaded_from": lease.tier, "load_ms": round(lease.load_ms, 1)}


@router.post("/adapters/{adapter_id}/pin")
async def pin_adapter(adapter_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    """Keep the latest version in host RAM until unpinned (pinned adapters are never evicted)."""
    owner = await _owner(services, adapter_id)
    pins = request_pins(services)
    if adapter_id not in pins:
        version = await run_in_threadpool(services.registry.resolve, owner, adapter_id)
        await _acquire(services, version)
        pins[adapter_id] = version.digest
    return {"id": adapter_id, "pinned": True}


@router.delete("/adapters/{adapter_id}/pin")
async def unpin_adapter(adapter_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    await _owner(services, adapter_id)
    await _unpin(services, adapter_id)
    return {"id": adapter_id, "pinned": False}


def request_pins(services) -> dict[str, str]:
    """Adapters pinned by operators: adapter id -> pinned digest."""
    if not hasattr(services, "admin_pins"):
        services.admin_pins = {}
    return services.admin_pins


async def _unpin(services, adapter_id: str) -> None:
    digest = request_pins(services).pop(adapter_id, None)
    if digest is not None:
        services.adapter_cache.release(digest)


async def _acquire(services, version):
    from loramux.adapters.tiers import AdapterLoadError

    try:
        return await services.adapter_cache.acquire(version, timeout=120)
    except (AdapterLoadError, TimeoutError) as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None


# -- tiers and prices ----------------------------------------------------------------------------------
class TierBody(RequestBody):
    priority: int = Field(ge=-100, le=100)
    requests_per_min: int = Field(default=0, ge=0)
    tokens_per_min: int = Field(default=0, ge=0)
    max_concurrent: int = Field(default=0, ge=0)
    default_timeout_s: float = Field(gt=0, le=86_400)
    max_timeout_s: float = Field(gt=0, le=86_400)


@router.get("/tiers")
async def list_tiers(services: ServicesDep, admin: AdminDep) -> dict:
    return {"tiers": [t.__dict__ for t in await run_in_threadpool(services.tenancy.tiers)]}


@router.put("/tiers/{name}")
async def put_tier(name: str, body: TierBody, services: ServicesDep, admin: AdminDep) -> dict:
    try:
        info = await run_in_threadpool(services.tenancy.upsert_tier, TierInfo(name=name, **body.model_dump()))
    except TenancyError as exc:
        raise HTTPException(400, str(exc)) from None
    return info.__dict__


class PriceBody(RequestBody):
    base_model: str | None = Field(default=None, description="default: the served base model")
    adapter_id: str | None = None
    tier: str | None = None
    input_per_mtok: Decimal = Field(ge=0, description="USD per 1M prompt tokens (not cached)")
    cached_input_per_mtok: Decimal = Field(ge=0, description="USD per 1M cached prompt tokens")
    output_per_mtok: Decimal = Field(ge=0, description="USD per 1M completion tokens")
    effective_from: datetime | None = Field(default=None, description="default: now; timezone required")


def _price_json(p) -> dict:
    return {"id": p.id, "base_model": p.base_model, "adapter_id": p.adapter_id, "tier": p.tier,
            "input_per_mtok": str(p.input_per_mtok), "cached_input_per_mtok": str(p.cached_input_per_mtok),
            "output_per_mtok": str(p.output_per_mtok), "effective_from": p.effective_from.isoformat()}


@router.post("/prices", status_code=201)
async def set_price(body: PriceBody, request: Request, services: ServicesDep, admin: AdminDep) -> dict:
    from loramux.admin.pricing import PriceError

    if body.tier is not None:
        try:
            await run_in_threadpool(services.tenancy.tier, body.tier)
        except TenancyError as exc:
            raise HTTPException(400, str(exc)) from None
    if body.adapter_id is not None:
        await _owner(services, body.adapter_id)
    try:
        price = await run_in_threadpool(lambda: services.prices.set_price(
            body.base_model or request.app.state.server.model_id, str(body.input_per_mtok),
            str(body.cached_input_per_mtok), str(body.output_per_mtok), adapter_id=body.adapter_id, tier=body.tier,
            effective_from=body.effective_from))
    except PriceError as exc:
        raise HTTPException(400, str(exc)) from None
    return _price_json(price)


@router.get("/prices")
async def list_prices(services: ServicesDep, admin: AdminDep, base_model: str | None = None) -> dict:
    return {"prices": [_price_json(p) for p in await run_in_threadpool(services.prices.list_prices, base_model)]}


# -- billing -------------------------------------------------------------------------------------------
def _period(start: str | None, end: str | None):
    from loramux.admin.billing import BillingQueryError, parse_period

    try:
        return parse_period(start, end)
    except BillingQueryError as exc:
        raise HTTPException(400, str(exc)) from None


def _jsonable(value):
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


@router.get("/billing/summary")
async def billing_summary(services: ServicesDep, admin: AdminDep, tenant_id: str | None = None,
                          start: str | None = Query(default=None, description="ISO 8601, inclusive"),
                          end: str | None = Query(default=None, description="ISO 8601, exclusive")) -> dict:
    from loramux.admin.billing import summary

    period = _period(start, end)
    await run_in_threadpool(services.ledger.flush, 10.0)  # include what finished a moment ago
    return _jsonable(await run_in_threadpool(summary, services.db, tenant_id, period))


@router.get("/billing/export")
async def billing_export(services: ServicesDep, admin: AdminDep, tenant_id: str | None = None,
                         start: str | None = None, end: str | None = None,
                         format: Literal["csv", "jsonl", "parquet"] = "csv"):
    from loramux.admin.billing import content_type, export

    period = _period(start, end)
    await run_in_threadpool(services.ledger.flush, 10.0)
    name = f"loramux-billing{'-' + tenant_id if tenant_id else ''}.{format}"
    return StreamingResponse(iterate_in_threadpool(export(services.db, format, tenant_id, period)),
                             media_type=content_type(format),
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


# -- admin keys ----------------------------------------------------------------------------------------
class AdminKeyCreate(RequestBody):
    name: str = Field(default="", max_length=128)


@router.post("/keys", status_code=201)
async def create_admin_key(body: AdminKeyCreate, services: ServicesDep, admin: AdminDep) -> dict:
    info, raw = await run_in_threadpool(services.admin_keys.create, body.name)
    return {"id": info.id, "key": raw, "prefix": info.prefix}


@router.get("/keys")
async def list_admin_keys(services: ServicesDep, admin: AdminDep) -> dict:
    return {"keys": [{"id": k.id, "name": k.name, "prefix": k.prefix, "created_at": k.created_at.isoformat(),
                      "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}
                     for k in await run_in_threadpool(services.admin_keys.list)]}


@router.delete("/keys/{key_id}")
async def revoke_admin_key(key_id: str, services: ServicesDep, admin: AdminDep) -> dict:
    from loramux.admin.keys import AdminKeyError

    if key_id == admin.id:
        raise HTTPException(400, "an admin key cannot revoke itself; use another admin key")
    try:
        info = await run_in_threadpool(services.admin_keys.revoke, key_id)
    except AdminKeyError as exc:
        raise HTTPException(404, str(exc)) from None
    return {"id": info.id, "revoked_at": info.revoked_at.isoformat()}
