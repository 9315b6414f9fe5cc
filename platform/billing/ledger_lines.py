"""The ledger writer's line format and its file of refused records.

`encode` makes the JSON line of a record, as the write-ahead log (`ledger_wal`) stores it; the format is
the one the earlier spool file used, so a log left by an older version is replayed as it stands.
`RejectedFile` appends JSON lines of what can never become a ledger row (with the reason), from any thread.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import fields
from pathlib import Path

from loramux.billing.usage import RequestRecord

_FIELDS = tuple(f.name for f in fields(RequestRecord))


def encode(record: RequestRecord) -> bytes:
    """One log line holding `record` (raises ValueError / TypeError for what JSON cannot hold)."""
    data = {name: getattr(record, name) for name in _FIELDS}
    data["created_at"] = record.created_at.isoformat()
    return (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode()


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
