"""The device level of adapters: a byte budget of adapter memory in buckets of one rank and target set.

Adapters are grouped by (rank, merged projections they target): each such group present gets a bucket,
which holds, for each of those projections in every layer, a stack of `capacity` slots of exactly that
rank (`LoRALayerWeights`). So an adapter occupies, and each of its rows costs, its own rank on its own
projections: a rank-8 adapter next to a rank-64 one never does rank-64 work, and one on q/v only never
touches the MLP. (Within a merged projection every slice is held: a q/v adapter also holds zeros for k.)
An adapter with per-module ranks or scales or a layer subset (rank_pattern, alpha_pattern,
layers_to_transform, ...) goes to a bucket whose key lists its layout (`BucketKey.layer_ranks`, see
`pool_layout`): there each (layer, projection) holds only the slices it covers, each at its own rank (A rows
of slice i right after those of slice i-1, so the kernels take per-slice ranks; no zero padding, even within
a merged projection) with its own scale ([n_slices, slots] scales), and modules it leaves alone hold nothing.
A slot also holds its adapter's embedding LoRA and trained heads when it has them (`BucketKey.extras`, see
`loramux.adapters.residency.head_slots`), counted in `slot_bytes` like the projections.
The buckets share one byte budget; which adapter sits where, and when buckets grow or shrink, is decided by
`loramux.adapters.residency.locations` (torch-free), which calls the operations here, each on the bucket named by
its `key` (`BucketKey`: the rank and the projections targeted); `then`, where taken, runs under the pool
lock right after the change:

* `resize(key, capacity, keep, then)`: a bucket's new capacity, keeping the listed slots (in that order at
  the front). Done rarely (the mix of ranks changed); costs one copy of what is kept.
* `load(key, slot_of, adapter)`: copy an adapter from host RAM into a slot. With `async_loads` the copy
  runs on a helper thread (and a side CUDA stream on GPU) while the engine keeps stepping; the returned
  future completes when the weights are in place. `slot_of()` is read at copy time, under the pool lock,
  because the slot may move (swap, resize) while the load is queued.
* `swap(key, i, j, then)`: exchange two slots. On CPU the LoRA ops read a contiguous range of slots as a view
  of the stacks and copy any other set first (kernels/torch_ops.py), so the residency keeps a bucket's
  active adapters in its lowest slots (`needs_active_prefix`); on GPU the kernels read any slot and nothing
  is swapped.

DoRA adapters live in their own buckets (`BucketKey.dora`, so plain buckets never pay): each of their slots
also holds, per (layer, projection), DoRA's fixed per-output-channel scale g = m / ||W + s·B·A||_row
(`LoRALayerWeights.dora_g`, 1 on slices the adapter does not cover), computed from the model's weights when
the adapter is written (loramux.adapters.formats.dora) and counted in `slot_bytes`.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from loramux.adapters.formats.dora import dora_scale, unservable_reason
from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.residency import expert_slots, head_slots, pool_layout
from loramux.kernels.wrapper import LoRALayerWeights, LoRAWrapper
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES, LlamaModel


def _a_buffer(num_slots: int, rows: int, d_in: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros for A as the kernels see it, [slots, rows, d_in]. On CPU it lives as [slots, d_in, rows], so
    that a range of slots is one batched-GEMM operand [slots, d_in, rows] in the layout CPU BLAS reads
    fastest at small batch (see MergedLinear); on GPU it lives as is (contiguous rows for the Triton tiles)."""
    if device.type == "cpu":
        return torch.zeros(num_slots, d_in, rows, dtype=dtype, device=device).transpose(1, 2)
    return torch.zeros(num_slots, rows, d_in, dtype=dtype, device=device)


class BucketKey(NamedTuple):
    """The shape every slot of a bucket has; adapters of equal keys share a bucket. A tuple, so keys order
    (decode rows sort by bucket) and hash. Fields past `paths` default to "the plain case", so a plain LoRA
    adapter's key is (rank, paths) with the defaults; each adapter format that changes a slot's shape or
    what a row computes records it in its own field."""

    rank: int  # the rank of every targeted (layer, projection) unless `layer_ranks` says otherwise
    paths: tuple[str, ...]  # merged projection paths targeted, in model order
    # per-module ranks / layer subsets: ((layer, path, (rank of each slice, 0 = not covered)), ...) for each
    # (layer, path) covered (see pool_layout); empty: every layer of `paths` at `rank`, one scale per slot
    layer_ranks: tuple = ()
    dora: bool = False  # slots carry DoRA's per-output-channel magnitude scale
    extras: tuple = ()  # per-slot tensors outside the decoder projections (embedding LoRA, trained heads)
    experts: tuple = ()  # LoRA on routed experts: ((projection, rank), ...), see expert_slots


class _Bucket:
    """The slot stacks of one bucket: per layer, per projection path it covers, its LoRALayerWeights."""

    def __init__(self, model: LlamaModel, key: BucketKey, capacity: int, dtype: torch.dtype, device: torch.device):
        key = BucketKey(*key)
        rank, paths, self.capacity = key.rank, key.paths, capacity
        self.rank = rank
        self.weights: dict[tuple[int, str], LoRALayerWeights] = {}
        # Embedding LoRA and trained heads (adapters/residency/head_slots.py): one stack per buffer, slots first.
        cfg = model.config
        self.extras = head_slots.allocate(key.extras, capacity, cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.experts = expert_slots.allocate(key.experts, model, capacity, dtype, device)
        if key.layer_ranks:
            self.scale = None
            self.scales = self._patterned(model, key.layer_ranks, key.dora, capacity, dtype, device)
            return
        self.scale = torch.zeros(capacity, dtype=torch.float32, device=device)  # one per slot, all projections
        self.scales = [self.scale]  # every scale tensor of the bucket (slots on the last dimension)
        for layer, path, module in model.lora_modules():
            if path not in paths:
                continue
            self.weights[(layer, path)] = LoRALayerWeights(
                a=_a_buffer(capacity, len(module.slices) * rank, module.in_features, dtype, device),
                # B lives as [slots, R, d_out] (so slots 0..k stack into one GEMM operand without a copy)
                # and is handed to the kernels as the [slots, d_out, R] view their semantics name.
                b=[torch.zeros(capacity, rank, size, dtype=dtype, device=device).transpose(1, 2)
                   for _, size in module.slices],
                offsets=[module.slice_range(name)[0] for name, _ in module.slices],
                scale=self.scale, names=[name for name, _ in module.slices], targeted=[False] * capacity,
                dora_g=torch.ones(capacity, module.out_features, dtype=dtype, device=device) if key.dora else None,
                dora_bias=None if module.bias is None or not key.dora else module.bias.data)

    def _patterned(self, model: LlamaModel, table: tuple, dora: bool, capacity: int, dtype: torch.dtype,
                   device: torch.device) -> list[torch.Tensor]:
        """A patterned bucket's stacks: per listed (layer, path), its covered slices at their own ranks."""
        modules = {(layer, path): module for layer, path, module in model.lora_modules()}
        scales = []
        for layer, path, ranks in table:
            module = modules[(layer, path)]
            live = [(name, size, r) for (name, size), r in zip(module.slices, ranks) if r]
            scale = torch.zeros(len(live), capacity, dtype=torch.float32, device=device)
            scales.append(scale)
            self.weights[(layer, path)] = LoRALayerWeights(
                a=_a_buffer(capacity, sum(r for _, _, r in live), module.in_features, dtype, device),
                b=[torch.zeros(capacity, r, size, dtype=dtype, device=device).transpose(1, 2) for _, size, r in live],
                offsets=[module.slice_range(name)[0] for name, _, _ in live],
                scale=scale, names=[name for name, _, _ in live], targeted=[False] * capacity,
                dora_g=torch.ones(capacity, module.out_features, dtype=dtype, device=device) if dora else None,
                dora_bias=None if module.bias is None or not dora else module.bias.data)
        return scales

    def copy_slot(self, src: _Bucket, src_slot: int, dst_slot: int) -> None:
        for key, weights in self.weights.items():
            other = src.weights[key]
            weights.a[dst_slot].copy_(other.a[src_slot])
            for b, other_b in zip(weights.b, other.b):
                b[dst_slot].copy_(other_b[src_slot])
            if weights.dora_g is not None:
                assert other.dora_g is not None  # src has the same key, so DoRA scales too
                weights.dora_g[dst_slot].copy_(other.dora_g[src_slot])
            weights.set_targeted(dst_slot, other.targeted[src_slot])
        for scale, other in zip(self.scales, src.scales):
            scale[..., dst_slot] = other[..., src_slot]
        for name, stack in self.extras.items():
            stack[dst_slot].copy_(src.extras[name][src_slot])
        expert_slots.copy_slot(self.experts, src.experts, src_slot, dst_slot)


class DevicePool:
    def __init__(self, model: LlamaModel, budget_bytes: int, dtype: torch.dtype, device: torch.device | str,
                 lora_impl: str = "auto", async_loads: bool = True):
        self.model, self.budget, self.dtype, self.device = model, budget_bytes, dtype, torch.device(device)
        element = torch.finfo(dtype).bits // 8
        # Bytes one unit of rank costs per projection path: A rows and B columns of its slices, every layer.
        self.bytes_per_rank: dict[str, int] = {}
        self.shapes = {path: (m.in_features, m.slices) for _, path, m in model.lora_modules()}
        # How many layers have each path (a hybrid's layers have linear_attn.* or self_attn.*; a MoE's router or MLP).
        self.path_layers: dict[str, int] = {}
        for _, path, _ in model.lora_modules():
            self.path_layers[path] = self.path_layers.get(path, 0) + 1
        self.element = element
        self.dora_bytes: dict[str, int] = {}  # bytes of one slot's DoRA scales per projection path, every layer
        for _, path, m in model.lora_modules():
            self.bytes_per_rank[path] = self.bytes_per_rank.get(path, 0) + \
                (len(m.slices) * m.in_features + m.out_features) * element
            self.dora_bytes[path] = self.dora_bytes.get(path, 0) + m.out_features * element
        self.buckets: dict[BucketKey, _Bucket] = {}
        self.needs_active_prefix = self.device.type == "cpu"
        self.wrapper = LoRAWrapper(lora_impl, self.device, self._weights_of)
        for layer, path, module in model.lora_modules():
            module.lora_wrapper, module.lora_key = self.wrapper, (layer, path)
        for layer, path, expert_module in model.expert_modules():  # LoRA on routed experts (expert_slots)
            expert_module.lora_wrapper, expert_module.lora_key = self.wrapper, (layer, path)
        self.wrapper.experts_of = self._experts_of
        # Embedding LoRA and trained heads: the model asks the same wrapper, which reads the slots' extras.
        self.wrapper.extras_of = self._extras_of
        model.lora_wrapper = self.wrapper
        self._lock = threading.Lock()  # one copy at a time into the pool: loads, swaps, resizes
        # One copy thread. On CPU it copies with one OpenMP thread: a second team of intra-op threads next
        # to the engine's would contend for the same cores (measured: 6x slower decode steps while both
        # teams existed, even after the copies ended).
        self._loader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="loramux-device-load",
            initializer=(lambda: torch.set_num_threads(1)) if self.device.type == "cpu" else None) \
            if async_loads else None
        self._stream = torch.cuda.Stream(self.device) if async_loads and self.device.type == "cuda" else None

    # -- sizes -------------------------------------------------------------------------------------
    def bucket_of(self, adapter: LoRAAdapter) -> BucketKey:
        """The bucket an adapter belongs in: its rank and the merged projections it targets."""
        paths = {PROJECTION_SLICES[target][0] for _, target in adapter.weights}
        if adapter.magnitudes:
            self._check_dora(adapter)
        head_slots.absorb_base_copies(adapter, self.model)  # once: PEFT's saved copies of the base embedding
        return BucketKey(adapter.rank, tuple(p for p in LORA_MODULES if p in paths),
                         layer_ranks=pool_layout.layer_ranks(adapter, self.shapes, self.path_layers),
                         dora=bool(adapter.magnitudes), extras=head_slots.extras_of(adapter),
                         experts=expert_slots.key_of(adapter))

    def _check_dora(self, adapter: LoRAAdapter) -> None:
        """ValueError (the message says what to do) where this model cannot serve DoRA exactly."""
        for layer, target in adapter.magnitudes:
            reason = unservable_reason(self.model.projection(layer, PROJECTION_SLICES[target][0]))
            if reason:
                raise ValueError(f"DoRA adapter {adapter.name!r} cannot be served exactly: {reason}")

    def slot_bytes(self, key: BucketKey) -> int:
        """Device bytes one slot of bucket `key` occupies (its projections, every layer; or, patterned, the
        modules its `layer_ranks` lists, with their per-slice scales)."""
        key = BucketKey(*key)
        if key.layer_ranks:
            lora = pool_layout.lora_slot_bytes(key.rank, key.paths, key.layer_ranks, self.shapes, self.path_layers,
                                               self.element)
            # DoRA: one g row of the merged projection's width per (layer, path) the table lists.
            dora = sum(sum(size for _, size in self.shapes[path][1]) for _, path, _ in key.layer_ranks) * self.element
        else:
            lora = key.rank * sum(self.bytes_per_rank[p] for p in key.paths)
            dora = sum(self.dora_bytes[p] for p in key.paths)
        cfg = self.model.config
        extras = head_slots.extras_bytes(key.extras, cfg.vocab_size, cfg.hidden_size, self.element)
        experts = expert_slots.slot_bytes(key.experts, cfg, self.element)
        return lora + (dora if key.dora else 0) + extras + experts

    def capacity(self, key: BucketKey) -> int:
        bucket = self.buckets.get(key)
        return bucket.capacity if bucket else 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated to buckets (<= budget)."""
        return sum(b.capacity * self.slot_bytes(k) for k, b in self.buckets.items())

    # -- what the kernels read ---------------------------------------------------------------------
    def _weights_of(self, key: BucketKey, module: tuple[int, str]) -> LoRALayerWeights | None:
        bucket = self.buckets.get(key)
        return None if bucket is None else bucket.weights.get(module)

    def _experts_of(self, key: BucketKey, module: tuple[int, str]):
        bucket = self.buckets.get(key)
        return None if bucket is None else bucket.experts.get(module)

    def _extras_of(self, key: BucketKey) -> dict[str, torch.Tensor]:
        bucket = self.buckets.get(key)
        return {} if bucket is None else bucket.extras

    # -- operations (called by the residency) ------------------------------------------------------
    def resize(self, key: BucketKey, capacity: int, keep: list[int], then: Callable[[], None] = lambda: None) -> None:
        """Give bucket `key` `capacity` slots; old slot keep[i] moves to slot i; the rest is dropped.
        `then` runs under the pool lock right after, so a queued load reads its new slot."""
        if len(keep) > capacity:
            raise ValueError("cannot keep more slots than the new capacity")
        extra = (capacity - self.capacity(key)) * self.slot_bytes(key)
        if self.nbytes + extra > self.budget:
            raise MemoryError(f"a bucket of {capacity} slots for {key} exceeds the adapter pool budget")
        with self._lock:
            old = self.buckets.pop(key, None)
            if capacity > 0:
                new = _Bucket(self.model, key, capacity, self.dtype, self.device)
                for dst, src in enumerate(keep):
                    assert old is not None  # slots to keep: the bucket had a capacity
                    new.copy_slot(old, src, dst)
                self.buckets[key] = new
            then()

    def swap(self, key: BucketKey, i: int, j: int, then: Callable[[], None] = lambda: None) -> None:
        """Exchange slots i and j of bucket `key`; `then` runs under the pool lock (see resize)."""
        with self._lock:
            bucket = self.buckets[key]
            for weights in bucket.weights.values():
                for stack in (weights.a, *weights.b):
                    held = stack[i].clone()
                    stack[i].copy_(stack[j])
                    stack[j].copy_(held)
                if weights.dora_g is not None:
                    weights.dora_g[[i, j]] = weights.dora_g[[j, i]]
                flag_i, flag_j = weights.targeted[i], weights.targeted[j]
                weights.set_targeted(i, flag_j)
                weights.set_targeted(j, flag_i)
            for scale in bucket.scales:
                scale[..., [i, j]] = scale[..., [j, i]]
            for stack in bucket.extras.values():
                stack[[i, j]] = stack[[j, i]]
            expert_slots.swap(bucket.experts, i, j)
            then()

    def load(self, key: BucketKey, slot_of: Callable[[], int], adapter: LoRAAdapter) -> concurrent.futures.Future:
        """Copy `adapter` into its slot (`slot_of()` at copy time); a future of the copy's duration (s)."""
        if self.bucket_of(adapter) != key:
            raise ValueError(f"adapter {adapter.name!r} belongs in bucket {self.bucket_of(adapter)}, not {key}")
        if self._loader is not None:
            return self._loader.submit(self._timed_write, key, slot_of, adapter)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(self._timed_write(key, slot_of, adapter))
        except Exception as exc:  # noqa: BLE001 - the caller sees it through the future, as with async loads
            future.set_exception(exc)
        return future

    def _timed_write(self, key: BucketKey, slot_of: Callable[[], int], adapter: LoRAAdapter) -> float:
        start = time.perf_counter()
        with self._lock:
            if self._stream is None:
                self._write(self.buckets[key], slot_of(), adapter)
            else:  # a side stream, so the copy overlaps the engine's kernels on the default stream
                with torch.cuda.stream(self._stream):
                    self._write(self.buckets[key], slot_of(), adapter)
                self._stream.synchronize()
        return time.perf_counter() - start

    def _write(self, bucket: _Bucket, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot`, zeroing whatever the previous occupant left there."""
        for weights in bucket.weights.values():
            weights.a[slot].zero_()
            for b in weights.b:
                b[slot].zero_()
            if weights.dora_g is not None:
                weights.dora_g[slot].fill_(1)
            weights.set_targeted(slot, False)
        for (layer, target), (a, b) in adapter.weights.items():
            path, slice_name = PROJECTION_SLICES[target]
            weights = bucket.weights[(layer, path)]
            index = weights.names.index(slice_name)
            start = sum(weights.ranks[:index])  # slice i's A rows follow those of the slices before it
            weights.a[slot, start:start + a.shape[0]].copy_(a, non_blocking=True)
            weights.b[index][slot].copy_(b, non_blocking=True)
            weights.set_targeted(slot, True)
            if weights.scale.dim() == 2:  # patterned: each module its own scale
                weights.scale[index, slot] = adapter.scale_of((layer, target))
            if (layer, target) in adapter.magnitudes:
                module = self.model.projection(layer, path)
                g = dora_scale(module, slice_name, a, b, adapter.scale_of((layer, target)),
                               adapter.magnitudes[(layer, target)])
                lo, hi = module.slice_range(slice_name)
                assert weights.dora_g is not None  # a DoRA module puts its adapter in a DoRA bucket
                weights.dora_g[slot, lo:hi].copy_(g)
        if bucket.scale is not None:
            bucket.scale[slot] = adapter.scale
        head_slots.write(bucket.extras, slot, adapter)
        expert_slots.write(bucket.experts, slot, adapter)

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)
