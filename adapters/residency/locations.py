"""Adapter residency on the device: the one owner of name -> version -> device location (torch-free).

The engine's adapters live in a `DevicePool` (adapters/residency/device_pool.py): rank buckets of slots within one
byte budget. This module decides what is where; the pool only moves bytes. Per adapter version (keyed
by content digest) it tracks the host copy, the state (absent, loading, resident), the slot, and demand:
requests waiting for it and requests running on it (which lease it).

Policy, and why:

* **Demand-driven loads, off the critical path.** The scheduler asks `want(digest)` for waiting requests
  in priority order; an absent adapter gets a slot and its host -> device copy starts on the pool's
  helper thread while the engine keeps stepping. At most `max_inflight_loads` copies are queued, and
  only for the highest-ranked waiting requests, so a burst over many adapters cannot flood the pool.
  Its requests are admitted together once it is resident, so one load serves all of them.
* **Where a new adapter goes**: a free slot of its rank's bucket; else the bucket grows if the budget
  allows; else an eviction. Only an adapter with no running request is evicted, and only once it has
  been resident `min_residency_s` (a just-loaded adapter is not thrown out before its requests run).
  One that waiting requests still want is kept (they are about to run on it: evicting it would cost a
  reload, which is how thrash starts) unless the request asking has waited `drain_after_s`. Among the
  rest, least recently used first. If its own bucket has none, another bucket gives up slots.
* **Bounded waits.** A request passed over for `drain_after_s` because nothing can be evicted (every
  slot leased by running requests, or the `max_active` cap reached) reserves room: one running adapter
  (the one with the fewest running requests) is drained: no new request is admitted on it, and when its
  running ones finish it is evicted in favour of the waiting one. So once a request heads the blocked
  queue it waits at most `drain_after_s` + the rest of one request's run + one load; priority aging
  bounds how long it takes to head the queue.
* **Active prefix (CPU).** The CPU kernels multiply a bucket's slots 0..k-1 in one GEMM, so when
  `pool.needs_active_prefix` the adapters with running requests are kept in their bucket's lowest slots
  (one swap when an adapter becomes active or idle).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays torch-free at run time
    from loramux.adapters.formats.peft import LoRAAdapter

log = logging.getLogger(__name__)

ABSENT, LOADING, RESIDENT = "absent", "loading", "resident"
# The pool's bucket key (device_pool.BucketKey): opaque here, so this module stays torch-free.
Bucket = Hashable


@dataclass(eq=False)
class _Entry:
    digest: str
    name: str
    bucket: Bucket  # the pool's bucket key (its bucket and projections): slots there fit this adapter exactly
    adapter: LoRAAdapter | None  # the host copy; dropped when nothing refers to the version
    rank: int = 0  # the adapter's rank, kept here: `stats` reports it after the host copy is dropped
    state: str = ABSENT
    slot: int = -1
    running: int = 0  # running requests (they lease the slot)
    waiting: int = 0  # waiting requests that want it
    names: int = 0  # registered names resolving to it
    loaded_at: float = 0.0
    last_used: float = 0.0
    retired: bool = False  # replaced or deleted: freed once no request uses it
    future: concurrent.futures.Future[float] | None = None  # the device copy, while LOADING


def _copy(entry: _Entry) -> concurrent.futures.Future[float]:
    """The device copy of an entry in `_loading` (it has one until `poll` takes it in)."""
    assert entry.future is not None
    return entry.future


class AdapterResidency:
    def __init__(self, pool, max_active: int = 0, min_residency_s: float = 2.0, drain_after_s: float = 2.0,
                 max_inflight_loads: int = 2, clock: Callable[[], float] = time.monotonic, on_load=None):
        """`pool`: a DevicePool (or a fake with its interface). `max_active`: most distinct adapters with
        running requests (0 = no cap). `on_load(seconds)`: called with each finished copy's duration."""
        self.pool, self.max_active, self.clock = pool, max_active, clock
        self.min_residency_s, self.drain_after_s, self.max_inflight_loads = \
            min_residency_s, drain_after_s, max_inflight_loads
        self.on_load = on_load
        self.entries: dict[str, _Entry] = {}
        self.by_name: dict[str, str] = {}
        self.slots: dict[Bucket, list[_Entry | None]] = {}  # bucket -> what each slot of its bucket holds
        self.num_active: dict[Bucket, int] = {}  # bucket -> adapters with running requests in that bucket
        self._drain: tuple[str, str] | None = None  # (draining victim, the digest it makes room for)
        self._loading: list[_Entry] = []  # copies in flight
        self.loads = self.evictions = self.load_failures = 0

    # -- versions and names ------------------------------------------------------------------------
    def check_servable(self, adapter) -> None:
        """Raise ValueError (the message says what to change) if `adapter` can never be placed."""
        need = self.pool.slot_bytes(self.pool.bucket_of(adapter))
        if need > self.pool.budget:
            raise ValueError(f"adapter {adapter.name!r} (rank {adapter.rank}) needs {need} bytes of device memory; "
                             f"the adapter pool has {self.pool.budget} (LORAMUX_ADAPTER_POOL_BYTES)")

    def register(self, adapter) -> None:
        """Serve `adapter` under its name; a previous version under that name is retired."""
        self.check_servable(adapter)
        old = self.by_name.get(adapter.name)
        entry = self._entry(adapter)
        entry.names += 1
        self.by_name[adapter.name] = adapter.digest
        if old is not None and old != adapter.digest:
            self.entries[old].names -= 1
            self.retire(old)

    def lookup(self, name: str) -> LoRAAdapter | None:
        """The host copy of the adapter registered as `name`, or None."""
        digest = self.by_name.get(name)
        return None if digest is None else self.entries[digest].adapter

    def retire(self, digest: str) -> None:
        """A version was replaced or deleted: its slot is freed once no request uses it, never reused."""
        entry = self.entries.get(digest)
        if entry is not None:
            entry.retired = True
            self._forget_if_unused(entry)

    def _entry(self, adapter) -> _Entry:
        entry = self.entries.get(adapter.digest)
        if entry is None:
            entry = self.entries[adapter.digest] = _Entry(adapter.digest, adapter.name,
                                                               self.pool.bucket_of(adapter), adapter,
                                                               int(getattr(adapter, "rank", 0)))
        elif entry.adapter is None:
            entry.adapter = adapter
        return entry

    # -- demand (the engine and the scheduler) ------------------------------------------------------
    def add_waiting(self, adapter) -> None:
        """A request for `adapter` joined the queue."""
        self.check_servable(adapter)
        entry = self._entry(adapter)
        entry.waiting += 1
        entry.last_used = self.clock()

    def ready(self, digest: str) -> bool:
        """Whether a waiting request for `digest` can be admitted now."""
        entry = self.entries[digest]
        if entry.state != RESIDENT or (self._drain is not None and self._drain[0] == digest):
            return False
        return entry.running > 0 or not self.max_active or sum(self.num_active.values()) < self.max_active

    def want(self, digest: str, waited_s: float = 0.0) -> bool:
        """A waiting request needs `digest`: True if it can be admitted now; else bring it in (a load, or
        after `waited_s` >= drain_after_s a drain that makes room) and return False."""
        self._check_drain()
        if self.ready(digest):
            return True
        entry = self.entries[digest]
        urgent = waited_s >= self.drain_after_s
        if entry.state == ABSENT and self._inflight() < self.max_inflight_loads and self._place(entry, urgent):
            if _copy(entry).done():  # an inline copy (no helper thread): usable at once
                self.poll()
            return self.ready(digest)
        if urgent and self._drain is None and entry.state != LOADING:
            self._start_drain(entry)
        return False

    def lease(self, digest: str) -> None:
        """A waiting request for `digest` was admitted: it now runs on the adapter's slot, which it leases."""
        entry = self.entries[digest]
        entry.waiting -= 1
        entry.running += 1
        entry.last_used = self.clock()
        if entry.running == 1:
            self._activate(entry)

    def release(self, digest: str) -> None:
        """A running request for `digest` finished or was preempted (it re-queues via add_waiting)."""
        entry = self.entries[digest]
        entry.running -= 1
        entry.last_used = self.clock()
        if entry.running == 0:
            self._deactivate(entry)
            self._forget_if_unused(entry)

    def requeue(self, digest: str) -> None:
        """A preempted request for `digest` went back to the queue (after `release`)."""
        self.entries[digest].waiting += 1

    def drop_waiting(self, digest: str) -> None:
        """A waiting request for `digest` left the queue without running (timeout, cancel)."""
        entry = self.entries[digest]
        entry.waiting -= 1
        self._forget_if_unused(entry)

    def location(self, digest: str) -> tuple[Bucket, int]:
        """(bucket, slot) of a resident adapter, for the kernels."""
        entry = self.entries[digest]
        return entry.bucket, entry.slot

    def state(self, digest: str) -> str:
        entry = self.entries.get(digest)
        return ABSENT if entry is None else entry.state

    # -- loads ---------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Take in finished device copies (call once per engine step)."""
        for entry in [e for e in self._loading if _copy(e).done()]:
            self._loading.remove(entry)
            future, entry.future = _copy(entry), None
            error = future.exception()
            if error is not None:
                log.error("copying adapter %s to the device failed: %r; it will be retried", entry.name, error)
                self.load_failures += 1
                self._vacate(entry)
                self._forget_if_unused(entry)
                continue
            entry.state, entry.loaded_at = RESIDENT, self.clock()
            if self.on_load is not None:
                self.on_load(future.result())
            self._forget_if_unused(entry)

    def wait_for_load(self, timeout: float) -> None:
        """Block until a device copy finishes (or `timeout`): the engine has nothing else to run. With no
        copy in flight (the waiting requests wait for room: a young adapter's minimum residency), back
        off for `timeout` rather than spin."""
        futures = [_copy(e) for e in self._loading]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(timeout)

    def _inflight(self) -> int:
        return len(self._loading)

    def _place(self, entry: _Entry, urgent: bool) -> bool:
        """Find `entry` a slot (free, by growing its bucket, or by eviction) and start its copy. Idle
        adapters that still have waiting requests are evicted only for an `urgent` request: they are
        about to run again, and evicting them would cost a reload (thrash)."""
        slot = self._free_slot(entry.bucket)
        if slot is None:
            slot = self._grow(entry.bucket) if self._affordable(entry.bucket) else None
        if slot is None:
            slot = self._evict_in(entry.bucket, urgent)
        if slot is None and self._shrink_others(entry.bucket, urgent):
            slot = self._grow(entry.bucket)
        if slot is None:
            return False
        if self._drain is not None and self._drain[1] == entry.digest:
            self._drain = None
        self.slots[entry.bucket][slot] = entry
        entry.state, entry.slot = LOADING, slot
        self.loads += 1
        entry.future = self.pool.load(entry.bucket, lambda: entry.slot, entry.adapter)
        self._loading.append(entry)
        return True

    def _free_slot(self, bucket: Bucket) -> int | None:
        slots = self.slots.get(bucket, [])
        return next((i for i in range(len(slots) - 1, -1, -1) if slots[i] is None), None)

    def _affordable(self, bucket: Bucket) -> bool:
        return self.pool.nbytes + self.pool.slot_bytes(bucket) <= self.pool.budget

    def _grow(self, bucket: Bucket) -> int:
        """Add slots to the `bucket` bucket (doubling, within the budget); returns the first new slot."""
        old = len(self.slots.get(bucket, []))
        room = (self.pool.budget - self.pool.nbytes) // self.pool.slot_bytes(bucket)
        capacity = old + max(1, min(max(old, 1), room))

        def extend() -> None:
            self.slots[bucket] = self.slots.get(bucket, []) + [None] * (capacity - old)

        self.pool.resize(bucket, capacity, list(range(old)), then=extend)
        return old

    def _evictable(self, entry: _Entry | None, now: float, urgent: bool) -> bool:
        if entry is None or entry.state != RESIDENT or entry.running:
            return False
        draining = self._drain is not None and self._drain[0] == entry.digest
        if entry.retired or draining:
            return True
        return now - entry.loaded_at >= self.min_residency_s and (urgent or not entry.waiting)

    def _victims(self, bucket: Bucket, urgent: bool) -> list[_Entry]:
        """Evictable adapters of a bucket, best victim first: no waiters before waiters, then LRU."""
        now = self.clock()
        found = [e for e in self.slots.get(bucket, []) if e is not None and self._evictable(e, now, urgent)]
        return sorted(found, key=lambda e: (not e.retired, e.waiting > 0, e.last_used))

    def _evict_in(self, bucket: Bucket, urgent: bool) -> int | None:
        victims = self._victims(bucket, urgent)
        if not victims:
            return None
        slot = victims[0].slot
        self._vacate(victims[0])
        self.evictions += 1
        self._forget_if_unused(victims[0])
        return slot

    def _shrink_others(self, bucket: Bucket, urgent: bool) -> bool:
        """Free budget for one more `bucket` slot by shrinking other buckets (their free slots first, then
        evictions, larger slots first); False, and nothing changed, if they cannot give enough."""
        need = self.pool.slot_bytes(bucket) - (self.pool.budget - self.pool.nbytes)
        offers = []
        for other in sorted((b for b in self.slots if b != bucket), key=self.pool.slot_bytes, reverse=True):
            free = sum(1 for e in self.slots[other] if e is None)
            offers.append((other, free, self._victims(other, urgent)))
        if sum((free + len(victims)) * self.pool.slot_bytes(r) for r, free, victims in offers) < need:
            return False
        for other, free, victims in offers:
            if need <= 0:
                break
            size, take = self.pool.slot_bytes(other), 0
            while (free + take) * size < need and take < len(victims):
                take += 1
            if free + take == 0:
                continue
            for victim in victims[:take]:
                self._vacate(victim)
                self.evictions += 1
                self._forget_if_unused(victim)
            self._compact(other, need_free=0)
            need -= (free + take) * size
        return True

    def _compact(self, bucket: Bucket, need_free: int) -> None:
        """Drop a bucket's empty slots (occupied ones keep their order, so an active prefix stays one)."""
        kept = [e for e in self.slots[bucket] if e is not None]

        def renumber() -> None:
            self.slots[bucket] = list(kept) + [None] * need_free
            for i, e in enumerate(kept):
                e.slot = i
            if not self.slots[bucket]:
                del self.slots[bucket]

        self.pool.resize(bucket, len(kept) + need_free, [e.slot for e in kept], then=renumber)

    def _vacate(self, entry: _Entry) -> None:
        """`entry` leaves its slot (evicted, failed copy or retired)."""
        if entry.slot >= 0:
            self.slots[entry.bucket][entry.slot] = None
        entry.state, entry.slot, entry.future = ABSENT, -1, None

    # -- active adapters -----------------------------------------------------------------------------
    def _activate(self, entry: _Entry) -> None:
        k = self.num_active.get(entry.bucket, 0)
        self.num_active[entry.bucket] = k + 1
        if self.pool.needs_active_prefix and entry.slot != k:
            self._swap(entry.bucket, entry.slot, k)

    def _deactivate(self, entry: _Entry) -> None:
        k = self.num_active[entry.bucket] - 1
        self.num_active[entry.bucket] = k
        if self.pool.needs_active_prefix and entry.slot != k:
            self._swap(entry.bucket, entry.slot, k)

    def _swap(self, bucket: Bucket, i: int, j: int) -> None:
        slots = self.slots[bucket]

        def renumber() -> None:
            slots[i], slots[j] = slots[j], slots[i]
            for slot in (i, j):
                entry = slots[slot]
                if entry is not None:
                    entry.slot = slot

        self.pool.swap(bucket, i, j, then=renumber)

    def _start_drain(self, starving: _Entry) -> None:
        """Reserve room for `starving`: drain the running adapter that frees it soonest."""
        candidates = [e for e in self.entries.values() if e.running and e.digest != starving.digest]
        if not candidates:
            return
        same = [e for e in candidates if e.bucket == starving.bucket]
        victim = min(same or candidates, key=lambda e: (e.running, e.last_used))
        log.info("adapter %s waits for room; draining %s", starving.name, victim.name)
        self._drain = (victim.digest, starving.digest)

    def _check_drain(self) -> None:
        if self._drain is not None:
            victim, starving = (self.entries.get(d) for d in self._drain)
            if victim is None or starving is None or starving.waiting == 0 or starving.state != ABSENT:
                self._drain = None

    def _forget_if_unused(self, entry: _Entry) -> None:
        """Let go of what no request and no name needs: a retired version's slot and record; an unnamed
        version's host copy (its device copy stays for the next request with the same digest)."""
        if entry.running or entry.waiting or entry.state == LOADING:
            return  # a finished copy comes back here from `poll`
        if entry.retired and entry.state == RESIDENT:
            self._vacate(entry)
        if entry.names > 0 and not entry.retired:
            return
        if entry.state == ABSENT:
            del self.entries[entry.digest]
        else:
            entry.adapter = None

    # -- what is where ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """See loramux.engine.stats.lora_stats. Reads a snapshot of the entries, so other threads may call it.
        `adapters`: every version placed on the device, one dict each: name, digest, rank, state ("resident" or
        "loading"), running and waiting requests (the Ray ingress reads these keys from replica snapshots)."""
        entries = list(self.entries.values())  # one C-level copy: atomic under the GIL
        running = sorted({e.name for e in entries if e.running})
        waiting = sorted({e.name for e in entries if e.waiting})
        placed = [e for e in entries if e.state != ABSENT]
        adapters = [{"name": e.name, "digest": e.digest, "rank": e.rank, "state": state, "running": e.running,
                     "waiting": e.waiting} for e in placed if (state := e.state) in (RESIDENT, LOADING)]
        return {"running": running, "waiting": waiting, "max_lora": self.max_active or self._capacity_estimate(),
                "device_adapters": sum(1 for e in placed if e.state == RESIDENT),
                "device_bytes": sum(self.pool.slot_bytes(e.bucket) for e in placed),
                "device_budget_bytes": self.pool.budget, "loading": sum(1 for e in placed if e.state == LOADING),
                "loads": self.loads, "evictions": self.evictions, "load_failures": self.load_failures,
                "adapters": sorted(adapters, key=lambda a: (a["name"], a["digest"]))}

    def _capacity_estimate(self) -> int:
        """Adapters the pool holds at the mean size of those placed (one slot if none): max_lora when uncapped."""
        sizes = [self.pool.slot_bytes(e.bucket) for e in list(self.entries.values()) if e.state != ABSENT]
        return max(1, self.pool.budget * len(sizes) // sum(sizes)) if sizes else 1
