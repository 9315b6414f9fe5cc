"""Tenants and their API keys: /admin/tenants and /admin/tenants/{tenant_id}/keys."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from loramux.admin.routes.schemas import Key, KeyList, NewKey, RotatedKey, Tenant, TenantList
from loramux.server.bodies import RequestBody
from loramux.server.deps import ServicesDep
from loramux.tenancy import KeyInfo, TenantInfo

router = APIRouter(prefix="/tenants")


class TenantCreate(RequestBody):
    name: str = Field(min_length=1, max_length=128)
    tier: str = "standard"


class TenantPatch(RequestBody):
    tier: str | None = None
    status: Literal["active", "suspended"] | None = None
    fallback: str | None = Field(default=None, max_length=200)


@router.post("", status_code=201, response_model=Tenant)
def create_tenant(body: TenantCreate, services: ServicesDep) -> TenantInfo:
    return services.tenancy.create_tenant(body.name, body.tier)


@router.get("", response_model=TenantList)
def list_tenants(services: ServicesDep) -> dict:
    return {"tenants": services.tenancy.list_tenants()}


@router.get("/{tenant_id}", response_model=Tenant)
def get_tenant(tenant_id: str, services: ServicesDep) -> TenantInfo:
    """A tenant by id or name."""
    return services.tenancy.tenant(tenant_id)


@router.patch("/{tenant_id}", response_model=Tenant)
def patch_tenant(tenant_id: str, body: TenantPatch, services: ServicesDep) -> TenantInfo:
    tenant = services.tenancy.tenant(tenant_id)
    return services.tenancy.set_tenant(tenant.id, tier=body.tier, status=body.status, fallback=body.fallback)


@router.post("/{tenant_id}/keys", status_code=201)
def create_key(tenant_id: str, services: ServicesDep) -> NewKey:
    info, raw = services.tenancy.create_key(tenant_id)
    return NewKey(id=info.id, key=raw, prefix=info.prefix)


@router.get("/{tenant_id}/keys", response_model=KeyList)
def list_keys(tenant_id: str, services: ServicesDep) -> dict:
    return {"keys": services.tenancy.list_keys(services.tenancy.tenant(tenant_id).id)}


@router.post("/{tenant_id}/keys/{key_id}/rotate", status_code=201)
def rotate_key(tenant_id: str, key_id: str, services: ServicesDep) -> RotatedKey:
    """A new key replaces `key_id`, which is revoked at once."""
    info, raw, old = services.tenancy.rotate_key(services.tenancy.tenant(tenant_id).id, key_id)
    return RotatedKey(id=info.id, key=raw, prefix=info.prefix, revoked=old.id)


@router.delete("/{tenant_id}/keys/{key_id}", response_model=Key)
def revoke_key(tenant_id: str, key_id: str, services: ServicesDep) -> KeyInfo:
    return services.tenancy.revoke_key(services.tenancy.tenant(tenant_id).id, key_id)
