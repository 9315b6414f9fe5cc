"""Decode steps from fixed-shape buffers, replayed as CUDA graphs (as vLLM and SGLang do).

A step whose work is plain decodes only (no prefill chunk, no speculative verification) and at most the
largest batch bucket runs here; anything else runs eagerly (`ModelRunner.prepare`). Everything such a step
reads lives in one flat int64 device buffer filled by a single host -> device copy before the forward:

    [input ids | positions | KV slot of each row | context lengths | per rank bucket: slot of each row | block tables]

for `bs` rows, `bs` being the smallest batch bucket (1, 2, 4, 8, 16, 24, 32, ...) that holds the step, and
block tables `nb` wide, `nb` the smallest block bucket (8, 16, 32, ... blocks, up to max_model_len) that
holds the longest context. Padding rows read token 0 at position 0, write their KV into the runner's
scratch block (one block past the block manager's, never handed out) and attend to it alone; their logits
are dropped. LoRA goes through `StaticLoRA` (per-token slot indices, BGMV kernels: loramux.kernels.bgmv),
so one graph per (bs, nb) serves every mix of adapters.

A graph bakes in the addresses of the rank buckets' weight buffers. The device pool replaces a bucket's
buffers when it resizes it (a new `_Bucket`, loramux.adapters.residency.device_pool) and adds or drops buckets as
the mix of ranks changes; `LoRABuckets` notices both (an identity check on one probe per bucket, each
step) and bumps a generation, which drops every graph: they are captured again, lazily, on next use.

`capture=False` runs the same static-buffer forward eagerly, without capturing: that is how CPU tests
(and `bench/gpu_check.py --tiny`) exercise this path; only capture and replay need CUDA.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from loramux.engine.scheduling.block_manager import RELEASED
from loramux.kernels.bgmv import StaticLoRA
from loramux.kernels.wrapper import LoRALayerWeights
from loramux.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

ModuleKey = tuple[int, str]  # (layer, projection path): a LoRA projection's key

MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly (launch overhead is small next to their work)
MIN_GRAPH_BLOCKS = 8  # the narrowest block-table bucket


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a graph is captured for: 1, 2, 4, then multiples of 8 until one holds `max_batch`."""
    cap = max(1, min(max_batch, MAX_GRAPH_BATCH))
    sizes = [1, 2, 4, *range(8, cap + 8, 8)]
    return tuple(s for s in sizes if s < cap) + (next(s for s in sizes if s >= cap),)


def block_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths: powers of two from MIN_GRAPH_BLOCKS, then `max_blocks` itself. Decode attention
    gathers every block of the width, so a width near the longest context keeps padding cheap."""
    sizes, width = [], MIN_GRAPH_BLOCKS
    while width < max_blocks:
        sizes.append(width)
        width *= 2
    return (*sizes, max(1, max_blocks))


def smallest_at_least(buckets: tuple[int, ...], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class _Probe:
    key: ModuleKey  # a projection key the bucket covers
    weights: LoRALayerWeights  # what weights_of(bucket, key) returned when the graphs were captured
    tensors: tuple  # its buffers (held, so their identities cannot be reused)


class LoRABuckets:
    """The rank buckets the graphs cover, and whether their buffers are still the ones captured."""

    def __init__(self, weights_of: Callable[[Any, ModuleKey], LoRALayerWeights | None],
                 module_keys: list[ModuleKey] | Callable[[], list[ModuleKey]]):
        """`module_keys`: the projection keys (a list, or a callable returning one: read when a bucket is
        probed, so a pool attached to the model later is still seen)."""
        self.weights_of = weights_of
        self.module_keys = module_keys
        self.keys: list = []  # in graph order
        self._probes: dict[object, _Probe] = {}
        self.generation = 0

    def _probe(self, bucket) -> _Probe | None:
        for key in self.module_keys() if callable(self.module_keys) else self.module_keys:
            weights = self.weights_of(bucket, key)
            if weights is not None:
                return _Probe(key, weights, (weights.a, weights.scale, *weights.b))
        return None

    def _current(self, bucket) -> bool:
        probe = self._probes[bucket]
        weights = self.weights_of(bucket, probe.key)
        if weights is None or weights is not probe.weights:
            return False
        tensors = (weights.a, weights.scale, *weights.b)
        return len(tensors) == len(probe.tensors) and all(t is p for t, p in zip(tensors, probe.tensors))

    def refresh(self, present) -> bool:
        """Take in the buckets of this step (`present`) and check the known ones; True if anything changed
        (a new bucket, a dropped one, or one whose buffers were replaced): the graphs are stale."""
        stale = [b for b in self.keys if not self._current(b)]
        new = [b for b in dict.fromkeys(present) if b not in self._probes]
        if not stale and not new:
            return False
        for bucket in stale + new:
            probe = self._probe(bucket)
            if probe is None:
                self._probes.pop(bucket, None)
            else:
                self._probes[bucket] = probe
        self.keys = [b for b in dict.fromkeys(self.keys + new) if b in self._probes]
        self.generation += 1
        return True


class GraphBackend(Protocol):
    """What DecodeGraphs captures and replays through: a CudaGraphBackend, or a CPU tests' stand-in."""

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]: ...

    def replay(self, graph: Any) -> None: ...

    def release(self) -> None: ...


class CudaGraphBackend:
    """Everything that touches torch.cuda graphs: a side-stream warm-up, capture into one memory pool that
    all graphs share (they never run at once), replay. Tests on CPU swap in a stand-in that re-runs the
    captured function, which exercises all of DecodeGraphs except the capture itself."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def warm_up(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return out

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the device pool's copy thread may be moving an adapter in meanwhile.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        self.pool = self.pool or graph.pool()
        return graph, out

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()

    def release(self) -> None:
        """Before graphs are dropped: wait for replays in flight; the next capture starts a fresh pool."""
        torch.cuda.synchronize(self.device)
        self.pool = None


@dataclass
class _Entry:
    """One (batch size, block width) shape: its views into the input buffer, and its graph once captured."""

    views: dict
    lora: list = field(default_factory=list)
    graph: object = None
    out: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_model_len: int, capture: bool,
                 backend: GraphBackend | None = None):
        """`capture`: capture and replay graphs through `backend` (a CudaGraphBackend by default); else run
        the fixed-shape forward eagerly every step."""
        self.runner = runner
        self.model, self.kv, self.device = runner.model, runner.kv, runner.device
        self.block_size = runner.block_size
        self.scratch_block = runner.scratch_block
        self.capture = capture
        self.batch_sizes = batch_buckets(max_batch)
        self.max_blocks = -(-max_model_len // self.block_size)
        self.block_widths = block_buckets(self.max_blocks)
        wrapper = runner.lora_wrapper
        self.static_lora = StaticLoRA(wrapper.weights_of, wrapper.impl) if wrapper is not None else None
        keys = lambda: [m.lora_key for _, _, m in self.model.lora_modules() if m.lora_key is not None]  # noqa: E731
        self.lora = LoRABuckets(wrapper.weights_of, keys) if wrapper is not None else None
        self.entries: dict[tuple[int, int], _Entry] = {}
        self._buffer: torch.Tensor | None = None
        self._key_positions = torch.arange(self.max_blocks * self.block_size, device=self.device)
        self.backend: GraphBackend | None = (backend or CudaGraphBackend(self.device)) if capture else None
        self.disabled = False  # set when a capture failed or disagreed with the eager run
        self.steps = self.captures = 0  # steps run here; graphs captured (tests, bench)

    def accepts(self, batch) -> bool:
        return (not self.disabled and not batch.prefills and 0 < len(batch.decodes) <= self.batch_sizes[-1]
                and not any(seq.draft_token_ids for seq in batch.decodes))

    def invalidate(self) -> None:
        """Drop every graph (and their shared pool): the next step of each shape captures again."""
        if self.backend is not None and any(e.graph is not None for e in self.entries.values()):
            self.backend.release()
        self.entries.clear()
        self._buffer = None

    # -- one step ------------------------------------------------------------------------------------
    def run(self, seqs: list, locations: list) -> torch.Tensor | None:
        """float32 logits [len(seqs), vocab] of one plain decode step, rows in `seqs` order; None when the
        step does not fit a graph shape (the caller runs it eagerly). `locations`: each row's adapter
        (bucket, slot), or None."""
        bs_tokens = self.block_size
        needed = [-(-(seq.num_computed_tokens + 1) // bs_tokens) for seq in seqs]
        bs = smallest_at_least(self.batch_sizes, len(seqs))
        nb = smallest_at_least(self.block_widths, max(needed))
        if bs is None or nb is None:
            return None
        if self.lora is not None and self.lora.refresh(loc[0] for loc in locations if loc is not None):
            self.invalidate()
        entry = self.entries.get((bs, nb)) or self._entry(bs, nb)
        self._fill(bs, nb, seqs, locations, needed)
        self.steps += 1
        if entry.graph is not None:
            assert self.backend is not None and entry.out is not None  # captured: with its output
            self.backend.replay(entry.graph)
            return entry.out[:len(seqs)].clone()
        if not self.capture:
            return self._forward(entry)[:len(seqs)]
        out = self._capture(entry)
        return out[:len(seqs)].clone()

    @property
    def _buckets(self) -> list:
        return self.lora.keys if self.lora is not None else []

    def _layout(self, bs: int, nb: int) -> tuple[int, int]:
        """(offset of the block tables, total length) in the input buffer for shape (bs, nb)."""
        tables = (4 + len(self._buckets)) * bs
        return tables, tables + bs * nb

    def _entry(self, bs: int, nb: int) -> _Entry:
        size = self._layout(self.batch_sizes[-1], self.max_blocks)[1]
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.zeros(size, dtype=torch.long, device=self.device)
            self.entries.clear()  # views into the old buffer
        buf = self._buffer
        tables, end = self._layout(bs, nb)
        views = {name: buf[i * bs:(i + 1) * bs] for i, name in enumerate(("ids", "positions", "slots", "lens"))}
        views["tables"] = buf[tables:end].view(bs, nb)
        lora = [(bucket, buf[(4 + j) * bs:(5 + j) * bs]) for j, bucket in enumerate(self._buckets)]
        entry = self.entries[(bs, nb)] = _Entry(views, lora)
        return entry

    def _fill(self, bs: int, nb: int, seqs: list, locations: list, needed: list[int]) -> None:
        """One host -> device copy of the step's inputs, padding rows included."""
        n, block, scratch = len(seqs), self.block_size, self.scratch_block
        pad = bs - n
        ids = [seq.last_token() for seq in seqs] + [0] * pad
        positions = [seq.num_computed_tokens for seq in seqs]
        slots = [seq.block_table[p // block] * block + p % block for seq, p in zip(seqs, positions)]
        lens = [p + 1 for p in positions] + [1] * pad
        data = ids + positions + [0] * pad + slots + [scratch * block] * pad + lens
        for bucket in self._buckets:
            data += [loc[1] if loc is not None and loc[0] == bucket else -1 for loc in locations] + [-1] * pad
        for seq, k in zip(seqs, needed):
            data += [scratch if b == RELEASED else b for b in seq.block_table[:k]] + [scratch] * (nb - k)
        data += [scratch] * (pad * nb)
        assert self._buffer is not None  # made by _entry
        self._buffer[:len(data)].copy_(torch.tensor(data, dtype=torch.long))

    def _forward(self, entry: _Entry) -> torch.Tensor:
        """The step's forward from the entry's buffers: logits float32 [bs, vocab]."""
        v = entry.views
        keys = v["tables"].shape[1] * self.block_size
        valid = self._key_positions[:keys].unsqueeze(0) < v["lens"].unsqueeze(1)
        mask = torch.zeros(valid.shape, dtype=self.kv.k.dtype, device=self.device)
        mask = mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]
        meta = AttentionMetadata(v["slots"], [], 0, v["tables"], mask, decode_context_lens=v["lens"])
        with self._static_lora(entry.lora):
            hidden = self.model(v["ids"], v["positions"], self.kv, meta)
        return self.model.compute_logits(hidden).float()

    @contextmanager
    def _static_lora(self, slots: list):
        """Point the model's LoRA projections at the fixed-shape path for one forward."""
        wrapper = self.runner.lora_wrapper
        modules = [m for _, _, m in self.model.lora_modules() if wrapper is not None and m.lora_wrapper is wrapper]
        if self.static_lora is not None:
            self.static_lora.slots = slots
        for m in modules:
            m.lora_wrapper = self.static_lora
        try:
            yield
        finally:
            for m in modules:
                m.lora_wrapper = wrapper

    def _capture(self, entry: _Entry) -> torch.Tensor:
        """Warm up (compiles the kernels; it is this step's real forward), capture, replay once and check the
        replay against the warm-up. On any failure graphs are turned off and the warm-up's logits are used."""
        forward = lambda: self._forward(entry)  # noqa: E731
        assert self.backend is not None  # capture mode
        warm = self.backend.warm_up(forward)
        try:
            graph, out = self.backend.capture(forward)
            self.backend.replay(graph)
            error = ((out - warm).abs().max() / warm.abs().max().clamp(min=1e-6)).item()
            if error > 1e-2:
                raise RuntimeError(f"replayed logits differ from the eager run (relative error {error:.2e})")
        except Exception:  # noqa: BLE001 - a capture problem must not take the server down: run eagerly
            log.exception("CUDA graph capture of decode batch %d failed; decode runs eagerly from now on",
                          entry.views["ids"].shape[0])
            self.disabled = True
            self.invalidate()
            return warm
        entry.graph, entry.out = graph, out
        self.captures += 1
        return out
