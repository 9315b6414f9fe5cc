"""The admin credential: `Authorization: Bearer lmxa-...`. Tenant keys are refused here (403)."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPBearer

from loramux.server.http.caller_deps import caller_dependency
from loramux.server.http.ingress import ADMIN_KEYS
from loramux.tenancy.admin_keys import AdminKeyInfo

_bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                     description="An admin key: `Authorization: Bearer lmxa-...`")

get_admin = caller_dependency(ADMIN_KEYS, _bearer)
AdminDep = Annotated[AdminKeyInfo, Depends(get_admin)]
