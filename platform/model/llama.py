"""The decoder of every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, the mixture-of-experts
families of loramux.model.moe and the hybrids of loramux.model.linear_attention) over a paged KV cache.

The Llama layer is the default; what a family changes is read from `ModelConfig` (see its table): q/k norms,
(1 + w) norms, sandwich norms, GeGLU, scaled embeddings, soft-capping, per-layer windows and RoPE.

The engine owns the tokens' layout: `forward` takes a flat batch of tokens from many sequences with
their absolute positions and the attention metadata that says where each one's KV lives. q/k/v and
gate/up run as single merged matmuls; `MergedLinear.slices` records the sub-projections so weight
loading (and LoRA) can address q, k, v, gate and up separately.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loramux.model import cpu_linear, quantization
from loramux.model.attention import AttentionMetadata, KVCache, paged_attention
from loramux.model.config import ModelConfig
from loramux.model.linear_attention import LINEAR_PROJECTION_SLICES, GatedDeltaNet
from loramux.model.moe import EXPERT_MODULES, ExpertProjection, MoEBlock
from loramux.model.rope import RotaryEmbedding, apply_rope
from loramux.model.slices import slice_bounds

if TYPE_CHECKING:
    from loramux.kernels.wrapper import LoRAWrapper

# HF / PEFT projection name -> (merged module path inside a decoder layer, slice name): the one map from
# checkpoint and adapter names to this model's merged q/k/v and gate/up projections. "router" is the router of a
# mixture-of-experts layer (HF `mlp.gate`, gpt-oss `mlp.router`): a LoRA on it changes its rows' routing.
PROJECTION_SLICES: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", "o"),
    "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", "down"), "router": ("mlp.router", "router"),
    **LINEAR_PROJECTION_SLICES,  # a hybrid's linear-attention layers (Qwen3.5, Qwen3-Next)
}
# The merged projections of a decoder layer that LoRA adapters can target, in forward order.
LORA_MODULES: tuple[str, ...] = tuple(dict.fromkeys(path for path, _ in PROJECTION_SLICES.values()))


class ProjectionLoRA(Protocol):
    """What a projection calls after its matmul to add the step's adapter deltas into y: the LoRA wrapper,
    or the static one a captured decode graph swaps in (loramux.kernels.bgmv.StaticLoRA)."""

    def apply(self, y: torch.Tensor, x: torch.Tensor, key: tuple[int, str] | None) -> torch.Tensor: ...


class MergedLinear(nn.Module):
    """y = x @ W (+ b) where the columns of W stack named output slices, e.g. q, k, v.

    W is stored transposed relative to nn.Linear, as [in_features, out_features]: on CPU, small-batch
    decode matmuls run about 2x faster in this layout (measured: docs/performance.md), and on GPU it
    costs nothing. On CPU, `pack_for_cpu` may swap W for oneDNN's packed layout (see cpu_linear);
    `quantize_int8` swaps it for int8 weights with per-channel scales (see quantization).
    """

    def __init__(self, in_features: int, slices: tuple[tuple[str, int], ...], bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.slices = slices
        self.out_features = sum(size for _, size in slices)
        self.weight = nn.Parameter(torch.empty(in_features, self.out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None  # oneDNN layout, when packed for CPU
        self.int8: quantization.Int8Linear | None = None  # int8 weights (and bias), when quantized
        # float32 [out_features]: ||W[:, o]|| per output channel, kept when packing drops W (DoRA's norms need it)
        self.column_norms: torch.Tensor | None = None
        # Set by the device adapter pool: the shared LoRA wrapper and this projection's key for it.
        self.lora_key: tuple[int, str] | None = None
        self.lora_wrapper: ProjectionLoRA | None = None

    def slice_range(self, name: str) -> tuple[int, int]:
        """Columns [start, end) of W (and entries of b) that belong to slice `name`."""
        return slice_bounds(self.slices, name)

    def pack_for_cpu(self, batch_hint: int) -> bool:
        """Replace W by oneDNN's packed layout where oneDNN is usable; W is then dropped (None)."""
        w = self.weight
        if w.device.type != "cpu" or not cpu_linear.can_pack(w.shape[0], w.shape[1], w.dtype, batch_hint):
            return False
        self.column_norms = torch.linalg.vector_norm(w.data, dim=0, dtype=torch.float32)
        self.packed_dtype = w.dtype
        self.packed_weight = cpu_linear.pack(w.data, batch_hint)
        self.weight = None
        return True

    def weight_column_norms(self) -> torch.Tensor:
        """float32 [out_features]: the L2 norm of each output channel's weights (a column of W as stored)."""
        if self.weight is not None:
            return torch.linalg.vector_norm(self.weight, dim=0, dtype=torch.float32)
        if self.column_norms is None:
            raise ValueError("this layer's float weights are gone (int8): its weight norms are unknown")
        return self.column_norms

    def weight_matmul(self, a: torch.Tensor) -> torch.Tensor:
        """a @ W without bias, float32 [rows, out_features], for a [rows, in_features] in any float dtype,
        whatever W's layout (plain or oneDNN-packed); int8 layers raise ValueError (their W is not the float one)."""
        if self.weight is not None:
            return a.float() @ self.weight.float()
        if self.packed_weight is not None:
            return cpu_linear.packed_linear(a.to(self.packed_dtype), self.packed_weight, None).float()
        raise ValueError("this layer's float weights are gone (int8)")

    def quantize_int8(self, kernel: str) -> None:
        """Replace W (and b) by int8 weights computed through `kernel`; W is then dropped (None)."""
        self.int8 = quantization.Int8Linear(self.weight.data, None if self.bias is None else self.bias.data, kernel)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            y = self.int8(x)
        elif self.packed_weight is not None:
            y = cpu_linear.packed_linear(x, self.packed_weight, self.bias)
        elif self.bias is None:
            y = x @ self.weight
        else:
            y = torch.addmm(self.bias, x, self.weight)
        if self.lora_wrapper is not None:
            self.lora_wrapper.apply(y, x, self.lora_key)
        return y


class RMSNorm(nn.Module):
    """x / rms(x) * w. With `offset` (Gemma) the checkpoint stores w - offset: the loader adds it back, and the
    weight stays float32 whatever the model's dtype, so (1 + w) is as exact as in HF's float32 arithmetic."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # float32 statistics, as HF does, so low-precision runs stay close to the reference.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * self.weight.float()).to(x.dtype)  # Gemma scales in float32, then casts
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Qwen3.5 / Qwen3-Next: q_proj yields per head [q, output gate], so its slice is twice the q width.
        self.output_gate = cfg.attn_output_gate
        q_width = 2 * cfg.q_size if self.output_gate else cfg.q_size
        self.qkv_proj = MergedLinear(cfg.hidden_size, (("q", q_width), ("k", cfg.kv_size), ("v", cfg.kv_size)),
                                     bias=cfg.attention_bias)
        self.o_proj = MergedLinear(cfg.q_size, (("o", cfg.hidden_size),), bias=cfg.o_bias)
        # Norms of q and k before RoPE: per head (Qwen3, Gemma 3), or over the whole projection (OLMoE).
        q_width, k_width = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.qk_norm_whole = cfg.qk_norm_whole
        self.clip_qkv = cfg.clip_qkv
        # gpt-oss: a learned logit per head joins every softmax's denominator (attention "sinks").
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attention_sinks else None
        self.scale = cfg.attn_scale
        self.window = cfg.layer_windows[layer]
        self.softcap = cfg.attn_softcap
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.output_gate:
            return self._gated(qkv, cos, sin, k_cache, v_cache, meta)
        if self.qk_norm_whole:  # OLMoE: norm q and k as whole projections, then clip, before the heads split
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        heads = qkv.view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk = heads[:, : self.num_heads + self.num_kv_heads]
        if self.q_norm is not None and not self.qk_norm_whole:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        # q and k heads are adjacent in the merged output: rotate them in one go.
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = heads[:, self.num_heads + self.num_kv_heads:]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap, self.sinks)
        return self.o_proj(o.reshape(t, self.q_size))

    def _gated(self, qkv, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        """Attention whose q_proj also yields a gate per head: o_proj(attention * sigmoid(gate))."""
        t, hd = qkv.shape[0], self.head_dim
        q_gate, k, v = qkv.split((2 * self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, gate = q_gate.view(t, self.num_heads, 2 * hd).split(hd, dim=-1)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k.view(t, self.num_kv_heads, hd)), cos, sin)
        o = paged_attention(q, k, v.view(t, self.num_kv_heads, hd), k_cache, v_cache, meta, self.scale, self.window,
                            self.softcap, self.sinks)
        return self.o_proj(o.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, (("gate", width), ("up", width)))
        self.down_proj = MergedLinear(width, (("down", cfg.hidden_size),))
        self.intermediate_size = width
        self.gelu = cfg.hidden_act != "silu"  # GeGLU (Gemma): gelu with the tanh approximation

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; with `sandwich_norms` (Gemma) the attention and MLP outputs are normed too
    before they join the residual, and `post_attention_layernorm` is the attention's output norm."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        linear = cfg.linear_attention
        # A hybrid's layer mixes tokens with Gated DeltaNet (per-sequence state) or with attention (paged KV);
        # `cache_index` is its index into LinearStates or into the KV cache's layers.
        self.is_linear = linear is not None and linear.layers[layer]
        if self.is_linear:
            assert linear is not None
            self.cache_index = sum(linear.layers[:layer])
            self.linear_attn = GatedDeltaNet(cfg, self.cache_index)
        else:
            self.cache_index = cfg.attention_layers.index(layer)
            self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = norm()
        self.mlp = MoEBlock(cfg, layer) if cfg.moe is not None and cfg.moe.sparse_layers[layer] else MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, cos, sin, kv: KVCache, meta):
        if self.is_linear:
            assert kv.states is not None and meta.states is not None
            attn = self.linear_attn(self.input_layernorm(x), kv.states, meta.states)
        else:
            i = self.cache_index
            attn = self.self_attn(self.input_layernorm(x), cos, sin, kv.k[i], kv.v[i], meta)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaModel(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` projects chosen rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        # With tied embeddings the transposed LM head doubles as the embedding table (columns = tokens).
        self.lm_head = MergedLinear(cfg.hidden_size, (("vocab", cfg.vocab_size),))
        self.embed_tokens = None if cfg.tie_word_embeddings else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if self.embed_tokens is not None:
            self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        # One table per distinct RoPE (Gemma 3: local and global layers differ); each layer names its own.
        specs = list(dict.fromkeys(cfg.layer_ropes))
        positions = max_positions or cfg.max_position_embeddings
        ropes = [RotaryEmbedding(s.rotary_dim, s.theta, s.scaling, positions) for s in specs]
        self.ropes = nn.ModuleList(ropes)
        self.layer_rope = [specs.index(s) for s in cfg.layer_ropes]
        self.rope = ropes[self.layer_rope[-1]]
        self.embed_scale = cfg.embed_scale
        self.final_softcap = cfg.final_softcap
        # Set by the device adapter pool: the LoRA wrapper, for adapters that change the embedding or the head.
        self.lora_wrapper: LoRAWrapper | None = None

    def projection(self, layer: int, path: str) -> MergedLinear:
        """The merged projection at `path` (one of LORA_MODULES) of decoder layer `layer`."""
        module = self.layers[layer].get_submodule(path)
        assert isinstance(module, MergedLinear), path
        return module

    def lora_modules(self) -> Iterator[tuple[int, str, MergedLinear]]:
        """(layer index, module path, MergedLinear) of every projection an adapter can target: a sparse layer of
        a mixture-of-experts model has its router instead of a dense MLP (its experts: see `expert_modules`), and a
        hybrid's linear-attention layer its `linear_attn` projections instead of attention's."""
        for index in range(len(self.layers)):
            for path in self.layer_lora_paths(index):
                yield index, path, self.projection(index, path)

    def layer_lora_paths(self, layer: int) -> tuple[str, ...]:
        """The LORA_MODULES paths layer `layer` has."""
        sparse = isinstance(self.layers[layer].mlp, MoEBlock)
        mixer = "linear_attn." if self.layers[layer].is_linear else "self_attn."
        return tuple(path for path in LORA_MODULES
                     if (path.startswith(mixer) if not path.startswith("mlp.") else sparse == (path == "mlp.router")))

    def expert_modules(self) -> Iterator[tuple[int, str, ExpertProjection]]:
        """(layer index, path, ExpertProjection) of every routed-expert projection (sparse layers only)."""
        for index, layer in enumerate(self.layers):
            if isinstance(layer.mlp, MoEBlock):
                for path in EXPERT_MODULES:
                    module = layer.get_submodule(path)
                    assert isinstance(module, ExpertProjection), path
                    yield index, path, module

    def untie_embedding(self) -> None:
        """Give a tied embedding its own float rows, so the LM head's W may change layout or be dropped."""
        if self.embed_tokens is None:
            table = self.lm_head.weight.data.t().contiguous()
            self.embed_tokens = nn.Embedding(table.shape[0], table.shape[1], _weight=table, _freeze=True)

    def pack_for_cpu(self, batch_hint: int = 8) -> int:
        """Pack every linear layer oneDNN can take (see cpu_linear); returns how many were packed."""
        self.untie_embedding()
        packable = (MergedLinear, ExpertProjection)
        return sum(m.pack_for_cpu(batch_hint) for m in self.modules() if isinstance(m, packable))

    def quantize_int8(self, kernel: str) -> int:
        """int8 weights for every linear layer, the LM head included (see quantization); returns how many.

        The embedding keeps float rows: a lookup reads only a few of them, while the head reads all each step.
        """
        self.untie_embedding()
        layers = [m for m in self.modules() if isinstance(m, MergedLinear)]
        for layer in layers:
            layer.quantize_int8(kernel)
        return len(layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.embed_tokens is None:
            x = self.lm_head.weight.index_select(1, input_ids).t()  # tied, unpacked: columns are tokens
        else:
            x = self.embed_tokens(input_ids)
        if self.lora_wrapper is not None and self.lora_wrapper.embeds:  # adapters' embedding changes, then the scale
            x = self.lora_wrapper.embed(x, input_ids, self.embed_scale)
        elif self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the model's dtype, as HF does
        rope_lens = _rope_lens(positions, meta) if any(r.long_after is not None for r in self.ropes) else None
        tables = [rope.cos_sin(positions, rope_lens) for rope in self.ropes]
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self.layer_rope[i]]
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lora_wrapper is not None and self.lora_wrapper.replaces_logits:  # adapters' trained heads
            logits = self.lora_wrapper.logits(hidden, self.lm_head)
        else:
            logits = self.lm_head(hidden)
        if self.final_softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _rope_lens(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Per row, the sequence length LongRoPE chooses its factors by (see PrefillChunk.rope_len)."""
    lens = positions + 1
    for chunk in meta.prefills:
        if chunk.rope_len is not None:
            lens[chunk.start:chunk.end] = chunk.rope_len
    return lens
