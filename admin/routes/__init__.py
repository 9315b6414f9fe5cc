"""The admin API under /admin, one router per resource. Every route needs an admin key (AdminDep, set on
this router so no route can miss it); tenant keys get 403 here, and admin keys get 403 on tenant routes."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from loramux.admin.deps import get_admin
from loramux.admin.routes import (
    adapters,
    admin_keys,
    billing,
    budgets,
    medusa,
    prices,
    replicas,
    stats,
    tenants,
    tiers,
    webhooks,
)

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(get_admin)])
for _resource in (tenants, budgets, webhooks, adapters, medusa, tiers, prices, billing, admin_keys, stats,
                  replicas):
    router.include_router(_resource.router)

__all__ = ["router"]
