"""Architecture description of a decoder, read from an HF `config.json`.

One decoder implementation (loramux.model.llama) serves every supported family; `ModelConfig` records
what a family changes relative to Llama, so a family is a few fields here rather than a copy of the model:

| family (model_type) | what differs from Llama                                                              |
|---------------------|--------------------------------------------------------------------------------------|
| mistral             | `sliding_window` on every layer (v0.1), none in later versions                        |
| qwen2               | q/k/v bias; optional sliding window on layers >= `max_window_layers`                  |
| qwen3               | per-head RMSNorm on q and k, explicit `head_dim`                                      |
| gemma2              | embedding x sqrt(hidden), RMSNorm (1 + w), GeGLU (tanh), norms around attention and    |
|                     | MLP, `query_pre_attn_scalar`, attention and final logit soft-capping, sliding layers  |
| gemma3_text         | as Gemma 2 plus q/k norms, 5 sliding layers to 1 global with their own RoPE bases      |
| phi3                | fused `qkv_proj` / `gate_up_proj` in checkpoint and adapters, LongRoPE, partial rotary |
| qwen3_moe           | as Qwen3, with routed experts (`MoESpec`) in the layers `decoder_sparse_step` /       |
|                     | `mlp_only_layers` leave sparse                                                        |
| qwen2_moe           | q/k/v bias, routed experts plus a shared expert behind a sigmoid gate                  |
| mixtral             | routed experts (top-k renormalised), optional sliding window                           |
| olmoe               | q/k RMSNorm over the whole projection (not per head), routed experts                  |
| gpt_oss             | q/k/v/o bias, attention sinks, sliding / full layers, YaRN RoPE, routed experts with   |
|                     | biases, router bias and softmax after top-k, clamped SwiGLU with interleaved gate/up  |
| qwen3_5_text        | hybrid: Gated DeltaNet layers (`LinearAttentionSpec`) between full-attention layers,   |
|                     | whose q_proj also yields a sigmoid output gate; RMSNorm (1 + w), q/k norms, partial   |
|                     | rotary                                                                                 |
| qwen3_next          | as qwen3_5_text with fused `in_proj_qkvz` / `in_proj_ba`, and routed experts plus a    |
|                     | shared expert behind a sigmoid gate                                                    |

Multimodal checkpoints (`MULTIMODAL_MODEL_TYPES`: Gemma 3 4B and up, Qwen3.5) serve their language model: the
config's `text_config` is read as that family's, and `multimodal` records the wrapper (its weights sit under
`model.language_model.`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_next")
# Families whose layers mix Gated DeltaNet linear attention (a fixed-size state per sequence) with full attention.
HYBRID_MODEL_TYPES = ("qwen3_5_text", "qwen3_next")
# Multimodal checkpoints whose language model is served (images are not): wrapper model_type -> text model_type.
MULTIMODAL_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", *MOE_MODEL_TYPES,
                         "qwen3_5_text", *MULTIMODAL_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
# The activation of the MLP's gate, by HF name.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture this engine does not implement."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base `theta`, frequency `scaling` (None = plain RoPE; else a dict with
    `rope_type` linear / llama3 / longrope and its parameters) and how many of the head's dims rotate."""

    theta: float
    scaling: dict[str, Any] | None
    rotary_dim: int

    def __hash__(self) -> int:
        return hash((self.theta, repr(self.scaling), self.rotary_dim))


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a mixture-of-experts family (see loramux.model.moe for the computation).

    Each sparse layer's MLP is `num_experts` SwiGLU experts of width `intermediate_size`; a router picks
    `top_k` of them per token and the layer returns the routing-weighted sum of their outputs.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's hidden width (`moe_intermediate_size`, or `intermediate_size`)
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the family's dense MLP
    norm_topk_prob: bool = False  # renormalise the top-k softmax probabilities to sum to 1
    # gpt-oss: top-k of the router logits first, then a softmax over those k (in the logits' dtype)
    softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False  # gpt-oss: a bias per expert on gate_up and on down
    # The expert activation: "silu" (act(gate) * up) or "swiglu_clamp" (gpt-oss's clamped SwiGLU:
    # gate clamped to <= limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_size: int = 0  # Qwen2-MoE / Qwen3-Next: a dense expert every token takes, sigmoid-gated
    router_name: str = "gate"  # the router's module name in checkpoints (`mlp.gate`, gpt-oss `mlp.router`)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def lora_bytes(self, hidden: int, ranks: dict[str, int], element: int, scale_bytes: int = 4) -> int:
        """Device bytes of one adapter's LoRA on the routed experts, as the adapter pool holds it: for every sparse
        layer, expert and covered projection ("gate_up": hidden -> 2 x width, "down": width -> hidden; `ranks`
        gives each one's rank), rank x (in + out) weights of `element` bytes and one float32 scale."""
        shapes = {"gate_up": (hidden, 2 * self.intermediate_size), "down": (self.intermediate_size, hidden)}
        per_expert = sum(rank * (shapes[name][0] + shapes[name][1]) * element + scale_bytes
                         for name, rank in ranks.items())
        return self.num_sparse_layers * self.num_experts * per_expert

    def expert_parameters(self, hidden: int) -> int:
        """Weights (and biases) of one expert."""
        return 3 * hidden * self.intermediate_size + (2 * self.intermediate_size + hidden if self.expert_bias else 0)


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers of a hybrid family (see loramux.model.linear_attention for the computation).

    Each such layer keeps, per sequence, a causal-conv window (the last `conv_kernel - 1` inputs of its q/k/v
    convolution, in the model's dtype) and a recurrent matrix per value head ([key_head_dim, value_head_dim], in
    float32 as the reference keeps it) instead of a KV cache that grows with the sequence.
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention
    fused_projections: bool = False  # Qwen3-Next: `in_proj_qkvz` / `in_proj_ba` interleaved per key head

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return sum(self.layers)

    def in_proj_slices(self) -> tuple[tuple[str, int], ...]:
        """The output slices of a linear layer's merged input projection, in checkpoint column order."""
        if self.fused_projections:
            return (("qkvz", 2 * self.key_dim + 2 * self.value_dim), ("ba", 2 * self.num_value_heads))
        heads = self.num_value_heads
        return (("qkv", self.conv_dim), ("z", self.value_dim), ("b", heads), ("a", heads))

    def state_bytes(self, element: int) -> int:
        """Bytes of one sequence's state over every linear layer: the conv window in `element`-byte values and the
        float32 recurrent matrices."""
        conv = self.conv_dim * (self.conv_kernel - 1) * element
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return self.num_linear_layers * (conv + recurrent)

    def parameters(self, hidden: int) -> int:
        """Weights of one linear-attention layer: projections, conv, decay parameters and the gated norm."""
        projections = hidden * (self.conv_dim + self.value_dim + 2 * self.num_value_heads) + self.value_dim * hidden
        return projections + self.conv_dim * self.conv_kernel + 2 * self.num_value_heads + self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2 style)
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    # --- what families change (defaults: Llama) ---
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 1 for Gemma, whose checkpoints store w - 1
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # Gemma: norms after attention and before/after the MLP as well
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window (tokens seen, itself included)
    layer_ropes: tuple[RopeSpec, ...] = ()  # per layer: its rotary embedding
    fused_projections: bool = False  # Phi-3: `qkv_proj` and `gate_up_proj` in checkpoint and adapters
    o_bias: bool = False  # a bias on the attention's output projection too (gpt-oss)
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    qk_norm_whole: bool = False  # OLMoE: q/k RMSNorm over the whole projection instead of each head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    moe: MoESpec | None = None  # routed experts (mixture-of-experts families); None for dense models
    linear_attention: LinearAttentionSpec | None = None  # Gated DeltaNet layers (hybrid families); None: none
    attn_output_gate: bool = False  # q_proj yields [q, gate] per head; the output is scaled by sigmoid(gate)
    multimodal: str | None = None  # the multimodal wrapper's model_type whose language model this is, or None

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if not self.layer_ropes:
            spec = RopeSpec(self.rope_theta, self.rope_scaling, self.head_dim)
            object.__setattr__(self, "layer_ropes", (spec,) * self.num_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer has the same one (Mistral v0.1); None if any layer is global."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache: all of them, but a hybrid's full-attention layers only."""
        linear = self.linear_attention.layers if self.linear_attention is not None else (False,) * self.num_layers
        return tuple(i for i in range(self.num_layers) if not linear[i])

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for every attention layer: 2 x attention layers x kv_heads x head_dim x bytes."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * dtype_bytes

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """The fixed-size per-sequence state of a hybrid's linear-attention layers (0 for other models)."""
        return 0 if self.linear_attention is None else self.linear_attention.state_bytes(dtype_bytes)

    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        attn = h * ((2 if self.attn_output_gate else 1) * self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.attention_sinks:
            attn += self.num_heads
        qk_norms = (self.q_size + self.kv_size if self.qk_norm_whole else 2 * self.head_dim) if self.qk_norm else 0
        norms = (4 if self.sandwich_norms else 2) * h + qk_norms
        head = 0 if self.tie_word_embeddings else v * h
        total = v * h + self.num_layers * (attn + norms) + h + head
        if self.linear_attention is not None:  # a linear layer has its own mixer (and no q/k norms) instead
            mixers = self.linear_attention.num_linear_layers
            total += mixers * (self.linear_attention.parameters(h) - attn - qk_norms)
        for layer in range(self.num_layers):
            total += self._mlp_parameters(layer, active=False)
        return total

    def active_parameters(self) -> int:
        """Parameters one token's forward pass uses: every weight except the experts its router does not pick."""
        if self.moe is None:
            return self.num_parameters()
        unused = sum(self._mlp_parameters(layer, active=False) - self._mlp_parameters(layer, active=True)
                     for layer in range(self.num_layers))
        return self.num_parameters() - unused

    def _mlp_parameters(self, layer: int, active: bool) -> int:
        h, moe = self.hidden_size, self.moe
        if moe is None or not moe.sparse_layers[layer]:
            return 3 * h * self.intermediate_size
        experts = moe.top_k if active else moe.num_experts
        router = moe.num_experts * h + (moe.num_experts if moe.router_bias else 0)
        shared = 3 * h * moe.shared_expert_size + h if moe.shared_expert_size else 0
        return router + experts * moe.expert_parameters(h) + shared

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read an HF config dict, in transformers 5's layout (`rope_parameters`, `layer_types`) or the older
        one on most Hub checkpoints (`rope_scaling`, `rope_theta`, `sliding_window_pattern`, ...)."""
        model_type = cfg.get("model_type", "llama")
        if model_type in MULTIMODAL_MODEL_TYPES:
            return cls._language_model(cfg, model_type)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        quantized = cfg.get("quantization_config")
        if model_type == "gpt_oss" and quantized:
            method = str(quantized.get("quant_method", "?")) if isinstance(quantized, dict) else "?"
            raise UnsupportedModelError(
                f"this gpt_oss checkpoint is quantized (quantization_config quant_method {method!r}); quantized "
                "experts, MXFP4 blocks and scales as openai/gpt-oss-20b and -120b are published included, are not "
                "supported: serve a bfloat16 or float32 checkpoint of the model (dequantized, without "
                "quantization_config)")
        gemma = model_type in GEMMA_FAMILIES
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        num_layers = cfg["num_hidden_layers"]
        layer_types = _layer_types(cfg, model_type, num_layers)
        window = cfg.get("sliding_window")
        layer_windows = tuple(window if kind == "sliding_attention" and window else None for kind in layer_types)
        ropes = {kind: _rope_spec(cfg, model_type, kind, head_dim) for kind in set(layer_types)}
        layer_ropes = tuple(ropes[kind] for kind in layer_types)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"hidden activation {act!r} is not supported; supported: "
                                        f"{', '.join(ACTIVATIONS)}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        global_rope = ropes.get("full_attention") or _rope_spec(cfg, model_type, "full_attention", head_dim)
        gpt_oss = model_type == "gpt_oss"
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=global_rope.theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            rope_scaling=global_rope.scaling,
            eos_token_ids=eos_ids,
            hidden_act=act,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe", *HYBRID_MODEL_TYPES),
            norm_offset=1.0 if gemma or model_type in HYBRID_MODEL_TYPES else 0.0,  # Qwen3.5 norms: (1 + w) too
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            sandwich_norms=gemma,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            layer_windows=layer_windows,
            layer_ropes=layer_ropes,
            fused_projections=model_type == "phi3",
            o_bias=gpt_oss and bool(cfg.get("attention_bias", True)),
            attention_sinks=gpt_oss,
            qk_norm_whole=model_type == "olmoe",
            clip_qkv=cfg.get("clip_qkv") if model_type == "olmoe" else None,
            moe=_moe_spec(cfg, model_type, num_layers),
            linear_attention=_linear_attention_spec(cfg, model_type, layer_types),
            attn_output_gate=model_type in HYBRID_MODEL_TYPES,
        )

    @classmethod
    def _language_model(cls, cfg: dict[str, Any], model_type: str) -> ModelConfig:
        """The language model of a multimodal checkpoint, from its `text_config` (what the wrapper sets at its top
        level, tied embeddings and EOS ids, wins as in transformers)."""
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError(f"this {model_type} checkpoint's config.json has no text_config object: "
                                        "a multimodal checkpoint describes its language model there")
        text = dict(text)
        text.setdefault("model_type", MULTIMODAL_MODEL_TYPES[model_type])
        if text["model_type"] != MULTIMODAL_MODEL_TYPES[model_type]:
            raise UnsupportedModelError(f"a {model_type} checkpoint's text_config has model_type "
                                        f"{text['model_type']!r}; expected {MULTIMODAL_MODEL_TYPES[model_type]!r}")
        for key in ("tie_word_embeddings", "eos_token_id"):
            if cfg.get(key) is not None:
                text[key] = cfg[key]
        if "tie_word_embeddings" not in text and model_type == "gemma3":
            text["tie_word_embeddings"] = True
        inner = cls.from_hf(text)
        return replace(inner, multimodal=model_type)


def _moe_spec(cfg: dict[str, Any], model_type: str, num_layers: int) -> MoESpec | None:
    """The routed experts of a mixture-of-experts config, read as transformers' modeling code reads it."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    if not num_experts or not top_k or top_k > num_experts:
        raise UnsupportedModelError(f"a {model_type} config needs num_experts (or num_local_experts) and "
                                    f"num_experts_per_tok <= it; got {num_experts!r} and {top_k!r}")
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        # transformers: layer i is sparse unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    else:
        sparse = (True,) * num_layers
    act = cfg.get("hidden_act") or "silu"
    if model_type != "gpt_oss" and act != "silu":
        raise UnsupportedModelError(f"expert activation {act!r} is not supported; supported: silu")
    gpt_oss = model_type == "gpt_oss"
    return MoESpec(
        num_experts=int(num_experts), top_k=int(top_k),
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        sparse_layers=sparse,
        norm_topk_prob=True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        softmax_after_topk=gpt_oss, router_bias=gpt_oss, expert_bias=gpt_oss,
        activation="swiglu_clamp" if gpt_oss else "silu",
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type in ("qwen2_moe", "qwen3_next") else 0,
        router_name="router" if gpt_oss else "gate",
    )


def _linear_attention_spec(cfg: dict[str, Any], model_type: str, layer_types: list[str]
                           ) -> LinearAttentionSpec | None:
    """The Gated DeltaNet layers of a hybrid config, read as transformers' modeling code reads them."""
    if model_type not in HYBRID_MODEL_TYPES:
        return None
    try:
        spec = LinearAttentionSpec(
            num_key_heads=int(cfg["linear_num_key_heads"]), num_value_heads=int(cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg["linear_key_head_dim"]), value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg["linear_conv_kernel_dim"]),
            layers=tuple(kind == "linear_attention" for kind in layer_types),
            fused_projections=model_type == "qwen3_next")
    except KeyError as exc:
        raise UnsupportedModelError(f"a {model_type} config needs {exc.args[0]} (its linear-attention layers' "
                                    "shape)") from None
    if spec.num_value_heads % spec.num_key_heads or spec.conv_kernel < 2:
        raise UnsupportedModelError(f"linear_num_value_heads {spec.num_value_heads} must be a multiple of "
                                    f"linear_num_key_heads {spec.num_key_heads}, and linear_conv_kernel_dim >= 2")
    return spec


def _layer_types(cfg: dict[str, Any], model_type: str, num_layers: int) -> list[str]:
    """'sliding_attention', 'full_attention' or (hybrid families) 'linear_attention' per layer, as transformers
    derives them."""
    given = cfg.get("layer_types")
    kinds = {"sliding_attention", "full_attention"} | ({"linear_attention"} if model_type in HYBRID_MODEL_TYPES
                                                       else set())
    if given:
        if len(given) != num_layers or not set(given) <= kinds:
            raise UnsupportedModelError(f"layer_types {given!r} is not one of {' / '.join(sorted(kinds))} "
                                        f"per layer ({num_layers} layers)")
        return list(given)
    if model_type in HYBRID_MODEL_TYPES:  # transformers' default: every `full_attention_interval`-th layer is full
        interval = cfg.get("full_attention_interval", 4)
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    window = cfg.get("sliding_window")
    if model_type == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        if not cfg.get("use_sliding_window") or not window:
            return ["full_attention"] * num_layers
        first = cfg.get("max_window_layers", num_layers)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return ["sliding_attention" if window else "full_attention"] * num_layers


def _rope_spec(cfg: dict[str, Any], model_type: str, layer_type: str, head_dim: int) -> RopeSpec:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:  # per layer type (Gemma 3 in transformers 5)
        params = params[layer_type]
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if model_type == "gemma3_text" and layer_type == "sliding_attention" and not isinstance(params, dict):
        # The older layout: local layers use plain RoPE at `rope_local_base_freq`, the scaling is the global's.
        return RopeSpec(float(cfg.get("rope_local_base_freq", 10000.0)), None, head_dim)
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    if theta is None:
        theta = 1_000_000.0 if model_type == "gemma3_text" else 10000.0
    default_partial = 0.25 if model_type in HYBRID_MODEL_TYPES else 1.0  # transformers' Qwen3.5 / Qwen3-Next default
    partial = float((scaling or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or default_partial)
    rotary_dim = int(head_dim * partial)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "su":  # Phi-3's early name for LongRoPE
            rope_type = "longrope"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type == "default":
            scaling = None
        else:
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
            scaling["rope_type"] = rope_type
            _context_defaults(cfg, scaling)
    return RopeSpec(float(theta), scaling, rotary_dim)


def _context_defaults(cfg: dict[str, Any], scaling: dict[str, Any]) -> None:
    """Fill what YaRN and LongRoPE read from the config's top level when their parameters leave it out."""
    if scaling["rope_type"] not in ("yarn", "longrope"):
        return
    scaling.setdefault("original_max_position_embeddings",
                       cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
    if scaling["rope_type"] == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = cfg.get("max_position_embeddings", 4096) / scaling["original_max_position_embeddings"]
    if scaling["rope_type"] == "longrope":
        scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings", 4096))
