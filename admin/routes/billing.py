"""Billing over the cost ledger: totals (/admin/billing/summary) and row exports (/admin/billing/export)."""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from loramux.admin.routes.schemas import BillingSummary
from loramux.billing.reports import FORMATS, content_type
from loramux.server.deps import ServicesDep
from loramux.server.http.downloads import download_response
from loramux.services import billing as ops

router = APIRouter(prefix="/billing")

Start = Annotated[str | None, Query(description="ISO 8601, inclusive")]
End = Annotated[str | None, Query(description="ISO 8601, exclusive")]
EXPORT_RESPONSES = {200: {"description": "The ledger rows, streamed; `Content-Disposition` names the file.",
                          "content": {content_type(f): {} for f in FORMATS}}}


@router.get("/summary", response_model=BillingSummary)
def billing_summary(services: ServicesDep, tenant_id: str | None = None, start: Start = None,
                    end: End = None) -> dict:
    return ops.billing_summary(services, tenant_id, start, end)


@router.get("/export", response_class=StreamingResponse, responses=EXPORT_RESPONSES)
def billing_export(services: ServicesDep, tenant_id: str | None = None, start: Start = None, end: End = None,
                   fmt: Annotated[Literal["csv", "jsonl", "parquet"], Query(alias="format")] = "csv"):
    export = ops.billing_export(services, fmt, tenant_id, start, end)
    return download_response(export.chunks, export.filename, export.content_type)
