"""`loramux plan`: the memory arithmetic, checked against hand-computed numbers for Llama-2-7B."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loramux.cli import main
from loramux.model.config import ModelConfig
from loramux.plan import parse_bytes, plan_memory

CONFIG = Path(__file__).parent / "data" / "llama2-7b-config.json"


def test_llama2_7b_numbers():
    cfg = ModelConfig.from_hf(json.loads(CONFIG.read_text()))
    assert cfg.num_parameters() == 6_738_415_616  # the published Llama-2-7B parameter count
    plan = plan_memory(cfg, 2, context_len=4096, batch_size=8, adapter_pool=2 * 1024**3, adapter_rank=16)
    assert plan.weights == 6_738_415_616 * 2
    assert plan.kv_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    assert plan.kv_cache == 524_288 * 4096 * 8
    per_slot = 16 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096)) * 32 * 2
    assert per_slot == 79_953_920  # 76.25 MiB: a rank-16 adapter on all 7 projections in bf16
    assert plan.adapter_bytes == per_slot and plan.adapters_fit == 2 * 1024**3 // per_slot == 26


def test_plan_cli_says_whether_it_fits(capsys):
    assert main(["plan", "--config", str(CONFIG), "--dtype", "bf16", "--context-len", "4096", "--batch-size", "8",
                 "--memory", "80GB"]) == 0
    assert "fits in" in capsys.readouterr().out
    assert main(["plan", "--config", str(CONFIG), "--dtype", "bf16", "--memory", "16GiB"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--config", str(CONFIG), "--memory", "lots"]) == 2
    assert "24GiB" in capsys.readouterr().err


@pytest.mark.parametrize("text,value", [("24GiB", 24 * 1024**3), ("512MB", 512_000_000), ("1000", 1000),
                                        ("1.5g", 1_500_000_000)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_bad_model_and_settings_give_a_clear_error(capsys, monkeypatch, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    assert "neither" in capsys.readouterr().err
    monkeypatch.setenv("LORAMUX_ADAPTERS", "oops")
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "name=/path/to/adapter" in capsys.readouterr().err
