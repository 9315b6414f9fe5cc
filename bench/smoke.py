"""Helper, not a benchmark: the tiny random model of the bench scripts' `--smoke` runs.

`--smoke` is each script's smallest run, the one the tests make (tests/system/test_bench_scripts.py): the same code
paths and output lines as a real run, FIGURE lines included, in seconds, on a tiny random Llama with SmolLM2's
tokenizer in place of the embedded SmolLM2. Its figures measure nothing worth recording.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

SMOKE_HELP = ("smoke run (what the tests run): the smallest sizes on a tiny random Llama with SmolLM2's tokenizer, "
              "in seconds; its figures mean nothing")
# A little more than the tests' 2-layer, hidden-64 model: enough compute per token that the ratios the smoke
# tests check (a prefill of 544 tokens against one of 32, say) are not lost in per-step overhead.
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048}
LABEL = f"a tiny random Llama (hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers)"
_made: dict[str, Path] = {}


def model_label(smoke: bool) -> str:
    """The model a run measures, for its header line."""
    return LABEL if smoke else "SmolLM2-135M-Instruct"


def tiny_model(path: Path | None = None) -> Path:
    """Write a tiny random Llama (SHAPE) with SmolLM2's tokenizer beside it into `path` (by
    default a temporary directory removed at exit) and make it the model of every `Settings()` here and in
    child processes (LORAMUX_MODEL); returns its directory. Made once per process: a second call (a script
    that runs another in-process) returns the first one's."""
    if "model" in _made:
        return _made["model"]
    from transformers import AutoTokenizer

    from loramux.model.loader import resolve_model_dir
    from loramux.settings import DEFAULT_MODEL, Settings
    from loramux.testing import save_tiny_hf_model

    if path is None:
        path = Path(tempfile.mkdtemp(prefix="loramux-smoke-model-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL, Path(Settings().cache_dir)))
    save_tiny_hf_model(path, vocab_size=len(tokenizer), tokenizer=tokenizer, **SHAPE)
    os.environ["LORAMUX_MODEL"] = str(path)
    _made["model"] = path
    return path


def tiny_medusa_heads(num_heads: int = 3) -> Path:
    """Random Medusa heads for tiny_model()'s model, in its directory, made the base model's heads
    (LORAMUX_MEDUSA_HEADS; the shipped ones fit SmolLM2 only); returns their directory."""
    import torch

    hidden_size, path = SHAPE["hidden_size"], tiny_model() / "medusa"
    if (path / "medusa_config.json").is_file():
        return path
    from loramux.adapters.formats.medusa import save_medusa_dir

    g = torch.Generator().manual_seed(0)
    blocks = [(torch.randn(hidden_size, hidden_size, generator=g) * 0.02, torch.randn(hidden_size, generator=g) * 0.02)
              for _ in range(num_heads)]
    save_medusa_dir(path, blocks, base_model=str(path))
    os.environ["LORAMUX_MEDUSA_HEADS"] = str(path)
    return path
