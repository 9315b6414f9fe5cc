"""Billing summary and streamed export (loramux.billing.reports), on SQLite and PostgreSQL."""
from __future__ import annotations

import csv
import io
import json
import re
import tracemalloc
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loramux.billing.reports import (
    COLUMN_NAMES,
    FORMATS,
    BillingQueryError,
    Period,
    content_type,
    export,
    parse_period,
    summary,
    summary_to_json,
)
from loramux.db import LedgerEntry

UTC = timezone.utc
DAY0 = datetime(2026, 11, 1, tzinfo=UTC)
BIG = Decimal("123456789012.123456789012")  # 24 significant digits: a float sum would lose the tail
MONEY_COLUMNS = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "cost")


def at(day: int, hours: float = 0, us: int = 0) -> datetime:
    return DAY0 + timedelta(days=day, hours=hours, microseconds=us)


def entry(n: int, tenant: str, adapter: str | None, outcome: str, created_at: datetime, cost: str,
          prompt: int = 100, cached: int = 0, completion: int = 10) -> dict:
    return {
        "request_id": f"req-{n:06d}", "tenant_id": tenant, "key_id": f"key_{tenant}", "model":
        adapter or "base-model", "adapter_id": adapter, "adapter_version": 1 if adapter else None,
        "tier": "standard", "outcome": outcome, "fallback": n % 7 == 0, "prompt_tokens": prompt,
        "cached_tokens": cached, "completion_tokens": completion, "queue_ms": None if n % 3 else 1.5,
        "ttft_ms": 12.25, "total_ms": 250.0 + n, "price_id": None if n % 5 == 0 else 1,
        "input_per_mtok": Decimal("0.150000000001"), "cached_input_per_mtok": Decimal("0.075"),
        "output_per_mtok": Decimal("0.6"), "cost": Decimal(cost), "created_at": created_at,
        "composition": COMPOSITION if n == 2 else None}


COMPOSITION = [{"adapter_id": "ad_1", "version": 1, "digest": "d1", "weight": 0.7},
               {"adapter_id": "ad_2", "version": 3, "digest": "d2", "weight": 0.3}]


ROWS = [
    entry(1, "tn_a", "ad_1", "stop", at(0, 10), "0.000123456789", 120, 20, 30),
    entry(2, "tn_a", "ad_1", "length", at(1, 5), str(BIG), 4000, 0, 512),
    entry(3, "tn_a", None, "stop", at(2, 1), "0.000000000001", 7, 0, 1),
    entry(4, "tn_a", "ad_2", "error", at(3, 12), "0", 50, 0, 0),
    entry(5, "tn_b", "ad_3", "stop", at(0, 23, 3_599_999_999), "1.111111111111", 10, 5, 3),  # 1 µs before day 1
    entry(6, "tn_b", None, "cancelled", at(1), "2.5", 200, 100, 0),  # exactly day 1, 00:00
    entry(7, "tn_b", "ad_3", "stop", at(4), "0.333333333333", 30, 0, 30),  # exactly day 4, 00:00
    entry(8, "tn_c", None, "timeout", at(5, 2), "99999.999999999999", 1, 0, 1),
    entry(9, "tn_b", "ad_3", "stop", at(2, 1), "0.000000000002", 1, 1, 1),  # same instant as row 3
    entry(10, "tn_a", "ad_1", "stop", at(6), "0.999999999999", 3, 0, 3),
]


def insert_rows(db, rows: list[dict]) -> None:
    with db.session() as session:  # Core executemany: much faster than an ORM bulk insert on PostgreSQL
        session.execute(LedgerEntry.__table__.insert(), rows)


def expected_totals(rows: list[dict]) -> dict[str, dict]:
    """Per-tenant counters computed here from the inserted rows."""
    out: dict[str, dict] = {}
    for r in rows:
        t = out.setdefault(r["tenant_id"], {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                                            "completion_tokens": 0, "cost": Decimal(0)})
        t["requests"] += 1
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            t[name] += r[name]
        t["cost"] += r["cost"]
    return out


def in_period(rows, start=None, end=None, tenant=None):
    return [r for r in rows if (start is None or r["created_at"] >= start) and (end is None or r["created_at"] < end)
            and (tenant is None or r["tenant_id"] == tenant)]


def tenant_lines(s: dict) -> dict[str, dict]:
    return {line["tenant_id"]: {k: v for k, v in line.items() if k != "tenant_id"} for line in s["tenants"]}


def read_back(fmt: str, chunks: list[bytes]) -> list[dict]:
    """Parse an export into dicts with the original Python types (Decimal money, aware datetimes)."""
    data = b"".join(chunks)
    if fmt == "parquet":
        return pq.read_table(io.BytesIO(data)).to_pylist()
    if fmt == "jsonl":
        records = [json.loads(line) for line in data.decode().splitlines()]
    else:
        records = list(csv.DictReader(io.StringIO(data.decode(), newline="")))
        for r in records:
            for k in ("prompt_tokens", "cached_tokens", "completion_tokens", "id"):
                r[k] = int(r[k])
    for r in records:
        for k in MONEY_COLUMNS:
            assert re.fullmatch(r"-?\d+\.\d{12}", r[k]), (k, r[k])
            r[k] = Decimal(r[k])
        r["created_at"] = datetime.fromisoformat(r["created_at"])
    return records


def totals_of(records: list[dict]) -> dict[str, dict]:
    return expected_totals(records)


# --- summary ----------------------------------------------------------------------------------------

def test_summary_totals_by_tenant_and_adapter_are_exact(database):
    insert_rows(database, ROWS)
    s = summary(database)

    assert s["currency"] == "USD" and s["period"] == {"start": None, "end": None} and s["tenant_id"] is None
    total_cost = Decimal("123456889017.068024690246")
    assert s["total"] == {"requests": 10, "prompt_tokens": 4422, "cached_tokens": 126, "completion_tokens": 581,
                          "cost": total_cost}
    assert all(type(x["cost"]) is Decimal for x in [s["total"], *s["tenants"], *s["adapters"]])
    assert tenant_lines(s) == expected_totals(ROWS)
    assert tenant_lines(s)["tn_a"]["cost"] == Decimal("123456789013.123580245801")
    assert sum((line["cost"] for line in s["tenants"]), Decimal(0)) == total_cost

    adapters = [(a["tenant_id"], a["adapter_id"], a["requests"], a["cost"]) for a in s["adapters"]]
    assert adapters == [  # tenant, then base model (None) first, then adapter id
        ("tn_a", None, 1, Decimal("0.000000000001")),
        ("tn_a", "ad_1", 3, Decimal("123456789013.123580245800")),
        ("tn_a", "ad_2", 1, Decimal("0")),
        ("tn_b", None, 1, Decimal("2.5")),
        ("tn_b", "ad_3", 3, Decimal("1.444444444446")),
        ("tn_c", None, 1, Decimal("99999.999999999999")),
    ]
    assert s["outcomes"] == {"cancelled": 1, "error": 1, "length": 1, "stop": 6, "timeout": 1}
    assert list(s["outcomes"]) == sorted(s["outcomes"])

    as_json = json.loads(json.dumps(summary_to_json(s)))
    assert as_json["total"]["cost"] == "123456889017.068024690246"
    assert as_json["adapters"][2]["cost"] == "0.000000000000"


def test_summary_tenant_filter(database):
    insert_rows(database, ROWS)
    everything = tenant_lines(summary(database))
    s = summary(database, tenant_id="tn_b")
    assert s["tenant_id"] == "tn_b"
    assert [line["tenant_id"] for line in s["tenants"]] == ["tn_b"]
    assert {a["tenant_id"] for a in s["adapters"]} == {"tn_b"}
    assert {k: v for k, v in s["total"].items()} == everything["tn_b"]
    assert s["outcomes"] == {"cancelled": 1, "stop": 3}

    nobody = summary(database, tenant_id="tn_nobody")
    assert nobody["total"] == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0,
                               "cost": Decimal(0)}
    assert nobody["tenants"] == [] and nobody["adapters"] == [] and nobody["outcomes"] == {}


def test_period_start_inclusive_end_exclusive(database):
    insert_rows(database, ROWS)
    period = Period(at(1), at(4))  # row 6 sits on the start (in), row 7 on the end (out), row 5 1 µs before (out)
    s = summary(database, period=period)
    assert s["period"] == {"start": "2026-11-02T00:00:00.000000+00:00", "end": "2026-11-05T00:00:00.000000+00:00"}
    assert tenant_lines(s) == expected_totals(in_period(ROWS, at(1), at(4)))
    assert s["total"]["requests"] == 5
    ids = [r["request_id"] for r in read_back("jsonl", list(export(database, "jsonl", period=period)))]
    assert ids == ["req-000006", "req-000002", "req-000003", "req-000009", "req-000004"]  # (created_at, id)

    # The same instants in another zone, or as query strings, select the same rows.
    plus2 = timezone(timedelta(hours=2))
    assert summary(database, period=Period(at(1).astimezone(plus2), at(4).astimezone(plus2)))["total"] == s["total"]
    assert summary(database, period=parse_period("2026-11-02", "2026-11-05T02:00:00+02:00"))["total"] == s["total"]

    open_end = summary(database, period=Period(at(4), None))
    assert open_end["total"]["requests"] == 3 and open_end["period"]["end"] is None
    open_start = summary(database, tenant_id="tn_b", period=Period(None, at(1)))
    assert open_start["total"]["requests"] == 1 and open_start["total"]["cost"] == Decimal("1.111111111111")


# --- export -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_export_parses_back_to_the_summary(database, fmt):
    insert_rows(database, ROWS)
    for tenant, period in [(None, Period()), ("tn_a", Period()), (None, Period(at(1), at(4))),
                           ("tn_b", Period(at(0, 12), at(7)))]:
        s = summary(database, tenant_id=tenant, period=period)
        records = read_back(fmt, list(export(database, fmt, tenant_id=tenant, period=period)))
        assert len(records) == s["total"]["requests"]
        assert totals_of(records) == tenant_lines(s)
        assert [(r["created_at"], r["id"]) for r in records] == sorted((r["created_at"], r["id"]) for r in records)

    records = read_back(fmt, list(export(database, fmt)))
    assert list(records[0]) == list(COLUMN_NAMES)
    by_request = {r["request_id"]: r for r in records}
    for row in ROWS:  # every column comes back as written
        got = by_request[row["request_id"]]
        assert got["created_at"] == row["created_at"] and got["created_at"].utcoffset() == timedelta(0)
        assert got["cost"] == row["cost"] and got["input_per_mtok"] == Decimal("0.150000000001")
        if fmt == "csv":
            assert got["adapter_id"] == (row["adapter_id"] or "")
            assert got["fallback"] == ("true" if row["fallback"] else "false")
            assert got["queue_ms"] == ("" if row["queue_ms"] is None else repr(row["queue_ms"]))
        else:
            for k in ("adapter_id", "adapter_version", "fallback", "queue_ms", "ttft_ms", "total_ms", "price_id"):
                assert got[k] == row[k], k
        # A composition is the JSON value in JSON lines, compact JSON text in CSV and Parquet.
        composition = got["composition"] if fmt == "jsonl" else json.loads(got["composition"] or "null")
        assert composition == row["composition"]
    if fmt == "parquet":
        schema = pq.read_schema(io.BytesIO(b"".join(export(database, fmt))))
        for k in MONEY_COLUMNS:
            assert schema.field(k).type == pa.decimal128(30, 12)
        assert schema.field("created_at").type == pa.timestamp("us", tz="UTC")
        assert schema.field("id").type == pa.int64() and schema.field("fallback").type == pa.bool_()
        assert schema.field("adapter_id").nullable and not schema.field("tenant_id").nullable


def test_export_streams_in_batches_with_modest_memory(database):
    n = 12_000
    tenants = ["tn_a", "tn_b", "tn_c"]
    rows = [entry(i, tenants[i % 3], None if i % 4 == 0 else f"ad_{i % 5}", "stop", at(0, us=i * 37_000),
                  f"{i % 997}.{(i * 7919) % 10**12:012d}", prompt=i % 300, cached=i % 11, completion=i % 50)
            for i in range(n)]
    insert_rows(database, rows)
    s = summary(database)
    assert tenant_lines(s) == expected_totals(rows)

    for fmt in FORMATS:
        chunks = list(export(database, fmt, batch_size=5000))
        assert len(chunks) >= 3, (fmt, len(chunks))  # at least one chunk per batch of 5000
        assert max(map(len, chunks)) < 0.6 * sum(map(len, chunks))
        records = read_back(fmt, chunks)
        assert len(records) == n and totals_of(records) == tenant_lines(s)
    assert pq.ParquetFile(io.BytesIO(b"".join(chunks))).num_row_groups == 3  # one row group per batch

    # Nothing is read before the first chunk is asked for; stopping early gives the connection back.
    stream = export(database, "csv", batch_size=1000)
    assert database.engine.pool.checkedout() == 0
    next(stream)
    next(stream)
    assert database.engine.pool.checkedout() == 1
    stream.close()
    assert database.engine.pool.checkedout() == 0

    first_4000 = Period(None, rows[4000]["created_at"])  # tracemalloc is slow: measure on a third of the rows

    def peak(batch_size: int) -> int:
        tracemalloc.start()
        try:
            for _chunk in export(database, "jsonl", period=first_4000, batch_size=batch_size):
                pass
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, whole = peak(250), peak(4000)
    assert small < whole / 4, (small, whole)  # memory follows the batch, not the ledger
    assert small < 4 * 2**20


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_export(database, fmt):
    insert_rows(database, ROWS)
    chunks = list(export(database, fmt, period=Period(at(30), at(31))))
    data = b"".join(chunks)
    if fmt == "csv":
        assert data.decode().splitlines() == [",".join(COLUMN_NAMES)]
    elif fmt == "jsonl":
        assert data == b""
    else:
        table = pq.read_table(io.BytesIO(data))
        assert table.num_rows == 0 and table.schema.names == list(COLUMN_NAMES)
        assert table.schema.field("cost").type == pa.decimal128(30, 12)
    empty = summary(database, period=Period(at(30), at(31)))
    assert empty["total"]["requests"] == 0 and empty["tenants"] == []


# --- inputs (no database) ---------------------------------------------------------------------------

def test_parse_period_accepts_iso_8601():
    assert parse_period(None, None) == Period(None, None)
    assert parse_period("", "  ") == Period()
    p = parse_period("2026-11-30", "2026-12-01T12:30:00Z")
    assert p.start == datetime(2026, 11, 30, tzinfo=UTC) and p.end == datetime(2026, 12, 1, 12, 30, tzinfo=UTC)
    assert parse_period("2026-11-30T10:00:00", None).start == datetime(2026, 11, 30, 10, tzinfo=UTC)  # naive = UTC
    p = parse_period("2026-11-30T10:00:00+02:00", "2026-11-30T10:00:00.5-01:00")
    assert p.start == datetime(2026, 11, 30, 8, tzinfo=UTC) and p.start.tzinfo is UTC
    assert p.end == datetime(2026, 11, 30, 11, 0, 0, 500_000, tzinfo=UTC)
    assert Period(datetime(2026, 1, 1, 3, tzinfo=timezone(timedelta(hours=3))), None).start == datetime(2026, 1, 1,
                                                                                                          tzinfo=UTC)


@pytest.mark.parametrize(("start", "end", "message"), [
    ("yesterday", None, "start 'yesterday' is not an ISO 8601"),
    (None, "2026-02-30", "end '2026-02-30' is not an ISO 8601"),
    ("2026-11-30T25:00", None, "start '2026-11-30T25:00' is not an ISO 8601"),
    ("2026-12-01", "2026-11-01", "must be before its end"),
    ("2026-12-01", "2026-12-01T00:00:00Z", "must be before its end"),
    ("2" * 100, None, "too long"),
])
def test_parse_period_errors(start, end, message):
    with pytest.raises(BillingQueryError, match=re.escape(message)):
        parse_period(start, end)


def test_bad_queries_raise_clear_errors():
    with pytest.raises(BillingQueryError, match="has no time zone"):
        Period(datetime(2026, 11, 1), None)
    with pytest.raises(BillingQueryError, match="end .* has no time zone"):
        Period(None, datetime(2026, 11, 1))
    with pytest.raises(BillingQueryError, match="must be a datetime, got date"):
        Period(date(2026, 11, 1), None)
    with pytest.raises(BillingQueryError, match="must be before its end"):
        Period(at(2), at(1))
    assert issubclass(BillingQueryError, ValueError)

    db = object()  # checked before the database is touched
    with pytest.raises(BillingQueryError, match=r"unknown export format 'xlsx'; choose one of csv, jsonl, parquet"):
        export(db, "xlsx")
    with pytest.raises(BillingQueryError, match="batch_size must be a positive integer"):
        export(db, "csv", batch_size=0)
    with pytest.raises(BillingQueryError, match="period must be a Period"):
        export(db, "csv", period=("2026-11-01", None))
    with pytest.raises(BillingQueryError, match="period must be a Period"):
        summary(db, period=None)
    with pytest.raises(BillingQueryError, match="unknown export format"):
        content_type("xml")
    assert content_type("csv").startswith("text/csv")
    assert content_type("jsonl") == "application/x-ndjson"
    assert content_type("parquet") == "application/vnd.apache.parquet"


def test_csv_export_neutralises_formula_cells_in_text_columns_only(database):
    """CSV injection: a text cell a spreadsheet would run as a formula gets a leading quote; numbers, money
    and times are written as they are, and JSON Lines / Parquet carry the raw values."""
    hostile = {**entry(1, "=cmd|'/C calc'!A0", "@SUM(A1:A9)", "stop", at(0, 1), "0.5"),
               "key_id": "+1+1", "model": "-2+3", "tier": "\tstandard", "request_id": "\r=1"}
    plain = entry(2, "tn_a", "ad_1", "stop", at(0, 2), "0.25")
    insert_rows(database, [hostile, plain])
    data = b"".join(export(database, "csv")).decode()
    records = list(csv.DictReader(io.StringIO(data, newline="")))
    got = {r["cost"]: r for r in records}
    evil = got["0.500000000000"]
    assert (evil["tenant_id"], evil["adapter_id"], evil["key_id"], evil["model"], evil["tier"], evil["request_id"]) \
        == ("'=cmd|'/C calc'!A0", "'@SUM(A1:A9)", "'+1+1", "'-2+3", "'\tstandard", "'\r=1")
    for r in records:  # no cell of the export starts a formula
        assert not any(v.startswith(("=", "+", "-", "@", "\t", "\r")) for v in r.values()), r
    ok = got["0.250000000000"]
    assert (ok["tenant_id"], ok["adapter_id"], ok["model"]) == ("tn_a", "ad_1", "ad_1")
    assert ok["prompt_tokens"] == "100" and ok["total_ms"] == "252.0"
    assert datetime.fromisoformat(ok["created_at"]) == at(0, 2)
    raw = {json.loads(line)["cost"]: json.loads(line) for line in b"".join(export(database, "jsonl")).splitlines()}
    assert raw["0.500000000000"]["tenant_id"] == "=cmd|'/C calc'!A0"  # other formats keep the exact value
