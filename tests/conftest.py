"""Shared fixtures: the embedded SmolLM2 (converted once into the cache dir) and tiny random Llamas."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors (set before import)

from loramux.engine.engine import EngineConfig, LLMEngine
from loramux.model.loader import build_model, end_of_turn_ids, resolve_model_dir
from loramux.settings import DEFAULT_MODEL, Settings

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """HF-style directory of the embedded SmolLM2-135M-Instruct (GGUF converted on first use)."""
    return resolve_model_dir(DEFAULT_MODEL, Path(Settings().cache_dir))


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def save_tiny_hf_model(path: Path, vocab_size: int, model_type: str = "llama", seed: int = 0, **overrides):
    """Write a small random HF checkpoint (safetensors) of the given family; return the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF zero-initialises biases; random ones make the bias path observable
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer random Llama with the SmolLM2 vocabulary, so the real tokenizer detokenises its output."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(path, vocab_size=len(tokenizer))
    return path


def make_engine(model_dir: Path, tokenizer, **config) -> LLMEngine:
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    engine_config = EngineConfig(**{"num_blocks": 256, "block_size": 16, "max_num_seqs": 32,
                                    "max_num_batched_tokens": 256, "max_model_len": 512, **config})
    return LLMEngine(model, tokenizer, engine_config, end_of_turn_ids(tokenizer, cfg, model_dir))


@pytest.fixture
def tiny_engine(tiny_dir, tokenizer) -> LLMEngine:
    return make_engine(tiny_dir, tokenizer)


PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_peft_adapter(path: Path, model_cfg, rank: int, targets: list[str], seed: int, alpha: float | None = None,
                       use_rslora: bool = False, b_std: float = 0.05) -> Path:
    """Write a random PEFT LoRA adapter (B non-zero) for a model config, in PEFT's on-disk format."""
    import json

    from safetensors.torch import save_file

    from loramux.adapters.peft_format import projection_shapes

    shapes = projection_shapes(model_cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_cfg.num_layers):
        for target in targets:
            d_in, d_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * b_std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": targets, "use_rslora": use_rslora, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "base_model_name_or_path": None}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
