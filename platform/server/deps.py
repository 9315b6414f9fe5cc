"""Typed FastAPI dependencies: the services, and the calling tenant from its API key."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loramux.server.http.ingress import Refusal, resolve_tenant
from loramux.server.serving.pipeline import Server
from loramux.services.container import Services
from loramux.tenancy.tenants import TenantContext

_bearer = HTTPBearer(auto_error=False, description="A tenant API key: `Authorization: Bearer lmx-...`")


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_server(request: Request) -> Server:
    return request.app.state.server


async def get_tenant(request: Request,
                     credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> TenantContext:
    """The tenant `loramux.server.http.ingress:Ingress` resolved before the body was read; without that
    middleware (an app assembled differently), the same checks here."""
    tenant = request.scope.get("state", {}).get("tenant")
    if tenant is None:
        tenant = await resolve_tenant(request.app.state.services, credentials.credentials if credentials else None)
        if isinstance(tenant, Refusal):
            raise HTTPException(tenant.status, tenant.message, headers=tenant.headers or None)
        request.state.tenant = tenant
    return tenant


ServicesDep = Annotated[Services, Depends(get_services)]
ServerDep = Annotated[Server, Depends(get_server)]
TenantDep = Annotated[TenantContext, Depends(get_tenant)]
