"""DoRA (use_dora) adapters made by PEFT itself, served exactly: greedy tokens equal PEFT's alone and in one mixed
batch with plain LoRA adapters and the base model (prefix caching and prompt-lookup speculation on), on a tiny
Llama, a tiny Qwen2 (q/k/v biases), through the fixed-shape decode path and the Triton kernels (interpreter),
and on the embedded SmolLM2. Also: DoRA's per-channel scale against PEFT's own weight norm, every refusal of a
malformed DoRA upload, the stored blob round trip, and the device bytes a DoRA slot costs."""
from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.adapters.formats.validation import AdapterValidationError
from loramux.engine.outputs import RequestError
from loramux.engine.sampling.params import SamplingParams
from loramux.testing import save_tiny_hf_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 10


def make_peft_adapter(model_dir, out, *, r: int, targets, seed: int, use_dora: bool = True,
                      use_rslora: bool = False, alpha: float | None = None):
    """Save a PEFT LoRA (DoRA with `use_dora`) adapter of `model_dir` to `out`, trained-looking: lora_A and
    lora_B random, and each DoRA magnitude moved away from its initial ||W + s·B·A|| (so g != 1)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=list(targets),
                                           use_dora=use_dora, use_rslora=use_rslora, init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(0.5 + torch.rand_like(param))
            elif "lora_B" in name:
                param.normal_(0, 0.2)
    peft.save_pretrained(out)
    return out


def greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens, one forward per token over HF's KV cache, no EOS handling (the engine ignores EOS too)."""
    out: list[int] = []
    with torch.inference_mode():
        step = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def peft_reference(model_dir, adapter_dirs: dict, prompts, n: int = NEW_TOKENS) -> dict:
    """{(prompt index, adapter name or None): PEFT's greedy tokens}. PEFT's DoRA caching (its inference switch:
    the weight norm and B·A kept per adapter in eval mode, the same values) spares recomputing them each token."""
    from peft import PeftModel
    from peft.tuners.lora import dora
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()
    results, caching = {}, dora.ENABLE_DORA_CACHING
    dora.ENABLE_DORA_CACHING = True
    try:
        for name in [None, *names]:
            for i, prompt in enumerate(prompts):
                if name is None:
                    with model.disable_adapter():
                        results[(i, None)] = greedy(model, prompt, n)
                else:
                    model.set_adapter(name)
                    results[(i, name)] = greedy(model, prompt, n)
    finally:
        dora.ENABLE_DORA_CACHING = caching
    return results


def engine_outputs(engine, prompts, names, n: int = NEW_TOKENS, mixed: bool = True) -> dict:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    keys = [(i, name) for name in names for i in range(len(prompts))]
    if mixed:
        outs = run_to_completion(engine, [(prompts[i], params, name) for i, name in keys])
    else:
        outs = [run_to_completion(engine, [(prompts[i], params, name)])[0] for i, name in keys]
    return {key: list(out.token_ids) for key, out in zip(keys, outs)}


def make_prompts(seed: int, count: int = 3) -> list[list[int]]:
    """Prompts sharing a prefix (prefix caching) that repeats itself (prompt-lookup drafts find n-grams)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 20000) for _ in range(12)]
    return [prefix + prefix[:6] + [rng.randrange(100, 20000) for _ in range(3 + i)] for i in range(count)]


def assert_adapters_matter(expected: dict, names, prompts) -> None:
    for name in names:
        assert any(expected[(i, name)] != expected[(i, None)] for i in range(len(prompts))), name


# --------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("dora-llama")
    save_tiny_hf_model(path, len(tokenizer), "llama", weight_scale=4.0, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("dora-llama-adapters")
    return {
        "dora-all": make_peft_adapter(llama_dir, root / "dora-all", r=8, targets=ALL, seed=1),
        "dora-qv-rslora": make_peft_adapter(llama_dir, root / "dora-qv", r=4, targets=["q_proj", "v_proj"], seed=2,
                                            use_rslora=True, alpha=6),
        "lora-attn": make_peft_adapter(llama_dir, root / "lora-attn", r=8, targets=ALL[:4], seed=3, use_dora=False),
    }


@pytest.fixture(scope="module")
def llama_prompts():
    return make_prompts(0)


@pytest.fixture(scope="module")
def llama_expected(llama_dir, llama_adapters, llama_prompts):
    expected = peft_reference(llama_dir, llama_adapters, llama_prompts)
    assert_adapters_matter(expected, llama_adapters, llama_prompts)
    return expected


def serving_engine(model_dir, tokenizer, adapters: dict, **config):
    engine = make_engine(model_dir, tokenizer, prefix_caching=True, speculative_tokens=4, max_lora_rank=16,
                         **config)
    for name, path in adapters.items():
        engine.load_adapter_dir(path, name)
    return engine


# --------------------------------------------------------------------------------------------- format

def test_magnitudes_are_read_as_peft_saved_them(llama_dir, llama_adapters, tiny_cfg):
    from safetensors.torch import load_file

    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(llama_dir)
    adapter = load_adapter_dir(llama_adapters["dora-all"], cfg)
    saved = load_file(llama_adapters["dora-all"] / "adapter_model.safetensors")
    names = [k for k in saved if "magnitude" in k]
    assert names and all(k.endswith(".lora_magnitude_vector") for k in names)  # PEFT 0.21's name
    assert set(adapter.magnitudes) == set(adapter.weights) and len(adapter.magnitudes) == len(names)
    for (layer, target), m in adapter.magnitudes.items():
        section = "self_attn" if target in ALL[:4] else "mlp"
        torch.testing.assert_close(m, saved[f"base_model.model.model.layers.{layer}.{section}.{target}"
                                            ".lora_magnitude_vector"], rtol=0, atol=0)
    assert not load_adapter_dir(llama_adapters["lora-attn"], cfg).magnitudes


def _files(path) -> dict:
    return {"adapter_config.json": (path / "adapter_config.json").read_bytes(),
            "adapter_model.safetensors": (path / "adapter_model.safetensors").read_bytes()}


def _edited(path, config_edit=None, tensors_edit=None) -> dict:
    from safetensors.torch import load_file, save

    config = json.loads((path / "adapter_config.json").read_text())
    tensors = load_file(path / "adapter_model.safetensors")
    if config_edit:
        config_edit(config)
    if tensors_edit:
        tensors_edit(tensors)
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": save(tensors)}


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _set(d, key, value):
    d[key] = value


def _pop_magnitude(t):
    t.pop(f"{Q0}.lora_magnitude_vector")


def _rename_magnitude(t):
    t[f"{Q0}.lora_magnitude_vector.weight"] = t[f"{Q0}.lora_magnitude_vector"].clone()


REFUSALS = {  # case: (config edit, tensors edit, code, words in the message)
    "magnitude-without-use_dora": (lambda c: _set(c, "use_dora", False), None, "unknown_tensor", "use_dora"),
    "missing-magnitude": (None, _pop_magnitude, "missing_tensor", "layer 0 q_proj"),
    "magnitude-of-uncovered-module": (None, lambda t: _set(t, Q0.replace("q_proj", "o_proj") + ".lora_magnitude_vector",
                                                            torch.ones(64)), "unknown_tensor", "o_proj"),
    "magnitude-wrong-shape": (None, lambda t: _set(t, f"{Q0}.lora_magnitude_vector", torch.ones(63)),
                              "shape_mismatch", "lora_magnitude_vector"),
    "magnitude-nan": (None, lambda t: t[f"{Q0}.lora_magnitude_vector"].__setitem__(3, float("nan")), "non_finite",
                      "lora_magnitude_vector"),
    "magnitude-twice": (None, _rename_magnitude, "duplicate_tensor", "twice"),
    "use_dora-not-boolean": (lambda c: _set(c, "use_dora", "yes"), None, "bad_option", "use_dora"),
    "dora-on-embedding": (lambda c: _set(c, "target_modules", ["q_proj", "v_proj", "embed_tokens"]), None,
                          "unsupported_option", "embed_tokens"),
    "embedding-magnitude": (None, lambda t: _set(t, "base_model.model.model.embed_tokens.lora_magnitude_vector",
                                                 torch.ones(64)), "unsupported_option", "embedding"),
    "extra-unknown-tensor": (None, lambda t: _set(t, f"{Q0}.lora_C.weight", torch.ones(2, 2)), "unknown_tensor",
                             "lora_C"),
}


@pytest.fixture(scope="module")
def qv_dora_dir(tmp_path_factory, llama_dir):
    return make_peft_adapter(llama_dir, tmp_path_factory.mktemp("qv-dora") / "a", r=4, targets=["q_proj", "v_proj"],
                             seed=5)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_malformed_dora_uploads_are_refused_by_name(case, qv_dora_dir, llama_dir):
    from loramux.adapters.formats.validation import validate_adapter_files
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(llama_dir)
    config_edit, tensors_edit, code, words = REFUSALS[case]
    validate_adapter_files(_files(qv_dora_dir), cfg)  # the unedited adapter passes
    with pytest.raises(AdapterValidationError) as refused:
        validate_adapter_files(_edited(qv_dora_dir, config_edit, tensors_edit), cfg)
    assert refused.value.code == code, str(refused.value)
    assert words in str(refused.value)


# --------------------------------------------------------------------------------------------- g

@pytest.mark.parametrize("packed", [False, True])
def test_dora_scale_matches_peft_weight_norm(llama_dir, llama_adapters, packed):
    """g = m / ||W + s·B·A||_row against PEFT's own get_weight_norm, with W kept and with W packed (norms kept
    from load, the cross term through the packed base layer)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loramux.adapters.formats.dora import dora_scale
    from loramux.model.llama import PROJECTION_SLICES
    from loramux.model.loader import build_model

    model, cfg = build_model(llama_dir, torch.float32, torch.device("cpu"), pack_cpu=packed)
    if packed and model.layers[0].self_attn.qkv_proj.weight is not None:
        pytest.skip("oneDNN packing is not available here")
    adapter = load_adapter_dir(llama_adapters["dora-all"], cfg)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                                     llama_adapters["dora-all"]).eval()
    for (layer, target), (a, b) in adapter.weights.items():
        section = "self_attn" if target in ALL[:4] else "mlp"
        module = peft.base_model.model.model.layers[layer].get_submodule(f"{section}.{target}")
        dora = module.lora_magnitude_vector["default"]
        lora_weight = module.lora_B["default"].weight @ module.lora_A["default"].weight
        norm = dora.get_weight_norm(module.get_base_layer().weight, lora_weight, module.scaling["default"])
        path, slice_name = PROJECTION_SLICES[target]
        g = dora_scale(model.layers[layer].get_submodule(path), slice_name, a, b, adapter.scale_of((layer, target)),
                       adapter.magnitudes[(layer, target)])
        torch.testing.assert_close(g, dora.weight.detach() / norm, rtol=2e-6, atol=0, msg=f"{layer} {target}")


# --------------------------------------------------------------------------------------------- engine

@pytest.mark.parametrize("static_decode", [False, True])
def test_tiny_llama_dora_equals_peft_alone_and_mixed(llama_dir, tokenizer, llama_adapters, llama_prompts,
                                                      llama_expected, static_decode):
    engine = serving_engine(llama_dir, tokenizer, llama_adapters)
    if static_decode:  # plain decode steps from fixed-shape buffers (what CUDA graphs replay), run eagerly
        engine.runner.use_decode_graphs(capture=False)
    names = [None, *llama_adapters]
    assert engine_outputs(engine, llama_prompts, names, mixed=True) == llama_expected
    alone = engine_outputs(engine, llama_prompts[:1], names, mixed=False)
    assert alone == {k: v for k, v in llama_expected.items() if k[0] == 0}
    if static_decode:
        assert engine.runner.graphs.steps > 0
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0
    assert stats["prefix_cache_hit_blocks"] > 0 and stats["spec_proposed_tokens"] > 0, stats  # both exercised
    keys = sorted(engine.pool.buckets)
    assert [k.dora for k in keys].count(True) == 2 and [k.dora for k in keys].count(False) == 1


def test_qwen2_biases_are_left_out_of_the_rescale(tmp_path_factory, tokenizer):
    model_dir = tmp_path_factory.mktemp("dora-qwen2")
    save_tiny_hf_model(model_dir, len(tokenizer), "qwen2", weight_scale=4.0, tokenizer=tokenizer)
    root = tmp_path_factory.mktemp("dora-qwen2-adapters")
    adapters = {"dora-qkv": make_peft_adapter(model_dir, root / "dora-qkv", r=8, targets=ALL[:4] + ["down_proj"],
                                              seed=11),
                "dora-k": make_peft_adapter(model_dir, root / "dora-k", r=4, targets=["k_proj"], seed=12),
                "lora": make_peft_adapter(model_dir, root / "lora", r=4, targets=["q_proj", "v_proj"], seed=13,
                                          use_dora=False)}
    prompts = make_prompts(1)
    expected = peft_reference(model_dir, adapters, prompts)
    assert_adapters_matter(expected, adapters, prompts)
    engine = serving_engine(model_dir, tokenizer, adapters)
    assert engine.model.layers[0].self_attn.qkv_proj.bias is not None
    assert engine_outputs(engine, prompts, [None, *adapters], mixed=True) == expected
    assert engine_outputs(engine, prompts[:1], [None, *adapters], mixed=False) == \
        {k: v for k, v in expected.items() if k[0] == 0}
    stats = engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0 and stats["spec_proposed_tokens"] > 0, stats


def test_dora_through_the_triton_kernels(llama_dir, tokenizer, llama_adapters, llama_prompts, llama_expected):
    """lora_impl="triton" (the interpreter on CPU): a DoRA adapter, a plain one and the base model, mixed."""
    pytest.importorskip("triton")
    adapters = {k: llama_adapters[k] for k in ("dora-qv-rslora", "lora-attn")}
    engine = serving_engine(llama_dir, tokenizer, adapters, lora_impl="triton")
    names = [None, *adapters]
    got = engine_outputs(engine, llama_prompts[:1], names, n=4, mixed=True)
    assert got == {k: v[:4] for k, v in llama_expected.items() if k[0] == 0 and k[1] in names}


def test_an_int8_base_refuses_dora_and_says_why(llama_dir, tokenizer, llama_adapters):
    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine
    from loramux.model.loader import build_model

    model, _ = build_model(llama_dir, torch.float32, torch.device("cpu"), quantization="int8")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, max_lora_rank=16))
    engine.load_adapter_dir(llama_adapters["lora-attn"], "plain")  # plain LoRA still serves on int8
    with pytest.raises(RequestError, match="int8"):
        engine.load_adapter_dir(llama_adapters["dora-all"], "dora")


def test_a_dora_slot_counts_its_scales(llama_dir, tokenizer, llama_adapters):
    engine = serving_engine(llama_dir, tokenizer, {})
    cfg = engine.model.config
    adapter = load_adapter_dir(llama_adapters["dora-all"], cfg)
    key = engine.pool.bucket_of(adapter)
    assert key.dora and key.rank == 8 and len(key.paths) == 4
    assert not engine.pool.bucket_of(load_adapter_dir(llama_adapters["lora-attn"], cfg)).dora
    outputs = cfg.q_size + 2 * cfg.kv_size + cfg.hidden_size + 2 * cfg.intermediate_size + cfg.hidden_size
    assert engine.pool.slot_bytes(key) - engine.pool.slot_bytes(key._replace(dora=False)) == \
        outputs * cfg.num_layers * 4  # float32 g per output channel, every layer


# --------------------------------------------------------------------------------------------- stored form

def test_registry_upload_serves_exactly_like_the_directory(llama_dir, tokenizer, llama_adapters, llama_prompts,
                                                           llama_expected, tmp_path):
    from loramux.adapters.storage.blob import pack, unpack
    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Database
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(llama_dir)
    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    store = FileStore(tmp_path / "blobs")
    registry = AdapterRegistry(db, store, cfg, "tiny-llama")
    tenant = registry.tenancy.create_tenant("acme")
    info = registry.register(tenant.id, "dora", _files(llama_adapters["dora-all"]))
    stored = unpack(store.get(info.storage_key), "dora", info.digest)
    local = load_adapter_dir(llama_adapters["dora-all"], cfg)
    assert set(stored.magnitudes) == set(local.magnitudes)
    for key, m in local.magnitudes.items():
        assert torch.equal(stored.magnitudes[key], m)
    # A plain adapter's blob is unchanged by DoRA support: no use_dora in its config, same bytes as before.
    plain = load_adapter_dir(llama_adapters["lora-attn"], cfg)
    blob, _ = pack(plain.rank, plain.alpha, plain.use_rslora, plain.target_modules, plain.weights)
    assert b"use_dora" not in blob and not unpack(blob, "plain").magnitudes
    engine = serving_engine(llama_dir, tokenizer, {})
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = run_to_completion(engine, [(p, params, stored) for p in llama_prompts])
    assert [list(o.token_ids) for o in outs] == [llama_expected[(i, "dora-all")] for i in range(len(llama_prompts))]
    db.dispose()


# --------------------------------------------------------------------------------------------- kernels

SLOT_MAPS = [[0, 1, 2, 3], [0, 0, 1, 1], [-1, 0, 0, 2, 2], [1, 0, 1, 0], [0, 0, 0, 1], [-1, -1], [3, -1, 3, 2, 2, 2]]


@pytest.mark.parametrize("slot_map", SLOT_MAPS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_dora_rescale_torch_paths_equal_the_reference(slot_map, with_bias):
    from loramux.kernels import LoRABatch
    from loramux.kernels.dora import dora_rescale, dora_rescale_reference

    gen = torch.Generator().manual_seed(len(slot_map))
    y = torch.randn(len(slot_map), 40, generator=gen)
    g = torch.rand(4, 40, generator=gen) + 0.5
    bias = torch.randn(40, generator=gen) if with_bias else None
    slots = torch.tensor(slot_map)
    expected = dora_rescale_reference(y, g, bias, slots)
    got = y.clone()
    dora_rescale(got, g, bias, LoRABatch.from_slot_map(slot_map), impl="torch")
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    for row, slot in enumerate(slot_map):  # rows of no slot are untouched, bit for bit
        if slot < 0:
            assert torch.equal(got[row], y[row])


@pytest.mark.parametrize("slot_map", SLOT_MAPS + [[0] * 37 + [2] * 5 + [-1] * 3])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dora_rescale_triton_equals_torch(slot_map, with_bias, dtype):
    pytest.importorskip("triton")
    from loramux.kernels.dora import dora_rescale_torch
    from loramux.kernels.dora_triton import dora_rescale_triton

    gen = torch.Generator().manual_seed(7)
    y = torch.randn(len(slot_map), 200, generator=gen).to(dtype)
    g = (torch.rand(4, 200, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(200, generator=gen).to(dtype) if with_bias else None
    slots = torch.tensor(slot_map)
    expected, got = y.clone(), y.clone()
    dora_rescale_torch(expected, g, bias, slots)
    dora_rescale_triton(got, g, bias, slots)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # Triton rounds once from float32, torch after each op
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    keep = slots < 0
    assert torch.equal(got[keep], y[keep])


# --------------------------------------------------------------------------------------------- SmolLM2

@pytest.mark.real_model
def test_smollm2_dora_equals_peft_in_a_mixed_batch(smol_dir, tokenizer, tmp_path):
    adapters = {"dora": make_peft_adapter(smol_dir, tmp_path / "dora", r=8, targets=["q_proj", "v_proj", "o_proj",
                                                                                     "down_proj"], seed=21),
                "lora": make_peft_adapter(smol_dir, tmp_path / "lora", r=8, targets=["q_proj", "v_proj"], seed=22,
                                          use_dora=False)}
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, tokenize=True)
    prompts = [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
    expected = peft_reference(smol_dir, adapters, prompts)
    assert_adapters_matter(expected, adapters, prompts)
    engine = serving_engine(smol_dir, tokenizer, adapters)
    assert engine_outputs(engine, prompts, [None, *adapters], mixed=True) == expected


def test_phi3_fused_dora_splits_onto_the_engine_projections(tmp_path_factory, tokenizer):
    """Phi-3's fused qkv_proj / gate_up_proj DoRA: the magnitude is cut by rows like B, and each sub-projection's
    g equals PEFT's on the fused module's rows (the norm is per output row)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loramux.adapters.formats.dora import dora_scale
    from loramux.model.llama import PROJECTION_SLICES
    from loramux.model.loader import build_model

    model_dir = tmp_path_factory.mktemp("dora-phi3")
    save_tiny_hf_model(model_dir, 300, "phi3", pad_token_id=0)
    fused = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapter_dir = make_peft_adapter(model_dir, tmp_path_factory.mktemp("dora-phi3-adapter") / "a", r=4,
                                    targets=fused, seed=31)
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    adapter = load_adapter_dir(adapter_dir, cfg)
    assert set(adapter.magnitudes) == set(adapter.weights) and len(adapter.weights) == 7 * cfg.num_layers
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                     adapter_dir).eval()
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
             "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    for layer in range(cfg.num_layers):
        for name in fused:
            section = "self_attn" if name in ("qkv_proj", "o_proj") else "mlp"
            module = peft.base_model.model.model.layers[layer].get_submodule(f"{section}.{name}")
            dora = module.lora_magnitude_vector["default"]
            lora_weight = module.lora_B["default"].weight @ module.lora_A["default"].weight
            expected = dora.weight.detach() / dora.get_weight_norm(module.get_base_layer().weight, lora_weight,
                                                                     module.scaling["default"])
            ours = []
            for part in parts[name]:
                path, slice_name = PROJECTION_SLICES[part]
                a, b = adapter.weights[(layer, part)]
                ours.append(dora_scale(model.layers[layer].get_submodule(path), slice_name, a, b,
                                       adapter.scale_of((layer, part)), adapter.magnitudes[(layer, part)]))
            torch.testing.assert_close(torch.cat(ours), expected, rtol=2e-6, atol=0, msg=f"{layer} {name}")
