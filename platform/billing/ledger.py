"""The cost ledger: one row per finished request, priced at the price in force when it ran, written
exactly once and never lost, even by kill -9.

`write_records` prices records and inserts them in one transaction with INSERT ... ON CONFLICT
(request_id, part) DO NOTHING, so writing a record again is harmless (`part` tells apart the rows of one
request: a fan-out bills each adapter on its own row).

`LedgerWriter` is the request path's hook. `submit(record)` never blocks and never raises: it checks and
encodes the record, queues its line for the write-ahead log (`ledger_wal`: JSON lines in the data dir)
and returns a `concurrent.futures.Future`. The "ledger-wal" thread writes whatever queued up meanwhile
with one fsync (group commit, off the event loop), then resolves those futures. THE PROMISE: a record
whose future resolved to True is written to SQL exactly once, whatever happens to the process afterwards
(kill -9, OOM, power loss), provided the next start uses the same data dir. So the server sends a
request's final response only after `await durable(ledger.submit(record))`. A record whose future had
not resolved when the process died is billed at most once (its client never got a final response).

The "ledger-writer" thread writes the log to SQL in order, up to `batch_size` rows a transaction (a
smaller batch waits up to `linger_s` for more, except while flushing): from memory for those it keeps
there (at most `max_buffer`), from the file for the others (replayed after a restart, or while the
database is down: then the log grows on disk while memory holds one batch). After each commit, segments
wholly in SQL are deleted and an active segment wholly in SQL is emptied. While the database is down the
thread keeps its batch, logs once, and retries with exponential backoff; a batch whose commit outcome is
unknown is simply written again. A line cut short by a crash (never acknowledged) and records that can
never be written (invalid data) go to `<spool>.rejected`. `close()` writes what it can within `timeout`;
the rest stays in the log for the next `start()`.

Record checks and row pricing live in `ledger_records`, the line format and rejected file in
`ledger_lines`, the log's files and its group commit in `ledger_wal`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from loramux.billing.budgets import book_spend
from loramux.billing.ledger_lines import RejectedFile, encode
from loramux.billing.ledger_records import (
    PRICE_RELOAD_S,
    LedgerRecordError,
    PriceCache,
    check_record,
    ledger_row,
    loose,
    short_error,
    write_batch,
)
from loramux.billing.ledger_wal import SEGMENT_BYTES, Entry, GroupCommit, Position, WriteAheadLog, place
from loramux.billing.pricing import PriceInfo, load_prices
from loramux.billing.usage import RequestRecord
from loramux.db import Database
from loramux.db.models import LedgerEntry

__all__ = ["PRICE_RELOAD_S", "LedgerBacklogError", "LedgerRecordError", "LedgerWriter", "check_record", "durable",
           "write_records"]

log = logging.getLogger(__name__)

_TABLE = LedgerEntry.__table__
_RECORD_FIELDS = [f.name for f in fields(RequestRecord)]


class LedgerBacklogError(OSError):
    """The log cannot be written and `max_pending` records already wait in memory for it."""


def write_records(db: Database, records: Sequence[RequestRecord],
                  prices: Sequence[PriceInfo] | None = None) -> tuple[int, int]:
    """Price each record at its own `created_at` (with `prices`, or the price table read in the same
    transaction when None) and insert the rows in one transaction; rows whose (request_id, part) is already
    in the ledger (or earlier in `records`) are skipped. Returns (inserted, duplicates)."""
    records = list(records)
    for record in records:
        check_record(record)
    if not records:
        return 0, 0
    unique = list({(r.request_id, r.part): r for r in reversed(records)}.values())  # the first of each key
    dialect = db.engine.dialect.name
    if dialect == "postgresql":
        insert = pg_insert
    elif dialect == "sqlite":
        insert = sqlite_insert
    else:
        raise NotImplementedError(f"the ledger supports PostgreSQL and SQLite, not {dialect}")
    # RETURNING tells the rows inserted from those already there (SQLAlchemy batches it as insertmanyvalues);
    # the budgets of the inserted ones are charged in the same transaction (`book_spend`).
    stmt = insert(_TABLE).on_conflict_do_nothing(index_elements=["request_id", "part"]).returning(
        _TABLE.c.request_id, _TABLE.c.part)
    with db.session() as session:
        if prices is None:
            prices = load_prices(session)
        rows = [ledger_row(r, prices) for r in unique]
        keys = {tuple(k) for k in session.execute(stmt, rows).all()}
        book_spend(session, [r for r in rows if (r["request_id"], r["part"]) in keys])
    return len(keys), len(records) - len(keys)


async def durable(future: Future, timeout: float | None = None) -> bool:
    """Await a `LedgerWriter.submit` future on the event loop: True once the record's line is fsync'd in
    the write-ahead log (it will be billed exactly once), False when it was refused as invalid. Raises
    asyncio.TimeoutError after `timeout` s (the record may still be stored later; the future is not
    cancelled), or the error that kept it from being stored."""
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout)


# --- the writer ---------------------------------------------------------------------------------------
def _decode(line: bytes) -> RequestRecord:
    data = json.loads(line)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    data["created_at"] = datetime.fromisoformat(data["created_at"])
    record = RequestRecord(**{k: data[k] for k in _RECORD_FIELDS if k in data})
    check_record(record)
    return record


@dataclass
class _Batch:
    records: list[RequestRecord]
    lines: int  # log lines the batch covers (records + unreadable ones)
    end: Position | None = None  # position just past its last line (None: not read from the file yet)
    start: Position | None = None  # a batch read from the file: where it begins
    bad: list[dict] = field(default_factory=list)  # unreadable lines, for the rejected file


class LedgerWriter:
    def __init__(self, db: Database, wal_path: Path, *, max_buffer: int = 10_000, batch_size: int = 500,
                 retry_initial_s: float = 0.2, retry_max_s: float = 5.0, segment_bytes: int = SEGMENT_BYTES,
                 linger_s: float = 0.05, max_pending: int = 10_000):
        """`wal_path` is the log's active segment (sealed ones sit next to it); `max_buffer` records at
        most are kept in memory for SQL, the others are read back from the log; `segment_bytes`: the
        active segment is sealed past this size (and deleted once all of it is in SQL); `linger_s`: a
        batch smaller than `batch_size` waits up to this long for more rows (not while flushing);
        `max_pending`: records waiting for the log (a full or failing disk) beyond which `submit` refuses
        new ones (their futures fail, so their requests fail) instead of growing memory without bound."""
        if max_buffer < 1 or batch_size < 1:
            raise ValueError("max_buffer and batch_size must be at least 1")
        if not 0 < retry_initial_s <= retry_max_s:
            raise ValueError("need 0 < retry_initial_s <= retry_max_s")
        self.db = db
        self.wal_path = Path(wal_path)
        self.rejected_path = self.wal_path.with_name(self.wal_path.name + ".rejected")
        self._wal = WriteAheadLog(self.wal_path, segment_bytes)
        self._rejected = RejectedFile(self.rejected_path)
        self.max_buffer, self.batch_size, self.max_pending = max_buffer, batch_size, max_pending
        self.retry_initial_s, self.retry_max_s, self.linger_s = retry_initial_s, retry_max_s, linger_s
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the SQL thread and flush() wait here
        self._commit = GroupCommit(self._wal, self._lock, self._appended, retry_initial_s, retry_max_s)
        self._wake = threading.Event()  # cuts a retry backoff short (flush, close)
        self._state = "new"  # new | running | closed
        self._thread: threading.Thread | None = None
        self._run_id = 0  # each start() runs a new SQL thread; an older one still stuck in the database just ends
        self._stopping = self._idle = False
        self._flushing, self._linger_until = 0, None  # flush() callers waiting; when a gathered batch goes
        # Log lines are numbered 1, 2, ... in file order (replayed ones first): `_seq` accepted, `_durable`
        # fsync'd, `_committed` in SQL (or rejected), `_settled` committed and trimmed; each a prefix of the last.
        self._seq = self._durable = self._committed = self._settled = 0
        self._ram: deque[Entry] = deque()  # kept in memory until in SQL, in line order (not contiguous)
        self._cursor: Position = (0, 0)  # log position of line `_committed + 1`
        self._inflight: _Batch | None = None
        self._prices = PriceCache(PRICE_RELOAD_S)
        self._failing = False
        self._counts = dict(written=0, duplicates=0, failures=0, rejected=0, lost=0, refused_backlog=0)
        self._last_error: str | None = None

    # -- the request path ------------------------------------------------------------------------------
    def submit(self, record: RequestRecord) -> Future:
        """Hand over one finished request; never blocks on disk or SQL and never raises. The returned
        future resolves to True once the record's line is fsync'd in the log (from then on it is billed
        exactly once, even after kill -9), to False when the record was refused as invalid (it is kept in
        the rejected file), or to the exception that kept it from being stored. Await it before the final
        response: `await durable(writer.submit(record))`. Before `start()` the line waits in memory; after
        `close()` it is appended and fsync'd on the calling thread."""
        future: Future = Future()
        future.set_running_or_notify_cancel()  # cannot be cancelled (asyncio.wait_for timing out would try)
        try:
            try:
                check_record(record)
                line = encode(record)
            except (LedgerRecordError, ValueError, TypeError) as exc:
                log.error("ledger: record refused (%s); kept in %s", exc, self.rejected_path)
                self._reject([{"error": str(exc), "record": loose(record)}])
                future.set_result(False)
                return future
            with self._lock:
                if self._state == "closed":
                    self._wal.append_closed(line)
                    self._seq += 1
                    self._durable = self._seq
                else:
                    if not self._wal.is_open:
                        self._open_wal()
                    if len(self._commit.pending) >= self.max_pending:
                        self._counts["refused_backlog"] += 1
                        if self._counts["refused_backlog"] == 1 or self._counts["refused_backlog"] % 1000 == 0:
                            log.error("ledger: %d records wait for the log %s (is the disk full?); refusing new "
                                      "ones (%d so far)", len(self._commit.pending), self.wal_path,
                                      self._counts["refused_backlog"])
                        future.set_exception(LedgerBacklogError(
                            f"{len(self._commit.pending)} records wait for the ledger log; refusing more"))
                        return future
                    self._seq += 1
                    entry = Entry(self._seq, line, record, future)
                    self._commit.put(entry)
                    if len(self._ram) < self.max_buffer:
                        self._ram.append(entry)
                    return future
            future.set_result(True)
        except Exception as exc:  # noqa: BLE001 - the request path must never fail because of the ledger
            log.exception("ledger: could not keep the record of request %s", getattr(record, "request_id", "?"))
            with self._lock:
                self._counts["lost"] += 1
            if not future.done():
                future.set_exception(exc)
        return future

    # -- control ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the WAL and SQL threads; the SQL thread begins with what an earlier run left in the log."""
        with self._lock:
            if self._state == "running":
                return
            if not self._wal.is_open:
                self._open_wal()
            self._stopping = False
            self._state = "running"
            self._run_id += 1
            self._commit.start()
            self._thread = threading.Thread(target=self._run, args=(self._run_id,), name="ledger-writer",
                                            daemon=True)
            self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record submitted so far is in SQL (True), or `timeout` seconds (False)."""
        with self._lock:
            target = self._seq
            if self._state == "running":
                self._wake.set()  # skip the rest of a retry backoff
                self._flushing += 1  # and do not wait for fuller batches
                self._cond.notify_all()
                try:
                    self._cond.wait_for(lambda: self._state != "running" or self._settled >= target, timeout)
                finally:
                    self._flushing -= 1
            return self._settled >= target

    def close(self, timeout: float = 10.0) -> None:
        """Flush for up to `timeout` seconds, then stop the threads; what is not in SQL stays in the log."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._state == "closed":
                return
            running = self._state == "running"
        if running and not self.flush(timeout):
            log.warning("ledger: database not reachable at shutdown; unwritten records stay in %s", self.wal_path)
        with self._lock:
            self._stopping = True
            self._cond.notify_all()
        self._wake.set()
        thread, stuck = self._thread, False
        if thread is not None:
            thread.join(max(0.2, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("ledger: writer thread still busy in the database at shutdown; its batch stays in "
                            "the log too (written at most once on replay)")
            stuck = not self._commit.stop(max(1.0, deadline - time.monotonic()))
        done: list[Entry] = []
        with self._lock:
            self._state = "closed"
            self._run_id += 1
            leftovers, self._commit.pending = self._commit.pending, []
            try:
                if stuck:
                    raise OSError("the WAL thread is stuck in a write")
                if leftovers:  # never started, or the log could not be written until now
                    place(leftovers, *self._wal.append([e.line for e in leftovers]))
                    self._appended(leftovers[-1].seq)
                    done = leftovers
                self._wal.close(self._cursor)
            except Exception as exc:  # noqa: BLE001
                log.exception("ledger: could not close the log %s cleanly", self.wal_path)
                lost = [] if done else leftovers
                self._counts["lost"] += len(lost)
                for e in lost:
                    e.future.set_exception(exc)
            self._ram.clear()
            self._inflight = None
            self._cond.notify_all()
        for e in done:
            e.future.set_result(True)

    def stats(self) -> dict:
        """written / duplicates / rejected / lost rows, failures (SQL) and wal_failures; buffered: records
        kept in memory for SQL; spooled: records not in SQL that are only in the log (or queued for it)."""
        with self._lock:
            return {**self._counts, "wal_failures": self._commit.failures, "buffered": len(self._ram),
                    "spooled": max(0, self._seq - self._committed - len(self._ram)), "last_error": self._last_error,
                    "wal_syncs": self._wal.syncs, "wal_lines": self._wal.appended}

    # -- the log ---------------------------------------------------------------------------------------
    def _open_wal(self) -> None:
        """Under the lock: open the log; its lines left by an earlier run come first."""
        replayed = self._wal.open()
        self._committed = self._settled = self._seq  # what an earlier open counted is in the files again
        self._seq += replayed
        self._durable = self._seq
        self._cursor = self._wal.start_position()
        if replayed:
            log.warning("ledger: replaying %d records from %s", replayed, self.wal_path)

    def _appended(self, seq: int) -> None:
        """Under the lock: every line up to `seq` is fsync'd (and placed)."""
        self._durable = seq
        if self._idle or self._durable - self._committed >= self.batch_size:
            self._cond.notify_all()  # else the SQL thread is busy, or gathering a batch and wakes by itself

    # -- the SQL thread --------------------------------------------------------------------------------
    def _run(self, run_id: int) -> None:
        backoff = self.retry_initial_s
        while True:
            try:
                with self._lock:
                    while True:
                        if self._stopping or run_id != self._run_id:
                            return
                        wait = self._gather()
                        batch = None if wait else self._next_batch()
                        if batch is not None:
                            break
                        self._idle = not wait  # no work: a group commit wakes it
                        self._cond.wait(wait or None)
                        self._idle = False
                if batch.end is None:
                    self._read(batch)
                inserted, duplicates, rejected = self._write(batch.records)
            except Exception as exc:  # noqa: BLE001 - any failure: keep the batch and retry
                self._failed(exc)
                with self._lock:
                    if self._stopping or run_id != self._run_id:
                        return
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, self.retry_max_s)
                continue
            backoff = self.retry_initial_s
            try:
                self._done(run_id, batch, inserted, duplicates, rejected)
            except Exception:  # noqa: BLE001 - bookkeeping of a committed batch; the rows are in SQL
                log.exception("ledger: bookkeeping after a committed batch failed")
                with self._lock:
                    if self._inflight is batch:
                        self._inflight = None
                    self._cond.notify_all()

    def _gather(self) -> float | None:
        """Under the lock: how long to wait for a fuller batch before writing (fewer transactions, less time
        holding the GIL away from the event loop); 0: write now."""
        if self._inflight is not None or self._stopping or self._flushing or not self.linger_s:
            return 0
        backlog = self._durable - self._committed
        if backlog == 0 or backlog >= self.batch_size:
            self._linger_until = None
            return 0
        now = time.monotonic()
        if self._linger_until is None:
            self._linger_until = now + self.linger_s
        if now >= self._linger_until:
            self._linger_until = None
            return 0
        return self._linger_until - now

    def _next_batch(self) -> _Batch | None:
        """Under the lock: the batch to write next (the failed one first), in log order."""
        if self._inflight is not None:
            return self._inflight
        first = self._committed + 1
        if first > self._durable:
            return None
        if self._ram and self._ram[0].seq == first:  # in memory: no need to read the file
            take = []
            for e in self._ram:
                if e.seq != first + len(take) or e.seq > self._durable or len(take) >= self.batch_size:
                    break
                take.append(e)
            batch = _Batch([e.record for e in take], len(take), end=take[-1].end)
        else:  # up to the next record kept in memory, from the file
            stop = min(self._ram[0].seq if self._ram else first + self.batch_size, self._durable + 1)
            batch = _Batch([], min(self.batch_size, stop - first), start=self._cursor)
        self._inflight = batch
        return batch

    def _read(self, batch: _Batch) -> None:
        lines, end = self._wal.read_lines(batch.start, batch.lines)
        records, bad = [], []
        for line in lines:
            try:
                records.append(_decode(line))
            except Exception as exc:  # noqa: BLE001
                log.error("ledger: unreadable log line (%s); kept in %s", short_error(exc), self.rejected_path)
                bad.append({"error": short_error(exc), "line": line.decode("utf-8", "replace").rstrip("\n")})
        if len(lines) < batch.lines:  # cannot happen unless someone else changed the files
            log.error("ledger: the log %s is shorter than written; %d records may be missing", self.wal_path,
                      batch.lines - len(lines))
            with self._lock:
                self._counts["lost"] += batch.lines - len(lines)
        batch.records, batch.bad, batch.end = records, bad, end

    def _write(self, records: list[RequestRecord]) -> tuple[int, int, list[dict]]:
        if not records:
            return 0, 0, []
        prices = self._prices.get(self.db)
        return write_batch(lambda batch: write_records(self.db, batch, prices), records, self.rejected_path)

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self._counts["failures"] += 1
            self._last_error = short_error(exc)
            first, self._failing = not self._failing, True
            pending = self._seq - self._committed
        if first:
            log.warning("ledger: database write failed (%s); %d records kept, retrying with backoff up to %.1fs",
                        self._last_error, pending, self.retry_max_s)
        else:
            log.debug("ledger: retry failed: %s", self._last_error)

    def _done(self, run_id: int, batch: _Batch, inserted: int, duplicates: int, rejected: list[dict]) -> None:
        if rejected or batch.bad:
            self._reject(rejected + batch.bad)  # before the log lines are dropped
        with self._lock:
            self._counts["written"] += inserted
            self._counts["duplicates"] += duplicates
            if self._failing:
                self._failing = False
                log.warning("ledger: database reachable again after %d failed attempts; writes resumed",
                            self._counts["failures"])
            if self._inflight is batch:
                self._inflight = None
            if run_id != self._run_id:  # closed meanwhile: the log is no longer ours to trim
                return
            self._committed += batch.lines
            self._cursor = cursor = batch.end
            while self._ram and self._ram[0].seq <= self._committed:
                self._ram.popleft()
            committed = self._committed
        cursor = self._wal.trim(cursor)  # outside the lock: it may wait for an fsync in progress
        with self._lock:
            if run_id == self._run_id:
                self._cursor = cursor
                self._settled = committed
            self._cond.notify_all()

    # -- the rejected file -----------------------------------------------------------------------------
    def _reject(self, entries: list[dict]) -> None:
        self._rejected.append(entries)
        with self._lock:
            self._counts["rejected"] += len(entries)

