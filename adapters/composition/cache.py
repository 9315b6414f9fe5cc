"""Composite adapters (`loramux.adapters.composition.weighted`) in host RAM, bounded in bytes, built off the event loop.

* **One budget.** A composite is an entry of the adapter cache's host RAM level (`HostCache`) under its
  composition digest, so composites cached and in use count against LORAMUX_HOST_CACHE_BYTES with every
  other adapter, and unused ones are evicted least recently used like them. A build first reserves its exact
  size (`composite_nbytes`, known from the components before anything is allocated); a reservation never
  takes the cache past its budget, so a build waits (within the request's deadline) while leased entries
  and other builds fill it. A composite that cannot fit the whole budget beside its components (leased while
  it is built) is refused at once.
* **Its own threads.** Builds run on a dedicated executor of LORAMUX_COMPOSITION_BUILD_THREADS threads
  (one intra-op torch thread each); callers await, so no thread of the shared AnyIO pool ever blocks on one.
* **Single flight, and a share per tenant.** One build per digest at a time, whoever waits for it; each
  tenant has at most LORAMUX_COMPOSITION_BUILDS_PER_TENANT builds in flight (the others wait), so one
  tenant's distinct weights queue behind each other, not in front of everyone's.
* **Leases.** A build holds its components' host-RAM leases until its thread is done reading them, whatever
  becomes of the requests that asked for it (a client that disconnects mid-build included).

`acquire` returns the composite leased; the request gives it back with `AdapterCache.release(digest)` when it
ends, like an adapter lease. Errors are domain errors (`CompositionCapacityError`, `CompositionTooLargeError`,
`CompositionError`, `AdapterLoadError`, TimeoutError); the HTTP layer maps them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable, Sequence

from loramux.adapters.composition.weighted import composite_nbytes
from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.residency.cache_levels import AdapterCache, _one_intra_op_thread
from loramux.adapters.storage.registry import AdapterVersionInfo

__all__ = ["CompositionCache", "CompositionCapacityError", "CompositionTooLargeError"]


class CompositionCapacityError(RuntimeError):
    """No room for a composite within the request's deadline (host RAM held by running requests, or the
    tenant's builds in flight): retryable."""


class CompositionTooLargeError(ValueError):
    """A composite larger than the whole host RAM budget: it can never be built here."""

    def __init__(self, nbytes: int, budget: int):
        super().__init__(f"the combined adapters take {nbytes / 2**20:.1f} MiB in host RAM (with their components "
                         f"while it is built), more than this server's "
                         f"whole host adapter budget of {budget / 2**20:.1f} MiB (LORAMUX_HOST_CACHE_BYTES): combine "
                         "fewer or smaller adapters")
        self.nbytes = nbytes
        self.budget = budget


class CompositionCache:
    """Composites by digest in `adapters`' host RAM level; see the module docstring. Use on one event loop."""

    def __init__(self, adapters: AdapterCache, build_threads: int = 1, builds_per_tenant: int = 2):
        self.adapters = adapters
        self.builds_per_tenant = builds_per_tenant
        self.builds = 0  # composites built (a hit, or a wait on another request's build, is not counted)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max(1, build_threads), thread_name_prefix="loramux-composition", initializer=_one_intra_op_thread)
        self._building: dict[str, asyncio.Task] = {}
        self._tenant_builds: Counter[str] = Counter()
        self._waiting_for: dict[str, str] = {}  # digest -> why its build waits (room, or its tenant's turn)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()  # replaced on every change: waiters re-check their condition
        adapters.release_listeners.append(self._wake_threadsafe)

    @property
    def building(self) -> int:
        """Builds in flight now."""
        return len(self._building)

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _until(self, digest: str, ready: Callable[[], bool], deadline: float, why: str) -> None:
        """Return once `ready()` holds (checked again at every release); CompositionCapacityError at `deadline`."""
        try:
            while not ready():
                self._waiting_for[digest] = why
                changed = self._changed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CompositionCapacityError(why)
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    raise CompositionCapacityError(why) from None
        finally:
            self._waiting_for.pop(digest, None)

    async def acquire(self, digest: str, tenant: str, versions: Sequence[AdapterVersionInfo],
                      check: Callable[[list[LoRAAdapter]], None],
                      build: Callable[[list[LoRAAdapter]], LoRAAdapter], deadline: float) -> LoRAAdapter:
        """The composite `digest` leased in host RAM: cached, or built once from `versions` (each brought into
        host RAM and leased for the build), `check`ed on the event loop (raise to refuse them) and `build`
        on the executor. Waits at most until `deadline` (time.monotonic()): TimeoutError for a component that
        did not load in time, CompositionCapacityError for no room. A request that stops waiting leaves the
        build running for the others (it caches its result)."""
        self._loop = asyncio.get_running_loop()
        while True:
            adapter = self.adapters.lease(digest)
            if adapter is not None:
                return adapter
            task = self._building.get(digest)
            if task is None:
                task = asyncio.ensure_future(self._build(digest, tenant, versions, check, build, deadline))
                self._building[digest] = task
                task.add_done_callback(lambda done: self._built(digest, done))
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(asyncio.shield(task), max(0.001, remaining))
            except asyncio.TimeoutError:
                waiting_for = self._waiting_for.get(digest)
                if waiting_for is not None:  # the build is still waiting for room or for its tenant's turn
                    raise CompositionCapacityError(waiting_for) from None
                raise TimeoutError("the combined adapters were not ready within the request's deadline") from None
            # Built and cached: lease it on the next turn (built again, within the deadline, if it was evicted).

    def _built(self, digest: str, task: asyncio.Task) -> None:
        if self._building.get(digest) is task:
            del self._building[digest]
        if not task.cancelled():
            task.exception()  # retrieved here: a build whose waiters all gave up still ends quietly
        self._wake()

    async def _build(self, digest: str, tenant: str, versions: Sequence[AdapterVersionInfo],
                     check: Callable[[list[LoRAAdapter]], None], build: Callable[[list[LoRAAdapter]], LoRAAdapter],
                     deadline: float) -> None:
        """Lease the components, check them, reserve the composite's bytes, build it on the executor and put
        it into host RAM (unleased). Everything taken is given back however it ends; the leases and the
        reservation only once the build thread is done with them."""
        await self._until(digest, lambda: self._tenant_builds[tenant] < self.builds_per_tenant, deadline,
                          f"this tenant already has {self.builds_per_tenant} combinations of adapters being built "
                          "(LORAMUX_COMPOSITION_BUILDS_PER_TENANT); retry shortly")
        self._tenant_builds[tenant] += 1
        leases: list[LoRAAdapter] = []
        reserved = 0
        future: concurrent.futures.Future | None = None
        try:
            for version in versions:
                acquired = await self.adapters.acquire(version, max(0.001, deadline - time.monotonic()))
                leases.append(acquired.adapter)
            check(leases)
            nbytes = composite_nbytes(leases)
            budget = self.adapters.host.budget
            if nbytes + sum(adapter.nbytes for adapter in leases) > budget:  # its components stay in RAM meanwhile
                raise CompositionTooLargeError(nbytes + sum(adapter.nbytes for adapter in leases), budget)
            await self._until(digest, lambda: self.adapters.reserve(nbytes), deadline,
                              f"host RAM for adapters is full ({budget / 2**20:.0f} MiB, LORAMUX_HOST_CACHE_BYTES, "
                              "held by running requests); retry shortly")
            reserved = nbytes
            future = self._executor.submit(build, list(leases))
            adapter = await asyncio.wrap_future(future)
            self.adapters.insert_reserved(adapter, reserved)
            reserved = 0
            self.builds += 1
        finally:
            self._tenant_builds[tenant] -= 1
            if self._tenant_builds[tenant] <= 0:
                del self._tenant_builds[tenant]
            if future is None or future.done():
                self._give_back(leases, reserved)
            else:  # cancelled while the thread still reads the components: give them back when it is done
                future.add_done_callback(lambda _: self._give_back(leases, reserved))

    def _give_back(self, leases: list[LoRAAdapter], reserved: int) -> None:
        if reserved:
            self.adapters.unreserve(reserved)
        for adapter in leases:
            self.adapters.release(adapter.digest)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
