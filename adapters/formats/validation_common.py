"""What every adapter upload check shares: the error types, the upload's file names and its size limits.

Import these names from `loramux.adapters.formats.validation` (which re-exports them); this module exists so that
the safetensors parser (`safetensors_header`) and the config and weight checks (`validation`) can share them.
"""
from __future__ import annotations

from dataclasses import dataclass

ALLOWED_FILENAMES = ("adapter_config.json", "adapter_model.safetensors")
CONFIG_FILE, WEIGHTS_FILE = ALLOWED_FILENAMES


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
    max_head_bytes: int | None = None  # embedding / head tensors (modules_to_save, ...) cap; None: none
    head_limit_source: str = "LORAMUX_MAX_ADAPTER_HEAD_BYTES"  # what sets max_head_bytes, named in the refusal


def fail(code: str, message: str) -> AdapterValidationError:
    return AdapterValidationError(code, message)


def show(value, limit: int = 120) -> str:
    """repr() of a client-given value, cut short so a hostile name cannot blow up a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"
