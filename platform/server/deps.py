"""Typed FastAPI dependencies: the services, and the calling tenant from its API key."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loramux.admin.keys import ADMIN_KEY_PREFIX
from loramux.server.serving import Server
from loramux.services import Services
from loramux.tenancy import TenantContext

_bearer = HTTPBearer(auto_error=False, description="A tenant API key: `Authorization: Bearer lmx-...`")


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_server(request: Request) -> Server:
    return request.app.state.server


async def get_tenant(request: Request,
                     credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> TenantContext:
    if credentials is None:
        raise HTTPException(401, "missing API key: send `Authorization: Bearer <your key>`",
                            headers={"WWW-Authenticate": "Bearer"})
    if credentials.credentials.startswith(ADMIN_KEY_PREFIX):
        raise HTTPException(403, "admin keys are not accepted on tenant routes: use a tenant API key")
    services: Services = request.app.state.services
    tenant = await run_in_threadpool(services.tenancy.authenticate, credentials.credentials)
    if tenant is None:
        raise HTTPException(401, "invalid or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    if not tenant.active:
        raise HTTPException(403, f"tenant {tenant.tenant_name!r} is suspended; contact your administrator")
    request.state.tenant = tenant
    return tenant


ServicesDep = Annotated[Services, Depends(get_services)]
ServerDep = Annotated[Server, Depends(get_server)]
TenantDep = Annotated[TenantContext, Depends(get_tenant)]
