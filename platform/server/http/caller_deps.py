"""The FastAPI dependency that hands a route its caller: the tenant (tenant routes) or the admin key (admin
routes) that `loramux.server.http.ingress:Ingress` resolved before the body was read; without that middleware
(an app assembled differently), resolved here by the same checks."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loramux.server.http.ingress import BearerKeys, Refusal

C = TypeVar("C")


def caller_dependency(keys: BearerKeys[C], bearer: HTTPBearer) -> Callable[..., Awaitable[C]]:
    """A dependency answering the caller of `keys`' kind; `bearer` reads the header (and names the scheme in the
    OpenAPI document). A refusal is an HTTPException with its status, message and headers."""

    # A default, not Annotated: with postponed annotations FastAPI resolves them in this module's globals,
    # where `bearer` (a local) is not.
    async def caller(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> C:
        found = request.scope.get("state", {}).get(keys.state_key)
        if found is None:
            found = await keys.resolve(request.app.state.services, credentials.credentials if credentials else None)
            if isinstance(found, Refusal):
                raise HTTPException(found.status, found.message, headers=found.headers or None)
            setattr(request.state, keys.state_key, found)
        return found

    return caller
