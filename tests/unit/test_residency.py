"""AdapterResidency against a fake pool (no torch): placement in rank buckets within the byte budget,
eviction order, minimum residency, the active prefix, the cap on active adapters and drains."""
from __future__ import annotations

import concurrent.futures
import subprocess
from dataclasses import dataclass

import pytest

from loramux.adapters.residency.locations import ABSENT, LOADING, RESIDENT, AdapterResidency
from loramux.child_python import python_command

BYTES_PER_RANK = 10


@dataclass
class FakeAdapter:
    name: str
    rank: int

    @property
    def digest(self) -> str:
        return f"d-{self.name}"


class FakePool:
    """Buckets as lists of what each slot holds; loads finish when the test says so (or at once)."""

    def __init__(self, budget: int, needs_active_prefix: bool = True, instant: bool = True):
        self.budget, self.needs_active_prefix, self.instant = budget, needs_active_prefix, instant
        self.buckets: dict[int, list] = {}
        self.pending: list[tuple[concurrent.futures.Future, int, object, object]] = []
        self.swaps = 0

    def bucket_of(self, adapter):
        return adapter.rank

    def slot_bytes(self, rank):
        return rank * BYTES_PER_RANK

    @property
    def nbytes(self):
        return sum(len(b) * self.slot_bytes(r) for r, b in self.buckets.items())

    def resize(self, rank, capacity, keep, then=lambda: None):
        assert self.nbytes + (capacity - len(self.buckets.get(rank, []))) * self.slot_bytes(rank) <= self.budget
        old = self.buckets.pop(rank, [])
        if capacity:
            self.buckets[rank] = [old[i] for i in keep] + [None] * (capacity - len(keep))
        then()

    def swap(self, rank, i, j, then=lambda: None):
        b = self.buckets[rank]
        b[i], b[j] = b[j], b[i]
        self.swaps += 1
        then()

    def load(self, rank, slot_of, adapter):
        future = concurrent.futures.Future()
        self.pending.append((future, rank, slot_of, adapter))
        if self.instant:
            self.finish_loads()
        return future

    def finish_loads(self):
        for future, rank, slot_of, adapter in self.pending:
            self.buckets[rank][slot_of()] = adapter.digest
            future.set_result(0.001)
        self.pending.clear()


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(budget_ranks: int, **kw):
    clock = Clock()
    pool = FakePool(budget_ranks * BYTES_PER_RANK, **{k: kw.pop(k) for k in ("needs_active_prefix", "instant")
                                                       if k in kw})
    kw.setdefault("min_residency_s", 0.0)
    return AdapterResidency(pool, clock=clock, **kw), pool, clock


def bring_in(res: AdapterResidency, adapter, waited_s: float = 0.0) -> bool:
    """Queue one request for `adapter` and poll until it is ready (fake loads are instant)."""
    res.add_waiting(adapter)
    res.want(adapter.digest, waited_s)
    res.poll()
    return res.ready(adapter.digest)


def check_prefix(res: AdapterResidency, pool: FakePool) -> None:
    """The fake pool's contents agree with the residency, and active adapters sit in each bucket's front."""
    for rank, slots in res.slots.items():
        assert [e.digest if e and e.state == RESIDENT else pool.buckets[rank][i] if e else None
                for i, e in enumerate(slots)] == pool.buckets[rank]
        active = [i for i, e in enumerate(slots) if e is not None and e.running]
        assert active == list(range(len(active))), f"rank {rank}: active slots {active} are not a prefix"


def test_module_is_torch_free():
    code = "import sys, loramux.adapters.residency.locations; assert 'torch' not in sys.modules"
    subprocess.run(python_command("-c", code), check=True)


def test_each_adapter_takes_its_own_rank_of_the_budget():
    res, pool, _ = make(budget_ranks=8 + 64 + 16)
    for adapter in (FakeAdapter("r8", 8), FakeAdapter("r64", 64), FakeAdapter("r16", 16)):
        assert bring_in(res, adapter)
    assert pool.nbytes == (8 + 64 + 16) * BYTES_PER_RANK  # no padding to the largest rank
    assert {r: len(b) for r, b in pool.buckets.items()} == {8: 1, 64: 1, 16: 1}
    assert res.stats()["device_adapters"] == 3


def test_an_adapter_larger_than_the_pool_is_refused_clearly():
    res, _, _ = make(budget_ranks=32)
    with pytest.raises(ValueError, match="needs 640 bytes of device memory; the adapter pool has 320"):
        res.add_waiting(FakeAdapter("huge", 64))


def test_eviction_prefers_adapters_nobody_waits_for_then_least_recently_used():
    res, pool, clock = make(budget_ranks=3 * 8)
    a, b, c, d = (FakeAdapter(n, 8) for n in "abcd")
    for adapter in (a, b, c):
        assert bring_in(res, adapter)
        clock.now += 1
    res.lease(a.digest)  # a runs; b is idle with a request queued; c idle, nobody waiting
    res.drop_waiting(c.digest)
    res.lease(b.digest)
    res.release(b.digest)
    res.add_waiting(b)
    assert bring_in(res, d)
    assert res.state(c.digest) == ABSENT and res.state(b.digest) == RESIDENT  # c had no waiter
    check_prefix(res, pool)
    assert res.evictions == 1


def test_running_adapters_are_never_evicted_and_young_ones_wait_out_their_minimum_residency():
    res, _, clock = make(budget_ranks=2 * 8, min_residency_s=5.0)
    a, b, c = (FakeAdapter(n, 8) for n in "abc")
    assert bring_in(res, a) and bring_in(res, b)
    res.lease(a.digest)
    res.drop_waiting(b.digest)  # b's request went away: b is idle
    assert not bring_in(res, c)  # a runs, b is too young
    clock.now += 5.0
    res.want(c.digest)
    res.poll()
    assert res.ready(c.digest) and res.state(b.digest) == ABSENT and res.state(a.digest) == RESIDENT


def test_active_adapters_stay_in_the_lowest_slots_of_their_bucket():
    res, pool, clock = make(budget_ranks=6 * 8)
    adapters = [FakeAdapter(f"a{i}", 8) for i in range(6)]
    for adapter in adapters:
        assert bring_in(res, adapter)
    for order in ([5, 2, 4], [2], [0, 3], [5, 4, 0, 3]):  # lease some, release others, in scattered order
        for i in order:
            entry = res.entries[adapters[i].digest]
            if entry.running:
                res.release(adapters[i].digest)
                res.add_waiting(adapters[i])
            else:
                res.lease(adapters[i].digest)
            check_prefix(res, pool)
    assert pool.swaps > 0


def test_without_an_active_prefix_nothing_is_swapped():
    res, pool, _ = make(budget_ranks=4 * 8, needs_active_prefix=False)
    adapters = [FakeAdapter(f"a{i}", 8) for i in range(4)]
    for adapter in adapters:
        bring_in(res, adapter)
    res.lease(adapters[3].digest)
    assert pool.swaps == 0


def test_a_bucket_shrinks_to_make_room_for_another_rank():
    res, pool, _ = make(budget_ranks=4 * 8)
    small = [FakeAdapter(f"s{i}", 8) for i in range(4)]
    for adapter in small:
        assert bring_in(res, adapter)
    res.lease(small[0].digest)  # stays
    for adapter in small[1:]:
        res.drop_waiting(adapter.digest)  # idle: their requests are gone
    big = FakeAdapter("big", 16)
    assert bring_in(res, big)
    assert pool.nbytes <= pool.budget
    assert res.state(small[0].digest) == RESIDENT and res.state(big.digest) == RESIDENT
    assert sum(res.state(a.digest) == RESIDENT for a in small[1:]) == 1  # two gave up their room
    check_prefix(res, pool)


def test_idle_adapters_with_waiters_are_kept_unless_the_asker_waited_long():
    res, _, _ = make(budget_ranks=8, drain_after_s=1.0)
    a, b = FakeAdapter("a", 8), FakeAdapter("b", 8)
    assert bring_in(res, a)  # idle, one request waiting for it (e.g. the batch is full)
    assert not bring_in(res, b) and res.state(a.digest) == RESIDENT
    assert res.want(b.digest, waited_s=1.0) and res.state(a.digest) == ABSENT


def test_loads_are_bounded_and_not_ready_until_copied():
    res, pool, _ = make(budget_ranks=8 * 8, instant=False, max_inflight_loads=2)
    adapters = [FakeAdapter(f"a{i}", 8) for i in range(5)]
    for adapter in adapters:
        res.add_waiting(adapter)
        assert not res.want(adapter.digest)
    assert [res.state(a.digest) for a in adapters] == [LOADING, LOADING, ABSENT, ABSENT, ABSENT]
    res.poll()
    assert not res.ready(adapters[0].digest)  # the copy has not finished
    pool.finish_loads()
    res.poll()
    assert res.ready(adapters[0].digest) and res.stats()["loading"] == 0


def test_failed_copy_frees_the_slot_and_is_retried():
    res, pool, _ = make(budget_ranks=8, instant=False)
    a = FakeAdapter("a", 8)
    res.add_waiting(a)
    res.want(a.digest)
    future, *_ = pool.pending.pop()
    future.set_exception(RuntimeError("dma"))
    res.poll()
    assert res.state(a.digest) == ABSENT and res.load_failures == 1 and res.slots[8] == [None]
    res.want(a.digest)
    pool.finish_loads()
    res.poll()
    assert res.ready(a.digest)


def test_max_active_caps_distinct_running_adapters():
    res, _, _ = make(budget_ranks=4 * 8, max_active=2)
    a, b, c = (FakeAdapter(n, 8) for n in "abc")
    for adapter in (a, b, c):
        bring_in(res, adapter)
    res.lease(a.digest)
    res.lease(b.digest)
    assert not res.ready(c.digest)
    res.add_waiting(a)
    assert res.ready(a.digest)  # already active: another request on it adds no adapter
    res.release(b.digest)
    assert res.ready(c.digest)


def test_a_request_blocked_past_drain_after_drains_one_running_adapter():
    res, _, _ = make(budget_ranks=2 * 8, drain_after_s=1.0)
    a, b, c = (FakeAdapter(n, 8) for n in "abc")
    for adapter in (a, b):
        bring_in(res, adapter)
        res.lease(adapter.digest)
    res.add_waiting(b)
    res.lease(b.digest)  # b has two running, a one: a drains first
    res.add_waiting(c)
    assert not res.want(c.digest, waited_s=0.5)
    res.add_waiting(a)
    assert res.ready(a.digest)  # no drain yet: passed over for less than drain_after_s
    assert not res.want(c.digest, waited_s=1.5)
    assert not res.ready(a.digest) and res.ready(b.digest)  # a drains: its queued request waits
    res.release(a.digest)  # a's running request ends
    assert res.want(c.digest, waited_s=1.6)  # c takes a's room (the fake copy is instant)
    assert res.state(a.digest) == ABSENT
    assert res._drain is None


def test_retired_version_is_freed_after_its_last_request():
    res, pool, _ = make(budget_ranks=2 * 8)
    v1 = FakeAdapter("v1", 8)
    bring_in(res, v1)
    res.lease(v1.digest)
    res.retire(v1.digest)
    assert res.state(v1.digest) == RESIDENT  # still serving its running request
    res.release(v1.digest)
    assert v1.digest not in res.entries and res.slots[8] == [None]
