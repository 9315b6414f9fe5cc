"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a base model.

Supported: peft_type LORA, r, lora_alpha, use_rslora, target_modules any subset of the q/k/v/o/gate/up/down
projections (names or a regex, as PEFT accepts; on a hybrid base also the linear-attention layers' in_proj_* /
out_proj, on a multimodal checkpoint its language model's: see adapters/formats/layer_modules.py), per-module
rank_pattern / alpha_pattern and layer subsets (layers_to_transform / layers_pattern, a regex or dotted names
selecting some layers, exclude_modules), by
PEFT's own matching rules (`module_selection`): each module keeps its own rank (the A / B shapes) and scale
(`module_scales`); DoRA (use_dora: the magnitude vectors land in `LoRAAdapter.magnitudes`; the device pool
turns them into DoRA's per-channel scale at load, see `adapters/formats/dora.py`); LoRA on embed_tokens,
modules_to_save of lm_head / embed_tokens and trainable_token_indices (`embedding` and `heads`: see
adapters/formats/heads.py); on a mixture-of-experts base, LoRA on the routed experts (PEFT `target_parameters` on
`mlp.experts.gate_up_proj` / `down_proj`, or transformers 4.x per-expert modules: `LoRAAdapter.experts`, see
adapters/formats/experts.py). Refused with a clear message for now: LoRA on lm_head (and DoRA on embed_tokens), added
tokens (a resized vocabulary), fan_in_fan_out, trained biases.
Every check lives in `validation.py` (the same path as uploads, base-model rule included: give
`base_model_id`, the served model's name, to have `base_model_name_or_path` checked exactly as an upload's);
this module turns a validated adapter into the float32 `LoRAAdapter` the engine serves, with its content digest.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from loramux.adapters.formats.heads import heads_nbytes
from loramux.adapters.formats.validation import (
    ALLOWED_FILENAMES,
    TARGETS,
    AdapterFormatError,
    AdapterValidationError,
    UploadLimits,
    ValidatedAdapter,
    projection_shapes,
    validate_adapter_files,
    validate_config,
)
from loramux.model.config import ModelConfig

__all__ = ["TARGETS", "AdapterFormatError", "LoRAAdapter", "build_adapter", "load_adapter_dir", "parse_config",
           "projection_shapes"]

# Adapters loaded by the operator (engine / CLI) are not uploads: no size cap, and no rank cap unless the
# engine gives its maximum. The structural caps (header size, tensor count) still apply.
_LOCAL_LIMITS = UploadLimits(max_total_bytes=sys.maxsize, max_rank=sys.maxsize)


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
    # Formats beyond one r / lora_alpha on whole projections; each empty for a plain adapter.
    module_scales: dict[tuple[int, str], float] = field(default_factory=dict)  # where a module's scale != `scale`
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)  # DoRA m [d_out]
    embedding: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # LoRA on embed_tokens
    heads: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # trained heads: adapters/formats/heads.py
    # LoRA on the routed experts: (layer, "gate_up" | "down") -> (A [E, R, d_in], B [E, d_out, R]), float32; expert
    # e's delta is B[e] @ A[e] * `scale` (gate_up rows: gate, then up). See adapters/formats/experts.py.
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def scale_of(self, key: tuple[int, str]) -> float:
        """The scale of module `key` = (layer, target): its own under rank/alpha patterns, else `scale`."""
        return self.module_scales.get(key, self.scale)

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()) \
            + sum(m.numel() * m.element_size() for m in self.magnitudes.values()) \
            + heads_nbytes(self.embedding, self.heads) \
            + sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.experts.values())


def parse_config(raw: bytes | str) -> dict:
    """Check `adapter_config.json` (bytes or text) and return it parsed (see `validation.validate_config`)."""
    return validate_config(raw)


def build_adapter(name: str, config_raw: bytes | str, weights_raw: bytes, cfg: ModelConfig,
                  max_rank: int | None = None, *, base_model_id: str | None = None,
                  allow_base_mismatch: bool = False) -> LoRAAdapter:
    """Validate the two files against the base model and return the adapter (float32 on CPU). With
    `base_model_id`, the config's base model is checked by `validation.check_base_model`, as an upload's is."""
    if isinstance(config_raw, str):
        config_raw = config_raw.encode()
    limits = _LOCAL_LIMITS if max_rank is None else replace(_LOCAL_LIMITS, max_rank=max_rank)
    validated = validate_adapter_files({"adapter_config.json": config_raw, "adapter_model.safetensors": weights_raw},
                                       cfg, limits, base_model_id, allow_base_mismatch)
    return _to_lora_adapter(name, validated, hashlib.sha256(weights_raw).digest())


def _to_lora_adapter(name: str, validated: ValidatedAdapter, weights_sha256: bytes) -> LoRAAdapter:
    weights = {key: (a.float().contiguous(), b.float().contiguous()) for key, (a, b) in validated.tensors.items()}
    digest = hashlib.sha256(hashlib.sha256(_canonical(validated.config)).digest() + weights_sha256)
    embedding, heads = float_heads(validated.embedding, validated.heads)
    return LoRAAdapter(name=name, rank=validated.rank, alpha=validated.alpha, use_rslora=validated.use_rslora,
                       target_modules=validated.target_modules, weights=weights, digest=digest.hexdigest(),
                       module_scales=dict(validated.module_scales),
                       magnitudes={key: m.float().contiguous() for key, m in validated.magnitudes.items()},
                       embedding=embedding, heads=heads,
                       experts={key: (a.float().contiguous(), b.float().contiguous())
                                for key, (a, b) in validated.experts.items()})


def float_heads(embedding, heads):
    """The embedding LoRA and head tensors as served on the host: float32 (token indices stay int64), a
    tensor shared by two heads (a tied head) still shared."""
    done: dict[int, torch.Tensor] = {}

    def conv(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            done[id(t)] = t.contiguous() if not t.is_floating_point() else t.float().contiguous()
        return done[id(t)]

    return (None if embedding is None else (conv(embedding[0]), conv(embedding[1])),
            {name: conv(t) for name, t in heads.items()})


def _canonical(config: Mapping) -> bytes:
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def _file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()


_PICKLE_GLOBS = ("adapter_model.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle")


def load_adapter_dir(path: str | Path, cfg: ModelConfig, name: str | None = None,
                     max_rank: int | None = None, *, base_model_id: str | None = None,
                     allow_base_mismatch: bool = False) -> LoRAAdapter:
    """Load and validate a PEFT adapter directory (other files in it, e.g. README.md, are ignored). With
    `base_model_id`, the config's base model is checked by `validation.check_base_model`, as an upload's is."""
    path = Path(path)
    files: dict[str, Path] = {f: path / f for f in ALLOWED_FILENAMES if (path / f).is_file()}
    if "adapter_model.safetensors" not in files:  # hand pickle weights to the validator, which refuses them
        files.update({p.name: p for pattern in _PICKLE_GLOBS for p in sorted(path.glob(pattern))[:1]})
    limits = _LOCAL_LIMITS if max_rank is None else replace(_LOCAL_LIMITS, max_rank=max_rank)
    try:
        validated = validate_adapter_files(files, cfg, limits, base_model_id, allow_base_mismatch)
    except AdapterValidationError as exc:
        if exc.code == "missing_file":
            raise AdapterValidationError(exc.code, f"{path.name}: {exc}") from None
        raise
    return _to_lora_adapter(name or path.name, validated, _file_sha256(files["adapter_model.safetensors"]))
