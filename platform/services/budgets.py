"""Budgets as the admin API, the console and `loramux admin budgets` see them: set, read and remove a tenant's
budgets by scope (tenant, key, user, tag), with the tenant named by id or name (`loramux.billing.budgets` keeps
the money)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from loramux.billing.budgets import BudgetBook, BudgetNotFound, BudgetStatus

if TYPE_CHECKING:
    from loramux.services.container import Services


def _book(services: Services) -> BudgetBook:
    if services.budgets is None:
        raise RuntimeError("these Services were built without a budget book")
    return services.budgets


def _tenant_id(services: Services, tenant_ref: str, scope: str, subject: str) -> str:
    """The tenant's id (TenantNotFoundError); a key budget's key must be one of the tenant's (BudgetNotFound)."""
    tenant_id = services.tenancy.tenant(tenant_ref).id
    if scope == "key" and subject not in {k.id for k in services.tenancy.list_keys(tenant_id)}:
        raise BudgetNotFound(f"tenant {tenant_id} has no API key {subject!r}")
    return tenant_id


def set_budget(services: Services, tenant_ref: str, scope: str, subject: str, limit_usd, period: str,
               hard: bool = True, alert_at=None) -> tuple[BudgetStatus, bool]:
    """Create or replace the budget; returns its status and whether it is new (BudgetError: bad values)."""
    tenant_id = _tenant_id(services, tenant_ref, scope, subject)
    return _book(services).put(tenant_id, scope, subject, limit_usd, period, hard, alert_at)


def get_budget(services: Services, tenant_ref: str, scope: str, subject: str = "") -> BudgetStatus:
    return _book(services).status(services.tenancy.tenant(tenant_ref).id, scope, subject)


def delete_budget(services: Services, tenant_ref: str, scope: str, subject: str = "") -> None:
    _book(services).delete(services.tenancy.tenant(tenant_ref).id, scope, subject)


def list_budgets(services: Services, tenant_ref: str | None = None) -> list[BudgetStatus]:
    """Every budget, or one tenant's."""
    tenant_id = services.tenancy.tenant(tenant_ref).id if tenant_ref else None
    return _book(services).statuses(tenant_id)
