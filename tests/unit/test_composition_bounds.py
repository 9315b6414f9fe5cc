"""Composites in host RAM (loramux.adapters.composition.cache): counted in bytes against the host adapter budget
with every adapter, cached and in use alike, never built past it; built on their own threads while callers
await; one build per composite, a few per tenant; the components' leases held until the build thread is done.
Small synthetic adapters on a real AdapterCache, whose host level already holds them (no store reads)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from loramux.adapters.composition.cache import CompositionCache, CompositionCapacityError, CompositionTooLargeError
from loramux.adapters.composition.weighted import compose, composite_nbytes, composition_digest
from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.residency.cache_levels import AdapterCache, DiskCache, HostCache
from polling import wait_until_async

HIDDEN = 64
RANK = 4


@dataclass(frozen=True)
class Version:  # what AdapterCache.acquire reads of a registry version on a host RAM hit
    digest: str
    label: str


def _adapter(digest: str, seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {(0, "q_proj"): (torch.randn(RANK, HIDDEN, generator=g), torch.randn(HIDDEN, RANK, generator=g))}
    return LoRAAdapter(name=digest, rank=RANK, alpha=8.0, use_rslora=False, target_modules=("q_proj",),
                       weights=weights, digest=digest)


COMPONENTS = [_adapter("a" * 64, 1), _adapter("b" * 64, 2)]
VERSIONS = [Version(a.digest, f"{a.name[:4]}@1") for a in COMPONENTS]
COMPOSITE_BYTES = composite_nbytes(COMPONENTS)
COMPONENT_BYTES = sum(a.nbytes for a in COMPONENTS)


def _cache(tmp_path, composites_that_fit: float) -> AdapterCache:
    """An adapter cache holding both components (unleased), with room for that many composites beside them."""
    host = HostCache(COMPONENT_BYTES + int(composites_that_fit * COMPOSITE_BYTES))
    for adapter in COMPONENTS:
        host.insert_leased(adapter)
        host.release(adapter.digest)
    return AdapterCache(store=None, disk=DiskCache(tmp_path / "disk", 1 << 20), host=host)  # type: ignore[arg-type]


def _digest(weight: float) -> str:
    return composition_digest([(COMPONENTS[0].digest, weight), (COMPONENTS[1].digest, 1.0)])


def _build_for(weight: float, log: list | None = None, gate: threading.Event | None = None):
    def build(loaded: list[LoRAAdapter]) -> LoRAAdapter:
        if log is not None:
            log.append((weight, threading.current_thread().name))
        if gate is not None:
            assert gate.wait(30), "the test never opened the gate"
        return compose(list(zip(loaded, [weight, 1.0])), f"c-{weight}", _digest(weight))
    return build


def _leases(cache: AdapterCache, digest: str) -> int:
    entry = cache.host._entries.get(digest)
    return entry.leases if entry is not None else 0


async def _acquire(compositions: CompositionCache, weight: float, tenant: str = "t1", timeout: float = 30.0,
                   log: list | None = None, gate: threading.Event | None = None) -> LoRAAdapter:
    return await compositions.acquire(_digest(weight), tenant, VERSIONS, lambda loaded: None,
                                      _build_for(weight, log, gate), time.monotonic() + timeout)


def test_composite_size_is_known_before_building_it():
    built = compose(list(zip(COMPONENTS, [0.5, 1.0])), "c")
    assert composite_nbytes(COMPONENTS) == built.nbytes == 2 * 2 * RANK * HIDDEN * 4


def test_distinct_weights_never_take_host_ram_past_its_budget(tmp_path):
    """200 compositions with distinct weights (one tenant, each used then given back): every one is built, the
    host level never holds more than its budget, and the least recently used composites make room."""
    cache = _cache(tmp_path, composites_that_fit=3.5)
    compositions = CompositionCache(cache)
    peak = 0

    async def flood():
        nonlocal peak
        for i in range(200):
            adapter = await _acquire(compositions, 0.5 + i * 1e-7)  # 0.5000001 and 0.5000002 are distinct
            peak = max(peak, cache.host.nbytes + cache.host.reserved)
            cache.release(adapter.digest)

    asyncio.run(flood())
    assert compositions.builds == 200
    assert peak <= cache.host.budget and cache.host.nbytes <= cache.host.budget
    composites = [d for d in cache.host._entries if d not in {a.digest for a in COMPONENTS}]
    assert len(composites) == 3 and cache.host.reserved == 0
    assert _digest(0.5 + 199e-7) in composites  # the most recent stayed


def test_composites_in_use_are_counted_and_a_build_waits_for_their_room(tmp_path):
    """Two running requests lease two composites that fill the budget: a third waits (nothing built, nothing
    reserved) and gets its room the moment one request ends; with no release it is a capacity error at its
    deadline, holding nothing."""
    cache = _cache(tmp_path, composites_that_fit=2.5)
    compositions = CompositionCache(cache)
    log: list = []

    async def scenario():
        first, second = await _acquire(compositions, 0.1), await _acquire(compositions, 0.2)
        with pytest.raises(CompositionCapacityError, match="LORAMUX_HOST_CACHE_BYTES"):
            await _acquire(compositions, 0.3, timeout=0.2, log=log)
        await wait_until_async(lambda: not compositions.building, "the refused build to end")
        assert log == [] and cache.host.reserved == 0 and all(_leases(cache, a.digest) == 0 for a in COMPONENTS)
        third = asyncio.ensure_future(_acquire(compositions, 0.3, log=log))
        await wait_until_async(lambda: compositions.building == 1, "the third build to start")
        assert log == [] and cache.host.reserved == 0  # it waits for room: nothing reserved, nothing built
        cache.release(first.digest)  # a request ends: its composite becomes evictable
        got = await third
        assert got.digest == _digest(0.3) and first.digest not in cache.host
        assert cache.host.nbytes <= cache.host.budget
        for adapter in (second, got):
            cache.release(adapter.digest)

    asyncio.run(scenario())


def test_a_composite_larger_than_the_whole_budget_is_refused_before_building(tmp_path):
    cache = _cache(tmp_path, composites_that_fit=0.5)
    compositions = CompositionCache(cache)
    log: list = []
    with pytest.raises(CompositionTooLargeError, match="LORAMUX_HOST_CACHE_BYTES") as refused:
        asyncio.run(_acquire(compositions, 0.5, log=log))
    assert refused.value.nbytes == COMPOSITE_BYTES + COMPONENT_BYTES and log == []
    assert cache.host.reserved == 0 and all(_leases(cache, a.digest) == 0 for a in COMPONENTS)


def test_builds_run_on_their_own_threads_once_while_callers_await(tmp_path):
    """Fifty requests for one composite: one build, on the composition executor; while it runs the event loop
    stays free (other work completes) and no other thread is taken by the waiters."""
    cache = _cache(tmp_path, composites_that_fit=2)
    compositions = CompositionCache(cache)
    log: list = []
    gate = threading.Event()

    async def scenario():
        threads_before = threading.active_count()
        waiters = [asyncio.ensure_future(_acquire(compositions, 0.7, log=log, gate=gate)) for _ in range(50)]
        await wait_until_async(lambda: log, "the build to start")  # the loop runs on while the build is held
        assert threading.active_count() <= threads_before + 1  # the build's one thread; no waiter holds one
        gate.set()
        return await asyncio.gather(*waiters)

    results = asyncio.run(scenario())
    assert compositions.builds == 1 and len(log) == 1 and log[0][1].startswith("loramux-composition")
    assert len({id(r) for r in results}) == 1 and _leases(cache, results[0].digest) == 50


def test_one_tenant_has_at_most_its_builds_in_flight_and_others_are_not_held_up(tmp_path):
    cache = _cache(tmp_path, composites_that_fit=10)
    compositions = CompositionCache(cache, build_threads=4, builds_per_tenant=2)
    log: list = []
    gate = threading.Event()

    async def scenario():
        heavy = [asyncio.ensure_future(_acquire(compositions, w, "heavy", log=log, gate=gate)) for w in (1, 2, 3)]
        await wait_until_async(lambda: len(log) == 2, "two heavy builds to start")
        light = await _acquire(compositions, 9.0, "light", log=log)  # not behind the heavy tenant's third build
        assert light.digest == _digest(9.0)
        assert sorted(w for w, _ in log) == [1, 2, 9.0]  # the heavy tenant's third waits for one of its own
        gate.set()
        await asyncio.gather(*heavy)
        assert sorted(w for w, _ in log) == [1, 2, 3, 9.0]

    asyncio.run(scenario())


def test_a_request_that_stops_waiting_leaves_the_leases_with_the_build(tmp_path):
    """A client disconnecting mid-build cancels its wait; the build thread still reads the components, so
    they stay leased until it ends, then everything is given back and the composite is cached."""
    cache = _cache(tmp_path, composites_that_fit=2)
    compositions = CompositionCache(cache)
    log: list = []
    gate = threading.Event()

    async def scenario():
        waiter = asyncio.ensure_future(_acquire(compositions, 0.4, log=log, gate=gate))
        await wait_until_async(lambda: log, "the build to start")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert all(_leases(cache, a.digest) == 1 for a in COMPONENTS)  # still the build's
        gate.set()
        await wait_until_async(lambda: not compositions.building, "the build to end")

    asyncio.run(scenario())
    assert all(_leases(cache, a.digest) == 0 for a in COMPONENTS) and cache.host.reserved == 0
    assert _digest(0.4) in cache.host and _leases(cache, _digest(0.4)) == 0


def test_a_failed_build_gives_everything_back_and_is_not_remembered(tmp_path):
    cache = _cache(tmp_path, composites_that_fit=2)
    compositions = CompositionCache(cache)

    def failing(loaded):
        raise RuntimeError("boom")

    async def scenario():
        with pytest.raises(RuntimeError, match="boom"):
            await compositions.acquire(_digest(0.9), "t1", VERSIONS, lambda loaded: None, failing,
                                       time.monotonic() + 5)
        assert cache.host.reserved == 0 and all(_leases(cache, a.digest) == 0 for a in COMPONENTS)
        return await _acquire(compositions, 0.9)

    assert asyncio.run(scenario()).digest == _digest(0.9) and compositions.builds == 1
