"""Bring your own base model, through the server: a tiny Qwen3, Gemma 3, Qwen3-MoE and Qwen3.5 directory served
with LORAMUX_MODEL=<dir> and a PEFT adapter from LORAMUX_ADAPTERS (on Qwen3-MoE, LoRA on the routed experts through
`target_parameters` as well as on attention; on the hybrid Qwen3.5, on its linear-attention projections too); the
official openai client gets, for a chat request with the adapter, the text HF transformers + PEFT generate for the
same chat."""
from __future__ import annotations

import openai
import pytest
import torch

from conftest import new_tenant_key
from loramux.model.loader import end_of_turn_ids, read_model_config
from loramux.server.app import create_app
from loramux.services.container import Services
from loramux.settings import Settings
from loramux.testing import LiveServer, save_tiny_hf_model

CHAT = [{"role": "user", "content": "Name three rivers of Europe."}]
ADMIN_KEY = "lmxa-family-serving-0123456789abcdef"
NEW_TOKENS = 12
DENSE_TARGETS = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
FAMILIES = {  # name: (model_type, config overrides, LoRA targets)
    "qwen3": ("qwen3", {"head_dim": 32}, DENSE_TARGETS),
    "gemma3": ("gemma3_text", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
               DENSE_TARGETS),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, "norm_topk_prob": True},
                  {"target_modules": ["q_proj", "v_proj"],
                   "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}),
    "qwen3_5": ("qwen3_5_text", {"head_dim": 16, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                                 "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
                {"target_modules": ["q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                                    "down_proj"]}),
}


@pytest.fixture(params=sorted(FAMILIES))
def served_family(request, tmp_path, tokenizer, monkeypatch):
    """(server, tenant key, adapter name, HF + PEFT's text for CHAT with the adapter)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    name = request.param
    model_type, overrides, targets = FAMILIES[name]
    model_dir, adapter_dir = tmp_path / f"{name}-tiny", tmp_path / f"{name}-lora"
    hf = save_tiny_hf_model(model_dir, len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer,
                            **overrides)
    torch.manual_seed(3)
    get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **targets)
                   ).save_pretrained(adapter_dir)

    cfg, _ = read_model_config(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    base.generation_config.eos_token_id = list(end_of_turn_ids(tokenizer, cfg, model_dir))  # where the server stops
    base.generation_config.pad_token_id = 0
    peft = PeftModel.from_pretrained(base, adapter_dir).eval()
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.inference_mode():
        out = peft.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)

    for key, value in {"MODEL": str(model_dir), "ADAPTERS": f"{name}-lora={adapter_dir}",
                       "DATA_DIR": str(tmp_path / "data"), "MAX_MODEL_LEN": "256", "ADMIN_KEY": ADMIN_KEY,
                       "KV_CACHE_BYTES": str(8 * 1024**2), "MAX_LORA_RANK": "16"}.items():
        monkeypatch.setenv(f"LORAMUX_{key}", value)
    app = create_app(lambda: Services.from_settings(Settings()))
    with LiveServer(app) as server:
        assert server.services.engine.engine.model.config.model_type == model_type
        yield server, new_tenant_key(server.services), f"local/{name}-lora", expected, adapter_dir


def test_chat_with_an_adapter_equals_hf_and_peft(served_family):
    server, key, adapter, expected, _ = served_family
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=adapter, messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    assert expected.strip(), "the reference should say something"
    assert reply.choices[0].message.content == expected
    base = client.chat.completions.create(model=Settings().model.rstrip("/").split("/")[-1], messages=CHAT,
                                          max_tokens=NEW_TOKENS, temperature=0)
    assert base.choices[0].message.content != expected, "the adapter should change the answer"


@pytest.mark.parametrize("served_family", ["qwen3_moe"], indirect=True)
def test_uploaded_expert_lora_serves_and_a_wrong_expert_count_is_refused(served_family):
    """On the MoE base, an expert-LoRA adapter uploaded through the admin API is stored with its experts and
    answers as the same adapter loaded from disk; the same files with one expert too few get a 400 that names
    the expert count."""
    import httpx
    from safetensors.torch import load, save

    server, key, _, expected, adapter_dir = served_family
    config = (adapter_dir / "adapter_config.json").read_bytes()
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    tensors = load(weights)
    fewer = {name: (t[: t.shape[0] * 7 // 8] if "experts" in name and "lora_A" in name else t)
             for name, t in tensors.items()}  # A rows for 7 of the 8 experts
    tenant = server.services.tenancy.ensure_tenant("acme", tier="standard")[0].id
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}

    def upload(name: str, body: bytes):
        files = {"adapter_config": ("adapter_config.json", config),
                 "adapter_model": ("adapter_model.safetensors", body)}
        return httpx.post(f"{server.url}/admin/adapters", data={"tenant_id": tenant, "name": name}, files=files,
                          headers=headers, timeout=60)

    refused = upload("moe-bad", save(fewer))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "expert_shape_mismatch" and "8" in refused.json()["error"]["message"]
    stored = upload("moe-lora", weights)
    assert stored.status_code == 201, stored.text
    assert stored.json()["summary"]["experts"]["gate_up"]["rank"] == 8
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="moe-lora", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content == expected
