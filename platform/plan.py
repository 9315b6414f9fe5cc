"""Memory planning: weights + KV cache + the adapter pool for a model, context, batch and pool size."""
from __future__ import annotations

import re
from dataclasses import dataclass

from loramux.model.config import ModelConfig

EXPERT_SCALE_BYTES = 4  # the device pool's float32 LoRA scale per (sparse layer, expert projection, expert)
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'24GiB', '512MB', '1.5g', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 24GiB, 512MB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@dataclass
class MemoryPlan:
    weights: int
    kv_per_token: int
    kv_cache: int
    adapter_bytes: int  # one adapter of the planned rank on every projection (a sparse layer's: attention only)
    adapter_pool: int
    head_bytes: int = 0  # what a fully trained lm_head or embed_tokens (modules_to_save) adds to an adapter
    medusa_bytes: int = 0  # one set of Medusa heads (3 by default), per base model or adapter version using one
    draft_weights: int = 0  # a draft model's weights (LORAMUX_DRAFT_MODEL)
    draft_kv: int = 0  # ... and its own paged KV pool (LORAMUX_DRAFT_KV_CACHE_BYTES)
    # A mixture-of-experts base: what one adapter's LoRA on the routed experts at the planned rank adds (0 for a
    # dense model); counted in each adapter (`slot_bytes`) when the plan is for expert LoRA (`expert_lora`).
    expert_lora_bytes: int = 0
    expert_lora: bool = False
    # A hybrid base: one sequence's fixed-size linear-attention state (conv windows + float32 recurrent matrices)
    # and the batch's (0 for other models); held beside the KV of its attention layers, whatever the context.
    state_per_sequence: int = 0
    state_pool: int = 0

    @property
    def slot_bytes(self) -> int:
        """One planned adapter in the device pool: `adapter_bytes`, plus `expert_lora_bytes` with `expert_lora`."""
        return self.adapter_bytes + (self.expert_lora_bytes if self.expert_lora else 0)

    @property
    def adapters_fit(self) -> int:
        """Adapters of the planned rank (every projection, and the experts with `expert_lora`) the pool holds;
        more at lower ranks."""
        return self.adapter_pool // self.slot_bytes if self.slot_bytes else 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.state_pool + self.adapter_pool + self.draft_weights + self.draft_kv


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, quantization: str = "none") -> int:
    """Bytes of the base weights: parameters x bytes (a mixture-of-experts model's every expert included), or
    with int8 quantization, 1 byte per linear-layer parameter (the LM head included) plus a float32 scale per
    output channel, the rest (embedding, norms, biases, routed experts) at `dtype_bytes`. A tied embedding then
    counts twice: float rows for the lookup, int8 for the head."""
    if quantization == "none":
        return cfg.num_parameters() * dtype_bytes
    if quantization != "int8":
        raise ValueError(f"quantization {quantization!r} is not one of none, int8")
    h, v = cfg.hidden_size, cfg.vocab_size
    linear = scales = 0
    for layer in range(cfg.num_layers):
        for d_in, d_out in _int8_linears(cfg, layer):
            linear += d_in * d_out
            scales += d_out
    float_params = cfg.num_parameters() - linear - (0 if cfg.tie_word_embeddings else v * h)
    return float_params * dtype_bytes + linear + v * h + 4 * (scales + v)


def _int8_linears(cfg: ModelConfig, layer: int) -> list[tuple[int, int]]:
    """(d_in, d_out) of each linear layer of decoder layer `layer` that int8 quantization converts: attention,
    and the dense MLP; in a sparse layer the router and the shared expert with its gate instead, the routed
    experts staying in the model's dtype (they are grouped matmuls, not linear layers)."""
    h, moe, linear = cfg.hidden_size, cfg.moe, cfg.linear_attention
    if linear is not None and linear.layers[layer]:  # a hybrid's linear-attention layer: in_proj, out_proj
        out = [(h, sum(width for _, width in linear.in_proj_slices())), (linear.value_dim, h)]
    else:
        q_out = (2 if cfg.attn_output_gate else 1) * cfg.q_size
        out = [(h, q_out + 2 * cfg.kv_size), (cfg.q_size, h)]  # qkv, o
    if moe is None or not moe.sparse_layers[layer]:
        return [*out, (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]  # gate_up, down
    out.append((h, moe.num_experts))  # router
    if moe.shared_expert_size:
        s = moe.shared_expert_size
        out += [(h, 2 * s), (s, h), (h, 1)]  # shared expert gate_up, down, and its sigmoid gate
    return out


def expert_lora_bytes(cfg: ModelConfig, rank: int, dtype_bytes: int) -> int:
    """Device bytes of one adapter's LoRA on the routed experts at `rank` on gate_up and down (0 for a dense
    model): `MoESpec.lora_bytes`, what the device pool's slot holds."""
    if cfg.moe is None or rank <= 0:
        return 0
    return cfg.moe.lora_bytes(cfg.hidden_size, {"gate_up": rank, "down": rank}, dtype_bytes, EXPERT_SCALE_BYTES)


def kv_tokens_held(cfg: ModelConfig, context_len: int, block_size: int = 16) -> int:
    """KV tokens one sequence of `context_len` holds. A model windowed on every layer (Mistral v0.1) gives back
    the blocks that left the window, keeping at most the window plus two blocks (the partial blocks at either
    end); a model with any global layer (Gemma's mix, Llama, Qwen) holds every layer at every token, local
    layers included, since the paged cache has one block table per sequence for all layers."""
    window = cfg.sliding_window
    return context_len if window is None else min(context_len, window + 2 * block_size)


def plan_memory(cfg: ModelConfig, dtype_bytes: int, context_len: int, batch_size: int, adapter_pool: int,
                adapter_rank: int, quantization: str = "none", block_size: int = 16) -> MemoryPlan:
    """weights: see `weight_bytes`; KV per token = 2 x layers x kv_heads x head_dim x bytes, times the
    tokens a sequence holds (`kv_tokens_held`; a hybrid's attention layers only, its linear layers holding a fixed
    `state_per_sequence` instead); an adapter = rank x sum over the 7 projections of (d_in + d_out) x layers x
    bytes (a hybrid's linear layers: their input projection's slices and out_proj; the device pool holds each
    adapter at its own rank, so this is exact for one targeting every projection). A mixture-of-experts layer has
    no dense MLP, so there an adapter covers the 4 attention projections only; `expert_lora_bytes` is what LoRA on
    its routed experts adds (set the plan's `expert_lora` to count it in each adapter)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q_out = (2 if cfg.attn_output_gate else 1) * cfg.q_size  # Qwen3.5's q_proj also yields the output gate
    attention = [(h, q_out), (h, cfg.kv_size), (h, cfg.kv_size), (cfg.q_size, h)]
    mlp = [(h, i), (h, i), (i, h)]
    dense_layers = cfg.num_layers - (cfg.moe.num_sparse_layers if cfg.moe is not None else 0)
    linear = cfg.linear_attention
    # a hybrid's linear-attention layers: their input projections' slices and out_proj instead of attention
    mixers = sum(a + b for a, b in attention) * len(cfg.attention_layers)
    if linear is not None:
        mixers += (sum(h + width for _, width in linear.in_proj_slices()) + linear.value_dim + h) \
            * linear.num_linear_layers
    per_slot = adapter_rank * dtype_bytes * (mixers + sum(a + b for a, b in mlp) * dense_layers)
    kv_token = cfg.kv_bytes_per_token(dtype_bytes)
    state = cfg.state_bytes_per_sequence(dtype_bytes)
    return MemoryPlan(
        weights=weight_bytes(cfg, dtype_bytes, quantization),
        kv_per_token=kv_token,
        kv_cache=kv_token * kv_tokens_held(cfg, context_len, block_size) * batch_size,
        adapter_bytes=per_slot,
        adapter_pool=adapter_pool,
        # the device pool holds it whole (adapters/residency/head_slots.py)
        head_bytes=cfg.vocab_size * h * dtype_bytes,
        medusa_bytes=medusa_heads_bytes(cfg, dtype_bytes),
        expert_lora_bytes=expert_lora_bytes(cfg, adapter_rank, dtype_bytes),
        state_per_sequence=state,
        state_pool=state * batch_size,
    )


def medusa_heads_bytes(cfg: ModelConfig, dtype_bytes: int, num_heads: int = 3) -> int:
    """Device bytes of one set of Medusa-1 heads: per head an H x H block and its bias (the LM head is shared)."""
    h = cfg.hidden_size
    return num_heads * (h * h + h) * dtype_bytes
