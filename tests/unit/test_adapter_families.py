"""Adapters by each family's own module names: Phi-3's fused qkv_proj / gate_up_proj LoRAs become the engine's
per-projection LoRAs exactly (PEFT's delta weights as the reference), and a target the base does not have
is refused with a message that names the family's modules."""
from __future__ import annotations

import json

import pytest
import torch

from loramux.adapters.formats.peft import load_adapter_dir
from loramux.adapters.formats.validation import AdapterValidationError, module_names
from loramux.model.config import ModelConfig
from loramux.testing import save_tiny_hf_model, write_peft_adapter

PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
SUB_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                   "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def config_of(path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    hf = save_tiny_hf_model(path, 300, "phi3", pad_token_id=0)
    return path, hf


def test_fused_phi3_lora_equals_peft_delta_per_sub_projection(phi3, tmp_path):
    from peft import LoraConfig, get_peft_model

    path, hf = phi3
    torch.manual_seed(0)
    peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=PHI3_TARGETS, init_lora_weights=False))
    peft.save_pretrained(tmp_path / "lora")
    cfg = config_of(path)
    adapter = load_adapter_dir(tmp_path / "lora", cfg)
    assert adapter.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for layer in range(cfg.num_layers):
        for fused, parts in SUB_PROJECTIONS.items():
            section = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            module = peft.base_model.model.model.layers[layer].get_submodule(f"{section}.{fused}")
            delta = module.get_delta_weight("default")  # [d_out of the fused module, d_in]
            ours = torch.cat([adapter.scale * adapter.weights[(layer, p)][1] @ adapter.weights[(layer, p)][0]
                              for p in parts])
            torch.testing.assert_close(ours, delta, msg=f"layer {layer} {fused}")


def test_module_names_and_all_linear_follow_the_family(phi3, tmp_path):
    path, _ = phi3
    cfg = config_of(path)
    assert module_names(cfg)[(0, "qkv_proj")] == "model.layers.0.self_attn.qkv_proj"
    assert (0, "q_proj") not in module_names(cfg)
    adapter_dir = write_peft_adapter(tmp_path / "all", cfg, 4, PHI3_TARGETS, seed=1)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    for targets in ("all-linear", r".*\.(qkv_proj|o_proj|gate_up_proj|down_proj)"):
        (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "target_modules": targets}))
        assert len(load_adapter_dir(adapter_dir, cfg).target_modules) == 7, targets


def test_a_target_the_family_does_not_have_is_refused_clearly(phi3, tmp_path, tiny_cfg):
    path, _ = phi3
    cfg = config_of(path)
    llama_style = write_peft_adapter(tmp_path / "split", tiny_cfg, 4, ["q_proj", "v_proj"], seed=2)
    with pytest.raises(AdapterValidationError, match="fuses q/k/v into qkv_proj") as refused:
        load_adapter_dir(llama_style, cfg)
    assert refused.value.code in ("unsupported_target", "shape_mismatch")
    fused = write_peft_adapter(tmp_path / "fused", cfg, 4, ["qkv_proj"], seed=3)
    with pytest.raises(AdapterValidationError, match="fused module of Phi-3") as refused:
        load_adapter_dir(fused, tiny_cfg)
    assert refused.value.code == "unsupported_target"
