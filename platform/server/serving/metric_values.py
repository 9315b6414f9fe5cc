"""Reading numbers out of the engine's state for the metrics: every value is checked, and one that is missing or
not a number is left out rather than exported (or failing the scrape)."""
from __future__ import annotations

import math
from collections.abc import Mapping

from prometheus_client.utils import floatToGoString

__all__ = ["count", "finite", "histogram", "names", "seconds"]


def finite(value) -> float | None:
    """`value` as a finite float, or None (missing, a bool, not a number, NaN or infinite)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def seconds(value: float | None) -> float | None:
    """A duration fit to observe, or None; negatives -> 0."""
    value = finite(value)
    return None if value is None else max(0.0, value)


def count(value) -> float | None:
    """A non-negative finite number (counter increment or state value), or None."""
    value = finite(value)
    return None if value is None or value < 0 else value


def names(value) -> str:
    """Adapter names (a list, tuple or set of str) comma-joined, sorted and unique; anything else -> "".
    A name that could not be told apart in the joined list (empty, or with a comma) is left out."""
    if not isinstance(value, (list, tuple, set, frozenset)):
        return ""
    return ",".join(sorted({v for v in value if isinstance(v, str) and v and "," not in v}))


def histogram(snapshot) -> tuple[list[tuple[str, float]], float] | None:
    """A `DurationHistogram.snapshot()` as HistogramMetricFamily buckets [(le, cumulative count)] and sum, or
    None if it is not one: bounds ascending and ending at +Inf, counts non-negative and non-decreasing."""
    if not isinstance(snapshot, Mapping):
        return None
    raw, total = snapshot.get("buckets"), finite(snapshot.get("sum"))
    if not isinstance(raw, (list, tuple)) or not raw or total is None:
        return None
    buckets: list[tuple[str, float]] = []
    last_bound, last_count = -math.inf, 0.0
    for item in raw:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or isinstance(item[0], bool):
            return None
        try:
            bound = float(item[0])
        except (TypeError, ValueError):
            return None
        cumulative = count(item[1])
        if math.isnan(bound) or bound <= last_bound or cumulative is None or cumulative < last_count:
            return None
        buckets.append((floatToGoString(bound), cumulative))
        last_bound, last_count = bound, cumulative
    if last_bound != math.inf:
        return None
    return buckets, max(0.0, total)
