"""PEFT LoRA adapters on hybrid bases (Qwen3.5 `qwen3_5_text`, Qwen3-Next `qwen3_next`: Gated DeltaNet layers between
full-attention layers) and on the language model of multimodal checkpoints (`qwen3_5`, `gemma3`), against HF
transformers + PEFT: greedy output token for token in one mixed batch of every adapter and the base model, with
prompts longer than the convolution window (one per family more than 64 new tokens, with and without an adapter),
also with preemption forced. Module names per layer equal
the ones PEFT wraps ("all-linear" included); LoRA on `linear_attn.conv1d`, on the vision side of a multimodal model,
and on a projection a layer does not have is refused by name; other forms PEFT saves a multimodal adapter in load the
same weights; blobs, summaries, pool slots and merges handle the new projections exactly. Tiny random models."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import family_engine, run_to_completion
from loramux.adapters.formats.layer_modules import layer_targets
from loramux.adapters.formats.peft import build_adapter, load_adapter_dir
from loramux.adapters.formats.validation import AdapterValidationError, module_names
from loramux.model.config import ModelConfig
from loramux.model.loader import read_model_config
from loramux.testing import save_tiny_hf_model, save_tiny_multimodal_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LINEAR = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LM_REGEX = r".*language_model.*\.(q_proj|v_proj|in_proj_qkv|out_proj)"  # as users write it for a multimodal base
HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, num_hidden_layers=4)  # layers 0-2 linear attention, layer 3 full
NEXT = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {  # name: (model_type, text config overrides, {adapter: LoraConfig arguments}, prompts)
    "qwen3_5_text": ("qwen3_5_text", HYBRID, {
        "all": dict(r=8, lora_alpha=16, target_modules=ATTENTION + LINEAR + MLP),
        "linear": dict(r=4, lora_alpha=4, target_modules=LINEAR),
        "attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION, alpha_pattern={"v_proj": 4}),  # per module
        "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "in_proj_qkv", "out_proj"], use_dora=True),
    }, 3),
    "qwen3_next": ("qwen3_next", {**HYBRID, **NEXT}, {
        "mixer": dict(r=8, lora_alpha=16, target_modules=["in_proj_qkvz", "in_proj_ba", "out_proj", *ATTENTION]),
        "subset": dict(r=4, lora_alpha=8, target_modules=["in_proj_ba", "out_proj"], layers_to_transform=[0, 2]),
    }, 2),
    "qwen3_5": ("qwen3_5", {}, {"lm": dict(r=8, lora_alpha=16, target_modules=LM_REGEX),
                                "mlp": dict(r=4, lora_alpha=8, target_modules=MLP)}, 2),
    "gemma3": ("gemma3", {}, {"lm": dict(r=8, lora_alpha=16, target_modules=LM_REGEX),
                              "mlp": dict(r=4, lora_alpha=8, target_modules=MLP)}, 2),
}
MULTIMODAL = ("qwen3_5", "gemma3")
NEW_TOKENS, LONG_TOKENS = 10, 70
# (family, prompt, adapter) run past 64 new tokens: the base and an adapter on linear-attention projections each
LONG = {("qwen3_5_text", 0, None), ("qwen3_5_text", 0, "all"), ("qwen3_next", 0, None), ("qwen3_next", 0, "mixer"),
        ("qwen3_5", 0, None), ("qwen3_5", 0, "lm"), ("gemma3", 0, None), ("gemma3", 0, "lm")}


def prompts(count: int = 3) -> list[list[int]]:
    """Prompts longer than the convolution window (4) and Gemma's sliding window (8)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (9, 13, 18)][:count]


def new_tokens(family: str, prompt: int, adapter: str | None) -> int:
    return LONG_TOKENS if (family, prompt, adapter) in LONG else NEW_TOKENS


@dataclass
class Family:
    name: str
    model_dir: Path
    cfg: ModelConfig
    hf: torch.nn.Module  # the HF model (adapters unloaded), to make more adapters from
    dirs: dict[str, Path]
    expected: dict[tuple[int, str | None], list[int]]  # (prompt index, adapter or None) -> HF / PEFT greedy tokens
    prompts: list[list[int]]


def hf_model_class(name: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if name in MULTIMODAL else AutoModelForCausalLM


def build_family(name: str, root: Path, tokenizer) -> Family:
    from peft import LoraConfig, PeftModel, get_peft_model

    model_type, overrides, adapters, count = FAMILIES[name]
    model_dir = root / "model"
    if name in MULTIMODAL:
        hf = save_tiny_multimodal_model(model_dir, len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer)
    else:
        hf = save_tiny_hf_model(model_dir, len(tokenizer), model_type, weight_scale=4.0, tokenizer=tokenizer,
                                **overrides)
    dirs = {}
    for index, (adapter, kwargs) in enumerate(adapters.items()):
        torch.manual_seed(20 + index)
        lora = get_peft_model(hf, LoraConfig(init_lora_weights=False, **kwargs))
        lora.save_pretrained(root / adapter)
        hf = lora.unload()
        dirs[adapter] = root / adapter

    def fresh():
        model = hf_model_class(name).from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        model.generation_config.eos_token_id = None  # exactly new_tokens tokens, as ignore_eos does here
        model.generation_config.pad_token_id = 0
        return model.eval()

    def greedy(model, adapter: str | None) -> dict[tuple[int, str | None], list[int]]:
        outs = {}
        for i, ids in enumerate(prompts(count)):
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens(name, i, adapter), do_sample=False)
            outs[(i, adapter)] = out[0, len(ids):].tolist()
        return outs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # HF's tiny per-token ops: a second OpenMP thread only waits (on a busy machine, long)
    try:
        expected = greedy(fresh(), None)
        for adapter, path in dirs.items():
            expected.update(greedy(PeftModel.from_pretrained(fresh(), path).eval(), adapter))
    finally:
        torch.set_num_threads(threads)
    return Family(name, model_dir, read_model_config(model_dir)[0], hf, dirs, expected, prompts(count))


@pytest.fixture(scope="module")
def families(tmp_path_factory, tokenizer):
    """Each family built once for the module, on first use: name -> Family."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(name), tokenizer)
        return built[name]
    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_batch_equals_peft_token_for_token(families, name, tokenizer):
    from loramux.adapters.formats.summary import describe
    from loramux.engine.sampling.params import SamplingParams

    family = families(name)
    for adapter in family.dirs:  # each adapter matters, so equality proves something
        assert any(family.expected[(i, None)][:NEW_TOKENS] != family.expected[(i, adapter)][:NEW_TOKENS]
                   for i in range(len(family.prompts))), adapter
    engine = family_engine(family.model_dir, tokenizer)
    loaded = {adapter: engine.load_adapter_dir(path, adapter) for adapter, path in family.dirs.items()}
    keys = [(i, a) for i in range(len(family.prompts)) for a in (None, *family.dirs)]
    outs = run_to_completion(engine, [(family.prompts[i], SamplingParams(max_tokens=new_tokens(name, i, a),
                                                                         ignore_eos=True), a) for i, a in keys])
    assert {key: out.token_ids for key, out in zip(keys, outs)} == {key: family.expected[key] for key in keys}
    for adapter in loaded.values():  # what the summary says a slot takes is what the pool allocates
        key = engine.pool.bucket_of(adapter)
        assert describe(adapter, family.cfg, 4)["device_bytes"]["total"] == engine.pool.slot_bytes(key), adapter.name
        if adapter.name in ("all", "linear", "mixer", "mlp"):  # one rank and scale on every layer that has each
            assert key.layer_ranks == (), adapter.name
    assert engine.stats()["adapter_slots_pinned"] == 0


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next"])
def test_mixed_adapters_with_preemption_forced_equal_peft(families, name, tokenizer):
    """Every adapter and the base in one batch on too few KV blocks and two state slots: preempted sequences drop
    their state and recompute it through their own adapters; HF + PEFT's tokens, nothing leaked."""
    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.model.loader import build_model, end_of_turn_ids

    family = families(name)
    model, cfg = build_model(family.model_dir, torch.float32, torch.device("cpu"))
    config = EngineConfig(block_size=4, num_blocks=30, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          kv_cache_bytes=4 * cfg.state_bytes_per_sequence(4), adapter_pool_bytes=64 << 20,
                          async_adapter_loads=False)
    engine = LLMEngine(model, tokenizer, config, end_of_turn_ids(tokenizer, cfg, family.model_dir))
    assert engine.num_state_slots == 2
    for adapter, path in family.dirs.items():
        engine.load_adapter_dir(path, adapter)
    keys = [(i, a) for i in range(len(family.prompts)) for a in (None, *family.dirs)]
    for n, (i, a) in enumerate(keys):
        engine.add_request(str(n), family.prompts[i], SamplingParams(max_tokens=new_tokens(name, i, a),
                                                                     ignore_eos=True), adapter=a)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[keys[int(out.request_id)]] = out.token_ids
        engine.block_manager.check_invariants(engine.scheduler.running)
    assert finished == {key: family.expected[key] for key in keys}
    assert engine.stats()["preemptions"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats()["adapter_slots_pinned"] == 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_module_names_are_the_ones_peft_wraps_with_all_linear(families, name, tmp_path):
    """PEFT 0.21's "all-linear" on each base: every decoder projection loramux serves, per layer kind (plus, on
    Qwen3-Next, the router and experts by target_parameters and the shared expert's gate, which is refused; on a
    multimodal base the vision tower's modules, refused by name)."""
    from peft import LoraConfig, get_peft_model

    family = families(name)
    peft = get_peft_model(family.hf, LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft.named_modules() if hasattr(m, "lora_A")}
    peft.save_pretrained(tmp_path)
    family.hf = peft.unload()
    vision = {n for n in wrapped if ".visual." in n or ".vision_tower." in n}
    moe = {n for n in wrapped if n.endswith((".mlp.experts", ".mlp.experts.base_layer", ".shared_expert_gate"))}
    assert wrapped - vision - moe == set(module_names(family.cfg).values())  # Qwen3-Next's routers included
    assert bool(vision) == (name in MULTIMODAL)
    if name == "qwen3_5_text":  # all-linear selects every projection: in_proj_b and in_proj_a included
        adapter = load_adapter_dir(tmp_path, family.cfg)
        assert set(adapter.target_modules) == set(ATTENTION + LINEAR + MLP)
        assert set(adapter.weights) == {(i, t) for i in range(4) for t in layer_targets(family.cfg, i)}
        return
    with pytest.raises(AdapterValidationError) as refused:
        load_adapter_dir(tmp_path, family.cfg)
    assert refused.value.code == "unsupported_target"
    assert ("shared_expert_gate" if name == "qwen3_next" else "vision") in str(refused.value)


def test_conv1d_lora_is_refused_by_name(families, tmp_path):
    from peft import LoraConfig, get_peft_model

    family = families("qwen3_5_text")
    # PEFT wraps the depthwise Conv1d only at a rank divisible by its groups (conv_dim = 64 here).
    peft = get_peft_model(family.hf, LoraConfig(r=64, target_modules=["conv1d", "out_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path)
    family.hf = peft.unload()
    with pytest.raises(AdapterValidationError) as refused:
        load_adapter_dir(tmp_path, family.cfg)
    assert refused.value.code == "unsupported_target"
    message = str(refused.value)
    assert "linear_attn.conv1d" in message and "depthwise causal convolution" in message
    assert "exclude_modules" in message and "in_proj_qkv" in message


@pytest.mark.parametrize("name, targets, module", [("qwen3_5", ["qkv", "q_proj"], "visual"),
                                                   ("gemma3", ["q_proj", "v_proj"], "vision_tower")])
def test_vision_lora_is_refused_by_name(families, name, targets, module, tmp_path):
    """A list of short names selects the vision tower's modules of those names too (PEFT's rule)."""
    from peft import LoraConfig, get_peft_model

    family = families(name)
    peft = get_peft_model(family.hf, LoraConfig(r=2, target_modules=targets, init_lora_weights=False))
    peft.save_pretrained(tmp_path)
    family.hf = peft.unload()
    with pytest.raises(AdapterValidationError) as refused:
        load_adapter_dir(tmp_path, family.cfg)
    assert refused.value.code == "unsupported_target"
    message = str(refused.value)
    assert f"base_model.model.model.{module}." in message and "until images are" in message
    assert "language_model" in message  # what to train on instead


def _renamed(src: Path, dst: Path, rename, config: dict | None = None) -> Path:
    """A copy of adapter `src` with its tensor names passed through `rename` (None drops one) and its config
    updated with `config`."""
    dst.mkdir()
    tensors = {rename(k): v for k, v in load_file(str(src / "adapter_model.safetensors")).items()}
    save_file({k: v for k, v in tensors.items() if k is not None}, str(dst / "adapter_model.safetensors"))
    body = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**body, **(config or {})}))
    return dst


@pytest.mark.parametrize("name, adapter, old, new, code, words", [
    ("qwen3_5_text", "linear", "layers.0.linear_attn", "layers.3.linear_attn", "target_mismatch",
     "layer 3 of this base model is a full-attention layer"),
    ("qwen3_5_text", "attn", "layers.3.self_attn", "layers.1.self_attn", "target_mismatch",
     "layer 1 of this base model is a linear-attention (Gated DeltaNet) layer"),
    ("qwen3_5_text", "linear", "linear_attn.out_proj", "self_attn.out_proj", "unsupported_target",
     "'self_attn.out_proj'"),
    ("qwen3_next", "mixer", "in_proj_qkvz", "in_proj_qkv", "unsupported_target", "fuses in_proj_qkv"),
])
def test_a_projection_the_layer_lacks_is_refused_by_name(families, name, adapter, old, new, code, words, tmp_path):
    family = families(name)
    path = _renamed(family.dirs[adapter], tmp_path / "renamed", lambda k: k.replace(old, new))
    with pytest.raises(AdapterValidationError) as refused:
        load_adapter_dir(path, family.cfg)
    assert refused.value.code == code and words in str(refused.value), str(refused.value)


@pytest.mark.parametrize("name", MULTIMODAL)
def test_other_saved_forms_of_a_multimodal_adapter_load_the_same_weights(families, name, tmp_path):
    """transformers 4.x Gemma 3 saved the language model as `language_model.model.layers`; an adapter trained on the
    text-only class has `model.layers`: PEFT matched target_modules against those names, and so does loramux."""
    family = families(name)
    src = family.dirs["lm"]
    want = load_adapter_dir(src, family.cfg).weights
    old = "base_model.model.model.language_model.layers."
    forms = {"language_model.model.layers.": None, "model.layers.": ["q_proj", "v_proj", "in_proj_qkv", "out_proj"]}
    for form, targets in forms.items():
        path = _renamed(src, tmp_path / form, lambda k, form=form: k.replace(old, f"base_model.model.{form}"),
                        None if targets is None else {"target_modules": targets})
        got = load_adapter_dir(path, family.cfg).weights
        assert got.keys() == want.keys() and all(torch.equal(got[k][0], a) and torch.equal(got[k][1], b)
                                                 for k, (a, b) in want.items()), form
    mixed = _renamed(src, tmp_path / "mixed", lambda k: k.replace(old + "3.", "base_model.model.model.layers.3."))
    with pytest.raises(AdapterValidationError, match="names every layer the one way") as refused:
        load_adapter_dir(mixed, family.cfg)
    assert refused.value.code == "unknown_tensor"


def test_blobs_keep_hybrid_adapters(families):
    from loramux.adapters.storage.blob import pack, unpack

    family = families("qwen3_5_text")
    for adapter in family.dirs:
        a = load_adapter_dir(family.dirs[adapter], family.cfg)
        blob, digest = pack(a.rank, a.alpha, a.use_rslora, a.target_modules, a.weights, a.module_scales, a.magnitudes)
        restored = unpack(blob, a.name, digest)
        assert restored.target_modules == a.target_modules and restored.module_scales == a.module_scales
        assert restored.weights.keys() == a.weights.keys() and restored.magnitudes.keys() == a.magnitudes.keys()
        assert all(torch.equal(restored.weights[k][1], b) for k, (_, b) in a.weights.items())


@pytest.mark.parametrize("method, parameters", [("cat", {}), ("dare_linear", {"density": 0.5, "seed": 3})])
def test_merges_of_hybrid_adapters_equal_peft(families, method, parameters, tmp_path):
    """PEFT merges on the real model; DARE draws its masks in the model's module order (Qwen3.5 defines out_proj
    before the input projections), so equal bytes prove the skeleton's order too."""
    from peft import PeftModel

    from loramux.adapters.composition.merge import MergeComponent, check_components, check_request, merge

    family = families("qwen3_5_text")
    names, weights = ["all", "attn"], [0.7, 0.5]
    components = [MergeComponent(n, load_adapter_dir(family.dirs[n], family.cfg), w) for n, w in zip(names, weights)]
    checked = check_request(method, parameters, weights)
    check_components(method, checked, components, family.cfg)
    ours = build_adapter("m", *merge(method, checked, components, family.cfg).files().values(), family.cfg)

    # PEFT initialises the merged adapter as the first component's config says before DARE draws its masks: as
    # trained adapters say (these were made with random B, init_lora_weights=false, to matter in generation).
    dirs = [_renamed(family.dirs[n], tmp_path / n, lambda k: k, {"init_lora_weights": True}) for n in names]
    base = hf_model_class(family.name).from_pretrained(family.model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, dirs[0], adapter_name="c0")
    model.load_adapter(dirs[1], adapter_name="c1")
    torch.manual_seed(parameters.get("seed", 0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the merge worker: a CPU draw splits its stream by thread
    try:
        model.add_weighted_adapter(["c0", "c1"], weights, "merged", combination_type=method,
                                   **{k: v for k, v in parameters.items() if k != "seed"})
    finally:
        torch.set_num_threads(threads)
    want = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "lora_A") and "merged" in module.lora_A:
            parts = module_name.split(".")
            want[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    assert set(ours.weights) == set(want) and {t for _, t in want} >= set(LINEAR)
    for key, module in want.items():
        assert torch.equal(ours.weights[key][0], module.lora_A["merged"].weight.detach()), key
        assert torch.equal(ours.weights[key][1], module.lora_B["merged"].weight.detach()), key
        assert ours.scale_of(key) == module.scaling["merged"], key


def test_a_merge_on_a_multimodal_base_names_language_model_modules(families):
    from loramux.adapters.composition.merge import MergeComponent, check_request, merge

    family = families("gemma3")
    components = [MergeComponent(n, load_adapter_dir(family.dirs[n], family.cfg), 0.5) for n in ("lm", "mlp")]
    merged = merge("cat", check_request("cat", {}, [0.5, 0.5]), components, family.cfg)
    targets = json.loads(merged.config)["target_modules"]
    assert targets and all(t.startswith("model.language_model.layers.") for t in targets)  # never a vision module
    adapter = build_adapter("m", merged.config, merged.weights, family.cfg)
    assert set(adapter.weights) == set(components[0].adapter.weights) | set(components[1].adapter.weights)
