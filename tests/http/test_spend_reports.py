"""Spend reports (GET /admin/billing/spend) and `loramux admin budgets` / `loramux admin billing spend`, on
SQLite and PostgreSQL: every grouping and period adds up, exactly, to the ledger rows it covers; UTC day,
week (Monday) and month boundaries; a request under each of its tags; 400s that say what to fix."""
from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, time, timedelta, timezone
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import select

from conftest import admin_client, live_stack
from loramux.billing.ledger import write_records
from loramux.billing.money import sum_money
from loramux.billing.pricing import PriceInfo
from loramux.billing.usage import RequestRecord
from loramux.cli import main
from loramux.db import LedgerEntry

ADMIN_KEY = "lmxa-spend-admin-key-0123456789abcdefghijklmnopqr"
MODEL = "smol"
UTC = timezone.utc
# Prices with many decimals: any float on the way would show in the 12th place.
PRICES = [PriceInfo(1, MODEL, None, None, Decimal("0.15"), Decimal("0.075"), Decimal("0.6"),
                    datetime(2020, 1, 1, tzinfo=UTC)),
          PriceInfo(2, MODEL, "ad_summarize", None, Decimal("0.333333"), Decimal("0.1"), Decimal("1.234567"),
                    datetime(2020, 1, 1, tzinfo=UTC))]
SAT = datetime(2026, 2, 28, tzinfo=UTC)  # a Saturday, the last day of February
SUN, MON = SAT + timedelta(days=1), SAT + timedelta(days=2)  # 2026-03-01 (a Sunday), 2026-03-02 (a Monday)
TICK = timedelta(microseconds=1)


@pytest.fixture
def stack(database_url, tiny_dir, tokenizer, tmp_path):
    with live_stack(tmp_path, tiny_dir, tokenizer, database_url=database_url, admin_key=ADMIN_KEY) as server:
        yield server


@pytest.fixture
def admin(stack) -> Iterator[httpx.Client]:
    with admin_client(stack, ADMIN_KEY) as client:
        yield client


def record(n: int, at: datetime, tenant: str, **fields) -> RequestRecord:
    """A finished request of `tenant` at `at`; `fields` override RequestRecord's (key_id, adapter_id, end_user,
    tags, tokens)."""
    adapter = fields.get("adapter_id")
    values = dict(request_id=f"req-{n}", tenant_id=tenant, key_id="key_1", tier="standard", model=MODEL,
                  adapter_id=None, adapter_version=1 if adapter else None, adapter_digest=None,
                  requested=adapter or MODEL, fallback=False, outcome="stop", prompt_tokens=1000, cached_tokens=0,
                  completion_tokens=100, queue_ms=1.0, ttft_ms=2.0, total_ms=3.0, created_at=at)
    return RequestRecord(**{**values, **fields})


def tenants(server) -> tuple[str, str]:
    ensure = server.services.tenancy.ensure_tenant
    return ensure("acme")[0].id, ensure("globex")[0].id


def fill_ledger(server) -> list[LedgerEntry]:
    """A ledger across the February / March boundary: two tenants, keys, adapters, end users and tags, rows at
    the last microsecond of a day and the first of the next; returns the rows as stored."""
    acme, globex = tenants(server)
    moments = [SAT - timedelta(days=6), SAT + timedelta(hours=12), SUN - TICK, SUN, SUN + timedelta(hours=23),
               MON - TICK, MON, MON + timedelta(hours=5, minutes=7), MON + timedelta(days=6, hours=23),
               MON + timedelta(days=7), datetime(2026, 3, 31, 23, 59, 59, 999999, tzinfo=UTC),
               datetime(2026, 4, 1, tzinfo=UTC)]
    records = []
    for i, at in enumerate(moments):
        for j in range(3):
            n = i * 3 + j
            records.append(record(
                n, at + timedelta(microseconds=j), (acme, globex)[n % 2], key_id=("key_a", "key_b", "key_c")[n % 3],
                adapter_id=(None, "ad_summarize", "ad_translate")[(n // 2) % 3],
                end_user=(None, "alice", "bob")[(i + j) % 3],
                tags=[None, ["batch"], ["batch", "eval"], ["eval", "eval"], []][n % 5],
                prompt_tokens=100 + 37 * n, cached_tokens=(11 * n) % 50, completion_tokens=1 + 13 * n))
    assert write_records(server.services.db, records, PRICES) == (len(records), 0)
    with server.services.db.session() as session:
        rows = list(session.scalars(select(LedgerEntry).order_by(LedgerEntry.id)))
    assert all(row.cost > 0 for row in rows) and len({row.cost for row in rows}) > 20
    return rows


def bucket(period: str, at: datetime) -> str:
    """The start of the UTC day / week (from Monday) / month that holds `at`, written out on its own here."""
    day = at.astimezone(UTC).date()
    start = {"day": day, "week": day - timedelta(days=day.weekday()), "month": day.replace(day=1)}[period]
    return datetime.combine(start, time(), tzinfo=UTC).isoformat(timespec="microseconds")


def expected(rows: list[LedgerEntry], group_by: str, period: str) -> list[dict]:
    groups: dict = {}
    for row in rows:
        if group_by == "tag":
            subjects = sorted(set(row.tags or ()))
        else:
            subjects = [{"tenant": row.tenant_id, "adapter": row.adapter_id, "key": row.key_id,
                         "user": row.end_user}[group_by]]
        for subject in subjects:
            c = groups.setdefault((bucket(period, row.created_at), subject), [0, 0, 0, 0, Decimal(0)])
            for k, v in enumerate((1, row.prompt_tokens, row.cached_tokens, row.completion_tokens)):
                c[k] += v
            c[4] += row.cost
    return [{"period_start": when, "group": group, "requests": c[0], "prompt_tokens": c[1], "cached_tokens": c[2],
             "completion_tokens": c[3], "cost_usd": format(c[4].quantize(Decimal("1e-12")), "f")}
            for (when, group), c in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None,
                                                                           kv[0][1] or ""))]


def spend(admin: httpx.Client, **params) -> dict:
    resp = admin.get("/admin/billing/spend", params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_every_grouping_and_period_adds_up_exactly_to_the_ledger_rows(stack, admin):
    rows = fill_ledger(stack)
    for group_by in ("tenant", "adapter", "key", "user", "tag"):
        for period in ("day", "week", "month"):
            report = spend(admin, group_by=group_by, period=period)
            assert report == {"group_by": group_by, "period": period, "start": None, "end": None,
                              "rows": expected(rows, group_by, period)}, (group_by, period)
    # Exact to the last decimal: the report's money adds up to SQL's own exact sum of the ledger.
    by_tenant = spend(admin, group_by="tenant", period="month")["rows"]
    with stack.services.db.session() as session:
        ledger_total = sum_money(session, LedgerEntry.cost)
    assert sum(Decimal(r["cost_usd"]) for r in by_tenant) == ledger_total
    assert all(len(r["cost_usd"].split(".")[1]) == 12 for r in by_tenant)
    # The base model is the null adapter, requests without `user` the null user: both sort first.
    first_day = spend(admin, group_by="adapter", period="day")["rows"]
    assert first_day[0]["group"] is None and first_day[0]["period_start"] == "2026-02-22T00:00:00.000000+00:00"
    march = [r["group"] for r in spend(admin, group_by="user", period="month")["rows"]
             if r["period_start"].startswith("2026-03")]
    assert march == [None, "alice", "bob"]


def test_a_request_counts_under_each_of_its_tags_and_untagged_ones_not_at_all(stack, admin):
    acme, _ = tenants(stack)
    at = MON + timedelta(hours=1)
    write_records(stack.services.db, [
        record(1, at, acme, tags=["batch", "eval"], prompt_tokens=1000, completion_tokens=10),
        record(2, at, acme, tags=["eval"], prompt_tokens=2000, completion_tokens=20),
        record(3, at, acme, prompt_tokens=4000, completion_tokens=40),
        record(4, at, acme, tags=[], prompt_tokens=8000, completion_tokens=80)], PRICES)
    rows = spend(admin, group_by="tag", period="day")["rows"]
    # 1000 prompt tokens at $0.15/M plus 10 output tokens at $0.60/M = $0.000156
    assert [(r["group"], r["requests"], r["prompt_tokens"], r["completion_tokens"], r["cost_usd"]) for r in rows] == [
        ("batch", 1, 1000, 10, "0.000156000000"),
        ("eval", 2, 3000, 30, "0.000468000000")]
    assert {r["period_start"] for r in rows} == {"2026-03-02T00:00:00.000000+00:00"}
    assert spend(admin, group_by="tenant", period="day")["rows"][0]["requests"] == 4


def test_rows_either_side_of_midnight_fall_in_different_periods(stack, admin):
    acme, _ = tenants(stack)
    write_records(stack.services.db, [record(1, SAT.replace(hour=23, minute=59, second=59), acme),
                                      record(2, SUN, acme),
                                      record(3, MON - timedelta(seconds=1), acme),
                                      record(4, MON, acme)], PRICES)

    def starts(period: str) -> list[tuple[str, int]]:
        return [(r["period_start"][:10], r["requests"]) for r in spend(admin, group_by="tenant", period=period)["rows"]]

    assert starts("day") == [("2026-02-28", 1), ("2026-03-01", 2), ("2026-03-02", 1)]
    assert starts("week") == [("2026-02-23", 3), ("2026-03-02", 1)]  # Sunday 23:59:59 and Monday 00:00
    assert starts("month") == [("2026-02-01", 1), ("2026-03-01", 3)]


def test_start_end_and_tenant_bound_the_rows_read(stack, admin):
    rows = fill_ledger(stack)
    acme, globex = tenants(stack)
    # The end is exclusive and start inclusive; a tenant by name or id; times in any zone.
    report = spend(admin, group_by="key", period="week", tenant_id="acme", start="2026-03-01",
                   end="2026-03-02T01:00:00+01:00")
    kept = [r for r in rows if r.tenant_id == acme and SUN <= r.created_at < MON]
    assert report["rows"] == expected(kept, "key", "week") and kept
    assert (report["start"], report["end"]) == ("2026-03-01T00:00:00.000000+00:00", "2026-03-02T00:00:00.000000+00:00")
    assert spend(admin, group_by="tenant", period="month", tenant_id=globex)["rows"] == \
        expected([r for r in rows if r.tenant_id == globex], "tenant", "month")
    assert spend(admin, group_by="tenant", period="day", start="2030-01-01")["rows"] == []


@pytest.mark.parametrize("params, param, words", [
    ({"group_by": "model"}, "group_by", "group_by must be one of tenant, adapter, key, user, tag"),
    ({"period": "hour"}, "period", "period must be one of day, week, month"),
    ({"period": "total"}, "period", "period must be one of day, week, month"),
    ({"start": "yesterday"}, None, "start 'yesterday' is not an ISO 8601 date"),
    ({"start": "2026-03-02", "end": "2026-03-01"}, None, "must be before its end"),
])
def test_bad_parameters_are_400s_that_say_what_to_fix(stack, admin, params, param, words):
    resp = admin.get("/admin/billing/spend", params=params)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and error["param"] == param
    assert admin.get("/admin/billing/spend", params={"tenant_id": "no-such-tenant"}).status_code == 404


def test_budgets_and_spend_from_the_command_line(stack, admin, capsys):
    acme, globex = tenants(stack)
    key_id = stack.services.tenancy.create_key("acme")[0].id
    write_records(stack.services.db, [record(1, MON, acme, tags=["batch"]), record(2, MON, globex)], PRICES)

    def cli(*args: str) -> tuple[int, dict | None, str]:
        capsys.readouterr()
        code = main(["admin", "--url", stack.url, "--key", ADMIN_KEY, *args])
        out, err = capsys.readouterr()
        return code, json.loads(out) if out.strip() else None, err

    code, made, _ = cli("budgets", "set", "acme", "100.50", "--period", "month", "--soft", "--alert-at", "0.5, 0.9")
    assert code == 0 and made["tenant_id"] == acme and made["scope"] == "tenant" and made["subject"] is None
    assert (made["limit_usd"], made["period"], made["hard"], made["alert_at"]) == ("100.50", "month", False,
                                                                                   ["0.5", "0.9"])
    assert cli("budgets", "set", "acme", "5", "--period", "day", "--tag", "batch")[1]["hard"] is True
    assert cli("budgets", "set", "acme", "7", "--period", "week", "--user", "alice ops@example.com")[0] == 0
    assert cli("budgets", "set", acme, "9", "--period", "total", "--key", key_id)[0] == 0
    assert cli("budgets", "set", "globex", "1", "--period", "day")[0] == 0

    assert cli("budgets", "get", "acme")[1]["limit_usd"] == "100.50"
    got = cli("budgets", "get", "acme", "--tag", "batch")[1]
    assert (got["scope"], got["subject"], got["limit_usd"], got["period"]) == ("tag", "batch", "5.00", "day")
    assert cli("budgets", "get", "acme", "--user", "alice ops@example.com")[1]["subject"] == "alice ops@example.com"
    assert cli("budgets", "get", "acme", "--key", key_id)[1]["period"] == "total"
    listed = cli("budgets", "list", "acme")[1]["budgets"]
    assert [(b["scope"], b["subject"]) for b in listed] == [("key", key_id), ("tag", "batch"),
                                                            ("tenant", None), ("user", "alice ops@example.com")]
    assert cli("budgets", "list")[1] == admin.get("/admin/budgets").json()
    assert len(cli("budgets", "list")[1]["budgets"]) == 5

    code, deleted, _ = cli("budgets", "delete", "acme", "--tag", "batch")
    assert code == 0 and deleted == {"tenant": "acme", "scope": "tag", "subject": "batch", "deleted": True}
    code, _, err = cli("budgets", "get", "acme", "--tag", "batch")
    assert code == 1 and "error (404)" in err and "no budget is set for tag 'batch'" in err
    code, _, err = cli("budgets", "set", "acme", "1.5", "--period", "fortnight")
    assert code == 1 and "error (400)" in err and "period must be one of" in err
    code, _, err = cli("budgets", "set", "acme", "lots", "--period", "day")
    assert code == 1 and "error (400)" in err and "not a decimal number" in err

    code, report, _ = cli("billing", "spend", "--group-by", "tag", "--period", "day", "--tenant", "acme",
                          "--start", "2026-03-01")
    assert code == 0 and report == spend(admin, group_by="tag", period="day", tenant_id="acme", start="2026-03-01")
    assert [(r["group"], r["requests"]) for r in report["rows"]] == [("batch", 1)]
    code, _, err = cli("billing", "spend", "--group-by", "model")
    assert code == 1 and "error (400): group_by must be one of" in err
