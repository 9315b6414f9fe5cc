"""Typed FastAPI dependencies: the services, and the calling tenant from its API key."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPBearer

from loramux.server.http.caller_deps import caller_dependency
from loramux.server.http.ingress import TENANT_KEYS
from loramux.server.serving.pipeline import RequestPipeline
from loramux.services.container import Services
from loramux.tenancy.tenants import TenantContext

_bearer = HTTPBearer(auto_error=False, description="A tenant API key: `Authorization: Bearer lmx-...`")


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_pipeline(request: Request) -> RequestPipeline:
    return request.app.state.pipeline


get_tenant = caller_dependency(TENANT_KEYS, _bearer)  # the calling tenant, from its API key

ServicesDep = Annotated[Services, Depends(get_services)]
PipelineDep = Annotated[RequestPipeline, Depends(get_pipeline)]
TenantDep = Annotated[TenantContext, Depends(get_tenant)]
