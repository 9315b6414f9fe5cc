"""Device copies of requests' own Medusa head sets, by digest, within one byte budget (LRU).

Semantics:

* `acquire(weights)` returns the set's device copy pinned for one more user, or None when the request must run
  without these heads. A cached copy is reused (no rebuild, whether or not it is in use). A missing one is built
  only if its bytes fit the budget once unused copies are evicted, least recently used first; when every cached
  copy is in use and the new one still does not fit, nothing is built and the answer is None. A build that fails
  (a torch out-of-memory error, any RuntimeError) is also None: heads only speed a request up, so not having
  them never refuses it.
* `release(heads)` drops one user. A copy nobody uses stays cached (the next request with its digest finds it)
  until the room is needed for another set.
* The bytes of all cached copies, plus the one being built, never exceed `budget_bytes`.
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
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.engine.speculation.medusa_heads import MedusaHeads

__all__ = ["MedusaDeviceCache", "device_bytes"]

log = logging.getLogger(__name__)


def device_bytes(weights: MedusaHeadsWeights, dtype: torch.dtype) -> int:
    """Bytes of the device copy of `weights` at `dtype`: K x (H x H + H) elements."""
    h = weights.hidden_size
    return weights.num_heads * (h * h + h) * torch.empty((), dtype=dtype).element_size()


@dataclass
class _Entry:
    heads: MedusaHeads
    nbytes: int
    users: int = 0


class MedusaDeviceCache:
    """Head sets on the device by digest: `build(weights)` makes a copy of `size(weights)` bytes."""

    def __init__(self, budget_bytes: int, build: Callable[[MedusaHeadsWeights], MedusaHeads],
                 size: Callable[[MedusaHeadsWeights], int]):
        self.budget = budget_bytes
        self._build = build
        self._size = size
        self._lock = threading.Lock()  # the bookkeeping below; never held across a build
        self._build_lock = threading.Lock()  # one build at a time (so one reservation at a time)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._reserved = 0  # bytes of the build in progress
        self.builds = 0  # device copies made
        self.evictions = 0  # unused copies dropped for room
        self.no_room = 0  # requests that ran without their heads: every cached copy in use, no room
        self.build_failures = 0  # requests that ran without their heads: the copy could not be made

    def _pin(self, digest: str) -> MedusaHeads | None:  # caller holds the lock
        entry = self._entries.get(digest)
        if entry is None:
            return None
        entry.users += 1
        self._entries.move_to_end(digest)
        return entry.heads

    def cached(self, digest: str) -> MedusaHeads | None:
        """The cached copy of `digest` pinned for one more user (release it), or None; never builds."""
        with self._lock:
            return self._pin(digest)

    def acquire(self, weights: MedusaHeadsWeights) -> MedusaHeads | None:
        """The device copy of `weights` pinned for one more user (release it), built if needed and if it fits;
        None: run without these heads (see the module docstring). Blocks while building: not on the step
        thread."""
        heads = self.cached(weights.digest)
        if heads is not None:
            return heads
        with self._build_lock:
            with self._lock:
                heads = self._pin(weights.digest)  # built by another caller meanwhile
                if heads is not None:
                    return heads
                nbytes = self._size(weights)
                if not self._make_room(nbytes):
                    self.no_room += 1
                    log.info("Medusa heads %s (%d bytes) do not fit LORAMUX_MEDUSA_DEVICE_BYTES=%d beside the "
                             "sets in use; the request runs without them", weights.digest[:12], nbytes, self.budget)
                    return None
                self._reserved = nbytes
            try:
                heads = self._build(weights)
            except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
                with self._lock:
                    self._reserved = 0
                    self.build_failures += 1
                log.warning("Medusa heads %s could not be copied to the device (%s); the request runs without "
                            "them", weights.digest[:12], exc)
                return None
            except BaseException:
                with self._lock:
                    self._reserved = 0
                raise
            with self._lock:
                self._reserved = 0
                self.builds += 1
                self._entries[weights.digest] = _Entry(heads, nbytes, users=1)
            return heads

    def _make_room(self, nbytes: int) -> bool:  # caller holds the lock
        """Evict unused copies, least recently used first, until `nbytes` more fit; False (nothing evicted)
        when even evicting every unused copy would not make room."""
        used = self._held_bytes()
        unused = [(d, e) for d, e in self._entries.items() if e.users == 0]
        if used - sum(e.nbytes for _, e in unused) + nbytes > self.budget:
            return False
        for digest, entry in unused:
            if used + nbytes <= self.budget:
                break
            del self._entries[digest]
            used -= entry.nbytes
            self.evictions += 1
        return True

    def _held_bytes(self) -> int:  # caller holds the lock
        return sum(e.nbytes for e in self._entries.values()) + self._reserved

    def release(self, heads: MedusaHeads) -> None:
        """One user of `heads` is done; the copy stays cached while there is room."""
        with self._lock:
            entry = self._entries.get(heads.digest)
            if entry is not None and entry.heads is heads and entry.users > 0:
                entry.users -= 1

    def users(self, digest: str) -> int:
        """Users of the cached copy of `digest` (0 when unused or not cached)."""
        with self._lock:
            entry = self._entries.get(digest)
            return entry.users if entry is not None else 0

    def stats(self) -> dict:
        """bytes / budget_bytes / sets / sets_in_use, and the counters builds, evictions, no_room,
        build_failures."""
        with self._lock:
            return {"bytes": self._held_bytes(), "budget_bytes": self.budget, "sets": len(self._entries),
                    "sets_in_use": sum(1 for e in self._entries.values() if e.users), "builds": self.builds,
                    "evictions": self.evictions, "no_room": self.no_room, "build_failures": self.build_failures}
