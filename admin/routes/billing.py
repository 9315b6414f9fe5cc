"""Billing over the cost ledger: totals (/admin/billing/summary), row exports (/admin/billing/export) and spend
per period and tenant, adapter, key, end user or tag (/admin/billing/spend)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import Field

from loramux.admin.routes.schemas import BillingSummary, Out
from loramux.billing.reports import FORMATS, content_type
from loramux.billing.spend import GROUPS, PERIODS, SpendQueryError
from loramux.server.deps import ServicesDep
from loramux.server.http.downloads import download_response
from loramux.server.http.errors import ApiError
from loramux.services import billing as ops

router = APIRouter(prefix="/billing")

Start = Annotated[str | None, Query(description="ISO 8601, inclusive")]
End = Annotated[str | None, Query(description="ISO 8601, exclusive")]
EXPORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The ledger rows, streamed; `Content-Disposition` names the file.",
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


class SpendRow(Out):
    period_start: str = Field(description="ISO 8601 UTC: the start of the day, week (Monday) or month")
    group: str | None = Field(description="the tenant id, adapter id (null: the base model), key id, end user "
                                          "(null: requests without `user`) or tag")
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: str = Field(description="USD, exact, 12 decimals")


class SpendReport(Out):
    """Spend per period and group (see `loramux.billing.spend.spend_report`)."""

    group_by: str
    period: str
    start: str | None = Field(description="ISO 8601 UTC, inclusive; null: open")
    end: str | None = Field(description="ISO 8601 UTC, exclusive; null: open")
    rows: list[SpendRow] = Field(description="by period_start, then group (null first)")


@router.get("/spend", response_model=SpendReport)
def billing_spend(services: ServicesDep,
                  group_by: Annotated[str, Query(description=f"one of {', '.join(GROUPS)}; tag: a request counts "
                                                             "under each of its tags, untagged ones not at all")]
                  = "tenant",
                  period: Annotated[str, Query(description=f"UTC calendar periods: one of {', '.join(PERIODS)} "
                                                           "(weeks start on Monday)")] = "day",
                  tenant_id: str | None = None, start: Start = None, end: End = None) -> dict:
    try:
        return ops.spend(services, group_by, period, tenant_id, start, end)
    except SpendQueryError as exc:
        raise ApiError(400, str(exc), code="invalid_parameter", param=exc.param) from None
