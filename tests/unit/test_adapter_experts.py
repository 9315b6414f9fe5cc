"""LoRA on the routed experts of mixture-of-experts bases, against PEFT 0.21 itself (transformers 5's fused experts):
PEFT `target_parameters` adapters read into `LoRAAdapter.experts` with every expert's delta equal to PEFT's own
`get_delta_weight` (gpt-oss's interleaved gate/up included); transformers 4.x per-expert adapters (built from a
fused adapter's per-expert slices) with the same deltas; per-layer module names on bases with dense layers; and
every refusal by code and message (router, shared expert, other parameters, expert count, orientation, scales,
partial coverage, DoRA, dense bases), composition and merge refusals."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux.adapters.composition.merge import MergeComponent, MergeError, check_components
from loramux.adapters.composition.weighted import CompositionError, compose
from loramux.adapters.formats.experts import expert_module_names
from loramux.adapters.formats.peft import LoRAAdapter, load_adapter_dir
from loramux.adapters.formats.validation import AdapterValidationError, module_names
from loramux.model.config import ModelConfig

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft.tuners.lora.layer import ParamWrapper  # noqa: E402

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
E, H = 8, 64
WIDTH = {"qwen3_moe": 32, "qwen2_moe": 32, "mixtral": 96, "olmoe": 96, "gpt_oss": 96}  # one expert's width
DENSE = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                    max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False)


def hf_config(family: str, **extra):
    kw = dict(vocab_size=256, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, eos_token_id=0)
    kw["num_local_experts" if family in ("mixtral", "gpt_oss") else "num_experts"] = E
    if family in ("qwen3_moe", "qwen2_moe"):
        kw["moe_intermediate_size"] = 32
    if family == "qwen2_moe":
        kw["shared_expert_intermediate_size"] = 48
    return transformers.AutoConfig.for_model(family, **{**kw, **extra})


def make_peft(path: Path, family: str, hf_extra: dict | None = None, **lora):
    """A PEFT adapter for a tiny `family` model saved at `path`: (the PeftModel, the base's ModelConfig)."""
    torch.manual_seed(0)
    cfg = hf_config(family, **(hf_extra or {}))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    args = dict(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**{**args, **lora}))
    peft_model.save_pretrained(path)
    return peft_model, ModelConfig.from_hf(cfg.to_dict())


def peft_deltas(peft_model) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, parameter name) -> PEFT's delta of each wrapped expert parameter, [E, out, in] or [E, in, out] as
    the parameter is laid out ([E, in, out]: transposed below to [E, out, in])."""
    out = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, ParamWrapper):
            layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
            delta = module.get_delta_weight("default").detach()
            out[(layer, module.parameter_name)] = delta if module._did_swap_in_out_features else delta.transpose(1, 2)
    return out


def our_delta(adapter: LoRAAdapter, key: tuple[int, str], interleaved: bool) -> torch.Tensor:
    """[E, out, in] of the representation, gate/up rows re-interleaved as in the checkpoint for gpt-oss."""
    a, b = adapter.experts[key]
    delta = torch.bmm(b, a) * adapter.scale
    if interleaved and key[1] == "gate_up":
        half = delta.shape[1] // 2
        woven = torch.empty_like(delta)
        woven[:, 0::2], woven[:, 1::2] = delta[:, :half], delta[:, half:]
        delta = woven
    return delta


def refusal(path, base: ModelConfig) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError) as info:
        load_adapter_dir(path, base)
    return info.value


def edit(path: Path, config: dict | None = None, tensors=None, drop: tuple[str, ...] = ()) -> Path:
    """Change an adapter directory in place: config keys, and tensors (name -> tensor, or a function of them)."""
    if config is not None:
        body = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**body, **config}))
    if tensors is not None or drop:
        weights = load_file(path / "adapter_model.safetensors")
        weights = tensors(weights) if callable(tensors) else {**weights, **(tensors or {})}
        save_file({k: v.contiguous() for k, v in weights.items() if k not in drop}, path / "adapter_model.safetensors")
    return path


# ----------------------------------------------------------------------------------- target_parameters

@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """family -> (adapter dir, PeftModel, ModelConfig): target_parameters on both expert parameters + q/v."""
    out = {}
    for family in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe"):
        path = tmp_path_factory.mktemp(family)
        model, cfg = make_peft(path, family, target_parameters=EXPERTS)
        out[family] = (path, model, cfg)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen2_moe"])
def test_target_parameters_deltas_equal_peft(fused, family):
    path, peft_model, cfg = fused[family]
    adapter = load_adapter_dir(path, cfg)
    width = WIDTH[family]
    assert sorted(adapter.experts) == [(0, "down"), (0, "gate_up"), (1, "down"), (1, "gate_up")]
    for (_, slot), (a, b) in adapter.experts.items():
        d_in, d_out = (H, 2 * width) if slot == "gate_up" else (width, H)
        assert a.shape == (E, 4, d_in) and b.shape == (E, d_out, 4)
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
    deltas = peft_deltas(peft_model)
    assert len(deltas) == 4
    for (layer, param), expected in deltas.items():
        slot = {"gate_up_proj": "gate_up", "down_proj": "down"}[param]
        got = our_delta(adapter, (layer, slot), interleaved=family == "gpt_oss")
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert adapter.target_modules == ("q_proj", "v_proj") and adapter.scale == 2.0
    state = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    q_a = state["base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight"]
    assert torch.equal(adapter.weights[(1, "q_proj")][0], q_a)
    expert_bytes = sum((a.numel() + b.numel()) * 4 for a, b in adapter.experts.values())
    plain_bytes = sum((a.numel() + b.numel()) * 4 for a, b in adapter.weights.values())
    assert adapter.nbytes == expert_bytes + plain_bytes


def test_gpt_oss_gate_up_is_deinterleaved(fused):
    """The representation's gate_up rows are gate then up: gpt-oss's even output columns first."""
    path, peft_model, cfg = fused["gpt_oss"]
    adapter = load_adapter_dir(path, cfg)
    raw = load_file(path / "adapter_model.safetensors")
    b = raw["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"]  # [2I, E*r] interleaved
    b3 = b.reshape(b.shape[0], 4, E).permute(2, 0, 1)
    assert torch.equal(adapter.experts[(0, "gate_up")][1][:, :96], b3[:, 0::2])
    assert torch.equal(adapter.experts[(0, "gate_up")][1][:, 96:], b3[:, 1::2])


@pytest.mark.parametrize("params", [["mlp.experts.down_proj"], ["experts.gate_up_proj"]])
def test_one_expert_parameter_rslora_and_parameters_only(tmp_path, params):
    """One targeted parameter (no base_layer nesting), no target_modules at all, rsLoRA's scale."""
    model, cfg = make_peft(tmp_path, "qwen3_moe", target_modules=None, target_parameters=params, use_rslora=True)
    adapter = load_adapter_dir(tmp_path, cfg)
    slot = "down" if params[0].endswith("down_proj") else "gate_up"
    assert sorted(adapter.experts) == [(0, slot), (1, slot)] and adapter.weights == {}
    assert adapter.scale == 8 / 2
    for (layer, _), expected in peft_deltas(model).items():
        torch.testing.assert_close(our_delta(adapter, (layer, slot), False), expected, rtol=1e-5, atol=1e-6)


def test_rank_pattern_keeping_the_scale(tmp_path):
    """rank_pattern + alpha_pattern giving gate_up rank 8 at the same scale, and layer 1's down rank 6: R = 8 for
    gate_up, down padded to 6 on layer 0 (zero rows of A, zero columns of B); deltas PEFT's."""
    model, cfg = make_peft(tmp_path, "olmoe", target_parameters=EXPERTS,
                           rank_pattern={"gate_up_proj": 8, "layers.1.mlp.experts.down_proj": 6},
                           alpha_pattern={"gate_up_proj": 16, "layers.1.mlp.experts.down_proj": 12})
    adapter = load_adapter_dir(tmp_path, cfg)
    assert adapter.experts[(0, "gate_up")][0].shape == (E, 8, H)
    a0, b0 = adapter.experts[(0, "down")]
    assert a0.shape == (E, 6, 96) and b0.shape == (E, H, 6) and adapter.experts[(1, "down")][0].shape == (E, 6, 96)
    assert not a0[:, 4:].any() and not b0[:, :, 4:].any() and a0[:, :4].all()
    for (layer, param), expected in peft_deltas(model).items():
        slot = "gate_up" if param == "gate_up_proj" else "down"
        torch.testing.assert_close(our_delta(adapter, (layer, slot), False), expected, rtol=1e-5, atol=1e-6)


def test_layer_options_do_not_apply_to_target_parameters(tmp_path):
    """PEFT applies layers_to_transform to target_modules only: the experts of every layer are wrapped."""
    model, cfg = make_peft(tmp_path, "qwen3_moe", target_parameters=EXPERTS, layers_to_transform=[0])
    adapter = load_adapter_dir(tmp_path, cfg)
    assert sorted(adapter.weights) == [(0, "q_proj"), (0, "v_proj")] and len(adapter.experts) == 4
    for (layer, param), expected in peft_deltas(model).items():
        slot = "gate_up" if param == "gate_up_proj" else "down"
        torch.testing.assert_close(our_delta(adapter, (layer, slot), False), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- dense layers, module names

def test_dense_and_sparse_layers(tmp_path):
    """Qwen3-MoE with layer 0 dense, PEFT 0.21's own conversion of target_modules gate/up/down_proj on transformers 5
    (target_parameters on the experts, gate_up at r x 2 and lora_alpha x 2 by rank_pattern / alpha_pattern): the
    experts of layer 1 only, at the adapter's scale; the module names per layer."""
    model, cfg = make_peft(tmp_path, "qwen3_moe", {"mlp_only_layers": [0]},
                           target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == ["down_proj", "gate_up_proj"] and saved["rank_pattern"]
    names = module_names(cfg)
    assert (0, "gate_proj") in names and (1, "gate_proj") not in names and (1, "q_proj") in names
    assert {layer for layer, _, _ in expert_module_names(cfg)} == {1}
    adapter = load_adapter_dir(tmp_path, cfg)
    assert sorted(adapter.weights) == [(0, "q_proj"), (1, "q_proj")]
    assert sorted(adapter.experts) == [(1, "down"), (1, "gate_up")]
    assert adapter.experts[(1, "gate_up")][0].shape == (E, 8, H) and adapter.experts[(1, "down")][0].shape == (E, 4, 32)
    for (layer, param), expected in peft_deltas(model).items():
        slot = "gate_up" if param == "gate_up_proj" else "down"
        torch.testing.assert_close(our_delta(adapter, (layer, slot), False), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,targets", [("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                            ("mixtral", r".*\.(q|v)_proj"), ("gpt_oss", ["q_proj", "o_proj"])])
def test_attention_only_adapters_load_as_before(tmp_path, family, targets):
    model, cfg = make_peft(tmp_path, family, target_modules=targets)
    adapter = load_adapter_dir(tmp_path, cfg)
    assert adapter.experts == {} and adapter.magnitudes == {}
    state = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(state) == 2 * len(adapter.weights)
    for (layer, target), (a, b) in adapter.weights.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
        assert torch.equal(a, state[f"{prefix}.lora_A.weight"]) and torch.equal(b, state[f"{prefix}.lora_B.weight"])
    assert adapter.nbytes == sum((a.numel() + b.numel()) * 4 for a, b in adapter.weights.values())


# ----------------------------------------------------------------------------------- per-expert (transformers 4.x)

def write_per_expert(path: Path, source: LoRAAdapter, family: str, parts=("gate_proj", "up_proj", "down_proj"),
                     skip: tuple = (), dense: dict | None = None, **config) -> Path:
    """A transformers 4.x style adapter: the per-expert slices of `source`'s experts under per-expert names, its
    attention LoRA, and `dense` ((layer, target) -> (A, B)) on dense MLP projections."""
    path.mkdir(parents=True, exist_ok=True)
    mixtral = family == "mixtral"
    own = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {p: p for p in parts}
    section = "block_sparse_moe" if mixtral else "mlp"
    tensors = {}
    for (layer, target), (a, b) in {**source.weights, **(dense or {})}.items():
        module = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{module}"
        tensors[f"{prefix}.{target}.lora_A.weight"], tensors[f"{prefix}.{target}.lora_B.weight"] = a, b
    for (layer, slot), (a, b) in source.experts.items():
        width = b.shape[1] // 2
        for e in range(a.shape[0]):
            pieces = {"down_proj": b[e]} if slot == "down" else {"gate_proj": b[e, :width], "up_proj": b[e, width:]}
            for proj, rows in pieces.items():
                if proj not in parts or (layer, proj, e) in skip:
                    continue
                name = f"base_model.model.model.layers.{layer}.{section}.experts.{e}.{own[proj]}"
                tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a[e].clone(), rows.clone()
    save_file(tensors, path / "adapter_model.safetensors")
    targets = sorted({t for _, t in source.weights} | {t for _, t in dense or {}} | {own[p] for p in parts})
    body = {"peft_type": "LORA", "r": source.rank, "lora_alpha": source.alpha, "target_modules": targets,
            "lora_dropout": 0.0, "bias": "none", **config}
    (path / "adapter_config.json").write_text(json.dumps(body))
    return path


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_names_equal_fused(fused, tmp_path, family):
    path, _, cfg = fused[family]
    source = load_adapter_dir(path, cfg)
    adapter = load_adapter_dir(write_per_expert(tmp_path / "per", source, family), cfg)
    assert sorted(adapter.experts) == sorted(source.experts) and adapter.scale == source.scale
    assert adapter.experts[(0, "gate_up")][0].shape == (E, 8, H)  # R = r_gate + r_up
    assert adapter.experts[(0, "down")][0].shape == (E, 4, WIDTH[family])
    for key in source.experts:
        torch.testing.assert_close(our_delta(adapter, key, False), our_delta(source, key, False), rtol=1e-6, atol=1e-7)
    for key in source.weights:
        assert all(torch.equal(x, y) for x, y in zip(adapter.weights[key], source.weights[key]))


def test_per_expert_gate_only_and_dense_layer(tmp_path):
    """target_modules gate_proj and down_proj with layer 0 dense (transformers 4.x): the per-expert gate fills the
    gate rows (up rows zero) of layer 1's experts, the dense MLP of layer 0 is a plain module."""
    fused_dir = tmp_path / "fused"
    _, cfg = make_peft(fused_dir, "qwen3_moe", {"mlp_only_layers": [0]}, target_modules=["q_proj"],
                       target_parameters=EXPERTS)
    source = load_adapter_dir(fused_dir, cfg)
    dense = {(0, "gate_proj"): (torch.randn(4, H), torch.randn(96, 4)), (0, "down_proj"): (torch.randn(4, 96),
                                                                                           torch.randn(H, 4))}
    per = write_per_expert(tmp_path / "per", source, "qwen3_moe", parts=("gate_proj", "down_proj"), dense=dense)
    declared = json.loads((per / "adapter_config.json").read_text())["target_modules"]
    assert declared == ["down_proj", "gate_proj", "q_proj"]
    adapter = load_adapter_dir(per, cfg)
    assert sorted(adapter.weights) == [(0, "down_proj"), (0, "gate_proj"), (0, "q_proj"), (1, "q_proj")]
    assert all(torch.equal(x, y) for key in dense for x, y in zip(adapter.weights[key], dense[key]))
    a, b = adapter.experts[(1, "gate_up")]
    assert a.shape == (E, 4, H) and b.shape == (E, 64, 4) and not b[:, 32:].any()
    got, want = our_delta(adapter, (1, "gate_up"), False), our_delta(source, (1, "gate_up"), False)
    torch.testing.assert_close(got[:, :32], want[:, :32], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(our_delta(adapter, (1, "down"), False), our_delta(source, (1, "down"), False))


def test_per_expert_bfloat16_keeps_dtype(fused, tmp_path):
    path, _, cfg = fused["olmoe"]
    source = load_adapter_dir(path, cfg)
    per = write_per_expert(tmp_path / "per", source, "olmoe")
    edit(per, tensors=lambda w: {k: v.to(torch.bfloat16) for k, v in w.items()})
    from loramux.adapters.formats.validation import validate_adapter_files
    files = {n: (per / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    validated = validate_adapter_files(files, cfg)
    assert {t.dtype for pair in validated.experts.values() for t in pair} == {torch.bfloat16}
    assert validated.nbytes == sum((a.numel() + b.numel()) * 2 for a, b in
                                   [*validated.experts.values(), *validated.tensors.values()])


# ----------------------------------------------------------------------------------- refusals

def fresh(fused, family: str, tmp_path: Path) -> Path:
    """A copy of the family's fused adapter to edit."""
    path = tmp_path / f"copy-{family}"
    path.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (path / name).write_bytes((fused[family][0] / name).read_bytes())
    return path


def test_wrong_number_of_experts(fused, tmp_path):
    path, _, _ = fused["qwen3_moe"]
    fewer = ModelConfig.from_hf(hf_config("qwen3_moe", num_experts=4).to_dict())
    err = refusal(path, fewer)
    assert err.code == "expert_shape_mismatch" and "8 experts" in str(err) and "4 experts" in str(err)
    source = load_adapter_dir(path, fused["qwen3_moe"][2])
    per = write_per_expert(tmp_path / "per", source, "qwen3_moe")
    err = refusal(per, fewer)
    assert err.code == "expert_shape_mismatch" and "has 4 experts" in str(err)


def test_orientation_swapped(fused, tmp_path):
    path = fresh(fused, "qwen3_moe", tmp_path)  # down: in = 32, out = 64: A [E*r, 64], B [32, E*r] is swapped
    edit(path, tensors={"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.randn(32, 64),
                        "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.randn(32, 32)})
    err = refusal(path, fused["qwen3_moe"][2])
    assert err.code == "expert_shape_mismatch" and "orientation is swapped" in str(err)
    assert "mlp.experts.down_proj" in str(err)


def test_other_expert_shape(fused, tmp_path):
    path = fresh(fused, "gpt_oss", tmp_path)
    edit(path, tensors={"base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight": torch.randn(190, 32)})
    err = refusal(path, fused["gpt_oss"][2])
    assert err.code == "expert_shape_mismatch" and "(192, 32)" in str(err)


@pytest.mark.parametrize("family,lora,where", [
    ("qwen3_moe", dict(target_modules=["q_proj", "gate"]), "mlp.gate"),
    ("qwen3_moe", dict(target_modules=["q_proj"], target_parameters=["mlp.gate.weight"]), "mlp.gate"),
    ("gpt_oss", dict(target_modules=["q_proj"], target_parameters=["mlp.router.weight"]), "mlp.router"),
    ("mixtral", dict(target_modules="all-linear"), "mlp.gate"),  # PEFT 0.21 adds the router to all-linear
])
def test_router_lora_is_a_module_of_its_own(tmp_path, family, lora, where):
    """LoRA on the router loads as the "router" module, A [r, hidden] and B [experts, r], PEFT's delta exactly;
    router tensors the config does not select are refused by name."""
    peft_model, cfg = make_peft(tmp_path, family, **lora)
    adapter = load_adapter_dir(tmp_path, cfg)
    for layer in range(cfg.num_layers):
        a, b = adapter.weights[(layer, "router")]
        assert a.shape == (4, cfg.hidden_size) and b.shape == (cfg.moe.num_experts, 4)
        module = peft_model.base_model.model.model.layers[layer].get_submodule(where)
        torch.testing.assert_close(b @ a * adapter.scale_of((layer, "router")),
                                   module.get_delta_weight("default").float(), rtol=1e-5, atol=1e-6)
    edit(tmp_path, config={"target_modules": ["q_proj"], "target_parameters": None})
    assert refusal(tmp_path, cfg).code == "target_mismatch"  # (all-linear: the experts' tensors are named first)


def test_router_bias_lora_refused(tmp_path):
    """PEFT cannot wrap the 1-D bias; a config that names it anyway is refused by name."""
    _, cfg = make_peft(tmp_path, "gpt_oss", target_modules=["q_proj"], target_parameters=["mlp.router.weight"])
    edit(tmp_path, config={"target_parameters": ["mlp.router.bias"]})
    err = refusal(tmp_path, cfg)
    assert err.code == "unsupported_target" and "router's bias" in str(err)


@pytest.mark.parametrize("targets", [["q_proj", "shared_expert_gate"], ["q_proj", "gate_proj", "up_proj", "down_proj"],
                                     "all-linear"])
def test_shared_expert_lora_refused(tmp_path, targets):
    _, cfg = make_peft(tmp_path, "qwen2_moe", target_modules=targets)
    err = refusal(tmp_path, cfg)
    assert err.code == "unsupported_target" and "mlp.shared_expert" in str(err) and "not served" in str(err)


@pytest.mark.parametrize("family,params,phrase", [
    ("gpt_oss", ["mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"], "biases"),
    ("qwen3_moe", ["mlp.experts.gate_up_proj", "self_attn.q_proj.weight"], "names no routed-expert parameter"),
    ("qwen2_moe", ["mlp.shared_expert.up_proj.weight"], "mlp.shared_expert"),
])
def test_other_target_parameters_refused(fused, tmp_path, family, params, phrase):
    path = edit(fresh(fused, family, tmp_path), config={"target_parameters": params})
    err = refusal(path, fused[family][2])
    assert err.code == "unsupported_target" and phrase in str(err)


def test_expert_lora_on_a_dense_base(fused, tmp_path):
    err = refusal(fused["qwen3_moe"][0], DENSE)
    assert err.code == "unsupported_target" and "target_parameters" in str(err) and "no routed experts" in str(err)
    source = load_adapter_dir(fused["qwen3_moe"][0], fused["qwen3_moe"][2])
    per = write_per_expert(tmp_path / "per", source, "qwen3_moe")
    edit(per, tensors=lambda w: {k: v for k, v in w.items() if "q_proj" not in k and "v_proj" not in k},
         config={"target_modules": ["gate_proj", "up_proj", "down_proj"]})
    err = refusal(per, DENSE)
    assert err.code == "unsupported_target" and "no routed experts" in str(err) and "llama" in str(err)


def test_expert_scale_differing_refused(tmp_path):
    _, cfg = make_peft(tmp_path, "qwen3_moe", target_parameters=EXPERTS, rank_pattern={"down_proj": 8})
    err = refusal(tmp_path, cfg)
    assert err.code == "unsupported_expert_lora" and "mlp.experts.down_proj" in str(err) and "scale" in str(err)


def test_per_expert_scale_differing_refused(fused, tmp_path):
    source = load_adapter_dir(fused["mixtral"][0], fused["mixtral"][2])
    per = write_per_expert(tmp_path / "per", source, "mixtral", alpha_pattern={"experts.3.w1": 2})
    err = refusal(per, fused["mixtral"][2])
    assert err.code == "unsupported_expert_lora" and "block_sparse_moe.experts.3.w1" in str(err)


def test_partial_coverage_refused(fused, tmp_path):
    path = edit(fresh(fused, "qwen3_moe", tmp_path), config={"target_parameters": [
        "model.layers.0.mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})
    err = refusal(path, fused["qwen3_moe"][2])
    assert err.code == "unsupported_expert_lora" and "every sparse layer" in str(err)
    source = load_adapter_dir(fused["qwen3_moe"][0], fused["qwen3_moe"][2])
    per = write_per_expert(tmp_path / "per", source, "qwen3_moe", layers_to_transform=[1])
    edit(per, tensors=lambda w: {k: v for k, v in w.items() if "layers.0." not in k})
    err = refusal(per, fused["qwen3_moe"][2])
    assert err.code == "unsupported_expert_lora" and "every expert of every sparse layer" in str(err)


def test_missing_expert_refused(fused, tmp_path):
    source = load_adapter_dir(fused["olmoe"][0], fused["olmoe"][2])
    per = write_per_expert(tmp_path / "per", source, "olmoe", skip=((1, "up_proj", 5),))
    err = refusal(per, fused["olmoe"][2])
    assert err.code == "missing_tensor" and "model.layers.1.mlp.experts.5.up_proj" in str(err)
    path = fresh(fused, "olmoe", tmp_path)
    edit(path, drop=("base_model.model.model.layers.1.mlp.experts.lora_B.weight",))
    err = refusal(path, fused["olmoe"][2])
    assert err.code == "missing_tensor" and "layer 1 mlp.experts.down_proj lacks lora_B" in str(err)


def test_dora_and_bias_on_experts_refused(fused, tmp_path):
    path = edit(fresh(fused, "qwen3_moe", tmp_path), config={"use_dora": True})
    err = refusal(path, fused["qwen3_moe"][2])
    assert err.code == "unsupported_expert_lora" and "DoRA" in str(err)
    source = load_adapter_dir(fused["qwen3_moe"][0], fused["qwen3_moe"][2])
    per = write_per_expert(tmp_path / "per", source, "qwen3_moe", use_dora=True)
    err = refusal(per, fused["qwen3_moe"][2])
    assert err.code == "unsupported_expert_lora" and "DoRA" in str(err)
    path = edit(fresh(fused, "mixtral", tmp_path / "b"),
                tensors={"base_model.model.model.layers.0.mlp.experts.lora_B.bias": torch.zeros(H)})
    err = refusal(path, fused["mixtral"][2])
    assert err.code == "unsupported_expert_lora" and "lora_bias" in str(err)


def test_dense_mlp_lora_on_a_sparse_layer(fused, tmp_path):
    path = edit(fresh(fused, "qwen3_moe", tmp_path), config={"target_modules": ["q_proj", "v_proj", "gate_proj"]},
                tensors={"base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight": torch.randn(4, H),
                         "base_model.model.model.layers.1.mlp.gate_proj.lora_B.weight": torch.randn(32, 4)})
    err = refusal(path, fused["qwen3_moe"][2])
    assert err.code == "target_mismatch" and "has routed experts, not a dense MLP" in str(err)


def test_fused_tensors_without_target_parameters(fused, tmp_path):
    path = edit(fresh(fused, "olmoe", tmp_path), config={"target_parameters": None})
    err = refusal(path, fused["olmoe"][2])
    assert err.code == "target_mismatch" and "target_parameters" in str(err)


def test_bad_target_parameters_option(fused, tmp_path):
    path = edit(fresh(fused, "olmoe", tmp_path), config={"target_parameters": "mlp.experts.down_proj"})
    err = refusal(path, fused["olmoe"][2])
    assert err.code == "bad_option" and "target_parameters" in str(err)


# ----------------------------------------------------------------------------------- composition and merges

def test_composition_and_merge_refuse_expert_lora(fused):
    path, _, cfg = fused["qwen3_moe"]
    adapter = load_adapter_dir(path, cfg, name="moe-ad")
    with pytest.raises(CompositionError, match="moe-ad.*LoRA on routed experts.*not supported"):
        compose([(adapter, 1.0)], "c")
    with pytest.raises(MergeError, match="LoRA on routed experts.*not supported") as info:
        check_components("cat", {}, [MergeComponent("'moe-ad'", adapter, 1.0), MergeComponent("b", adapter, 1.0)],
                         cfg)
    assert info.value.param == "components[0]" and "moe-ad" in str(info.value)


def test_merge_refuses_router_lora_and_composition_keeps_it(tmp_path):
    """Composition concatenates ranks, so a router LoRA composes exactly like any module; a merge is refused."""
    _, cfg = make_peft(tmp_path, "qwen3_moe", target_modules=["q_proj"], target_parameters=["mlp.gate.weight"])
    adapter = load_adapter_dir(tmp_path, cfg, name="router-ad")
    composite = compose([(adapter, 0.5), (adapter, 0.25)], "c")
    a, b = composite.weights[(0, "router")]
    want_a, want_b = adapter.weights[(0, "router")]
    torch.testing.assert_close(b @ a * composite.scale, want_b @ want_a * adapter.scale * 0.75)
    with pytest.raises(MergeError, match="router.*not supported") as info:
        check_components("cat", {}, [MergeComponent("'router-ad'", adapter, 1.0), MergeComponent("b", adapter, 1.0)],
                         cfg)
    assert info.value.param == "components[0]"
