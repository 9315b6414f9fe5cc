"""Operators' admin keys (`lmxa-...`): /admin/keys."""
from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from loramux.admin.deps import AdminDep
from loramux.admin.keys import AdminKeyInfo
from loramux.admin.routes.schemas import AdminKeyList, NewKey, RevokedAdminKey
from loramux.server.bodies import RequestBody
from loramux.server.deps import ServicesDep
from loramux.server.errors import ApiError

router = APIRouter(prefix="/keys")


class AdminKeyCreate(RequestBody):
    name: str = Field(default="", max_length=128)


@router.post("", status_code=201)
def create_admin_key(body: AdminKeyCreate, services: ServicesDep) -> NewKey:
    info, raw = services.admin_keys.create(body.name)
    return NewKey(id=info.id, key=raw, prefix=info.prefix)


@router.get("", response_model=AdminKeyList)
def list_admin_keys(services: ServicesDep) -> dict:
    return {"keys": services.admin_keys.list()}


@router.delete("/{key_id}", response_model=RevokedAdminKey)
def revoke_admin_key(key_id: str, services: ServicesDep, admin: AdminDep) -> AdminKeyInfo:
    if key_id == admin.id:
        raise ApiError(400, "an admin key cannot revoke itself; use another admin key")
    return services.admin_keys.revoke(key_id)  # AdminKeyError: 404
