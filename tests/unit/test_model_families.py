"""Each supported model family, end to end against HF transformers and PEFT: greedy output token for token
with no adapter, with a PEFT LoRA on attention and MLP (the family's own module names), and both in one
mixed batch, with prefix caching and prompt-lookup speculation on. Tiny random-weight models built with
transformers' own config classes; the windowed families run prompts longer than their window."""
from __future__ import annotations

import pytest
import torch

from conftest import drafts_expected, family_engine, greedy_tokens
from loramux.engine.engine import LLMEngine
from loramux.engine.model_runner import ModelRunner
from loramux.testing import save_tiny_hf_model

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
WINDOW = 8
FAMILIES = {  # name: (model_type, config overrides, PEFT target_modules)
    "llama": ("llama", {}, LLAMA_TARGETS),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
                    LLAMA_TARGETS),
    "qwen2": ("qwen2", {}, LLAMA_TARGETS),
    "qwen3": ("qwen3", {"head_dim": 32}, LLAMA_TARGETS),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}, LLAMA_TARGETS),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}, LLAMA_TARGETS),
    "gemma3": ("gemma3_text", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": WINDOW,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
               LLAMA_TARGETS),
    "phi3": ("phi3", {"pad_token_id": 0}, PHI3_TARGETS),
}
NEW_TOKENS = 10


def family_prompts() -> list[list[int]]:
    """Three prompts longer than the window: two share a 12-token prefix (three blocks of 4, for the prefix
    cache) and each repeats an n-gram (for prompt lookup to draft from)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(100, 40000, (12,), generator=g).tolist()
    tails = [torch.randint(100, 40000, (6,), generator=g).tolist() for _ in range(3)]
    return [shared + tails[0] + shared[:5] + tails[0], shared + tails[1] + tails[1],
            tails[2] + shared + tails[2] + shared[:4]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, tokenizer):
    """(name, model dir, adapter dir, HF greedy outputs {(prompt index, None | "lora"): tokens})."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    name = request.param
    model_type, overrides, targets = FAMILIES[name]
    root = tmp_path_factory.mktemp(f"family-{name}")
    model_dir, adapter_dir = root / "model", root / "adapter"
    hf = save_tiny_hf_model(model_dir, len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer,
                            **overrides)
    torch.manual_seed(1)
    lora = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    lora.save_pretrained(adapter_dir)

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    base.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, as ignore_eos does here
    base.generation_config.pad_token_id = 0
    peft = PeftModel.from_pretrained(base, adapter_dir).eval()
    outputs = {}
    for index, ids in enumerate(family_prompts()):
        for adapter in (None, "lora"):
            with torch.inference_mode():
                if adapter is None:
                    with peft.disable_adapter():
                        out = peft.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
                else:
                    out = peft.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            outputs[(index, adapter)] = out[0, len(ids):].tolist()
    return name, model_dir, adapter_dir, outputs


def make_family_engine(model_dir, tokenizer) -> LLMEngine:
    return family_engine(model_dir, tokenizer)


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    return greedy_tokens(engine, requests, NEW_TOKENS)


def test_greedy_output_equals_hf_and_peft_alone_and_mixed(family, tokenizer, monkeypatch):
    name, model_dir, adapter_dir, expected = family
    cuts = []  # decode steps whose local layers gathered only their window (Gemma's mixed layers)
    original = ModelRunner._window_decodes
    monkeypatch.setattr(ModelRunner, "_window_decodes", lambda self, *a: cuts.append(original(self, *a)) or cuts[-1])
    prompts = family_prompts()
    # The adapter matters and the prompts differ: otherwise equality would prove little.
    assert any(expected[(i, None)] != expected[(i, "lora")] for i in range(len(prompts))), name
    assert len({tuple(expected[(i, None)]) for i in range(len(prompts))}) > 1, name

    engine = make_family_engine(model_dir, tokenizer)
    engine.load_adapter_dir(adapter_dir, "lora")
    for adapter in (None, "lora"):  # each alone, one request at a time
        for i, ids in enumerate(prompts):
            assert run_all(engine, {"r": (ids, adapter)})["r"] == expected[(i, adapter)], (name, i, adapter)
    # One mixed batch of every prompt with and without the adapter; prefix blocks are cached by now.
    mixed = {f"{i}/{a}": (ids, a) for i, ids in enumerate(prompts) for a in (None, "lora")}
    got = run_all(engine, mixed)
    assert got == {f"{i}/{a}": expected[(i, a)] for i, _ in enumerate(prompts) for a in (None, "lora")}, name
    stats = engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0, "the shared prefixes should have been served from the cache"
    if any(drafts_expected(ids, expected[(i, a)]) for i, ids in enumerate(prompts) for a in (None, "lora")):
        assert stats["spec_proposed_tokens"] > 0, "prompt lookup should have drafted from a repeated token"
    assert stats["kv_blocks_used"] == 0 and stats["adapter_slots_pinned"] == 0
    assert any(cuts) == name.startswith("gemma"), cuts



def test_fixed_shape_decode_steps_give_the_same_tokens(family, tokenizer):
    """The CUDA-graph decode path (run eagerly from its fixed-shape buffers here, as on a GPU without the
    capture) serves every family: windows, soft-capping, q/k norms and released blocks included."""
    name, model_dir, adapter_dir, expected = family
    engine = make_family_engine(model_dir, tokenizer)
    engine.load_adapter_dir(adapter_dir, "lora")
    engine.runner.use_decode_graphs(capture=False)
    prompts = family_prompts()
    got = run_all(engine, {f"{i}/{a}": (ids, a) for i, ids in enumerate(prompts) for a in (None, "lora")})
    assert got == {f"{i}/{a}": expected[(i, a)] for i, _ in enumerate(prompts) for a in (None, "lora")}, name
    assert engine.runner.graphs.steps > 0, "decode steps should have taken the fixed-shape path"


def test_longrope_sequences_switch_factors_exactly_as_hf(tmp_path, tokenizer):
    """Phi-3 LongRoPE as HF generates: a sequence that outgrows the original context (16 here) is recomputed
    whole with the long factors (HF drops its cache there), a prompt past it is computed with the long factors
    throughout, and a prefix cached under the short factors is never reused for it. Speculation on."""
    factors = [1.0 + 0.3 * i for i in range(8)]
    hf = save_tiny_hf_model(tmp_path, len(tokenizer), "phi3", weight_scale=4.0, pad_token_id=0,
                            original_max_position_embeddings=16,
                            rope_scaling={"rope_type": "longrope", "short_factor": factors,
                                          "long_factor": [4 * f for f in factors]})
    hf.generation_config.eos_token_id = None
    short = list(range(500, 512))  # 12 tokens: short factors
    long = short + list(range(700, 720))  # 32 tokens: long factors, sharing the short prompt's 3 blocks
    engine = make_family_engine(tmp_path, tokenizer)
    for prompt in (short, long):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        assert run_all(engine, {"r": (prompt, None)})["r"] == want.tolist()
