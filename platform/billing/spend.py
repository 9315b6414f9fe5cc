"""Spend reports: the ledger's requests, tokens and cost per UTC calendar period (day, week, month) and per
tenant, adapter, API key, end user or tag, for charts and for setting budgets (torch-free, no HTTP types).

Periods are the budgets' own (`loramux.billing.budgets.period_bounds`): days start at 00:00 UTC, weeks on
Monday 00:00 UTC, months on the 1st; a row falls in the period that holds its `created_at` (when the request
arrived). `start` / `end` bound the rows read, as in the billing summary (start inclusive, end exclusive):
they need not fall on period starts, so the first and last periods of a report may be partial.

Money is exact on both backends: PostgreSQL sums NUMERIC in SQL (grouped by `date_trunc` of the UTC time,
which buckets exactly as `period_bounds` does); on SQLite, which keeps money as decimal text, and for tag
reports (tags are a JSON list per row) the rows are streamed and their `Decimal` costs added here, one
running total per (period, group), so memory grows with the report, not with the ledger.
"""
from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy import DateTime, Numeric, func, select, type_coerce

from loramux.billing.budgets import period_bounds
from loramux.billing.money import MONEY_CONTEXT
from loramux.billing.reports import BillingQueryError, Period
from loramux.db import Database, LedgerEntry
from loramux.db.models import Money

GROUPS = ("tenant", "adapter", "key", "user", "tag")
PERIODS = ("day", "week", "month")
_COLUMNS = {"tenant": LedgerEntry.tenant_id, "adapter": LedgerEntry.adapter_id, "key": LedgerEntry.key_id,
            "user": LedgerEntry.end_user, "tag": LedgerEntry.tags}
_STREAM_ROWS = 5000


class SpendQueryError(BillingQueryError):
    """A spend report asked with an unknown `param` (group_by or period)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_spend_query(group_by, period) -> None:
    """Raise SpendQueryError unless group_by and period are ones a spend report knows."""
    if group_by not in GROUPS:
        raise SpendQueryError(f"group_by must be one of {', '.join(GROUPS)}, not {str(group_by)[:40]!r}",
                              "group_by")
    if period not in PERIODS:
        raise SpendQueryError(f"period must be one of {', '.join(PERIODS)}, not {str(period)[:40]!r}", "period")


def _iso(value: datetime) -> str:
    """The form of the billing summary's period bounds (UTC, microseconds: the strings sort like the times)."""
    return value.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _add(groups: dict, key: tuple[datetime, str | None], requests: int, prompt, cached, completion, cost) -> None:
    counters = groups.get(key)
    if counters is None:
        counters = groups[key] = [0, 0, 0, 0, Decimal(0)]
    counters[0] += int(requests)
    counters[1] += int(prompt or 0)
    counters[2] += int(cached or 0)
    counters[3] += int(completion or 0)
    counters[4] = MONEY_CONTEXT.add(counters[4], Decimal(cost) if cost is not None else Decimal(0))


def _summed_in_sql(db: Database, group_by: str, period: str, where: list) -> dict:
    """PostgreSQL: one row per (period, group), NUMERIC sums exact."""
    e = LedgerEntry
    bucket = func.date_trunc(period, func.timezone("UTC", e.created_at), type_=DateTime())
    column = _COLUMNS[group_by]
    stmt = (select(bucket, column, func.count(), func.sum(e.prompt_tokens), func.sum(e.cached_tokens),
                   func.sum(e.completion_tokens), type_coerce(func.sum(e.cost), Numeric(asdecimal=True)))
            .where(*where).group_by(bucket, column))
    groups: dict = {}
    with db.session() as session:
        for start, group, requests, prompt, cached, completion, cost in session.execute(stmt):
            _add(groups, (start.replace(tzinfo=timezone.utc), group), requests, prompt, cached, completion, cost)
    return groups


def _summed_here(db: Database, group_by: str, period: str, where: list) -> dict:
    """Rows streamed and added up as Decimals (SQLite's decimal text; a row under each of its tags)."""
    e = LedgerEntry
    stmt = (select(e.created_at, _COLUMNS[group_by], e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.cost)
            .where(*where).execution_options(yield_per=_STREAM_ROWS))
    groups: dict = {}
    starts: dict[datetime, datetime] = {}  # the day of a row -> its period's start (most rows share a few)
    with db.session() as session:
        for created, group, prompt, cached, completion, cost in session.execute(stmt):
            day = created.astimezone(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
            start = starts.get(day)
            if start is None:
                start = starts[day] = period_bounds(period, day)[0]
            if group_by != "tag":
                _add(groups, (start, group), 1, prompt, cached, completion, cost)
                continue
            for tag in dict.fromkeys(t for t in (group or ()) if isinstance(t, str)):  # each tag of the row once
                _add(groups, (start, tag), 1, prompt, cached, completion, cost)
    return groups


def spend_report(db: Database, group_by: str, period: str, tenant_id: str | None = None,
                 start: datetime | None = None, end: datetime | None = None) -> dict:
    """The ledger's spend per `period` (day, week, month: UTC calendar periods, weeks from Monday) and per
    `group_by` (tenant, adapter, key, user, tag), over [start, end) (aware datetimes; None leaves that side
    open), optionally for one tenant (by id):

    `{"group_by", "period", "start", "end", "rows": [{"period_start", "group", "requests", "prompt_tokens",
      "cached_tokens", "completion_tokens", "cost_usd"}]}`

    `start`, `end` and `period_start` are ISO 8601 UTC strings (None: open); `group` is the tenant id, the
    adapter id (None: the base model), the key id, the end user (None: requests without `user`) or the tag;
    `cost_usd` is the exact sum as a decimal string with 12 places, as in the billing summary. Rows sort by
    period_start, then group (None first); periods and groups without requests have no row.

    group_by=tag: a request counts once under each of its tags, so a report's rows add up to more than the
    ledger when requests carry several tags; requests without tags are not in a tag report at all.
    Raises SpendQueryError (a BillingQueryError) for an unknown group_by or period, BillingQueryError for a
    bad start / end."""
    check_spend_query(group_by, period)
    if tenant_id is not None and not isinstance(tenant_id, str):
        raise BillingQueryError(f"tenant_id must be a string, got {type(tenant_id).__name__}")
    bounds = Period(start, end)
    e = LedgerEntry
    where = []
    if tenant_id is not None:
        where.append(e.tenant_id == tenant_id)
    if bounds.start is not None:
        where.append(e.created_at >= bounds.start)
    if bounds.end is not None:
        where.append(e.created_at < bounds.end)
    if group_by == "tag":
        where.append(e.tags.is_not(None))
    if db.is_sqlite or group_by == "tag":
        groups = _summed_here(db, group_by, period, where)
    else:
        groups = _summed_in_sql(db, group_by, period, where)
    rows = [{"period_start": _iso(when), "group": group, "requests": c[0], "prompt_tokens": c[1],
             "cached_tokens": c[2], "completion_tokens": c[3],
             "cost_usd": format(c[4].quantize(Money.SCALE, context=MONEY_CONTEXT), "f")}
            for (when, group), c in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None,
                                                                           kv[0][1] or ""))]
    return {"group_by": group_by, "period": period, **bounds.as_dict(), "rows": rows}
