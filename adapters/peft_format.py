"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a base model.

Supported: peft_type LORA, r, lora_alpha, use_rslora, target_modules any subset of the q/k/v/o/gate/up/down
projections (names or a regex, as PEFT accepts). Refused with a clear message for now: DoRA, embedding /
lm_head targets, per-module rank or alpha patterns, layer subsets, fan_in_fan_out, trained biases.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes

from loramux.model.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterFormatError(ValueError):
    """The adapter files are not a LoRA adapter this engine can serve; the message says what to fix."""


@dataclass
class LoRAAdapter:
    """A validated adapter in host memory: A [r, d_in] and B [d_out, r] per (layer, target), float32."""

    name: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LoRA-targetable projection of the base model."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _targets_from_config(config: Mapping) -> set[str] | str:
    targets = config.get("target_modules")
    if targets is None:
        raise AdapterFormatError("adapter_config.json has no target_modules")
    if isinstance(targets, str):
        return targets  # a regex over module names, as in PEFT
    return {t.split(".")[-1] for t in targets}


def parse_config(raw: bytes | str) -> dict:
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterFormatError("adapter_config.json must hold a JSON object")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterFormatError(f"peft_type must be LORA, got {config.get('peft_type')!r}")
    if config.get("use_dora"):
        raise AdapterFormatError("DoRA adapters (use_dora=true) are not supported yet")
    if config.get("fan_in_fan_out"):
        raise AdapterFormatError("fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterFormatError(f"adapters that train biases (bias={config.get('bias')!r}) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterFormatError(f"per-module {key} is not supported yet; give one r and lora_alpha")
    if config.get("layers_to_transform") is not None:
        raise AdapterFormatError("layers_to_transform is not supported yet; the adapter must cover every layer")
    modules_to_save = config.get("modules_to_save")
    if modules_to_save:
        raise AdapterFormatError(f"modules_to_save={modules_to_save!r} (fully trained layers) is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterFormatError(f"r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise AdapterFormatError(f"lora_alpha must be a positive number, got {alpha!r}")
    return config


def build_adapter(name: str, config_raw: bytes | str, weights_raw: bytes, cfg: ModelConfig,
                  max_rank: int | None = None) -> LoRAAdapter:
    """Validate the two files against the base model and return the adapter (float32 on CPU)."""
    config = parse_config(config_raw)
    rank, alpha = config["r"], float(config["lora_alpha"])
    if max_rank is not None and rank > max_rank:
        raise AdapterFormatError(f"rank {rank} is above this server's maximum LoRA rank {max_rank}")
    declared = _targets_from_config(config)
    try:
        tensors = load_safetensors_bytes(weights_raw)
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise AdapterFormatError(f"adapter_model.safetensors is not a valid safetensors file: {exc}") from None
    shapes = projection_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _TENSOR_NAME.match(tensor_name)
        if match is None:
            if "embed_tokens" in tensor_name or "lm_head" in tensor_name:
                raise AdapterFormatError("embedding / lm_head LoRA targets are not supported yet")
            raise AdapterFormatError(f"unexpected tensor {tensor_name!r}: only LoRA A/B weights of "
                                     f"{', '.join(TARGETS)} are accepted")
        layer, target, kind = int(match.group(1)), match.group(2), match.group(3)
        if target not in shapes:
            raise AdapterFormatError(f"tensor {tensor_name!r} targets {target!r}; supported targets: "
                                     f"{', '.join(TARGETS)}")
        if layer >= cfg.num_layers:
            raise AdapterFormatError(f"tensor {tensor_name!r} is for layer {layer}, the base model has "
                                     f"{cfg.num_layers} layers")
        if not tensor.is_floating_point():
            raise AdapterFormatError(f"tensor {tensor_name!r} has dtype {tensor.dtype}; LoRA weights must be floats")
        d_in, d_out = shapes[target]
        expected = (rank, d_in) if kind == "A" else (d_out, rank)
        if tuple(tensor.shape) != expected:
            raise AdapterFormatError(f"tensor {tensor_name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                                     f"for r={rank} on this base model")
        pair = found.setdefault((layer, target), {})
        if kind in pair:
            raise AdapterFormatError(f"layer {layer} {target} has lora_{kind} twice (e.g. with and without "
                                     "an adapter-name suffix)")
        pair[kind] = tensor
    if not found:
        raise AdapterFormatError("adapter_model.safetensors holds no LoRA weights")
    targets = sorted({t for _, t in found}, key=TARGETS.index)
    if isinstance(declared, set):
        declared_here = declared & set(TARGETS)
        if set(targets) != declared_here or declared - set(TARGETS):
            raise AdapterFormatError(f"weights target {targets} but adapter_config.json declares "
                                     f"{sorted(declared)}; they must be the same projections")
    elif not all(re.fullmatch(declared, t) or re.search(declared, t) for t in targets):
        raise AdapterFormatError(f"weights target {targets}, which the target_modules pattern {declared!r} "
                                 "does not match")
    weights = {}
    for key in [(layer, t) for layer in range(cfg.num_layers) for t in targets]:
        pair = found.get(key, {})
        if set(pair) != {"A", "B"}:
            raise AdapterFormatError(f"layer {key[0]} {key[1]} lacks lora_{'A' if 'A' not in pair else 'B'}; "
                                     "an adapter must cover every layer of each target")
        a, b = pair["A"].float(), pair["B"].float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterFormatError(f"layer {key[0]} {key[1]} has NaN or infinite values")
        weights[key] = (a.contiguous(), b.contiguous())
    digest = hashlib.sha256(hashlib.sha256(_canonical(config)).digest() + hashlib.sha256(weights_raw).digest())
    return LoRAAdapter(name=name, rank=rank, alpha=alpha, use_rslora=bool(config.get("use_rslora", False)),
                       target_modules=tuple(targets), weights=weights, digest=digest.hexdigest())


def _canonical(config: Mapping) -> bytes:
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def load_adapter_dir(path: str | Path, cfg: ModelConfig, name: str | None = None,
                     max_rank: int | None = None) -> LoRAAdapter:
    """Load and validate a PEFT adapter directory."""
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise AdapterFormatError(f"{path.name}: adapter_config.json not found")
    if not weights_file.is_file():
        if any(path.glob("adapter_model.bin")) or any(path.glob("*.pt")):
            raise AdapterFormatError("pickle weights (.bin/.pt) are refused: save the adapter as safetensors")
        raise AdapterFormatError(f"{path.name}: adapter_model.safetensors not found")
    return build_adapter(name or path.name, config_file.read_bytes(), weights_file.read_bytes(), cfg, max_rank)
