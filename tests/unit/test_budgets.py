"""Budgets without a server, on SQLite and PostgreSQL: periods, checks of what an admin sets, worst cases, and the
money path (reserve -> ledger row -> spend) that must never count a row twice or let a hard limit pass."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import select

from loramux.billing.budgets import (
    BudgetBook,
    BudgetError,
    BudgetExceeded,
    BudgetNotFound,
    money_text,
    parse_tags,
    period_bounds,
)
from loramux.billing.ledger import write_records
from loramux.billing.pricing import PriceBook, PriceInfo, cost_of, worst_case_cost
from loramux.billing.usage import RequestRecord
from loramux.db import BudgetHold, BudgetSpend
from loramux.tenancy.tenants import Tenancy

UTC = timezone.utc
AT = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def _price(pid: int, adapter: str | None, inp: str, cached: str, out: str) -> PriceInfo:
    return PriceInfo(pid, "tiny", adapter, None, Decimal(inp), Decimal(cached), Decimal(out),
                     datetime(2026, 1, 1, tzinfo=UTC))


@pytest.mark.parametrize(("period", "at", "start", "end"), [
    ("day", datetime(2026, 12, 6, 23, 59, 59, 999999, tzinfo=UTC), datetime(2026, 12, 6, tzinfo=UTC),
     datetime(2026, 12, 7, tzinfo=UTC)),
    ("day", datetime(2026, 12, 7, tzinfo=UTC), datetime(2026, 12, 7, tzinfo=UTC), datetime(2026, 12, 8, tzinfo=UTC)),
    ("week", datetime(2026, 12, 6, 10, tzinfo=UTC), datetime(2026, 11, 30, tzinfo=UTC),  # a Sunday: Monday's week
     datetime(2026, 12, 7, tzinfo=UTC)),
    ("week", datetime(2026, 12, 7, tzinfo=UTC), datetime(2026, 12, 7, tzinfo=UTC), datetime(2026, 12, 14, tzinfo=UTC)),
    ("month", datetime(2026, 12, 31, 23, 0, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC),
     datetime(2027, 1, 1, tzinfo=UTC)),
    ("month", datetime(2028, 2, 29, tzinfo=UTC), datetime(2028, 2, 1, tzinfo=UTC), datetime(2028, 3, 1, tzinfo=UTC)),
    ("total", AT, datetime(1970, 1, 1, tzinfo=UTC), None),
])
def test_periods_are_utc_calendar_spans(period, at, start, end):
    assert period_bounds(period, at) == (start, end)


def test_a_period_in_another_zone_is_the_utc_one():
    from datetime import timedelta

    tokyo = timezone(timedelta(hours=9))
    assert period_bounds("day", datetime(2026, 12, 7, 8, 0, tzinfo=tokyo))[0] == datetime(2026, 12, 6, tzinfo=UTC)


def test_tags_are_checked_and_deduplicated():
    assert parse_tags(["a", "team-b", "a", "x.y:z_1"]) == ["a", "team-b", "x.y:z_1"]
    for bad in ([""], ["-lead"], ["has space"], ["x" * 65], ["é"], [f"t{i}" for i in range(9)], ["nul\x00"]):
        with pytest.raises(BudgetError):
            parse_tags(bad)


def test_money_text_keeps_exact_decimals():
    assert money_text(Decimal("0.05")) == "0.05"
    assert money_text(Decimal("500")) == "500.00"
    assert money_text(Decimal("0.000000000001")) == "0.000000000001"
    assert money_text(Decimal("12.3456789")) == "12.3456789"


def test_the_worst_case_bounds_every_cache_hit_and_every_length():
    prices = [_price(1, None, "10", "5", "100"), _price(2, "ad_dear", "30", "40", "300")]
    for prompt in (0, 1, 17):
        for limit in (0, 8):
            worst = worst_case_cost(prices, "tiny", [None], None, AT, prompt, limit)
            assert worst == cost_of(prompt, 0, limit, prices[0])
            for cached in range(prompt + 1):
                for out in range(limit + 1):
                    assert cost_of(prompt, cached, out, prices[0]) <= worst
            # A cached-input price above the input price (odd, allowed): every prompt token at the dearer one.
            dear = worst_case_cost(prices, "tiny", ["ad_dear"], None, AT, prompt, limit)
            assert dear == cost_of(prompt, prompt, limit, prices[1])
    # A composition: its costliest component's price or the base model's, even of one $0 component.
    assert worst_case_cost(prices, "tiny", ["ad_cheap", "ad_dear", None], None, AT, 10, 4) == \
        cost_of(10, 10, 4, prices[1])
    free = [*prices, _price(3, "ad_free", "0", "0", "0")]
    assert worst_case_cost(free, "tiny", ["ad_free"], None, AT, 10, 4) == 0
    assert worst_case_cost(free, "tiny", ["ad_free", None], None, AT, 10, 4) == cost_of(10, 0, 4, prices[0])
    assert worst_case_cost([], "tiny", [None], None, AT, 10, 4) == 0  # no price: free


@pytest.fixture
def world(database):
    tenancy = Tenancy(database)
    tenant = tenancy.create_tenant("acme")
    PriceBook(database).set_price("tiny", "10", "5", "100", effective_from=datetime(2026, 1, 1, tzinfo=UTC))
    book = BudgetBook(database, "holder-a", clock=lambda: AT)
    return database, book, tenant.id


def _record(request_id: str, tenant_id: str, prompt: int, completion: int, part: int = 0, **fields) -> RequestRecord:
    return RequestRecord(request_id=request_id, tenant_id=tenant_id, key_id="key_x", tier="standard", model="tiny",
                         adapter_id=None, adapter_version=None, adapter_digest=None, requested="base", fallback=False,
                         outcome="length", prompt_tokens=prompt, cached_tokens=0, completion_tokens=completion,
                         queue_ms=1.0, ttft_ms=2.0, total_ms=3.0, created_at=AT, part=part, **fields)


def _holds(db) -> list[tuple]:
    with db.session() as s:
        return [(h.request_id, h.part, h.amount) for h in s.scalars(select(BudgetHold).order_by(BudgetHold.part))]


def test_admin_values_are_checked(world):
    _, book, tenant_id = world
    for args in [("tenant", "", 1.5, "day"), ("tenant", "", "-1", "day"), ("tenant", "", "NaN", "day"),
                 ("tenant", "", "1e40", "day"), ("tenant", "", "abc", "day"), ("tenant", "", "0.0000000000001", "day"),
                 ("tenant", "", "1", "fortnight"), ("galaxy", "", "1", "day"), ("user", "", "1", "day"),
                 ("user", "x" * 257, "1", "day"), ("user", "a\x00b", "1", "day"), ("tag", "no spaces", "1", "day")]:
        with pytest.raises(BudgetError):
            book.put(tenant_id, *args)
    for alerts in ([0], [-0.5], ["x"], [11], list(range(1, 12))):
        with pytest.raises(BudgetError):
            book.put(tenant_id, "tenant", "", "1", "day", alert_at=alerts)
    with pytest.raises(BudgetNotFound):
        book.put("tn_nobody", "tenant", "", "1", "day")
    with pytest.raises(BudgetNotFound):
        book.status(tenant_id, "tenant")
    status, created = book.put(tenant_id, "tenant", "ignored", "0.1", "day", alert_at=["0.25", 1])
    assert created and status.budget.subject == "" and status.budget.alert_at == (Decimal("0.25"), Decimal("1"))


def test_reserve_book_and_release_move_the_money_exactly_once(world):
    db, book, tenant_id = world
    status, _ = book.put(tenant_id, "tenant", "", "0.001", "month")
    budgets = book.budgets_for(tenant_id)
    held = book.reserve("req-1", budgets, [Decimal("0.0004"), Decimal("0.0003")])  # a fan-out of two parts
    assert held[0].reserved == Decimal("0.0007") and held[0].remaining == Decimal("0.0003")
    with pytest.raises(BudgetExceeded) as refused:
        book.reserve("req-2", budgets, [Decimal("0.0004")])
    assert refused.value.status.remaining == Decimal("0.0003") and refused.value.needed == Decimal("0.0004")
    assert "max_tokens" in str(refused.value) and "2027-01-01" in str(refused.value)
    assert [h[0] for h in _holds(db)] == ["req-1", "req-1"]  # a refusal holds nothing
    # Part 0's row: its cost replaces its hold; writing it again changes nothing.
    part0 = _record("req-1", tenant_id, 10, 2, part=0)  # 0.0001 + 0.0002
    assert write_records(db, [part0]) == (1, 0)
    assert write_records(db, [part0]) == (0, 1)
    status = book.status(tenant_id, "tenant")
    assert (status.spent, status.reserved) == (Decimal("0.0003"), Decimal("0.0003"))
    assert write_records(db, [_record("req-1", tenant_id, 10, 1, part=1)]) == (1, 0)
    status = book.status(tenant_id, "tenant")
    assert (status.spent, status.reserved) == (Decimal("0.0005"), 0) and _holds(db) == []
    # A request that ends without a row gives its hold back.
    book.reserve("req-3", budgets, [Decimal("0.0005")])
    assert book.status(tenant_id, "tenant").remaining == 0
    book.release("req-3")
    assert book.status(tenant_id, "tenant").remaining == Decimal("0.0005")
    # A row of a request that reserved nothing (served while reservations could not be made, or in flight when
    # the budget was set) still counts, in the period of its arrival; a row of another tenant does not.
    other = Tenancy(db).create_tenant("other").id
    write_records(db, [_record("unreserved", tenant_id, 10, 2), _record("theirs", other, 10, 2)])
    assert book.status(tenant_id, "tenant").spent == Decimal("0.0008")


def test_a_new_budget_starts_with_what_the_ledger_holds_for_its_scope(world):
    db, book, tenant_id = world
    write_records(db, [_record("a", tenant_id, 10, 2, tags=["x", "y"], end_user="u1"),
                       _record("b", tenant_id, 10, 2, tags=["y"]),
                       _record("c", tenant_id, 10, 2)])
    one = Decimal("0.0003")
    assert book.put(tenant_id, "tenant", "", "1", "month")[0].spent == 3 * one
    assert book.put(tenant_id, "tag", "y", "1", "month")[0].spent == 2 * one
    assert book.put(tenant_id, "tag", "x", "1", "day")[0].spent == one
    assert book.put(tenant_id, "user", "u1", "1", "week")[0].spent == one
    assert book.put(tenant_id, "key", "key_x", "1", "total")[0].spent == 3 * one
    assert book.put(tenant_id, "key", "key_other", "1", "total")[0].spent == 0
    # Changing only the limit keeps the spend; changing the period recounts it, and what is in flight moves along.
    assert book.put(tenant_id, "tenant", "", "2", "month")[0].spent == 3 * one
    book.reserve("in-flight", book.budgets_for(tenant_id), [Decimal("0.25")])
    book.clock = lambda: datetime(2027, 1, 2, tzinfo=UTC)
    moved = book.put(tenant_id, "tenant", "", "2", "day")[0]
    assert (moved.spent, moved.reserved) == (0, Decimal("0.25"))
    write_records(db, [_record("in-flight", tenant_id, 10, 2)])
    assert (book.status(tenant_id, "tenant").spent, book.status(tenant_id, "tenant").reserved) == (one, 0)


def test_only_budgets_that_apply_count_a_request():
    from loramux.billing.budgets import BudgetInfo

    def info(scope, subject=""):
        return BudgetInfo(1, "tn", scope, subject, Decimal(1), "day", True, ())

    assert info("tenant").applies("k", None, [])
    assert info("key", "k").applies("k", None, []) and not info("key", "k").applies("j", None, [])
    assert info("user", "alice").applies("k", "alice", []) and not info("user", "alice").applies("k", None, [])
    assert info("tag", "b").applies("k", None, ["a", "b"]) and not info("tag", "b").applies("k", None, ["a"])


def test_concurrent_reservations_never_pass_a_hard_limit(world):
    """64 threads race for a budget that holds 10 of their reservations: exactly 10 win."""
    db, book, tenant_id = world
    book.put(tenant_id, "tenant", "", "0.0010", "month")
    budgets = book.budgets_for(tenant_id)

    def one(i: int) -> bool:
        try:
            book.reserve(f"r{i}", budgets, [Decimal("0.0001")])
            return True
        except BudgetExceeded:
            return False

    with ThreadPoolExecutor(16) as pool:
        won = sum(pool.map(one, range(64)))
    assert won == 10
    status = book.status(tenant_id, "tenant")
    assert status.reserved == Decimal("0.0010") and status.remaining == 0


def test_leftovers_of_an_earlier_run_are_dropped_and_a_deleted_budget_takes_its_holds(world):
    db, book, tenant_id = world
    book.put(tenant_id, "tenant", "", "1", "month")
    book.reserve("old", book.budgets_for(tenant_id), [Decimal("0.1")])
    restarted = BudgetBook(db, "holder-a", clock=lambda: AT)  # the same log, a new run
    other = BudgetBook(db, "holder-b", clock=lambda: AT)
    other.reserve("theirs", other.budgets_for(tenant_id), [Decimal("0.2")])
    restarted.reserve("new", restarted.budgets_for(tenant_id), [Decimal("0.3")])
    assert restarted.clear_leftovers() == 1
    assert sorted(h[0] for h in _holds(db)) == ["new", "theirs"]
    assert restarted.status(tenant_id, "tenant").reserved == Decimal("0.5")
    restarted.delete(tenant_id, "tenant")
    assert _holds(db) == []
    with db.session() as s:
        assert s.scalars(select(BudgetSpend)).all() == []
    with pytest.raises(BudgetNotFound):
        restarted.delete(tenant_id, "tenant")


def test_a_logs_holder_id_lives_beside_it_and_an_orphaned_logs_reservations_are_dropped(world, tmp_path):
    from loramux.billing.budgets import holder_of
    from loramux.billing.ledger_wal import WAL_NAME
    from loramux.billing.recovery import adopt_orphans

    db, book, tenant_id = world
    root = tmp_path / "ingress"
    first = holder_of(root / "slot-0" / WAL_NAME)
    assert holder_of(root / "slot-0" / WAL_NAME) == first != holder_of(root / "slot-1" / WAL_NAME)
    book.put(tenant_id, "tenant", "", "1", "month")
    gone = BudgetBook(db, first, clock=lambda: AT)  # an ingress that died with a request in flight
    gone.reserve("never-answered", gone.budgets_for(tenant_id), [Decimal("0.1")])
    live = BudgetBook(db, holder_of(root / "slot-1" / WAL_NAME), clock=lambda: AT)
    live.reserve("in-flight", live.budgets_for(tenant_id), [Decimal("0.2")])
    assert adopt_orphans(db, root, root / "slot-1") == 0  # its log is empty: nothing to replay, but its holds go
    assert [h[0] for h in _holds(db)] == ["in-flight"]


def test_a_release_while_the_database_is_down_is_retried(world, monkeypatch):
    from polling import wait_until

    db, book, tenant_id = world
    book.put(tenant_id, "tenant", "", "1", "month")
    book.reserve("doomed", book.budgets_for(tenant_id), [Decimal("0.3")])
    real, calls = db.session, []

    def flaky():
        calls.append(1)
        if len(calls) <= 2:
            raise ConnectionError("the database is down")
        return real()

    monkeypatch.setattr(db, "session", flaky)
    book.release_backoff_s = 0.01
    book.release_later("doomed")
    wait_until(lambda: len(calls) >= 3 and not _holds(db), "the release to get through on its third try")


def test_untagged_ledger_rows_store_sql_null(world):
    from sqlalchemy import text

    db, _, tenant_id = world
    write_records(db, [_record("plain", tenant_id, 1, 1), _record("tagged", tenant_id, 1, 1, tags=["a"])])
    with db.session() as s:
        assert s.execute(text("SELECT request_id FROM ledger WHERE tags IS NULL")).scalars().all() == ["plain"]
