"""Device adapter slots: which adapter sits in which slot (torch-free) and the stacked slot buffers.

A slot holds one adapter's A/B matrices for every layer, zero-padded to the pool's max rank. Running
sequences pin their adapter's slot; activating an adapter takes a free slot or else the least recently
used slot that no running sequence pins.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable


class NoFreeSlotError(RuntimeError):
    """Every slot is pinned by running sequences."""


class SlotTable:
    """Bookkeeping only (no tensors): adapter key -> slot, pins and LRU order."""

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self.key_of: list[Hashable | None] = [None] * num_slots
        self.pins = [0] * num_slots
        self.last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self.loads = 0  # adapters copied into a slot so far (cache misses)

    def slot_of(self, key: Hashable) -> int | None:
        try:
            return self.key_of.index(key)
        except ValueError:
            return None

    def _victim(self) -> int | None:
        free = [s for s in range(self.num_slots) if self.key_of[s] is None]
        if free:
            return free[0]
        unpinned = [s for s in range(self.num_slots) if self.pins[s] == 0]
        return min(unpinned, key=lambda s: self.last_used[s]) if unpinned else None

    def can_acquire(self, key: Hashable) -> bool:
        return self.slot_of(key) is not None or self._victim() is not None

    def acquire(self, key: Hashable) -> tuple[int, bool]:
        """Pin `key`'s slot, placing it first if needed; returns (slot, whether it must be loaded)."""
        slot = self.slot_of(key)
        needs_load = slot is None
        if slot is None:
            slot = self._victim()
            if slot is None:
                raise NoFreeSlotError(f"all {self.num_slots} adapter slots are pinned by running requests")
            self.key_of[slot] = key
            self.loads += 1
        self.pins[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot, needs_load

    def release(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise RuntimeError(f"slot {slot} released more often than acquired")
        self.pins[slot] -= 1
        self.last_used[slot] = next(self._clock)

    def evict(self, key: Hashable) -> bool:
        """Forget `key` if it is resident and unpinned (e.g. the adapter was deleted)."""
        slot = self.slot_of(key)
        if slot is None or self.pins[slot]:
            return False
        self.key_of[slot] = None
        return True

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self.pins if p)
