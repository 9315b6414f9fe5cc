"""Composite adapters (`loramux.adapters.composition`) in host RAM: the most recently used few, keyed by their
composition digest, each built once however many requests ask for it at the same time.

A composite is only a cache entry: the engine holds the object a request brought until that request ends
(its residency keeps the host copy), so evicting it here never disturbs a running request; the next request
for it builds it again from its components. Entries are bounded by count (LORAMUX_COMPOSITION_CACHE_SIZE),
each about the size of its components together.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable

from loramux.adapters.peft_format import LoRAAdapter


class CompositionCache:
    """An LRU of composites with single-flight builds; safe across threads."""

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._building: dict[str, concurrent.futures.Future] = {}
        self.builds = 0  # composites built (a hit or a wait on another request's build is not counted)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._entries

    def get(self, digest: str) -> LoRAAdapter | None:
        """The cached composite (now the most recently used), or None."""
        with self._lock:
            adapter = self._entries.get(digest)
            if adapter is not None:
                self._entries.move_to_end(digest)
            return adapter

    def get_or_build(self, digest: str, build: Callable[[], LoRAAdapter]) -> LoRAAdapter:
        """The composite `digest`: cached, or built by `build()` in this thread, or, when another thread is
        building it, that build's result (or its exception). Blocking: call it off the event loop."""
        with self._lock:
            adapter = self._entries.get(digest)
            if adapter is not None:
                self._entries.move_to_end(digest)
                return adapter
            future = self._building.get(digest)
            owner = future is None
            if owner:
                future = self._building[digest] = concurrent.futures.Future()
        if not owner:
            return future.result()
        try:
            adapter = build()
        except BaseException as exc:
            with self._lock:
                del self._building[digest]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._building[digest]
            self.builds += 1
            if self.capacity:
                self._entries[digest] = adapter
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
        future.set_result(adapter)
        return adapter
