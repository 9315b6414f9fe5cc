"""Billing over the cost ledger: a period's totals, its rows exported as CSV / JSONL / Parquet, spend per
day / week / month and tenant, adapter, key, end user or tag, and the last hour's requests and tokens per
adapter. Rows of requests that finished a moment ago are flushed to
the database before every read, so an answer the client already has is counted."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

from loramux.billing.reports import Period, content_type, export, parse_period, summary
from loramux.billing.spend import check_spend_query, spend_report
from loramux.db.models import utcnow
from loramux.services.container import Services

FLUSH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class BillingExport:
    """An export ready to stream: the file's name, its media type, and the chunks (read as they are consumed)."""
    filename: str
    content_type: str
    chunks: Iterator[bytes]


def tenant_filter(services: Services, tenant_ref: str | None) -> str | None:
    """The tenant id to filter on (given by id or name), or None for all (TenantNotFoundError when unknown)."""
    return None if tenant_ref is None else services.tenancy.tenant(tenant_ref).id


def billing_summary(services: Services, tenant_ref: str | None = None, start: str | None = None,
                    end: str | None = None) -> dict:
    """Totals per tenant and per adapter over [start, end) (ISO 8601; BillingQueryError when malformed)."""
    period = parse_period(start, end)
    tenant_id = tenant_filter(services, tenant_ref)
    services.ledger.flush(FLUSH_TIMEOUT_S)
    return summary(services.db, tenant_id, period)


def billing_export(services: Services, fmt: str, tenant_ref: str | None = None, start: str | None = None,
                   end: str | None = None) -> BillingExport:
    """The period's ledger rows in `fmt` (csv, jsonl, parquet); arguments are checked before any row is read."""
    period = parse_period(start, end)
    tenant_id = tenant_filter(services, tenant_ref)  # a real id from here on: safe in the file name
    media_type = content_type(fmt)
    services.ledger.flush(FLUSH_TIMEOUT_S)
    name = f"loramux-billing{'-' + tenant_id if tenant_id else ''}.{fmt}"
    return BillingExport(name, media_type, export(services.db, fmt, tenant_id, period))


def spend(services: Services, group_by: str, period: str, tenant_ref: str | None = None, start: str | None = None,
          end: str | None = None) -> dict:
    """Spend per `period` (day, week, month; UTC, weeks from Monday) and `group_by` (tenant, adapter, key, user,
    tag) over [start, end) (ISO 8601), for one tenant (by id or name) or all: `loramux.billing.spend.spend_report`
    (money as exact decimal strings; requests without tags are not in a tag report). BillingQueryError for a
    bad group_by, period or date; TenantNotFoundError for an unknown tenant."""
    check_spend_query(group_by, period)
    bounds = parse_period(start, end)
    tenant_id = tenant_filter(services, tenant_ref)
    services.ledger.flush(FLUSH_TIMEOUT_S)
    return spend_report(services.db, group_by, period, tenant_id, bounds.start, bounds.end)


def usage_last_hour(services: Services, flush_timeout_s: float = 5.0) -> dict[str, dict]:
    """adapter id -> {"requests", "tokens"} of the last hour (the ledger's billing summary)."""
    services.ledger.flush(flush_timeout_s)
    lines = summary(services.db, None, Period(utcnow() - timedelta(hours=1), None))["adapters"]
    usage: dict[str, dict] = {}
    for line in lines:
        if line["adapter_id"] is not None:
            seen = usage.setdefault(line["adapter_id"], {"requests": 0, "tokens": 0})
            seen["requests"] += line["requests"]
            seen["tokens"] += line["prompt_tokens"] + line["completion_tokens"]
    return usage
