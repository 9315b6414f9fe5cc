"""Prices by base model, adapter and tier: the ones in force now and the scheduled ones; set a new one."""
from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from loramux.adapters.storage.registry import RegistryError
from loramux.billing.pricing import PriceError
from loramux.console.deps import CheckedForm, Operator, render
from loramux.server.deps import PipelineDep, ServicesDep
from loramux.services import adapters, tenants
from loramux.services import prices as ops
from loramux.tenancy.tenants import TenancyError

router = APIRouter(prefix="/prices")


async def _page(request: Request, operator, services, pipeline, status_code: int = 200, **extra):
    board = await run_in_threadpool(ops.price_board, services)
    tiers = await run_in_threadpool(tenants.list_tiers, services.tenancy)
    adapter_list = await run_in_threadpool(adapters.list_adapters, services)
    return render(request, "prices.html", operator, status_code=status_code, current=board.current,
                  scheduled=board.scheduled, tiers=tiers, adapters=adapter_list, base_model=pipeline.model_id, **extra)


@router.get("")
async def prices_page(request: Request, operator: Operator, services: ServicesDep, pipeline: PipelineDep,
                      notice: str | None = None):
    return await _page(request, operator, services, pipeline, notice=notice)


@router.post("")
async def set_price(request: Request, operator: Operator, form: CheckedForm, services: ServicesDep,
                    pipeline: PipelineDep):
    try:
        effective = _when(str(form.get("effective_from", "")).strip())
        await run_in_threadpool(lambda: ops.set_price(
            services, pipeline.model_id, form.get("input_per_mtok", ""), form.get("cached_input_per_mtok", ""),
            form.get("output_per_mtok", ""), adapter_id=form.get("adapter_id") or None, tier=form.get("tier") or None,
            effective_from=effective))
    except (PriceError, TenancyError, RegistryError, ValueError) as exc:
        return await _page(request, operator, services, pipeline, 400, error=str(exc), form=form)
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
