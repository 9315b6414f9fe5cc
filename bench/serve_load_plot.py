"""Plot of bench/serve_load.py's offered-load sweep: one PNG, 2x2 panels against offered load (req/s), one line per
engine: output tok/s (closed-loop peak dotted), goodput req/s (y = x dashed: every offered request meeting the SLO),
TTFT p99 and inter-token p99 (log y). Medians over rounds, as in the JSON.

Called by the bench; also standalone: `python bench/serve_load_plot.py docs/serve_load.json docs/serve_load.png`.
"""
from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

PANELS = (("tok_s", "output tok/s", False), ("goodput_req_s", "goodput (req/s meeting the SLO)", False),
          ("ttft_p99_ms", "TTFT p99 (ms)", True), ("itl_p99_ms", "inter-token p99 (ms)", True))
COLOURS = {"loramux": "tab:blue", "vllm": "tab:orange"}  # vllm@N variants: the next colours of the cycle


def colour(name: str) -> str:
    if name in COLOURS:
        return COLOURS[name]
    variants = sorted(n for n in _seen if n not in COLOURS)
    return ("tab:red", "tab:green", "tab:purple", "tab:brown")[variants.index(name) % 4]


_seen: set[str] = set()


def _num(value) -> float:
    return math.nan if value is None else float(value)


def series(engine: dict, key: str) -> tuple[list[float], list[float]]:
    """(offered req/s, values of `key`) of one engine's median sweep; JSON nulls become NaN."""
    points = sorted((p["offered_req_s"], _num(p.get(key))) for p in engine.get("open") or [])
    return [x for x, _ in points], [y for _, y in points]


def _g(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def title(results: dict) -> str:
    m, c = results.get("machine", {}), results.get("config", {})
    return (f"serve_load: open-loop Poisson sweep, mixed tiers / 4 LoRA adapters / prompt and output lengths; "
            f"SLO TTFT <= {_g(c.get('slo_ttft_ms'))} ms, own ITL p99 <= {_g(c.get('slo_itl_ms'))} ms; medians of "
            f"{_g(c.get('rounds'))} round(s), {_g(c.get('duration_s'))} s per rate. {m.get('cpu', 'unknown CPU')}, "
            f"{m.get('logical_cpus')} logical CPUs ({m.get('simd', '')}), {m.get('threads')} threads per engine; "
            f"{results.get('date', '')}")


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return False
    engines = {name: e for name, e in results.get("engines", {}).items() if e.get("open")}
    _seen.update(engines)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    offered = sorted({x for e in engines.values() for x in series(e, "tok_s")[0]})
    for ax, (key, label, log_y) in zip(axes.flat, PANELS):
        for name, e in engines.items():
            xs, ys = series(e, key)
            ax.plot(xs, ys, "o-", color=colour(name), label=name)
            closed = e.get("closed") or {}
            if key == "tok_s" and closed.get("tok_s") is not None:
                ax.axhline(closed["tok_s"], ls=":", color=colour(name),
                           label=f"{name} closed loop, {_g(closed.get('clients', '?'))} clients")
            sustainable = e.get("sustainable_req_s")
            if key == "goodput_req_s" and sustainable:
                ax.axvline(sustainable, ls="-.", lw=0.8, color=colour(name),
                           label=f"{name} sustainable {sustainable:g} req/s")
        if key == "goodput_req_s" and offered:
            ax.plot([0, max(offered)], [0, max(offered)], "--", color="grey", lw=1, label="ideal (y = x)")
        if log_y and any(y > 0 for e in engines.values() for y in series(e, key)[1] if not math.isnan(y)):
            ax.set_yscale("log")
            for axis_fmt in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
                axis_fmt(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        if not log_y:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title(results), 140)), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: serve_load_plot.py RESULTS.json OUT.png")
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
