"""Billing over the cost ledger: totals (/admin/billing/summary) and row exports (/admin/billing/export)."""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.concurrency import iterate_in_threadpool
from fastapi.responses import StreamingResponse

from loramux.admin.billing import FORMATS, content_type, export, parse_period, summary
from loramux.admin.routes.schemas import BillingSummary
from loramux.server.deps import ServicesDep
from loramux.services import Services

router = APIRouter(prefix="/billing")

FLUSH_TIMEOUT_S = 10.0  # rows of requests that finished a moment ago are written before the query
Start = Annotated[str | None, Query(description="ISO 8601, inclusive")]
End = Annotated[str | None, Query(description="ISO 8601, exclusive")]
EXPORT_RESPONSES = {200: {"description": "The ledger rows, streamed; `Content-Disposition` names the file.",
                          "content": {content_type(f): {} for f in FORMATS}}}


@router.get("/summary", response_model=BillingSummary)
def billing_summary(services: ServicesDep, tenant_id: str | None = None, start: Start = None,
                    end: End = None) -> dict:
    period = parse_period(start, end)  # BillingQueryError: 400
    tenant_id = _tenant_filter(services, tenant_id)
    services.ledger.flush(FLUSH_TIMEOUT_S)
    return summary(services.db, tenant_id, period)


@router.get("/export", response_class=StreamingResponse, responses=EXPORT_RESPONSES)
def billing_export(services: ServicesDep, tenant_id: str | None = None, start: Start = None, end: End = None,
                   fmt: Annotated[Literal["csv", "jsonl", "parquet"], Query(alias="format")] = "csv"):
    period = parse_period(start, end)
    tenant_id = _tenant_filter(services, tenant_id)  # a real id from here on: safe in the file name
    services.ledger.flush(FLUSH_TIMEOUT_S)
    name = f"loramux-billing{'-' + tenant_id if tenant_id else ''}.{fmt}"
    return StreamingResponse(iterate_in_threadpool(export(services.db, fmt, tenant_id, period)),
                             media_type=content_type(fmt),
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _tenant_filter(services: Services, tenant_ref: str | None) -> str | None:
    """The tenant id to filter on (given by id or name), or None for all; unknown tenants are a 404."""
    return None if tenant_ref is None else services.tenancy.tenant(tenant_ref).id
