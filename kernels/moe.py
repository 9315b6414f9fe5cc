"""Grouped mixture-of-experts ops: routing pairs sorted by expert, each expert's GEMM on its own rows, and a
per-(adapter slot, expert) LoRA delta. Torch on CPU, Triton on CUDA (`loramux.kernels.moe_triton`), behind one
dispatch as `loramux.kernels.ops`.

A step routes each token row t to k experts (expert_ids [T, k]); each (t, j) is a "pair". `group_by_expert`
sorts the pairs by expert once per layer, so that every expert's pairs form one contiguous run:

    grouped_matmul: out[p] = x[p] @ w[e_p] (+ bias[e_p])        x in sorted pair order, w [E, d_in, d_out]
    expert_lora:    y[p] += (x[p] @ a[v_p]^T) @ b[v_p]^T * scale[v_p]   for rows with v_p >= 0

where v = slot * E + expert is a "virtual slot" (`virtual_slots`): an adapter's per-expert LoRA matrices
stacked as [slots * E, ...]. Only experts that some pair picks are ever read; `dense_expert_matmul` is the
"compute every expert" baseline for benchmarks.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from loramux.kernels.ops import _use_triton
from loramux.kernels.segments import NO_ADAPTER, Segments

# Slots are packed under the expert in one int64 sort key (expert << SLOT_BITS | slot + 1).
SLOT_BITS = 32

# expert_lora's torch strategy (pick_lora_strategy). "gather" copies each live row's own A and B out of the
# stacks and multiplies them in two torch.bmm calls: its cost grows with rows x bytes of one v's A and B.
# "segments" runs two small GEMMs per distinct v on its run of rows, reading each v's matrices once: a fixed
# ~10-15 us of Python and dispatch per distinct v. Gather while the bytes it copies per distinct v, (rows per
# v) x (bytes of one v's A and B), stay under this: on the 2-core VM (one thread, float32, ranks 8-64, d_in =
# d_out 64-2048, 1-32 rows per v, 8-64 distinct v) the two crossed between 64 and 256 KiB in every case.
GATHER_MAX_BYTES_PER_SLOT = 128 * 1024


@dataclass
class ExpertGroups:
    """A step's (token, k) routing pairs sorted by expert (then by `row_slot`, see group_by_expert)."""

    order: torch.Tensor  # [N] long: pair p of the sorted order is flat pair order[p] of expert_ids.view(-1)
    tokens: torch.Tensor  # [N] long: token row of sorted pair p (= order // k)
    experts: torch.Tensor  # [N] long: expert of sorted pair p
    counts: list[int]  # per expert in `present`: how many sorted pairs it has
    present: list[int]  # experts with >= 1 pair, ascending
    offsets: list[int]  # start of present[i]'s run in the sorted order (len(present) + 1 entries)
    num_experts: int
    _seg_tensors: dict = field(default_factory=dict, repr=False)

    @property
    def num_pairs(self) -> int:
        return self.offsets[-1]

    @property
    def max_count(self) -> int:
        return max(self.counts, default=0)

    def seg_tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(starts, lengths, experts) of the present experts' runs as int32 on `device`, for the Triton kernel
        (built on first use per device)."""
        key = str(torch.device(device))
        if key not in self._seg_tensors:
            self._seg_tensors[key] = tuple(torch.tensor(v, dtype=torch.int32, device=device)
                                           for v in (self.offsets[:-1], self.counts, self.present))
        return self._seg_tensors[key]


def group_by_expert(expert_ids: torch.Tensor, num_experts: int, row_slot: torch.Tensor | None = None
                    ) -> ExpertGroups:
    """Sort the routing pairs of expert_ids [T, k] (long, each row's top-k experts) by expert, stably (a
    token's pairs keep token order within an expert). With row_slot ([T] long, the adapter slot of each token
    row, -1 none), ties are broken by slot, so that each (expert, slot) run is contiguous too.
    One sort, one bincount and one host sync (the counts)."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [tokens, k], got shape {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).long()
    if row_slot is None:
        experts, order = torch.sort(flat, stable=True)
    else:
        if row_slot.shape != (expert_ids.shape[0],):
            raise ValueError(f"row_slot must be [{expert_ids.shape[0]}], got shape {tuple(row_slot.shape)}")
        slot = row_slot.long().repeat_interleave(k) + 1  # -1 (no adapter) sorts first within its expert
        key, order = torch.sort((flat << SLOT_BITS) | slot, stable=True)
        experts = key >> SLOT_BITS
    per_expert = torch.bincount(flat, minlength=num_experts).tolist()  # raises on a negative expert id
    if len(per_expert) > num_experts:
        raise ValueError(f"expert ids must be < num_experts ({num_experts}), got {len(per_expert) - 1}")
    present = [e for e, c in enumerate(per_expert) if c]
    counts = [per_expert[e] for e in present]
    return ExpertGroups(order, torch.div(order, k, rounding_mode="floor"), experts, counts, present,
                        [0, *itertools.accumulate(counts)], num_experts)


def virtual_slots(groups: ExpertGroups, row_slot: torch.Tensor) -> torch.Tensor:
    """[N] long: v = slot * E + expert of each sorted pair (slot = row_slot of its token), -1 where the token
    has no adapter: the index into per-expert LoRA stacks flattened as [slots * E, ...]."""
    slot = row_slot.long().index_select(0, groups.tokens)
    return torch.where(slot >= 0, slot * groups.num_experts + groups.experts, NO_ADAPTER)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups, bias: torch.Tensor | None = None,
                   impl: str | None = None) -> torch.Tensor:
    """out [N, d_out], out[p] = x[p] @ w[e_p] (+ bias[e_p]), for x [N, d_in] in sorted pair order, w [E, d_in,
    d_out] (any strides: a transposed view of an [E, d_out, d_in] stack is read in place) and bias [E, d_out]
    or None. Experts without pairs are never read.
    On CPU, hand w over as a transposed view of an [E, d_out, d_in] stack (nn.Linear's layout): MKL then reads
    each touched expert's weight about once for runs of 1-3 rows (the decode case), while a contiguous [E, d_in,
    d_out] stack costs about twice that for runs of 2-3 rows (measured on the 2-core VM, 2048 -> 1536)."""
    if x.shape[0] != groups.num_pairs:
        raise ValueError(f"x has {x.shape[0]} rows for {groups.num_pairs} pairs")
    if _use_triton(x, impl):
        from loramux.kernels.moe_triton import grouped_matmul_triton

        return grouped_matmul_triton(x, w, groups, bias)
    out = x.new_empty(x.shape[0], w.shape[2])
    for e, lo, hi in zip(groups.present, groups.offsets, groups.offsets[1:]):
        if bias is None:
            torch.mm(x[lo:hi], w[e], out=out[lo:hi])
        else:
            torch.addmm(bias[e], x[lo:hi], w[e], out=out[lo:hi])
    return out


def grouped_packed_matmul(x: torch.Tensor, packed: list[torch.Tensor], out_features: int, groups: ExpertGroups,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """As grouped_matmul, on CPU, with each expert's weight in oneDNN's packed layout (`packed[e]`, from
    loramux.model.cpu_linear.pack). At the few rows per expert of a decode step oneDNN's packed bf16 kernels
    read an expert at 20-21 GB/s where torch.mm reads a down projection at 13 (measured at Qwen3-30B-A3B's
    shapes, 2 cores with AMX): the grouped experts are most of an MoE decode step."""
    from loramux.model import cpu_linear  # the packed linear op, shared with the dense layers

    if x.shape[0] != groups.num_pairs:
        raise ValueError(f"x has {x.shape[0]} rows for {groups.num_pairs} pairs")
    out = x.new_empty(x.shape[0], out_features)
    for e, lo, hi in zip(groups.present, groups.offsets, groups.offsets[1:]):
        out[lo:hi] = cpu_linear.packed_linear(x[lo:hi], packed[e], None if bias is None else bias[e])
    return out


def dense_expert_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[E, T, d_out]: every row of x [T, d_in] through every expert of w [E, d_in, d_out] (a benchmark's
    'compute every expert' baseline)."""
    out = torch.matmul(x.unsqueeze(0), w)
    return out if bias is None else out.add_(bias.unsqueeze(1))


# -- expert LoRA ------------------------------------------------------------------------------------------
@dataclass
class ExpertLoRAPlan:
    """How expert_lora lays out the rows of one vslots tensor (`plan_expert_lora`). Depends only on vslots, so
    one plan serves every op on the same pairs (a layer's gate_up and down projections)."""

    num_rows: int
    num_live: int  # rows with v >= 0
    # Runs of rows sharing one v, as (v, start, stop): positions of rows in y itself when `order` is None
    # (the rows already form one run per v, as group_by_expert with row_slot leaves them), else positions in
    # the live rows gathered in `order` (sorted by v).
    runs: list[tuple[int, int, int]]
    order: torch.Tensor | None
    vslots: torch.Tensor
    max_v: int
    strategy: str | None = None  # the torch path's strategy, forced; None: pick_lora_strategy per op
    _gather: tuple | None = field(default=None, repr=False)

    @property
    def num_distinct(self) -> int:
        return len(self.runs)

    def gather_index(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(live row indices, or None when every row is live; each live row's v)."""
        if self._gather is None:
            if self.num_live == self.num_rows:
                self._gather = (None, self.vslots)
            else:
                rows = torch.nonzero(self.vslots >= 0).squeeze(1)
                self._gather = (rows, self.vslots.index_select(0, rows))
        return self._gather

    def segments(self) -> Segments:
        """The runs as kernel segments (rows of y itself, or of the gathered live rows)."""
        starts = tuple(lo for _, lo, _ in self.runs)
        lengths = tuple(hi - lo for _, lo, hi in self.runs)
        slots = tuple(v for v, _, _ in self.runs)
        return Segments(starts, lengths, slots, self.num_rows if self.order is None else self.num_live,
                        max(lengths, default=0), slots, max(slots, default=NO_ADAPTER))


def pick_lora_strategy(num_live: int, num_distinct: int, slot_bytes: int) -> str:
    """'gather' while num_live / num_distinct * slot_bytes (the bytes of one v's A and B) stays under
    GATHER_MAX_BYTES_PER_SLOT, else 'segments'. E.g. a decode step of one row per v gathers rank-16 matrices
    while d_in + d_out < 2048 (float32); a MoE projection of 2048 -> 1536 at rank 16 (224 KiB) takes segments."""
    return "gather" if num_live * slot_bytes < GATHER_MAX_BYTES_PER_SLOT * num_distinct else "segments"


def plan_expert_lora(vslots: torch.Tensor, strategy: str | None = None) -> ExpertLoRAPlan:
    """The layout of vslots [N] long (-1: no adapter). One host sync: the runs of equal v. If some v occurs in
    more than one run, the live rows are sorted by v (one stable sort, no further sync: the counts per v are
    summed from the runs on the host). `strategy` forces the torch path's "gather" or "segments"."""
    if strategy not in (None, "gather", "segments"):
        raise ValueError(f"expert LoRA strategy must be 'gather' or 'segments', got {strategy!r}")
    vslots = vslots.long()
    values, counts = torch.unique_consecutive(vslots, return_counts=True)
    values, counts = values.tolist(), counts.tolist()
    if values and min(values) < NO_ADAPTER:
        raise ValueError(f"virtual slots must be >= -1, got {min(values)}")
    runs: list[tuple[int, int, int]] = []
    per_v: dict[int, int] = {}
    start = 0
    for v, c in zip(values, counts):
        if v >= 0:
            runs.append((v, start, start + c))
            per_v[v] = per_v.get(v, 0) + c
        start += c
    num_live = sum(per_v.values())
    order = None
    if len(per_v) != len(runs):  # some v in several runs: gather the live rows sorted by v
        _, order = torch.sort(vslots, stable=True)
        order = order[vslots.shape[0] - num_live:]
        runs, pos = [], 0
        for v in sorted(per_v):
            runs.append((v, pos, pos + per_v[v]))
            pos += per_v[v]
    return ExpertLoRAPlan(vslots.shape[0], num_live, runs, order, vslots, max(per_v, default=NO_ADAPTER), strategy)


def _index_stack(stack: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """stack[index] for a [V, m, n] stack, copied in the order its memory is laid out (the slot pool's CPU
    stacks are transposed views), so the copy reads each matrix sequentially."""
    if stack.stride(1) == 1 and stack.stride(2) >= stack.shape[1]:  # [V, n, m] storage seen transposed
        return stack.transpose(1, 2).index_select(0, index).transpose(1, 2)
    return stack.index_select(0, index)


def _lora_gather(y, x, a, b, scale, plan: ExpertLoRAPlan) -> None:
    rows, vs = plan.gather_index()
    xs = x if rows is None else x.index_select(0, rows)
    t = torch.bmm(xs.unsqueeze(1), _index_stack(a, vs).transpose(1, 2))  # [L, 1, R]
    t.mul_(scale.index_select(0, vs).to(t.dtype).view(-1, 1, 1))
    delta = torch.bmm(t, _index_stack(b, vs).transpose(1, 2)).squeeze(1)  # [L, d_out]
    if rows is None:
        y.add_(delta)
    else:
        y.index_add_(0, rows, delta)


def _lora_segments(y, x, a, b, scale, plan: ExpertLoRAPlan) -> None:
    if plan.order is None:  # each v's rows are one run of y: multiply and accumulate in place
        for v, lo, hi in plan.runs:
            t = torch.mm(x[lo:hi], a[v].t()).mul_(scale[v])
            y[lo:hi].addmm_(t, b[v].t())
        return
    xs = x.index_select(0, plan.order)
    delta = y.new_empty(plan.num_live, y.shape[1])
    for v, lo, hi in plan.runs:
        torch.mm(torch.mm(xs[lo:hi], a[v].t()).mul_(scale[v]), b[v].t(), out=delta[lo:hi])
    y.index_add_(0, plan.order, delta)


def expert_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                vslots: torch.Tensor, impl: str | None = None, plan: ExpertLoRAPlan | None = None) -> None:
    """In place, per row p with v = vslots[p] >= 0: y[p] += (x[p] @ a[v]^T) @ b[v]^T * scale[v]; rows with
    v < 0 are untouched. x [N, d_in], y [N, d_out] (whole rows), a [V, R, d_in], b [V, d_out, R] (any strides),
    scale [V] float32, V = adapter slots * experts (see virtual_slots).
    `plan`, from plan_expert_lora(vslots), saves rebuilding the layout (and its host sync) when several ops
    share vslots; it may also force the torch path's strategy (default: pick_lora_strategy)."""
    if x.shape[0] != vslots.shape[0] or y.shape[0] != vslots.shape[0]:
        raise ValueError(f"x ({x.shape[0]}), y ({y.shape[0]}) and vslots ({vslots.shape[0]}) rows differ")
    plan = plan or plan_expert_lora(vslots)
    if plan.max_v >= a.shape[0]:
        raise ValueError(f"virtual slot {plan.max_v} out of range for {a.shape[0]} stacked adapters")
    if not plan.num_live:
        return
    if _use_triton(x, impl):
        from loramux.kernels.moe_triton import expert_lora_triton

        expert_lora_triton(y, x, a, b, scale, plan)
        return
    slot_bytes = (a.shape[1] * a.shape[2] + b.shape[1] * b.shape[2]) * a.element_size()
    if (plan.strategy or pick_lora_strategy(plan.num_live, plan.num_distinct, slot_bytes)) == "gather":
        _lora_gather(y, x, a, b, scale, plan)
    else:
        _lora_segments(y, x, a, b, scale, plan)
