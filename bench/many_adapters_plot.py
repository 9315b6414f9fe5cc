"""Plot of bench/many_adapters.py's mixed-set sweep: output tok/s and TTFT p99 against N (log x), uniform and Zipf.

Called by the bench; also standalone from its --json: `python bench/many_adapters_plot.py results.json out.png`.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

POPULARITIES = ("uniform", "zipf")


def mixed_points(rows: dict[str, dict], popularity: str) -> dict[int, dict]:
    """{N: metrics} of the mixed sweep for one popularity. At N=1 every popularity is the same load, so the bench
    runs it once (mixed-uniform-1) and it stands for both."""
    points = {int(name.rsplit("-", 1)[1]): m for name, m in rows.items() if name.startswith(f"mixed-{popularity}-")}
    if 1 not in points and "mixed-uniform-1" in rows:
        points[1] = rows["mixed-uniform-1"]
    return dict(sorted(points.items()))


def plot(rows: dict[str, dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = sorted({n for pop in POPULARITIES for n in mixed_points(rows, pop)})
    for ax, key, label in zip(axes, ("tok_s", "ttft_p99_ms"), ("output tok/s", "TTFT p99 (ms)")):
        for pop in POPULARITIES:
            points = mixed_points(rows, pop)
            ax.plot(list(points), [m[key] for m in points.values()], "o-", label=f"mixed set, {pop}")
        if "base" in rows:
            ax.axhline(rows["base"][key], ls="--", c="grey", label="base model")
        ax.set_xscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("distinct adapters N")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    results = json.loads(Path(sys.argv[1]).read_text())
    rows = {name: {k: float("nan") if v is None else v for k, v in m.items()}  # the JSON has null for NaN
            for name, m in results["scenarios"].items()}
    plot(rows, Path(sys.argv[2]), results["machine"])
