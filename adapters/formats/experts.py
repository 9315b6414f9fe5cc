"""LoRA on the routed experts of a mixture-of-experts base: PEFT's two layouts, read into one representation.

Representation (`ValidatedAdapter.experts`, `LoRAAdapter.experts`): per sparse layer and slot,

    experts[(layer, "gate_up")] = (A [E, R, hidden], B [E, 2 x width, R])   rows of B: gate, then up
    experts[(layer, "down")]    = (A [E, R, width],  B [E, hidden, R])

(E = `MoESpec.num_experts`, width = `MoESpec.intermediate_size`); expert e's delta is `B[e] @ A[e] * scale`,
[out, in], with the adapter's own scale (lora_alpha / r, lora_alpha / sqrt(r) with rsLoRA). gpt-oss checkpoints
interleave gate and up columns; the engine stores them de-interleaved (gate then up) and so does this
representation: B's rows are `cat(rows[0::2], rows[1::2])` of PEFT's.

The two layouts an adapter file may hold:

* **target_parameters** (PEFT 0.17+ on transformers 5, whose experts are fused `mlp.experts.gate_up_proj` /
  `mlp.experts.down_proj` parameters): per layer one `lora_A` [E * r, in] and `lora_B` [out, E * r] per targeted
  parameter, in and out logical (gate_up: in = hidden, out = 2 x width; down: in = width, out = hidden, in every
  family). PEFT wraps the targeted parameters of `mlp.experts` one inside the other, in the order the module
  registers them (gate_up_proj, then down_proj): the first wrapped is the deepest, so with both targeted
  gate_up's tensors are `mlp.experts.base_layer.lora_A` and down's `mlp.experts.lora_A`; with one, no
  `base_layer`. PEFT's delta of expert e (`ParamWrapper.get_delta_weight`): A viewed as [E, r, in] (expert-major),
  B as [out, r, E] (rank-major), delta_e = B[:, :, e] @ A[e] x scaling. Here: A.reshape(E, r, in),
  B.reshape(out, r, E).permute(2, 0, 1); R = r.
* **per-expert modules** (adapters trained on transformers 4.x, which held one Linear per expert):
  `mlp.experts.<e>.gate_proj / up_proj / down_proj` (Mixtral `block_sparse_moe.experts.<e>.w1 / w3 / w2`), each
  A [r, in] / B [out, r], selected by target_modules with PEFT's own rules (`module_selection`). gate and up
  share one slot: A = cat(A_gate, A_up) on the rank dim and B block-diagonal [[B_gate, 0], [0, B_up]], so that
  B @ A is exactly the gate rows then the up rows (R = r_gate + r_up; one of them not targeted: its B rows are
  zero). Experts given different ranks at one scale (rank_pattern with a matching alpha_pattern) are padded with
  zero rank rows, which add exactly nothing.

R is the same for every layer of a slot: a layer with a smaller rank (rank_pattern at an unchanged scale) is padded
with zero rows of A and zero columns of B to the slot's largest, which adds exactly nothing (the device pool holds
one rank per expert projection).

Refused by name, `unsupported_expert_lora`: an expert scale other than the adapter's (rank_pattern /
alpha_pattern giving the experts, or some of them, their own alpha / r: the engine applies one scale per
adapter, and folding a ratio into B would not give PEFT's numbers to the bit), expert LoRA that covers only some
sparse layers or some experts (layers_to_transform, layer subsets, regexes), DoRA or LoRA biases on the experts,
both layouts in one file. `unsupported_target`: LoRA on the router's bias, on Qwen2-MoE's shared expert
(`mlp.shared_expert`, `mlp.shared_expert_gate`), target_parameters naming anything but the experts' gate_up_proj /
down_proj (biases included), expert LoRA or target_parameters on a dense base, per-expert modules on gpt-oss
(whose checkpoints were always fused). `expert_shape_mismatch`: a layout for another number of experts (named, with
the count its shapes imply), in / out swapped (the orientation), or any other expert tensor shape.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from loramux.adapters.formats.module_selection import module_rank_alpha, scale_of, select_modules
from loramux.adapters.formats.safetensors_header import TensorEntry
from loramux.adapters.formats.validation_common import CONFIG_FILE, fail, show
from loramux.model.config import ModelConfig

__all__ = ["EXPERT_PARAMETERS", "EXPERT_SLOTS", "ExpertPlan", "check_expert_config", "check_target_parameters",
           "expert_module_names", "experts_nbytes", "read_experts", "split_expert_entries"]

EXPERT_SLOTS = ("gate_up", "down")
# The experts' fused parameters (PEFT target_parameters), in the order every family's experts module registers
# them, which is the order PEFT wraps them in; and the slot each fills.
EXPERT_PARAMETERS = {"gate_up_proj": "gate_up", "down_proj": "down"}
# transformers 4.x per-expert projections: name -> (slot, part); part 0 fills the slot's first rows (gate, down)
_PROJECTIONS = {"gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # Mixtral's 4.x names of them
MAX_TARGET_PARAMETERS = 64

_PREFIX = r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\."
_FUSED = re.compile(_PREFIX + r"mlp\.experts\.((?:base_layer\.)*)lora_([AB])(?:\.default)?\.weight$")
_PER_EXPERT = re.compile(_PREFIX + r"(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(.+)$")
_EXPERT_ANY = re.compile(_PREFIX + r"(?:mlp|block_sparse_moe)\.experts\.")
_SHARED = re.compile(_PREFIX + r"mlp\.(shared_expert_gate|shared_expert)\.")
_LORA_WEIGHT = re.compile(r"^lora_([AB])(?:\.default)?\.weight$")
_EXAMPLE = '["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]'
_Key = tuple[int, str]  # (layer, slot)
_ModuleKey = tuple[int, str, int]  # (layer, projection, expert)


@dataclass
class ExpertPlan:
    """An upload's expert tensors, checked against the base model and the config; `read_experts` reads them.

    `fused`: (layer, slot) -> {"A", "B"} entries of the target_parameters layout; `per_expert`: (layer, projection,
    expert) -> {"A", "B"} of the per-expert layout (projection gate_proj / up_proj / down_proj, Mixtral's too)."""

    fused: dict[_Key, dict[str, TensorEntry]] = field(default_factory=dict)
    per_expert: dict[_ModuleKey, dict[str, TensorEntry]] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return bool(self.fused or self.per_expert)


def _shared_message(what: str) -> str:
    return (f"{what} puts a LoRA on the shared expert (mlp.shared_expert / mlp.shared_expert_gate), which is not "
            "served. Train the adapter without it (e.g. exclude_modules=\".*shared_expert.*\"); LoRA on the routed "
            f"experts is served through target_parameters {_EXAMPLE}")


def _bias_message(what: str) -> str:
    return (f"{what} puts a LoRA on the experts' biases, which is not served; target the expert weights "
            f"(target_parameters {_EXAMPLE}) only")


# ----------------------------------------------------------------------------------------------- config

def check_target_parameters(config: Mapping) -> list[str]:
    """The config-only checks of `target_parameters`: absent, or a list of parameter names; not with DoRA."""
    value = config.get("target_parameters")
    if value is None or value == []:
        return []
    if (not isinstance(value, list) or not all(isinstance(v, str) and v for v in value)
            or len(value) > MAX_TARGET_PARAMETERS):
        raise fail("bad_option", f"target_parameters must be a list of at most {MAX_TARGET_PARAMETERS} parameter "
                                  f"names such as {_EXAMPLE}, got {show(value)}")
    if config.get("use_dora") is True:
        raise fail("unsupported_expert_lora", "DoRA (use_dora=true) on the routed experts (target_parameters) is not "
                                               "supported (PEFT refuses it too): train the experts without use_dora")
    return value


def _parameter_keys(base: ModelConfig) -> dict[str, tuple[str, int, str]]:
    """The base model's parameters target_parameters can reach around the experts, by PEFT's key
    (`model.layers.<i>.mlp.experts.gate_up_proj`, ...): key -> (kind, layer, parameter)."""
    moe = base.moe
    assert moe is not None
    keys: dict[str, tuple[str, int, str]] = {}
    for layer in range(base.num_layers):
        if not moe.sparse_layers[layer]:
            continue
        mlp = f"model.layers.{layer}.mlp"
        for param in EXPERT_PARAMETERS:
            keys[f"{mlp}.experts.{param}"] = ("expert", layer, param)
            if moe.expert_bias:
                keys[f"{mlp}.experts.{param}_bias"] = ("bias", layer, f"{param}_bias")
        keys[f"{mlp}.{moe.router_name}.weight"] = ("router", layer, "weight")
        if moe.router_bias:
            keys[f"{mlp}.{moe.router_name}.bias"] = ("router", layer, "bias")
        if moe.shared_expert_size:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                keys[f"{mlp}.shared_expert.{proj}.weight"] = ("shared", layer, proj)
            keys[f"{mlp}.shared_expert_gate.weight"] = ("shared", layer, "shared_expert_gate")
    return keys


def _expert_parameters(config: Mapping, base: ModelConfig) -> tuple[str, ...]:
    """The expert parameters target_parameters selects (PEFT's rule: a key equal to an entry or ending in
    `.<entry>`), in registration order; refuses every other entry, and a selection of only some sparse layers."""
    entries = check_target_parameters(config)
    if not entries:
        return ()
    if base.moe is None:
        raise fail("unsupported_target", f"target_parameters {show(entries)} puts LoRA on parameters directly, which "
                                          "is served only for the routed experts of a mixture-of-experts base; "
                                          f"model_type {base.model_type!r} has no routed experts: target its "
                                          "projections with target_modules")
    keys = _parameter_keys(base)
    layers: dict[str, set[int]] = {}
    for entry in entries:
        hits = [kind for key, kind in keys.items() if key == entry or key.endswith(f".{entry}")]
        what = f"target_parameters entry {show(entry)}"
        kinds = {kind for kind, _, _ in hits}
        last = entry.rsplit(".", 1)[-1]
        if "router" in kinds:  # served as a LoRA module of its own (router_parameter_layers)
            if any(param != "weight" for kind, _, param in hits if kind == "router"):
                raise fail("unsupported_target", f"{what} puts a LoRA on the router's bias, which is not served; "
                                                  f"target the router's weight (mlp.{base.moe.router_name}.weight)")
            continue
        if "shared" in kinds or (not hits and "shared_expert" in entry):
            raise fail("unsupported_target", _shared_message(what))
        if "bias" in kinds or (not hits and last.endswith("bias")):
            raise fail("unsupported_target", _bias_message(what))
        if not hits:
            raise fail("unsupported_target", f"{what} names no routed-expert parameter of this base model: only the "
                                              "experts' model.layers.<i>.mlp.experts.gate_up_proj and "
                                              f"model.layers.<i>.mlp.experts.down_proj can carry LoRA (e.g. "
                                              f"target_parameters {_EXAMPLE}); target other modules with "
                                              "target_modules")
        for _, layer, param in hits:
            layers.setdefault(param, set()).add(layer)
    sparse = {layer for layer in range(base.num_layers) if base.moe.sparse_layers[layer]}
    for param, covered in layers.items():
        if covered != sparse:
            raise fail("unsupported_expert_lora", f"target_parameters {show(entries)} puts LoRA on mlp.experts.{param} "
                                                   f"of layers {sorted(covered)} only, of the sparse layers "
                                                   f"{_layer_list(sparse)}: LoRA on the experts must cover every "
                                                   f"sparse layer (name the parameter without a layer, e.g. "
                                                   f"'mlp.experts.{param}')")
    return tuple(p for p in EXPERT_PARAMETERS if p in layers)


def router_parameter_layers(config: Mapping, base: ModelConfig) -> list[int]:
    """The sparse layers whose router weight target_parameters selects (PEFT 0.21's "all-linear" on
    transformers 5 adds `gate.weight`): each gets a router LoRA module, served like a projection's."""
    entries = check_target_parameters(config)
    if not entries or base.moe is None:
        return []
    keys = _parameter_keys(base)
    return sorted({layer for key, (kind, layer, param) in keys.items() if kind == "router" and param == "weight"
                   and any(key == e or key.endswith(f".{e}") for e in entries)})


def _layer_list(layers: set[int]) -> str:
    ordered = sorted(layers)
    return str(ordered) if len(ordered) <= 12 else f"[{ordered[0]}, ..., {ordered[-1]}] ({len(ordered)} layers)"


def _check_target_modules(config: Mapping, base: ModelConfig) -> None:
    """Refuse a target_modules that selects the shared expert (PEFT's matching). With "all-linear" the weights
    decide, and a shared-expert tensor is refused by name anyway."""
    moe, targets = base.moe, config.get("target_modules")
    if moe is None or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return
    names: dict[tuple[int, str], str] = {}
    for layer in range(base.num_layers):
        if not moe.sparse_layers[layer]:
            continue
        if moe.shared_expert_size:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[(layer, f"shared.{proj}")] = f"model.layers.{layer}.mlp.shared_expert.{proj}"
            names[(layer, "shared.gate")] = f"model.layers.{layer}.mlp.shared_expert_gate"
    for layer, kind in select_modules(config, names):
        what = f"target_modules {show(targets)} selects {names[(layer, kind)]}, which"
        raise fail("unsupported_target", _shared_message(what))


def check_expert_config(config: Mapping, base: ModelConfig) -> tuple[str, ...]:
    """The config's expert options against the base model: returns the expert parameters target_parameters
    selects (registration order, e.g. ("gate_up_proj", "down_proj")); refuses the router, the shared expert,
    other parameters and partial layer coverage."""
    params = _expert_parameters(config, base)
    _check_target_modules(config, base)
    return params


def expert_module_names(base: ModelConfig) -> dict[_ModuleKey, str]:
    """The transformers 4.x name of every per-expert projection of the sparse layers: (layer, projection, expert)
    -> `model.layers.<i>.mlp.experts.<e>.gate_proj` (Mixtral `...block_sparse_moe.experts.<e>.w1`), projection
    always by its gate_proj / up_proj / down_proj name. Empty for dense bases and gpt-oss (always fused)."""
    moe = base.moe
    if moe is None or base.model_type == "gpt_oss":
        return {}
    section, own = (("block_sparse_moe", {v: k for k, v in _MIXTRAL_NAMES.items()}) if base.model_type == "mixtral"
                    else ("mlp", {p: p for p in _PROJECTIONS}))
    return {(layer, proj, e): f"model.layers.{layer}.{section}.experts.{e}.{own[proj]}"
            for layer in range(base.num_layers) if moe.sparse_layers[layer]
            for proj in _PROJECTIONS for e in range(moe.num_experts)}


# ----------------------------------------------------------------------------------------------- weights

def _slot_shape(base: ModelConfig, slot: str) -> tuple[int, int]:
    """(d_in, d_out) of a slot: gate_up (hidden, 2 x width), down (width, hidden)."""
    assert base.moe is not None
    h, i = base.hidden_size, base.moe.intermediate_size
    return (h, 2 * i) if slot == "gate_up" else (i, h)


def _projection_shape(base: ModelConfig, proj: str) -> tuple[int, int]:
    """(d_in, d_out) of one expert's gate_proj / up_proj / down_proj."""
    assert base.moe is not None
    h, i = base.hidden_size, base.moe.intermediate_size
    return (i, h) if proj == "down_proj" else (h, i)


def split_expert_entries(entries: list[TensorEntry], config: Mapping, base: ModelConfig, params: tuple[str, ...]
                         ) -> tuple[ExpertPlan, list[TensorEntry]]:
    """(the expert tensors, checked, as an ExpertPlan; the other entries). `params`: `check_expert_config`'s
    result. Refuses router and shared-expert tensors, and expert tensors on a dense base, by name."""
    rest, fused, per_expert = _classify(entries, base)
    plan = ExpertPlan()
    if fused:
        plan.fused = _check_fused(fused, config, base, params)
    elif params:
        assert base.moe is not None  # target_parameters on a dense base: refused by check_expert_config
        raise fail("missing_tensor", f"layer {base.moe.sparse_layers.index(True)} mlp.experts.{params[0]} lacks "
                                      "lora_A: target_parameters "
                                      f"{show(config.get('target_parameters'))} selects it, and an adapter must hold "
                                      "every module its config selects")
    if per_expert:
        if fused:
            raise fail("unsupported_expert_lora", "the adapter holds expert LoRA in both layouts (target_parameters' "
                                                   "fused mlp.experts tensors and per-expert modules); give one")
        plan.per_expert = _check_per_expert(_collect_per_expert(per_expert, config, base), config, base)
    return plan, rest


def _classify(entries: list[TensorEntry], base: ModelConfig):
    """(other entries, fused expert entries (entry, layer, depth, A/B), per-expert entries (entry, layer, section,
    expert, projection, suffix)); refuses router, shared-expert and unreadable expert tensors."""
    rest: list[TensorEntry] = []
    fused: list[tuple[TensorEntry, int, int, str]] = []
    per_expert: list[tuple[TensorEntry, int, str, int, str, str]] = []
    for entry in entries:
        name = entry.name
        if base.moe is None:
            if _EXPERT_ANY.match(name):
                raise fail("unsupported_target", f"tensor {show(name)} is a LoRA on routed experts, but model_type "
                                                  f"{base.model_type!r} has no routed experts (is the adapter for a "
                                                  "mixture-of-experts model?)")
            rest.append(entry)
            continue
        if match := _FUSED.match(name):
            fused.append((entry, int(match.group(1)), match.group(2).count("base_layer."), match.group(3)))
        elif match := _PER_EXPERT.match(name):
            per_expert.append((entry, int(match.group(1)), match.group(2), int(match.group(3)), match.group(4),
                               match.group(5)))
        elif _EXPERT_ANY.match(name):
            _refuse_other_expert_tensor(name)
        elif _SHARED.match(name):
            raise fail("unsupported_target", _shared_message(f"tensor {show(name)}"))
        else:
            rest.append(entry)
    return rest, fused, per_expert


def _refuse_other_expert_tensor(name: str) -> None:
    if "lora_magnitude_vector" in name:
        raise fail("unsupported_expert_lora", f"tensor {show(name)} is a DoRA magnitude of a routed expert: DoRA on "
                                               "the experts is not supported; train them without use_dora")
    if name.endswith(".bias"):
        raise fail("unsupported_expert_lora", f"tensor {show(name)} is a LoRA bias (lora_bias) on the routed experts, "
                                               "which is not supported; train without lora_bias")
    raise fail("unknown_tensor", f"unexpected tensor {show(name)} under the routed experts: expert LoRA is "
                                  "mlp.experts.[base_layer.]lora_A/lora_B.weight (target_parameters) or "
                                  "mlp.experts.<e>.<projection>.lora_A/lora_B.weight (per-expert modules)")


def _check_scale(config: Mapping, name: str, rank: int, alpha: float) -> None:
    use_rslora = bool(config.get("use_rslora", False))
    own, default = scale_of(rank, alpha, use_rslora), scale_of(config["r"], config["lora_alpha"], use_rslora)
    if own != default:
        raise fail("unsupported_expert_lora", f"rank_pattern / alpha_pattern gives {name} r={rank}, lora_alpha={alpha} "
                                               f"(scale {own:g}), but LoRA on the routed experts is served at the "
                                               f"adapter's own scale ({default:g}, from r and lora_alpha): give the "
                                               "experts the adapter's r and lora_alpha, or an alpha_pattern that keeps "
                                               "their lora_alpha / r equal to it")


def _check_fused(fused: list[tuple[TensorEntry, int, int, str]], config: Mapping, base: ModelConfig,
                 params: tuple[str, ...]) -> dict[_Key, dict[str, TensorEntry]]:
    moe = base.moe
    assert moe is not None
    by_depth = {len(params) - 1 - j: param for j, param in enumerate(params)}  # the first wrapped is the deepest
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for entry, layer, depth, kind in fused:
        if layer >= base.num_layers:
            raise fail("layer_out_of_range", f"tensor {show(entry.name)} is for layer {layer}, the base model has "
                                              f"{base.num_layers} layers")
        if not moe.sparse_layers[layer]:
            raise fail("target_mismatch", f"tensor {show(entry.name)} is a LoRA on the routed experts of layer "
                                           f"{layer}, which is a dense layer of this base model (mlp_only_layers / "
                                           "decoder_sparse_step): the adapter was made for another model")
        if not params:
            raise fail("target_mismatch", f"tensor {show(entry.name)} is a LoRA on the routed experts (PEFT "
                                           f"target_parameters), but {CONFIG_FILE} sets no target_parameters: set "
                                           f"it to the expert parameters the adapter was trained on, e.g. {_EXAMPLE}")
        if depth not in by_depth:
            raise fail("target_mismatch", f"tensor {show(entry.name)} is nested {depth} base_layer deep, but "
                                           f"target_parameters {show(config.get('target_parameters'))} wraps "
                                           f"{len(params)} expert parameter(s) per layer (PEFT nests one wrapper per "
                                           "parameter, the first in registration order deepest)")
        pair = found.setdefault((layer, by_depth[depth]), {})
        if kind in pair:
            raise fail("duplicate_tensor", f"layer {layer} mlp.experts.{by_depth[depth]} has lora_{kind} twice (e.g. "
                                            "with and without an adapter-name suffix)")
        pair[kind] = entry
    names = {(layer, param): f"model.layers.{layer}.mlp.experts.{param}"
             for layer in range(base.num_layers) if moe.sparse_layers[layer] for param in params}
    ranks = module_rank_alpha(config, names)
    out: dict[_Key, dict[str, TensorEntry]] = {}
    for (layer, param), (rank, alpha) in ranks.items():
        pair = found.get((layer, param), {})
        if set(pair) != {"A", "B"}:
            lacking = "A" if "A" not in pair else "B"
            raise fail("missing_tensor", f"layer {layer} mlp.experts.{param} lacks lora_{lacking}; target_parameters "
                                          f"{show(config.get('target_parameters'))} selects it, and an adapter must "
                                          "hold every module its config selects")
        _check_scale(config, names[(layer, param)], rank, alpha)
        slot = EXPERT_PARAMETERS[param]
        _check_fused_shapes(pair, f"layer {layer} mlp.experts.{param}", rank, moe.num_experts,
                            *_slot_shape(base, slot), origin="" if rank == config["r"] else " (rank_pattern)")
        out[(layer, slot)] = pair
    return out


def _check_fused_shapes(pair: dict[str, TensorEntry], where: str, rank: int, experts: int, d_in: int, d_out: int,
                        origin: str) -> None:
    a, b = pair["A"].shape, pair["B"].shape
    want_a, want_b = (experts * rank, d_in), (d_out, experts * rank)
    if a == want_a and b == want_b:
        return
    expected = (f"expected lora_A [num_experts x r, in_features] = {want_a} and lora_B [out_features, num_experts x "
                f"r] = {want_b} for {experts} experts, r={rank}{origin}")
    if len(a) == 2 and len(b) == 2:
        if d_in != d_out and a[1] == d_out and b[0] == d_in:
            raise fail("expert_shape_mismatch", f"{where}: lora_A {a} and lora_B {b} have in_features and "
                                                 f"out_features swapped (the orientation is swapped): {expected}. The "
                                                 "adapter was made for an experts layout stored the other way round")
        if a[1] == d_in and b[0] == d_out and a[0] == b[1] and a[0] % rank == 0 and a[0] != experts * rank:
            raise fail("expert_shape_mismatch", f"{where}: lora_A has {a[0]} rows = {a[0] // rank} experts x r={rank}"
                                                 f"{origin}, but the base model has {experts} experts (num_experts): "
                                                 f"{expected}. The adapter was made for a model with {a[0] // rank} "
                                                 "experts")
    raise fail("expert_shape_mismatch", f"{where}: lora_A has shape {a} and lora_B {b}; {expected} on this base model")


def _collect_per_expert(per_expert: list[tuple[TensorEntry, int, str, int, str, str]], config: Mapping,
                        base: ModelConfig) -> dict[_ModuleKey, dict[str, TensorEntry]]:
    """(layer, projection, expert) -> {"A", "B"} of the per-expert tensors, each name checked against the base."""
    moe = base.moe
    assert moe is not None
    if base.model_type == "gpt_oss":
        raise fail("unsupported_target", f"tensor {show(per_expert[0][0].name)} is a LoRA on one expert's module, "
                                          "but gpt-oss holds its experts fused: train the adapter with "
                                          f"target_parameters {_EXAMPLE}")
    if config.get("use_dora") is True:
        raise fail("unsupported_expert_lora", f"tensor {show(per_expert[0][0].name)} is a LoRA on a routed expert of "
                                               "a DoRA adapter (use_dora=true): DoRA on the experts is not supported; "
                                               "train them without use_dora")
    mixtral = base.model_type == "mixtral"
    section, projections = ("block_sparse_moe", _MIXTRAL_NAMES) if mixtral else ("mlp", {p: p for p in _PROJECTIONS})
    found: dict[_ModuleKey, dict[str, TensorEntry]] = {}
    for entry, layer, sect, expert, proj, suffix in per_expert:
        if sect != section or proj not in projections:
            raise fail("unsupported_target", f"tensor {show(entry.name)} targets expert module {show(f'{sect}.{proj}')}"
                                              f"; model_type {base.model_type!r} names its experts' projections "
                                              f"{section}.experts.<e>.{'/'.join(projections)}")
        match = _LORA_WEIGHT.match(suffix)
        if match is None:
            _refuse_other_expert_tensor(entry.name)
        assert match is not None
        if layer >= base.num_layers:
            raise fail("layer_out_of_range", f"tensor {show(entry.name)} is for layer {layer}, the base model has "
                                              f"{base.num_layers} layers")
        if not moe.sparse_layers[layer]:
            raise fail("target_mismatch", f"tensor {show(entry.name)} is a LoRA on a routed expert of layer {layer}, "
                                           "which is a dense layer of this base model (mlp_only_layers / "
                                           "decoder_sparse_step): the adapter was made for another model")
        if expert >= moe.num_experts:
            raise fail("expert_shape_mismatch", f"tensor {show(entry.name)} is for expert {expert}, but the base model "
                                                 f"has {moe.num_experts} experts (num_experts); the adapter implies at "
                                                 f"least {expert + 1}: it was made for another model")
        kind = match.group(1)
        pair = found.setdefault((layer, projections[proj], expert), {})
        if kind in pair:
            raise fail("duplicate_tensor", f"layer {layer} expert {expert} {proj} has lora_{kind} twice (e.g. with and "
                                            "without an adapter-name suffix)")
        pair[kind] = entry
    return found


def _check_per_expert(found: dict[_ModuleKey, dict[str, TensorEntry]], config: Mapping, base: ModelConfig
                      ) -> dict[_ModuleKey, dict[str, TensorEntry]]:
    """The per-expert tensors against the modules the config selects: exactly those, covering every expert of
    every sparse layer for each projection, at the adapter's scale, of the right shapes."""
    moe = base.moe
    assert moe is not None
    names = expert_module_names(base)
    selected = set(select_modules(config, names))
    for key, pair in found.items():
        if key not in selected:
            raise fail("target_mismatch", f"tensor {show(next(iter(pair.values())).name)} is a LoRA on "
                                           f"{names[key]}, a module {CONFIG_FILE} does not select (target_modules "
                                           f"{show(config.get('target_modules'))}): remove it, or select it in the "
                                           "config")
    sparse = [layer for layer in range(base.num_layers) if moe.sparse_layers[layer]]
    for proj in _PROJECTIONS:
        chosen = {key for key in selected if key[1] == proj}
        if chosen and len(chosen) != len(sparse) * moe.num_experts:
            left = min(key for key in names if key[1] == proj and key not in chosen)
            raise fail("unsupported_expert_lora", f"{CONFIG_FILE} selects {names[min(chosen)]} but not "
                                                   f"{names[left]} (target_modules {show(config.get('target_modules'))}"
                                                   f"{_layer_options(config)}): LoRA on the experts must cover every "
                                                   f"expert of every sparse layer ({moe.num_experts} experts x "
                                                   f"{len(sparse)} layers)")
    ranks = module_rank_alpha(config, {key: names[key] for key in sorted(selected)})
    for key, (rank, alpha) in ranks.items():
        pair = found.get(key, {})
        if set(pair) != {"A", "B"}:
            raise fail("missing_tensor", f"{names[key]} lacks lora_{'A' if 'A' not in pair else 'B'}: every expert of "
                                          "a targeted projection must be in the adapter")
        _check_scale(config, names[key], rank, alpha)
        d_in, d_out = _projection_shape(base, key[1])
        for kind, want in (("A", (rank, d_in)), ("B", (d_out, rank))):
            if pair[kind].shape != want:
                origin = "" if rank == config["r"] else " (rank_pattern)"
                raise fail("expert_shape_mismatch", f"tensor {show(pair[kind].name)} has shape {pair[kind].shape}, "
                                                     f"expected {want} for r={rank}{origin} on this base model")
    return found


def _layer_options(config: Mapping) -> str:
    parts = [f"{k} {show(config[k])}" for k in ("layers_to_transform", "layers_pattern", "exclude_modules")
             if config.get(k) not in (None, "", [])]
    return f" with {', '.join(parts)}" if parts else ""


# ----------------------------------------------------------------------------------------------- reading

def read_experts(plan: ExpertPlan, base: ModelConfig, read: Callable[[TensorEntry], torch.Tensor]
                 ) -> dict[_Key, tuple[torch.Tensor, torch.Tensor]]:
    """The representation (module docstring) of a checked plan, in the file's dtype; `read` reads one tensor."""
    out: dict[_Key, tuple[torch.Tensor, torch.Tensor]] = {}
    if not plan.any:
        return out
    moe = base.moe
    assert moe is not None
    experts = moe.num_experts
    for (layer, slot), pair in sorted(plan.fused.items(), key=lambda kv: (kv[0][0], EXPERT_SLOTS.index(kv[0][1]))):
        a, b = read(pair["A"]), read(pair["B"])
        rank = a.shape[0] // experts
        a3 = a.reshape(experts, rank, a.shape[1])  # PEFT: expert-major rows of A
        b3 = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)  # PEFT: rank-major columns of B
        if slot == "gate_up" and base.model_type == "gpt_oss":
            # gpt-oss interleaves gate and up outputs (gate = [..., ::2]); the engine holds them gate then up.
            b3 = torch.cat((b3[:, 0::2], b3[:, 1::2]), dim=1)
        out[(layer, slot)] = (a3.contiguous(), b3.contiguous())
    slots: dict[_Key, dict[str, dict[int, dict[str, TensorEntry]]]] = {}
    for (layer, proj, expert), pair in plan.per_expert.items():
        slots.setdefault((layer, _PROJECTIONS[proj][0]), {}).setdefault(proj, {})[expert] = pair
    for (layer, slot), parts in sorted(slots.items(), key=lambda kv: (kv[0][0], EXPERT_SLOTS.index(kv[0][1]))):
        tensors = {proj: {e: (read(p["A"]), read(p["B"])) for e, p in by_expert.items()}
                   for proj, by_expert in parts.items()}
        dtype = _common_dtype([t for by_expert in tensors.values() for pair in by_expert.values() for t in pair])
        widths = {proj: max(a.shape[0] for a, _ in by_expert.values()) for proj, by_expert in tensors.items()}
        d_in, d_out = _slot_shape(base, slot)
        a_out = torch.zeros(experts, sum(widths.values()), d_in, dtype=dtype)
        b_out = torch.zeros(experts, d_out, sum(widths.values()), dtype=dtype)
        start = 0
        for proj in _PROJECTIONS:  # gate, then up: the rank blocks and B's row blocks in the same order
            if proj not in tensors:
                continue
            row = _PROJECTIONS[proj][1] * moe.intermediate_size
            for e, (a, b) in tensors[proj].items():
                a_out[e, start:start + a.shape[0]] = a
                b_out[e, row:row + b.shape[0], start:start + a.shape[0]] = b
            start += widths[proj]
        out[(layer, slot)] = (a_out, b_out)
    return _pad_ranks(out)


def _pad_ranks(experts: dict[_Key, tuple[torch.Tensor, torch.Tensor]]) -> dict[_Key, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer of a slot at the slot's largest R: zero rows of A and columns of B, which add exactly nothing
    (the device pool holds one rank per expert projection)."""
    ranks: dict[str, int] = {}
    for (_, slot), (a, _) in experts.items():
        ranks[slot] = max(ranks.get(slot, 0), a.shape[1])
    out = {}
    for (layer, slot), (a, b) in experts.items():
        pad = ranks[slot] - a.shape[1]
        if pad:
            a = torch.cat((a, a.new_zeros(a.shape[0], pad, a.shape[2])), dim=1)
            b = torch.cat((b, b.new_zeros(b.shape[0], b.shape[1], pad)), dim=2)
        out[(layer, slot)] = (a, b)
    return out


def _common_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def experts_nbytes(experts: Mapping[_Key, tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in experts.values())
