"""Billing over the cost ledger: a summary (totals by tenant, adapter and outcome) and a streamed export
of the ledger rows as CSV, JSON Lines or Parquet.

Periods are half-open UTC intervals on `LedgerEntry.created_at` (when the request arrived): start
inclusive, end exclusive, either side open when None. Money stays `Decimal` end to end: the summary sums
with SQL `SUM` on PostgreSQL (NUMERIC is exact) and with `Decimal` arithmetic over streamed rows on SQLite
(where money is decimal text and SQL `SUM` would go through a float). The export never holds the whole
ledger: rows are read `batch_size` at a time, ordered by (created_at, id), and each batch becomes one chunk
(one row group in Parquet).

Functions here are free of HTTP types; an admin route maps `BillingQueryError` to 400, streams `export`
with `content_type(fmt)` and serialises the summary with `summary_to_json` (money as strings).
"""
from __future__ import annotations

import csv
import decimal
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timezone
from decimal import Decimal

from sqlalchemy import JSON, Boolean, Float, Integer, String, Text, func, select
from sqlalchemy.sql.elements import ColumnElement

from loramux.db import Database, LedgerEntry
from loramux.db.models import Money, UTCDateTime

FORMATS = ("csv", "jsonl", "parquet")
CURRENCY = "USD"
COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost")

_CONTENT_TYPES = {"csv": "text/csv; charset=utf-8", "jsonl": "application/x-ndjson",
                  "parquet": "application/vnd.apache.parquet"}
_MONEY_SCALE = Money.SCALE  # 12 decimals, as stored
_MONEY_PRECISION, _MONEY_DECIMALS = 30, 12
# Sums of NUMERIC(30, 12) values can pass the default 28 significant digits; add with room to spare.
_SUM_CONTEXT = decimal.Context(prec=80, rounding=decimal.ROUND_HALF_EVEN, traps=[decimal.InvalidOperation])


class BillingQueryError(ValueError):
    """A billing query that cannot be answered as asked (bad period, format or batch size)."""


def _utc(name: str, value: datetime | None) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise BillingQueryError(f"period {name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise BillingQueryError(f"period {name} {value.isoformat()} has no time zone; give a UTC-aware datetime")
    return value.astimezone(timezone.utc)


@dataclass(frozen=True)
class Period:
    """[start, end) in UTC on the ledger's `created_at`; None leaves that side open. Aware datetimes in
    any zone are accepted and normalised to UTC; naive ones are refused."""

    start: datetime | None = None
    end: datetime | None = None

    def __post_init__(self):
        start, end = _utc("start", self.start), _utc("end", self.end)
        if start is not None and end is not None and start >= end:
            raise BillingQueryError(f"period start {_iso(start)} must be before its end {_iso(end)} "
                                    "(the end is exclusive)")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)

    def as_dict(self) -> dict:
        return {"start": _iso(self.start), "end": _iso(self.end)}


def _iso(value: datetime | None) -> str | None:
    """ISO 8601 in UTC with microseconds, e.g. 2026-11-30T12:00:00.000000+00:00 (fixed width, so the
    strings sort like the times)."""
    if value is None:
        return None
    return value.astimezone(timezone.utc).isoformat(timespec="microseconds")


def _parse_instant(name: str, text: str | None) -> datetime | None:
    if text is None or not text.strip():
        return None
    raw = text.strip()
    if len(raw) > 64:
        raise BillingQueryError(f"{name} is too long to be an ISO 8601 date or date-time")
    value = raw[:-1] + "+00:00" if raw[-1:] in ("Z", "z") else raw  # Python 3.10 fromisoformat has no 'Z'
    try:
        if len(value) == 10:  # a date alone: midnight UTC
            parsed = datetime.combine(date.fromisoformat(value), datetime.min.time())
        else:
            parsed = datetime.fromisoformat(value)
    except ValueError:
        raise BillingQueryError(f"{name} {raw!r} is not an ISO 8601 date or date-time "
                                "(e.g. 2026-11-30, 2026-11-30T12:00:00Z or 2026-11-30T12:00:00+01:00)") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed


def parse_period(start: str | None, end: str | None) -> Period:
    """A period from ISO 8601 strings (query parameters): a date alone is midnight UTC, times without an
    offset are UTC, 'Z' is allowed; None or blank leaves that side open. The end is exclusive, so
    `parse_period("2026-11-01", "2026-12-01")` is all of November."""
    return Period(_parse_instant("start", start), _parse_instant("end", end))


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise BillingQueryError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return fmt


def content_type(fmt: str) -> str:
    """The HTTP media type of an export format."""
    return _CONTENT_TYPES[_check_format(fmt)]


def _check_query(tenant_id, period) -> None:
    if tenant_id is not None and not isinstance(tenant_id, str):
        raise BillingQueryError(f"tenant_id must be a string, got {type(tenant_id).__name__}")
    if not isinstance(period, Period):
        raise BillingQueryError(f"period must be a Period, got {type(period).__name__}")


def _where(tenant_id: str | None, period: Period) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if tenant_id is not None:
        where.append(LedgerEntry.tenant_id == tenant_id)
    if period.start is not None:
        where.append(LedgerEntry.created_at >= period.start)
    if period.end is not None:
        where.append(LedgerEntry.created_at < period.end)
    return where


# --- summary ----------------------------------------------------------------------------------------

def _zero() -> dict:
    return {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "cost": Decimal(0)}


def _add(into: dict, requests: int, prompt: int, cached: int, completion: int, cost: Decimal) -> None:
    into["requests"] += int(requests)
    into["prompt_tokens"] += int(prompt or 0)
    into["cached_tokens"] += int(cached or 0)
    into["completion_tokens"] += int(completion or 0)
    into["cost"] = _SUM_CONTEXT.add(into["cost"], cost if cost is not None else Decimal(0))


def _grouped(db: Database, where: list) -> dict[tuple[str, str | None, str], dict]:
    """Counters per (tenant_id, adapter_id, outcome): the finest grouping, rolled up by `summary`."""
    e = LedgerEntry
    groups: dict[tuple[str, str | None, str], dict] = {}
    with db.session() as session:
        if not db.is_sqlite:  # NUMERIC: SQL SUM is exact
            stmt = (select(e.tenant_id, e.adapter_id, e.outcome, func.count(), func.sum(e.prompt_tokens),
                           func.sum(e.cached_tokens), func.sum(e.completion_tokens), func.sum(e.cost))
                    .where(*where).group_by(e.tenant_id, e.adapter_id, e.outcome))
            for tenant, adapter, outcome, *counters in session.execute(stmt):
                _add(groups.setdefault((tenant, adapter, outcome), _zero()), *counters)
            return groups
        # SQLite keeps money as decimal text: stream the rows and add them up as Decimals.
        stmt = (select(e.tenant_id, e.adapter_id, e.outcome, e.prompt_tokens, e.cached_tokens, e.completion_tokens,
                       e.cost).where(*where).execution_options(yield_per=5000))
        for tenant, adapter, outcome, prompt, cached, completion, cost in session.execute(stmt):
            _add(groups.setdefault((tenant, adapter, outcome), _zero()), 1, prompt, cached, completion, cost)
    return groups


def _quantized(counters: dict) -> dict:
    return {**counters, "cost": counters["cost"].quantize(_MONEY_SCALE, context=_SUM_CONTEXT)}


def summary(db: Database, tenant_id: str | None = None, period: Period = Period()) -> dict:
    """Totals of the ledger over a period, optionally for one tenant:

    `{"period": {"start", "end"}, "tenant_id", "currency": "USD", "total": {counters},
      "tenants": [{"tenant_id", counters}], "adapters": [{"tenant_id", "adapter_id", counters}],
      "outcomes": {outcome: requests}}`

    with counters `requests, prompt_tokens, cached_tokens, completion_tokens, cost` (cost an exact
    `Decimal` with 12 decimals). Tenants sort by id; adapters by tenant then adapter id, the base model
    (adapter_id None) first; outcomes by name."""
    _check_query(tenant_id, period)
    groups = _grouped(db, _where(tenant_id, period))
    total = _zero()
    tenants: dict[str, dict] = {}
    adapters: dict[tuple[str, str | None], dict] = {}
    outcomes: dict[str, int] = {}
    for (tenant, adapter, outcome), counters in groups.items():
        values = [counters[name] for name in COUNTERS]
        _add(total, *values)
        _add(tenants.setdefault(tenant, _zero()), *values)
        _add(adapters.setdefault((tenant, adapter), _zero()), *values)
        outcomes[outcome] = outcomes.get(outcome, 0) + counters["requests"]
    return {
        "period": period.as_dict(),
        "tenant_id": tenant_id,
        "currency": CURRENCY,
        "total": _quantized(total),
        "tenants": [{"tenant_id": t, **_quantized(c)} for t, c in sorted(tenants.items())],
        "adapters": [{"tenant_id": t, "adapter_id": a, **_quantized(c)}
                     for (t, a), c in sorted(adapters.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None,
                                                                                kv[0][1] or ""))],
        "outcomes": dict(sorted(outcomes.items())),
    }


def summary_to_json(value):
    """A summary (or any part of it) with every Decimal as a plain decimal string, ready for JSON
    (FastAPI's default encoder would turn Decimals into floats)."""
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, dict):
        return {k: summary_to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [summary_to_json(v) for v in value]
    return value


# --- export -----------------------------------------------------------------------------------------

_COLUMNS = list(LedgerEntry.__table__.columns)
COLUMN_NAMES = tuple(c.name for c in _COLUMNS)


def _money_text(value: Decimal) -> str:
    return format(value.quantize(_MONEY_SCALE, context=_SUM_CONTEXT), "f")


def _kind(column) -> str:
    t = column.type
    for kind, types in (("money", (Money,)), ("time", (UTCDateTime,)), ("bool", (Boolean,)),
                        ("float", (Float,)), ("int", (Integer,)), ("str", (String, Text)), ("json", (JSON,))):
        if isinstance(t, types):
            return kind
    raise TypeError(f"billing export does not know how to write ledger column {column.name} ({t!r})")


_KINDS = [_kind(c) for c in _COLUMNS]  # at import: a new ledger column of an unknown type fails loudly

# A JSON column (a composition) is compact JSON text in CSV and Parquet, the value itself in JSON lines.
_TEXT: dict[str, Callable] = {"money": _money_text, "time": _iso, "bool": lambda v: "true" if v else "false",
                              "float": lambda v: v, "int": lambda v: v, "str": lambda v: v,
                              "json": lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True)}
_JSON: dict[str, Callable] = {**_TEXT, "bool": bool, "json": lambda v: v}


def _arrow_schema():
    import pyarrow as pa

    types = {"money": pa.decimal128(_MONEY_PRECISION, _MONEY_DECIMALS), "time": pa.timestamp("us", tz="UTC"),
             "bool": pa.bool_(), "float": pa.float64(), "int": pa.int64(), "str": pa.string(),
             "json": pa.string()}
    return pa.schema([pa.field(c.name, types[k], nullable=bool(c.nullable)) for c, k in zip(_COLUMNS, _KINDS)])


def _batches(db: Database, where: list, batch_size: int) -> Iterator[list]:
    """Ledger rows (all columns, table order) in lists of at most batch_size, by (created_at, id). On
    PostgreSQL `yield_per` reads through a server-side cursor; SQLite steps its cursor lazily."""
    e = LedgerEntry
    stmt = (select(*_COLUMNS).where(*where).order_by(e.created_at, e.id)
            .execution_options(yield_per=batch_size))
    with db.session() as session, session.execute(stmt) as result:
        yield from result.partitions()


def _convert(rows: list, converters: list[Callable]) -> Iterator[list]:
    for row in rows:
        yield [None if v is None else f(v) for f, v in zip(converters, row)]


# A spreadsheet runs a cell that starts with one of these as a formula (CSV injection): text cells that do
# get a leading single quote, which spreadsheets show as text. Numbers, money and times are never touched.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_text(value: str) -> str:
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def _csv(batches: Iterator[list]) -> Iterator[bytes]:
    converters = [_csv_text if k == "str" else _TEXT[k] for k in _KINDS]

    def encode(rows) -> bytes:
        buffer = io.StringIO()
        csv.writer(buffer).writerows(rows)
        return buffer.getvalue().encode("utf-8")

    yield encode([COLUMN_NAMES])
    for rows in batches:
        yield encode(_convert(rows, converters))


def _jsonl(batches: Iterator[list]) -> Iterator[bytes]:
    converters = [_JSON[k] for k in _KINDS]
    for rows in batches:
        lines = (json.dumps(dict(zip(COLUMN_NAMES, values)), separators=(",", ":"))
                 for values in _convert(rows, converters))
        yield ("\n".join(lines) + "\n").encode("utf-8")


class _Sink:
    """A write-only file for pyarrow that hands back what was written since the last drain; `tell` keeps
    counting, so the offsets in the Parquet footer stay right."""

    def __init__(self):
        self._buffer = bytearray()
        self._position = 0
        self.closed = False

    def write(self, data) -> int:
        data = memoryview(data)
        self._buffer += data
        self._position += data.nbytes
        return data.nbytes

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

    def drain(self) -> bytes:
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


def _parquet(batches: Iterator[list]) -> Iterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _arrow_schema()
    sink = _Sink()
    writer = pq.ParquetWriter(sink, schema)
    try:
        for rows in batches:
            columns = [col if kind != "json" else [None if v is None else _TEXT["json"](v) for v in col]
                       for col, kind in zip(zip(*rows), _KINDS)]
            table = pa.Table.from_arrays([pa.array(col, type=field.type) for col, field in zip(columns, schema)],
                                         schema=schema)
            writer.write_table(table, row_group_size=max(1, len(rows)))  # one batch, one row group
            chunk = sink.drain()
            if chunk:
                yield chunk
    finally:
        writer.close()
    yield sink.drain()  # footer (and the magic bytes, for an empty file)


_WRITERS = {"csv": _csv, "jsonl": _jsonl, "parquet": _parquet}


def export(db: Database, fmt: str, tenant_id: str | None = None, period: Period = Period(),
           batch_size: int = 5000) -> Iterator[bytes]:
    """The ledger rows of a period (optionally one tenant) as a stream of byte chunks in `fmt`, ordered
    by (created_at, id), with every LedgerEntry column (`COLUMN_NAMES`). Arguments are checked now
    (BillingQueryError); the database is read only as the chunks are consumed, `batch_size` rows at a
    time, in one transaction (closing the iterator early ends it).

    csv: a header row, then one line per entry; money as plain decimals with 12 places, times ISO 8601
    UTC, booleans true/false, NULL empty; a text cell starting with = + - @ (or a tab or carriage return) gets
    a leading ' so that spreadsheets do not run it as a formula. jsonl: one object per line, money as strings,
    NULL null.
    parquet: decimal128(30, 12) money, timestamp[us, UTC] times, one row group per batch."""
    writer = _WRITERS[_check_format(fmt)]
    _check_query(tenant_id, period)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BillingQueryError(f"batch_size must be a positive integer, got {batch_size!r}")
    return _stream(writer, _batches(db, _where(tenant_id, period), batch_size))


def _stream(writer: Callable[[Iterator[list]], Iterator[bytes]], batches) -> Iterator[bytes]:
    try:
        yield from writer(batches)
    finally:  # also when the consumer stops early: end the read transaction and free the connection now
        batches.close()
