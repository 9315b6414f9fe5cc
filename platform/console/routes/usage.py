"""Usage and billing: spend and tokens per tenant and per adapter over a chosen period (the ledger's billing
summary, the same numbers as GET /admin/billing/summary), charted, with the CSV / JSONL / Parquet export; and the
daily spend by tag of the last 30 days (the ledger's spend report)."""
from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from loramux.billing.reports import FORMATS, BillingQueryError
from loramux.console.deps import Operator, render
from loramux.console.spend import RECENT_DAYS, recent_tag_chart
from loramux.db.models import utcnow
from loramux.server.deps import ServicesDep
from loramux.server.http.downloads import download_response
from loramux.services import adapters, billing, tenants

router = APIRouter(prefix="/usage")


def _period_fields(start: str | None, end: str | None) -> tuple[str, str]:
    """The form's values: the last 7 days when nothing is chosen."""
    if not start and not end:
        start = (utcnow() - timedelta(days=7)).date().isoformat()
    return start or "", end or ""


@router.get("")
async def usage_page(request: Request, operator: Operator, services: ServicesDep, start: str | None = None,
                     end: str | None = None):
    start, end = _period_fields(start, end)
    tags = await run_in_threadpool(recent_tag_chart, services)
    try:
        totals = await run_in_threadpool(billing.billing_summary, services, None, start or None, end or None)
    except BillingQueryError as exc:
        return render(request, "usage.html", operator, status_code=400, error=str(exc), start=start, end=end,
                      totals=None, formats=FORMATS, tags=tags, tag_days=RECENT_DAYS)
    names = {t.id: t.name for t in await run_in_threadpool(tenants.list_tenants, services.tenancy)}
    labels = {v.adapter_id: v.label for v in await run_in_threadpool(adapters.list_adapters, services)}
    chart = {"tenants": [{"label": names.get(t["tenant_id"], t["tenant_id"]), "cost": float(t["cost"]),
                          "tokens": t["prompt_tokens"] + t["completion_tokens"]} for t in totals["tenants"]],
             "adapters": [{"label": "base model" if a["adapter_id"] is None else labels.get(a["adapter_id"],
                                                                                           a["adapter_id"]),
                           "cost": float(a["cost"]), "tokens": a["prompt_tokens"] + a["completion_tokens"]}
                          for a in totals["adapters"]]}
    return render(request, "usage.html", operator, totals=totals, names=names, adapter_names=labels, chart=chart,
                  start=start, end=end, formats=FORMATS, tags=tags, tag_days=RECENT_DAYS)


@router.get("/export")
def usage_export(operator: Operator, services: ServicesDep, start: str | None = None, end: str | None = None,
                 format: str = "csv"):  # noqa: A002 - the query parameter's name
    """The admin API's own export (GET /admin/billing/export), for the signed-in operator."""
    export = billing.billing_export(services, format, None, start or None, end or None)
    return download_response(export.chunks, export.filename, export.content_type)
