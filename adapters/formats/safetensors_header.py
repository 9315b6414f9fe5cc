"""The safetensors file of an adapter upload, read without the safetensors library.

`parse_header` checks the structure (8-byte length, JSON header, dtypes, shapes, data offsets that tile
the data section) so that each failure gets its own `AdapterValidationError` code and a message that says
what to fix, and so that hostile headers are refused cheaply: the header size is capped before it is read
and the tensor count is checked while the JSON is being parsed. `read_tensor` then reads one tensor at a
time. `looks_like_pickle` recognises pickle / torch.save content, which is refused, never unpickled.
`check_weights_file` and `check_config_size` are the size and pickle checks every upload (adapters, Medusa
heads) passes first.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.adapters.formats.validation_common import WEIGHTS_FILE, AdapterValidationError, UploadLimits, fail, show

DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}
_NOT_SAFETENSORS = f"{WEIGHTS_FILE} is not a valid safetensors file"


class ByteSource:
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
            raise fail("truncated", f"{_NOT_SAFETENSORS}: it ended early (expected {offset + n} bytes)")
        return buf

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def parse_header(src: ByteSource, limits: UploadLimits) -> tuple[list[TensorEntry], int]:
    """Check the safetensors structure; return the tensor entries and where the data section starts."""
    if src.size < 8:
        raise fail("truncated", f"{_NOT_SAFETENSORS}: it is {src.size} bytes, too short for the 8-byte "
                                 "header length")
    n = int.from_bytes(src.read(0, 8), "little")
    if n > limits.max_header_bytes:
        raise fail("header_too_large", f"{_NOT_SAFETENSORS}: its header declares {n} bytes, above this "
                                        f"server's limit of {limits.max_header_bytes} bytes")
    if n > src.size - 8:
        raise fail("truncated", f"{_NOT_SAFETENSORS}: its header declares {n} bytes but only {src.size - 8} "
                                 "follow; the file is truncated or corrupt")
    try:
        text = src.read(8, n).decode("utf-8")
    except UnicodeDecodeError:
        raise fail("bad_header", f"{_NOT_SAFETENSORS}: its header is not UTF-8 text") from None

    tensor_objects = 0

    def on_object(pairs):  # called for every JSON object as soon as it is parsed, inner ones first
        nonlocal tensor_objects
        obj = dict(pairs)
        if len(obj) != len(pairs):
            raise fail("bad_header", f"{_NOT_SAFETENSORS}: its header repeats a key")
        if "data_offsets" in obj:
            tensor_objects += 1
            if tensor_objects > limits.max_tensors:
                raise fail("too_many_tensors", f"{WEIGHTS_FILE} holds more than {limits.max_tensors} tensors, "
                                                "this server's limit")
        return obj

    try:
        header = json.JSONDecoder(object_pairs_hook=on_object).decode(text)
    except AdapterValidationError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        detail = f" ({exc.msg} at character {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        raise fail("bad_header", f"{_NOT_SAFETENSORS}: its header is not valid JSON{detail}") from None
    del text
    if not isinstance(header, dict):
        raise fail("bad_header", f"{_NOT_SAFETENSORS}: its header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise fail("bad_header", f"{_NOT_SAFETENSORS}: __metadata__ must map strings to strings")
    if len(header) > limits.max_tensors:
        raise fail("too_many_tensors", f"{WEIGHTS_FILE} holds {len(header)} tensors, above this server's "
                                        f"limit of {limits.max_tensors}")

    data_start = 8 + n
    data_len = src.size - data_start
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise fail("bad_header", f"{_NOT_SAFETENSORS}: header entry {show(name)} must have exactly "
                                      "dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str):
            raise fail("bad_header", f"{_NOT_SAFETENSORS}: tensor {show(name)} has a non-string dtype")
        if not isinstance(shape, list) or not all(_is_nonneg_int(d) for d in shape):
            raise fail("bad_header", f"{_NOT_SAFETENSORS}: tensor {show(name)} has shape {show(shape)}; "
                                      "a shape is a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_nonneg_int(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise fail("bad_header", f"{_NOT_SAFETENSORS}: tensor {show(name)} has data_offsets "
                                      f"{show(offsets)}; expected [begin, end] with 0 <= begin <= end")
        if dtype not in DTYPES:
            raise fail("bad_dtype", f"tensor {show(name)} has dtype {show(dtype)}; LoRA weights must be "
                                     f"{', '.join(DTYPES)} (save them as float32, float16 or bfloat16)")
        begin, end = offsets
        expected = math.prod(shape) * DTYPES[dtype][1]
        if end - begin != expected:
            raise fail("span_mismatch", f"{_NOT_SAFETENSORS}: tensor {show(name)} is declared {dtype} "
                                         f"{tuple(shape)} ({expected} bytes) but its data_offsets span "
                                         f"{end - begin} bytes")
        if end > data_len:
            raise fail("offset_out_of_bounds", f"{_NOT_SAFETENSORS}: tensor {show(name)} ends at byte {end} "
                                                f"of the data section, which has only {data_len} bytes")
        entries.append(TensorEntry(name, dtype, tuple(shape), begin, end))

    covered, previous = 0, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < covered:
            assert previous is not None  # something covered those bytes
            raise fail("overlapping_tensors", f"{_NOT_SAFETENSORS}: tensors {show(previous.name)} and "
                                               f"{show(entry.name)} share bytes of the data section")
        if entry.begin > covered:
            raise fail("data_gap", f"{_NOT_SAFETENSORS}: bytes {covered}..{entry.begin} of the data section "
                                    "belong to no tensor")
        covered, previous = entry.end, entry
    if covered != data_len:
        raise fail("data_gap", f"{_NOT_SAFETENSORS}: {data_len - covered} bytes after the last tensor belong "
                                "to no tensor")
    return entries, data_start


def looks_like_pickle(head: bytes | bytearray) -> str | None:
    """'pickle' / 'zip' when the first bytes are a pickle protocol 2-5 or a zip (torch.save) file; a
    safetensors file whose header length happens to start with those bytes has '{' at byte 8."""
    if len(head) >= 9 and head[8:9] == b"{":
        return None
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if head.startswith(b"PK\x03\x04"):
        return "zip (torch.save)"
    return None


def read_upload(content: bytes | os.PathLike) -> bytes:
    """All of one uploaded file, given as bytes or as a path."""
    return Path(content).read_bytes() if isinstance(content, (str, os.PathLike)) else bytes(content)


def check_config_size(name: str, size: int, limits: UploadLimits) -> None:
    """An upload's JSON config within `limits.max_config_bytes` (`config_too_large`)."""
    if size > limits.max_config_bytes:
        raise fail("config_too_large", f"{name} is {size} bytes, above this server's limit of "
                                       f"{limits.max_config_bytes} bytes")


def check_weights_file(src: ByteSource, name: str, limits: UploadLimits, what: str, fix: str = "") -> None:
    """What every uploaded weights file passes before its header is read: within `limits.max_total_bytes`
    (`too_large`, `fix` appended to the message) and no pickle (`pickle_refused`: save the `what` as safetensors)."""
    if src.size > limits.max_total_bytes:
        raise fail("too_large", f"{name} is {src.size} bytes, above this server's limit of "
                                f"{limits.max_total_bytes} bytes{fix}")
    kind = looks_like_pickle(src.read(0, min(9, src.size)))
    if kind:
        raise fail("pickle_refused", f"pickle weights are refused: save the {what} as safetensors "
                                     f"({name} holds a {kind} file)")


def read_tensor(src: ByteSource, data_start: int, entry: TensorEntry) -> torch.Tensor:
    dtype = DTYPES[entry.dtype][0]
    buf = src.read(data_start + entry.begin, entry.end - entry.begin)
    tensor = torch.frombuffer(buf, dtype=dtype).view(entry.shape)  # owns `buf`; safetensors is little-endian
    if not bool(torch.isfinite(tensor).all()):
        raise fail("non_finite", f"tensor {show(entry.name)} has NaN or infinite values; retrain or fix "
                                  "the adapter")
    return tensor
