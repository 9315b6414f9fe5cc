"""Every adapter format PEFT writes, through the server: made by PEFT on a tiny Llama, uploaded through the admin
API, then 40 concurrent completions over all of them (and the base model) in shared batches, each equal to what
HF transformers + PEFT generate greedily for the same prompt and adapter."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from conftest import admin_client, live_stack, make_engine, new_tenant_key
from loramux.testing import save_tiny_hf_model

ADMIN_KEY = "lmxa-formats-admin-key-0123456789abcdefghijklmnop"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 8
# name: LoraConfig arguments (r=8, lora_alpha=16 unless given) and what else training changed.
FORMATS = {
    "plain": dict(target_modules=ALL),
    "rslora": dict(target_modules=["q_proj", "v_proj"], use_rslora=True),
    "patterns": dict(target_modules=ALL, rank_pattern={"q_proj": 4, "down_proj": 12}, alpha_pattern={"v_proj": 32}),
    "layer-subset": dict(target_modules=["q_proj", "v_proj", "gate_proj"], layers_to_transform=[1]),
    "regex-subset": dict(target_modules=r".*\.0\.self_attn\.(q|o)_proj"),
    "dora": dict(target_modules=ALL, use_dora=True),
    "dora-patterns": dict(target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True, use_rslora=True,
                          rank_pattern={"v_proj": 4}, layers_to_transform=[0]),
    "embedding": dict(target_modules=["q_proj", "embed_tokens"]),
    "lm-head": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    "trainable-tokens": dict(target_modules=["q_proj"], trainable_token_indices=[5, 17, 300, 4000]),
}
PROMPTS = [[1, 450, 3200, 17, 99, 23001, 871], [1, 12, 5, 4000, 300, 17, 12, 5], [1, 2048, 77, 77, 9000]]


def _train_like(model, seed: int) -> None:
    """Make every trainable tensor non-trivial, as training would (LoRA B, DoRA magnitudes, head copies, tokens)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            noise = torch.randn(param.shape, generator=g)
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.2 * noise)
            elif "lora_" in name:
                param.copy_(noise * 0.3)
            else:  # modules_to_save copies, trainable token rows
                param.add_(noise * 0.5)


@pytest.fixture(scope="module")
def formats(tmp_path_factory, tokenizer):
    """(model dir, {format: adapter dir}, {(format or None, prompt index): PEFT's greedy tokens})."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("formats")
    model_dir = root / "model"
    save_tiny_hf_model(model_dir, len(tokenizer), weight_scale=4.0, tokenizer=tokenizer)

    def fresh_base():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        base.generation_config.eos_token_id = None  # exactly NEW_TOKENS, as ignore_eos does
        base.generation_config.pad_token_id = 0
        return base

    dirs, expected = {}, {}
    for seed, (name, kwargs) in enumerate(FORMATS.items()):
        peft = get_peft_model(fresh_base(), LoraConfig(**{"r": 8, "lora_alpha": 16, **kwargs}))
        _train_like(peft, seed)
        peft.save_pretrained(root / name)
        dirs[name] = root / name
        reloaded = PeftModel.from_pretrained(fresh_base(), root / name).eval()
        for i, ids in enumerate(PROMPTS):
            with torch.inference_mode():
                out = reloaded.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            expected[(name, i)] = out[0, len(ids):].tolist()
    base = fresh_base()
    for i, ids in enumerate(PROMPTS):
        with torch.inference_mode():
            expected[(None, i)] = base.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                                do_sample=False)[0, len(ids):].tolist()
    return model_dir, dirs, expected


def test_every_format_uploads_and_serves_40_concurrent_requests_equal_to_peft(formats, tokenizer, tmp_path):
    model_dir, dirs, expected = formats
    assert len({tuple(v) for k, v in expected.items() if k[1] == 0}) > 5  # the formats really change the output
    engine = make_engine(model_dir, tokenizer, max_lora_rank=16, adapter_pool_bytes=256 * 2**20,
                         prefix_caching=True, speculative_tokens=4, speculative_max_batch=64)
    with live_stack(tmp_path, engine=engine, admin_key=ADMIN_KEY, max_upload_bytes=64 * 2**20,
                    max_lora_rank=16) as server, admin_client(server, ADMIN_KEY) as admin:
        key = new_tenant_key(server.services, "formats", "premium")
        tenant = server.services.tenancy.tenant("formats")
        summaries = {}
        for name, path in dirs.items():
            files = {f: (f, (path / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
            answer = admin.post("/admin/adapters", data={"tenant_id": tenant.id, "name": name},
                                files={"adapter_config": files["adapter_config.json"],
                                       "adapter_model": files["adapter_model.safetensors"]})
            assert answer.status_code == 201, (name, answer.text)
            summaries[name] = answer.json()["summary"]
        assert summaries["dora"]["dora"] and not summaries["plain"]["dora"]
        assert summaries["patterns"]["layout"] == "per-module" and summaries["layer-subset"]["layout"] == "per-module"
        assert summaries["patterns"]["modules"]["q_proj"]["rank_max"] == 4
        assert summaries["layer-subset"]["modules"]["q_proj"]["layers"] == [1]
        assert summaries["embedding"]["embedding"] == {"rank": 8}
        assert summaries["lm-head"]["heads"] == ["lm_head"] and summaries["lm-head"]["device_bytes"]["heads"] > 0
        assert summaries["trainable-tokens"]["heads"] == ["embed_tokens tokens (4)"]

        jobs = [(name, i) for name in [None, *dirs] for i in range(len(PROMPTS))]
        jobs = (jobs * 2)[:40]

        def complete(job):
            name, i = job
            body = {"model": name or "base", "prompt": PROMPTS[i], "max_tokens": NEW_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key}"})
            return job, resp

        with concurrent.futures.ThreadPoolExecutor(40) as pool:
            results = list(pool.map(complete, jobs))
    for (name, i), resp in results:
        assert resp.status_code == 200, (name, resp.text)
        choice = resp.json()["choices"][0]
        want = tokenizer.decode(expected[(name, i)])
        assert choice["text"] == want, (name, i, choice["text"], want)
