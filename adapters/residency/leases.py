"""Cached copies that requests lease: a byte-budgeted LRU whose leased entries are never evicted.

The one mechanism by which a request (or a composite's build) keeps a cached copy while it uses it: the
host RAM level of adapters, composites and Medusa heads (`cache_levels.HostCache`) and the device copies of
requests' Medusa heads (`loramux.engine.speculation.medusa_device_cache`).

* `lease(key)` takes one more lease on a cached entry (None when it is not cached); `insert_leased` adds an
  entry leased once; `release(key)` gives one lease back. Entries are keyed by digest.
* Only entries nobody leases are evicted, least recently used first, so the table exceeds its budget only by
  what is leased. An entry discarded while leased goes at its last release.
* `reserve(nbytes)` sets bytes aside for an entry still being made (they count as if present) and never takes
  the table past its budget; `insert_reserved` turns the reservation into the entry.
* `cap(kind, nbytes)`: entries of one kind take at most `nbytes` of the budget (their own least recently used
  unleased ones are evicted first).

Not thread-safe: every caller guards its table with its own lock.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["LeaseTable", "Leased"]


class _Cacheable(Protocol):
    @property
    def digest(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


T = TypeVar("T", bound=_Cacheable)


@dataclass
class Leased(Generic[T]):
    item: T
    nbytes: int
    kind: str = ""
    leases: int = 0
    doomed: bool = False  # discarded while leased: dropped at the last release


class LeaseTable(Generic[T]):
    """Items (with a `digest` and their size in `nbytes`) by digest within `budget` bytes; see the module
    docstring."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.reserved = 0  # bytes of entries being made (`reserve`)
        self.evictions = 0  # unleased entries dropped for room
        self._caps: dict[str, int] = {}
        self._entries: OrderedDict[str, Leased[T]] = OrderedDict()  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def cap(self, kind: str, nbytes: int) -> None:
        """Entries of `kind` take at most `nbytes` (leased ones excepted)."""
        self._caps[kind] = nbytes

    def count(self, kind: str) -> tuple[int, int]:
        """(entries, bytes) of one kind."""
        found = [e.nbytes for e in self._entries.values() if e.kind == kind]
        return len(found), sum(found)

    def get(self, key: str) -> T | None:
        """The cached item, unleased, without touching its place in the LRU order."""
        entry = self._entries.get(key)
        return None if entry is None else entry.item

    def touch(self, key: str) -> T | None:
        """The cached item, unleased, now the most recently used; None when it is not cached."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.item

    def leases(self, key: str) -> int:
        """Leases on `key` now (0 when unleased or not cached)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.leases

    def leased(self) -> int:
        """Entries with at least one lease."""
        return sum(1 for e in self._entries.values() if e.leases)

    def lease(self, key: str) -> T | None:
        """The cached item with one more lease (give it back with `release`), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.leases += 1
        self._entries.move_to_end(key)
        return entry.item

    def insert_leased(self, item: T, kind: str = "") -> T:
        """`item` leased once more: the cached entry of its digest if there is one (re-inserted if it was
        evicted), room made for it first otherwise. Returns the cached item."""
        entry = self._entries.get(item.digest)
        if entry is None:
            self._make_room(item.nbytes, kind)
            entry = self._entries[item.digest] = Leased(item, item.nbytes, kind)
        entry.leases += 1
        self._entries.move_to_end(item.digest)
        return entry.item

    def release(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.leases <= 0:
            raise RuntimeError(f"cached copy {key[:12]}… released more often than leased")
        entry.leases -= 1
        if entry.leases == 0 and entry.doomed:
            del self._entries[key]
        elif self.nbytes > self.budget:
            self._make_room(0)

    def discard(self, key: str) -> None:
        """Drop `key` now, or at its last release while it is leased."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.leases:
            entry.doomed = True
        else:
            del self._entries[key]

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more would fit once every unleased entry were evicted (nothing is evicted)."""
        held = sum(e.nbytes for e in self._entries.values() if e.leases)
        return held + self.reserved + nbytes <= self.budget

    def reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` for an entry to come (`insert_reserved`), evicting unleased entries (least recently
        used first) as needed; False, with nothing reserved, when leased entries and other reservations leave
        too little room: unlike `insert_leased`, a reservation never takes the table past its budget."""
        self._make_room(nbytes)
        if self.nbytes + self.reserved + nbytes > self.budget:
            return False
        self.reserved += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def insert_reserved(self, item: T, reserved: int, kind: str = "") -> None:
        """Turn a reservation of `reserved` bytes into the unleased entry `item` (the most recently used)."""
        self.reserved -= reserved
        if item.digest not in self._entries:
            self._entries[item.digest] = Leased(item, item.nbytes, kind)
        self._entries.move_to_end(item.digest)

    def _make_room(self, incoming: int, kind: str = "") -> None:
        """Evict unleased entries, least recently used first, until `incoming` more bytes fit the budget (and,
        for a capped `kind`, its cap)."""
        cap = self._caps.get(kind)
        if cap is not None:
            self._evict_until(lambda: self.count(kind)[1] + incoming <= cap, lambda e: e.kind == kind)
        self._evict_until(lambda: self.nbytes + self.reserved + incoming <= self.budget, lambda e: True)

    def _evict_until(self, done: Callable[[], bool], which: Callable[[Leased[T]], bool]) -> None:
        for key in [k for k, e in self._entries.items() if e.leases == 0 and which(e)]:
            if done():
                return
            del self._entries[key]
            self.evictions += 1
