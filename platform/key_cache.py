"""A small, bounded, thread-safe TTL cache for key lookups (tenant keys and admin keys).

Authenticating a request must not cost a SQL round trip, yet a revoked key or a changed tier must take
effect within seconds. `invalidate()` bumps a generation: an answer looked up before the bump is never
stored after it, so a lookup racing with a revocation cannot re-insert the stale answer.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")

MAX_KEY_CHARS = 128


def hash_key(raw: str) -> str:
    """What is stored of a key: its sha256 (hex)."""
    return hashlib.sha256(raw.encode()).hexdigest()


class KeyCache(Generic[V]):
    def __init__(self, ttl_s: float, max_entries: int = 10_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries  # bounded: a flood of unknown keys must not grow it forever
        self._entries: dict[str, tuple[float, V]] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def authenticate(self, raw: str, prefix: str, lookup: Callable[[str], V | None]) -> V | None:
        """The answer for a raw key: None when it does not have the form `prefix...`, else the cached or
        freshly looked-up `lookup(sha256 of the key)` (None for an unknown or revoked key)."""
        if not raw.startswith(prefix) or len(raw) > MAX_KEY_CHARS:
            return None
        digest = hash_key(raw)
        return self.get_or_load(digest, lambda: lookup(digest))

    def get_or_load(self, digest: str, load: Callable[[], V]) -> V:
        """The cached answer for `digest`, else `load()` (called outside the lock) and remember it."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(digest)
            if hit is not None and hit[0] > now:
                return hit[1]
            generation = self._generation
        value = load()
        with self._lock:
            if generation == self._generation:  # nothing was invalidated while we looked it up
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[digest] = (now + self.ttl_s, value)
        return value

    def invalidate(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()
