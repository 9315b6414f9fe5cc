"""Upload validation for PEFT LoRA adapters: the single path every adapter goes through before it is stored
or served (`peft_format.build_adapter` / `load_adapter_dir` call it too).

An upload is `adapter_config.json` + `adapter_model.safetensors`, checked against the base model before
anything is stored. The safetensors header is parsed by `safetensors_header` (not by the safetensors
library) so that each structural failure gets its own code and a message that says what to fix, and so
that hostile headers are refused cheaply: sizes are capped before reading, the tensor count is checked
while the JSON header is being parsed, and tensor data is read one tensor at a time after the whole
header has been checked. The config and weight checks live here; the error types, file names and limits
in `validation_common` (all re-exported here).
Nothing is ever unpickled: pickle / torch.save files are recognised by name and by content and refused.

Every failure raises `AdapterValidationError` (a subclass of `AdapterFormatError`, itself a `ValueError`)
with a stable `code`:

  files      bad_filename, pickle_refused, unexpected_file, missing_file, too_large, config_too_large
  header     truncated, header_too_large, bad_header, too_many_tensors, bad_dtype, span_mismatch,
             offset_out_of_bounds, overlapping_tensors, data_gap
  config     bad_json, code_hook, not_lora, unsupported_option, bad_option, bad_rank, rank_out_of_range,
             bad_alpha, base_model_mismatch
  weights    unknown_tensor, unsupported_target, layer_out_of_range, shape_mismatch, duplicate_tensor,
             no_lora_weights, target_mismatch, missing_tensor, non_finite
  experts    expert_shape_mismatch (another number of experts, in / out swapped, any other expert shape),
             unsupported_expert_lora (an expert scale other than the adapter's, some sparse layers or experts only,
             DoRA or LoRA biases on experts, both layouts at once); LoRA on the router or the shared expert, and
             target_parameters other than the experts' gate_up_proj / down_proj, are unsupported_target (see
             adapters/formats/experts.py)
  heads      vocab_mismatch (an embedding or head with another vocabulary: added tokens), head_too_large
             (above `UploadLimits.max_head_bytes`); embed_tokens / lm_head tensors the config does not ask for
             are unknown_tensor, a LoRA on lm_head unsupported_target (see adapters/formats/heads.py)

Which modules a config selects, and each one's rank and alpha, follow PEFT's own rules (`module_selection`:
target_modules names or regex, exclude_modules, layers_to_transform / layers_pattern, rank_pattern /
alpha_pattern). The weights must hold exactly those modules, each at its own rank: every tensor is either
served or refused by name (`target_mismatch` names a tensor of a module the config does not select).

On a mixture-of-experts base (`ModelConfig.moe`) the attention projections are targetable on every layer and
the MLP projections only on its dense layers (`module_names`); LoRA on the routed experts, PEFT's
`target_parameters` layout or transformers 4.x per-expert modules, is read by `experts` into
`ValidatedAdapter.experts`.

On a hybrid base (`ModelConfig.linear_attention`: Qwen3.5, Qwen3-Next) each layer has its own kind of token mixer:
a linear-attention layer's `linear_attn.in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj` (Qwen3-Next:
`in_proj_qkvz / in_proj_ba / out_proj`), a full-attention layer's `self_attn.q_proj` (2 x q_size wide: [q, output
gate] per head) / k_proj / v_proj / o_proj; a tensor for a projection its layer lacks is target_mismatch naming the
layer's kind. The language model of a multimodal checkpoint (`ModelConfig.multimodal`) is served with its module
names (`model.language_model.layers.<i>...`, or the other forms PEFT saves: `layer_modules`). Refused by name as
unsupported_target: LoRA on a multimodal model's vision side (until images are served) and on a linear-attention
layer's other modules (`linear_attn.conv1d`).

DoRA (`use_dora: true`) is accepted with its magnitude vectors, checked by `validation_dora` (same codes:
a magnitude without use_dora, on a module without LoRA weights, of the wrong shape, missing or twice is
refused naming the tensor; DoRA on embed_tokens / lm_head is refused as unsupported_option).

Messages never contain server paths (file contents given as paths are only ever named by their upload name).

A `target_modules` regex comes from the client, so it never runs on Python's backtracking `re` (a pattern
such as `(?:.*){60}z` would hold the GIL for minutes): it is compiled with RE2 (google-re2, linear time,
bounded memory; `module_selection.compile_client_regex`, as every client regex), capped at 1,000 characters,
and matched whole (`fullmatch`, as PEFT does) against
the base model's own module names (`model.layers.<i>.self_attn.q_proj`, ...), under a deadline of 1 s of the
thread's CPU time (not wall time, which a starved machine stretches). Without
google-re2 installed, regex target_modules are refused (a list of module names always works).

The base model a config names (`base_model_name_or_path`) is checked by `check_base_model`, the one rule of
uploads and of local adapter directories: shapes prove compatibility, so only a clearly different hub
model id (`org/name` whose name differs from the served model's) is refused, unless the caller allows it.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from loramux.adapters.formats.experts import (
    check_expert_config,
    check_target_parameters,
    experts_nbytes,
    read_experts,
    router_parameter_layers,
    split_expert_entries,
)
from loramux.adapters.formats.heads import (
    EMBED,
    HEAD,
    HEAD_MODULES,
    assemble,
    check_head_tensors,
    drop_tied_copies,
    head_config,
    head_tensor,
    heads_nbytes,
    plan_heads,
)
from loramux.adapters.formats.layer_modules import (
    ATTENTION_TARGETS,
    FUSED_LINEAR_TARGETS,
    LINEAR_TARGETS,
    MLP_TARGETS,
    SECTIONS,
    TENSOR_PREFIX,
    layer_kind,
    layer_targets,
    module_prefix,
    refuse_unserved,
    tensor_prefix,
)
from loramux.adapters.formats.module_selection import (
    ClientRegex,
    check_pattern_values,
    check_selection_options,
    compile_client_regex,
    module_rank_alpha,
    scale_of,
    select_modules,
)
from loramux.adapters.formats.safetensors_header import (
    ByteSource,
    TensorEntry,
    check_config_size,
    check_weights_file,
    parse_header,
    read_tensor,
)
from loramux.adapters.formats.validation_common import (
    ALLOWED_FILENAMES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFormatError,
    AdapterValidationError,
    UploadLimits,
    fail,
    show,
)
from loramux.adapters.formats.validation_dora import check_dora_config, check_magnitudes, dora_enabled, split_magnitudes
from loramux.model.config import ModelConfig

__all__ = ["TARGETS", "ALLOWED_FILENAMES", "CONFIG_FILE", "WEIGHTS_FILE", "AdapterFormatError",
           "AdapterValidationError", "UploadLimits", "ValidatedAdapter", "check_base_model", "module_names",
           "projection_shapes", "validate_config", "validate_adapter_files", "base_targets", "checkpoint_shapes",
           "FUSED_TARGETS", "split_fused", "split_fused_magnitudes"]

# What the engine serves, in model order: the attention projections, a hybrid's linear-attention ones (Qwen3.5's, then
# Qwen3-Next's fused in_proj_qkvz / in_proj_ba), the MLP's, and "router" (a mixture-of-experts layer's router: HF
# `mlp.gate`, gpt-oss `mlp.router`). Which of them each layer of a base has: `layer_modules.layer_targets`.
TARGETS = (*ATTENTION_TARGETS, *LINEAR_TARGETS, *FUSED_LINEAR_TARGETS[:2], *MLP_TARGETS, "router")
# Phi-3 fuses projections in its checkpoint, so its adapters target the fused modules: a fused LoRA is the
# sub-projections' LoRAs with one shared A and B cut by rows (q, k, v / gate, up), exactly.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
FUSED_BASE_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PATTERN_HELP = ("patterns use RE2 syntax (no lookaround or backreferences, repetition counts up to 1000) and "
                 "are matched whole (fullmatch, as PEFT does) against module names such as "
                 "'model.layers.0.self_attn.q_proj'; or give target_modules as a list such as "
                 "[\"q_proj\", \"v_proj\"]")
# `org/name` as on the Hugging Face Hub: the one form of base_model_name_or_path that names a model clearly.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
MAX_BASE_MODEL_CHARS = 500  # what is recorded of base_model_name_or_path (AdapterVersion.claimed_base_model)

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?" + TENSOR_PREFIX + r"layers\.(\d+)\.(self_attn|linear_attn|mlp|block_sparse_moe)\."
    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# Config keys that ask a loader to import or run code (transformers' auto_map / trust_remote_code, Hydra's
# _target_ ...). PEFT's own `auto_mapping` (base model class lookup) is standard and not listed.
_CODE_HOOK_KEYS = frozenset({"auto_map", "auto_class", "trust_remote_code", "custom_code", "remote_code",
                             "_target_"})


@dataclass
class ValidatedAdapter:
    """A validated upload. `tensors[(layer, target)] = (A [r, d_in], B [d_out, r])` in the file's dtype, on CPU,
    contiguous and owning their memory; `nbytes` is the size of those tensors."""

    config: dict
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    base_model: str | None = None  # base_model_name_or_path as the config claims it (printable, capped)
    # (layer, target) -> its scale where rank_pattern / alpha_pattern make it differ from r / lora_alpha's
    module_scales: dict[tuple[int, str], float] = field(default_factory=dict)
    # DoRA: (layer, target) -> magnitude m [d_out] in the file's dtype, one per key of `tensors` (else empty)
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    # LoRA on embed_tokens (A [r, vocab], B [hidden, r]) and trained heads: see adapters/formats/heads.py.
    embedding: tuple[torch.Tensor, torch.Tensor] | None = None
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    # LoRA on the routed experts of a mixture-of-experts base, in the file's dtype: (layer, "gate_up" | "down") ->
    # (A [E, R, d_in], B [E, d_out, R]), served at the adapter's scale (adapters/formats/experts.py); else empty
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LoRA-targetable projection of the base model (by the engine's names, PROJECTION_SLICES'
    keys). With an attention output gate (Qwen3.5, Qwen3-Next) q_proj yields [q, gate] per head: 2 x q_size wide."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_width = 2 * cfg.q_size if cfg.attn_output_gate else cfg.q_size
    shapes = {"q_proj": (h, q_width), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
              "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    linear = cfg.linear_attention
    if linear is not None:  # a hybrid's Gated DeltaNet layers (loramux.model.linear_attention.in_proj_slices)
        heads = linear.num_value_heads
        if linear.fused_projections:
            shapes.update(in_proj_qkvz=(h, 2 * linear.key_dim + 2 * linear.value_dim), in_proj_ba=(h, 2 * heads))
        else:
            shapes.update(in_proj_qkv=(h, linear.conv_dim), in_proj_z=(h, linear.value_dim), in_proj_b=(h, heads),
                          in_proj_a=(h, heads))
        shapes["out_proj"] = (linear.value_dim, h)
    if cfg.moe is not None:
        shapes["router"] = (h, cfg.moe.num_experts)
    return shapes


def base_targets(cfg: ModelConfig) -> tuple[str, ...]:
    """The LoRA-targetable modules of the base model by its own (checkpoint, PEFT) names, in model order: those
    some layer has (`layer_modules.layer_targets`), and the dense MLP's on any base but Phi-3's."""
    if cfg.fused_projections:
        return FUSED_BASE_TARGETS
    linear = cfg.linear_attention
    mixer = () if linear is None else FUSED_LINEAR_TARGETS if linear.fused_projections else LINEAR_TARGETS
    return (*ATTENTION_TARGETS, *mixer, *MLP_TARGETS, *(("router",) if cfg.moe is not None else ()))


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each module of `base_targets(cfg)`."""
    shapes = projection_shapes(cfg)
    for fused, parts in FUSED_TARGETS.items():
        shapes[fused] = (shapes[parts[0]][0], sum(shapes[p][1] for p in parts))
    return {t: shapes[t] for t in base_targets(cfg)}


def module_names(cfg: ModelConfig, prefix: str | None = None) -> dict[tuple[int, str], str]:
    """The base model's own name of each LoRA-targetable module (what PEFT matches a regex against), layer by layer,
    each layer's in model order: `model.layers.<i>.self_attn.q_proj`, a hybrid's linear-attention layer
    `model.layers.<i>.linear_attn.in_proj_qkv`, a multimodal base's `model.language_model.layers.<i>...`. On a
    mixture-of-experts base the MLP projections exist only in its dense layers (`MoESpec.sparse_layers`), the router
    (HF `mlp.gate`, gpt-oss `mlp.router`) in its sparse ones; the routed experts' own modules are
    `experts.expert_module_names`. `prefix`: the path the adapter's tensors put the decoder layers under
    (`layer_modules.tensor_prefix`), None for the base's own."""
    root = module_prefix(cfg, prefix)
    router = cfg.moe.router_name if cfg.moe is not None else ""
    return {(layer, t): f"{root}layers.{layer}." + (f"mlp.{router}" if t == "router" else f"{SECTIONS[t]}.{t}")
            for layer in range(cfg.num_layers) for t in layer_targets(cfg, layer)}


def split_fused_magnitudes(magnitudes: dict[tuple[int, str], torch.Tensor], cfg: ModelConfig
                           ) -> dict[tuple[int, str], torch.Tensor]:
    """Fused-module DoRA magnitudes as the engine's per-projection ones: cut by rows, as B (DoRA's norm is per
    output row, so each sub-projection's rows keep their own magnitude and norm)."""
    shapes, out = projection_shapes(cfg), {}
    for (layer, target), m in magnitudes.items():
        if target not in FUSED_TARGETS:
            out[(layer, target)] = m
            continue
        for part, rows in zip(FUSED_TARGETS[target], m.split([shapes[p][1] for p in FUSED_TARGETS[target]])):
            out[(layer, part)] = rows.contiguous()
    return out


def split_fused(tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig
                ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Fused-module LoRA weights as the engine's per-projection ones: A shared, B cut into its row blocks."""
    shapes, out = projection_shapes(cfg), {}
    for (layer, target), (a, b) in tensors.items():
        if target not in FUSED_TARGETS:
            out[(layer, target)] = (a, b)
            continue
        for part, rows in zip(FUSED_TARGETS[target], b.split([shapes[p][1] for p in FUSED_TARGETS[target]])):
            out[(layer, part)] = (a, rows.contiguous())
    return out


# ----------------------------------------------------------------------------------------------- file names

def _check_filename(name) -> None:
    if not isinstance(name, str) or not name:
        raise fail("bad_filename", f"file name {show(name)} is not allowed: upload exactly "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    if ("/" in name or "\\" in name or ".." in name or "\x00" in name or os.path.isabs(name)
            or re.match(r"^[A-Za-z]:", name) or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        raise fail("bad_filename", f"file name {show(name)} is not allowed: give plain file names without "
                                    f"directories, '..' or control characters ({CONFIG_FILE}, {WEIGHTS_FILE})")
    if name.lower().endswith(_PICKLE_SUFFIXES):
        raise fail("pickle_refused", f"pickle weights are refused: save the adapter as safetensors "
                                      f"({WEIGHTS_FILE}, e.g. save_pretrained(..., safe_serialization=True)) "
                                      f"instead of {show(name)}")
    if name not in ALLOWED_FILENAMES:
        raise fail("unexpected_file", f"unexpected file {show(name)}: an adapter upload holds exactly "
                                       f"{CONFIG_FILE} and {WEIGHTS_FILE}")


# ----------------------------------------------------------------------------------------------- config

@dataclass(frozen=True)
class _TargetPattern:
    """A `target_modules` regex string, compiled with RE2."""

    source: str
    compiled: ClientRegex

    def matches(self, name: str) -> bool:
        return self.compiled.fullmatch(name) is not None


def _compile_target_pattern(pattern: str) -> _TargetPattern:
    return _TargetPattern(pattern, compile_client_regex(pattern, "target_modules pattern", _PATTERN_HELP))


def _targets_from_config(config: Mapping, base: ModelConfig | None = None) -> set[str] | _TargetPattern:
    targets = config.get("target_modules")
    if targets is None and config.get("target_parameters"):
        return set()  # parameters only: the routed experts (adapters/formats/experts.py)
    if targets is None:
        raise fail("bad_option", f"{CONFIG_FILE} has no target_modules")
    if isinstance(targets, str):
        if targets.lower() == "all-linear":  # PEFT's shorthand: every linear layer but the output head
            return set(base_targets(base)) if base is not None else set(TARGETS) | set(FUSED_TARGETS)
        return _compile_target_pattern(targets)  # a regex over module names, as in PEFT
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise fail("bad_option", f"target_modules must be a list of module names or a regex string, got "
                                  f"{show(targets)}")
    return {t.split(".")[-1] for t in targets}


def _find_code_hook(value, depth: int = 0) -> str | None:
    if depth > 32:
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if key in _CODE_HOOK_KEYS and item not in (None, False, "", {}, []):
                return key
            found = _find_code_hook(item, depth + 1)
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _find_code_hook(item, depth + 1)
            if found:
                return found
    return None


def validate_config(raw: bytes | bytearray | str, max_rank: int | None = None) -> dict:
    """Check `adapter_config.json` (given as its bytes or text) and return it parsed."""
    try:  # UTF-8 only (RFC 8259, and what PEFT's `open()` reads): json.loads(bytes) would also take UTF-16/32
        config = json.loads(raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw)
    except UnicodeDecodeError:
        raise fail("bad_json", f"{CONFIG_FILE} is not UTF-8 text: save it as UTF-8 (as PEFT writes it)") from None
    except json.JSONDecodeError as exc:
        raise fail("bad_json", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    except (ValueError, RecursionError):  # e.g. nesting too deep, integers with too many digits
        raise fail("bad_json", f"{CONFIG_FILE} is not valid JSON (too deeply nested or a number too long)") \
            from None
    if not isinstance(config, dict):
        raise fail("bad_json", f"{CONFIG_FILE} must hold a JSON object")
    hook = _find_code_hook(config)
    if hook:
        raise fail("code_hook", f"{CONFIG_FILE} sets {hook!r}, which asks to import or run custom code; remove "
                                 "it (adapters are data only and never run code on this server)")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise fail("not_lora", f"peft_type must be LORA, got {show(config.get('peft_type'))}")
    check_dora_config(config)
    if config.get("fan_in_fan_out"):
        raise fail("unsupported_option", "fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported")
    if config.get("bias", "none") != "none":
        raise fail("unsupported_option",
                   f"adapters that train biases (bias={show(config.get('bias'))}) are not supported")
    # modules_to_save / trainable_token_indices (adapters/formats/heads.py)
    head_config(config, embedding_targeted=False)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise fail("bad_rank", f"r must be a positive integer, got {show(rank)}")
    if rank < 1:
        raise fail("rank_out_of_range", f"r must be a positive integer, got {rank}")
    if max_rank is not None and rank > max_rank:
        raise fail("rank_out_of_range", f"rank {rank} is above this server's maximum LoRA rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not _positive_finite(alpha):
        raise fail("bad_alpha", f"lora_alpha must be a positive number, got {show(alpha)}")
    if config.get("use_rslora") not in (None, True, False):
        raise fail("bad_option", f"use_rslora must be true or false, got {show(config.get('use_rslora'))}")
    check_target_parameters(config)
    _targets_from_config(config)
    check_selection_options(config)  # layers_to_transform, layers_pattern, exclude_modules, patterns
    check_pattern_values(config, max_rank)
    return config


def _positive_finite(x: int | float) -> bool:
    try:
        return math.isfinite(x) and x > 0
    except OverflowError:  # an integer too large for a float
        return False


def _printable(text: str) -> str:
    """`text` with control characters and lone surrogates replaced (safe for SQL text columns and JSON)."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _last_component(name: str) -> str:
    return re.split(r"[/\\]", name.strip().rstrip("/\\"))[-1].lower()


def check_base_model(claimed, base_model_id: str | None, allow_mismatch: bool = False) -> str | None:
    """The one base-model rule (uploads, `load_adapter_dir`, `build_adapter`): return what to record of the
    config's `base_model_name_or_path` (None when it records none), or raise `base_model_mismatch`.

    The shapes, checked tensor by tensor, are what proves an adapter fits this base model; the name is only
    a hint. Accepted: no name, a local path (an adapter trained from a local copy records where that copy
    was), a bare name, and any name whose last path component is the served model's name. Refused: a hub
    id (`org/name`) whose name differs from the served model's, unless `allow_mismatch`."""
    if claimed is None or claimed == "":
        return None
    if not isinstance(claimed, str):
        raise fail("bad_option", f"base_model_name_or_path must be a string, got {show(claimed)}")
    recorded = _printable(claimed)[:MAX_BASE_MODEL_CHARS]
    if allow_mismatch or not base_model_id or not _HUB_ID.fullmatch(claimed.strip()):
        return recorded
    if _last_component(claimed) == _last_component(base_model_id):
        return recorded
    served = re.split(r"[/\\]", base_model_id.rstrip("/\\"))[-1]  # never a server path
    raise fail("base_model_mismatch",
               f"the adapter was trained for base model {show(claimed)} (base_model_name_or_path) but this "
               f"server serves {served!r}. If it was trained on {served!r}, set base_model_name_or_path in "
               f"{CONFIG_FILE} to {served!r} (or to the local path of the copy it was trained from); if you "
               "know the shapes and weights match, upload it with allow_base_mismatch=true")


# ----------------------------------------------------------------------------------------------- weights

def _check_entries(entries: list[TensorEntry], base: ModelConfig, config: Mapping,
                   expected: Mapping[tuple[int, str], tuple[int, float]], heads_only_ok: bool = False
                   ) -> tuple[list[str], dict[tuple[int, str], dict[str, TensorEntry]]]:
    """Every tensor against the modules the config selects (`expected`: (layer, target) -> (r, alpha)): each
    is a LoRA A or B of a selected module at that module's rank, and each selected module has both. Head-module
    tensors are checked by `_head_entries`; `heads_only_ok`: the adapter changes the embedding or head (or the
    routed experts), so it may target no projection at all."""
    shapes, names = checkpoint_shapes(base), base_targets(base)
    found: dict[tuple[int, str], dict[str, TensorEntry]] = {}
    for entry in entries:
        layer, target, kind = _entry_module(entry.name, base)
        pair = found.setdefault((layer, target), {})
        if kind in pair:
            raise fail("duplicate_tensor", f"layer {layer} {target} has lora_{kind} twice (e.g. with and "
                                            "without an adapter-name suffix)")
        pair[kind] = entry
    if not found and not heads_only_ok:
        raise fail("no_lora_weights", f"{WEIGHTS_FILE} holds no LoRA weights")
    targets = sorted({t for _, t in found}, key=names.index)
    chosen = sorted({t for _, t in expected}, key=names.index)
    if targets != chosen:
        declared = config.get("target_modules")
        if isinstance(declared, str) and declared.lower() != "all-linear":
            raise fail("target_mismatch", f"weights target {targets} but the target_modules pattern "
                                           f"{show(declared)} selects {chosen} of this base model; they must "
                                           f"be the same projections ({_PATTERN_HELP})")
        raise fail("target_mismatch", f"weights target {targets} but {CONFIG_FILE} declares target_modules "
                                       f"{show(declared)}{_layer_options(config)}, which selects {chosen} of this "
                                       "base model; they must be the same projections")
    for key, pair in found.items():
        entry = next(iter(pair.values()))
        if key not in expected:
            raise fail("target_mismatch", f"tensor {show(entry.name)} is for layer {key[0]} {key[1]}, a module "
                                           f"{CONFIG_FILE} does not select (target_modules "
                                           f"{show(config.get('target_modules'))}{_layer_options(config)}): it "
                                           "would be ignored; remove it, or select that module in the config")
    for key, (rank, _) in expected.items():
        pair = found.get(key, {})
        if set(pair) != {"A", "B"}:
            raise fail("missing_tensor", f"layer {key[0]} {key[1]} lacks lora_{'A' if 'A' not in pair else 'B'}; "
                                          "an adapter must hold every module its config selects")
        d_in, d_out = shapes[key[1]]
        for kind, want in (("A", (rank, d_in)), ("B", (d_out, rank))):
            if pair[kind].shape != want:
                origin = "" if rank == config["r"] else " (rank_pattern)"
                raise fail("shape_mismatch", f"tensor {show(pair[kind].name)} has shape {pair[kind].shape}, "
                                              f"expected {want} for r={rank}{origin} on this base model")
    return targets, found


def _entry_module(name: str, base: ModelConfig) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a LoRA tensor of a decoder projection, checked against the base model: a
    module it serves, on a layer that has it."""
    names = base_targets(base)
    match = _TENSOR_NAME.match(name)
    if match is None:
        raise fail("unknown_tensor", f"unexpected tensor {show(name)}: only LoRA A/B weights of "
                                      f"{', '.join(names)}, and of embed_tokens / lm_head as the config "
                                      "asks (target_modules, modules_to_save, trainable_token_indices), "
                                      "are accepted")
    layer, section, target, kind = int(match.group(2)), match.group(3), match.group(4), match.group(5)
    target = _router_target(base, section, target)
    if section == "block_sparse_moe" and target != "router":
        target = f"block_sparse_moe.{target}"  # not a module LoRA can target here: refused below
    if (section == "linear_attn") != (SECTIONS.get(target) == "linear_attn"):
        target = f"{section}.{target}"  # a projection under another layer section than its own: refused below
    if target not in checkpoint_shapes(base):
        raise fail("unsupported_target", f"tensor {show(name)} targets {show(target)}; supported "
                                          f"targets: {', '.join(names)}{_fusion_hint(base, target)}")
    if layer >= base.num_layers:
        raise fail("layer_out_of_range", f"tensor {show(name)} is for layer {layer}, the base model "
                                          f"has {base.num_layers} layers")
    if target == "router" and base.moe is not None and not base.moe.sparse_layers[layer]:
        raise fail("target_mismatch", f"tensor {show(name)} is a LoRA on the router of layer {layer}, "
                                       f"a dense layer of this base model (it has no router)")
    if base.moe is not None and base.moe.sparse_layers[layer] and SECTIONS[target] == "mlp":
        raise fail("target_mismatch", f"tensor {show(name)} is for layer {layer} {target}, but layer "
                                       f"{layer} of this base model has routed experts, not a dense MLP: LoRA on "
                                       "the experts is mlp.experts.* (target_parameters, or per-expert modules)")
    if target not in layer_targets(base, layer):  # a hybrid's layer: the other kind of token mixer
        mixer = layer_kind(base, layer)
        kind_name = "a linear-attention (Gated DeltaNet)" if mixer == "linear_attn" else "a full-attention"
        own = ", ".join(f"{mixer}.{t}" for t in layer_targets(base, layer) if SECTIONS[t] == mixer)
        raise fail("target_mismatch", f"tensor {show(name)} is a LoRA on {SECTIONS[target]}.{target} of layer "
                                       f"{layer}, but layer {layer} of this base model is {kind_name} layer ({own}): "
                                       "the adapter was made for a model with other layer types (layer_types)")
    return layer, target, kind


def _layer_options(config: Mapping) -> str:
    """The config's layer options, as a message fragment ('' when it has none)."""
    parts = [f"{k} {show(config[k])}" for k in ("layers_to_transform", "layers_pattern", "exclude_modules")
             if config.get(k) not in (None, "", [])]
    return f" with {', '.join(parts)}" if parts else ""


# ----------------------------------------------------------------------------------------------- entry point

def validate_adapter_files(files: Mapping[str, bytes | Path], base: ModelConfig, limits: UploadLimits = UploadLimits(),
                           base_model_id: str | None = None, allow_base_mismatch: bool = False) -> ValidatedAdapter:
    """Validate an adapter upload (client file name -> bytes, or path of a temp file holding them) against
    the base model; return its config and tensors or raise `AdapterValidationError`. `base_model_id` is the
    served model's name (None: the config's base model is recorded, not checked; see `check_base_model`)."""
    for name in files:
        _check_filename(name)
    for name in ALLOWED_FILENAMES:
        if name not in files:
            raise fail("missing_file", f"{name} is missing: an adapter upload needs {CONFIG_FILE} and "
                                        f"{WEIGHTS_FILE} (PEFT's save_pretrained writes both)")
    with ByteSource(files[CONFIG_FILE]) as config_src, ByteSource(files[WEIGHTS_FILE]) as weights_src:
        check_config_size(CONFIG_FILE, config_src.size, limits)
        check_weights_file(weights_src, WEIGHTS_FILE, limits, "adapter", "; use a smaller rank or fewer targets")
        config = validate_config(config_src.read(0, config_src.size), limits.max_rank)
        claimed_base = check_base_model(config.get("base_model_name_or_path"), base_model_id, allow_base_mismatch)
        rank = config["r"]
        expert_params = check_expert_config(config, base)
        entries, data_start = parse_header(weights_src, _tensor_cap_for(base, limits))
        refuse_unserved((entry.name for entry in entries), base)
        # The module names PEFT matched the config against: those of the model class the tensors were saved from.
        prefix = module_prefix(base, tensor_prefix(entry.name for entry in entries))
        names = module_names(base, prefix)
        expected = module_rank_alpha(config, {key: names[key] for key in select_modules(config, names)})
        expected.update(module_rank_alpha(config, {(layer, "router"): names[(layer, "router")]
                                                   for layer in router_parameter_layers(config, base)}))
        hc = head_config(config, _embedding_targeted(_targets_from_config(config, base), prefix))
        _check_embedding_patterns(config, hc, rank, prefix)
        head_entries, entries = _head_entries(entries, hc, rank, base, limits)
        expert_plan, entries = split_expert_entries(entries, config, base, expert_params)
        entries, magnitude_entries = split_magnitudes(entries, dora_enabled(config))
        targets, found = _check_entries(entries, base, config, expected, heads_only_ok=hc.any or expert_plan.any)
        head_tensors = {key: read_tensor(weights_src, data_start, entry) for key, entry in head_entries.items()}
        if dora_enabled(config):
            check_magnitudes(magnitude_entries, set(found), checkpoint_shapes(base), base.num_layers)
        magnitudes = {key: read_tensor(weights_src, data_start, entry) for key, entry in magnitude_entries.items()}
        nbytes = sum(m.numel() * m.element_size() for m in magnitudes.values())
        tensors = {}
        for key in expected:
            a = read_tensor(weights_src, data_start, found[key]["A"])
            b = read_tensor(weights_src, data_start, found[key]["B"])
            tensors[key] = (a, b)
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        experts = read_experts(expert_plan, base, lambda entry: read_tensor(weights_src, data_start, entry))
        nbytes += experts_nbytes(experts)
    use_rslora = bool(config.get("use_rslora", False))
    default = scale_of(rank, config["lora_alpha"], use_rslora)
    module_scales = {key: scale_of(r, alpha, use_rslora) for key, (r, alpha) in expected.items()}
    module_scales = {key: s for key, s in module_scales.items() if s != default}
    if base.fused_projections:
        tensors = split_fused(tensors, base)
        module_scales = {(layer, part): s for (layer, t), s in module_scales.items()
                         for part in FUSED_TARGETS.get(t, (t,))}
        magnitudes = split_fused_magnitudes(magnitudes, base)
        targets = [t for t in TARGETS if any(part == t for _, part in tensors)]
    embedding, heads = None, {}
    if head_tensors:
        plan = plan_heads(hc, rank, base.vocab_size, base.hidden_size, base.tie_word_embeddings)
        drop_tied_copies(head_tensors, plan)
        embedding, heads = assemble(head_tensors, plan, hc)
    return ValidatedAdapter(config=config, rank=rank, alpha=float(config["lora_alpha"]), use_rslora=use_rslora,
                            target_modules=tuple(targets), tensors=tensors,
                            nbytes=nbytes + heads_nbytes(embedding, heads), base_model=claimed_base,
                            module_scales=module_scales, magnitudes=magnitudes, embedding=embedding, heads=heads,
                            experts=experts)


def _router_target(base: ModelConfig, section: str, target: str) -> str:
    """"router" for a tensor name's module that is a mixture-of-experts router (`mlp.gate`, gpt-oss `mlp.router`,
    transformers 4.x Mixtral `block_sparse_moe.gate`); else the module name as given."""
    if base.moe is None:
        return target
    if (section == "mlp" and target == base.moe.router_name) or (section == "block_sparse_moe" and target == "gate"):
        return "router"
    return target


def _tensor_cap_for(base: ModelConfig, limits: UploadLimits) -> UploadLimits:
    """The tensor-count cap, raised on a mixture-of-experts base to what a full per-expert adapter holds (two
    tensors per expert projection of every sparse layer, as transformers 4.x trainers save them: ~37k for
    Qwen3-30B-A3B), so a well-formed adapter is never refused for its tensor count."""
    if base.moe is None:
        return limits
    per_expert = 2 * 3 * base.moe.num_experts * base.moe.num_sparse_layers
    dense = 2 * len(TARGETS) * base.num_layers + 64  # attention / dense MLP modules, embedding and heads
    return replace(limits, max_tensors=max(limits.max_tensors, per_expert + dense))


def _head_names(prefix: str) -> dict[str, str]:
    """PEFT's module names of embed_tokens and lm_head when the decoder layers sit under `prefix` (transformers 4.x
    Gemma 3's `language_model.model.`: the head is `language_model.lm_head`; else it is the model's own)."""
    head = "language_model.lm_head" if prefix == "language_model.model." else HEAD
    return {EMBED: f"{prefix}{EMBED}", HEAD: head}


def _check_embedding_patterns(config: Mapping, hc, rank: int, prefix: str = "model.") -> None:
    """An embedding LoRA is served at r and lora_alpha: refuse rank_pattern / alpha_pattern entries that give
    embed_tokens its own (PEFT's matching, as for the projections)."""
    if not hc.embedding_lora:
        return
    (r, alpha), = module_rank_alpha(config, {(-1, EMBED): _head_names(prefix)[EMBED]}).values()
    if r != rank or alpha != config["lora_alpha"]:
        raise fail("unsupported_option", "rank_pattern / alpha_pattern gives embed_tokens its own rank or alpha; "
                                          "an embedding LoRA is served at r and lora_alpha only for now")


def _embedding_targeted(declared: set[str] | _TargetPattern, prefix: str = "model.") -> bool:
    """Whether target_modules selects embed_tokens (PEFT: a name matches as the key or its last part; a regex
    matches the whole module name) and refuse a LoRA on lm_head (PEFT's Linear LoRA on the output head)."""
    if isinstance(declared, set):
        hits = {m for m in HEAD_MODULES if m in declared}
    else:
        hits = {m for m, name in _head_names(prefix).items() if declared.matches(name)}
    if HEAD in hits:
        raise fail("unsupported_target", "target_modules selects lm_head: LoRA on the output head is not supported; "
                                          "train it with modules_to_save=[\"lm_head\"] (a full head) or "
                                          "trainable_token_indices (a few token rows) instead")
    return EMBED in hits


def _head_entries(entries: list[TensorEntry], hc, rank: int, base: ModelConfig, limits: UploadLimits
                  ) -> tuple[dict[tuple[str, str], TensorEntry], list[TensorEntry]]:
    """Split off the embed_tokens / lm_head tensors, check them against the config (adapters/formats/heads.py) and the
    head size limit; returns ({(module, kind): entry}, the other entries)."""
    heads: dict[tuple[str, str], TensorEntry] = {}
    rest = []
    for entry in entries:
        key = head_tensor(entry.name)
        if key is None:
            rest.append(entry)
            continue
        if key in heads:
            raise fail("duplicate_tensor", f"{key[0]} has {key[1]} twice ({show(heads[key].name)} and "
                                            f"{show(entry.name)})")
        heads[key] = entry
    plan = plan_heads(hc, rank, base.vocab_size, base.hidden_size, base.tie_word_embeddings)
    check_head_tensors({k: (e.name, e.shape) for k, e in heads.items()}, plan, hc, base.vocab_size, base.hidden_size)
    size = sum(e.end - e.begin for e in heads.values())
    if limits.max_head_bytes is not None and size > limits.max_head_bytes:
        copies = [e.name for (_, kind), e in heads.items() if kind == "base"]
        hint = (f" ({show(copies[0])} is PEFT's copy of the base embedding: save with save_embedding_layers=False "
                "to leave it out)") if copies else ""
        raise fail("head_too_large", f"the adapter's embedding and head tensors hold {size} bytes, above the "
                                      f"limit of {limits.max_head_bytes} bytes for trained heads "
                                      f"({limits.head_limit_source}){hint}; use trainable_token_indices for a "
                                      "few tokens instead of a full head, or ask the operator to raise the limit")
    return heads, rest


def _fusion_hint(base: ModelConfig, target: str) -> str:
    linear = base.linear_attention
    if target in (*LINEAR_TARGETS, *FUSED_LINEAR_TARGETS):
        if linear is None:
            return (f" ({target} is a projection of a hybrid model's linear-attention layers (Qwen3.5, Qwen3-Next); "
                    f"model_type {base.model_type!r} has none)")
        if linear.fused_projections:
            return (f" (model_type {base.model_type!r} fuses in_proj_qkv / in_proj_z into in_proj_qkvz and in_proj_b /"
                    " in_proj_a into in_proj_ba: train the adapter on those modules)")
        return (f" ({target} is a fused module of Qwen3-Next; model_type {base.model_type!r} has in_proj_qkv, "
                "in_proj_z, in_proj_b and in_proj_a instead)")
    if base.fused_projections and SECTIONS.get(target) in ("self_attn", "mlp"):
        return (f" (model_type {base.model_type!r} fuses q/k/v into qkv_proj and gate/up into gate_up_proj: "
                "train the adapter on those modules)")
    if not base.fused_projections and target in FUSED_TARGETS:
        return (f" ({target} is a fused module of Phi-3; model_type {base.model_type!r} has "
                f"{', '.join(FUSED_TARGETS[target])} instead)")
    return ""
