"""Shared timing helpers for the benchmark scripts."""
from __future__ import annotations

import math
import statistics
import time


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def median_seconds(fn, reps: int = 5) -> float:
    """Run fn once to warm up, then `reps` times; the median wall-clock seconds of one call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
