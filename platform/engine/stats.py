"""What the engine reports of itself: counters kept as it steps, the snapshot behind `LLMEngine.stats()`
(/metrics, /admin/stats, the console), and the queue-wait estimate that admission control reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loramux.engine.sequence import FinishReason, Sequence
from loramux.model.moe import MoEBlock

if TYPE_CHECKING:
    from loramux.adapters.residency.locations import AdapterResidency
    from loramux.engine.scheduling.block_manager import BlockManager
    from loramux.engine.scheduling.scheduler import Scheduler
    from loramux.engine.scheduling.step_budget import StepBudget
    from loramux.engine.speculation.medusa_device_cache import MedusaDeviceCache
    from loramux.engine.speculation.speculator import Speculator
    from loramux.histogram import DurationHistogram
    from loramux.model.llama import LlamaModel

__all__ = ["EngineCounters", "EngineParts", "ExpertTokens", "engine_stats", "lora_stats"]


class ExpertTokens:
    """(token, expert) routing pairs of a mixture-of-experts model since the engine started, per layer and
    expert: every forward's, prefill chunks and speculative verification included. `count` is each MoEBlock's
    `expert_counter` hook and runs on the engine thread once per sparse layer per step, so it only adds the
    step's host-side counts into a plain list; readers (/metrics, stats()) copy the lists when they ask."""

    def __init__(self, sparse_layers: tuple[bool, ...], num_experts: int):
        # One row per decoder layer, index = layer; a dense layer's row is empty.
        self.rows: list[list[int]] = [[0] * num_experts if sparse else [] for sparse in sparse_layers]

    @classmethod
    def attach(cls, model: LlamaModel) -> ExpertTokens | None:
        """A counter fed by every MoEBlock of `model` (the hook is set on them), or None for a dense model."""
        moe = model.config.moe
        if moe is None:
            return None
        counter = cls(moe.sparse_layers, moe.num_experts)
        for module in model.modules():
            if isinstance(module, MoEBlock):
                module.expert_counter = counter
        return counter

    def count(self, layer: int, present: list[int], counts: list[int]) -> None:
        row = self.rows[layer]
        for expert, n in zip(present, counts):
            row[expert] += n

    def snapshot(self) -> list[list[int]]:
        """Pairs per layer (a list per decoder layer, [] for a dense one) and expert. Safe from any thread."""
        return [list(row) for row in self.rows]

    def restore(self, rows: list[list[int]]) -> None:
        """Set the counts back to an earlier `snapshot` (calibration's synthetic work is not counted)."""
        for row, saved in zip(self.rows, rows):
            row[:] = saved


@dataclass
class EngineCounters:
    """Counts since the engine started (calibration's synthetic work excluded), and the running average
    of how long a request runs once scheduled."""

    preemptions: int = 0
    spec_proposed: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # ... and accepted
    service_s_ewma: float | None = None  # None until a request has completed
    expert_tokens: ExpertTokens | None = None  # a mixture-of-experts model's routing pairs; None for a dense one

    def record_finished(self, seq: Sequence) -> None:
        """Fold a finished request's service time (first scheduled -> finished) into the average; only
        requests that completed (stop or length) count, not cancelled, failed or timed-out ones."""
        t = seq.timings
        if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and t.first_scheduled and t.finished:
            service = t.finished - t.first_scheduled
            ewma = self.service_s_ewma
            self.service_s_ewma = service if ewma is None else 0.8 * ewma + 0.2 * service

    def queue_wait_s(self, running: int, waiting: int, max_num_seqs: int) -> float:
        """A rough estimate of how long a request arriving now waits before it is scheduled, with `running`
        and `waiting` requests ahead of it: zero while the batch has room (or before any request has
        completed), else one average service time per full batch of requests ahead of it."""
        if running + waiting < max_num_seqs or self.service_s_ewma is None:
            return 0.0
        batches_ahead = (waiting + max_num_seqs) // max_num_seqs
        return batches_ahead * self.service_s_ewma


class EngineParts(Protocol):
    """What the stats read of an LLMEngine (a Protocol: no import of the engine, which imports this module)."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def block_manager(self) -> BlockManager: ...

    @property
    def counters(self) -> EngineCounters: ...

    @property
    def speculator(self) -> Speculator: ...

    @property
    def step_budget(self) -> StepBudget | None: ...

    @property
    def medusa_device(self) -> MedusaDeviceCache: ...

    @property
    def adapters(self) -> AdapterResidency | None: ...

    @property
    def load_histogram(self) -> DurationHistogram: ...


def engine_stats(engine: EngineParts) -> dict:
    """The engine's counters and gauges: running / waiting requests, KV blocks used / free / total and their size
    in tokens (`kv_block_size`), whether prefix caching is on,
    prefix-cache blocks and hits, speculative tokens proposed / accepted (in all and per method: `speculation`),
    preemptions, adapter slots leased by running requests (`adapter_slots_pinned`: the key keeps its published
    name) and loads, `lora` (see `lora_stats`), `steps` (`StepBudget.stats()`) and
    `fair_share`: tenant -> its virtual token counter and weighted service (`FairShare.stats()`); `medusa_device`:
    requests' own Medusa head sets on the device (`MedusaDeviceCache.stats()`); `moe_expert_tokens`: a
    mixture-of-experts model's (token, expert) routing pairs so far, a list per decoder layer of one count per
    expert ([] for a dense layer; no entries at all for a dense model: `ExpertTokens.snapshot()`)."""
    lora = lora_stats(engine)
    scheduler, blocks, counters = engine.scheduler, engine.block_manager, engine.counters
    return {
        "running": len(scheduler.running),
        "waiting": scheduler.num_waiting,
        "kv_blocks_used": blocks.num_used_blocks,
        "kv_blocks_free": blocks.num_free_blocks,
        "kv_blocks_total": blocks.num_blocks,
        "kv_block_size": blocks.block_size,  # tokens per KV block
        "prefix_caching": blocks.enable_prefix_caching,
        "prefix_cache_blocks": blocks.num_cached_blocks,
        "prefix_cache_hit_blocks": blocks.hits,
        "spec_proposed_tokens": counters.spec_proposed,
        "spec_accepted_tokens": counters.spec_accepted,
        "speculation": engine.speculator.stats.snapshot(),  # per method: proposed, accepted, verifications
        "preemptions": counters.preemptions,
        "adapter_slots_pinned": len(lora["running"]) if lora else 0,  # slots leased by running requests
        "adapter_slot_loads": lora["loads"] if lora else 0,
        "lora": lora,
        "steps": engine.step_budget.stats() if engine.step_budget is not None else {},
        "fair_share": scheduler.fair.stats(),
        "medusa_device": engine.medusa_device.stats(),
        "moe_expert_tokens": counters.expert_tokens.snapshot() if counters.expert_tokens is not None else [],
    }


def lora_stats(engine: EngineParts) -> dict:
    """Adapter residency: running / waiting: sorted names of adapters with running / waiting requests;
    max_lora: the most distinct adapters one batch may hold (LORAMUX_MAX_LORAS, or an estimate of what
    the pool holds when uncapped); device_adapters / device_bytes / device_budget_bytes; loading:
    copies in flight; loads / evictions / load_failures so far; load_seconds: copy times
    (DurationHistogram.snapshot()); adapters: each version placed on the device (name, digest, rank, state
    "resident" or "loading", running, waiting: `AdapterResidency.stats`). Empty when LoRA is off. Safe to call
    from any thread."""
    if engine.adapters is None:
        return {}
    return {**engine.adapters.stats(), "load_seconds": engine.load_histogram.snapshot()}
