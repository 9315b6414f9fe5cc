"""Medusa heads on their way to the engine: object store -> local disk cache -> host RAM, keyed by digest.

Heads go through the adapters' own loader (`AdapterCache.load_blob`, `loramux.adapters.residency.cache_levels`):
the same disk cache, the same digest check before anything is parsed, the same single flight (one load per
digest however many requests wait) and the same host RAM level, so heads count against
LORAMUX_HOST_CACHE_BYTES with adapters and composites; within it they take at most `budget_bytes`
(LORAMUX_MEDUSA_CACHE_BYTES). What is specific to heads: the blob is parsed for the served model's hidden size,
and nothing is leased: a request's engine holds the heads object it was given until it ends, so an entry evicted
meanwhile only costs a reload later.
"""
from __future__ import annotations

from collections import Counter

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.adapters.residency.cache_levels import MEDUSA, AdapterCache, StoredBlob
from loramux.adapters.storage.medusa_registry import MedusaHeadsInfo, unpack_medusa

__all__ = ["MedusaCache", "MedusaLoadError"]


class MedusaLoadError(RuntimeError):
    """Heads could not be brought into host RAM (the request then runs without them); `detail` says why."""

    def __init__(self, info: MedusaHeadsInfo, detail: str):
        super().__init__(f"Medusa heads {info.id} could not be loaded from storage")
        self.info = info
        self.detail = detail


class _HeadsBlob(StoredBlob[MedusaHeadsWeights]):
    kind = MEDUSA
    record: MedusaHeadsInfo

    def __init__(self, info: MedusaHeadsInfo, hidden_size: int):
        super().__init__(info)
        self.hidden_size = hidden_size

    @property
    def label(self) -> str:
        return f"Medusa heads {self.record.id}"

    def parse(self, data: bytes) -> MedusaHeadsWeights:
        return unpack_medusa(data, self.hidden_size, self.record.digest)

    def error(self, detail: str, retryable: bool) -> MedusaLoadError:
        return MedusaLoadError(self.record, detail)


class MedusaCache:
    """Heads by digest in the host RAM level of `loader`, within `budget_bytes` of it."""

    def __init__(self, loader: AdapterCache, hidden_size: int, budget_bytes: int):
        self.loader = loader
        self.hidden_size = hidden_size
        self.budget = budget_bytes
        loader.host.cap(MEDUSA, budget_bytes)

    @property
    def hits(self) -> Counter[str]:
        """RAM hits and loads by level (ram, disk, store)."""
        return self.loader.counters[MEDUSA].hits

    def get_nowait(self, digest: str) -> MedusaHeadsWeights | None:
        """The heads if they are in host RAM now (no load)."""
        return self.loader.cached(digest, MEDUSA)

    async def get(self, info: MedusaHeadsInfo, timeout: float | None = None) -> MedusaHeadsWeights:
        """The heads in host RAM, loading them if needed; MedusaLoadError, or TimeoutError after `timeout`
        seconds (the shared load goes on, so a later request finds them)."""
        return (await self.loader.load_blob(_HeadsBlob(info, self.hidden_size), timeout, lease=False)).adapter

    def get_blocking(self, info: MedusaHeadsInfo, timeout: float | None = None) -> MedusaHeadsWeights:
        """`get` for synchronous callers (CLI, scripts); never on an event loop thread."""
        return self.loader.load_blob_blocking(_HeadsBlob(info, self.hidden_size), timeout, lease=False).adapter

    def evict(self, digest: str) -> None:
        """Forget heads everywhere (no live row uses their digest any more)."""
        self.loader.evict(digest)

    def has_in_ram(self, digest: str) -> bool:
        return self.loader.has_in_ram(digest)
