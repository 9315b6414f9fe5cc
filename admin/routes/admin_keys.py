"""Operators' admin keys (`lmxa-...`): /admin/keys."""
from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from loramux.admin.deps import AdminDep
from loramux.admin.routes.schemas import AdminKeyList, NewKey, RevokedAdminKey
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import admin_keys as ops
from loramux.tenancy.admin_keys import AdminKeyInfo

router = APIRouter(prefix="/keys")


class AdminKeyCreate(RequestBody):
    name: str = Field(default="", max_length=128)


@router.post("", status_code=201)
def create_admin_key(body: AdminKeyCreate, services: ServicesDep) -> NewKey:
    issued = ops.create_admin_key(services.admin_keys, body.name)
    return NewKey(id=issued.id, key=issued.key, prefix=issued.prefix)


@router.get("", response_model=AdminKeyList)
def list_admin_keys(services: ServicesDep) -> dict:
    return {"keys": ops.list_admin_keys(services.admin_keys)}


@router.delete("/{key_id}", response_model=RevokedAdminKey)
def revoke_admin_key(key_id: str, services: ServicesDep, admin: AdminDep) -> AdminKeyInfo:
    return ops.revoke_admin_key(services.admin_keys, key_id, admin.id)  # AdminKeyError: 404
