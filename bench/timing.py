"""Shared timing helper for the benchmark scripts."""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, reps: int = 5) -> float:
    """Run fn once to warm up, then `reps` times; the median wall-clock seconds of one call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
