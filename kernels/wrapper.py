"""The one LoRA entry point for model layers (as vLLM's punica wrapper).

Semantics, for every row i of the step's flat batch and every slice of a merged projection:
    y[i, slice] += (x[i] @ A_slice[adapter(i)]^T) @ B_slice[adapter(i)]^T * scale[adapter(i)]
where rows without an adapter are left untouched; then, for DoRA buckets only (`LoRALayerWeights.dora_g`),
    y[i, :] = g[adapter(i)] * (y[i, :] - bias) + bias
(loramux.kernels.dora: DoRA's fixed per-channel scale, one elementwise op per bucket). Adapters live in
rank buckets (see `loramux.adapters.residency.device_pool`): every adapter of a bucket has the bucket's rank and
projections, exactly, so each row costs its own adapter's rank. The engine sets each row's location (rank,
slot) once per step; every layer then calls `apply` with its own key, and the wrapper runs the shared ops
once per bucket present, on the span of rows that bucket's adapters cover.

LoRA on the routed experts of a mixture-of-experts layer (PEFT `target_parameters`) goes through the same
wrapper: each expert projection calls `apply_experts` with the layer's pairs sorted by expert, and every pair
(token t, expert e) of an adapter row gets that adapter's own rank-r pair of expert e (`ExpertLoRAWeights`):
    y[p] += (x[p] @ A[slot(t), e]^T) @ B[slot(t), e]^T * scale[slot(t)]
(loramux.kernels.moe.expert_lora, with (slot, expert) flattened into one "virtual slot").

Adapters that change the embedding or the output head (embedding LoRA, trained lm_head / embed_tokens,
trainable tokens) are served through the same wrapper: the model calls `embed` and `logits` when the
step has such rows (`embeds`, `replaces_logits`); see loramux.kernels.head_rows for their semantics.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loramux.kernels.dora import dora_rescale
from loramux.kernels.head_rows import StepHeads
from loramux.kernels.moe import ExpertGroups, ExpertLoRAPlan, expert_lora, plan_expert_lora, virtual_slots
from loramux.kernels.ops import LoRABatch, LoRACost, lora_shrink_expand, resolve_lora_impl

Location = tuple[object, int]  # (bucket key, slot in it): see loramux.adapters.residency.device_pool
# The bucket key as the pool's lookups take it: its own type (BucketKey), which the wrapper only hands back.
BucketKeyArg = Any


@dataclass
class LoRALayerWeights:
    """Stacked adapter-slot buffers of one merged projection in one rank bucket.

    a: [n_slots, R_0 + R_1 + ..., d_in]: the slices' A matrices stacked so one shrink serves them all
    (slice i's rows after those of the slices before it; in a plain bucket every R_i is the bucket's rank).
    b: one [n_slots, d_out_slice, R_i] per slice; offsets: the slice's first output column.
    scale: [n_slots] (the adapter's alpha / r), or [n_slices, n_slots] where each slice has its own
    (rank_pattern / alpha_pattern). Unused slices or slots hold zeros.
    targeted: per slot, whether its adapter targets any slice of this projection (a bucket whose
    adapters in a step all leave the projection alone is skipped); `targeted_mask` holds the same as bits,
    so that check costs one AND per layer whatever the number of adapters. Set both with `set_targeted`.
    """

    a: torch.Tensor
    b: list[torch.Tensor]
    offsets: list[int]
    scale: torch.Tensor
    names: list[str]  # slice names, e.g. ["q", "k", "v"]
    targeted: list[bool]
    targeted_mask: int = 0
    # Operand views of slot ranges, kept by the torch path across steps (see ops.lora_shrink_expand).
    operand_cache: dict = field(default_factory=dict, repr=False)
    # DoRA buckets only: [n_slots, d_out] per-channel scale of each slot (1 where its adapter has no DoRA
    # module), and the layer's bias (None when it has none), which the rescale leaves out.
    dora_g: torch.Tensor | None = field(default=None, repr=False)
    dora_bias: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.targeted_mask = sum(1 << slot for slot, flag in enumerate(self.targeted) if flag)

    def set_targeted(self, slot: int, flag: bool) -> None:
        self.targeted[slot] = flag
        self.targeted_mask = self.targeted_mask | (1 << slot) if flag else self.targeted_mask & ~(1 << slot)

    @property
    def rank(self) -> int:
        """The first slice's rank (every slice's, in a plain bucket)."""
        return self.b[0].shape[2]

    @property
    def ranks(self) -> list[int]:
        return [b.shape[2] for b in self.b]


@dataclass
class ExpertLoRAWeights:
    """Expert-LoRA buffers of one expert projection (one layer) in one rank bucket: per slot, a rank-R pair
    per expert, stacked with (slot, expert) flattened: row v = slot * num_experts + expert.

    a: [n_slots * E, R, d_in]; b: [n_slots * E, d_out, R]; scale: [n_slots * E] float32 (the slot's adapter
    scale, repeated over its experts). `targeted` / `targeted_mask`: per slot, whether its adapter has LoRA
    on this projection (set with `set_targeted`), as LoRALayerWeights."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    num_experts: int
    targeted: list[bool]
    targeted_mask: int = 0

    def __post_init__(self) -> None:
        self.targeted_mask = sum(1 << slot for slot, flag in enumerate(self.targeted) if flag)

    def set_targeted(self, slot: int, flag: bool) -> None:
        self.targeted[slot] = flag
        self.targeted_mask = self.targeted_mask | (1 << slot) if flag else self.targeted_mask & ~(1 << slot)

    def slot_rows(self, slot: int) -> slice:
        """The rows of a, b and scale that belong to `slot`."""
        return slice(slot * self.num_experts, (slot + 1) * self.num_experts)


@dataclass
class _BucketRows:
    bucket: object
    start: int  # rows [start, stop) of the step hold every row of this bucket
    stop: int
    batch: LoRABatch
    slots_mask: int  # bit s set: slot s has rows in this step
    token_slots: torch.Tensor | None = None  # [rows in the step] long: slot of this bucket's rows, -1 elsewhere


class LoRAWrapper:
    def __init__(self, impl: str = "auto", device: torch.device | str = "cpu",
                 weights_of: Callable[[BucketKeyArg, tuple[int, str]], LoRALayerWeights | None] | None = None
                 ) -> None:
        """`impl`: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch"; resolved once, here.
        `weights_of(rank, key)`: the bucket buffers of projection `key` (the device pool provides it)."""
        self.impl = resolve_lora_impl(impl, device)
        self.device = torch.device(device)
        self.weights_of = weights_of
        self.buckets: list[_BucketRows] = []
        self.cost = LoRACost()  # what the LoRA path touched since the last reset (tests)
        # Embedding LoRA and trained heads: `extras_of(bucket)` gives a bucket's extra buffers (the device
        # pool sets it); `heads` holds this step's rows of such buckets, None when the step has none.
        self.extras_of: Callable[[BucketKeyArg], dict[str, torch.Tensor]] = lambda bucket: {}
        self.heads: StepHeads | None = None
        # Expert LoRA: `experts_of(bucket, key)` gives a bucket's buffers of expert projection `key` (the pool).
        self.experts_of: Callable[[BucketKeyArg, tuple[int, str]], ExpertLoRAWeights | None] = lambda b, k: None
        self.num_rows = 0
        # The layer's pairs being served and, per bucket, their plan: a layer's gate_up and down share one.
        self._expert_plans: tuple[ExpertGroups | None, dict[int, ExpertLoRAPlan]] = (None, {})

    def set_batch(self, locations: Sequence[Location | None] | None, logit_rows: Sequence[int] | None = None) -> None:
        """Per step: each row's adapter location, None for a base-model row (or no list at all), and the rows
        whose logits the step computes (`logit_rows`, in logits order: for trained heads)."""
        self.buckets = []
        self.heads = None
        self._expert_plans = (None, {})
        self.num_rows = len(locations) if locations else 0
        if not locations:
            return
        if any(location is not None and getattr(location[0], "extras", ()) for location in locations):
            self.heads = StepHeads(locations, self.extras_of, self.device)
            self.heads.set_logit_rows(logit_rows or [])
        rows_of: dict[object, list[int]] = {}
        for row, location in enumerate(locations):
            if location is not None:
                rows_of.setdefault(location[0], []).append(row)
        for bucket, rows in rows_of.items():
            start, stop = rows[0], rows[-1] + 1
            slot_map = [-1] * (stop - start)
            for row in rows:
                slot_map[row - start] = locations[row][1]
            mask = sum(1 << slot for slot in {locations[row][1] for row in rows})
            self.buckets.append(_BucketRows(bucket, start, stop, LoRABatch.from_slot_map(slot_map, self.device), mask))

    # -- embedding LoRA and trained heads (loramux.kernels.head_rows) ---------------------------------
    @property
    def embeds(self) -> bool:
        """Whether this step has rows whose embedding an adapter changes (then the model calls `embed`)."""
        return self.heads is not None and self.heads.embeds

    @property
    def replaces_logits(self) -> bool:
        """Whether this step's logits rows include an adapter's trained head (then the model calls `logits`)."""
        return self.heads is not None and self.heads.heads

    def embed(self, x: torch.Tensor, ids: torch.Tensor, embed_scale: float | None) -> torch.Tensor:
        """The step's embeddings with each row's adapter's changes, the model's `embed_scale` applied."""
        return self.heads.embed(x, ids, embed_scale)

    def logits(self, hidden: torch.Tensor, base_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Logits of the step's logits rows: each row's adapter's head where it has one, `base_head` else."""
        return self.heads.logits(hidden, base_head)

    def apply_experts(self, y: torch.Tensor, x: torch.Tensor, groups: ExpertGroups,
                      key: tuple[int, str] | None) -> torch.Tensor:
        """Add the expert-LoRA deltas of this step's adapters to y = grouped expert projection of x, in place:
        y and x hold the layer's (token, expert) pairs in `groups`' sorted order. Returns y."""
        for bucket in self.buckets:
            weights = self.experts_of(bucket.bucket, key)
            if weights is None or not weights.targeted_mask & bucket.slots_mask:
                continue
            if bucket.token_slots is None:  # once per step: the slot of each of the step's rows in this bucket
                slots = torch.full((self.num_rows,), -1, dtype=torch.long, device=self.device)
                slots[bucket.start:bucket.stop] = bucket.batch.slot_map
                bucket.token_slots = slots
            if self._expert_plans[0] is not groups:
                self._expert_plans = (groups, {})
            plans = self._expert_plans[1]
            if id(bucket) not in plans:
                plans[id(bucket)] = plan_expert_lora(virtual_slots(groups, bucket.token_slots))
            plan = plans[id(bucket)]
            expert_lora(y, x, weights.a, weights.b, weights.scale, plan.vslots, impl=self.impl, plan=plan)
        return y

    def apply(self, y: torch.Tensor, x: torch.Tensor, key: tuple[int, str] | None) -> torch.Tensor:
        """Add the LoRA deltas of this step's adapters to y = base(x), in place; returns y."""
        for bucket in self.buckets:
            weights = self.weights_of(bucket.bucket, key)
            if weights is None or not weights.targeted_mask & bucket.slots_mask:
                continue
            whole = bucket.start == 0 and bucket.stop == x.shape[0]  # then no slicing views are needed
            ys, xs = (y, x) if whole else (y[bucket.start:bucket.stop], x[bucket.start:bucket.stop])
            lora_shrink_expand(ys, xs, weights.a, weights.b, weights.offsets, weights.scale, bucket.batch,
                               impl=self.impl, cost=self.cost, operand_cache=weights.operand_cache)
            if weights.dora_g is not None:
                dora_rescale(ys, weights.dora_g, weights.dora_bias, bucket.batch, impl=self.impl)
        return y
