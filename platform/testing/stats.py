"""The statistics bench figures are made of."""
from __future__ import annotations

import math
import statistics
import time


def percentile(values, q: float) -> float:
    """The nearest-rank q-th percentile (q in 0..100) of `values`: the smallest value with at least q% of
    the values at or below it, i.e. sorted(values)[ceil(q / 100 * n) - 1] (q = 0: the minimum). Always one
    of the values, never interpolated; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
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
