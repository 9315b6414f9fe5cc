"""The admin credential: `Authorization: Bearer lmxa-...`. Tenant keys are refused here (403)."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loramux.server.http.ingress import Refusal, resolve_admin
from loramux.tenancy.admin_keys import AdminKeyInfo

_bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                     description="An admin key: `Authorization: Bearer lmxa-...`")


async def get_admin(request: Request,
                    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> AdminKeyInfo:
    """The admin key `loramux.server.http.ingress:Ingress` resolved before the body was read; without that
    middleware (an app assembled differently), the same checks here."""
    admin = request.scope.get("state", {}).get("admin")
    if admin is None:
        admin = await resolve_admin(request.app.state.services, credentials.credentials if credentials else None)
        if isinstance(admin, Refusal):
            raise HTTPException(admin.status, admin.message, headers=admin.headers or None)
        request.state.admin = admin
    return admin


AdminDep = Annotated[AdminKeyInfo, Depends(get_admin)]
