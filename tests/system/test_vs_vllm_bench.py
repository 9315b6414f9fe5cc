"""bench/vs_vllm.py stays runnable without vLLM: its `--loramux-only --smoke` run (the tiny model)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real_model
def test_vs_vllm_bench_loramux_only_quick_reports_figures():
    """b8 base-only and U=8 (plus int8 U=8 when Settings has `quantization`), 4 tokens per request, one round,
    loramux alone, on the tiny model. One thread: two oversubscribe a 2-vCPU machine shared with other jobs."""
    from loramux.settings import Settings

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vs_vllm.py"), "--loramux-only", "--smoke",
                           "--threads", "1"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out, out
    assert "figures vs vLLM not printed: --loramux-only" in out, out
    assert "warm-up b8 base-only" in out and "round 1/1 b8 U=8" in out, out
    figures = [line.split() for line in out.strip().splitlines() if line.startswith("FIGURE ")]
    names = ["mixed_vs_base_b8"] + (["int8_vs_fp32_b8"] if "quantization" in Settings.model_fields else [])
    assert [f[1] for f in figures] == names, out
    assert out.strip().splitlines()[-len(names):] == [" ".join(f) for f in figures], out  # figures come last
    assert all(float(f[2]) > 0 for f in figures), out
    if "quantization" not in Settings.model_fields:
        assert "int8: skipped" in out, out
