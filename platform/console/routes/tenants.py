"""Tenants: list and create; one tenant's tier, status and fallback; its keys (create, rotate, revoke); its
budgets (set, remove), with the current period's daily spend charted against the tenant budget's limit.

A new or rotated key is shown once, in the answer to the form that made it (never stored, never in a URL,
never rendered again): the page says to copy it now.
"""
from __future__ import annotations

import re

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from loramux.billing.budgets import BudgetError, BudgetNotFound
from loramux.console.deps import CheckedForm, Operator, render
from loramux.console.spend import tenant_budget_chart
from loramux.server.deps import ServicesDep
from loramux.services import budgets
from loramux.services import tenants as ops
from loramux.tenancy.tenants import TenancyError

router = APIRouter(prefix="/tenants")


@router.get("")
async def tenants_page(request: Request, operator: Operator, services: ServicesDep, notice: str | None = None):
    tenants = await run_in_threadpool(ops.list_tenants, services.tenancy)
    tiers = await run_in_threadpool(ops.list_tiers, services.tenancy)
    return render(request, "tenants.html", operator, tenants=tenants, tiers=tiers, notice=notice)


@router.post("")
async def create_tenant(request: Request, operator: Operator, form: CheckedForm, services: ServicesDep):
    name, tier = str(form.get("name", "")).strip(), str(form.get("tier", "standard"))
    try:
        tenant = await run_in_threadpool(ops.create_tenant, services.tenancy, name, tier)
    except TenancyError as exc:
        tenants = await run_in_threadpool(ops.list_tenants, services.tenancy)
        tiers = await run_in_threadpool(ops.list_tiers, services.tenancy)
        return render(request, "tenants.html", operator, status_code=400, tenants=tenants, tiers=tiers,
                      error=str(exc), form=form)
    return RedirectResponse(f"/console/tenants/{tenant.id}?notice=created", status_code=303)


async def _tenant_page(request: Request, operator, services, tenant_ref: str, status_code: int = 200, **extra):
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_ref)
    keys = await run_in_threadpool(ops.list_keys, services.tenancy, tenant.id)
    tiers = await run_in_threadpool(ops.list_tiers, services.tenancy)
    statuses = await run_in_threadpool(budgets.list_budgets, services, tenant.id)
    chart = await run_in_threadpool(tenant_budget_chart, services, tenant.id, statuses)
    return render(request, "tenant.html", operator, status_code=status_code, tenant=tenant, keys=keys, tiers=tiers,
                  budgets=[s.as_dict() for s in statuses], budget_chart=chart, **extra)


@router.get("/{tenant_id}")
async def tenant_page(request: Request, tenant_id: str, operator: Operator, services: ServicesDep,
                      notice: str | None = None):
    return await _tenant_page(request, operator, services, tenant_id, notice=notice)


@router.post("/{tenant_id}")
async def update_tenant(request: Request, tenant_id: str, operator: Operator, form: CheckedForm,
                        services: ServicesDep):
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_id)
    changes = {"tier": form.get("tier") or None, "status": form.get("status") or None,
               "fallback": form.get("fallback") if "fallback" in form else None}
    try:
        await run_in_threadpool(lambda: ops.update_tenant(services.tenancy, tenant.id, **changes))
    except TenancyError as exc:
        return await _tenant_page(request, operator, services, tenant.id, 400, error=str(exc))
    return RedirectResponse(f"/console/tenants/{tenant.id}?notice=saved", status_code=303)


@router.post("/{tenant_id}/keys")
async def create_key(request: Request, tenant_id: str, operator: Operator, form: CheckedForm, services: ServicesDep):
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_id)
    issued = await run_in_threadpool(ops.issue_key, services.tenancy, tenant.id)
    return await _tenant_page(request, operator, services, tenant.id, 201, new_key=issued.key,
                              new_key_prefix=issued.prefix)


@router.post("/{tenant_id}/keys/{key_id}/rotate")
async def rotate_key(request: Request, tenant_id: str, key_id: str, operator: Operator, form: CheckedForm,
                     services: ServicesDep):
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_id)
    issued = await run_in_threadpool(ops.rotate_key, services.tenancy, tenant.id, key_id)
    return await _tenant_page(request, operator, services, tenant.id, 201, new_key=issued.key,
                              new_key_prefix=issued.prefix, notice=f"key {issued.revoked.prefix}… revoked and replaced")


@router.post("/{tenant_id}/keys/{key_id}/revoke")
async def revoke_key(request: Request, tenant_id: str, key_id: str, operator: Operator, form: CheckedForm,
                     services: ServicesDep):
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_id)
    await run_in_threadpool(ops.revoke_key, services.tenancy, tenant.id, key_id)
    return RedirectResponse(f"/console/tenants/{tenant.id}?notice=revoked", status_code=303)


def _alerts(text: str) -> list[str] | None:
    """The thresholds field ("0.5, 0.8, 1"): its fractions as text, or None (the defaults) when empty."""
    values = [v for v in re.split(r"[,\s]+", text) if v]
    return values or None


@router.post("/{tenant_id}/budgets")
async def set_budget(request: Request, tenant_id: str, operator: Operator, form: CheckedForm, services: ServicesDep):
    """Create or replace the budget of a scope and subject; the limit stays the decimal text typed."""
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_id)
    scope, subject = str(form.get("scope", "")), str(form.get("subject", "")).strip()
    limit, period = str(form.get("limit_usd", "")).strip(), str(form.get("period", ""))
    try:
        await run_in_threadpool(budgets.set_budget, services, tenant.id, scope, subject, limit, period,
                                "hard" in form, _alerts(str(form.get("alert_at", ""))))
    except (BudgetError, BudgetNotFound) as exc:
        return await _tenant_page(request, operator, services, tenant.id, 400, error=str(exc), budget_form=form)
    return RedirectResponse(f"/console/tenants/{tenant.id}?notice=budget-set", status_code=303)


@router.post("/{tenant_id}/budgets/remove")
async def remove_budget(request: Request, tenant_id: str, operator: Operator, form: CheckedForm,
                        services: ServicesDep):
    tenant = await run_in_threadpool(ops.get_tenant, services.tenancy, tenant_id)
    scope, subject = str(form.get("scope", "")), str(form.get("subject", ""))
    try:
        await run_in_threadpool(budgets.delete_budget, services, tenant.id, scope, subject)
    except (BudgetError, BudgetNotFound) as exc:
        return await _tenant_page(request, operator, services, tenant.id, 400, error=str(exc))
    return RedirectResponse(f"/console/tenants/{tenant.id}?notice=budget-removed", status_code=303)
