"""The console's budgets over HTTP: the tenant page lists a tenant's budgets with their exact decimals, sets and
removes them through its forms (CSRF, POST-redirect-GET, the service's errors shown on the page), and charts the
ledger's daily spend of the tenant budget's period; the usage page reports the daily spend by tag."""
from __future__ import annotations

import html
import json
import re
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import select

from conftest import serve_admin_stack
from loramux.billing.budgets import BudgetNotFound, money_text, period_bounds
from loramux.db.models import LedgerEntry, utcnow

ADMIN_KEY = "lmxa-console-budgets-key-0123456789abcdefghijkl"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dir, tokenizer):
    yield from serve_admin_stack(tmp_path_factory.mktemp("console-budgets"), tiny_dir, tokenizer, ADMIN_KEY)


@pytest.fixture
def client(stack):
    client = httpx.Client(base_url=stack[0].url, follow_redirects=False, timeout=30)
    form = client.get("/console/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)
    assert client.post("/console/login", data={"admin_key": ADMIN_KEY, "csrf_token": token}).status_code == 303
    yield client
    client.close()


def csrf_of(page: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)"', page).group(1)


def new_tenant(services, name: str):
    services.tenancy.ensure_tenant(name, tier="standard")
    key = services.tenancy.create_key(name)[0]
    return services.tenancy.tenant(name), key


def book(services, tenant_id: str, key_id: str, rows: list[tuple[str, datetime, list[str] | None]]) -> None:
    """Ledger rows of (cost, arrival, tags), written straight to the table."""
    with services.db.session() as session:
        session.add_all([LedgerEntry(
            request_id=f"console-budgets-{uuid.uuid4().hex}", part=0, tenant_id=tenant_id, key_id=key_id,
            model="tiny", adapter_id=None, adapter_version=None, tier="standard", outcome="ok", fallback=False,
            prompt_tokens=10, cached_tokens=0, completion_tokens=5, queue_ms=None, ttft_ms=None, total_ms=1.0,
            price_id=None, input_per_mtok=Decimal(0), cached_input_per_mtok=Decimal(0),
            output_per_mtok=Decimal(0), cost=Decimal(cost), created_at=when, tags=tags) for cost, when, tags in rows])


def ledger_by_day(services, tenant_id: str | None = None) -> dict[tuple[date, str | None], Decimal]:
    """The ledger's cost per (UTC day, tenant), read back from the table."""
    totals: dict[tuple[date, str | None], Decimal] = {}
    with services.db.session() as session:
        for tenant, cost, when in session.execute(select(LedgerEntry.tenant_id, LedgerEntry.cost,
                                                         LedgerEntry.created_at)):
            if tenant_id is None or tenant == tenant_id:
                day = when.astimezone(timezone.utc).date()
                totals[(day, tenant)] = totals.get((day, tenant), Decimal(0)) + cost
    return totals


def budget_rows(page: str) -> dict[str, list[str]]:
    """The budgets table: "scope:subject" -> the text of each cell."""
    rows = {}
    for key, body in re.findall(r'<tr data-budget="([^"]*)">(.*?)</tr>', page, re.S):
        cells = re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)
        rows[html.unescape(key)] = [" ".join(html.unescape(re.sub(r"<[^>]+>", " ", c)).split()) for c in cells]
    return rows


def chart_of(page: str, element_id: str) -> dict:
    raw = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', page, re.S).group(1)
    return json.loads(raw)


def spread_rows(now: datetime) -> list[tuple[str, datetime, list[str] | None]]:
    """Costs with 12 decimal places on several recent days, one before this month and one 40 days ago."""
    month_start = period_bounds("month", now)[0]
    return [("0.123456789012", now, ["support"]), ("1.000000000001", now - timedelta(minutes=1), ["support", "eu"]),
            ("0.000000000007", max(month_start, now - timedelta(days=2)), None),
            ("2.5", max(month_start, now - timedelta(days=3)), ["batch"]),
            ("0.3", month_start - timedelta(hours=1), ["support"]),
            ("7.000000000009", now - timedelta(days=40), None)]


def test_the_tenant_page_lists_budgets_with_exact_decimals(stack, client):
    services = stack[0].services
    tenant, key = new_tenant(services, "budget-list")
    now = utcnow()
    book(services, tenant.id, key.id, spread_rows(now))
    budgets = services.budgets
    budgets.put(tenant.id, "tenant", "", "1234.567890123456", "month", True, None)
    budgets.put(tenant.id, "key", key.id, "0.000000000001", "week", False, ["0.25", "0.75"])
    budgets.put(tenant.id, "tag", "support", "5", "total", True, None)
    budgets.put(tenant.id, "user", "alice@example.com", "10.10", "day", True, None)
    page = client.get(f"/console/tenants/{tenant.id}")
    assert page.status_code == 200
    rows = budget_rows(page.text)
    assert set(rows) == {"tenant:", f"key:{key.id}", "tag:support", "user:alice@example.com"}
    month = ledger_by_day(services, tenant.id)
    month_spent = sum((v for (day, _), v in month.items() if day >= period_bounds("month", now)[0].date()),
                      Decimal(0))
    statuses = {f"{s.budget.scope}:{s.budget.subject}": s.as_dict() for s in services.budgets.statuses(tenant.id)}
    for subject, cells in rows.items():
        d = statuses[subject]
        # scope, subject, limit, spent, reserved, remaining, period, resets at, kind, alerts, actions
        assert cells[2:7] == [d["limit_usd"], d["spent_usd"], d["reserved_usd"], d["remaining_usd"], d["period"]]
    assert rows["tenant:"][1] == "the whole tenant"
    assert rows["tenant:"][2:6] == ["1234.567890123456", money_text(month_spent), "0.00",
                                    money_text(Decimal("1234.567890123456") - month_spent)]
    assert rows["tenant:"][3] == "3.62345678902"  # the four rows of this month
    assert rows[f"key:{key.id}"][1] == f"{key.prefix}… {key.id}"
    assert rows[f"key:{key.id}"][2] == "0.000000000001" and rows[f"key:{key.id}"][5] == "0.00"
    assert rows[f"key:{key.id}"][8:10] == ["soft", "0.25, 0.75"]
    assert rows["tag:support"][2:5] == ["5.00", "1.423456789013", "0.00"]  # the tag's rows, all time
    assert rows["tag:support"][7] == "never" and rows["tag:support"][8:10] == ["hard", "0.5, 0.8, 1"]
    resets = period_bounds("day", now)[1].strftime("%Y-%m-%d %H:%M")
    assert rows["user:alice@example.com"][2] == "10.10" and rows["user:alice@example.com"][7] == f"{resets} UTC"


def test_setting_and_removing_a_budget_through_the_form(stack, client):
    services = stack[0].services
    tenant, key = new_tenant(services, "budget-form")
    page = client.get(f"/console/tenants/{tenant.id}")
    token = csrf_of(page.text)
    assert "No budgets: this tenant can spend without limit" in page.text
    set_ = client.post(f"/console/tenants/{tenant.id}/budgets",
                       data={"csrf_token": token, "scope": "key", "subject": key.id, "limit_usd": " 250.000000000001 ",
                             "period": "week", "alert_at": "0.9, 0.5", "hard": "on"})
    assert set_.status_code == 303 and set_.headers["location"] == f"/console/tenants/{tenant.id}?notice=budget-set"
    shown = client.get(set_.headers["location"])
    assert '<p class="notice" role="status">Budget set.</p>' in shown.text
    status = services.budgets.status(tenant.id, "key", key.id)
    assert status.budget.limit_usd == Decimal("250.000000000001") and status.budget.period == "week"
    assert status.budget.hard and status.budget.alert_at == (Decimal("0.5"), Decimal("0.9"))
    assert budget_rows(shown.text)[f"key:{key.id}"][2] == "250.000000000001"

    # The same scope and subject again replaces it: an unticked box makes it soft, no thresholds the defaults.
    again = client.post(f"/console/tenants/{tenant.id}/budgets",
                        data={"csrf_token": token, "scope": "key", "subject": key.id, "limit_usd": "3",
                              "period": "month", "alert_at": ""})
    assert again.status_code == 303
    rows = budget_rows(client.get(f"/console/tenants/{tenant.id}").text)
    assert list(rows) == [f"key:{key.id}"] and rows[f"key:{key.id}"][2] == "3.00"
    assert rows[f"key:{key.id}"][8:10] == ["soft", "0.5, 0.8, 1"]

    # A tenant budget ignores a subject typed by mistake.
    tenant_wide = client.post(f"/console/tenants/{tenant.id}/budgets",
                              data={"csrf_token": token, "scope": "tenant", "subject": "ignored", "limit_usd": "100",
                                    "period": "day", "hard": "on"})
    assert tenant_wide.status_code == 303
    assert services.budgets.status(tenant.id, "tenant").budget.limit_usd == Decimal(100)

    removed = client.post(f"/console/tenants/{tenant.id}/budgets/remove",
                          data={"csrf_token": token, "scope": "key", "subject": key.id})
    assert removed.status_code == 303
    assert removed.headers["location"] == f"/console/tenants/{tenant.id}?notice=budget-removed"
    assert "Budget removed." in client.get(removed.headers["location"]).text
    with pytest.raises(BudgetNotFound):
        services.budgets.status(tenant.id, "key", key.id)
    assert [s.budget.scope for s in services.budgets.statuses(tenant.id)] == ["tenant"]

    # Removing it twice says there is none; without the CSRF token nothing is removed.
    twice = client.post(f"/console/tenants/{tenant.id}/budgets/remove",
                        data={"csrf_token": token, "scope": "key", "subject": key.id})
    assert twice.status_code == 400
    assert re.search(r'<p class="error" role="alert">no budget is set for key .* of tenant', twice.text)
    forged = client.post(f"/console/tenants/{tenant.id}/budgets/remove", data={"scope": "tenant"})
    assert forged.status_code == 403 and "CSRF" in forged.text
    assert [s.budget.scope for s in services.budgets.statuses(tenant.id)] == ["tenant"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"limit_usd": "12.3.4"}, "limit_usd &#39;12.3.4&#39; is not a decimal number"),
    ({"limit_usd": ""}, "is not a decimal number"),
    ({"limit_usd": "-5"}, "limit_usd must be at least 0"),
    ({"limit_usd": "0.0000000000001"}, "limit_usd has more than 12 decimal places"),
    ({"alert_at": "0.5, lots"}, "alert_at must be a list of fractions"),
    ({"period": "year"}, "period must be one of day, week, month, total"),
    ({"scope": "user", "subject": ""}, "a user budget needs its user"),
    ({"scope": "key", "subject": "key_not_this_tenants"}, "has no API key &#39;key_not_this_tenants&#39;"),
])
def test_a_bad_budget_shows_the_services_error_and_sets_nothing(stack, client, fields, message):
    services = stack[0].services
    tenant, _ = new_tenant(services, "budget-errors")
    token = csrf_of(client.get(f"/console/tenants/{tenant.id}").text)
    data = {"csrf_token": token, "scope": "tenant", "subject": "", "limit_usd": "10", "period": "month",
            "alert_at": "0.5", "hard": "on", **fields}
    answer = client.post(f"/console/tenants/{tenant.id}/budgets", data=data)
    assert answer.status_code == 400
    error = re.search(r'<p class="error" role="alert">([^<]*)</p>', answer.text)
    assert error and message in error.group(1), answer.text[:2000]
    assert services.budgets.statuses(tenant.id) == []
    # The form keeps what was typed, so the operator corrects it rather than retyping.
    assert f'name="limit_usd" type="text" inputmode="decimal" required placeholder="500.00" ' \
           f'value="{html.escape(data["limit_usd"])}"' in answer.text


def test_the_chart_draws_the_ledgers_daily_spend_against_the_tenant_budget(stack, client):
    services = stack[0].services
    tenant, key = new_tenant(services, "budget-chart")
    other, other_key = new_tenant(services, "budget-chart-other")
    now = utcnow()
    book(services, tenant.id, key.id, spread_rows(now))
    book(services, other.id, other_key.id, [("100", now, None)])  # another tenant's spend is not drawn
    today = now.date()
    ledger = {day: cost for (day, _), cost in ledger_by_day(services, tenant.id).items()}

    # Without a tenant budget: the last 30 days, no limit.
    chart = chart_of(client.get(f"/console/tenants/{tenant.id}").text, "budget-data")
    days = [today - timedelta(days=29 - i) for i in range(30)]
    assert chart["labels"] == [d.isoformat() for d in days] and chart["limit"] is None and chart["period"] is None
    assert [Decimal(v) for v in chart["daily"]] == [ledger.get(d, Decimal(0)) for d in days]
    assert Decimal(chart["cumulative"][-1]) == Decimal(chart["spent"]) == sum(
        (v for d, v in ledger.items() if d >= days[0]), Decimal(0))

    # A monthly budget: every day of this month, the days to come empty, the limit flat.
    services.budgets.put(tenant.id, "tenant", "", "9.999999999999", "month", True, None)
    page = client.get(f"/console/tenants/{tenant.id}").text
    chart = chart_of(page, "budget-data")
    start, end = period_bounds("month", now)
    days = [start.date() + timedelta(days=i) for i in range((end - start).days)]
    assert chart["labels"] == [d.isoformat() for d in days]
    assert chart["limit"] == "9.999999999999" and chart["period"] == "month"
    past = [d for d in days if d <= today]
    assert [Decimal(v) for v in chart["daily"][:len(past)]] == [ledger.get(d, Decimal(0)) for d in past]
    assert chart["daily"][len(past):] == chart["cumulative"][len(past):] == [None] * (len(days) - len(past))
    running, expected = Decimal(0), []
    for d in past:
        running += ledger.get(d, Decimal(0))
        expected.append(running)
    assert [Decimal(v) for v in chart["cumulative"][:len(past)]] == expected
    assert Decimal(chart["spent"]) == expected[-1] == services.budgets.status(tenant.id, "tenant").spent
    assert (f'id="budget-chart" role="img" aria-label="Daily spend in USD from {days[0].isoformat()} to '
            f'{days[-1].isoformat()} as bars, the cumulative spend as a line') in page
    assert f"the limit of 9.999999999999 USD as a flat line; {chart['spent']} USD spent" in page

    # A total budget: from the first day with spend (40 days ago) to today, the line from 0.
    services.budgets.put(tenant.id, "tenant", "", "50", "total", True, None)
    chart = chart_of(client.get(f"/console/tenants/{tenant.id}").text, "budget-data")
    first = min(ledger)
    assert chart["labels"][0] == first.isoformat() and chart["labels"][-1] == today.isoformat()
    assert len(chart["labels"]) == (today - first).days + 1
    assert Decimal(chart["cumulative"][-1]) == sum(ledger.values(), Decimal(0))


def test_the_usage_page_reports_the_last_30_days_of_spend_by_tag(stack, client):
    services = stack[0].services
    tenant, key = new_tenant(services, "budget-tags")
    now = utcnow()
    book(services, tenant.id, key.id, [("0.000000000011", now, ["tagreport-a"]),
                                       ("1.25", now - timedelta(days=2), ["tagreport-a", "tagreport-b"]),
                                       ("4", now - timedelta(days=31), ["tagreport-old"])])
    page = client.get("/console/usage")
    assert page.status_code == 200
    chart = chart_of(page.text, "tag-spend-data")
    today = now.date()
    assert chart["labels"] == [(today - timedelta(days=29 - i)).isoformat() for i in range(30)]
    series = {t["tag"]: t for t in chart["tags"]}
    assert "tagreport-old" not in series
    a, b = series["tagreport-a"], series["tagreport-b"]
    day_of = {label: i for i, label in enumerate(chart["labels"])}
    assert a["daily"][day_of[today.isoformat()]] == "0.000000000011"
    assert a["daily"][day_of[(now - timedelta(days=2)).date().isoformat()]] == "1.25"
    assert a["total"] == "1.250000000011" and a["requests"] == 2 and a["tokens"] == 30
    assert b["total"] == "1.25" and sum(Decimal(v) for v in b["daily"]) == Decimal("1.25")
    assert 'id="spend-by-tag" role="img"' in page.text
    assert re.search(r'<tr data-tag="tagreport-a"><td>tagreport-a</td><td class="num">2</td>'
                     r'<td class="num">30</td><td class="num">1.250000000011</td></tr>', page.text)
