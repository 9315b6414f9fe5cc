"""Checkpoint tensors of a mixture-of-experts layer, in every naming the families' checkpoints use.

* transformers 4.x names, which transformers 5 still writes on save for most families: one tensor per expert and
  projection, `mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` [out, in] (Qwen-MoE, OLMoE) or Mixtral's
  `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight` with its router at `block_sparse_moe.gate`;
* fused 3-D tensors, as transformers 5 holds them: `mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I] ([E, out, in]), or gpt-oss's [E, H, 2I] / [E, I, H] ([E, in, out]) whose
  gate and up columns interleave (gate = [..., ::2]), with `gate_up_proj_bias` / `down_proj_bias`;
* the router (`mlp.gate.weight`, gpt-oss `mlp.router.weight` and `.bias`) and Qwen2-MoE's shared expert
  (`mlp.shared_expert.{gate,up,down}_proj.weight`, `mlp.shared_expert_gate.weight`).

The model keeps every expert projection as [E, out, in] with gate rows before up rows. Each expert's
slice of a stacked parameter is recorded as loaded (`name#slice<e>`), so a checkpoint missing one expert is
refused by the loader's completeness check like any missing tensor.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.model.moe import ExpertProjection, MoEBlock

# Per-expert checkpoint names -> (stacked projection, slice)
_PER_EXPERT = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
               "down_proj": ("down_proj", "down"), "w1": ("gate_up_proj", "gate"), "w3": ("gate_up_proj", "up"),
               "w2": ("down_proj", "down")}
_SHARED = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"), "down_proj": ("down_proj", "down")}

Put = Callable[..., None]


def deinterleave(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """gpt-oss's gate/up layout (gate at even, up at odd positions of `dim`) -> gate half, then up half."""
    size = tensor.shape[dim]
    order = torch.cat((torch.arange(0, size, 2), torch.arange(1, size, 2))).to(tensor.device)
    return tensor.index_select(dim, order)


def load_moe_tensor(block: MoEBlock, layer: int, rest: list[str], tensor: torch.Tensor, put: Put,
                    loaded: set[str]) -> bool:
    """Load one tensor of sparse layer `layer` whose name after `layers.{layer}.` is `rest` (split on dots).
    Returns False when the name is not an MoE tensor (the caller handles attention and norms)."""
    prefix = f"layers.{layer}.mlp"
    section, tail = rest[0], rest[1:]
    if section not in ("mlp", "block_sparse_moe") or not tail:
        return False
    moe = block.moe
    if tail[0] == moe.router_name or (section == "block_sparse_moe" and tail[0] == "gate"):
        kind = tail[-1]
        param = block.router.weight if kind == "weight" else block.router.bias
        if param is None:
            raise ValueError(f"checkpoint has a router {kind} in layer {layer} but the config says it has none")
        put(param, tensor)
        loaded.add(f"{prefix}.router.{kind}#router")
        return True
    if tail[0] == "experts":
        _load_experts(block, layer, tail[1:], tensor, put, loaded)
        return True
    if tail[0] == "shared_expert" and block.shared_expert is not None and len(tail) == 3 and tail[1] in _SHARED:
        module_name, slice_name = _SHARED[tail[1]]
        module = getattr(block.shared_expert, module_name)
        put(module.weight, tensor, module.slice_range(slice_name))
        loaded.add(f"{prefix}.shared_expert.{module_name}.weight#{slice_name}")
        return True
    if tail[0] == "shared_expert_gate" and block.shared_expert_gate is not None:
        put(block.shared_expert_gate.weight, tensor)
        loaded.add(f"{prefix}.shared_expert_gate.weight#gate")
        return True
    return False


def _load_experts(block: MoEBlock, layer: int, tail: list[str], tensor: torch.Tensor, put: Put,
                  loaded: set[str]) -> None:
    prefix = f"layers.{layer}.mlp.experts"
    experts = block.experts
    num = block.moe.num_experts
    if tail and tail[0].isdigit():  # per expert: {e}.{proj}.weight
        expert = int(tail[0])
        if expert >= num or len(tail) != 3 or tail[1] not in _PER_EXPERT or tail[2] != "weight":
            raise ValueError(f"checkpoint tensor {prefix}.{'.'.join(tail)} does not name a weight of one of the "
                             f"{num} experts of layer {layer}")
        module_name, slice_name = _PER_EXPERT[tail[1]]
        module: ExpertProjection = getattr(experts, module_name)
        lo, hi = module.slice_range(slice_name)
        _copy(module.weight[expert, lo:hi], tensor, f"{prefix}.{expert}.{tail[1]}")
        loaded.add(f"{prefix}.{module_name}.weight#{slice_name}{expert}")
        return
    name = tail[0] if len(tail) == 1 else ".".join(tail)
    interleaved = block.moe.activation == "swiglu_clamp"  # gpt-oss's layout
    if name in ("gate_up_proj", "down_proj"):
        module = getattr(experts, name)
        stacked = tensor.transpose(1, 2) if interleaved else tensor  # gpt-oss's [E, in, out] -> [E, out, in]
        if interleaved and name == "gate_up_proj":
            stacked = deinterleave(stacked, dim=1)
        _copy(module.weight, stacked, f"{prefix}.{name}")
        loaded.update(f"{prefix}.{name}.weight#{s}{e}" for s, _ in module.slices for e in range(num))
        return
    if name in ("gate_up_proj_bias", "down_proj_bias"):
        module = getattr(experts, name.removesuffix("_bias"))
        if module.bias is None:
            raise ValueError(f"checkpoint has {prefix}.{name} but the config says the experts have no bias")
        bias = deinterleave(tensor, dim=1) if name == "gate_up_proj_bias" else tensor
        _copy(module.bias, bias, f"{prefix}.{name}")
        stem = name.removesuffix("_bias")
        loaded.update(f"{prefix}.{stem}.bias#{s}{e}" for s, _ in module.slices for e in range(num))
        return
    raise ValueError(f"checkpoint tensor {prefix}.{name} is not an expert weight this engine knows "
                     "(gate_up_proj, down_proj, their biases, or per-expert gate/up/down projections)")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {name}: expected {tuple(dst.shape)} (as [experts, out, in] "
                         f"after the family's orientation), got {tuple(src.shape)}")
    dst.copy_(src)


def complete_experts(module_name: str, module: ExpertProjection, loaded: set[str]) -> set[str]:
    """The stacked parameters of `module` (named `module_name`) every expert slice of which arrived."""
    done = set()
    for kind in ("weight", "bias"):
        if getattr(module, kind, None) is None:
            continue
        if all(f"{module_name}.{kind}#{s}{e}" in loaded for s, _ in module.slices for e in range(module.num_experts)):
            done.add(f"{module_name}.{kind}")
    return done
