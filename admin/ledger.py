"""The cost ledger: one row per finished request, priced at the price in force when it ran, written
exactly once and never lost.

`write_records` prices records and inserts them in one transaction with INSERT ... ON CONFLICT
(request_id) DO NOTHING, so replaying records is harmless. `LedgerWriter` is the request path's hook: its
`submit` only appends to a bounded in-memory buffer (or, when that is full, to a JSON-lines spool file
that is fsync'd), and a background thread writes batches to SQL. While the database is down the thread
keeps its batch, logs once, and retries with exponential backoff; a batch whose commit outcome is
unknown is simply written again. `close()` writes what it can and spools the rest; the next `start()`
replays the spool. Records that can never be written (invalid data) go to `<spool>.rejected`.

Record checks and row pricing live in `ledger_records`, the spool and rejected files in `ledger_spool`.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

from loramux.admin.ledger_records import LedgerRecordError, check_record, ledger_row
from loramux.admin.ledger_spool import RejectedFile, SpoolFile
from loramux.admin.pricing import PriceInfo, load_prices, price_generation
from loramux.db import Database
from loramux.db.models import LedgerEntry
from loramux.usage import RequestRecord

__all__ = ["PRICE_RELOAD_S", "LedgerRecordError", "LedgerWriter", "check_record", "write_records"]

log = logging.getLogger(__name__)

PRICE_RELOAD_S = 1.0  # the writer reloads the price table at most this often (and when this process sets a price)
_TABLE = LedgerEntry.__table__
_RECORD_FIELDS = [f.name for f in fields(RequestRecord)]


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
        rows = [ledger_row(r, prices) for r in unique]
        inserted = session.execute(stmt, rows).rowcount
    return inserted, len(records) - inserted


# --- the writer ---------------------------------------------------------------------------------------
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
        self._spool = SpoolFile(self.spool_path)  # [offset, size) of it is not yet in SQL
        self._rejected = RejectedFile(self.rejected_path)
        self.max_buffer, self.batch_size = max_buffer, batch_size
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._cond = threading.Condition()
        self._wake = threading.Event()  # cuts a retry backoff short (flush, close)
        self._state = "new"  # new | running | closed
        self._thread: threading.Thread | None = None
        self._run_id = 0  # each start() runs a new thread; an older one still stuck in the database just ends
        self._stopping = False
        self._buffer: deque[tuple[int, RequestRecord]] = deque()
        self._seq = 0
        self._inflight: _Batch | None = None
        self._spool_next = False  # alternate buffer and spool batches so neither starves
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
                    self._spool.append([record])
                    if self._state == "closed":
                        self._spool.close()
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
            self._spool.open()
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
            target = (self._seq, self._spool.epoch, self._spool.size)
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
                self._spool.compact(leftovers)
                self._buffer.clear()
                self._inflight = None
            except Exception:  # noqa: BLE001
                log.exception("ledger: could not spool %d unwritten records to %s", len(leftovers), self.spool_path)
            self._spool.close()
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            return {**self._counts, "buffered": len(self._buffer) + self._inflight_buffered(),
                    "spooled": self._spool.pending, "last_error": self._last_error}

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
            pending = len(self._buffer) + self._inflight_buffered() + self._spool.pending
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
            if (batch.source == "spool" and self._state != "closed" and batch.epoch == self._spool.epoch
                    and batch.end_offset > self._spool.offset):
                self._spool.commit(batch.end_offset, batch.lines)
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
        spool_done = self._spool.pending == 0 or (self._state != "closed" and (
            epoch != self._spool.epoch or self._spool.offset >= size))
        return oldest > seq and spool_done

    def _next_batch(self) -> _Batch | None:
        if self._inflight is not None:
            return self._inflight  # a failed batch is retried before anything else
        spool_ready = self._spool.ready
        if self._buffer and not (spool_ready and self._spool_next):
            take = [self._buffer.popleft() for _ in range(min(self.batch_size, len(self._buffer)))]
            batch = _Batch("buffer", [r for _, r in take], first_seq=take[0][0], last_seq=take[-1][0])
        elif spool_ready:
            batch = self._read_spool()
            if batch.lines == 0:  # the file is shorter than written: changed by someone else
                log.error("ledger: spool file %s shrank unexpectedly; %d records may be missing", self.spool_path,
                          self._spool.pending)
                self._spool.forget_unread()
                return self._next_batch()
        else:
            return None
        self._spool_next = batch.source == "buffer"
        self._inflight = batch
        return batch

    def _read_spool(self) -> _Batch:
        """The next batch_size lines of the spool from the committed offset."""
        batch = _Batch("spool", [], epoch=self._spool.epoch, end_offset=self._spool.offset)
        for line, end_offset in self._spool.read_lines(self.batch_size):
            batch.lines, batch.end_offset = batch.lines + 1, end_offset
            try:
                batch.records.append(_decode(line))
            except Exception as exc:  # noqa: BLE001
                log.error("ledger: unreadable spool line (%s); kept in %s", _short(exc), self.rejected_path)
                batch.bad.append({"error": _short(exc), "line": line.decode("utf-8", "replace").rstrip("\n")})
        return batch

    # -- the rejected file -----------------------------------------------------------------------------
    def _reject(self, entries: list[dict]) -> None:
        self._rejected.append(entries)
        with self._cond:
            self._counts["rejected"] += len(entries)


def _loose(record) -> object:
    """As much of a (possibly malformed) record as JSON can hold."""
    if isinstance(record, RequestRecord):
        return {k: getattr(record, k) for k in _RECORD_FIELDS}
    return repr(record)[:2000]
