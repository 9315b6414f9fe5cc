"""The cost ledger: one row per finished request, priced at the price in force when it ran, written
exactly once and never lost.

`write_records` prices records and inserts them in one transaction with INSERT ... ON CONFLICT
(request_id) DO NOTHING, so replaying records is harmless. `LedgerWriter` is the request path's hook: its
`submit` only appends to a bounded in-memory buffer (or, when that is full, to a JSON-lines spool file
that is fsync'd), and a background thread writes batches to SQL. While the database is down the thread
keeps its batch, logs once, and retries with exponential backoff; a batch whose commit outcome is
unknown is simply written again. `close()` writes what it can and spools the rest; the next `start()`
replays the spool. Records that can never be written (invalid data) go to `<spool>.rejected`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path

from sqlalchemy import String
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError, DataError, IntegrityError, StatementError

from loramux.adapters.store import fsync_dir as _fsync_dir
from loramux.admin.pricing import PriceInfo, cost_of, load_prices, price_for, price_generation
from loramux.db import Database
from loramux.db.models import LedgerEntry, Money
from loramux.usage import RequestRecord

log = logging.getLogger(__name__)

PRICE_RELOAD_S = 1.0  # the writer reloads the price table at most this often (and when this process sets a price)
_INT32_MAX = 2**31 - 1
_ZERO = Money.SCALE * 0
_TABLE = LedgerEntry.__table__
_STRINGS = {c.name: c.type.length for c in _TABLE.columns if isinstance(c.type, String)}
_INTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "adapter_version")
_READ_CHUNK = 1 << 20
_RECORD_FIELDS = [f.name for f in fields(RequestRecord)]


class LedgerRecordError(ValueError):
    """A RequestRecord that cannot become a ledger row (the message says which and why)."""


def check_record(record) -> None:
    """Raise LedgerRecordError unless `record` fits the ledger table on every backend."""
    if not isinstance(record, RequestRecord):
        raise LedgerRecordError(f"expected a RequestRecord, got {type(record).__name__}")
    rid = record.request_id if isinstance(record.request_id, str) else repr(record.request_id)

    def bad(message: str) -> LedgerRecordError:
        return LedgerRecordError(f"request {rid[:80]}: {message}")

    for name, length in _STRINGS.items():
        value = getattr(record, name, None)
        if value is None and name == "adapter_id":
            continue
        if not isinstance(value, str) or not value:
            raise bad(f"{name} must be a non-empty string")
        if length is not None and len(value) > length:
            raise bad(f"{name} is longer than {length} characters")
    for name in _INTS:
        value = getattr(record, name)
        if value is None and name == "adapter_version":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
            raise bad(f"{name} must be an int in [0, {_INT32_MAX}], got {value!r}")
    if record.cached_tokens > record.prompt_tokens:
        raise bad(f"cached_tokens ({record.cached_tokens}) exceeds prompt_tokens ({record.prompt_tokens})")
    for name in ("queue_ms", "ttft_ms", "total_ms"):
        value = getattr(record, name)
        if value is None and name != "total_ms":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(f"{name} must be a finite number, got {value!r}")
    if not isinstance(record.fallback, bool):
        raise bad("fallback must be a bool")
    if not isinstance(record.created_at, datetime) or record.created_at.utcoffset() is None:
        raise bad("created_at must be a timezone-aware datetime")


def _row(record: RequestRecord, prices: Sequence[PriceInfo]) -> dict:
    price = price_for(prices, record.model, record.adapter_id, record.tier, record.created_at)
    return dict(
        request_id=record.request_id, tenant_id=record.tenant_id, key_id=record.key_id, model=record.model,
        adapter_id=record.adapter_id, adapter_version=record.adapter_version, tier=record.tier,
        outcome=record.outcome, fallback=record.fallback, prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens,
        queue_ms=None if record.queue_ms is None else float(record.queue_ms),
        ttft_ms=None if record.ttft_ms is None else float(record.ttft_ms), total_ms=float(record.total_ms),
        price_id=price.id if price else None,
        input_per_mtok=price.input_per_mtok if price else _ZERO,
        cached_input_per_mtok=price.cached_input_per_mtok if price else _ZERO,
        output_per_mtok=price.output_per_mtok if price else _ZERO,
        cost=cost_of(record.prompt_tokens, record.cached_tokens, record.completion_tokens, price),
        created_at=record.created_at)


def write_records(db: Database, records: Sequence[RequestRecord],
                  prices: Sequence[PriceInfo] | None = None) -> tuple[int, int]:
    """Price each record at its own `created_at` (with `prices`, or the price table read in the same
    transaction when None) and insert the rows in one transaction; rows whose request_id is already in
    the ledger (or earlier in `records`) are skipped. Returns (inserted, duplicates)."""
    records = list(records)
    for record in records:
        check_record(record)
    if not records:
        return 0, 0
    unique = list({r.request_id: r for r in reversed(records)}.values())  # the first of each request id
    dialect = db.engine.dialect.name
    if dialect == "postgresql":
        insert = pg_insert
    elif dialect == "sqlite":
        insert = sqlite_insert
    else:
        raise NotImplementedError(f"the ledger supports PostgreSQL and SQLite, not {dialect}")
    # executemany without RETURNING: psycopg pipelines it and sums the row counts, sqlite3 sums them too.
    stmt = insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id"]).execution_options(
        preserve_rowcount=True)
    with db.session() as session:
        if prices is None:
            prices = load_prices(session)
        rows = [_row(r, prices) for r in unique]
        inserted = session.execute(stmt, rows).rowcount
    return inserted, len(records) - inserted


# --- the writer ---------------------------------------------------------------------------------------
def _encode(record: RequestRecord) -> bytes:
    data = record.as_dict()
    data["created_at"] = record.created_at.isoformat()
    return (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _decode(line: bytes) -> RequestRecord:
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    data["created_at"] = datetime.fromisoformat(data["created_at"])
    record = RequestRecord(**{k: data[k] for k in _RECORD_FIELDS if k in data})
    check_record(record)
    return record


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _is_data_error(exc: BaseException) -> bool:
    """True when a write failed because of the rows themselves (retrying cannot help), not the database."""
    if isinstance(exc, DBAPIError):
        return not exc.connection_invalidated and isinstance(exc, (DataError, IntegrityError))
    if isinstance(exc, StatementError):  # raised while binding parameters, before reaching the database
        return isinstance(exc.orig, (ValueError, TypeError, ArithmeticError))
    return isinstance(exc, (ValueError, TypeError, ArithmeticError))


@dataclass
class _Batch:
    source: str  # "buffer" | "spool"
    records: list[RequestRecord]
    first_seq: int = 0  # buffer: sequence numbers of the first and last record
    last_seq: int = 0
    epoch: int = 0  # spool: the spool file generation and the offset just past the batch's last line
    end_offset: int = 0
    lines: int = 0  # spool lines consumed (records + unreadable ones)
    bad: list[dict] = field(default_factory=list)  # unreadable spool lines, for the rejected file


class LedgerWriter:
    def __init__(self, db: Database, spool_path: Path, *, max_buffer: int = 10_000, batch_size: int = 500,
                 retry_initial_s: float = 0.2, retry_max_s: float = 5.0):
        if max_buffer < 1 or batch_size < 1:
            raise ValueError("max_buffer and batch_size must be at least 1")
        if not 0 < retry_initial_s <= retry_max_s:
            raise ValueError("need 0 < retry_initial_s <= retry_max_s")
        self.db = db
        self.spool_path = Path(spool_path)
        self.rejected_path = self.spool_path.with_name(self.spool_path.name + ".rejected")
        self.max_buffer, self.batch_size = max_buffer, batch_size
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._cond = threading.Condition()
        self._wake = threading.Event()  # cuts a retry backoff short (flush, close, refresh)
        self._reject_lock = threading.Lock()
        self._state = "new"  # new | running | closed
        self._thread: threading.Thread | None = None
        self._run_id = 0  # each start() runs a new thread; an older one still stuck in the database just ends
        self._stopping = False
        self._buffer: deque[tuple[int, RequestRecord]] = deque()
        self._seq = 0
        self._inflight: _Batch | None = None
        self._spool_next = False  # alternate buffer and spool batches so neither starves
        # The spool: an append-only file of JSON lines; [offset, size) is not yet in SQL.
        self._spool_out = None
        self._spool_in = None
        self._spool_size = self._spool_offset = self._spool_epoch = self._spool_pending = 0
        self._prices: list[PriceInfo] | None = None
        self._prices_at = 0.0
        self._prices_generation = -1
        self._failing = False
        self._counts = dict(written=0, duplicates=0, failures=0, rejected=0, lost=0)
        self._last_error: str | None = None

    # -- the request path ------------------------------------------------------------------------------
    def submit(self, record: RequestRecord) -> None:
        """Hand over one finished request. Never blocks on SQL and never raises."""
        try:
            try:
                check_record(record)
            except LedgerRecordError as exc:
                log.error("ledger: record refused (%s); kept in %s", exc, self.rejected_path)
                self._reject([{"error": str(exc), "record": _loose(record)}])
                return
            with self._cond:
                in_memory = len(self._buffer) + self._inflight_buffered()
                if self._state != "closed" and in_memory < self.max_buffer:
                    self._seq += 1
                    self._buffer.append((self._seq, record))
                else:
                    self._spool_append([record])
                    if self._state == "closed":
                        self._close_spool()
                self._cond.notify_all()
        except Exception:  # noqa: BLE001 - the request path must never fail because of the ledger
            log.exception("ledger: could not keep the record of request %s",
                          getattr(record, "request_id", "?"))
            with self._cond:
                self._counts["lost"] += 1

    # -- control ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the writer thread; it begins with the spool file left by an earlier run, if any."""
        with self._cond:
            if self._state == "running":
                return
            self._open_spool()
            self._stopping = False
            self._state = "running"
            self._spool_next = True
            self._run_id += 1
            self._thread = threading.Thread(target=self._run, args=(self._run_id,), name="ledger-writer",
                                            daemon=True)
            self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record submitted so far is in SQL (True), or `timeout` seconds (False)."""
        with self._cond:
            target = (self._seq, self._spool_epoch, self._spool_size)
            if self._state != "running":
                return self._flushed(target)
            self._wake.set()  # skip the rest of a retry backoff
            done = self._cond.wait_for(lambda: self._state != "running" or self._flushed(target), timeout)
            return bool(done) and self._flushed(target)

    def close(self, timeout: float = 10.0) -> None:
        """Flush for up to `timeout` seconds, stop the thread, and spool whatever is not in SQL yet."""
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._state == "closed":
                return
            running = self._state == "running"
        if running and not self.flush(timeout):
            log.warning("ledger: database not reachable at shutdown; unwritten records go to %s", self.spool_path)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.2, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("ledger: writer thread still busy in the database at shutdown; its batch is spooled "
                            "too (written at most once on replay)")
        with self._cond:
            self._state = "closed"
            leftovers = [r for _, r in self._buffer]
            if self._inflight is not None and self._inflight.source == "buffer":
                leftovers = self._inflight.records + leftovers
            try:
                self._compact_spool(leftovers)
                self._buffer.clear()
                self._inflight = None
            except Exception:  # noqa: BLE001
                log.exception("ledger: could not spool %d unwritten records to %s", len(leftovers), self.spool_path)
            self._close_spool()
            self._cond.notify_all()

    def refresh_prices(self) -> None:
        """Reload the price table before the next write."""
        with self._cond:
            self._prices = None

    def stats(self) -> dict:
        with self._cond:
            return {**self._counts, "buffered": len(self._buffer) + self._inflight_buffered(),
                    "spooled": self._spool_pending, "last_error": self._last_error}

    # -- the writer thread -----------------------------------------------------------------------------
    def _run(self, run_id: int) -> None:
        backoff = self.retry_initial_s
        while True:
            try:
                with self._cond:
                    while True:
                        if self._stopping or run_id != self._run_id:
                            return
                        batch = self._next_batch()
                        if batch is not None:
                            break
                        self._cond.wait()
                inserted, duplicates, rejected = self._write(batch.records)
            except Exception as exc:  # noqa: BLE001 - any failure: keep the batch and retry
                self._failed(exc)
                with self._cond:
                    if self._stopping or run_id != self._run_id:
                        return
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, self.retry_max_s)
                continue
            backoff = self.retry_initial_s
            try:
                self._done(batch, inserted, duplicates, rejected)
            except Exception:  # noqa: BLE001 - bookkeeping of a committed batch; the rows are in SQL
                log.exception("ledger: bookkeeping after a committed batch failed")
                with self._cond:
                    if self._inflight is batch:
                        self._inflight = None
                    self._cond.notify_all()

    def _write(self, records: list[RequestRecord]) -> tuple[int, int, list[dict]]:
        if not records:
            return 0, 0, []
        prices = self._current_prices()
        try:
            inserted, duplicates = write_records(self.db, records, prices)
            return inserted, duplicates, []
        except Exception as exc:  # noqa: BLE001
            if not _is_data_error(exc):
                raise
            log.error("ledger: a batch of %d rows was refused (%s); writing them one by one", len(records),
                      _short(exc))
        inserted = duplicates = 0
        rejected = []
        for record in records:
            try:
                i, d = write_records(self.db, [record], prices)
            except Exception as exc:  # noqa: BLE001
                if not _is_data_error(exc):
                    raise
                log.error("ledger: request %s refused by the database (%s); kept in %s", record.request_id,
                          _short(exc), self.rejected_path)
                rejected.append({"error": _short(exc), "record": _loose(record)})
                continue
            inserted += i
            duplicates += d
        return inserted, duplicates, rejected

    def _current_prices(self) -> list[PriceInfo]:
        generation = price_generation()
        with self._cond:
            fresh = (self._prices is not None and generation == self._prices_generation
                     and time.monotonic() - self._prices_at < PRICE_RELOAD_S)
            if fresh:
                return self._prices
        loaded_at = time.monotonic()
        with self.db.session() as session:
            prices = load_prices(session)
        with self._cond:
            self._prices, self._prices_at, self._prices_generation = prices, loaded_at, generation
        return prices

    def _failed(self, exc: BaseException) -> None:
        with self._cond:
            self._counts["failures"] += 1
            self._last_error = _short(exc)
            first = not self._failing
            self._failing = True
            pending = len(self._buffer) + self._inflight_buffered() + self._spool_pending
        if first:
            log.warning("ledger: database write failed (%s); %d records kept, retrying with backoff up to %.1fs",
                        self._last_error, pending, self.retry_max_s)
        else:
            log.debug("ledger: retry failed: %s", self._last_error)

    def _done(self, batch: _Batch, inserted: int, duplicates: int, rejected: list[dict]) -> None:
        if rejected or batch.bad:
            self._reject(rejected + batch.bad)  # before the spool lines are dropped
        with self._cond:
            self._counts["written"] += inserted
            self._counts["duplicates"] += duplicates
            if self._failing:
                self._failing = False
                log.warning("ledger: database reachable again after %d failed attempts; writes resumed",
                            self._counts["failures"])
            if self._inflight is batch:
                self._inflight = None
            if (batch.source == "spool" and self._state != "closed" and batch.epoch == self._spool_epoch
                    and batch.end_offset > self._spool_offset):
                self._spool_offset = batch.end_offset
                self._spool_pending = max(0, self._spool_pending - batch.lines)
                if self._spool_offset >= self._spool_size:  # all of it is in SQL: start the file afresh
                    self._spool_out.truncate(0)
                    os.fsync(self._spool_out.fileno())
                    self._spool_offset = self._spool_size = self._spool_pending = 0
                    self._spool_epoch += 1
            self._cond.notify_all()

    # -- state, under self._cond -----------------------------------------------------------------------
    def _inflight_buffered(self) -> int:
        batch = self._inflight
        return len(batch.records) if batch is not None and batch.source == "buffer" else 0

    def _flushed(self, target: tuple[int, int, int]) -> bool:
        seq, epoch, size = target
        if self._inflight is not None and self._inflight.source == "buffer":
            oldest = self._inflight.first_seq
        else:
            oldest = self._buffer[0][0] if self._buffer else seq + 1
        spool_done = self._spool_pending == 0 or (self._state != "closed" and (
            epoch != self._spool_epoch or self._spool_offset >= size))
        return oldest > seq and spool_done

    def _next_batch(self) -> _Batch | None:
        if self._inflight is not None:
            return self._inflight  # a failed batch is retried before anything else
        spool_ready = self._spool_offset < self._spool_size
        if self._buffer and not (spool_ready and self._spool_next):
            take = [self._buffer.popleft() for _ in range(min(self.batch_size, len(self._buffer)))]
            batch = _Batch("buffer", [r for _, r in take], first_seq=take[0][0], last_seq=take[-1][0])
        elif spool_ready:
            batch = self._read_spool()
            if batch.lines == 0:  # the file is shorter than written: changed by someone else
                log.error("ledger: spool file %s shrank unexpectedly; %d records may be missing", self.spool_path,
                          self._spool_pending)
                self._spool_size, self._spool_pending = self._spool_offset, 0
                return self._next_batch()
        else:
            return None
        self._spool_next = batch.source == "buffer"
        self._inflight = batch
        return batch

    def _open_spool(self) -> None:
        if self._spool_out is not None:
            return
        self.spool_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.spool_path, "ab")
        size = out.seek(0, os.SEEK_END)
        lines = 0
        if size:
            with open(self.spool_path, "rb") as f:
                last = b"\n"
                while chunk := f.read(1 << 20):
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
            if last != b"\n":  # a line cut short by a crash: end it, it will be rejected as unreadable
                out.write(b"\n")
                out.flush()
                os.fsync(out.fileno())
                size += 1
                lines += 1
            log.warning("ledger: replaying %d spooled records from %s", lines, self.spool_path)
        self._spool_out = out
        self._spool_in = open(self.spool_path, "rb", buffering=0)  # read with pread: never a stale buffer
        self._spool_size, self._spool_offset, self._spool_pending = size, 0, lines
        self._spool_epoch += 1

    def _close_spool(self) -> None:
        for f in (self._spool_out, self._spool_in):
            if f is not None:
                f.close()
        self._spool_out = self._spool_in = None
        self._spool_size = self._spool_offset = 0
        self._spool_epoch += 1

    def _spool_append(self, records: list[RequestRecord]) -> None:
        self._open_spool()
        data = b"".join(_encode(r) for r in records)
        try:
            self._spool_out.write(data)
            self._spool_out.flush()
            os.fsync(self._spool_out.fileno())
        except BaseException:
            try:  # drop a partial line so the file stays line-aligned
                self._spool_out.truncate(self._spool_size)
            except OSError:
                pass
            raise
        self._spool_size += len(data)
        self._spool_pending += len(records)

    def _read_spool(self) -> _Batch:
        """The next batch_size lines of the spool from the committed offset."""
        fd = self._spool_in.fileno()
        batch = _Batch("spool", [], epoch=self._spool_epoch)
        position = self._spool_offset  # file offset of buf[start]
        buf, start = b"", 0
        while batch.lines < self.batch_size:
            end = buf.find(b"\n", start)
            if end < 0:
                read_at = position + len(buf) - start
                if read_at >= self._spool_size:
                    break
                chunk = os.pread(fd, min(_READ_CHUNK, self._spool_size - read_at), read_at)
                if not chunk:
                    break
                buf, start = buf[start:] + chunk, 0
                continue
            line = buf[start:end + 1]
            start = end + 1
            position += len(line)
            batch.lines += 1
            try:
                batch.records.append(_decode(line))
            except Exception as exc:  # noqa: BLE001
                log.error("ledger: unreadable spool line (%s); kept in %s", _short(exc), self.rejected_path)
                batch.bad.append({"error": _short(exc), "line": line.decode("utf-8", "replace").rstrip("\n")})
        batch.end_offset = position
        return batch

    def _compact_spool(self, leftovers: list[RequestRecord]) -> None:
        """Rewrite the spool as: records still in memory, then the spool lines not yet in SQL (atomic)."""
        if self._spool_out is None and not leftovers:
            return
        self._open_spool()
        if not leftovers and self._spool_offset == 0:
            return
        count = len(leftovers) + self._spool_pending
        tmp = self.spool_path.with_name(self.spool_path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(_encode(r) for r in leftovers))
            position = self._spool_offset
            while position < self._spool_size:
                chunk = os.pread(self._spool_in.fileno(), min(_READ_CHUNK, self._spool_size - position), position)
                if not chunk:
                    break
                f.write(chunk)
                position += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.spool_path)
        _fsync_dir(self.spool_path.parent)
        self._spool_pending = count
        if leftovers:
            log.warning("ledger: %d unwritten records spooled to %s", len(leftovers), self.spool_path)

    # -- the rejected file -----------------------------------------------------------------------------
    def _reject(self, entries: list[dict]) -> None:
        data = b"".join((json.dumps(e, separators=(",", ":"), default=str) + "\n").encode() for e in entries)
        with self._reject_lock:
            self.rejected_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.rejected_path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        with self._cond:
            self._counts["rejected"] += len(entries)


def _loose(record) -> object:
    """As much of a (possibly malformed) record as JSON can hold."""
    if isinstance(record, RequestRecord):
        return {k: getattr(record, k) for k in _RECORD_FIELDS}
    return repr(record)[:2000]


