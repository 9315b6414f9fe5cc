"""Where an adapter version is, as operators see it, and the adapters they pin in host RAM.

`where_is` puts together the levels: the device (the engine's `AdapterResidency`, asked through
`EngineClient.adapter_residency`), host RAM and local disk (`AdapterCache`), and the store (always: a live
version's blob is there).

Pinning is the operator's choice (`POST /admin/adapters/{id}/pin`, the console): the adapter's latest version
is kept in host RAM until unpinned. Each pin holds one lease on its host RAM copy (`AdapterCache.acquire`), so
the copy is never evicted; a request's own leases come and go beside it.
"""
from __future__ import annotations

from collections.abc import Callable

from loramux.adapters.residency.cache_levels import AdapterCache
from loramux.adapters.storage.registry import AdapterVersionInfo

__all__ = ["PinnedAdapters", "where_is"]

# the engine's answer (None: it has no such version) -> the API's; else "absent"
_DEVICE_STATES: dict[str | None, str] = {"device": "resident", "loading": "loading"}


def where_is(version: AdapterVersionInfo, cache: AdapterCache, device_state: Callable[[str], str | None]) -> dict:
    """Where `version` is now: device (resident / loading / absent; `device_state(digest)` is the engine's
    answer), host RAM, local disk, the store."""
    return {"version": version.version, "device": _DEVICE_STATES.get(device_state(version.digest), "absent"),
            "ram": cache.has_in_ram(version.digest), "disk": cache.has_on_disk(version.digest), "store": True}


class PinnedAdapters:
    """Adapters pinned in host RAM by operators: adapter id -> the digest of the version pinned, each holding
    one lease on `cache`'s copy. Use on one event loop; `unpin` may run on a worker thread."""

    def __init__(self, cache: AdapterCache):
        self.cache = cache
        self._pins: dict[str, str] = {}

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._pins

    def digests(self) -> frozenset[str]:
        """The digests of the versions pinned now (the metrics' `pinned` label); safe from any thread."""
        return frozenset(list(self._pins.values()))  # one C-level copy first: pins may change meanwhile

    async def pin(self, version: AdapterVersionInfo, timeout: float | None = None) -> None:
        """Keep `version` (an adapter's latest) in host RAM until `unpin`; AdapterLoadError, TimeoutError."""
        adapter_id = version.adapter_id
        if adapter_id in self._pins:
            return
        await self.cache.acquire(version, timeout)
        # No await from here on: a concurrent pin call that recorded its pin while this one loaded wins, and
        # this call gives its lease back, so each recorded pin holds exactly one.
        if adapter_id in self._pins:
            self.cache.release(version.digest)
        else:
            self._pins[adapter_id] = version.digest

    def unpin(self, adapter_id: str) -> None:
        """Give the pin's lease back (nothing when `adapter_id` is not pinned)."""
        digest = self._pins.pop(adapter_id, None)  # one atomic step, also from a worker thread
        if digest is not None:
            self.cache.release(digest)
