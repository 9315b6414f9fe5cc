"""Random weights on disk: PEFT LoRA adapters for a model config, and tiny random HF checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

# Where each projection sits in a Llama-style decoder layer (the PEFT tensor names include it).
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
               "qkv_proj": "self_attn", "gate_up_proj": "mlp",  # Phi-3's fused modules
               # a hybrid's linear-attention layers (Qwen3.5; Qwen3-Next fuses in_proj_qkvz and in_proj_ba)
               "in_proj_qkv": "linear_attn", "in_proj_z": "linear_attn", "in_proj_b": "linear_attn",
               "in_proj_a": "linear_attn", "in_proj_qkvz": "linear_attn", "in_proj_ba": "linear_attn",
               "out_proj": "linear_attn"}


def write_peft_adapter(path: Path, model_cfg, rank: int, targets: list[str], seed: int, alpha: float | None = None,
                       use_rslora: bool = False, b_std: float = 0.05, dtype: str = "float32") -> Path:
    """Write a random PEFT LoRA adapter (B non-zero) for a model config, in PEFT's on-disk format; return
    `path`. A ~ N(0, 1/d_in), B ~ N(0, b_std^2), drawn in float32 from `seed` (layer by layer, target by
    target, A then B) and stored as `dtype` (a torch dtype name); lora_alpha defaults to 2 * rank. `targets` are
    the base model's own module names (for Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj); on a hybrid base
    each layer gets those of its kind (linear-attention or attention projections)."""
    import torch
    from safetensors.torch import save_file

    from loramux.adapters.formats.validation import checkpoint_shapes, projection_shapes

    shapes = {**projection_shapes(model_cfg), **checkpoint_shapes(model_cfg)}
    g, weight_dtype, tensors = torch.Generator().manual_seed(seed), getattr(torch, dtype), {}
    linear = model_cfg.linear_attention.layers if model_cfg.linear_attention is not None \
        else (False,) * model_cfg.num_layers
    for layer in range(model_cfg.num_layers):
        for target in targets:
            if PROJECTIONS[target] != "mlp" and (PROJECTIONS[target] == "linear_attn") != linear[layer]:
                continue
            d_in, d_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[target]}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in, generator=g) / d_in**0.5).to(weight_dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank, generator=g) * b_std).to(weight_dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": list(targets), "use_rslora": use_rslora, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "base_model_name_or_path": None}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def save_tiny_hf_model(path: Path, vocab_size: int, model_type: str = "llama", seed: int = 0, *,
                       weight_scale: float = 1.0, tokenizer=None, **overrides):
    """Write a small random HF checkpoint (safetensors) of the given family; return the HF model. Defaults:
    2 layers, hidden 64, intermediate 128, 4 heads (2 KV heads), 512 positions, untied embeddings;
    `overrides` replace any config field. Biases (where the family has them) are random, not zero, and so
    are norm weights (HF starts them at 1, or 0 for Gemma's 1 + w), so a norm loaded wrong shows.
    `weight_scale` multiplies every matrix (random init is small: x8 makes greedy tokens differ between
    prompts); `tokenizer`, when given, is saved beside the weights, which makes the directory servable."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return _perturb_and_save(model, path, weight_scale, tokenizer)


def _perturb_and_save(model, path: Path, weight_scale: float, tokenizer):
    """Random biases (HF zero-initialises them; random ones make the bias path observable), noisy norm weights,
    matrices times `weight_scale`; save the model (and the tokenizer beside it) and return it."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
            elif param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            elif weight_scale != 1.0:
                param.mul_(weight_scale)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def save_tiny_multimodal_model(path: Path, vocab_size: int, model_type: str, seed: int = 0, *,
                               weight_scale: float = 1.0, tokenizer=None, **text_overrides):
    """Write a small random multimodal checkpoint, `qwen3_5` (Qwen3_5ForConditionalGeneration) or `gemma3`
    (Gemma3ForConditionalGeneration), with a one-layer vision tower; return the HF model. Its language model is
    as save_tiny_hf_model's (4 layers for qwen3_5 with linear-attention shapes, 6 for gemma3 with a window of 8),
    `text_overrides` replacing any text_config field; weights are perturbed and scaled as there."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2)
    if model_type == "qwen3_5":
        text.update(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    elif model_type == "gemma3":
        text.update(num_hidden_layers=6, sliding_window=8)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                      patch_size=8)
    else:
        raise ValueError(f"no tiny multimodal recipe for {model_type!r} (qwen3_5, gemma3)")
    text.update(text_overrides)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    return _perturb_and_save(model, path, weight_scale, tokenizer)
