"""Continuous batching: which sequences run in the next step, and with how many tokens (torch-free).

Each step has a token cap and, with a `StepBudget`, a time target (see loramux.engine.scheduling.step_budget).
Running decodes come first (one token each), then running prefills continue in chunks, then waiting
sequences are admitted by priority, while the predicted step time stays within the target. A long prompt
is therefore split across steps instead of stalling the decodes. When the KV pool runs dry the running
sequence of lowest effective priority (see `rank_key`) is preempted: its blocks are freed and it is recomputed later.

Within one priority level, tenants share by a virtual token counter (loramux.engine.scheduling.fair_share): the next
request admitted is the oldest of the tenant served least so far, so one tenant's flood cannot take
another's service; across levels, priority with ageing decides (a level's claim is its longest-waiting
request's). Heaps keep both choices (`TenantHeap`): an admission costs O(log tenants), not a scan of them.
When the batch is full (`max_num_seqs`), that request need not wait for another tenant's request to end: it
takes the slot of the latest request of the tenant served most in its level, while it holds less than its
weighted share of the slots and that tenant more than its own (`_share_slot`). Otherwise the next slot to
free goes to it. In the step that admits a request of a tenant below its share, the work of its level's
tenants above their own share (decodes, prompt chunks, admissions) sits out one step (`_held_back`), so its
first token costs a step of the within-share work only, however far the batch is overfilled. Preemption
under KV pressure takes the lowest level, then the tenant served most, then the latest arrival.

A sequence with an adapter is admitted only once its adapter is on the device (`adapters`, an
`AdapterResidency`: see loramux.adapters.residency.locations for the load, eviction and drain policy); it leases the
adapter while running. Waiting sequences whose adapter is not there yet are passed over (others,
base-only or with resident adapters, run meanwhile) while their adapter is brought in; the highest-ranked
ones ask first, so loads follow priority and aging.

After the model ran, `complete` advances each scheduled sequence by what was computed and commits its
full blocks to the prefix cache: the one place that does this token accounting.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from loramux.engine.scheduling.block_manager import BlockManager
from loramux.engine.scheduling.fair_share import FairShare, TenantHeap
from loramux.engine.scheduling.step_budget import StepBudget, StepPlan
from loramux.engine.sequence import FinishReason, Sequence, SequenceStatus


class AdapterDemand(Protocol):
    """What the scheduler asks of the adapter residency (loramux.adapters.residency.locations.AdapterResidency),
    by adapter digest; a Protocol, so this module imports no torch."""

    def ready(self, digest: str) -> bool: ...

    def want(self, digest: str, waited_s: float = 0.0) -> bool: ...

    def lease(self, digest: str) -> None: ...

    def release(self, digest: str) -> None: ...

    def requeue(self, digest: str) -> None: ...

    def drop_waiting(self, digest: str) -> None: ...


@dataclass
class ScheduledBatch:
    """Prefill chunks (sequence, number of tokens) and decode sequences of one step."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan | None = None  # the time budget's account of this step (None: token cap only)
    started: float = 0.0  # time.monotonic() when it was scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + sum(1 + len(s.draft_token_ids) for s in self.decodes)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


def rank_key(seq: Sequence, aging_s: float) -> tuple:
    """Sort key, smallest first: priority with aging, then estimated cost, then arrival order.

    A sequence's effective priority is `priority + waited / aging_s`: every `aging_s` seconds of waiting
    is worth one priority level, so low tiers are never starved. Since every waiting sequence ages at the
    same rate, ordering by `arrival / aging_s - priority` is the same at every moment, and a heap keyed
    on it stays valid without re-sorting. Ties go to the cheaper request (prompt + max new tokens).
    """
    return (seq.arrival / aging_s - seq.priority, len(seq.prompt_token_ids) + seq.params.max_tokens, seq.seq_id)


class _Level:
    """One priority level's waiting sequences: tenant -> its heap by rank (`tenants`), and the two
    choices over its tenants as heaps: the oldest request's rank (`by_claim`, the level's claim) and the fair
    share's order, (counter, oldest rank) (`by_share`)."""

    def __init__(self, priority: int, fair: FairShare):
        self.priority = priority
        self.tenants: dict[str, list[tuple[tuple, Sequence]]] = {}
        self.by_claim: TenantHeap[str] = TenantHeap(lambda t: self.tenants[t][0][0])
        self.by_share: TenantHeap[str] = TenantHeap(lambda t: (fair.counter(t), self.tenants[t][0][0]))

    def push(self, tenant: str) -> None:
        self.by_claim.push(tenant)
        self.by_share.push(tenant)

    def discard(self, tenant: str) -> None:
        self.by_claim.discard(tenant)
        self.by_share.discard(tenant)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 adapters: AdapterDemand | None = None, aging_s: float = 10.0, step_budget: StepBudget | None = None,
                 long_rope_after: int | None = None, fair_share: FairShare | None = None):
        """`long_rope_after`: a LongRoPE model's original context (Phi-3). A sequence that outgrows it while
        computed with the short factors is recomputed whole with the long ones, as HF's Phi-3 generation
        drops its cache at that point; drafts stop short of it. `fair_share`: the tenants' virtual token
        counters (default weights when None)."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every decode fits a step")
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.adapters = adapters  # AdapterResidency; None = no LoRA
        if aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        self.aging_s = aging_s
        self.step_budget = step_budget  # None: each step is bounded by max_num_batched_tokens alone
        self.long_rope_after = long_rope_after
        self.fair = fair_share if fair_share is not None else FairShare()
        # priority level -> its waiting sequences per tenant, heaps by _rank. Empty ones are removed.
        self._levels: dict[int, _Level] = {}
        self._num_waiting = 0
        self._work: dict[str, int] = {}  # tenant -> its sequences waiting or running (idle tenants are pruned)
        self.running: list[Sequence] = []

    def _rank(self, seq: Sequence) -> tuple:
        return rank_key(seq, self.aging_s)

    # -- queue ---------------------------------------------------------------------------------
    @property
    def waiting(self) -> list[Sequence]:
        """The waiting sequences by rank (not in admission order, which fair share decides). Engine thread."""
        items = [item for level in self._levels.values() for heap in level.tenants.values() for item in heap]
        return [seq for _, seq in sorted(items, key=lambda item: item[0])]

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        if not self._work.get(seq.tenant):
            self.fair.busy(seq.tenant)
        self._work[seq.tenant] = self._work.get(seq.tenant, 0) + 1
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._put(seq, rejoin=True)

    def has_unfinished(self) -> bool:
        return bool(self._num_waiting or self.running)

    def _put(self, seq: Sequence, rejoin: bool) -> None:
        """Queue `seq`; with `rejoin`, a tenant whose queue in the level was empty has its counter lifted
        (a passed-over sequence going back is not a rejoin: it never left)."""
        level = self._levels.get(seq.priority)
        if level is None:
            level = self._levels[seq.priority] = _Level(seq.priority, self.fair)
        heap = level.tenants.get(seq.tenant)
        if heap is None:
            if rejoin:
                least = level.by_share.top()
                self.fair.joined(seq.tenant, seq.priority, None if least is None else self.fair.counter(least))
            heap = level.tenants[seq.tenant] = []
        heapq.heappush(heap, (self._rank(seq), seq))
        self._num_waiting += 1
        level.push(seq.tenant)  # a new tenant, or a new oldest request: its keys may have become smaller

    def _take(self, seq: Sequence, leave: bool) -> None:
        """Remove waiting `seq` from its queue; with `leave`, a queue it empties counts as its tenant leaving."""
        level = self._levels[seq.priority]
        heap = level.tenants[seq.tenant]
        if heap[0][1] is seq:
            heapq.heappop(heap)
        else:
            heap[:] = [item for item in heap if item[1] is not seq]
            heapq.heapify(heap)
        self._num_waiting -= 1
        if not heap:  # (otherwise its oldest rank only grew: the heaps refresh it lazily)
            del level.tenants[seq.tenant]
            level.discard(seq.tenant)
            if leave:
                self.fair.left(seq.tenant, seq.priority)
            if not level.tenants:
                del self._levels[seq.priority]

    def _best_level(self) -> _Level:
        """The level with the best claim: its longest-waiting request's aged priority."""
        best: tuple[tuple, _Level] | None = None
        for level in self._levels.values():  # a few tiers
            tenant = level.by_claim.top()
            assert tenant is not None  # empty levels are removed
            claim = level.tenants[tenant][0][0]
            if best is None or claim < best[0]:
                best = (claim, level)
        assert best is not None, "no waiting sequence"
        return best[1]

    def _next_waiting(self) -> Sequence:
        """The waiting sequence to admit next: in the best level, the oldest request of the tenant with the
        smallest counter."""
        level = self._best_level()
        tenant = level.by_share.top()
        assert tenant is not None  # empty levels are removed
        return level.tenants[tenant][0][1]

    def _share_slot(self, admitted: list[Sequence]) -> tuple[Sequence, Sequence] | None:
        """With every slot taken: (waiting sequence, running sequence whose slot it takes), or None. The
        sequences `admitted` in this step are never taken (their prompt was just charged to their tenant).

        In the best level, the tenant served least (the smallest counter) among those holding fewer slots
        than their share, its oldest request; it takes the slot of the latest request of the tenant served
        most among those served at least as much that hold more than their share. A tenant's share is
        `max_num_seqs` x its weight / the weights of the level's running tenants and its own; so two busy
        tenants settle at their shares instead of taking slots back and forth, and a tenant alone in its
        level is never preempted for fairness. At most (running tenants + 1) are tried, not every waiting one:
        those refused while holding slots are among the running ones, and once a tenant holding none is
        refused, so is every later one (of the same weight; one of a larger weight further on waits for a
        free slot, as it would have anyway)."""
        level = self._best_level()
        priority = level.priority
        slots, weights = self._slots(priority)
        running_weight = sum(weights.values())

        def total(tenant: str) -> float:
            return running_weight + (0.0 if tenant in weights else level.tenants[tenant][0][1].share_weight)

        def below_share(tenant: str) -> bool:
            weight = level.tenants[tenant][0][1].share_weight
            return slots.get(tenant, 0) + 1 <= self.max_num_seqs * weight / total(tenant)

        tenant = level.by_share.first(below_share, tries=len(slots) + 1)
        if tenant is None:
            return None
        seq, counter, whole = level.tenants[tenant][0][1], self.fair.counter(tenant), total(tenant)
        victims = [s for s in self.running if s.priority == priority and s.tenant != tenant and s not in admitted
                   and slots[s.tenant] > self.max_num_seqs * weights[s.tenant] / whole
                   and self.fair.counter(s.tenant) >= counter]
        return (seq, max(victims, key=self._victim_key)) if victims else None

    def _slots(self, priority: int) -> tuple[dict[str, int], dict[str, float]]:
        """Per tenant of level `priority`: the running sequences (slots) it holds, and its share weight."""
        slots: dict[str, int] = {}
        weights: dict[str, float] = {}
        for s in self.running:
            if s.priority == priority:
                slots[s.tenant] = slots.get(s.tenant, 0) + 1
                weights[s.tenant] = s.share_weight
        return slots, weights

    def _held_back(self) -> tuple[set[tuple[int, str]], Sequence | None]:
        """A fair first token: ((priority, tenant) whose work sits this step out, the admission it makes
        way for), or (empty, None).

        The admission this step will make is peeked at as the admission loop will choose it (a free slot:
        `_next_waiting`; every slot taken: `_share_slot`). If its tenant holds less than its weighted share of
        its level's slots (as `_share_slot` counts them, with it), the work of that level's tenants holding
        more than their own share waits one step (their decodes, their prompts' next chunks and admissions:
        a step without decodes would otherwise fill up with their prompts), so its prompt runs in a step of
        the other tenants' work only: its TTFT does not grow with how far an above-share tenant overfills the
        batch. Nothing is
        preempted or freed, and outputs are the same, one step later. Tenants within their share, other
        levels (a higher one is never held back by a lower one) and a tenant alone in its level decode as
        always. No starvation: a tenant is held back at most once per such admission (if the peeked request
        is not admitted after all, they decode in the same step), and below-share admissions are bounded by
        the slots their tenants may take before reaching their share."""
        if not self._num_waiting:
            return set(), None
        if len(self.running) < self.max_num_seqs:
            seq = self._next_waiting()
        else:
            taken = self._share_slot([])
            if taken is None:
                return set(), None
            seq = taken[0]
        if seq.adapter is not None and not self._residency().ready(seq.adapter):
            return set(), None  # passed over this step
        slots, weights = self._slots(seq.priority)
        whole = sum(weights.values()) + (0.0 if seq.tenant in weights else seq.share_weight)
        if slots.get(seq.tenant, 0) + 1 > self.max_num_seqs * weights.get(seq.tenant, seq.share_weight) / whole:
            return set(), None
        return {(seq.priority, t) for t, n in slots.items() if n > self.max_num_seqs * weights[t] / whole}, seq

    def _victim_key(self, seq: Sequence) -> tuple:
        """Preemption order, largest first: lowest priority, then the tenant served most, then the latest."""
        return (-seq.priority, self.fair.counter(seq.tenant), seq.arrival, seq.seq_id)

    def _charge_outputs(self, seq: Sequence) -> None:
        new = len(seq.output_token_ids) - seq.fair_charged_outputs
        if new > 0:
            self.fair.charge_output(seq.tenant, new, seq.share_weight)
            seq.fair_charged_outputs += new

    def finish(self, seq: Sequence, reason: FinishReason, now: float | None = None) -> None:
        """End `seq` wherever it is (waiting or running) and free its blocks at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_adapter(seq)
        else:
            self._take(seq, leave=True)
            if seq.adapter is not None:
                self._residency().drop_waiting(seq.adapter)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = now = now if now is not None else time.monotonic()
        left = self._work.get(seq.tenant, 0) - 1
        if left > 0:
            self._work[seq.tenant] = left
        else:
            self._work.pop(seq.tenant, None)
            self.fair.idle(seq.tenant, now)

    # -- scheduling ----------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> ScheduledBatch:
        started = time.monotonic()
        now = now if now is not None else started
        plan = self.step_budget.plan() if self.step_budget is not None else None
        batch = ScheduledBatch(plan=plan, started=started)
        self.fair.prune(now)
        budget = self.max_num_batched_tokens
        # A new sorted list, not list.sort(): CPython empties a list while sorting it in place, and other
        # threads (the server's queue-wait estimate, stats) read `running` meanwhile.
        self.running = sorted(self.running, key=self._rank)

        held, newcomer = self._held_back()
        deferred: list[Sequence] = []  # decodes held back for the newcomer's first token
        for seq in [s for s in self.running if not s.is_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if (seq.priority, seq.tenant) in held:
                seq.draft_token_ids = []
                deferred.append(seq)
                continue
            if self.long_rope_after is not None and not seq.long_rope:
                room = self.long_rope_after - seq.num_computed_tokens - 1  # drafts the short factors still cover
                if room < 0:
                    seq.long_rope = True
                    seq.cache_salt += "|longrope"
                    self._preempt(seq, batch)  # recomputed from the prompt on, with the long factors
                    continue
                del seq.draft_token_ids[room:]
            draft = seq.draft_token_ids
            if draft and (1 + len(draft) > budget or not self.blocks.can_allocate(seq, 1 + len(draft))):
                seq.draft_token_ids = draft = []  # speculation never preempts anyone
            n = 1 + len(draft)
            if draft or self._make_room(seq, 1, batch):
                self.blocks.allocate(seq, n)
                batch.decodes.append(seq)
                budget -= n
        if plan is not None:
            # The survivors: _make_room may have preempted earlier ones. (A prefill's _make_room below can
            # still preempt a planned decode; the plan then over-counts that step, erring on the safe side.)
            for seq in batch.decodes:
                plan.add_decode(1 + len(seq.draft_token_ids), seq.num_computed_tokens)
        reserve = len(deferred)  # their tokens, kept for them until the newcomer is admitted
        for seq in [s for s in self.running if s.is_prefill]:
            if (seq.priority, seq.tenant) in held:
                continue  # its next chunk waits a step too: the newcomer's step carries no held tenant's work
            n = self._chunk(seq, seq.num_computed_tokens, budget - reserve, plan)
            if n <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and self._make_room(seq, n, batch):
                self.blocks.allocate(seq, n)
                self._add_prefill(batch, seq, n)
                budget -= n

        # Admit new work only when nothing had to be preempted for KV this step: otherwise they would thrash.
        passed_over, admitted = [], []
        kv_short = bool(batch.preempted)
        while self._num_waiting and not kv_short and budget > 0:
            victim = None
            if len(self.running) < self.max_num_seqs:
                seq = self._next_waiting()
            else:  # a slot it may take (fair share), or wait for one to free
                taken = self._share_slot(admitted)
                if taken is None:
                    break
                seq, victim = taken
            if seq is not newcomer and (seq.priority, seq.tenant) in held:
                break  # a held tenant's prompt waits for the next step, as its decodes do
            if seq.adapter is not None and not self._residency().want(seq.adapter, now - seq.arrival):
                self._take(seq, leave=False)  # its adapter is on its way
                passed_over.append(seq)
                continue
            # Leading blocks already in the prefix cache are reused. The whole remaining prompt (+ the
            # first decode) must fit, and it is allocated at once, so an admitted prefill is never
            # preempted halfway by the admissions after it.
            hits = self.blocks.match_prefix(seq)
            cached = len(hits) * self.blocks.block_size
            remaining = seq.num_tokens - cached
            n = self._chunk(seq, cached, budget if seq is newcomer else budget - reserve, plan)
            if n <= 0:
                break
            if victim is not None:
                self._preempt(victim, batch)
            if not self.blocks.can_admit(seq, hits, remaining + 1):
                break
            self._take(seq, leave=True)
            if seq.adapter is not None:
                self._residency().lease(seq.adapter)
                seq.adapter_leased = True
            self.blocks.admit(seq, hits, remaining)  # the whole prompt, not just this chunk
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                # Its prompt is charged once, at first admission: a preempted one's recompute is ours, not its.
                self.fair.charge_input(seq.tenant, seq.num_tokens - cached, seq.share_weight)
            seq.status = SequenceStatus.RUNNING
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = now
            self.running.append(seq)
            admitted.append(seq)
            self._add_prefill(batch, seq, n)
            budget -= n
            if seq is newcomer:
                reserve = 0
        for seq in passed_over:
            self._put(seq, rejoin=False)
        if reserve:  # the newcomer was not admitted after all: the held-back decodes run in this step
            for seq in deferred:
                if seq.status is SequenceStatus.RUNNING and self.blocks.can_allocate(seq, 1):
                    self.blocks.allocate(seq, 1)
                    batch.decodes.append(seq)
                    if plan is not None:
                        plan.add_decode(1, seq.num_computed_tokens)
        return batch

    def complete(self, batch: ScheduledBatch, accepted: Mapping[Sequence, int] | None = None) -> None:
        """The model ran `batch` (and the engine appended the sampled tokens): each sequence still alive
        now has the KV of what it was scheduled for (a speculative decode: its last token and the
        `accepted[seq]` drafts kept), and its full blocks go to the prefix cache."""
        accepted = accepted or {}
        if batch.plan is not None:
            assert self.step_budget is not None  # only the step budget makes plans
            self.step_budget.observe(batch.plan, time.monotonic() - batch.started)
        for seq, n in batch.prefills:
            self._charge_outputs(seq)
            if not seq.is_finished:
                seq.num_computed_tokens += n
                self.blocks.commit(seq)
                self.blocks.release_out_of_window(seq)
        for seq in batch.decodes:
            self._charge_outputs(seq)
            if not seq.is_finished:
                seq.num_computed_tokens += 1 + accepted.get(seq, 0)  # KV of rejected drafts is overwritten later
                self.blocks.commit(seq)
                self.blocks.release_out_of_window(seq)

    @staticmethod
    def _chunk(seq: Sequence, context: int, budget: int, plan: StepPlan | None) -> int:
        """Prompt tokens of `seq` (with `context` computed or cached) this step takes: within the token cap
        left and, with a time budget, what fits the step's target."""
        n = min(seq.num_tokens - context, budget)
        return n if plan is None or n <= 0 else plan.prefill_allowance(context, n)

    @staticmethod
    def _add_prefill(batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.prefills.append((seq, n))
        if batch.plan is not None:
            batch.plan.add_prefill(n, seq.num_computed_tokens)

    def _residency(self) -> AdapterDemand:
        """The adapter residency, for a sequence with an adapter (the engine gives one whenever it serves any)."""
        assert self.adapters is not None, "a sequence has an adapter but the scheduler has no residency"
        return self.adapters

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.adapter_leased:
            assert seq.adapter is not None  # only a sequence with an adapter leases one
            self._residency().release(seq.adapter)
            seq.adapter_leased = False

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt lower-ranked sequences until `seq` can get its blocks; False if `seq` itself was."""
        while not self.blocks.can_allocate(seq, num_tokens):
            victim = max(self.running, key=self._victim_key)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        if seq in batch.decodes:
            batch.decodes.remove(seq)
        batch.prefills = [(s, n) for s, n in batch.prefills if s is not seq]
        self.blocks.free(seq)
        if seq.adapter is not None:
            self._residency().requeue(seq.adapter)  # before releasing it, so its adapter is still wanted
        self._release_adapter(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        batch.preempted.append(seq)
        self._requeue(seq)
