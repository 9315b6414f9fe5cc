"""The ledger's write-ahead log (WAL): JSON lines in segment files in the data dir, appended and fsync'd
in groups, read back in order by the SQL writer, and deleted or emptied once their rows are in SQL.

Files, for `path` = `<data dir>/ledger-wal.jsonl` (WAL_NAME): `path` is the active segment (appends go there);
`path.<n>` (n = 8 digits, increasing) are sealed segments, renamed from `path` when it outgrew
`segment_bytes`. Replay order is sealed segments by n, then `path`. A line's position is (segment
number, offset just past the line); segment numbers only grow, so a position is never reused.

What is durable when: `append` writes one group of lines and fsyncs (fdatasync) once, before it
returns; only then are the lines visible to `read_lines` and acknowledged by the writer. A new active
segment's directory entry is fsync'd before anything is written to it. Trimming never loses a line not
yet in SQL: a sealed segment is unlinked only when every line of it is before the SQL cursor; the active
one is truncated to empty only when every line of it is (under the append lock, so no write is in flight).
Neither needs an fsync: if a crash undoes an unlink or a truncation, the lines come back and are replayed
as duplicates, which the ledger's ON CONFLICT (request_id, part) DO NOTHING skips. A line cut short by a crash
(the process died inside `write`, before the fsync, so it was never acknowledged) is ended with a newline
when the log is reopened and then refused as unreadable.

A log an older version left under another name (LEGACY_WAL_NAMES: `ledger-spool.jsonl`) is adopted at
`open`, under that name's lock too: its segments become sealed segments of this log, replayed like them.

One process at a time: `open` takes an exclusive lock (flock) on `path.lock` and `close` gives it back, so
two servers pointed at one data dir cannot truncate each other's log; the second one's `open` raises
`LogInUseError`. The kernel drops the lock when its process dies, so a restart after kill -9 opens at once.

Threads: one appender (`GroupCommit`, the writer's WAL thread) and one reader/trimmer (its SQL thread);
the log's lock guards the segment list and sizes and serialises appends with truncation and rotation.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from loramux.durable_files import fsync_dir

log = logging.getLogger("loramux.billing.ledger")  # the writer's own logger: these are its messages

WAL_NAME = "ledger-wal.jsonl"
LEGACY_WAL_NAMES = ("ledger-spool.jsonl",)  # what the log was called before; such files are adopted at open
Position = tuple[int, int]  # (segment number, byte offset in it)
SEGMENT_BYTES = 16 << 20
_READ_CHUNK = 1 << 20
_sync = getattr(os, "fdatasync", os.fsync)  # an append changes the size: fdatasync makes it durable too


class LogInUseError(RuntimeError):
    """Another process (or another writer in this one) has the log open."""


def try_lock(path: Path) -> int | None:
    """An exclusive, non-blocking flock on `path` (created): its fd, or None when someone else holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the open file releases its flock


@dataclass
class Segment:
    no: int
    path: Path
    fd: int  # O_RDWR | O_APPEND: writes go to the end, reads use pread
    size: int = 0  # bytes fsync'd: readers never look past this
    lines: int = 0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class WriteAheadLog:
    def __init__(self, path: Path, segment_bytes: int = SEGMENT_BYTES):
        if segment_bytes < 1:
            raise ValueError("segment_bytes must be at least 1")
        self.path = Path(path)
        self.segment_bytes = segment_bytes
        self._lock = threading.Lock()
        self._segments: list[Segment] = []  # oldest first; the last one is the active segment, at `path`
        self._next_no = 1
        self._sealed_name = re.compile(re.escape(self.path.name) + r"\.(\d{8})")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._lock_fd: int | None = None
        self.syncs = 0  # group commits (one fsync each) since this object was made
        self.appended = 0  # lines they made durable

    @property
    def is_open(self) -> bool:
        return bool(self._segments)

    def open(self) -> int:
        """Open the log (creating `path`); returns how many lines earlier runs left in it, to be replayed."""
        with self._lock:
            if self._segments:
                return 0
            if self._lock_fd is None:
                self._lock_fd = try_lock(self.lock_path)
                if self._lock_fd is None:
                    raise LogInUseError(f"the ledger log {self.path} is in use by another process: give each server "
                                        "its own data dir (LORAMUX_DATA_DIR)")
            self.path.with_name(self.path.name + ".tmp").unlink(missing_ok=True)  # a compaction cut short
            try:
                self._adopt_legacy_logs()
            except BaseException:
                unlock(self._lock_fd)
                self._lock_fd = None
                raise
            sealed = self._sealed()
            segments = []
            try:
                for no, p in sealed:
                    segments.append(self._open_segment(no, p))
                created = not self.path.exists()
                segments.append(self._open_segment(sealed[-1][0] + 1 if sealed else self._next_no, self.path))
                if created:
                    fsync_dir(self.path.parent)
            except BaseException:
                for seg in segments:
                    os.close(seg.fd)
                unlock(self._lock_fd)
                self._lock_fd = None
                raise
            self._segments = segments
            self._next_no = max(self._next_no, segments[-1].no + 1)
            return sum(seg.lines for seg in segments)

    def _sealed(self) -> list[tuple[int, Path]]:
        return sorted((int(m.group(1)), p) for p in self.path.parent.iterdir()
                      if (m := self._sealed_name.fullmatch(p.name)))

    def _adopt_legacy_logs(self) -> None:
        """Rename the files of a log an older version left next to `path` under a legacy name into sealed
        segments of this one (after this log's own sealed ones, before its active one), and append its
        rejected file to ours. Under the legacy log's lock: an older server still running there keeps it."""
        for legacy in LEGACY_WAL_NAMES:
            old = self.path.with_name(legacy)
            if old.name == self.path.name:
                continue
            pattern = re.compile(re.escape(legacy) + r"(?:\.(\d{8}))?")
            files = sorted((int(m.group(1) or 10**8), p) for p in self.path.parent.iterdir()
                           if (m := pattern.fullmatch(p.name)))
            rejected = old.with_name(legacy + ".rejected")
            if not files and not rejected.exists():
                continue
            held = try_lock(old.with_name(legacy + ".lock"))
            if held is None:
                raise LogInUseError(f"the ledger log {old} is in use by another process (an older loramux?): stop "
                                    "it, or give each server its own data dir (LORAMUX_DATA_DIR)")
            try:
                sealed = self._sealed()
                no = sealed[-1][0] + 1 if sealed else 1
                for _, path in files:  # sealed ones by number, then the old active one (sorted last)
                    os.replace(path, self.path.with_name(f"{self.path.name}.{no:08d}"))
                    no += 1
                if rejected.exists():
                    with open(self.path.with_name(self.path.name + ".rejected"), "ab") as ours:
                        ours.write(rejected.read_bytes())
                        ours.flush()
                        os.fsync(ours.fileno())
                    rejected.unlink()
                fsync_dir(self.path.parent)
                if files:
                    log.warning("ledger: adopted %d file(s) of the log %s, to be replayed", len(files), old.name)
            finally:
                unlock(held)

    def _open_segment(self, no: int, path: Path) -> Segment:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            lines, at, last = 0, 0, b"\n"
            while at < size:
                chunk = os.pread(fd, min(_READ_CHUNK, size - at), at)
                if not chunk:
                    break
                lines += chunk.count(b"\n")
                at, last = at + len(chunk), chunk[-1:]
            if size and last != b"\n":
                log.warning("ledger: the last line of %s was cut short by a crash (it was never acknowledged); "
                            "it is skipped and kept in the rejected file", path.name)
                _write_all(fd, b"\n")
                _sync(fd)
                size, lines = size + 1, lines + 1
            return Segment(no, path, fd, size, lines)
        except BaseException:
            os.close(fd)
            raise

    def start_position(self) -> Position:
        with self._lock:
            return (self._segments[0].no, 0)

    def append(self, lines: list[bytes]) -> tuple[int, list[int]]:
        """Write `lines` (each ending in a newline) at the end of the log and fsync them once (group commit).
        Returns the segment number and each line's end offset. On failure nothing of them stays in the file."""
        with self._lock:
            active = self._segments[-1]
            if active.size >= self.segment_bytes or active.path != self.path:
                active = self._rotate()
            data = b"".join(lines)
            try:
                _write_all(active.fd, data)
                _sync(active.fd)
            except BaseException:
                try:  # drop what this write left, so the file stays line-aligned; it is written again later
                    os.ftruncate(active.fd, active.size)
                except OSError:
                    pass
                raise
            ends = [active.size + n for n in accumulate(map(len, lines))]
            active.size += len(data)
            active.lines += len(lines)
            self.syncs += 1
            self.appended += len(lines)
            return active.no, ends

    def _rotate(self) -> Segment:
        """Seal the active segment (rename it to `path.<n>`) and start a new, empty one at `path`."""
        old = self._segments[-1]
        if old.path == self.path:
            sealed = self.path.with_name(f"{self.path.name}.{old.no:08d}")
            os.rename(self.path, sealed)
            old.path = sealed
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        fsync_dir(self.path.parent)  # both names durable before a line is acknowledged in the new file
        seg = Segment(self._next_no, self.path, fd)
        self._next_no += 1
        self._segments.append(seg)
        return seg

    def read_lines(self, position: Position, count: int) -> tuple[list[bytes], Position]:
        """Up to `count` durable lines from `position` on (across segments), and the position past them."""
        with self._lock:
            segments = [(s.no, s.fd, s.size) for s in self._segments if s.no >= position[0]]
        lines: list[bytes] = []
        for no, fd, size in segments:
            offset = position[1] if no == position[0] else 0  # file offset of buf[start]
            position = (no, offset)
            buf, start, read_at = b"", 0, offset
            while len(lines) < count:
                end = buf.find(b"\n", start)
                if end >= 0:
                    lines.append(buf[start:end + 1])
                    offset += end + 1 - start
                    start = end + 1
                    continue
                if read_at >= size:
                    break
                chunk = os.pread(fd, min(_READ_CHUNK, size - read_at), read_at)
                if not chunk:
                    break
                buf, start, read_at = buf[start:] + chunk, 0, read_at + len(chunk)
            position = (no, offset)
            if len(lines) >= count:
                break
        return lines, position

    def trim(self, position: Position) -> Position:
        """Every line before `position` is in SQL: unlink the sealed segments wholly before it, and empty
        the active segment when all of it is. Returns `position`, moved past what was removed."""
        removed = []
        with self._lock:
            while len(self._segments) > 1:
                first = self._segments[0]
                if first.no > position[0] or (first.no == position[0] and position[1] < first.size):
                    break
                removed.append(self._segments.pop(0))
                if position[0] <= first.no:
                    position = (self._segments[0].no, 0)
            active = self._segments[-1] if self._segments else None
            if (active is not None and len(self._segments) == 1 and active.size
                    and position == (active.no, active.size) and active.path == self.path):
                os.ftruncate(active.fd, 0)  # no write is in flight: appends hold this lock
                active.size = active.lines = 0
                active.no, self._next_no = self._next_no, self._next_no + 1  # old positions never match again
                position = (active.no, 0)
        for seg in removed:
            os.close(seg.fd)
            seg.path.unlink(missing_ok=True)
        return position

    def close(self, position: Position | None = None) -> None:
        """Close the files. With `position` (the SQL cursor), first drop what is before it: when the rest is
        small it becomes the single file `path` (written aside, fsync'd, renamed over `path`); when it is
        large the segments stay (their prefix already in SQL is replayed as duplicates, which are skipped)."""
        if not self._segments:
            return
        if position is not None:
            position = self.trim(position)
        with self._lock:
            segments, self._segments = self._segments, []
            try:
                if position is not None and (len(segments) > 1 or position[1] > 0):
                    self._compact(segments, position)
            finally:
                for seg in segments:
                    os.close(seg.fd)
                unlock(self._lock_fd)
                self._lock_fd = None

    def _compact(self, segments: list[Segment], position: Position) -> None:
        parts = [(s, position[1] if s.no == position[0] else 0) for s in segments if s.no >= position[0]]
        if sum(s.size - start for s, start in parts) > self.segment_bytes:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for seg, at in parts:
                while at < seg.size:
                    chunk = os.pread(seg.fd, min(_READ_CHUNK, seg.size - at), at)
                    if not chunk:
                        break
                    f.write(chunk)
                    at += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        for seg in segments:  # their unread lines are all in `path` now
            if seg.path != self.path:
                seg.path.unlink(missing_ok=True)

    def append_closed(self, line: bytes) -> None:
        """Append one line durably while the log is closed (a record submitted after shutdown)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            _write_all(fd, line)
            _sync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.path.parent)


class Entry:
    """A submitted record: its line until it is in the log, then its position; kept until it is in SQL."""
    __slots__ = ("seq", "line", "record", "future", "end")

    def __init__(self, seq: int, line: bytes, record, future: Future):
        self.seq, self.line, self.record, self.future = seq, line, record, future
        self.end: Position | None = None  # position just past its line, once fsync'd


class GroupCommit:
    """The WAL thread: whatever was queued while it wrote the previous group goes out in one write and one
    fsync (group commit); then each entry gets its position, `on_durable(last seq)` runs under `lock` and
    the futures resolve (True). A failed write (disk full, I/O error) is retried with backoff, in order."""

    def __init__(self, wal: WriteAheadLog, lock: threading.Lock, on_durable: Callable,
                 retry_initial_s: float, retry_max_s: float):
        self.wal, self._on_durable = wal, on_durable
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._cond = threading.Condition(lock)
        self.pending: list[Entry] = []  # under the lock: accepted, not yet in the log, in line order
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._run_id = 0
        self._stopping = False
        self.failures = 0
        self._failing = False

    def put(self, entry: Entry) -> None:
        """Under the lock: queue `entry` for the next group."""
        self.pending.append(entry)
        if len(self.pending) == 1:
            self._cond.notify()

    def start(self) -> None:
        """Under the lock."""
        self._stopping = False
        self._run_id += 1
        self._thread = threading.Thread(target=self._run, args=(self._run_id,), name="ledger-wal", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Write what is queued, then end the thread; False if it is still stuck in a write after `timeout`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
        with self._cond:
            self._run_id += 1  # not stuck: a later start() runs a new thread
        return True

    def _run(self, run_id: int) -> None:
        backoff = self.retry_initial_s
        while True:
            with self._cond:
                while not self.pending or run_id != self._run_id:
                    if self._stopping or run_id != self._run_id:
                        return
                    self._cond.wait()
                group, self.pending = self.pending, []
            try:
                no, ends = self.wal.append([e.line for e in group])
            except Exception as exc:  # noqa: BLE001 - keep the lines, in order, and retry
                with self._cond:
                    self.pending[:0] = group
                    self.failures += 1
                    first, self._failing = not self._failing, True
                    stopping = self._stopping
                if first:
                    log.error("ledger: cannot write the log %s (%s: %s); %d records wait in memory, retrying",
                              self.wal.path, type(exc).__name__, exc, len(group))
                if stopping:
                    return  # shutting down: close() tries once more, then counts what is left as lost
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(backoff * 2, self.retry_max_s)
                continue
            backoff = self.retry_initial_s
            place(group, no, ends)  # before the lock: not yet visible to the SQL thread, which waits for on_durable
            with self._cond:
                self._on_durable(group[-1].seq)
                if self._failing:
                    self._failing = False
                    log.warning("ledger: the log %s is writable again", self.wal.path)
            for e in group:
                e.future.set_result(True)


def place(group: list[Entry], no: int, ends: list[int]) -> None:
    """`group` is fsync'd in segment `no`, each line ending at its offset in `ends`."""
    for e, end in zip(group, ends):
        e.end, e.line = (no, end), b""
