"""Prices by base model, adapter and tier: the ones in force now and the scheduled ones; set a new one."""
from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from loramux.adapters.registry import RegistryError
from loramux.admin.pricing import PriceError
from loramux.console.deps import CheckedForm, Operator, render
from loramux.db.models import utcnow
from loramux.tenancy import TenancyError

router = APIRouter(prefix="/prices")


async def _page(request: Request, operator, status_code: int = 200, **extra):
    services = request.app.state.services
    prices = await run_in_threadpool(services.prices.list_prices, None)
    now = utcnow()
    in_force: dict = {}
    for price in sorted(prices, key=lambda p: p.effective_from):  # the latest started one per scope wins
        if price.effective_from <= now:
            in_force[(price.base_model, price.adapter_id, price.tier)] = price
    scheduled = [p for p in prices if p.effective_from > now]
    tiers = await run_in_threadpool(services.tenancy.tiers)
    adapters = await run_in_threadpool(services.registry.list_all, None)
    return render(request, "prices.html", operator, status_code=status_code, current=list(in_force.values()),
                  scheduled=scheduled, tiers=tiers, adapters=adapters,
                  base_model=request.app.state.server.model_id, **extra)


@router.get("")
async def prices_page(request: Request, operator: Operator, notice: str | None = None):
    return await _page(request, operator, notice=notice)


@router.post("")
async def set_price(request: Request, operator: Operator, form: CheckedForm):
    services = request.app.state.services
    try:
        effective = _when(str(form.get("effective_from", "")).strip())
        tier = form.get("tier") or None
        adapter_id = form.get("adapter_id") or None
        if tier is not None:
            await run_in_threadpool(services.tenancy.tier, tier)
        if adapter_id is not None:
            await run_in_threadpool(services.registry.owner_of, adapter_id)
        await run_in_threadpool(lambda: services.prices.set_price(
            request.app.state.server.model_id, form.get("input_per_mtok", ""), form.get("cached_input_per_mtok", ""),
            form.get("output_per_mtok", ""), adapter_id=adapter_id, tier=tier, effective_from=effective))
    except (PriceError, TenancyError, RegistryError, ValueError) as exc:
        return await _page(request, operator, 400, error=str(exc), form=form)
    return RedirectResponse("/console/prices?notice=saved", status_code=303)


def _when(text: str) -> datetime | None:
    """A datetime-local field's value (no offset: UTC), or None for now."""
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"effective from {text!r} is not a date and time (YYYY-MM-DDTHH:MM)") from None
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
