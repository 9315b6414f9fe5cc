"""Prices and the cost ledger: exact costs, the price in force when a request ran, exactly-once writes,
and a writer that loses nothing while PostgreSQL is really down (a fault-injecting TCP proxy in front of it)."""
from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from loramux.billing import ledger as ledger_module
from loramux.billing.ledger import LedgerWriter, write_records
from loramux.billing.money import sum_money
from loramux.billing.pricing import PriceBook, PriceError, PriceInfo, cost_of, price_for
from loramux.billing.usage import RequestRecord
from loramux.db import Adapter, Database, LedgerEntry, Tenant
from loramux.testing import FaultyProxy
from polling import wait_until

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
MODEL = "smol"


def record(i: int | str, *, prompt: int = 0, cached: int = 0, completion: int = 1, at: datetime | None = None,
           model: str = MODEL, adapter_id: str | None = None, tier: str = "standard", tenant: str = "tn_a",
           ) -> RequestRecord:
    return RequestRecord(request_id=f"req-{i}", tenant_id=tenant, key_id="key_1", tier=tier, model=model,
                         adapter_id=adapter_id, adapter_version=1 if adapter_id else None, adapter_digest=None,
                         requested=adapter_id or model, fallback=False, outcome="stop", prompt_tokens=prompt,
                         cached_tokens=cached, completion_tokens=completion, queue_ms=1.5, ttft_ms=None,
                         total_ms=12.25, created_at=at or T0 + timedelta(hours=1))


def price(pid: int, *, adapter_id: str | None = None, tier: str | None = None, at: datetime = T0,
          base_model: str = MODEL, inp: str = "1", cached: str = "0.5", out: str = "2") -> PriceInfo:
    return PriceInfo(pid, base_model, adapter_id, tier, Decimal(inp), Decimal(cached), Decimal(out), at)


def ledger_rows(db: Database) -> list[LedgerEntry]:
    with db.session() as session:
        return list(session.execute(select(LedgerEntry).order_by(LedgerEntry.request_id)).scalars())


def row_count(db: Database) -> int:
    with db.session() as session:
        return session.execute(select(func.count()).select_from(LedgerEntry)).scalar_one()


# --- pure: cost and the price in force -----------------------------------------------------------------
def test_cost_of_is_exact_and_rounds_half_even():
    p = price(1, inp="0.15", cached="0.075", out="0.6")
    # (1000 - 400) * 0.15 + 400 * 0.075 + 250 * 0.6 = 90 + 30 + 150 = 270 per 1M tokens
    assert cost_of(1000, 400, 250, p) == Decimal("0.000270000000")
    assert cost_of(0, 0, 0, p) == 0
    assert cost_of(10, 0, 0, None) == Decimal("0")
    assert cost_of(1, 0, 0, price(1, inp="0.000001")) == Decimal("1E-12")
    assert cost_of(1, 0, 0, price(1, inp="0.0000005")) == Decimal("0")  # 0.5e-12 -> even 0
    assert cost_of(1, 0, 0, price(1, inp="0.0000015")) == Decimal("2E-12")  # 1.5e-12 -> even 2
    assert cost_of(1, 0, 0, price(1, inp="0.0000025")) == Decimal("2E-12")  # 2.5e-12 -> even 2
    big = price(1, inp="999999999.999999999999", cached="0", out="999999999.999999999999")
    assert cost_of(2**31 - 1, 0, 2**31 - 1, big) == Decimal("4294967293999.999999995705")
    with pytest.raises(ValueError, match="cannot exceed"):
        cost_of(5, 6, 0, p)
    with pytest.raises(ValueError, match="negative"):
        cost_of(5, 0, -1, p)


SCOPES = [price(1), price(2, tier="premium"), price(3, adapter_id="ad_x"), price(4, adapter_id="ad_x", tier="premium"),
          price(5, base_model="other")]


@pytest.mark.parametrize("adapter_id, tier, expected", [
    ("ad_x", "premium", 4),  # (adapter, tier)
    ("ad_x", "free", 3),  # (adapter, any tier)
    (None, "premium", 2),  # (base, tier)
    ("ad_y", "premium", 2),  # another adapter: its base model's tier price
    (None, "free", 1),  # (base, any tier)
    ("ad_y", "free", 1),
])
def test_price_for_most_specific_scope_wins(adapter_id, tier, expected):
    at = T0 + timedelta(days=1)
    assert price_for(SCOPES, MODEL, adapter_id, tier, at).id == expected
    assert price_for(list(reversed(SCOPES)), MODEL, adapter_id, tier, at).id == expected
    assert price_for(SCOPES, "unpriced", adapter_id, tier, at) is None


def test_price_for_effective_from_boundaries():
    t1 = T0 + timedelta(days=10)
    prices = [price(1, at=T0), price(2, at=t1), price(3, adapter_id="ad_x", at=t1 + timedelta(days=5))]
    us = timedelta(microseconds=1)
    assert price_for(prices, MODEL, None, "free", T0 - us) is None
    assert price_for(prices, MODEL, None, "free", T0).id == 1  # in force from effective_from itself
    assert price_for(prices, MODEL, None, "free", t1 - us).id == 1
    assert price_for(prices, MODEL, None, "free", t1).id == 2  # the latest in its scope
    # the adapter's price applies only from its own effective_from, then beats the newer base price
    assert price_for(prices, MODEL, "ad_x", "free", t1 + timedelta(days=5) - us).id == 2
    assert price_for(prices, MODEL, "ad_x", "free", t1 + timedelta(days=5)).id == 3
    # an aware time in another zone is the same instant
    assert price_for(prices, MODEL, None, "free", t1.astimezone(timezone(timedelta(hours=-5)))).id == 2
    with pytest.raises(ValueError, match="timezone-aware"):
        price_for(prices, MODEL, None, "free", datetime(2026, 1, 20))


# --- the price book ---------------------------------------------------------------------------------
def test_price_book_validates_and_lists(database):
    book = PriceBook(database)
    with database.session() as session:
        session.add(Tenant(id="tn_a", name="acme"))
        session.flush()
        session.add(Adapter(id="ad_x", tenant_id="tn_a", name="legal"))
    p = book.set_price(MODEL, "0.15", Decimal("0.075"), "0.600", effective_from=T0)
    assert (p.input_per_mtok, p.cached_input_per_mtok, p.output_per_mtok) == (
        Decimal("0.15"), Decimal("0.075"), Decimal("0.6"))
    assert p.effective_from == T0 and p.adapter_id is None and p.tier is None
    book.set_price(MODEL, "1", "1", "1", adapter_id="ad_x", tier="premium",
                   effective_from=T0.astimezone(timezone(timedelta(hours=2))))  # same instant, other scope: fine
    now = book.set_price(MODEL, "0.2", "0.1", "0.8")
    assert now.effective_from.tzinfo is not None and abs(now.effective_from - datetime.now(timezone.utc)) < timedelta(
        minutes=1)
    book.set_price("other", "0", "0", "0", effective_from=T0)

    bad = [
        (dict(input_per_mtok=0.15), "float"),
        (dict(input_per_mtok="-0.01"), "negative"),
        (dict(output_per_mtok="ten"), "not a decimal"),
        (dict(output_per_mtok="NaN"), "finite"),
        (dict(cached_input_per_mtok="0.0000000000001"), "12 decimal places"),
        (dict(input_per_mtok="1e12"), "too large"),
        (dict(base_model="m" * 201), "longer than 200"),
        (dict(effective_from=datetime(2026, 2, 1)), "timezone-aware"),
        (dict(effective_from=T0), "already exists"),  # same scope (adapter and tier NULL) and time
        (dict(adapter_id="ad_missing"), "unknown adapter"),
        (dict(tier="gold"), "unknown tier"),
    ]
    for change, message in bad:
        kwargs = dict(input_per_mtok="1", cached_input_per_mtok="1", output_per_mtok="1", effective_from=T0
                      + timedelta(days=3))
        kwargs.update(change)
        with pytest.raises(PriceError, match=message):
            book.set_price(kwargs.pop("base_model", MODEL), **kwargs)
    with pytest.raises(PriceError, match="already exists"):
        book.set_price(MODEL, "2", "2", "2", adapter_id="ad_x", tier="premium", effective_from=T0)

    listed = book.list_prices(MODEL)
    assert [x.id for x in listed] == [p.id, listed[1].id, now.id] and listed[1].adapter_id == "ad_x"
    assert len(book.list_prices()) == 4
    assert listed[0] == p


# --- writing the ledger ------------------------------------------------------------------------------
def test_a_hundred_thousand_micro_charges_sum_to_exactly_ten_cents(database):
    """1 completion token at $1 per 1M tokens = $0.000001; 100,000 of them are exactly $0.1 (a float sum
    of the same charges is not)."""
    book = PriceBook(database)
    book.set_price(MODEL, "0", "0", "1", effective_from=T0)
    prices = book.list_prices()
    records = [record(i, tenant="tn_a" if i % 4 else "tn_b") for i in range(100_000)]
    total = (0, 0)
    for start in range(0, len(records), 25_000):
        inserted, duplicates = write_records(database, records[start:start + 25_000], prices)
        total = (total[0] + inserted, total[1] + duplicates)
    assert total == (100_000, 0)
    with database.session() as session:
        assert sum_money(session, LedgerEntry.cost) == Decimal("0.1")
        assert str(sum_money(session, LedgerEntry.cost)) == "0.100000000000"
        assert sum_money(session, LedgerEntry.cost, LedgerEntry.tenant_id == "tn_b") == Decimal("0.025")
        assert sum_money(session, LedgerEntry.cost, LedgerEntry.tenant_id == "tn_b",
                         LedgerEntry.request_id == "req-0") == Decimal("0.000001")
        assert str(sum_money(session, LedgerEntry.cost, LedgerEntry.tenant_id == "nobody")) == "0E-12"
    assert sum([0.000001] * 100_000) != 0.1


def test_a_price_change_mid_period_bills_each_request_at_its_own_price(database, tmp_path):
    book = PriceBook(database)
    change = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(minutes=5)
    old = book.set_price(MODEL, "0", "0", "1", effective_from=change - timedelta(days=30))
    us = timedelta(microseconds=1)
    write_records(database, [record("before", at=change - us, completion=10)])  # prices read from SQL
    new = book.set_price(MODEL, "0", "0", "3", effective_from=change)
    # written after the change: the record that ran before it keeps the old price
    assert write_records(database, [record("late", at=change - timedelta(hours=1), completion=10),
                                    record("at", at=change, completion=10),
                                    record("after", at=change + timedelta(minutes=1), completion=10)]) == (3, 0)

    writer = LedgerWriter(database, tmp_path / "spool.jsonl")
    writer.start()
    try:
        writer.submit(record("w-first", at=change + us, completion=1))
        assert writer.flush(10)  # the writer's price cache is now fresh (it reloads at most every second) ...
        newer = book.set_price(MODEL, "0", "0", "5", effective_from=change + timedelta(minutes=2))
        writer.submit(record("w-late", at=change + timedelta(minutes=1), completion=1))
        writer.submit(record("w-new", at=change + timedelta(minutes=3), completion=1))
        assert writer.flush(10)  # ... but a price set in this process is seen at once
    finally:
        writer.close()
    billed = {r.request_id: (r.price_id, r.output_per_mtok, r.cost) for r in ledger_rows(database)}
    assert billed == {
        "req-before": (old.id, Decimal("1"), Decimal("0.00001")),
        "req-late": (old.id, Decimal("1"), Decimal("0.00001")),
        "req-at": (new.id, Decimal("3"), Decimal("0.00003")),
        "req-after": (new.id, Decimal("3"), Decimal("0.00003")),
        "req-w-first": (new.id, Decimal("3"), Decimal("0.000003")),
        "req-w-late": (new.id, Decimal("3"), Decimal("0.000003")),
        "req-w-new": (newer.id, Decimal("5"), Decimal("0.000005")),
    }


def test_unpriced_requests_cost_zero_and_replays_write_nothing(database):
    records = [record(i, prompt=100, cached=10, completion=5) for i in range(20)]
    assert write_records(database, records) == (20, 0)  # no price at all: cost 0, price_id NULL
    assert write_records(database, records) == (0, 20)
    assert write_records(database, records[:5] + records[:5] + [record(99)]) == (1, 10)
    assert write_records(database, []) == (0, 0)
    rows = ledger_rows(database)
    assert len(rows) == 21 and len({r.request_id for r in rows}) == 21
    first = next(r for r in rows if r.request_id == "req-0")
    assert (first.price_id, first.cost, first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (
        None, Decimal(0), 100, 10, 5)
    assert first.created_at == T0 + timedelta(hours=1) and first.queue_ms == 1.5 and first.ttft_ms is None
    with pytest.raises(ValueError, match="cached_tokens"):
        write_records(database, [record(100, prompt=1, cached=2)])
    with pytest.raises(ValueError, match="timezone-aware"):
        write_records(database, [record(101, at=datetime(2026, 1, 1))])
    assert row_count(database) == 21


def test_parts_of_one_request_are_rows_of_their_own_each_written_once(database):
    """A fan-out bills each adapter on its own row under one request id: idempotent on (request_id, part)."""
    from dataclasses import replace

    parts = [replace(record("fan", completion=3 + p), part=p) for p in range(3)]
    composed = replace(record("mix"), composition=[{"adapter_id": "ad_1", "version": 1, "digest": "d1",
                                                    "weight": 0.7}])
    assert write_records(database, parts + [composed]) == (4, 0)
    assert write_records(database, parts + parts[:1]) == (0, 4)
    rows = [r for r in ledger_rows(database) if r.request_id == "req-fan"]
    assert sorted((r.part, r.completion_tokens) for r in rows) == [(0, 3), (1, 4), (2, 5)]
    mixed = next(r for r in ledger_rows(database) if r.request_id == "req-mix")
    assert (mixed.part, mixed.composition) == (0, composed.composition)
    with pytest.raises(ValueError, match="part must be an int"):
        write_records(database, [replace(record("bad"), part=-1)])
    with pytest.raises(ValueError, match="composition must be"):
        write_records(database, [replace(record("bad"), composition=[])])


def test_writer_from_many_threads_writes_each_request_exactly_once(database, tmp_path):
    PriceBook(database).set_price(MODEL, "0.15", "0.075", "0.6", effective_from=T0)
    records = [record(i, prompt=i * 7 % 900 + 50, cached=i % 50, completion=i % 300) for i in range(500)]
    writer = LedgerWriter(database, tmp_path / "spool.jsonl", batch_size=37)
    writer.start()
    barrier = threading.Barrier(5)

    def submit(part):
        barrier.wait()
        for r in part:
            writer.submit(r)

    threads = [threading.Thread(target=submit, args=(records[k::5],)) for k in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert writer.flush(30)
    for r in records[:50]:  # the same request ids again: no new rows
        writer.submit(r)
    writer.close()
    stats = writer.stats()
    assert (stats["written"], stats["duplicates"], stats["buffered"], stats["spooled"]) == (500, 50, 0, 0)
    assert row_count(database) == 500
    expected = sum((Decimal(r.prompt_tokens - r.cached_tokens) * Decimal("0.15") + r.cached_tokens * Decimal("0.075")
                    + r.completion_tokens * Decimal("0.6")) / 1_000_000 for r in records)
    with database.session() as session:
        assert sum_money(session, LedgerEntry.cost) == expected
    assert not (tmp_path / "spool.jsonl").read_bytes()


def test_close_with_rows_still_buffered_writes_them(database, tmp_path, monkeypatch):
    gate = threading.Event()
    real = ledger_module.write_records

    def gated(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(ledger_module, "write_records", gated)
    writer = LedgerWriter(database, tmp_path / "spool.jsonl", batch_size=7)
    writer.start()
    for i in range(100):
        writer.submit(record(i))
    assert writer.stats()["buffered"] == 100  # all still in memory: the first write waits at the gate
    gate.set()
    writer.close()
    assert row_count(database) == 100
    assert writer.stats()["buffered"] == 0 and not (tmp_path / "spool.jsonl").read_bytes()


def test_spool_replay_is_idempotent_and_keeps_unreadable_lines(database, tmp_path):
    spool = tmp_path / "spool.jsonl"
    written = [record(i) for i in range(5)]
    assert write_records(database, written) == (5, 0)
    lines = [json.dumps({**r.as_dict(), "created_at": r.created_at.isoformat()}) for r in written + [
        record(i) for i in range(5, 10)]]
    # committed rows still in the spool (a crash before truncation), a garbage line, a line cut short
    spool.write_text("\n".join(lines[:7] + ["not json"] + lines[7:]) + "\n" + lines[0][:20])
    writer = LedgerWriter(database, spool, batch_size=3)
    writer.submit(None)  # never raises: kept aside
    writer.submit(record("bad", prompt=1, cached=5))
    writer.start()
    assert writer.flush(10)
    stats = writer.stats()
    assert (stats["written"], stats["duplicates"], stats["rejected"], stats["spooled"]) == (5, 5, 4, 0)
    writer.close()
    assert sorted(r.request_id for r in ledger_rows(database)) == sorted(f"req-{i}" for i in range(10))
    assert spool.read_bytes() == b""
    rejected = [json.loads(line) for line in spool.with_name("spool.jsonl.rejected").read_text().splitlines()]
    assert len(rejected) == 4 and all(r["error"] for r in rejected)
    assert rejected[0]["record"] == "None" and rejected[1]["record"]["request_id"] == "req-bad"
    assert [r["line"] for r in rejected[2:]] == ["not json", lines[0][:20]]


# --- PostgreSQL really down: a TCP proxy between the writer and the server ------------------------------
@pytest.fixture
def pg(postgres_server_url):
    """(database through a FaultyProxy with a 1 s connect timeout, the proxy, a direct database)."""
    engine = create_engine(postgres_server_url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    direct = Database(postgres_server_url)
    direct.upgrade()
    target = make_url(postgres_server_url)
    proxy = FaultyProxy(target.host or "127.0.0.1", target.port or 5432)
    url = target.set(host="127.0.0.1", port=proxy.port, query={**target.query, "connect_timeout": "1"})
    through = Database(url.render_as_string(hide_password=False))
    yield through, proxy, direct
    proxy.close()
    through.dispose()
    direct.dispose()


@pytest.mark.parametrize("fault", ["refuse", "blackhole"])
def test_writer_keeps_records_while_the_database_is_down(pg, tmp_path, fault, caplog):
    caplog.set_level(logging.WARNING, logger="loramux.billing.ledger")
    db, proxy, direct = pg
    PriceBook(direct).set_price(MODEL, "0", "0", "1", effective_from=T0)
    writer = LedgerWriter(db, tmp_path / "spool.jsonl", retry_initial_s=0.05, retry_max_s=0.2)
    writer.start()
    try:
        for i in range(10):
            writer.submit(record(i))
        assert writer.flush(10)
        proxy.set_mode(fault)
        for i in range(10, 30):
            writer.submit(record(i))
        wait_until(lambda: writer.stats()["failures"] >= 2, "two failed SQL writes", 15)
        assert not writer.flush(0.2)
        stats = writer.stats()
        assert (stats["buffered"], stats["spooled"], stats["written"]) == (20, 0, 10)
        assert stats["last_error"] and len(stats["last_error"]) <= 200
        assert row_count(direct) == 10
        proxy.set_mode("pass")
        assert writer.flush(20)
        assert writer.stats()["buffered"] == 0
    finally:
        writer.close()
    rows = ledger_rows(direct)
    assert len(rows) == 30 and len({r.request_id for r in rows}) == 30
    messages = [r.getMessage() for r in caplog.records]
    assert sum("database write failed" in m for m in messages) == 1  # once per outage, not per retry
    assert sum("reachable again" in m for m in messages) == 1
    with direct.session() as session:
        assert sum_money(session, LedgerEntry.cost) == Decimal("0.00003")


def test_buffer_overflow_goes_to_the_spool_and_is_written_after_recovery(pg, tmp_path):
    db, proxy, direct = pg
    spool = tmp_path / "spool.jsonl"
    writer = LedgerWriter(db, spool, max_buffer=5, batch_size=3, retry_initial_s=0.05, retry_max_s=0.2)
    proxy.set_mode("refuse")
    writer.start()
    try:
        futures = [writer.submit(record(i)) for i in range(20)]
        stats = writer.stats()
        assert (stats["buffered"], stats["spooled"]) == (5, 15)  # memory stays bounded
        assert all(f.result(10) for f in futures)  # each one fsync'd in the write-ahead log, which holds
        assert [json.loads(line)["request_id"] for line in spool.read_text().splitlines()] == [
            f"req-{i}" for i in range(20)]  # every record (the old spool held only the 15 past the buffer)
        wait_until(lambda: writer.stats()["failures"] >= 1, "a failed SQL write", 15)
        assert row_count(direct) == 0
        proxy.set_mode("pass")
        assert writer.flush(20)
        stats = writer.stats()
        assert (stats["written"], stats["buffered"], stats["spooled"]) == (20, 0, 0)
        assert spool.read_bytes() == b""  # truncated once its rows were committed
    finally:
        writer.close()
    assert sorted(r.request_id for r in ledger_rows(direct)) == sorted(f"req-{i}" for i in range(20))


def test_close_with_the_database_down_spools_and_the_next_start_writes(pg, tmp_path):
    db, proxy, direct = pg
    spool = tmp_path / "spool.jsonl"
    first = LedgerWriter(db, spool, max_buffer=4, retry_initial_s=0.05, retry_max_s=0.2)
    first.start()
    first.submit(record(0))
    assert first.flush(10)
    proxy.set_mode("refuse")
    for i in range(1, 11):
        first.submit(record(i))
    first.close(timeout=0.3)
    assert (first.stats()["buffered"], first.stats()["spooled"]) == (0, 10)
    spooled = sorted(json.loads(line)["request_id"] for line in spool.read_text().splitlines())
    assert spooled == sorted(f"req-{i}" for i in range(1, 11))
    first.submit(record(11))  # after close: straight to the spool
    assert len(spool.read_text().splitlines()) == 11

    second = LedgerWriter(db, spool, retry_initial_s=0.05, retry_max_s=0.2)
    second.start()
    try:
        second.submit(record(0))  # already written: a duplicate, not a second row
        wait_until(lambda: second.stats()["failures"] >= 1, "a failed SQL write", 15)
        assert row_count(direct) == 1 and second.stats()["spooled"] == 11
        proxy.set_mode("pass")
        assert second.flush(20)
        stats = second.stats()
        assert (stats["written"], stats["duplicates"], stats["spooled"]) == (11, 1, 0)
    finally:
        second.close()
    assert sorted(r.request_id for r in ledger_rows(direct)) == sorted(f"req-{i}" for i in range(12))
    assert spool.read_bytes() == b""


def test_a_row_the_database_refuses_does_not_block_the_others(pg, tmp_path, monkeypatch):
    _, _, direct = pg
    monkeypatch.setattr(ledger_module, "check_record", lambda record: None)  # let a bad row reach PostgreSQL
    writer = LedgerWriter(direct, tmp_path / "spool.jsonl", retry_initial_s=0.05, retry_max_s=0.2)
    writer.start()
    try:
        for i in range(5):
            writer.submit(record(i))
        writer.submit(record("x" * 100))  # longer than the request_id column
        assert writer.flush(20)
        stats = writer.stats()
        assert (stats["written"], stats["rejected"]) == (5, 1)
    finally:
        writer.close()
    assert row_count(direct) == 5
    rejected = json.loads((tmp_path / "spool.jsonl.rejected").read_text())
    assert rejected["record"]["request_id"] == "req-" + "x" * 100 and "DataError" in rejected["error"]
