"""Which LoRA-targetable modules each decoder layer of a base model has, what PEFT calls them, and how an adapter's
tensor names map onto them.

Per layer (`layer_targets`), by the checkpoint's (PEFT's) own names:

* the token mixer: attention's q_proj, k_proj, v_proj, o_proj (Phi-3: qkv_proj, o_proj), or on a hybrid's
  linear-attention layer (`ModelConfig.linear_attention`) its Gated DeltaNet projections, in_proj_qkv, in_proj_z,
  in_proj_b, in_proj_a, out_proj (Qwen3.5) or in_proj_qkvz, in_proj_ba, out_proj (Qwen3-Next, fused);
* the MLP: gate_proj, up_proj, down_proj (Phi-3: gate_up_proj, down_proj) on a dense layer, the router on a
  sparse layer of a mixture-of-experts base (its experts: adapters/formats/experts.py).

PEFT names a module by its path in the model class it wrapped, and saves its tensors under `base_model.model.`
plus that path. A text model's decoder layers are `model.layers.<i>`; a multimodal checkpoint's language model
(`ModelConfig.multimodal`) is `model.language_model.layers.<i>` in transformers 5 (and 4.52 on), was
`language_model.model.layers.<i>` in Gemma 3's first transformers 4.x class, and is `model.layers.<i>` when the
adapter was trained on the text-only class (Qwen3.5 through AutoModelForCausalLM). Every one of those is the same
language model: an adapter is read in the form its tensors are saved in (`tensor_prefix`), and a target_modules
regex is matched against the module names of that same form (`module_prefix`), as PEFT matched it.

Refused by name (`refuse_unserved`, code unsupported_target): LoRA (or anything else) on the vision side of a
multimodal model (`model.visual.`, `vision_tower.`, `multi_modal_projector.` ...), until images are served, and on a
linear-attention layer's modules other than its projections (PEFT can wrap `linear_attn.conv1d`, the depthwise
causal convolution).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from loramux.adapters.formats.validation_common import fail, show
from loramux.model.config import ModelConfig

__all__ = ["ATTENTION_TARGETS", "FUSED_LINEAR_TARGETS", "LINEAR_TARGETS", "MLP_TARGETS", "SECTIONS",
           "TENSOR_PREFIX", "layer_kind", "layer_targets", "module_prefix", "refuse_unserved", "tensor_prefix"]

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LINEAR_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")  # Qwen3.5
FUSED_LINEAR_TARGETS = ("in_proj_qkvz", "in_proj_ba", "out_proj")  # Qwen3-Next
_PHI3_ATTENTION, _PHI3_MLP = ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")
# The section of a decoder layer each module sits in ("router": the MLP's router, named by MoESpec.router_name).
SECTIONS = {**{t: "self_attn" for t in (*ATTENTION_TARGETS, "qkv_proj")},
            **{t: "mlp" for t in (*MLP_TARGETS, "gate_up_proj")},
            **{t: "linear_attn" for t in (*LINEAR_TARGETS, *FUSED_LINEAR_TARGETS)}, "router": "router"}

# What may stand between PEFT's `base_model.model.` and `layers.<i>.`: the paths of the decoder layers in the model
# classes adapters are trained on (see the module docstring); "" (a bare `layers.<i>.`) is read as the base's own.
TENSOR_PREFIX = r"(?P<prefix>model\.language_model\.|language_model\.model\.|language_model\.|model\.|)"
_LAYER_TENSOR = re.compile(r"^(?:base_model\.model\.)?" + TENSOR_PREFIX + r"layers\.(\d+)\.")
# Modules of a multimodal model's vision side (Qwen3.5 `model.visual.`, Gemma 3 `vision_tower.` and
# `multi_modal_projector.`, other families' `vision_model.`), wherever they sit in the name.
_VISION = re.compile(r"(?:^|\.)(visual|vision_tower|vision_model|multi_modal_projector|mm_projector)\.")
_LINEAR_MODULE = re.compile(r"^(?:base_model\.model\.)?" + TENSOR_PREFIX + r"layers\.(\d+)\.linear_attn\.(\w+)\.")
_LINEAR_HELP = ("LoRA on a linear-attention layer is served on its projections only (in_proj_qkv, in_proj_z, "
                "in_proj_b, in_proj_a, out_proj; Qwen3-Next: in_proj_qkvz, in_proj_ba, out_proj)")


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    """"linear_attn" for a hybrid's linear-attention layer, else "self_attn"."""
    linear = cfg.linear_attention
    return "linear_attn" if linear is not None and linear.layers[layer] else "self_attn"


def layer_targets(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The LoRA-targetable modules of decoder layer `layer` by their checkpoint (PEFT) names, in model order:
    its token mixer's projections, then its dense MLP's or its router ("router")."""
    linear = cfg.linear_attention
    if layer_kind(cfg, layer) == "linear_attn":
        assert linear is not None
        mixer = FUSED_LINEAR_TARGETS if linear.fused_projections else LINEAR_TARGETS
    else:
        mixer = _PHI3_ATTENTION if cfg.fused_projections else ATTENTION_TARGETS
    if cfg.moe is not None and cfg.moe.sparse_layers[layer]:
        return (*mixer, "router")
    return (*mixer, *(_PHI3_MLP if cfg.fused_projections else MLP_TARGETS))


def default_prefix(cfg: ModelConfig) -> str:
    """The path of the decoder layers' parent in the model class the base's checkpoint loads as (transformers 5)."""
    return "model.language_model." if cfg.multimodal else "model."


def module_prefix(cfg: ModelConfig, prefix: str | None) -> str:
    """The module-name prefix PEFT matched target_modules against, for tensors saved under `prefix` (None or "":
    the base's own, `default_prefix`)."""
    return prefix or default_prefix(cfg)


def tensor_prefix(names: Iterable[str]) -> str | None:
    """The one prefix (`TENSOR_PREFIX`) the decoder-layer tensors among `names` are saved under (None: no such
    tensor); unknown_tensor when they use two, which no one model class produces."""
    seen: dict[str, str] = {}
    for name in names:
        match = _LAYER_TENSOR.match(name)
        if match is not None:
            seen.setdefault(match.group("prefix"), name)
    if len(seen) > 1:
        (p1, n1), (p2, n2) = list(seen.items())[:2]
        raise fail("unknown_tensor", f"tensor {show(n1)} names its decoder layer under {show(p1 + 'layers')} but "
                                      f"{show(n2)} under {show(p2 + 'layers')}: an adapter saved by PEFT names every "
                                      "layer the one way of the model class it was trained on")
    return next(iter(seen), None)


def refuse_unserved(names: Iterable[str], cfg: ModelConfig) -> None:
    """Refuse, naming the tensor, any tensor on the vision side of a multimodal model and any on a linear-attention
    layer's modules other than its projections (see the module docstring)."""
    linear = set(LINEAR_TARGETS) | set(FUSED_LINEAR_TARGETS)
    for name in names:
        if match := _VISION.search(name):
            model = f"the {cfg.multimodal} checkpoint" if cfg.multimodal else "a multimodal model"
            raise fail("unsupported_target", f"tensor {show(name)} is on the vision side of {model} (its "
                                              f"{match.group(1)} modules): this server serves the language model only "
                                              "(images are not served), so LoRA on vision modules is refused until "
                                              "images are. Train "
                                              "the adapter on language-model modules only, e.g. target_modules "
                                              r"'.*language_model.*\.(q_proj|k_proj|v_proj|o_proj)' (PEFT's "
                                              "\"all-linear\" and a list such as [\"q_proj\"] select the vision "
                                              "tower's modules too)")
        match = _LINEAR_MODULE.match(name)
        if match is not None and match.group(3) not in linear:
            module, layer = match.group(3), match.group(2)
            what = ("the Gated DeltaNet's depthwise causal convolution" if module == "conv1d"
                    else "a module that is not one of its projections")
            raise fail("unsupported_target", f"tensor {show(name)} changes linear_attn.{module} of layer {layer}, "
                                              f"{what}, which is not served: {_LINEAR_HELP}. Train the adapter "
                                              f"without it (e.g. exclude_modules=[{module!r}], or list the "
                                              "projections in target_modules)")
