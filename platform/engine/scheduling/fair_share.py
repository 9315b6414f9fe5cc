"""Fair share between the tenants of one tier: a virtual token counter per tenant (torch-free).

The Virtual Token Counter of S-LoRA's authors (Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24), adapted to this scheduler:

- Each tenant has a counter of the service it received: `input_weight` per prompt token it had computed
  (charged once, when its request is first admitted; prefix-cache hits are free) plus `output_weight` per
  token it was given, each divided by the tenant's weight (its tier's share weight, 1 by default).
- Among the waiting requests of one priority level, the next to run is the oldest request of the tenant
  with the smallest counter. Across levels the tier priority with ageing decides, as before (see
  loramux.engine.scheduling.scheduler.rank_key): a level's claim is that of its longest-waiting request.
- Lifting on rejoin: a tenant with nothing waiting that sends a request has its counter raised to the
  smallest counter of the tenants still waiting in its level (or, with none waiting, to the counter of the
  last one whose queue emptied), so idle time is never banked as credit for a burst later.
- A full batch does not make a tenant wait for someone else's request to end: when every sequence slot is
  taken, the least-served waiting tenant of a level may take the slot of the latest request of the tenant
  served most there, while it holds less than its weighted share of the slots (`max_num_seqs` x its weight /
  the weights of the level's tenants with work) and that tenant holds more than its own (see
  loramux.engine.scheduling.scheduler). The share keeps two busy tenants from taking slots back and forth. And the
  step that starts such a below-share request's prompt leaves out the decodes of the level's tenants above
  their share (they decode one step later, at most once per such admission), so its first token does not
  wait for a step of their whole overfill.
- Preemption under KV pressure takes the lowest priority level first, then the tenant with the largest
  counter, then the latest arrival.
- A tenant with nothing queued or running for `idle_prune_s` is forgotten (its account and its Prometheus
  series go): were it to come back, the lift on rejoin gives it the counter it would have had anyway.

The bound (VTC's theorem 4.3, restated for continuous batching): while two tenants of one level stay
backlogged, the weighted service they receive over any interval differs by at most
`2 * U`, `U = input_weight * P + output_weight * N * G` (P the longest prompt, G the most new tokens of a
request, N the most sequences in a batch): an admission decision goes to the smaller counter, and what can
be in flight when it is made is one prompt plus a full batch of decodes. tests/unit/test_fair_share.py checks it
at every step of a simulated run.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)  # a tenant, as the heap's caller names it


@dataclass
class TenantShare:
    """One tenant's account: `counter` (virtual, lifted on rejoin) and `service` (weighted tokens actually
    received, never lifted: what Prometheus shows as a rate)."""

    counter: float = 0.0
    service: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0


class FairShare:
    """Virtual token counters per tenant. The scheduler tells it when a tenant's queue becomes non-empty
    (`joined`) or empty (`left`), and what each tenant was served (`charge_*`); it answers which tenant of
    a set goes first (`counter`)."""

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0, idle_prune_s: float = 600.0):
        """`idle_prune_s`: how long a tenant with nothing queued or running keeps its account."""
        if not (input_weight > 0 and output_weight > 0):
            raise ValueError("fair-share token weights must be > 0")
        if idle_prune_s < 0:
            raise ValueError("idle_prune_s must be >= 0")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.idle_prune_s = idle_prune_s
        self.tenants: dict[str, TenantShare] = {}
        self._last_left: dict[int, float] = {}  # level -> counter of the last tenant whose queue emptied
        self._idle: dict[str, float] = {}  # tenant -> since when it has had no work, oldest first

    def _account(self, tenant: str) -> TenantShare:
        share = self.tenants.get(tenant)
        if share is None:
            share = self.tenants[tenant] = TenantShare()
        return share

    def counter(self, tenant: str) -> float:
        share = self.tenants.get(tenant)
        return share.counter if share is not None else 0.0

    def joined(self, tenant: str, level: int, backlogged_floor: float | None) -> None:
        """`tenant`'s queue in `level` went from empty to non-empty: lift its counter to the smallest counter
        of the tenants backlogged there (`backlogged_floor`), or to the last one to leave when none are (None)."""
        floor = backlogged_floor if backlogged_floor is not None else self._last_left.get(level, 0.0)
        share = self._account(tenant)
        share.counter = max(share.counter, floor)

    def left(self, tenant: str, level: int) -> None:
        """`tenant`'s queue in `level` emptied (its requests all admitted or ended)."""
        self._last_left[level] = self.counter(tenant)

    def busy(self, tenant: str) -> None:
        """`tenant` has a request queued or running again."""
        self._idle.pop(tenant, None)

    def idle(self, tenant: str, now: float) -> None:
        """`tenant`'s last request ended at `now` (time.monotonic()): nothing of it is queued or running."""
        self._idle.pop(tenant, None)
        self._idle[tenant] = now  # at the end: the dict stays in the order tenants went idle

    def prune(self, now: float) -> list[str]:
        """Forget the tenants idle for `idle_prune_s` or more at `now`; returns them."""
        pruned = []
        for tenant, since in self._idle.items():
            if now - since < self.idle_prune_s:
                break
            pruned.append(tenant)
        for tenant in pruned:
            del self._idle[tenant]
            self.tenants.pop(tenant, None)
        return pruned

    def charge_input(self, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """`tenant` (of tier weight `weight`) had `tokens` prompt tokens computed."""
        self._account(tenant).input_tokens += tokens
        self._charge(tenant, self.input_weight * tokens / weight)

    def charge_output(self, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """`tenant` (of tier weight `weight`) was given `tokens` output tokens."""
        self._account(tenant).output_tokens += tokens
        self._charge(tenant, self.output_weight * tokens / weight)

    def _charge(self, tenant: str, amount: float) -> None:
        share = self._account(tenant)
        share.counter += amount
        share.service += amount

    def bound(self, longest_prompt: int, most_new_tokens: int, max_num_seqs: int) -> float:
        """The largest difference in weighted service between two backlogged tenants of one level (see the
        module docstring), for weight-1 tenants."""
        return 2 * (self.input_weight * longest_prompt + self.output_weight * max_num_seqs * most_new_tokens)

    def stats(self) -> dict[str, dict[str, float]]:
        """tenant -> {"counter", "service", "input_tokens", "output_tokens"}."""
        tenants = dict(self.tenants)  # one C-level copy: safe while the engine thread adds tenants
        return {tenant: {"counter": s.counter, "service": s.service, "input_tokens": s.input_tokens,
                         "output_tokens": s.output_tokens} for tenant, s in tenants.items()}


class TenantHeap(Generic[T]):
    """The tenant of smallest key among a changing set, without scanning them: a heap with lazy updates.

    `key(tenant)` is the caller's (e.g. (counter, rank of its oldest request)). The caller `push`es a tenant
    when it joins and whenever its key may have become smaller, and `discard`s it when it leaves; a key that
    grew needs no call (counters only grow): a stale entry is refreshed when it reaches the top. So every
    tenant always has an entry no larger than its key, and a top entry whose key is current is the minimum.
    Each tenant has one live entry (`_live`); superseded ones are dropped when they surface, and the heap is
    rebuilt when they outnumber the live ones."""

    def __init__(self, key: Callable[[T], object]):
        self.key = key
        self._heap: list[tuple[object, int, T]] = []
        self._live: dict[T, tuple[object, int]] = {}  # tenant -> (key, tie) of its live entry
        self._tie = 0  # insertion counter: tenants themselves are never compared

    def __len__(self) -> int:
        return len(self._live)

    def push(self, tenant: T) -> None:
        key = self.key(tenant)
        live = self._live.get(tenant)
        if live is not None and live[0] == key:
            return
        self._tie += 1
        self._live[tenant] = (key, self._tie)
        heapq.heappush(self._heap, (key, self._tie, tenant))
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = [(k, tie, t) for t, (k, tie) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, tenant: T) -> None:
        self._live.pop(tenant, None)

    def first(self, accept: Callable[[T], bool], tries: int) -> T | None:
        """The tenant of smallest key that `accept`s, trying at most `tries` of them in key order (None if
        none of those does)."""
        refused = []
        try:
            while len(refused) < tries and (tenant := self.top()) is not None:
                if accept(tenant):
                    return tenant
                refused.append(heapq.heappop(self._heap))  # live and current: put back below
            return None
        finally:
            for entry in refused:
                heapq.heappush(self._heap, entry)

    def top(self) -> T | None:
        """The tenant of smallest key (None when empty)."""
        heap = self._heap
        while heap:
            key, tie, tenant = heap[0]
            if self._live.get(tenant) != (key, tie):  # superseded, or the tenant left
                heapq.heappop(heap)
                continue
            current = self.key(tenant)
            if current == key:
                return tenant
            self._tie += 1  # its key grew since: move it down
            self._live[tenant] = (current, self._tie)
            heapq.heapreplace(heap, (current, self._tie, tenant))
        return None
