"""The ledger writer's files: the spool of records not yet in SQL, and the file of records SQL refused.

`SpoolFile` is an append-only file of JSON lines, fsync'd on every append; the bytes [offset, size) are
not yet in SQL and hold `pending` lines. `epoch` changes whenever the file is reopened, emptied or closed,
so that a batch read from an older generation is never committed against a newer one. A line cut short
by a crash is ended when the file is reopened (and then rejected as unreadable). It is not thread-safe:
`LedgerWriter` calls it under its own lock. `RejectedFile` appends JSON lines, from any thread.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from loramux.adapters.store_common import fsync_dir
from loramux.usage import RequestRecord

log = logging.getLogger("loramux.admin.ledger")  # the writer's own logger: these are its messages

_READ_CHUNK = 1 << 20


def encode(record: RequestRecord) -> bytes:
    """One spool line holding `record`."""
    data = record.as_dict()
    data["created_at"] = record.created_at.isoformat()
    return (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode()


class SpoolFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._out = None
        self._in = None
        self.size = self.offset = self.epoch = self.pending = 0

    @property
    def ready(self) -> bool:
        """Lines past the committed offset are waiting to be read."""
        return self.offset < self.size

    def open(self) -> None:
        """Open the file (creating it), counting the lines an earlier run left in it; they are replayed."""
        if self._out is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.path, "ab")
        size = out.seek(0, os.SEEK_END)
        lines = 0
        if size:
            with open(self.path, "rb") as f:
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
            log.warning("ledger: replaying %d spooled records from %s", lines, self.path)
        self._out = out
        self._in = open(self.path, "rb", buffering=0)  # read with pread: never a stale buffer
        self.size, self.offset, self.pending = size, 0, lines
        self.epoch += 1

    def close(self) -> None:
        for f in (self._out, self._in):
            if f is not None:
                f.close()
        self._out = self._in = None
        self.size = self.offset = 0
        self.epoch += 1

    def append(self, records: list[RequestRecord]) -> None:
        """Append `records` durably (opening the file if needed); on failure the file stays line-aligned."""
        self.open()
        data = b"".join(encode(r) for r in records)
        try:
            self._out.write(data)
            self._out.flush()
            os.fsync(self._out.fileno())
        except BaseException:
            try:  # drop a partial line so the file stays line-aligned
                self._out.truncate(self.size)
            except OSError:
                pass
            raise
        self.size += len(data)
        self.pending += len(records)

    def read_lines(self, max_lines: int) -> Iterator[tuple[bytes, int]]:
        """Up to `max_lines` whole lines from the committed offset, each with the file offset just past it."""
        fd = self._in.fileno()
        position = self.offset  # file offset of buf[start]
        buf, start, lines = b"", 0, 0
        while lines < max_lines:
            end = buf.find(b"\n", start)
            if end < 0:
                read_at = position + len(buf) - start
                if read_at >= self.size:
                    break
                chunk = os.pread(fd, min(_READ_CHUNK, self.size - read_at), read_at)
                if not chunk:
                    break
                buf, start = buf[start:] + chunk, 0
                continue
            line = buf[start:end + 1]
            start = end + 1
            position += len(line)
            lines += 1
            yield line, position

    def commit(self, end_offset: int, lines: int) -> None:
        """`lines` lines up to `end_offset` are in SQL; once all of the file is, start it afresh."""
        self.offset = end_offset
        self.pending = max(0, self.pending - lines)
        if self.offset >= self.size:  # all of it is in SQL: start the file afresh
            self._out.truncate(0)
            os.fsync(self._out.fileno())
            self.offset = self.size = self.pending = 0
            self.epoch += 1

    def forget_unread(self) -> None:
        """The file is shorter than written (changed by someone else): give up on what was past the offset."""
        self.size, self.pending = self.offset, 0

    def compact(self, leftovers: list[RequestRecord]) -> None:
        """Rewrite the spool as: `leftovers` (records still in memory), then the lines not yet in SQL (atomic)."""
        if self._out is None and not leftovers:
            return
        self.open()
        if not leftovers and self.offset == 0:
            return
        count = len(leftovers) + self.pending
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(encode(r) for r in leftovers))
            position = self.offset
            while position < self.size:
                chunk = os.pread(self._in.fileno(), min(_READ_CHUNK, self.size - position), position)
                if not chunk:
                    break
                f.write(chunk)
                position += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self.pending = count
        if leftovers:
            log.warning("ledger: %d unwritten records spooled to %s", len(leftovers), self.path)


class RejectedFile:
    """JSON lines of what can never become a ledger row, each with the reason; fsync'd, thread-safe."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()

    def append(self, entries: list[dict]) -> None:
        data = b"".join((json.dumps(e, separators=(",", ":"), default=str) + "\n").encode() for e in entries)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
