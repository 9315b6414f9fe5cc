"""Mixture-of-experts families end to end against HF transformers and PEFT: greedy output token for token with
no adapter, with a PEFT LoRA on attention, with one on the routed experts (`target_parameters`), with one on the
router, and all in one mixed batch, with prefix caching and prompt-lookup speculation on. Tiny random-weight
models built with transformers' own config classes (gpt-oss with a sliding window shorter than the prompts); an
adapter saved under transformers 4.x per-expert names serves exactly as its fused equivalent."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import drafts_expected, family_engine, greedy_tokens, hf_greedy
from loramux.engine.engine import LLMEngine
from loramux.testing import save_tiny_hf_model

WINDOW = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FAMILIES = {  # name: (model_type, config overrides)
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "qwen2_moe": ("qwen2_moe", {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                "shared_expert_intermediate_size": 48, "num_hidden_layers": 3,
                                "mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "olmoe": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 4.0}),
    "gpt_oss": ("gpt_oss", {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "sliding_window": WINDOW, "intermediate_size": 48}),
}
ADAPTERS = {"attn": dict(target_modules=ATTENTION), "experts": dict(target_modules=[], target_parameters=EXPERTS),
            "router": dict(target_modules=["o_proj"], target_parameters=["mlp.gate.weight"])}


def adapter_targets(name: str, adapter: str) -> dict:
    """PEFT targets of `adapter` on family `name`: gpt-oss's router is `mlp.router`."""
    targets = dict(ADAPTERS[adapter])
    if adapter == "router" and name == "gpt_oss":
        targets["target_parameters"] = ["mlp.router.weight"]
    return targets
NEW_TOKENS = 10


def moe_prompts() -> list[list[int]]:
    """Three prompts longer than the window: two share a 12-token prefix (three blocks of 4, for the prefix
    cache) and each repeats an n-gram (for prompt lookup to draft from)."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(100, 40000, (12,), generator=g).tolist()
    tails = [torch.randint(100, 40000, (6,), generator=g).tolist() for _ in range(3)]
    return [shared + tails[0] + shared[:5] + tails[0], shared + tails[1] + tails[1],
            tails[2] + shared + tails[2] + shared[:4]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe_family(request, tmp_path_factory, tokenizer):
    """(name, model dir, {adapter: dir}, HF greedy outputs {(prompt index, None | adapter): tokens})."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    name = request.param
    model_type, overrides = FAMILIES[name]
    root = tmp_path_factory.mktemp(f"moe-{name}")
    model_dir = root / "model"
    hf = save_tiny_hf_model(model_dir, len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer,
                            **overrides)
    dirs = {}
    for index, adapter in enumerate(ADAPTERS):
        torch.manual_seed(10 + index)
        lora = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                             **adapter_targets(name, adapter)))
        lora.save_pretrained(root / adapter)
        hf = lora.unload()
        dirs[adapter] = root / adapter

    def fresh():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        model.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, as ignore_eos does here
        model.generation_config.pad_token_id = 0
        return model.eval()

    prompts = moe_prompts()
    outputs = {(i, None): out for i, out in enumerate(hf_greedy(fresh(), prompts, NEW_TOKENS))}
    for adapter, path in dirs.items():
        peft = PeftModel.from_pretrained(fresh(), path).eval()
        outputs.update({(i, adapter): out for i, out in enumerate(hf_greedy(peft, prompts, NEW_TOKENS))})
    return name, model_dir, dirs, outputs


def make_engine(model_dir, tokenizer) -> LLMEngine:
    return family_engine(model_dir, tokenizer)


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    return greedy_tokens(engine, requests, NEW_TOKENS)


def test_greedy_output_equals_hf_and_peft_alone_and_mixed(moe_family, tokenizer):
    name, model_dir, dirs, expected = moe_family
    prompts = moe_prompts()
    # Each adapter matters and the prompts differ: otherwise equality would prove little.
    for adapter in dirs:
        assert any(expected[(i, None)] != expected[(i, adapter)] for i in range(len(prompts))), (name, adapter)
    assert len({tuple(expected[(i, None)]) for i in range(len(prompts))}) > 1, name

    engine = make_engine(model_dir, tokenizer)
    for adapter, path in dirs.items():
        engine.load_adapter_dir(path, adapter)
    for adapter in (None, *dirs):  # each alone, one request at a time
        for i, ids in enumerate(prompts):
            assert run_all(engine, {"r": (ids, adapter)})["r"] == expected[(i, adapter)], (name, i, adapter)
    # One mixed batch of every prompt with no adapter, the attention LoRA and the expert LoRA.
    variants = (None, *dirs)
    mixed = {f"{i}/{a}": (ids, a) for i, ids in enumerate(prompts) for a in variants}
    got = run_all(engine, mixed)
    assert got == {f"{i}/{a}": expected[(i, a)] for i, _ in enumerate(prompts) for a in variants}, name
    stats = engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0, "the shared prefixes should have been served from the cache"
    if any(drafts_expected(ids, expected[(i, a)]) for i, ids in enumerate(prompts) for a in variants):
        assert stats["spec_proposed_tokens"] > 0, "prompt lookup should have drafted from a repeated token"
    assert stats["kv_blocks_used"] == 0 and stats["adapter_slots_pinned"] == 0


def per_expert_copy(fused_dir, out_dir, cfg: dict, mixtral: bool) -> None:
    """The fused `target_parameters` adapter in `fused_dir` rewritten under transformers 4.x per-expert module
    names (one LoRA per expert and projection), with the same deltas: gate and up each get the expert's A and
    their half of its B."""
    config = json.loads((fused_dir / "adapter_config.json").read_text())
    tensors = load_file(str(fused_dir / "adapter_model.safetensors"))
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]
    rank = config["r"]
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral else \
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    section = "block_sparse_moe" if mixtral else "mlp"
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for param, key in (("gate_up", f"{prefix}.base_layer"), ("down", prefix)):
            a = tensors[f"{key}.lora_A.weight"].reshape(num_experts, rank, -1)
            b = tensors[f"{key}.lora_B.weight"]
            b = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1)  # [E, out, r]
            for e in range(num_experts):
                target = f"base_model.model.model.layers.{layer}.{section}.experts.{e}"
                if param == "down":
                    parts = {"down": b[e]}
                else:
                    half = b.shape[1] // 2
                    parts = {"gate": b[e, :half], "up": b[e, half:]}
                for part, b_part in parts.items():
                    out[f"{target}.{names[part]}.lora_A.weight"] = a[e].clone()
                    out[f"{target}.{names[part]}.lora_B.weight"] = b_part.clone()
    config["target_modules"] = sorted(names.values())
    config["target_parameters"] = None
    out_dir.mkdir()
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    save_file(out, str(out_dir / "adapter_model.safetensors"))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_names_serve_as_their_fused_equivalent(family, tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    model_type, overrides = FAMILIES[family]
    hf = save_tiny_hf_model(tmp_path / "model", len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer,
                            **overrides)
    torch.manual_seed(3)
    lora = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[],
                                         target_parameters=EXPERTS))
    lora.save_pretrained(tmp_path / "fused")
    per_expert_copy(tmp_path / "fused", tmp_path / "per-expert", hf.config.to_dict(), family == "mixtral")
    engine = make_engine(tmp_path / "model", tokenizer)
    engine.load_adapter_dir(tmp_path / "fused", "fused")
    engine.load_adapter_dir(tmp_path / "per-expert", "per-expert")
    prompts = moe_prompts()
    got = run_all(engine, {f"{i}/{a}": (ids, a) for i, ids in enumerate(prompts)
                           for a in (None, "fused", "per-expert")})
    for i in range(len(prompts)):
        assert got[f"{i}/per-expert"] == got[f"{i}/fused"], i
    assert any(got[f"{i}/fused"] != got[f"{i}/None"] for i in range(len(prompts)))


def test_pool_budgets_expert_lora_bytes_exactly_and_blobs_keep_them(tmp_path, tokenizer):
    """A slot of an expert-LoRA adapter holds E x r x (in + out) weights per expert projection and sparse layer
    (plus one float32 scale per expert), counted exactly as allocated; the registry's blob keeps the experts."""
    from peft import LoraConfig, get_peft_model

    from loramux.adapters.formats.peft import load_adapter_dir
    from loramux.adapters.storage.blob import pack, unpack

    model_type, overrides = FAMILIES["qwen2_moe"]  # a dense layer among sparse ones, and a shared expert
    hf = save_tiny_hf_model(tmp_path / "model", len(tokenizer), model_type, tokenizer=tokenizer, **overrides)
    torch.manual_seed(5)
    get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"],
                                  target_parameters=EXPERTS)).save_pretrained(tmp_path / "lora")
    engine = make_engine(tmp_path / "model", tokenizer)
    cfg = engine.model.config
    adapter = load_adapter_dir(tmp_path / "lora", cfg)
    key = engine.pool.bucket_of(adapter)
    assert key.experts == (("gate_up", 4), ("down", 4))
    h, i, e = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.num_experts
    sparse = cfg.moe.num_sparse_layers
    assert sparse == 2
    experts = sparse * e * (4 * ((h + 2 * i) + (i + h)) * 4 + 2 * 4)  # float32 weights, one scale per expert
    attention = cfg.num_layers * 4 * (3 * h + cfg.q_size + 2 * cfg.kv_size) * 4  # q/k/v slices at r=4
    assert engine.pool.slot_bytes(key) == attention + experts
    engine.load_adapter_dir(tmp_path / "lora", "lora")
    run_all(engine, {"r": (moe_prompts()[0], "lora")})
    bucket = engine.pool.buckets[key]
    held = sum(t.numel() * t.element_size() for w in bucket.experts.values() for t in (w.a, w.b, w.scale))
    assert held == bucket.capacity * experts

    blob, digest = pack(4, 8.0, False, adapter.target_modules, adapter.weights, experts=adapter.experts)
    restored = unpack(blob, "lora", digest)
    assert restored.experts.keys() == adapter.experts.keys()
    for k, (a, b) in adapter.experts.items():
        assert torch.equal(restored.experts[k][0], a) and torch.equal(restored.experts[k][1], b)


def test_bfloat16_gpt_oss_checkpoint_loads_and_equals_hf(tmp_path, tokenizer):
    """gpt-oss ships bf16 weights (MXFP4 experts are refused by name: test_moe_plan_metrics): a bf16 checkpoint
    loads, here served in float32 as HF loads it, token for token."""
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILIES["gpt_oss"]
    hf = save_tiny_hf_model(tmp_path / "f32", len(tokenizer), model_type, weight_scale=4.0, **overrides)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = moe_prompts()
    engine = make_engine(tmp_path / "model", tokenizer)
    got = run_all(engine, {str(i): (ids, None) for i, ids in enumerate(prompts)})
    assert [got[str(i)] for i in range(len(prompts))] == hf_greedy(model, prompts, NEW_TOKENS)


def test_all_linear_adapter_with_router_and_experts_equals_peft(tmp_path, tokenizer):
    """PEFT 0.21's "all-linear" on a transformers 5 MoE base: attention, the experts (target_parameters, gate_up at
    2r / 2 alpha) and the router (`gate.weight`), all served, equal to PEFT."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILIES["qwen3_moe"]
    hf = save_tiny_hf_model(tmp_path / "model", len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer,
                            **overrides)
    torch.manual_seed(2)
    get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
                   ).save_pretrained(tmp_path / "lora")
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert any("gate.weight" in p for p in config["target_parameters"]), config["target_parameters"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, attn_implementation="eager")
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    prompts = moe_prompts()
    expected = hf_greedy(PeftModel.from_pretrained(base.eval(), tmp_path / "lora").eval(), prompts, NEW_TOKENS)
    engine = make_engine(tmp_path / "model", tokenizer)
    engine.load_adapter_dir(tmp_path / "lora", "lora")
    got = run_all(engine, {str(i): (ids, "lora") for i, ids in enumerate(prompts)})
    assert [got[str(i)] for i in range(len(prompts))] == expected
