"""A thread-safe cumulative histogram of durations or sizes (torch-free, no Prometheus types).

Components that time things (device adapter loads, host-RAM loads from disk or the object store) keep one
of these; `/metrics` renders its `snapshot()` as a Prometheus histogram at scrape time, so the timed code
never depends on the metrics layer.
"""
from __future__ import annotations

import bisect
import math
import threading

# Adapter loads: 0.5 ms (a device copy of a small adapter) .. 30 s (a large download).
LOAD_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                                     5.0, 10.0, 30.0)


class DurationHistogram:
    """Counts of observed durations (seconds) per upper bound, plus their sum and count."""

    def __init__(self, buckets: tuple[float, ...] = LOAD_BUCKETS_S):
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError("buckets must be distinct and ascending")
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        """Record one duration; negative, NaN or infinite values are ignored (a clock glitch is no sample)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
            self._sum += seconds

    def reset(self) -> None:
        with self._lock:
            self._counts = [0] * (len(self.buckets) + 1)
            self._sum = 0.0

    def snapshot(self) -> dict:
        """{"buckets": [(upper bound, cumulative count), ..., (inf, count)], "sum": seconds, "count": n}."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.buckets, math.inf), counts):
            running += n
            cumulative.append((bound, running))
        return {"buckets": cumulative, "sum": total, "count": running}
