"""bench/moe.py stays runnable: its `--smoke` run (a tiny random Qwen3-MoE with SmolLM2's tokenizer, no vLLM)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real_model
def test_moe_bench_smoke_prints_its_figures():
    """Base and 8 expert-LoRA adapters at batch 8, 4 tokens, one round; grouped vs dense on the captured steps."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out, out
    assert "round 1/1 loramux base" in out and "round 1/1 loramux 8 adapters" in out, out
    assert "ceiling base / (base + LoRA) = " in out and "routing implies " in out, out
    lines = out.strip().splitlines()
    assert [line.split()[:2] for line in lines[-3:]] == [
        ["FIGURE", "moe_mixed_vs_base"], ["FIGURE", "moe_base_vs_vllm"], ["FIGURE", "moe_grouped_vs_dense"]], out
    figures = {line.split()[1]: line.split()[2] for line in lines[-3:]}
    assert float(figures["moe_mixed_vs_base"]) > 0 and float(figures["moe_grouped_vs_dense"]) > 0, out
    assert figures["moe_base_vs_vllm"] == "n/a" and lines[-4].startswith("NOTE moe_base_vs_vllm n/a: --smoke"), out
