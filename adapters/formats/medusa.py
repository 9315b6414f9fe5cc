"""Medusa heads on disk and in uploads: `medusa_config.json` + `medusa_heads.safetensors`, validated for a base
model before anything serves them.

Medusa-1 (Cai et al. 2024): head k (k = 1 .. K) reads the model's final hidden state h at position t and
predicts the token at t + 1 + k through one residual SiLU block and the model's own LM head:
`logits_k = lm_head(h + silu(W_k h + b_k))`. Only W_k [H, H] and b_k [H] are stored (the LM head is shared),
under Medusa's own names `medusa_head.{k-1}.0.linear.weight` / `.bias`.

`medusa_config.json`: {"format": "loramux-medusa-1", "num_heads": K, "hidden_size": H,
"base_model_name_or_path": ..., "adapter": <name or null: what the heads were trained with>}.
"""
from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux.adapters.formats.safetensors_header import (
    ByteSource,
    check_config_size,
    check_weights_file,
    parse_header,
    read_tensor,
    read_upload,
)
from loramux.adapters.formats.validation_common import AdapterValidationError, UploadLimits, fail, show

__all__ = ["MEDUSA_CONFIG", "MEDUSA_WEIGHTS", "MEDUSA_FORMAT", "MAX_MEDUSA_HEADS", "MedusaHeadsWeights",
           "validate_medusa_files", "load_medusa_dir", "save_medusa_dir", "medusa_digest", "MedusaFormatError"]

MEDUSA_CONFIG, MEDUSA_WEIGHTS = "medusa_config.json", "medusa_heads.safetensors"
MEDUSA_FORMAT = "loramux-medusa-1"
MAX_MEDUSA_HEADS = 8  # more heads than this never pay: acceptance of head k falls roughly geometrically
MedusaFormatError = AdapterValidationError


@dataclass
class MedusaHeadsWeights:
    """Validated Medusa heads in host memory, float32: `blocks[k] = (W_k [H, H], b_k [H])`."""

    num_heads: int
    hidden_size: int
    blocks: list[tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    config: dict = field(default_factory=dict)
    digest: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes of the heads at float32 (the size they take on the device at that dtype)."""
        return sum(w.numel() * 4 + b.numel() * 4 for w, b in self.blocks)


def medusa_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """Content digest of a heads upload: sha256 over both files, length-prefixed (no ambiguity at the seam)."""
    h = hashlib.sha256()
    for part in (config_bytes, weights_bytes):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def validate_medusa_files(files: Mapping[str, bytes | Path], hidden_size: int,
                          limits: UploadLimits = UploadLimits()) -> MedusaHeadsWeights:
    """Validate a heads upload (file name -> bytes or path) for a base model of `hidden_size`; raise
    `MedusaFormatError` (an AdapterValidationError: `code` + a message that says what to fix)."""
    unknown = sorted(set(files) - {MEDUSA_CONFIG, MEDUSA_WEIGHTS})
    if unknown:
        raise fail("unexpected_file", f"unexpected file {show(unknown[0])}: Medusa heads are {MEDUSA_CONFIG} "
                                      f"and {MEDUSA_WEIGHTS} (what `loramux medusa train` writes)")
    for name in (MEDUSA_CONFIG, MEDUSA_WEIGHTS):
        if name not in files:
            raise fail("missing_file", f"{name} is missing: Medusa heads need {MEDUSA_CONFIG} and {MEDUSA_WEIGHTS}")
    config_bytes = read_upload(files[MEDUSA_CONFIG])
    check_config_size(MEDUSA_CONFIG, len(config_bytes), limits)
    config = _parse_config(config_bytes, hidden_size)
    with ByteSource(files[MEDUSA_WEIGHTS]) as src:
        check_weights_file(src, MEDUSA_WEIGHTS, limits, "heads")
        entries, data_start = parse_header(src, limits)
        by_name = {e.name: e for e in entries}
        k, h = config["num_heads"], hidden_size
        expected = {}
        for i in range(k):
            expected[f"medusa_head.{i}.0.linear.weight"] = (h, h)
            expected[f"medusa_head.{i}.0.linear.bias"] = (h,)
        extra = sorted(set(by_name) - set(expected))
        if extra:
            raise fail("unexpected_tensor", f"tensor {show(extra[0])} is not part of {k} Medusa-1 heads (expected "
                                            f"medusa_head.<i>.0.linear.weight / .bias for i < {k}); nothing may be "
                                            f"left unused")
        blocks = []
        for i in range(k):
            pair = []
            for suffix in ("weight", "bias"):
                name = f"medusa_head.{i}.0.linear.{suffix}"
                entry = by_name.get(name)
                if entry is None:
                    raise fail("missing_tensor", f"tensor {name} is missing ({k} heads declared in {MEDUSA_CONFIG})")
                if tuple(entry.shape) != expected[name]:
                    raise fail("shape_mismatch", f"tensor {name} has shape {list(entry.shape)}, expected "
                                                 f"{list(expected[name])} for hidden size {h}")
                t = read_tensor(src, data_start, entry).float()
                if not torch.isfinite(t).all():
                    raise fail("non_finite", f"tensor {name} holds NaN or infinite values")
                pair.append(t)
            blocks.append((pair[0], pair[1]))
        weights_bytes = read_upload(files[MEDUSA_WEIGHTS])
    return MedusaHeadsWeights(k, h, blocks, config, medusa_digest(config_bytes, weights_bytes))


def _parse_config(raw: bytes, hidden_size: int) -> dict:
    try:  # UTF-8 only (RFC 8259): json.loads(bytes) would also take UTF-16/32
        config = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise fail("bad_config", f"{MEDUSA_CONFIG} is not UTF-8 text: save it as UTF-8") from None
    except (ValueError, RecursionError):  # e.g. nesting past the parser's stack, an int of 5000 digits
        raise fail("bad_config", f"{MEDUSA_CONFIG} is not valid JSON") from None
    if not isinstance(config, dict):
        raise fail("bad_config", f"{MEDUSA_CONFIG} must hold a JSON object")
    if config.get("format") != MEDUSA_FORMAT:
        raise fail("bad_config", f"{MEDUSA_CONFIG} format must be {MEDUSA_FORMAT!r} (got {show(config.get('format'))});"
                                 f" make heads with `loramux medusa train`")
    k = config.get("num_heads")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_MEDUSA_HEADS:
        raise fail("bad_config", f"num_heads must be an integer from 1 to {MAX_MEDUSA_HEADS}, got {show(k)}")
    h = config.get("hidden_size")
    if h != hidden_size:
        raise fail("base_mismatch", f"the heads were made for hidden size {show(h)}, the served model's is "
                                    f"{hidden_size}: train heads for this model with `loramux medusa train`")
    return config


def load_medusa_dir(path: Path | str, hidden_size: int) -> MedusaHeadsWeights:
    """Validate and load a heads directory (the operator's own files: no upload size cap)."""
    path = Path(path)
    limits = UploadLimits(max_total_bytes=sys.maxsize)
    return validate_medusa_files({MEDUSA_CONFIG: path / MEDUSA_CONFIG, MEDUSA_WEIGHTS: path / MEDUSA_WEIGHTS},
                                 hidden_size, limits)


def save_medusa_dir(path: Path | str, blocks: list[tuple[torch.Tensor, torch.Tensor]], *,
                    base_model: str | None = None, adapter: str | None = None, extra: dict | None = None) -> Path:
    """Write heads as `medusa_config.json` + `medusa_heads.safetensors`, in the blocks' own dtype."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden = blocks[0][0].shape[0]
    tensors = {}
    for i, (w, b) in enumerate(blocks):
        tensors[f"medusa_head.{i}.0.linear.weight"] = w.detach().contiguous().cpu()
        tensors[f"medusa_head.{i}.0.linear.bias"] = b.detach().contiguous().cpu()
    save_file(tensors, str(path / MEDUSA_WEIGHTS))
    config = {"format": MEDUSA_FORMAT, "num_heads": len(blocks), "hidden_size": hidden,
              "base_model_name_or_path": base_model, "adapter": adapter, **(extra or {})}
    (path / MEDUSA_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path
