"""bench/hybrid.py stays runnable: its `--smoke` run (toy Qwen3.5 hybrid and dense Qwen3 models with SmolLM2's
tokenizer, 4 tokens, one round), with the default target groups and with the linear-attention ones alone."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ["hybrid_decode_vs_dense", "hybrid_mixed_vs_base"]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "hybrid.py"), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def figures(out: str) -> dict[str, str]:
    lines = out.strip().splitlines()
    assert [line.split()[:2] for line in lines[-2:]] == [["FIGURE", name] for name in FIGURES], out
    return {line.split()[1]: line.split()[2] for line in lines[-2:]}


def memory_rows(out: str) -> dict[str, list[int]]:
    """model -> [KV layers, state bytes, KV bytes at 4096, total] from the per-sequence memory table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("per-sequence memory")) + 2
    return {parts[0]: [int(p.replace(",", "")) for p in parts[1:5]]
            for parts in (line.split() for line in lines[start:start + 2])}


@pytest.mark.real_model
def test_hybrid_bench_smoke_prints_its_figures():
    """Dense base, hybrid base and 8 adapters at batch 8; the figures are positive, the memory table consistent, and
    a target group validation refuses is named, and said before the figures."""
    proc = run_bench("--smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out, out
    for name in ("dense qwen3 base", "hybrid base", "hybrid 8 adapters"):
        assert f"round 1/1 {name} " in out, out
    values = figures(out)
    assert float(values["hybrid_decode_vs_dense"]) > 0 and float(values["hybrid_mixed_vs_base"]) > 0, out
    rows = memory_rows(out)
    # toy shapes: 1 of 4 layers attends; the dense model has no state and KV on all 4 layers
    assert rows["hybrid"][0] == 1 and rows["dense"][0] == 4, out
    assert rows["hybrid"][1] > 0 and rows["dense"][1] == 0, out
    assert rows["dense"][2] == 4 * rows["hybrid"][2], out
    assert "-> dense / hybrid = " in out and "ceiling base / (base + LoRA) = " in out, out
    if "REFUSED target group" in out:
        assert out.strip().splitlines()[-3].startswith("NOTE hybrid_mixed_vs_base covers target groups "), out
    else:
        assert "NOTE " not in out, out


@pytest.mark.real_model
def test_hybrid_bench_linear_targets_alone_are_measured_or_refused_by_name():
    """`--targets linear`: with LoRA on the linear-attention projections the mixed figure is measured; without it
    the group is refused by name, the figure is n/a and the NOTE says why."""
    proc = run_bench("--smoke", "--targets", "linear")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    values = figures(out)
    assert float(values["hybrid_decode_vs_dense"]) > 0, out
    if "REFUSED target group linear (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj): " in out:
        assert values["hybrid_mixed_vs_base"] == "n/a", out
        assert out.strip().splitlines()[-3] == ("NOTE hybrid_mixed_vs_base n/a: validation refused every target "
                                                "group asked for (linear)"), out
        assert "round 1/1 hybrid 8 adapters" not in out, out
    else:
        assert float(values["hybrid_mixed_vs_base"]) > 0 and "on in_proj_qkv, in_proj_z" in out, out


def test_hybrid_bench_refuses_an_unknown_target_group():
    proc = run_bench("--smoke", "--targets", "mlp,experts")
    assert proc.returncode == 2, proc.stdout
    assert "--targets: unknown groups ['experts']" in proc.stderr, proc.stderr
