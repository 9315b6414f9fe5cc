"""Hybrid linear-attention bases (Qwen3.5, Qwen3-Next) and the text half of multimodal checkpoints (Qwen3.5 and
Gemma 3 ...ForConditionalGeneration) end to end against HF transformers: greedy output token for token on prompts
longer than the conv window (one longer than a step's token cap, so its prefill runs in chunks that carry state),
over 64 new tokens, in mixed batches, with preemption forced and with too few state slots for every request;
prefix caching and speculation are asked for and turned off, said once. Tiny random-weight models built with
transformers' own config classes."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import family_engine, greedy_tokens, hf_greedy
from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.model.config import ModelConfig, UnsupportedModelError
from loramux.model.loader import build_model, end_of_turn_ids
from loramux.testing import save_tiny_hf_model, save_tiny_multimodal_model

NEW_TOKENS = 70
LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_hidden_layers=4)
FAMILIES = {  # name: (builder, model_type, overrides)
    "qwen3_5_text": (save_tiny_hf_model, "qwen3_5_text", LINEAR),
    "qwen3_next": (save_tiny_hf_model, "qwen3_next", {**LINEAR, "num_experts": 8, "num_experts_per_tok": 2,
                                                      "moe_intermediate_size": 32,
                                                      "shared_expert_intermediate_size": 48}),
    "qwen3_5": (save_tiny_multimodal_model, "qwen3_5", {}),
    "gemma3": (save_tiny_multimodal_model, "gemma3", {}),
}


def hybrid_prompts() -> list[list[int]]:
    """Three prompts longer than the conv window (4); the second is longer than a step's 64-token cap."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (23, 90, 9)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid_family(request, tmp_path_factory, tokenizer):
    """(name, model dir, HF greedy outputs per prompt)."""
    builder, model_type, overrides = FAMILIES[request.param]
    model_dir = tmp_path_factory.mktemp(f"hybrid-{request.param}") / "model"
    hf = builder(model_dir, len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer, **overrides)
    return request.param, model_dir, hf_greedy(hf, hybrid_prompts(), NEW_TOKENS)


def engine_with(model_dir, tokenizer, **overrides) -> LLMEngine:
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    config = EngineConfig(**{**dict(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                                    max_model_len=256, async_adapter_loads=False), **overrides})
    return LLMEngine(model, tokenizer, config, end_of_turn_ids(tokenizer, cfg, model_dir))


def test_greedy_equals_hf_in_a_mixed_batch(hybrid_family, tokenizer, caplog):
    """All prompts in one batch, with prefix caching and speculation asked for: they are turned off for hybrids
    (said in one log line), and the output equals HF's."""
    name, model_dir, expected = hybrid_family
    with caplog.at_level(logging.INFO, logger="loramux.engine.engine"):
        engine = family_engine(model_dir, tokenizer)
    hybrid = engine.model.config.linear_attention is not None
    said = [r.getMessage() for r in caplog.records if "hybrid model" in r.getMessage()]
    assert len(said) == (1 if hybrid else 0)
    if hybrid:
        assert "prefix caching and speculative decoding off" in said[0]
        assert not engine.config.prefix_caching and engine.config.speculative_tokens == 0
    got = greedy_tokens(engine, {str(i): (p, None) for i, p in enumerate(hybrid_prompts())}, NEW_TOKENS)
    assert [got[str(i)] for i in range(3)] == expected
    engine.block_manager.check_invariants([])
    if hybrid:
        assert len(engine.block_manager.free_state_slots) == engine.num_state_slots


def test_preemption_and_scarce_state_slots_keep_hf_output(hybrid_family, tokenizer):
    """Too few KV blocks for every sequence (preempted ones drop their state and recompute it) and, on hybrids,
    two state slots for three requests (the third waits for one): still HF's tokens, nothing leaked."""
    name, model_dir, expected = hybrid_family
    model_cfg = build_model(model_dir, torch.float32, torch.device("cpu"))[1]
    state = model_cfg.state_bytes_per_sequence(4)
    # kv_cache_bytes such that half of it holds exactly two sequences' state
    engine = engine_with(model_dir, tokenizer, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=3,
                         kv_cache_bytes=4 * state or 1 << 20)
    if state:
        assert engine.num_state_slots == 2
    prompts = hybrid_prompts()
    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        engine.block_manager.check_invariants(engine.scheduler.running)
        if state:
            assert len({s.state_slot for s in engine.scheduler.running}) == len(engine.scheduler.running) <= 2
    assert [finished[str(i)] for i in range(3)] == expected
    assert engine.stats()["preemptions"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("hybrid_family", ["qwen3_5", "qwen3_5_text", "qwen3_next"], indirect=True)
def test_decodes_on_scattered_state_slots_equal_hf(hybrid_family, tokenizer):
    """Slots handed out with gaps between them (0, 2, 4): decode steps gather and write back copies instead of
    updating one range in place, with the same result."""
    name, model_dir, expected = hybrid_family
    engine = engine_with(model_dir, tokenizer)
    engine.block_manager.free_state_slots = [0, 2, 4, 6]  # a heap: lowest first
    got = greedy_tokens(engine, {str(i): (p, None) for i, p in enumerate(hybrid_prompts())}, NEW_TOKENS)
    assert [got[str(i)] for i in range(3)] == expected
    assert sorted(engine.block_manager.free_state_slots) == [0, 2, 4, 6]


def test_decode_graphs_are_refused_for_hybrids(hybrid_family, tokenizer, caplog):
    """The fixed-shape decode buffers do not carry state slots: a hybrid keeps decoding eagerly, said once."""
    name, model_dir, _ = hybrid_family
    engine = engine_with(model_dir, tokenizer)
    with caplog.at_level(logging.INFO, logger="loramux.engine.model_runner"):
        taken = engine.runner.use_decode_graphs(capture=False)
    hybrid = engine.model.config.linear_attention is not None
    assert taken != hybrid
    assert any("state slots" in r.getMessage() for r in caplog.records) == hybrid


def test_multimodal_checkpoint_serves_its_language_model_only(tmp_path, tokenizer, caplog):
    """The vision tower's tensors are not loaded (one log line says how many); the config is the text model's."""
    model_dir = tmp_path / "qwen3_5"
    save_tiny_multimodal_model(model_dir, len(tokenizer), "qwen3_5", tokenizer=tokenizer)
    with caplog.at_level(logging.INFO, logger="loramux.model.loader"):
        model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    assert cfg.model_type == "qwen3_5_text" and cfg.multimodal == "qwen3_5"
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == 1 and "qwen3_5" in said[0]
    assert not any("visual" in name for name, _ in model.named_parameters())


def test_weights_of_the_other_layer_kind_are_refused_clearly(tmp_path, tokenizer):
    """A config whose layer_types disagree with the checkpoint's layers: a ValueError naming the tensor and the
    layer, not an AttributeError from deep in the loader."""
    from safetensors.torch import load_file, save_file

    save_tiny_hf_model(tmp_path, len(tokenizer), "qwen3_5_text", **FAMILIES["qwen3_5_text"][2])
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.3.self_attn.q_proj.weight"].clone()
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.0.self_attn.q_proj.weight.*layer 0 a linear_attention layer"):
        build_model(tmp_path, torch.float32, torch.device("cpu"))


def test_hybrid_state_and_kv_are_counted():
    """The state of a Qwen3.5-shaped layer stack: conv windows in the model's dtype, float32 recurrent matrices;
    only full-attention layers hold KV."""
    cfg = ModelConfig.from_hf(dict(model_type="qwen3_5_text", vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                   linear_value_head_dim=8, linear_conv_kernel_dim=4))
    spec = cfg.linear_attention
    assert spec is not None and spec.layers == (True, True, True, False) * 2
    assert cfg.attention_layers == (3, 7)
    assert cfg.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
    conv_dim = 2 * 2 * 8 + 4 * 8
    assert cfg.state_bytes_per_sequence(2) == 6 * (conv_dim * 3 * 2 + 4 * 8 * 8 * 4)
    assert cfg.layer_ropes[3].rotary_dim == 4  # partial_rotary_factor defaults to 0.25, as in transformers
    assert cfg.attn_output_gate and cfg.norm_offset == 1.0


def test_state_pool_and_plan_agree_with_what_is_allocated(hybrid_family, tokenizer):
    """The engine's state tensors are exactly its slots x `state_bytes_per_sequence`, as `loramux plan` counts them;
    the KV cache has a layer per attention layer only."""
    from loramux.plan import plan_memory

    _, model_dir, _ = hybrid_family
    engine = engine_with(model_dir, tokenizer, kv_cache_bytes=1 << 24)
    cfg = engine.model.config
    assert engine.runner.kv.k.shape[0] == len(cfg.attention_layers)
    plan = plan_memory(cfg, 4, 4096, 3, 0, 8)
    assert plan.state_pool == 3 * cfg.state_bytes_per_sequence(4)
    if cfg.linear_attention is None:
        assert engine.runner.kv.states is None and plan.state_pool == 0
        return
    assert engine.runner.kv.states.nbytes == engine.num_state_slots * plan.state_per_sequence
    assert engine.num_state_slots == engine.config.max_num_seqs


def test_hf_parameter_count_matches(hybrid_family):
    """num_parameters counts linear-attention layers, gated q_proj and (Qwen3-Next) experts as HF holds them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name, model_dir, _ = hybrid_family
    cfg = build_model(model_dir, torch.float32, torch.device("cpu"))[1]
    hf_cfg = AutoConfig.from_pretrained(model_dir)
    hf_cfg = getattr(hf_cfg, "text_config", hf_cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    expected = sum(p.numel() for p in hf.parameters())  # a tied weight is listed once
    assert cfg.num_parameters() == expected


@pytest.mark.parametrize("broken, says", [
    ({"linear_num_key_heads": None}, "linear_num_key_heads"),
    ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ({"layer_types": ["linear_attention", "mamba"]}, "layer_types"),
])
def test_broken_hybrid_configs_are_refused_by_name(broken, says):
    raw = dict(model_type="qwen3_5_text", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    raw.update(broken)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(UnsupportedModelError, match=says):
        ModelConfig.from_hf(raw)


def test_multimodal_config_without_text_config_is_refused():
    with pytest.raises(UnsupportedModelError, match="text_config"):
        ModelConfig.from_hf({"model_type": "gemma3", "vision_config": {}})


def test_a_hybrid_draft_model_is_refused_by_name(tokenizer):
    from loramux.engine.speculation.draft_runner import DraftMismatchError, check_draft_compatible

    hybrid = ModelConfig.from_hf(dict(model_type="qwen3_5_text", vocab_size=len(tokenizer), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                      linear_conv_kernel_dim=4))
    with pytest.raises(DraftMismatchError, match="hybrid"):
        check_draft_compatible(tokenizer, tokenizer, hybrid, hybrid)
