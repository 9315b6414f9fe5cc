"""One Settings object for the whole platform, read from `LORAMUX_*` environment variables."""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loramux"


class Settings(BaseSettings):
    """Runtime configuration. Every field can be set as `LORAMUX_<FIELD>` (e.g. LORAMUX_DTYPE=bfloat16)."""

    model_config = SettingsConfigDict(env_prefix="LORAMUX_", extra="ignore")

    # Base model: the embedded default name, an HF directory of safetensors, or a .gguf file.
    model: str = DEFAULT_MODEL
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto = cuda if available else cpu

    # Engine sizing.
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2  # memory budget for the paged KV pool
    max_num_seqs: int = 64  # most sequences in one batch
    max_num_batched_tokens: int = 512  # token budget per step: bounds how long a prefill chunk stalls decodes
    max_model_len: int = 4096

    # LoRA adapters: device slots (distinct adapters in one batch) and the largest rank they hold.
    max_loras: int = 8
    max_lora_rank: int = 32
    # Adapters to load at start, "name=dir,name2=dir2" (a local source until the SQL registry lands).
    adapters: str = ""

    def adapter_dirs(self) -> dict[str, str]:
        """Parse `adapters` into {name: directory}; raise ValueError naming the bad entry."""
        result = {}
        for entry in filter(None, (e.strip() for e in self.adapters.split(","))):
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"LORAMUX_ADAPTERS entry {entry!r} must look like name=/path/to/adapter")
            result[name.strip()] = path.strip()
        return result

    # Server.
    host: str = "127.0.0.1"
    port: int = 8000


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
