"""Budgets: PUT / GET / DELETE /admin/tenants/{tenant_id}/budget, .../keys/{key_id}/budget,
.../users/{user}/budget and .../tags/{tag}/budget (a user id may hold a "/"); GET
/admin/tenants/{tenant_id}/budgets lists a tenant's and GET /admin/budgets every tenant's."""
from __future__ import annotations

from decimal import Decimal

from fastapi import APIRouter, Response
from pydantic import Field

from loramux.billing.budgets import PERIODS, BudgetStatus
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import budgets as ops

router = APIRouter()


class BudgetBody(RequestBody):
    limit_usd: str | int = Field(description="the limit in USD, as a decimal string such as \"500.00\"")
    period: str = Field(description=f"when it resets, at 00:00 UTC: one of {', '.join(PERIODS)} (total: never)")
    hard: bool = Field(default=True, description="refuse requests that would pass it (402); false: alert only")
    alert_at: list[str | int | float] | None = Field(
        default=None, max_length=10, description="fractions of the limit whose crossing sends a webhook event "
                                                 "(default [0.5, 0.8, 1.0])")


def _answer(status: BudgetStatus, tenant_id: str) -> dict:
    return {"tenant_id": tenant_id, **status.as_dict()}


def _put(services, response: Response, tenant_id: str, scope: str, subject: str, body: BudgetBody) -> dict:
    alerts = None if body.alert_at is None else [a if isinstance(a, str) else Decimal(str(a)) for a in body.alert_at]
    status, created = ops.set_budget(services, tenant_id, scope, subject, body.limit_usd, body.period, body.hard,
                                     alerts)
    response.status_code = 201 if created else 200
    return _answer(status, status.budget.tenant_id)


def _get(services, tenant_id: str, scope: str, subject: str = "") -> dict:
    status = ops.get_budget(services, tenant_id, scope, subject)
    return _answer(status, status.budget.tenant_id)


@router.get("/budgets")
def list_all_budgets(services: ServicesDep) -> dict:
    return {"budgets": [_answer(s, s.budget.tenant_id) for s in ops.list_budgets(services)]}


@router.get("/tenants/{tenant_id}/budgets")
def list_tenant_budgets(tenant_id: str, services: ServicesDep) -> dict:
    return {"budgets": [_answer(s, s.budget.tenant_id) for s in ops.list_budgets(services, tenant_id)]}


@router.put("/tenants/{tenant_id}/budget")
def put_tenant_budget(tenant_id: str, body: BudgetBody, services: ServicesDep, response: Response) -> dict:
    return _put(services, response, tenant_id, "tenant", "", body)


@router.get("/tenants/{tenant_id}/budget")
def get_tenant_budget(tenant_id: str, services: ServicesDep) -> dict:
    return _get(services, tenant_id, "tenant")


@router.delete("/tenants/{tenant_id}/budget", status_code=204)
def delete_tenant_budget(tenant_id: str, services: ServicesDep) -> None:
    ops.delete_budget(services, tenant_id, "tenant")


@router.put("/tenants/{tenant_id}/keys/{key_id}/budget")
def put_key_budget(tenant_id: str, key_id: str, body: BudgetBody, services: ServicesDep, response: Response) -> dict:
    return _put(services, response, tenant_id, "key", key_id, body)


@router.get("/tenants/{tenant_id}/keys/{key_id}/budget")
def get_key_budget(tenant_id: str, key_id: str, services: ServicesDep) -> dict:
    return _get(services, tenant_id, "key", key_id)


@router.delete("/tenants/{tenant_id}/keys/{key_id}/budget", status_code=204)
def delete_key_budget(tenant_id: str, key_id: str, services: ServicesDep) -> None:
    ops.delete_budget(services, tenant_id, "key", key_id)


@router.put("/tenants/{tenant_id}/users/{user:path}/budget")
def put_user_budget(tenant_id: str, user: str, body: BudgetBody, services: ServicesDep, response: Response) -> dict:
    return _put(services, response, tenant_id, "user", user, body)


@router.get("/tenants/{tenant_id}/users/{user:path}/budget")
def get_user_budget(tenant_id: str, user: str, services: ServicesDep) -> dict:
    return _get(services, tenant_id, "user", user)


@router.delete("/tenants/{tenant_id}/users/{user:path}/budget", status_code=204)
def delete_user_budget(tenant_id: str, user: str, services: ServicesDep) -> None:
    ops.delete_budget(services, tenant_id, "user", user)


@router.put("/tenants/{tenant_id}/tags/{tag:path}/budget")
def put_tag_budget(tenant_id: str, tag: str, body: BudgetBody, services: ServicesDep, response: Response) -> dict:
    return _put(services, response, tenant_id, "tag", tag, body)


@router.get("/tenants/{tenant_id}/tags/{tag:path}/budget")
def get_tag_budget(tenant_id: str, tag: str, services: ServicesDep) -> dict:
    return _get(services, tenant_id, "tag", tag)


@router.delete("/tenants/{tenant_id}/tags/{tag:path}/budget", status_code=204)
def delete_tag_budget(tenant_id: str, tag: str, services: ServicesDep) -> None:
    ops.delete_budget(services, tenant_id, "tag", tag)
