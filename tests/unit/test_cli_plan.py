"""`loramux plan`: the memory arithmetic, checked against hand-computed numbers for Llama-2-7B."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from loramux.cli import main
from loramux.model.config import ModelConfig
from loramux.model.loader import read_model_config
from loramux.plan import fmt_bytes, parse_bytes, plan_memory

CONFIG = Path(__file__).parents[1] / "data" / "llama2-7b-config.json"


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


PLAN_FAMILIES = {
    "qwen3": ("qwen3", {"head_dim": 32}),
    "gemma2": ("gemma2", {"head_dim": 16}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "num_hidden_layers": 6, "sliding_window": 64}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "qwen2": ("qwen2", {}),
    "mistral-window": ("mistral", {"sliding_window": 64}),
}


@pytest.mark.parametrize("family", sorted(PLAN_FAMILIES))
def test_each_family_counts_its_parameters_as_hf_does(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = PLAN_FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, **overrides})
    hf = AutoModelForCausalLM.from_config(config)
    ours = ModelConfig.from_hf(config.to_dict())
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())  # tied weights counted once


def test_the_plan_names_the_family_and_caps_windowed_kv(tmp_path, capsys):
    from transformers import AutoConfig

    for model_type, overrides, expect in [
        ("mistral", {"sliding_window": 512}, "sliding window of 512 on every layer: a sequence holds at most 544"),
        ("gemma3_text", {"sliding_window": 512}, "5 of 6 layers are local (window 512)"),
    ]:
        config = AutoConfig.for_model(model_type, vocab_size=1000, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                      **overrides)
        path = tmp_path / f"{model_type}.json"
        path.write_text(json.dumps(config.to_dict()))
        assert main(["plan", "--config", str(path), "--context-len", "4096", "--batch-size", "2"]) == 0
        out = capsys.readouterr().out
        assert f"model: {model_type}," in out and expect in out, out
    cfg = ModelConfig.from_hf(json.loads((tmp_path / "mistral.json").read_text()))
    full = plan_memory(cfg, 2, 4096, 2, 0, 16, block_size=16)
    assert full.kv_cache == full.kv_per_token * (512 + 32) * 2


def test_plan_counts_speculators(tmp_path, capsys, monkeypatch, tokenizer):
    """Medusa heads per set, and a draft model's weights and its own KV pool in the total."""
    from loramux.testing import save_tiny_hf_model

    cfg = ModelConfig.from_hf(json.loads(CONFIG.read_text()))
    assert plan_memory(cfg, 2, 4096, 8, 0, 16).medusa_bytes == 3 * (4096 * 4096 + 4096) * 2
    draft = tmp_path / "draft"
    save_tiny_hf_model(draft, vocab_size=len(tokenizer), tokenizer=tokenizer)
    draft_cfg, _ = read_model_config(draft)
    monkeypatch.setenv("LORAMUX_DRAFT_MODEL", str(draft))
    monkeypatch.setenv("LORAMUX_DRAFT_KV_CACHE_BYTES", str(1024**2))
    assert main(["plan", "--config", str(CONFIG), "--dtype", "bf16", "--adapter-pool", "0"]) == 0
    out = capsys.readouterr().out
    assert "draft model" in out and "2 layers" in out and "Medusa heads: 96.0 MiB" in out
    plan = plan_memory(cfg, 2, 4096, 16, 0, 16)
    expected = plan.total + draft_cfg.num_parameters() * 2 + 1024**2
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert total.split(None, 1)[1].strip() == fmt_bytes(expected), (total, fmt_bytes(expected), fmt_bytes(plan.total))
