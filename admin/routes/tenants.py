"""Tenants and their API keys: /admin/tenants and /admin/tenants/{tenant_id}/keys."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from loramux.admin.routes.schemas import Key, KeyList, NewKey, RotatedKey, Tenant, TenantList
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import tenants as ops
from loramux.tenancy.tenants import KeyInfo, TenantInfo

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
    return ops.create_tenant(services.tenancy, body.name, body.tier)


@router.get("", response_model=TenantList)
def list_tenants(services: ServicesDep) -> dict:
    return {"tenants": ops.list_tenants(services.tenancy)}


@router.get("/{tenant_id}", response_model=Tenant)
def get_tenant(tenant_id: str, services: ServicesDep) -> TenantInfo:
    """A tenant by id or name."""
    return ops.get_tenant(services.tenancy, tenant_id)


@router.patch("/{tenant_id}", response_model=Tenant)
def patch_tenant(tenant_id: str, body: TenantPatch, services: ServicesDep) -> TenantInfo:
    return ops.update_tenant(services.tenancy, tenant_id, tier=body.tier, status=body.status, fallback=body.fallback)


@router.post("/{tenant_id}/keys", status_code=201)
def create_key(tenant_id: str, services: ServicesDep) -> NewKey:
    issued = ops.issue_key(services.tenancy, tenant_id)
    return NewKey(id=issued.id, key=issued.key, prefix=issued.prefix)


@router.get("/{tenant_id}/keys", response_model=KeyList)
def list_keys(tenant_id: str, services: ServicesDep) -> dict:
    return {"keys": ops.list_keys(services.tenancy, tenant_id)}


@router.post("/{tenant_id}/keys/{key_id}/rotate", status_code=201)
def rotate_key(tenant_id: str, key_id: str, services: ServicesDep) -> RotatedKey:
    """A new key replaces `key_id`, which is revoked at once."""
    issued = ops.rotate_key(services.tenancy, tenant_id, key_id)
    return RotatedKey(id=issued.id, key=issued.key, prefix=issued.prefix, revoked=issued.revoked.id)


@router.delete("/{tenant_id}/keys/{key_id}", response_model=Key)
def revoke_key(tenant_id: str, key_id: str, services: ServicesDep) -> KeyInfo:
    return ops.revoke_key(services.tenancy, tenant_id, key_id)
