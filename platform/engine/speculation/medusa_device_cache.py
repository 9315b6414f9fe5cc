"""Device copies of requests' own Medusa head sets, by digest, within one byte budget (LRU).

Semantics:

* `acquire(weights)` returns the set's device copy leased for one more user, or None when the request must run
  without these heads. A cached copy is reused (no rebuild, whether or not it is in use). A missing one is built
  only if its bytes fit the budget once unused copies are evicted, least recently used first; when every cached
  copy is in use and the new one still does not fit, nothing is built and the answer is None. A build that fails
  (a torch out-of-memory error, any RuntimeError) is also None: heads only speed a request up, so not having
  them never refuses it.
* `release(heads)` drops one user. A copy nobody uses stays cached (the next request with its digest finds it)
  until the room is needed for another set.
* The bytes of all cached copies, plus the one being built, never exceed `budget_bytes`.
* The copies and their leases are a `LeaseTable` (`loramux.adapters.residency.leases`), the mechanism by which
  requests lease adapters and heads in host RAM too.
* Thread-safe. Builds (the stack and copy to the device) run on the caller's thread, one at a time, outside the
  bookkeeping lock: call `acquire` off the engine's step thread (`AsyncEngine` does, before the request enters
  the engine). `cached` and `release` only take that lock for a few dict operations, so the step thread never
  waits for a build.

The engine's own heads for requests that bring none (`LLMEngine.set_medusa_heads`, loaded once at start) are
not cached here and not counted against the budget.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.adapters.residency.leases import LeaseTable
from loramux.engine.speculation.medusa_heads import MedusaHeads

__all__ = ["MedusaDeviceCache", "device_bytes"]

log = logging.getLogger(__name__)


def device_bytes(weights: MedusaHeadsWeights, dtype: torch.dtype) -> int:
    """Bytes of the device copy of `weights` at `dtype`: K x (H x H + H) elements."""
    h = weights.hidden_size
    return weights.num_heads * (h * h + h) * torch.empty((), dtype=dtype).element_size()


class MedusaDeviceCache:
    """Head sets on the device by digest: `build(weights)` makes a copy of `size(weights)` bytes."""

    def __init__(self, budget_bytes: int, build: Callable[[MedusaHeadsWeights], MedusaHeads],
                 size: Callable[[MedusaHeadsWeights], int]):
        self._build = build
        self._size = size
        self._lock = threading.Lock()  # the table below; never held across a build
        self._build_lock = threading.Lock()  # one build at a time (so one reservation at a time)
        self._table: LeaseTable[MedusaHeads] = LeaseTable(budget_bytes)
        self.builds = 0  # device copies made
        self.no_room = 0  # requests that ran without their heads: every cached copy in use, no room
        self.build_failures = 0  # requests that ran without their heads: the copy could not be made

    @property
    def budget(self) -> int:
        return self._table.budget

    def cached(self, digest: str) -> MedusaHeads | None:
        """The cached copy of `digest` leased for one more user (release it), or None; never builds."""
        with self._lock:
            return self._table.lease(digest)

    def acquire(self, weights: MedusaHeadsWeights) -> MedusaHeads | None:
        """The device copy of `weights` leased for one more user (release it), built if needed and if it fits;
        None: run without these heads (see the module docstring). Blocks while building: not on the step
        thread."""
        heads = self.cached(weights.digest)
        if heads is not None:
            return heads
        with self._build_lock:
            with self._lock:
                heads = self._table.lease(weights.digest)  # built by another caller meanwhile
                if heads is not None:
                    return heads
                nbytes = self._size(weights)
                # Nothing is evicted for a copy that cannot fit beside the sets in use anyway.
                if not (self._table.fits(nbytes) and self._table.reserve(nbytes)):
                    self.no_room += 1
                    log.info("Medusa heads %s (%d bytes) do not fit LORAMUX_MEDUSA_DEVICE_BYTES=%d beside the "
                             "sets in use; the request runs without them", weights.digest[:12], nbytes, self.budget)
                    return None
            try:
                heads = self._build(weights)
            except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                with self._lock:
                    self._table.unreserve(nbytes)
                    self.build_failures += 1
                log.warning("Medusa heads %s could not be copied to the device (%s); the request runs without "
                            "them", weights.digest[:12], exc)
                return None
            except BaseException:
                with self._lock:
                    self._table.unreserve(nbytes)
                raise
            with self._lock:
                self.builds += 1
                self._table.insert_reserved(heads, nbytes)
                return self._table.lease(heads.digest)

    def release(self, heads: MedusaHeads) -> None:
        """One user of `heads` is done; the copy stays cached while there is room."""
        with self._lock:
            if self._table.get(heads.digest) is heads and self._table.leases(heads.digest) > 0:
                self._table.release(heads.digest)

    def leases(self, digest: str) -> int:
        """Users of the cached copy of `digest` (0 when unused or not cached)."""
        with self._lock:
            return self._table.leases(digest)

    def stats(self) -> dict:
        """bytes / budget_bytes / sets / sets_in_use, and the counters builds, evictions, no_room,
        build_failures."""
        with self._lock:
            table = self._table
            return {"bytes": table.nbytes + table.reserved, "budget_bytes": table.budget, "sets": len(table),
                    "sets_in_use": table.leased(), "builds": self.builds, "evictions": table.evictions,
                    "no_room": self.no_room, "build_failures": self.build_failures}
