"""The console's spend charts: the ledger's daily spend (`loramux.services.billing.spend`) laid out as the series
`static/console.js` draws with Chart.js. Amounts stay exact: every money value in a chart is a decimal string
(the script turns them into numbers only to draw them); days without spend are "0.00", days still to come None."""
from __future__ import annotations

from collections.abc import Iterable
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import TYPE_CHECKING

from loramux.billing.budgets import BudgetStatus, money_text
from loramux.billing.money import MONEY_CONTEXT
from loramux.db.models import utcnow
from loramux.services import billing

if TYPE_CHECKING:
    from loramux.services.container import Services

RECENT_DAYS = 30  # the window drawn without a tenant budget, and the usage page's tag report
MAX_DAYS = 366  # a `total` budget draws at most this many days; what came before is the line's starting point
_ZERO = Decimal(0)


def _day(period_start: str) -> date:
    """A report row's `period_start` (ISO 8601 in UTC) as its day."""
    return datetime.fromisoformat(period_start).astimezone(timezone.utc).date()


def _sum(values: Iterable[Decimal]) -> Decimal:
    total = _ZERO
    for value in values:
        total = MONEY_CONTEXT.add(total, value)
    return total


def daily_totals(rows: Iterable[dict]) -> dict[date, Decimal]:
    """Spend per UTC day, summed over the rows' groups."""
    totals: dict[date, Decimal] = {}
    for row in rows:
        day = _day(row["period_start"])
        totals[day] = MONEY_CONTEXT.add(totals.get(day, _ZERO), Decimal(str(row["cost_usd"])))
    return totals


def _days(first: date, last: date) -> list[date]:
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


def budget_chart(rows: Iterable[dict], first: date, last: date, today: date, limit: Decimal | None) -> dict:
    """Daily spend bars from `first` to `last` (days after `today` empty), the cumulative spend as a line
    (starting from what days before `first` spent), and the limit when there is one."""
    totals = daily_totals(rows)
    running = _sum(v for d, v in totals.items() if d < first)
    labels, daily, cumulative = [], [], []
    for day in _days(first, last):
        labels.append(day.isoformat())
        if day > today:
            daily.append(None)
            cumulative.append(None)
            continue
        spent = totals.get(day, _ZERO)
        running = MONEY_CONTEXT.add(running, spent)
        daily.append(money_text(spent))
        cumulative.append(money_text(running))
    return {"labels": labels, "daily": daily, "cumulative": cumulative,
            "limit": None if limit is None else money_text(limit)}


def tenant_budget_chart(services: Services, tenant_id: str, budgets: list[BudgetStatus]) -> dict:
    """The tenant page's chart: its tenant budget's current period (a `total` budget: from its first day of
    spend, at most MAX_DAYS), or the last RECENT_DAYS days without a limit when it has no tenant budget.
    `period` names the budget's period (None without one); `spent` is the ledger's spend over the days drawn."""
    today = utcnow().date()
    budget = next((s for s in budgets if s.budget.scope == "tenant"), None)
    if budget is None:
        first = today - timedelta(days=RECENT_DAYS - 1)
        rows = billing.spend(services, "tenant", "day", tenant_id, start=first.isoformat())["rows"]
        chart = budget_chart(rows, first, today, today, None)
        period = None
    else:
        rows = billing.spend(services, "tenant", "day", tenant_id, start=budget.period_start.isoformat())["rows"]
        first = budget.period_start.date()
        if budget.resets_at is None:  # total: from the first day with spend
            days = daily_totals(rows)
            first = max(min(days, default=today), today - timedelta(days=MAX_DAYS - 1))
            last = today
        else:
            last = (budget.resets_at - timedelta(days=1)).date()
        chart = budget_chart(rows, first, last, today, budget.budget.limit_usd)
        period = budget.budget.period
    spent = next((v for v in reversed(chart["cumulative"]) if v is not None), "0.00")
    return {**chart, "period": period, "spent": spent}


def tag_chart(rows: Iterable[dict], first: date, last: date) -> dict:
    """Daily spend per tag from `first` to `last` (one series per tag, by total spend, largest first), with
    each tag's totals. A request counts under each of its tags; requests without tags are in no series."""
    per_tag: dict[str, dict[date, Decimal]] = {}
    counts: dict[str, list[int]] = {}
    for row in rows:
        tag = str(row["group"])
        by_day = per_tag.setdefault(tag, {})
        day = _day(row["period_start"])
        by_day[day] = MONEY_CONTEXT.add(by_day.get(day, _ZERO), Decimal(str(row["cost_usd"])))
        seen = counts.setdefault(tag, [0, 0])
        seen[0] += int(row["requests"])
        seen[1] += int(row["prompt_tokens"]) + int(row["completion_tokens"])
    days = _days(first, last)
    totals = {tag: _sum(by_day.values()) for tag, by_day in per_tag.items()}
    order = sorted(per_tag, key=lambda t: (-totals[t], t))
    return {"labels": [d.isoformat() for d in days],
            "tags": [{"tag": tag, "total": money_text(totals[tag]), "requests": counts[tag][0],
                      "tokens": counts[tag][1], "daily": [money_text(per_tag[tag].get(d, _ZERO)) for d in days]}
                     for tag in order]}


def recent_tag_chart(services: Services) -> dict:
    """The usage page's report: daily spend by tag over the last RECENT_DAYS days (today included)."""
    today = utcnow().date()
    first = today - timedelta(days=RECENT_DAYS - 1)
    return tag_chart(billing.spend(services, "tag", "day", start=first.isoformat())["rows"], first, today)
