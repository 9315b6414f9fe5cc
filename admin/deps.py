"""The admin credential: `Authorization: Bearer lmxa-...`. Tenant keys are refused here (403)."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loramux.admin.keys import AdminKeyInfo
from loramux.tenancy import KEY_PREFIX

_bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                     description="An admin key: `Authorization: Bearer lmxa-...`")


async def get_admin(request: Request,
                    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> AdminKeyInfo:
    if credentials is None:
        raise HTTPException(401, "missing admin key: send `Authorization: Bearer <admin key>`",
                            headers={"WWW-Authenticate": "Bearer"})
    raw = credentials.credentials
    if raw.startswith(KEY_PREFIX):
        raise HTTPException(403, "tenant API keys are not accepted on admin routes: use an admin key")
    admin = await run_in_threadpool(request.app.state.services.admin_keys.authenticate, raw)
    if admin is None:
        raise HTTPException(401, "invalid or revoked admin key", headers={"WWW-Authenticate": "Bearer"})
    return admin


AdminDep = Annotated[AdminKeyInfo, Depends(get_admin)]
