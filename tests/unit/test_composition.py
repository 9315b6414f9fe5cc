"""Weighted composition of adapters (loramux.adapters.composition.weighted) against PEFT's own
`add_weighted_adapter(..., combination_type="cat")`: the composite's A and B equal PEFT's to the bit (its
zero padding aside), and the engine serving it generates PEFT's greedy tokens, alone and in one mixed batch
with plain adapters and the base model; refusals name the component.
How composites are bounded in host RAM and built: tests/unit/test_composition_bounds.py."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import run_to_completion
from loramux.adapters.composition.weighted import CompositionError, compose, composition_digest, refusal_reason
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.engine.sampling.params import SamplingParams
from loramux.testing import save_tiny_hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = ALL  # a dense base's projections
NEW_TOKENS = 8
PROMPTS = [[1, 450, 3200, 17, 99, 23001, 871], [1, 12, 5, 4000, 300, 17, 12, 5], [1, 2048, 77, 77, 9000]]
# Components of different ranks, scales and targets: plain, rsLoRA with rank/alpha patterns, a layer subset.
ADAPTERS = {
    "tone": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "legal": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True, rank_pattern={"q_proj": 2},
                  alpha_pattern={"v_proj": 4}),
    "style": dict(r=6, lora_alpha=12, target_modules=["k_proj", "o_proj", "up_proj", "v_proj"],
                  layers_to_transform=[1]),
}
# PEFT gives the composite the FIRST component's config (r = alpha = summed rank), so it inherits its
# use_rslora and layers_to_transform: references start with a plain, all-layer component (see the docs).
COMPOSITIONS = {
    "two": [("tone", 0.7), ("legal", 0.3)],
    "three": [("tone", 1.5), ("style", -0.5), ("legal", 0.8)],
    "zero-weight": [("tone", 1.0), ("legal", 0.0)],
}
# Where PEFT does not compute the weighted sum: an rsLoRA component first makes its composite's scale
# sqrt(summed rank) instead of 1 (the tensors are the same; loramux runs them at scale 1).
RSLORA_FIRST = [("legal", 0.3), ("tone", 0.7)]


def _train_like(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)


def _fresh_base(model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None  # exactly NEW_TOKENS, as ignore_eos does
    base.generation_config.pad_token_id = 0
    return base


def _greedy(model, prompts=PROMPTS) -> list[list[int]]:
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            outs.append(model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
                        .tolist())
    return outs


@pytest.fixture(scope="module")
def peft_case(tmp_path_factory, tokenizer):
    return build_peft_case(tmp_path_factory.mktemp("composition"), tokenizer)


def build_peft_case(root, tokenizer):
    """(model dir, {name: adapter dir}, PEFT model holding every adapter and composite, {name: greedy tokens
    per prompt} for each adapter, composite and the base model (None)), built under `root`."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model_dir = root / "model"
    save_tiny_hf_model(model_dir, len(tokenizer), weight_scale=4.0, tokenizer=tokenizer)
    dirs = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        peft = get_peft_model(_fresh_base(model_dir), LoraConfig(**kwargs))
        _train_like(peft, seed)
        peft.save_pretrained(root / name)
        dirs[name] = root / name
    names = list(ADAPTERS)
    model = PeftModel.from_pretrained(_fresh_base(model_dir), dirs[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    for name, parts in COMPOSITIONS.items():
        model.add_weighted_adapter([a for a, _ in parts], [w for _, w in parts], name, combination_type="cat")
    model.add_weighted_adapter([a for a, _ in RSLORA_FIRST], [w for _, w in RSLORA_FIRST], "rslora-first",
                               combination_type="cat")
    expected = {}
    for name in [*ADAPTERS, *COMPOSITIONS]:
        model.set_adapter(name)
        expected[name] = _greedy(model)
    with model.disable_adapter():
        expected[None] = _greedy(model)
    return model_dir, dirs, model, expected


def _loaded(peft_case) -> dict:
    model_dir, dirs, _, _ = peft_case
    from loramux.model.loader import read_model_config

    cfg = read_model_config(model_dir)[0]
    return {name: load_adapter_dir(path, cfg, name) for name, path in dirs.items()}


def _composite(adapters: dict, name: str):
    return compose([(adapters[a], w) for a, w in COMPOSITIONS[name]], name)


def _peft_module(model, layer: int, target: str):
    parent = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return model.base_model.model.model.layers[layer].get_submodule(f"{parent}.{target}")


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_composite_tensors_are_pefts_cat_to_the_bit(peft_case, name):
    _, _, model, _ = peft_case
    adapters = _loaded(peft_case)
    composite = _composite(adapters, name)
    assert composite.scale == 1.0 and not composite.module_scales
    summed = sum(max(a.shape[0] for a, _ in adapters[c].weights.values()) for c, _ in COMPOSITIONS[name])
    for layer in range(2):
        for target in TARGETS:
            module = _peft_module(model, layer, target)
            covered = [c for c, _ in COMPOSITIONS[name] if (layer, target) in adapters[c].weights]
            if not covered:
                assert (layer, target) not in composite.weights
                continue
            assert module.scaling[name] == 1.0  # no component of these references is first with rsLoRA
            a_ref, b_ref = module.lora_A[name].weight.data, module.lora_B[name].weight.data
            assert a_ref.shape[0] == summed  # PEFT: every module at the summed rank, zero rows past its own
            a, b = composite.weights[(layer, target)]
            rows = sum(adapters[c].weights[(layer, target)][0].shape[0] for c in covered)
            assert a.shape[0] == rows and b.shape[1] == rows
            assert torch.equal(a, a_ref[:rows]) and not a_ref[rows:].any(), (layer, target)
            assert torch.equal(b, b_ref[:, :rows]) and not b_ref[:, rows:].any(), (layer, target)


def test_pefts_rslora_first_quirk_scales_the_same_tensors_by_sqrt_of_the_summed_rank(peft_case):
    _, _, model, _ = peft_case
    adapters = _loaded(peft_case)
    composite = compose([(adapters[a], w) for a, w in RSLORA_FIRST], "rslora-first")
    module = _peft_module(model, 0, "v_proj")  # legal (rank 8) and tone (rank 4) both adapt it
    assert module.scaling["rslora-first"] == 12 / math.sqrt(12) != 1.0
    a, b = composite.weights[(0, "v_proj")]
    assert torch.equal(a, module.lora_A["rslora-first"].weight.data) and composite.scale == 1.0
    assert torch.equal(b, module.lora_B["rslora-first"].weight.data)


def _engine(model_dir, tokenizer, **overrides):
    from test_adapter_patterns import make_engine

    return make_engine(model_dir, tokenizer, **{"max_lora_rank": 32, **overrides})


def test_composites_generate_pefts_tokens_alone_and_in_a_mixed_batch(peft_case, tokenizer):
    model_dir, _, _, expected = peft_case
    assert len({tuple(expected[n][0]) for n in expected}) >= 5  # compositions really change the output
    adapters = _loaded(peft_case)
    composites = {name: _composite(adapters, name) for name in COMPOSITIONS}
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = _engine(model_dir, tokenizer)
    for name in ("two", "three"):  # alone
        outs = run_to_completion(engine, [(ids, params, composites[name]) for ids in PROMPTS])
        assert [o.token_ids for o in outs] == expected[name], name
    # One mixed batch: every composite, the components as plain adapters and the base model, each prompt.
    jobs = [(name, i) for name in [None, *ADAPTERS, *COMPOSITIONS] for i in range(len(PROMPTS))]
    engine = _engine(model_dir, tokenizer)
    outs = run_to_completion(engine, [
        (PROMPTS[i], params, composites.get(name) or adapters.get(name)) for name, i in jobs])
    for (name, i), out in zip(jobs, outs):
        assert out.token_ids == expected[name][i], (name, i)


def test_triton_kernels_serve_composites_like_pefts(peft_case, tokenizer):
    """The composite's per-module ranks through the Triton kernels (interpreted on CPU, native on GPU)."""
    pytest.importorskip("triton")
    model_dir, _, _, expected = peft_case
    adapters = _loaded(peft_case)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    engine = _engine(model_dir, tokenizer, lora_impl="triton", speculative_tokens=0)
    names = ["two", "three", "tone"]
    outs = run_to_completion(engine, [(PROMPTS[1], params, _composite(adapters, n) if n in COMPOSITIONS
                                       else adapters[n]) for n in names])
    assert [o.token_ids for o in outs] == [expected[n][1] for n in names]


def test_one_component_is_the_weighted_adapter(peft_case, tokenizer):
    model_dir, _, _, expected = peft_case
    adapters = _loaded(peft_case)
    single = compose([(adapters["legal"], 1.0)], "legal-1")
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = run_to_completion(_engine(model_dir, tokenizer), [(ids, params, single) for ids in PROMPTS])
    assert [o.token_ids for o in outs] == expected["legal"]
    halved = compose([(adapters["legal"], 0.5)], "legal-half")
    a, _ = halved.weights[(0, "q_proj")]
    a0, _ = adapters["legal"].weights[(0, "q_proj")]
    assert torch.equal(a, a0 * 0.5 * adapters["legal"].scale_of((0, "q_proj")))


def test_digest_is_canonical_and_apart_from_versions():
    parts = [("d1", 0.7), ("d2", 0.3)]
    assert composition_digest(parts) == composition_digest([("d1", 0.7), ("d2", 0.3)])
    assert composition_digest(parts) != composition_digest([("d1", 0.7), ("d2", 0.30000000000000004)])
    assert composition_digest(parts) != composition_digest(list(reversed(parts)))
    assert len(composition_digest(parts)) == 64
    with pytest.raises(CompositionError, match="finite"):
        composition_digest([("d1", float("nan"))])


def test_formats_cat_cannot_combine_are_refused_by_name(peft_case):
    adapters = _loaded(peft_case)
    tone = adapters["tone"]
    assert refusal_reason(tone) is None
    dora = load_adapter_dir(peft_case[1]["tone"], _cfg(peft_case), "tone")
    dora.magnitudes = {(0, "q_proj"): torch.ones(64)}
    heads = load_adapter_dir(peft_case[1]["tone"], _cfg(peft_case), "heads")
    heads.heads = {"lm_head": torch.zeros(4, 4)}
    for adapter, words in ((dora, "DoRA"), (heads, "modules_to_save")):
        with pytest.raises(CompositionError, match=words) as info:
            compose([(tone, 0.5), (adapter, 0.5)], "bad")
        assert info.value.component == 1 and repr(adapter.name) in str(info.value)
    with pytest.raises(CompositionError, match="finite"):
        compose([(tone, float("inf"))], "bad")
    with pytest.raises(CompositionError, match="at least one"):
        compose([], "bad")


def _cfg(peft_case):
    from loramux.model.loader import read_model_config

    return read_model_config(peft_case[0])[0]


def test_a_components_rank_is_pefts_r_or_its_largest_pattern_rank():
    from datetime import datetime, timezone

    from loramux.adapters.storage.registry import AdapterVersionInfo
    from loramux.server.serving.composition_choice import component_rank

    version = AdapterVersionInfo(
        adapter_id="ad_1", tenant_id="t", name="a", visibility="private", version=1, digest="d" * 64,
        storage_key="k", size_bytes=1, rank=8, alpha=16.0, use_rslora=False, target_modules=("q_proj",),
        base_model="m", created_at=datetime.now(timezone.utc))
    assert component_rank(version) == 8
    patterned = {"modules": {"q_proj": {"rank_max": 4}, "down_proj": {"rank_max": 12}}}
    assert component_rank(dataclasses.replace(version, summary=patterned)) == 12
    assert component_rank(dataclasses.replace(version, summary={"modules": {"q_proj": {"rank_max": 2}}})) == 8
