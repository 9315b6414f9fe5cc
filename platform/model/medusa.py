"""Where the Medusa heads made for the embedded model ship: a small file in the package, so the default server
speculates with Medusa out of the box (`loramux medusa train --ship` makes it; loramux.engine.speculation.medusa_heads
runs heads)."""
from __future__ import annotations

from pathlib import Path

__all__ = ["shipped_medusa_dir"]


def shipped_medusa_dir() -> Path:
    """The heads directory of the embedded SmolLM2-135M-Instruct (medusa_config.json + medusa_heads.safetensors)."""
    return Path(__file__).parent / "data" / "smollm2-135m-instruct-medusa"
