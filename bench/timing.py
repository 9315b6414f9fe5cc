"""Shared timing helpers for the benchmark scripts."""
from __future__ import annotations

import math
import statistics
import subprocess
import time
from pathlib import Path


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


def cpu_model_and_flags() -> tuple[str, str]:
    """(CPU model name, space-separated flags) from lscpu, else /proc/cpuinfo: printed with every figure,
    because results differ between CPU classes (AVX2 / AVX-512 / AMX, Intel / AMD)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if not out:
        try:
            out = Path("/proc/cpuinfo").read_text().replace("model name", "Model name").replace("flags", "Flags")
        except OSError:
            out = ""
    info: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info.get("Model name", "unknown CPU"), info.get("Flags", "unknown")
