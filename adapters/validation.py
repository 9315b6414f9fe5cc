"""Upload validation for PEFT LoRA adapters: the single path every adapter goes through before it is stored
or served (`peft_format.build_adapter` / `load_adapter_dir` call it too).

An upload is `adapter_config.json` + `adapter_model.safetensors`, checked against the base model before
anything is stored. The safetensors header is parsed here (not by the safetensors library) so that each
structural failure gets its own code and a message that says what to fix, and so that hostile headers are
refused cheaply: sizes are capped before reading, the tensor count is checked while the JSON header is
being parsed, and tensor data is read one tensor at a time after the whole header has been checked.
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

Messages never contain server paths (file contents given as paths are only ever named by their upload name).
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.model.config import ModelConfig

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALLOWED_FILENAMES = ("adapter_config.json", "adapter_model.safetensors")
CONFIG_FILE, WEIGHTS_FILE = ALLOWED_FILENAMES

_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}
# Config keys that ask a loader to import or run code (transformers' auto_map / trust_remote_code, Hydra's
# _target_ ...). PEFT's own `auto_mapping` (base model class lookup) is standard and not listed.
_CODE_HOOK_KEYS = frozenset({"auto_map", "auto_class", "trust_remote_code", "custom_code", "remote_code",
                             "_target_"})


class AdapterFormatError(ValueError):
    """The adapter files are not a LoRA adapter this engine can serve; the message says what to fix."""


class AdapterValidationError(AdapterFormatError):
    """An upload failed one validation check; `code` is a short stable machine-readable name of the check."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # keep code and message across pickling (e.g. to a worker process)
        return type(self), (self.code, str(self))


@dataclass(frozen=True)
class UploadLimits:
    max_total_bytes: int = 512 * 1024**2  # adapter_model.safetensors size cap
    max_config_bytes: int = 64 * 1024  # adapter_config.json size cap
    max_header_bytes: int = 16 * 1024**2  # safetensors JSON header cap
    max_tensors: int = 4096  # tensor-count cap
    max_rank: int = 64


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


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LoRA-targetable projection of the base model."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, cfg.q_size), "k_proj": (h, cfg.kv_size), "v_proj": (h, cfg.kv_size),
            "o_proj": (cfg.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _fail(code: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(code, message)


def _show(value, limit: int = 120) -> str:
    """repr() of a client-given value, cut short so a hostile name cannot blow up a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


_NOT_SAFETENSORS = f"{WEIGHTS_FILE} is not a valid safetensors file"


# ----------------------------------------------------------------------------------------------- file names

def _check_filename(name) -> None:
    if not isinstance(name, str) or not name:
        raise _fail("bad_filename", f"file name {_show(name)} is not allowed: upload exactly "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    if ("/" in name or "\\" in name or ".." in name or "\x00" in name or os.path.isabs(name)
            or re.match(r"^[A-Za-z]:", name) or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        raise _fail("bad_filename", f"file name {_show(name)} is not allowed: give plain file names without "
                                    f"directories, '..' or control characters ({CONFIG_FILE}, {WEIGHTS_FILE})")
    if name.lower().endswith(_PICKLE_SUFFIXES):
        raise _fail("pickle_refused", f"pickle weights are refused: save the adapter as safetensors "
                                      f"({WEIGHTS_FILE}, e.g. save_pretrained(..., safe_serialization=True)) "
                                      f"instead of {_show(name)}")
    if name not in ALLOWED_FILENAMES:
        raise _fail("unexpected_file", f"unexpected file {_show(name)}: an adapter upload holds exactly "
                                       f"{CONFIG_FILE} and {WEIGHTS_FILE}")


# ----------------------------------------------------------------------------------------------- byte sources

class _Source:
    """Random access to one uploaded file given as bytes or as a path; reads return fresh bytearrays."""

    def __init__(self, content):
        self._file = None
        if isinstance(content, (bytes, bytearray, memoryview)):
            view = memoryview(content)
            self._view = view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")
            self.size = self._view.nbytes
        elif isinstance(content, os.PathLike):
            self._file = open(content, "rb")  # closed by close() / __exit__
            self.size = os.fstat(self._file.fileno()).st_size
        else:
            raise TypeError(f"file content must be bytes or a path, got {type(content).__name__}")

    def read(self, offset: int, n: int) -> bytearray:
        if self._file is None:
            buf = bytearray(self._view[offset:offset + n])
        else:
            self._file.seek(offset)
            buf = bytearray(n)
            got, view = 0, memoryview(buf)
            while got < n:
                chunk = self._file.readinto(view[got:])
                if not chunk:
                    break
                got += chunk
            view.release()
            del buf[got:]
        if len(buf) != n:  # only possible when a file shrinks under us
            raise _fail("truncated", f"{_NOT_SAFETENSORS}: it ended early (expected {offset + n} bytes)")
        return buf

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> "_Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------- config

def _targets_from_config(config: Mapping) -> set[str] | str:
    targets = config.get("target_modules")
    if targets is None:
        raise _fail("bad_option", f"{CONFIG_FILE} has no target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise _fail("bad_option", f"target_modules {_show(targets)} is not a valid regular expression: "
                                      f"{exc}") from None
        return targets  # a regex over module names, as in PEFT
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _fail("bad_option", f"target_modules must be a list of module names or a regex string, got "
                                  f"{_show(targets)}")
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


def validate_config(raw: bytes | str, max_rank: int | None = None) -> dict:
    """Check `adapter_config.json` (given as its bytes or text) and return it parsed."""
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail("bad_json", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    except (ValueError, RecursionError):  # e.g. nesting too deep, integers with too many digits
        raise _fail("bad_json", f"{CONFIG_FILE} is not valid JSON (too deeply nested or a number too long)") \
            from None
    if not isinstance(config, dict):
        raise _fail("bad_json", f"{CONFIG_FILE} must hold a JSON object")
    hook = _find_code_hook(config)
    if hook:
        raise _fail("code_hook", f"{CONFIG_FILE} sets {hook!r}, which asks to import or run custom code; remove "
                                 "it (adapters are data only and never run code on this server)")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise _fail("not_lora", f"peft_type must be LORA, got {_show(config.get('peft_type'))}")
    if config.get("use_dora"):
        raise _fail("unsupported_option", "DoRA adapters (use_dora=true) are not supported yet")
    if config.get("fan_in_fan_out"):
        raise _fail("unsupported_option", "fan_in_fan_out adapters (GPT-2 style Conv1D) are not supported")
    if config.get("bias", "none") != "none":
        raise _fail("unsupported_option",
                    f"adapters that train biases (bias={_show(config.get('bias'))}) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _fail("unsupported_option", f"per-module {key} is not supported yet; give one r and lora_alpha")
    if config.get("layers_to_transform") is not None:
        raise _fail("unsupported_option",
                    "layers_to_transform is not supported yet; the adapter must cover every layer")
    modules_to_save = config.get("modules_to_save")
    if modules_to_save:
        raise _fail("unsupported_option",
                    f"modules_to_save={_show(modules_to_save)} (fully trained layers) is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise _fail("bad_rank", f"r must be a positive integer, got {_show(rank)}")
    if rank < 1:
        raise _fail("rank_out_of_range", f"r must be a positive integer, got {rank}")
    if max_rank is not None and rank > max_rank:
        raise _fail("rank_out_of_range", f"rank {rank} is above this server's maximum LoRA rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not _positive_finite(alpha):
        raise _fail("bad_alpha", f"lora_alpha must be a positive number, got {_show(alpha)}")
    if config.get("use_rslora") not in (None, True, False):
        raise _fail("bad_option", f"use_rslora must be true or false, got {_show(config.get('use_rslora'))}")
    _targets_from_config(config)
    return config


def _positive_finite(x: int | float) -> bool:
    try:
        return math.isfinite(x) and x > 0
    except OverflowError:  # an integer too large for a float
        return False


def _check_base_model(config: Mapping, base_model_id: str | None) -> None:
    claimed = config.get("base_model_name_or_path")
    if not base_model_id or claimed in (None, ""):
        return
    if not isinstance(claimed, str):
        raise _fail("bad_option", f"base_model_name_or_path must be a string, got {_show(claimed)}")

    def last(name: str) -> str:
        return re.split(r"[/\\]", name.rstrip("/\\"))[-1].lower()

    if last(claimed) != last(base_model_id):
        served = re.split(r"[/\\]", base_model_id.rstrip("/\\"))[-1]  # never a server path
        raise _fail("base_model_mismatch", f"the adapter was trained for base model {_show(claimed)} "
                                           f"(base_model_name_or_path) but this server serves {served!r}; "
                                           "train the adapter on that base model")


# ----------------------------------------------------------------------------------------------- safetensors

@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_header(src: _Source, limits: UploadLimits) -> tuple[list[_Entry], int]:
    """Check the safetensors structure; return the tensor entries and where the data section starts."""
    if src.size < 8:
        raise _fail("truncated", f"{_NOT_SAFETENSORS}: it is {src.size} bytes, too short for the 8-byte "
                                 "header length")
    n = int.from_bytes(src.read(0, 8), "little")
    if n > limits.max_header_bytes:
        raise _fail("header_too_large", f"{_NOT_SAFETENSORS}: its header declares {n} bytes, above this "
                                        f"server's limit of {limits.max_header_bytes} bytes")
    if n > src.size - 8:
        raise _fail("truncated", f"{_NOT_SAFETENSORS}: its header declares {n} bytes but only {src.size - 8} "
                                 "follow; the file is truncated or corrupt")
    try:
        text = src.read(8, n).decode("utf-8")
    except UnicodeDecodeError:
        raise _fail("bad_header", f"{_NOT_SAFETENSORS}: its header is not UTF-8 text") from None

    tensor_objects = 0

    def on_object(pairs):  # called for every JSON object as soon as it is parsed, inner ones first
        nonlocal tensor_objects
        obj = dict(pairs)
        if len(obj) != len(pairs):
            raise _fail("bad_header", f"{_NOT_SAFETENSORS}: its header repeats a key")
        if "data_offsets" in obj:
            tensor_objects += 1
            if tensor_objects > limits.max_tensors:
                raise _fail("too_many_tensors", f"{WEIGHTS_FILE} holds more than {limits.max_tensors} tensors, "
                                                "this server's limit")
        return obj

    try:
        header = json.JSONDecoder(object_pairs_hook=on_object).decode(text)
    except AdapterValidationError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        detail = f" ({exc.msg} at character {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        raise _fail("bad_header", f"{_NOT_SAFETENSORS}: its header is not valid JSON{detail}") from None
    del text
    if not isinstance(header, dict):
        raise _fail("bad_header", f"{_NOT_SAFETENSORS}: its header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise _fail("bad_header", f"{_NOT_SAFETENSORS}: __metadata__ must map strings to strings")
    if len(header) > limits.max_tensors:
        raise _fail("too_many_tensors", f"{WEIGHTS_FILE} holds {len(header)} tensors, above this server's "
                                        f"limit of {limits.max_tensors}")

    data_start = 8 + n
    data_len = src.size - data_start
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _fail("bad_header", f"{_NOT_SAFETENSORS}: header entry {_show(name)} must have exactly "
                                      "dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str):
            raise _fail("bad_header", f"{_NOT_SAFETENSORS}: tensor {_show(name)} has a non-string dtype")
        if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
            raise _fail("bad_header", f"{_NOT_SAFETENSORS}: tensor {_show(name)} has shape {_show(shape)}; "
                                      "a shape is a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_nonneg_int(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise _fail("bad_header", f"{_NOT_SAFETENSORS}: tensor {_show(name)} has data_offsets "
                                      f"{_show(offsets)}; expected [begin, end] with 0 <= begin <= end")
        if dtype not in _DTYPES:
            raise _fail("bad_dtype", f"tensor {_show(name)} has dtype {_show(dtype)}; LoRA weights must be "
                                     f"{', '.join(_DTYPES)} (save them as float32, float16 or bfloat16)")
        begin, end = offsets
        expected = math.prod(shape) * _DTYPES[dtype][1]
        if end - begin != expected:
            raise _fail("span_mismatch", f"{_NOT_SAFETENSORS}: tensor {_show(name)} is declared {dtype} "
                                         f"{tuple(shape)} ({expected} bytes) but its data_offsets span "
                                         f"{end - begin} bytes")
        if end > data_len:
            raise _fail("offset_out_of_bounds", f"{_NOT_SAFETENSORS}: tensor {_show(name)} ends at byte {end} "
                                                f"of the data section, which has only {data_len} bytes")
        entries.append(_Entry(name, dtype, tuple(shape), begin, end))

    covered, previous = 0, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < covered:
            raise _fail("overlapping_tensors", f"{_NOT_SAFETENSORS}: tensors {_show(previous.name)} and "
                                               f"{_show(entry.name)} share bytes of the data section")
        if entry.begin > covered:
            raise _fail("data_gap", f"{_NOT_SAFETENSORS}: bytes {covered}..{entry.begin} of the data section "
                                    "belong to no tensor")
        covered, previous = entry.end, entry
    if covered != data_len:
        raise _fail("data_gap", f"{_NOT_SAFETENSORS}: {data_len - covered} bytes after the last tensor belong "
                                "to no tensor")
    return entries, data_start


def _looks_like_pickle(head: bytes) -> str | None:
    """'pickle' / 'zip' when the first bytes are a pickle protocol 2-5 or a zip (torch.save) file; a
    safetensors file whose header length happens to start with those bytes has '{' at byte 8."""
    if len(head) >= 9 and head[8:9] == b"{":
        return None
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if head.startswith(b"PK\x03\x04"):
        return "zip (torch.save)"
    return None


# ----------------------------------------------------------------------------------------------- weights

def _check_entries(entries: list[_Entry], base: ModelConfig, rank: int, declared: set[str] | str
                   ) -> tuple[list[str], dict[tuple[int, str], dict[str, _Entry]]]:
    shapes = projection_shapes(base)
    found: dict[tuple[int, str], dict[str, _Entry]] = {}
    for entry in entries:
        match = _TENSOR_NAME.match(entry.name)
        if match is None:
            if "embed_tokens" in entry.name or "lm_head" in entry.name:
                raise _fail("unsupported_target", "embedding / lm_head LoRA targets are not supported yet")
            raise _fail("unknown_tensor", f"unexpected tensor {_show(entry.name)}: only LoRA A/B weights of "
                                          f"{', '.join(TARGETS)} are accepted")
        layer, target, kind = int(match.group(1)), match.group(2), match.group(3)
        if target not in shapes:
            raise _fail("unsupported_target", f"tensor {_show(entry.name)} targets {_show(target)}; supported "
                                              f"targets: {', '.join(TARGETS)}")
        if layer >= base.num_layers:
            raise _fail("layer_out_of_range", f"tensor {_show(entry.name)} is for layer {layer}, the base model "
                                              f"has {base.num_layers} layers")
        d_in, d_out = shapes[target]
        expected = (rank, d_in) if kind == "A" else (d_out, rank)
        if entry.shape != expected:
            raise _fail("shape_mismatch", f"tensor {_show(entry.name)} has shape {entry.shape}, expected "
                                          f"{expected} for r={rank} on this base model")
        pair = found.setdefault((layer, target), {})
        if kind in pair:
            raise _fail("duplicate_tensor", f"layer {layer} {target} has lora_{kind} twice (e.g. with and "
                                            "without an adapter-name suffix)")
        pair[kind] = entry
    if not found:
        raise _fail("no_lora_weights", f"{WEIGHTS_FILE} holds no LoRA weights")
    targets = sorted({t for _, t in found}, key=TARGETS.index)
    if isinstance(declared, set):
        if set(targets) != declared & set(TARGETS) or declared - set(TARGETS):
            raise _fail("target_mismatch", f"weights target {targets} but {CONFIG_FILE} declares "
                                           f"{sorted(declared)}; they must be the same projections")
    elif not all(re.fullmatch(declared, t) or re.search(declared, t) for t in targets):
        raise _fail("target_mismatch", f"weights target {targets}, which the target_modules pattern "
                                       f"{_show(declared)} does not match")
    for key in [(layer, t) for layer in range(base.num_layers) for t in targets]:
        pair = found.get(key, {})
        if set(pair) != {"A", "B"}:
            raise _fail("missing_tensor", f"layer {key[0]} {key[1]} lacks lora_{'A' if 'A' not in pair else 'B'}; "
                                          "an adapter must cover every layer of each target")
    return targets, found


def _read_tensor(src: _Source, data_start: int, entry: _Entry) -> torch.Tensor:
    dtype = _DTYPES[entry.dtype][0]
    buf = src.read(data_start + entry.begin, entry.end - entry.begin)
    tensor = torch.frombuffer(buf, dtype=dtype).view(entry.shape)  # owns `buf`; safetensors is little-endian
    if not bool(torch.isfinite(tensor).all()):
        raise _fail("non_finite", f"tensor {_show(entry.name)} has NaN or infinite values; retrain or fix "
                                  "the adapter")
    return tensor


# ----------------------------------------------------------------------------------------------- entry point

def validate_adapter_files(files: Mapping[str, bytes | Path], base: ModelConfig, limits: UploadLimits = UploadLimits(),
                           base_model_id: str | None = None) -> ValidatedAdapter:
    """Validate an adapter upload (client file name -> bytes, or path of a temp file holding them) against
    the base model; return its config and tensors or raise `AdapterValidationError`."""
    for name in files:
        _check_filename(name)
    for name in ALLOWED_FILENAMES:
        if name not in files:
            raise _fail("missing_file", f"{name} is missing: an adapter upload needs {CONFIG_FILE} and "
                                        f"{WEIGHTS_FILE} (PEFT's save_pretrained writes both)")
    with _Source(files[CONFIG_FILE]) as config_src, _Source(files[WEIGHTS_FILE]) as weights_src:
        if config_src.size > limits.max_config_bytes:
            raise _fail("config_too_large", f"{CONFIG_FILE} is {config_src.size} bytes, above this server's "
                                            f"limit of {limits.max_config_bytes} bytes")
        if weights_src.size > limits.max_total_bytes:
            raise _fail("too_large", f"{WEIGHTS_FILE} is {weights_src.size} bytes, above this server's limit of "
                                     f"{limits.max_total_bytes} bytes; use a smaller rank or fewer targets")
        kind = _looks_like_pickle(weights_src.read(0, min(9, weights_src.size)))
        if kind:
            raise _fail("pickle_refused", f"pickle weights are refused: save the adapter as safetensors "
                                          f"({WEIGHTS_FILE} holds a {kind} file)")
        config = validate_config(config_src.read(0, config_src.size), limits.max_rank)
        _check_base_model(config, base_model_id)
        rank, declared = config["r"], _targets_from_config(config)

        entries, data_start = _parse_header(weights_src, limits)
        targets, found = _check_entries(entries, base, rank, declared)
        tensors, nbytes = {}, 0
        for key in [(layer, t) for layer in range(base.num_layers) for t in targets]:
            a = _read_tensor(weights_src, data_start, found[key]["A"])
            b = _read_tensor(weights_src, data_start, found[key]["B"])
            tensors[key] = (a, b)
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
    return ValidatedAdapter(config=config, rank=rank, alpha=float(config["lora_alpha"]),
                            use_rslora=bool(config.get("use_rslora", False)), target_modules=tuple(targets),
                            tensors=tensors, nbytes=nbytes)
