"""Benchmark scripts stay runnable: their `--smoke` runs (bench/smoke.py: the smallest sizes, on a tiny random Llama
with SmolLM2's tokenizer where a script loads a model; gpu_check's on the Triton interpreter)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_tiny_runs_and_passes():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke"], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "kernel checks: all ok" in out, out
    assert "BAD" not in out
    assert "decode ratio" in out and "tok/s" in out


@pytest.mark.real_model
def test_adapter_cache_levels_bench_runs_end_to_end():
    """Smoke mode: one round, 12-token streams, the tiny model; moto S3 in a subprocess."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "adapter_cache_levels.py"), "--smoke"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FIGURE cold_load_itl_p99_ratio" in proc.stdout and "FIGURE cold_s3_ttft_ms" in proc.stdout


@pytest.mark.real_model
def test_serve_load_bench_quick_run_reports_figures():
    """Smoke mode: loramux alone on the tiny model, its server in its own process, 5 s of open-loop Poisson arrivals
    at 1 request/s over HTTP (4 requests at the default seed), no closed loop, no files written."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serve_load.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out and "open-loop poisson" in out.lower(), out
    assert "requests: sent 4, ok 4, failed 0" in out, out
    assert "loramux sustainable load: " in out and "at 1 req/s: goodput " in out, out  # SLOs depend on the machine
    lines = out.strip().splitlines()
    names = ["sustainable_req_s", "goodput_vs_vllm", "peak_tok_s_vs_vllm", "ttft_p50_ms", "throughput_tok_s"]
    assert [line.split()[:2] for line in lines[-5:]] == [["FIGURE", n] for n in names], out
    values = {n: float(line.split()[2]) for n, line in zip(names, lines[-5:])}
    assert values["sustainable_req_s"] in (0.0, 1.0), out  # the only rate offered, or none
    assert math.isnan(values["goodput_vs_vllm"]) and math.isnan(values["peak_tok_s_vs_vllm"]), out  # no peer
    assert values["ttft_p50_ms"] > 0 and values["throughput_tok_s"] > 0, out


@pytest.mark.real_model
def test_prefix_cache_bench_quick_run_reports_ratio():
    """Smoke mode: one round of 3 prompts (512-token shared prefix + 32-token suffix), loramux and HF, on the tiny
    model. One torch thread: on a 2-vCPU machine shared with other jobs, two threads oversubscribe."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "prefix_cache.py"), "--smoke", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "loramux num_cached_tokens: cached [512], uncached [0]" in out, out
    assert "| loramux |" in out and "| HF transformers" in out and "hf_prefix_ttft_ratio " in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FIGURE prefix_ttft_ratio "), out
    assert 0 < float(last.split()[-1]) < 0.5, out  # reusing 512 of 544 tokens must pay off


@pytest.mark.real_model
def test_speculative_bench_quick_run_reports_figure():
    """Smoke mode, on the tiny model with random Medusa heads: Medusa on one chat prompt and 16 adaptive streams,
    then 2 summarisation prompts, 16 tokens, K=4, one round, loramux and HF prompt lookup."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "speculative.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "ENGINE BUG" not in out and "HF lookup K=4" in out and "loramux K=4" in out, out
    figures = dict(line.split()[1:] for line in out.splitlines() if line.startswith("FIGURE "))
    assert float(figures["medusa_speedup_b1"]) > 0 and float(figures["spec_b16_on_vs_off"]) > 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FIGURE spec_speedup "), out
    assert float(last.split()[-1]) > 0


def test_ledger_durability_bench_quick_run_reports_figure():
    """Smoke mode: one round of 0.5 s phases on SQLite; every submitted record reaches SQL exactly once."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ledger_durability.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out and "durable submit, open loop" in out, out
    assert "lost 0" in out and "LEDGER BUG" not in proc.stderr, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FIGURE ledger_final_chunk_p99_ms "), out
    assert float(last.split()[-1]) > 0


def test_budgets_bench_quick_run_reports_figures():
    """Smoke mode: one short round on SQLite; every reservation is replaced by its ledger row."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "budgets.py"), "--smoke"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "machine: " in proc.stdout and "BUDGET BUG" not in proc.stderr
    assert [line.split()[1] for line in lines[-3:]] == ["budget_reserve_p50_ms", "budget_admissions_per_s",
                                                       "budget_ledger_batch_ratio"]
    assert all(float(line.split()[-1]) > 0 for line in lines[-3:])


@pytest.mark.real_model
def test_many_adapters_bench_quick_run_reports_figures(tmp_path):
    """Smoke mode: the base model, the table set (1 and uniform over 8) and the mixed set at N 1 and 8, 2 clients,
    8 tokens, 4 s windows, over HTTP with adapters uploaded through the admin API, on the tiny model; JSON and plot
    written."""
    out_json, out_png = tmp_path / "many_adapters.json", tmp_path / "many_adapters.png"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "many_adapters.py"), "--smoke", "--json",
                           str(out_json), "--plot", str(out_png)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "SIMD " in out and "torch " in out, out
    assert "uploaded 16 adapters through the admin API" in out and "FAILURES" not in out, out
    for name in ("base", "table-1", "table-uniform-8", "mixed-uniform-1", "mixed-uniform-8", "mixed-zipf-8"):
        assert f"\n{name} " in out, out
    lines = out.strip().splitlines()[-4:]
    names = ["adapters_64_vs_base_tok_s", "adapters_64_ttft_p50_ratio", "adapters_1000_vs_8_tok_s",
             "adapters_1000_ttft_p99_ms"]
    assert [line.split()[:2] for line in lines] == [["FIGURE", n] for n in names], out
    values = dict(line.split()[1:] for line in lines)
    assert float(values["adapters_64_vs_base_tok_s"]) > 0 and float(values["adapters_1000_vs_8_tok_s"]) > 0, out
    # Latency figures need a request to end inside a 4 s window: nan on a slow machine is fine for a smoke run.
    assert all(float(v) > 0 or v == "nan" for v in values.values()), out
    results = json.loads(out_json.read_text())
    assert results["uploads"]["adapters"] == 16
    assert all(r["failures"] == {} for r in results["scenarios"].values()), results["scenarios"]
    assert out_png.is_file() or "matplotlib is not installed" in out


def test_structured_bench_tiny_run_reports_the_step_overhead():
    """Smoke mode: the tiny random model (SmolLM2's tokenizer), one round of 8 rows x 8 tokens with 0, 1 and 8
    rows under the JSON schema; every row decodes to its max_tokens."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "structured.py"), "--smoke", "--threads", "1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out and "round 1/1: none " in out, out
    for name in ("none (0/8", "one  (1/8", "all  (8/8"):
        assert name in out, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FIGURE json_schema_step_overhead "), out
    assert float(last.split()[-1]) > 0


def test_model_families_bench_quick_run_measures_both_families(tmp_path):
    """Smoke mode without vLLM: tiny shapes of Qwen3 and Llama 3 built into --models-dir, 8 adapters, each family
    decodes exactly its tokens; no FIGURE lines without the peer."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "model_families.py"), "--smoke",
                           "--models-dir", str(tmp_path), "--threads", "1"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "machine: " in out and "lscpu flags: " in out, out
    for family in ("Qwen3-0.6B (tiny shapes)", "Llama-3.2-1B (tiny shapes)"):
        assert f"{family}: round 1/1 loramux" in out, out
    assert "FIGURE" not in out, out
    assert json.loads((tmp_path / "qwen3_0p6b-tiny" / "config.json").read_text())["architectures"] == \
        ["Qwen3ForCausalLM"]
