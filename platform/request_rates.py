"""Recent request counts per adapter (last minute, last five minutes), in bounded memory, torch-free.

The server records one request per adapter id when a request's adapter has resolved; the admin API reads
the counts (`GET /admin/adapters/{id}`). Requests are counted per whole second of a monotonic clock, so one
adapter holds at most `LONG_WINDOW_S` (second, count) pairs however many requests it gets, and at most
`max_adapters` adapters are tracked: recording a new one past that drops the one recorded least recently
(its counts were the oldest). Counts are exact to the second: "last 60 s" is the current second and the
59 before it. Thread-safe: one lock, held for a few dictionary operations.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

SHORT_WINDOW_S = 60
LONG_WINDOW_S = 300
DEFAULT_MAX_ADAPTERS = 10_000


@dataclass(frozen=True)
class RecentRequests:
    last_60s: int
    last_300s: int
    per_minute: float  # the average rate over the last 300 s, in requests per minute


class RequestRates:
    """Per-adapter request counts over the last `SHORT_WINDOW_S` and `LONG_WINDOW_S` seconds."""

    def __init__(self, max_adapters: int = DEFAULT_MAX_ADAPTERS, clock: Callable[[], float] = time.monotonic):
        if max_adapters < 1:
            raise ValueError("max_adapters must be >= 1")
        self.max_adapters = max_adapters
        self._clock = clock
        self._lock = threading.Lock()
        # adapter id -> deque of [second, count], oldest second first; ids in order of their last record
        self._seconds: OrderedDict[str, deque[list[int]]] = OrderedDict()

    def __len__(self) -> int:
        """Adapters tracked now (at most `max_adapters`)."""
        with self._lock:
            return len(self._seconds)

    def record(self, adapter_id: str) -> None:
        """Count one request for `adapter_id` now."""
        second = int(self._clock())
        with self._lock:
            buckets = self._seconds.get(adapter_id)
            if buckets is None:
                buckets = self._seconds[adapter_id] = deque()
                while len(self._seconds) > self.max_adapters:
                    self._seconds.popitem(last=False)
            else:
                self._seconds.move_to_end(adapter_id)
            if buckets and buckets[-1][0] == second:
                buckets[-1][1] += 1
            elif buckets and buckets[-1][0] > second:  # a clock that stepped back: count it with the latest
                buckets[-1][1] += 1
            else:
                buckets.append([second, 1])
            _expire(buckets, second)

    def recent(self, adapter_id: str) -> RecentRequests:
        """The counts of `adapter_id` (zeros for an id never recorded or dropped); reading tracks nothing."""
        second = int(self._clock())
        short = long = 0
        with self._lock:
            buckets = self._seconds.get(adapter_id)
            if buckets is not None:
                _expire(buckets, second)
                for at, n in buckets:
                    long += n
                    if at > second - SHORT_WINDOW_S:
                        short += n
        return RecentRequests(last_60s=short, last_300s=long, per_minute=long * 60 / LONG_WINDOW_S)


def _expire(buckets: deque[list[int]], second: int) -> None:
    """Drop the seconds that left the long window (caller holds the lock)."""
    while buckets and buckets[0][0] <= second - LONG_WINDOW_S:
        buckets.popleft()


__all__ = ["LONG_WINDOW_S", "SHORT_WINDOW_S", "RecentRequests", "RequestRates"]
