"""A small, bounded, thread-safe TTL cache for key lookups (tenant keys and admin keys).

Authenticating a request must not cost a SQL round trip, yet a revoked key or a changed tier must take
effect within seconds. `invalidate()` bumps a generation: an answer looked up before the bump is never
stored after it, so a lookup racing with a revocation cannot re-insert the stale answer.

Known keys and unknown ones live apart: a "no such key" answer (None) goes to a bounded negative side,
cleared when it fills, so a flood of random keys never pushes out a real tenant's cached answer. The
positive side only holds answers for keys that exist, so only real keys can fill it.
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
    def __init__(self, ttl_s: float, max_entries: int = 10_000, max_negative: int = 10_000):
        self.ttl_s = ttl_s
        self.max_entries = max_entries  # answers for keys that exist (only real keys can fill it)
        self.max_negative = max_negative  # "unknown key" answers: bounded, so a flood cannot grow it forever
        self._entries: dict[str, tuple[float, V]] = {}
        self._negative: dict[str, float] = {}  # digest -> expiry of its None answer
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
        """The cached answer for `digest`, else `load()` (called outside the lock) and remember it: a None
        answer on the negative side, anything else on the positive side, each cleared only when it fills."""
        now = time.monotonic()
        with self._lock:
            hit = self._entries.get(digest)
            if hit is not None and hit[0] > now:
                return hit[1]
            expiry = self._negative.get(digest)
            if expiry is not None and expiry > now:
                return None  # what load() answered for it
            generation = self._generation
        value = load()
        with self._lock:
            if generation == self._generation:  # nothing was invalidated while we looked it up
                side = self._negative if value is None else self._entries
                if len(side) >= (self.max_negative if value is None else self.max_entries):
                    side.clear()
                if value is None:
                    self._entries.pop(digest, None)
                    self._negative[digest] = now + self.ttl_s
                else:
                    self._negative.pop(digest, None)
                    self._entries[digest] = (now + self.ttl_s, value)
        return value

    def invalidate(self) -> None:
        with self._lock:
            self._generation += 1
            self._entries.clear()
            self._negative.clear()
