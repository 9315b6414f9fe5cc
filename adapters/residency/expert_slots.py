"""Expert LoRA in the device pool: per slot, a rank-R pair per routed expert of every sparse layer.

An adapter trained with PEFT `target_parameters` on the experts (`LoRAAdapter.experts`) holds, per sparse layer
and expert projection ("gate_up", "down"), A [E, R, d_in] and B [E, d_out, R]. Its bucket key records the rank
of each expert projection it covers (`BucketKey.experts`, e.g. (("gate_up", 16), ("down", 16))); such an
adapter covers every sparse layer (validation refuses layer subsets of expert LoRA), so a slot holds

    sum over covered projections p of  num_sparse_layers x E x R_p x (d_in_p + d_out_p)  weights

plus one float32 scale per (layer, projection, expert): `slot_bytes` counts exactly what `allocate` makes.
The buffers are `ExpertLoRAWeights` (loramux.kernels.wrapper), (slot, expert) flattened so the kernels index
one "virtual slot" per pair.
"""
from __future__ import annotations

import torch

from loramux.kernels.wrapper import ExpertLoRAWeights
from loramux.model.config import ModelConfig

SCALE_BYTES = 4
# LoRAAdapter.experts names -> the model's expert projection paths (loramux.model.moe.EXPERT_MODULES)
EXPERT_PATHS = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
ExpertsKey = tuple  # ((name, rank), ...) in EXPERT_PATHS order; () = no expert LoRA


def key_of(adapter) -> ExpertsKey:
    """The expert part of `adapter`'s bucket key: the rank of each expert projection it covers."""
    ranks: dict[str, set[int]] = {}
    for (_, name), (a, _) in adapter.experts.items():
        ranks.setdefault(name, set()).add(a.shape[1])
    for name, seen in ranks.items():
        if len(seen) != 1:
            raise ValueError(f"adapter {adapter.name!r} has expert LoRA of several ranks on {name} "
                             f"({sorted(seen)}); one rank per expert projection is served")
    return tuple((name, ranks[name].pop()) for name in EXPERT_PATHS if name in ranks)


def slot_bytes(key: ExpertsKey, cfg: ModelConfig, element: int) -> int:
    """Device bytes of one slot's expert LoRA (weights at `element` bytes each, float32 scales)."""
    if not key:
        return 0
    if cfg.moe is None:
        raise ValueError("expert LoRA needs a mixture-of-experts base model")
    return cfg.moe.lora_bytes(cfg.hidden_size, dict(key), element, SCALE_BYTES)


def allocate(key: ExpertsKey, model, capacity: int, dtype: torch.dtype, device: torch.device
             ) -> dict[tuple[int, str], ExpertLoRAWeights]:
    """Zeroed buffers of `capacity` slots for every (sparse layer, covered expert projection)."""
    if not key:
        return {}
    ranks = dict(key)
    out = {}
    for layer, path, module in model.expert_modules():
        name = next((n for n, p in EXPERT_PATHS.items() if p == path), None)
        if name not in ranks:
            continue
        rows, rank = capacity * module.num_experts, ranks[name]
        out[(layer, path)] = ExpertLoRAWeights(
            a=torch.zeros(rows, rank, module.in_features, dtype=dtype, device=device),
            b=torch.zeros(rows, module.out_features, rank, dtype=dtype, device=device),
            scale=torch.zeros(rows, dtype=torch.float32, device=device),
            num_experts=module.num_experts, targeted=[False] * capacity)
    return out


def write(buffers: dict[tuple[int, str], ExpertLoRAWeights], slot: int, adapter) -> None:
    """Copy `adapter`'s expert LoRA into `slot`, zeroing what the previous occupant left."""
    for weights in buffers.values():
        rows = weights.slot_rows(slot)
        weights.a[rows].zero_()
        weights.b[rows].zero_()
        weights.scale[rows] = 0.0
        weights.set_targeted(slot, False)
    for (layer, name), (a, b) in adapter.experts.items():
        weights = buffers[(layer, EXPERT_PATHS[name])]
        rows = weights.slot_rows(slot)
        weights.a[rows].copy_(a, non_blocking=True)
        weights.b[rows].copy_(b, non_blocking=True)
        weights.scale[rows] = adapter.scale
        weights.set_targeted(slot, True)


def copy_slot(dst: dict[tuple[int, str], ExpertLoRAWeights], src: dict[tuple[int, str], ExpertLoRAWeights],
              src_slot: int, dst_slot: int) -> None:
    for key, weights in dst.items():
        other = src[key]
        rows, other_rows = weights.slot_rows(dst_slot), other.slot_rows(src_slot)
        weights.a[rows].copy_(other.a[other_rows])
        weights.b[rows].copy_(other.b[other_rows])
        weights.scale[rows] = other.scale[other_rows]
        weights.set_targeted(dst_slot, other.targeted[src_slot])


def swap(buffers: dict[tuple[int, str], ExpertLoRAWeights], i: int, j: int) -> None:
    for weights in buffers.values():
        rows_i, rows_j = weights.slot_rows(i), weights.slot_rows(j)
        for stack in (weights.a, weights.b, weights.scale):
            held = stack[rows_i].clone()
            stack[rows_i] = stack[rows_j]
            stack[rows_j] = held
        flag_i, flag_j = weights.targeted[i], weights.targeted[j]
        weights.set_targeted(i, flag_j)
        weights.set_targeted(j, flag_i)
