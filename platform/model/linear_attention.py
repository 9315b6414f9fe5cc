"""Gated DeltaNet, the linear-attention token mixer of hybrid families (Qwen3.5, Qwen3-Next), over a pool of
per-sequence states.

A layer projects x into q/k/v (through a depthwise causal convolution), an output gate z and per value head a rate
beta = sigmoid(b) and a decay g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
(loramux.kernels.gated_delta) mixes the tokens, a gated RMSNorm (norm(o) * silu(z)) and `out_proj` finish.

Instead of KV blocks, each running sequence holds one slot of `LinearStates`: the last K - 1 convolution inputs and
one recurrent matrix per value head, per linear layer. A prefill chunk starts from its slot (or from zeros when it
is the sequence's first) and runs the chunked rule; the step's plain decode rows take one step of the rule together,
updating their slots in place when they form one range of slots (the usual case: slots are handed out lowest
first), else through a gathered copy written back.

The projections are merged like attention's: Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` are the
slices qkv, z, b, a of `in_proj`; Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba` keep their checkpoint column
order (interleaved per key head) as the slices qkvz and ba, so a LoRA on either adds to exactly the columns it does
in PEFT, and the split happens after the deltas.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loramux.kernels.gated_delta import causal_conv1d, chunk_gated_delta_rule, gated_delta_step
from loramux.model.config import LinearAttentionSpec, ModelConfig

# HF / PEFT projection name -> (merged module path inside a linear-attention layer, slice name)
LINEAR_PROJECTION_SLICES: dict[str, tuple[str, str]] = {
    "in_proj_qkv": ("linear_attn.in_proj", "qkv"), "in_proj_z": ("linear_attn.in_proj", "z"),
    "in_proj_b": ("linear_attn.in_proj", "b"), "in_proj_a": ("linear_attn.in_proj", "a"),
    "in_proj_qkvz": ("linear_attn.in_proj", "qkvz"), "in_proj_ba": ("linear_attn.in_proj", "ba"),
    "out_proj": ("linear_attn.out_proj", "out"),
}


@dataclass
class StateBatch:
    """Where a step's rows keep their linear-attention state: `chunks` are (first row, end row, slot, fresh) of
    each prefill chunk (fresh: the sequence's first, starting from zeros); the rows from `decode_start` on are plain
    decodes, one per sequence, whose slots are `decode_slots` [D] long. When those slots are exactly
    `decode_span`, ..., `decode_span` + D - 1, `decode_order` [D] lists the decode rows (counted from decode_start)
    in slot order, and the states are read and written in place."""

    chunks: list[tuple[int, int, int, bool]]
    decode_start: int
    decode_slots: torch.Tensor | None = None
    decode_span: int | None = None
    decode_order: torch.Tensor | None = None

    @classmethod
    def build(cls, chunks: list[tuple[int, int, int, bool]], decode_start: int, decode_slots: list[int], tensor):
        """The batch of a step whose decode rows hold `decode_slots` (row order); `tensor` makes a long tensor."""
        if not decode_slots:
            return cls(chunks, decode_start)
        first = min(decode_slots)
        if sorted(decode_slots) != list(range(first, first + len(decode_slots))):
            return cls(chunks, decode_start, tensor(decode_slots))
        order = sorted(range(len(decode_slots)), key=decode_slots.__getitem__)
        return cls(chunks, decode_start, tensor(decode_slots), first, tensor(order))


class LinearStates:
    """The per-sequence state pool of every linear layer: conv windows [layers, slots, conv_dim, K - 1] in the
    model's dtype and recurrent matrices [layers, slots, value heads, key_head_dim, value_head_dim] in float32."""

    def __init__(self, spec: LinearAttentionSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str):
        layers = spec.num_linear_layers
        self.conv = torch.zeros(layers, num_slots, spec.conv_dim, spec.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(layers, num_slots, spec.num_value_heads, spec.key_head_dim,
                                     spec.value_head_dim, dtype=torch.float32, device=device)
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4


class GatedRMSNorm(nn.Module):
    """norm(x) * w * silu(gate), with float32 statistics and gate, as the reference's RMSNormGated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, state_layer: int):
        super().__init__()
        from loramux.model.llama import MergedLinear  # the shared projection type (llama imports this module)

        spec = cfg.linear_attention
        assert spec is not None
        self.spec = spec
        self.state_layer = state_layer  # this layer's index into LinearStates
        self.in_proj = MergedLinear(cfg.hidden_size, spec.in_proj_slices())
        self.conv_weight = nn.Parameter(torch.empty(spec.conv_dim, spec.conv_kernel), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(spec.num_value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(spec.num_value_heads), requires_grad=False)
        self.norm = GatedRMSNorm(spec.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = MergedLinear(spec.value_dim, (("out", cfg.hidden_size),))

    def _split(self, projected: torch.Tensor):
        """(qkv [T, conv_dim] in q, k, v order, z [T, value heads, Dv], b, a [T, value heads])."""
        spec, t = self.spec, projected.shape[0]
        if not spec.fused_projections:
            qkv, z, b, a = projected.split((spec.conv_dim, spec.value_dim, spec.num_value_heads,
                                            spec.num_value_heads), dim=-1)
            return qkv, z.reshape(t, -1, spec.value_head_dim), b, a
        # Qwen3-Next: per key head [q, k, v (its value heads), z (same)] and [b, a (its value heads each)].
        group = spec.num_value_heads // spec.num_key_heads
        qkvz, ba = projected.split((2 * spec.key_dim + 2 * spec.value_dim, 2 * spec.num_value_heads), dim=-1)
        qkvz = qkvz.reshape(t, spec.num_key_heads, -1)
        q, k, v, z = qkvz.split((spec.key_head_dim, spec.key_head_dim, group * spec.value_head_dim,
                                 group * spec.value_head_dim), dim=-1)
        b, a = ba.reshape(t, spec.num_key_heads, 2 * group).split((group, group), dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, -1, spec.value_head_dim), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, x: torch.Tensor, states: LinearStates, batch: StateBatch) -> torch.Tensor:
        spec, t = self.spec, x.shape[0]
        qkv, z, b, a = self._split(self.in_proj(x))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv_states, recurrent = states.conv[self.state_layer], states.recurrent[self.state_layer]
        out = x.new_empty(t, spec.num_value_heads, spec.value_head_dim)
        for start, end, slot, fresh in batch.chunks:  # prefill chunks, each from its own state
            mixed, window = causal_conv1d(qkv[start:end].t()[None], None if fresh else conv_states[slot:slot + 1],
                                          self.conv_weight)
            conv_states[slot] = window[0]
            q, k, v = self._heads(mixed[0].t())
            o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None, start:end], beta[None, start:end],
                                              None if fresh else recurrent[slot:slot + 1])
            recurrent[slot] = final[0]
            out[start:end] = o[0]
        if batch.decode_slots is not None:
            out[batch.decode_start:] = self._decode(qkv, g, beta, conv_states, recurrent, batch)
        core = self.norm(out.reshape(-1, spec.value_head_dim), z.reshape(-1, spec.value_head_dim))
        return self.out_proj(core.reshape(t, spec.value_dim))

    def _decode(self, qkv, g, beta, conv_states, recurrent, batch: StateBatch) -> torch.Tensor:
        """The plain decode rows' outputs [D, value heads, Dv]: one step of the rule each, from and into their
        slots (in place over a range of slots, else through a gathered copy; see StateBatch)."""
        d0, order, slots = batch.decode_start, batch.decode_order, batch.decode_slots
        assert slots is not None
        rows = qkv[d0:], g[d0:], beta[d0:]
        if order is not None:  # the rows in slot order, over views of their range of slots
            rows = tuple(x.index_select(0, order) for x in rows)
            span = slice(batch.decode_span, batch.decode_span + len(order))
            windows, states = conv_states[span], recurrent[span]
        else:
            windows, states = conv_states[slots], recurrent[slots]  # copies (advanced indexing)
        x, g_rows, beta_rows = rows
        mixed, new_windows = causal_conv1d(x[:, :, None], windows, self.conv_weight)
        windows.copy_(new_windows)
        o = gated_delta_step(*self._heads(mixed[:, :, 0]), g_rows, beta_rows, states)
        if order is None:  # write the copies back
            conv_states.view(conv_states.shape[0], -1).index_copy_(0, slots, windows.view(len(slots), -1))
            recurrent.view(recurrent.shape[0], -1).index_copy_(0, slots, states.view(len(slots), -1))
            return o
        return torch.empty_like(o).index_copy_(0, order, o)  # back to row order

    def _heads(self, mixed: torch.Tensor):
        """[T, conv_dim] -> q, k [T, key heads, Dk], v [T, value heads, Dv]."""
        spec, t = self.spec, mixed.shape[0]
        q, k, v = mixed.split((spec.key_dim, spec.key_dim, spec.value_dim), dim=-1)
        return (q.reshape(t, -1, spec.key_head_dim), k.reshape(t, -1, spec.key_head_dim),
                v.reshape(t, -1, spec.value_head_dim))
