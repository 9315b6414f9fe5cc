"""The routed-experts MLP of mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss).

Per token, a router scores the `num_experts` experts and keeps the `top_k` best with their routing weights
(`route`, each family's rule from `MoESpec`). The step's (token, expert) pairs are then sorted by expert
(`loramux.kernels.moe.group_by_expert`), so each expert's weights are read once for the run of pairs routed
to it, as SGMV reads each adapter's once: `grouped_matmul` never loops over tokens and never computes an
expert no token picked. Each pair's output is scaled by its routing weight and summed back into its token's
row, experts in ascending order as in transformers.

Expert weights are stacked per projection as [E, out, in] (as nn.Linear and most checkpoints hold them) and
multiplied through the [E, in, out] view: at the few rows per expert of a decode step CPU BLAS reads this
layout at memory speed, about 1.8x faster than a contiguous [E, in, out] stack (measured at Qwen3-30B-A3B's
shapes). `gate_up_proj` holds every expert's gate rows then its up rows (gpt-oss checkpoints interleave them;
the loader separates them), `down_proj` maps back to the hidden size. A LoRA on the experts (PEFT
`target_parameters`) is added inside each grouped projection by the step's LoRA wrapper (`apply_experts`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loramux.kernels.moe import ExpertGroups, group_by_expert, grouped_matmul, grouped_packed_matmul
from loramux.model import cpu_linear
from loramux.model.config import ModelConfig, MoESpec
from loramux.model.slices import slice_bounds

if TYPE_CHECKING:
    from loramux.model.llama import MergedLinear

# The expert projections an adapter can target (PEFT `target_parameters` names), in forward order.
EXPERT_MODULES: tuple[str, ...] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class ExpertLoRA(Protocol):
    """What an expert projection calls to add the step's expert-LoRA deltas (loramux.kernels.wrapper)."""

    def apply_experts(self, y: torch.Tensor, x: torch.Tensor, groups: ExpertGroups,
                      key: tuple[int, str] | None) -> torch.Tensor: ...


class ExpertCounter(Protocol):
    """Where a layer reports how many of the step's tokens each expert took (the engine's metrics)."""

    def count(self, layer: int, present: list[int], counts: list[int]) -> None: ...


class ExpertProjection(nn.Module):
    """One projection of every expert: y[p] = x[p] @ weight[e_p]^T (+ bias[e_p]) for pairs sorted by expert;
    `weight` is [E, out, in].

    `slices` names the output columns as MergedLinear's do (gate and up, or down), so checkpoints and adapters
    can address each expert's gate and up parts separately."""

    def __init__(self, num_experts: int, in_features: int, slices: tuple[tuple[str, int], ...], bias: bool):
        super().__init__()
        self.num_experts, self.in_features, self.slices = num_experts, in_features, slices
        self.out_features = sum(size for _, size in slices)
        self.weight = nn.Parameter(torch.empty(num_experts, self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_experts, self.out_features), requires_grad=False) if bias else None
        # Set by the device adapter pool: the shared LoRA wrapper and this projection's key for it.
        self.lora_key: tuple[int, str] | None = None
        self.lora_wrapper: ExpertLoRA | None = None
        self.packed: list[torch.Tensor] | None = None  # each expert in oneDNN's layout, when packed for CPU

    def pack_for_cpu(self, batch_hint: int) -> bool:
        """Swap each expert's weight for oneDNN's packed layout where usable (then `weight` is None), as the dense
        layers do: see loramux.kernels.moe.grouped_packed_matmul for why."""
        w = self.weight
        if w is None or w.device.type != "cpu" or \
                not cpu_linear.can_pack(self.in_features, self.out_features, w.dtype, batch_hint):
            return False
        self.packed = [cpu_linear.pack(w.data[e].t(), batch_hint) for e in range(self.num_experts)]
        self.weight = None
        return True

    def slice_range(self, name: str) -> tuple[int, int]:
        """Each expert's output features [start, end) (rows of its weight, entries of its bias) of slice `name`."""
        return slice_bounds(self.slices, name)

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        if self.packed is not None:
            y = grouped_packed_matmul(x, self.packed, self.out_features, groups, self.bias)
        else:
            y = grouped_matmul(x, self.weight.transpose(1, 2), groups, self.bias)
        if self.lora_wrapper is not None:
            self.lora_wrapper.apply_experts(y, x, groups, self.lora_key)
        return y


class Experts(nn.Module):
    def __init__(self, moe: MoESpec, hidden: int):
        super().__init__()
        i = moe.intermediate_size
        self.gate_up_proj = ExpertProjection(moe.num_experts, hidden, (("gate", i), ("up", i)), moe.expert_bias)
        self.down_proj = ExpertProjection(moe.num_experts, i, (("down", hidden),), moe.expert_bias)


def route(logits: torch.Tensor, moe: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (routing weights [T, k], expert ids [T, k]) by the family's rule:
    softmax in float32, top-k, optionally renormalised (Qwen, Mixtral, OLMoE); or top-k of the logits, then
    a softmax over those k in the logits' dtype (gpt-oss)."""
    if moe.softmax_after_topk:
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def activate(gate_up: torch.Tensor, moe: MoESpec) -> torch.Tensor:
    """[N, 2I] (gate columns, then up) -> [N, I]: SiLU(gate) * up, or gpt-oss's clamped SwiGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    if moe.activation == "swiglu_clamp":
        gate = gate.clamp(max=moe.swiglu_limit)
        up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))
    return F.silu(gate) * up


class MoEBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's sigmoid-gated shared expert), in place of a dense MLP."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        from loramux.model.llama import MLP, MergedLinear  # the dense pieces: shared expert, router

        moe = cfg.moe
        assert moe is not None
        self.moe, self.layer = moe, layer
        router: MergedLinear = MergedLinear(cfg.hidden_size, (("router", moe.num_experts),), bias=moe.router_bias)
        self.router = router
        self.experts = Experts(moe, cfg.hidden_size)
        self.shared_expert = MLP(cfg, moe.shared_expert_size) if moe.shared_expert_size else None
        self.shared_expert_gate = MergedLinear(cfg.hidden_size, (("gate", 1),)) if moe.shared_expert_size else None
        self.expert_counter: ExpertCounter | None = None  # set by the engine: tokens per expert, for metrics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.moe)
        groups = group_by_expert(ids, self.moe.num_experts)
        if self.expert_counter is not None:
            self.expert_counter.count(self.layer, groups.present, groups.counts)
        pairs = x.index_select(0, groups.tokens)
        hidden = activate(self.experts.gate_up_proj(pairs, groups), self.moe)
        out_pairs = self.experts.down_proj(hidden, groups)
        out_pairs = out_pairs * weights.reshape(-1).index_select(0, groups.order).unsqueeze(1).to(out_pairs.dtype)
        out = torch.zeros_like(x).index_add_(0, groups.tokens, out_pairs.to(x.dtype))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
