"""Upload checks of DoRA adapters (`use_dora: true`): the magnitude vectors PEFT saves beside lora_A / lora_B.

PEFT stores one magnitude per DoRA module, `...<module>.lora_magnitude_vector` (older PEFT versions add
`.weight`, and an adapter-name suffix may sit before it), of shape [d_out] of that module. Rules:
a magnitude tensor in an adapter without `use_dora` is refused (it would be silently ignored); with
`use_dora`, every covered (layer, module) has exactly one, of its module's output size, finite; a
magnitude for a module the adapter has no lora_A / lora_B for is refused naming the tensor. DoRA on the
embedding (`embed_tokens`) or the LM head is refused: its norm runs over the other axis of a table the
engine does not rescale per adapter, so it cannot be served exactly (train those without DoRA).
Codes used (see `validation`): bad_option, unsupported_option, unknown_tensor, shape_mismatch,
duplicate_tensor, missing_tensor, layer_out_of_range, unsupported_target.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

from loramux.adapters.formats.layer_modules import TENSOR_PREFIX
from loramux.adapters.formats.safetensors_header import TensorEntry
from loramux.adapters.formats.validation_common import CONFIG_FILE, fail, show

_MAGNITUDE_NAME = re.compile(
    r"^(?:base_model\.model\.)?" + TENSOR_PREFIX + r"layers\.(\d+)\.(?:self_attn|linear_attn|mlp)\.(\w+)"
    r"\.lora_magnitude_vector(?:\.default)?(?:\.weight)?$")
_MAGNITUDE_SUFFIX = re.compile(r"\.lora_magnitude_vector(?:\.default)?(?:\.weight)?$")
_NOT_LINEAR = ("embed_tokens", "lm_head")


def dora_enabled(config: Mapping) -> bool:
    """Whether the (already parsed) config asks for DoRA; raises bad_option unless use_dora is a boolean."""
    value = config.get("use_dora")
    if value not in (None, True, False):
        raise fail("bad_option", f"use_dora must be true or false, got {show(value)}")
    return bool(value)


def check_dora_config(config: Mapping) -> None:
    """Refuse DoRA settings this server cannot serve exactly (DoRA on the embedding or the LM head)."""
    if not dora_enabled(config):
        return
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []
    for name in names:
        if isinstance(name, str) and name.split(".")[-1] in _NOT_LINEAR:
            raise fail("unsupported_option", f"DoRA (use_dora=true) on {show(name.split('.')[-1])} is not "
                                              "supported: its magnitude rescales the embedding table, which this "
                                              "server shares between adapters. Train the adapter with "
                                              f"{show(name)} left out of target_modules (or without use_dora)")


def split_magnitudes(entries: list[TensorEntry], dora: bool
                     ) -> tuple[list[TensorEntry], dict[tuple[int, str], TensorEntry]]:
    """(the other entries, {(layer, module): magnitude entry}). Refuses a magnitude without `use_dora`, one on
    a module other than a decoder projection, and two for the same module."""
    rest, found = [], {}
    for entry in entries:
        if not _MAGNITUDE_SUFFIX.search(entry.name):
            rest.append(entry)
            continue
        if not dora:
            raise fail("unknown_tensor", f"tensor {show(entry.name)} is a DoRA magnitude but {CONFIG_FILE} does "
                                          "not set use_dora=true; set it (the adapter was trained with DoRA) or "
                                          "remove the tensor")
        match = _MAGNITUDE_NAME.match(entry.name)
        if match is None:
            if any(name in entry.name for name in _NOT_LINEAR):
                raise fail("unsupported_option", f"tensor {show(entry.name)} is a DoRA magnitude of the embedding "
                                                  "or LM head, which is not supported: train those modules without "
                                                  "use_dora")
            raise fail("unknown_tensor", f"unexpected DoRA magnitude {show(entry.name)}: only magnitudes of the "
                                          "decoder projections are accepted")
        key = (int(match.group(2)), match.group(3))
        if key in found:
            raise fail("duplicate_tensor", f"layer {key[0]} {key[1]} has lora_magnitude_vector twice (e.g. with "
                                            "and without a '.weight' or adapter-name suffix)")
        found[key] = entry
    return rest, found


def check_magnitudes(magnitudes: dict[tuple[int, str], TensorEntry], covered: set[tuple[int, str]],
                     shapes: Mapping[str, tuple[int, int]], num_layers: int) -> None:
    """Exactly one magnitude of shape [d_out] per covered (layer, module), none elsewhere."""
    for (layer, target), entry in sorted(magnitudes.items()):
        if target not in shapes:
            raise fail("unsupported_target", f"DoRA magnitude {show(entry.name)} targets {show(target)}; supported "
                                              f"targets: {', '.join(shapes)}")
        if layer >= num_layers:
            raise fail("layer_out_of_range", f"tensor {show(entry.name)} is for layer {layer}, the base model has "
                                              f"{num_layers} layers")
        if (layer, target) not in covered:
            raise fail("unknown_tensor", f"DoRA magnitude {show(entry.name)} is for layer {layer} {target}, which "
                                          "has no lora_A / lora_B in this adapter; remove it")
        expected = (shapes[target][1],)
        if entry.shape != expected:
            raise fail("shape_mismatch", f"tensor {show(entry.name)} has shape {entry.shape}, expected {expected} "
                                          f"(the output size of {target} on this base model)")
    for layer, target in sorted(covered):
        if (layer, target) not in magnitudes:
            raise fail("missing_tensor", f"layer {layer} {target} lacks its DoRA magnitude "
                                          "(lora_magnitude_vector); a use_dora adapter has one per LoRA module")
