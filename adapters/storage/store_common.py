"""What both object-store backends (`store.FileStore`, `s3_store.S3Store`) share: key and prefix checks,
the redacted credential holder and the per-store operation counters.

This module exists so that the backends can live in their own files without importing each other.
"""
from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

CHUNK = 1 << 20
TMP_MARK = ".loramux-tmp-"  # FileStore temp files; key segments may not start with it


def check_key(key: str) -> str:
    """A key is a relative posix path: no empty, '.' or '..' segments, no backslash, no control chars."""
    if not isinstance(key, str) or not key:
        raise ValueError("object key must be a non-empty string")
    if len(key.encode("utf-8")) > 1024:
        raise ValueError("object key is longer than 1024 bytes")
    if key.startswith("/") or "\\" in key or any(ord(c) < 0x20 or c == "\x7f" for c in key):
        raise ValueError(f"invalid object key {key!r}: must be a relative posix path")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith(TMP_MARK):
            raise ValueError(f"invalid object key {key!r}: empty, '.', '..' or reserved path segment")
    return key


def check_prefix(prefix: str) -> str:
    """A listing prefix is "" or the start of a key (its last segment may be partial)."""
    if not isinstance(prefix, str):
        raise ValueError("list prefix must be a string")
    if not prefix:
        return prefix
    if prefix.startswith("/"):
        raise ValueError(f"invalid list prefix {prefix!r}: must be relative")
    head, _, last = prefix.rpartition("/")
    check_key(f"{head}/x" if head else "x")  # every complete segment must be valid
    if last in (".", "..") or "\\" in last or any(ord(c) < 0x20 for c in last):
        raise ValueError(f"invalid list prefix {prefix!r}")
    return prefix


def as_source(data: bytes | Path) -> bytes | Path:
    """The source of a `put`: bytes (a bytes-like object copied) or a Path."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, os.PathLike):
        return Path(data)
    raise TypeError(f"put() takes bytes or a Path, not {type(data).__name__}")


class Secret:
    """Holds a credential; its repr never shows it (so neither do repr(store) nor vars(store))."""

    __slots__ = ("value",)

    def __init__(self, value: str | None):
        self.value = value

    def __repr__(self) -> str:
        return "<redacted>" if self.value is not None else "None"


class Counted:
    """Per-store operation counters (for tests and metrics), incremented under a lock."""

    def __init__(self) -> None:
        self.counters: collections.Counter = collections.Counter()
        self._counter_lock = threading.Lock()

    def _count(self, op: str) -> None:
        with self._counter_lock:
            self.counters[op] += 1
