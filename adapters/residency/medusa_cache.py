"""Medusa heads on their way to the engine: object store -> local disk cache -> host RAM, keyed by digest.

The same levels as adapters (`loramux.adapters.residency.cache_levels`): the disk cache is the adapters' own (blobs by
digest, one byte budget), every byte read is checked against the digest before it is parsed, loads run on a
small thread pool with one load per digest at a time ("single flight"), and a failed load is not remembered.
Host RAM holds the parsed heads in their own LRU within `budget_bytes`. Nothing is pinned: a request's engine
holds the heads object it was given until it ends, so an entry evicted meanwhile only costs a reload later.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter, OrderedDict

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.adapters.formats.validation_common import AdapterFormatError
from loramux.adapters.residency.cache_levels import DiskCache
from loramux.adapters.storage.blob import DigestMismatchError
from loramux.adapters.storage.medusa_registry import MedusaHeadsInfo, unpack_medusa
from loramux.adapters.storage.store import BlobNotFoundError, ObjectStore, StoreError

log = logging.getLogger(__name__)


class MedusaLoadError(RuntimeError):
    """Heads could not be brought into host RAM (the request then runs without them); `detail` says why."""

    def __init__(self, info: MedusaHeadsInfo, detail: str):
        super().__init__(f"Medusa heads {info.id} could not be loaded from storage")
        self.info = info
        self.detail = detail


def _one_intra_op_thread() -> None:
    import torch

    torch.set_num_threads(1)  # as the adapter loads: no second OpenMP team contending with the engine's


class MedusaCache:
    """Heads by digest in host RAM (LRU within `budget_bytes`), loaded through the disk cache from the store."""

    def __init__(self, store: ObjectStore, disk: DiskCache, hidden_size: int, budget_bytes: int, max_workers: int = 2):
        self.store = store
        self.disk = disk
        self.hidden_size = hidden_size
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._host: OrderedDict[str, MedusaHeadsWeights] = OrderedDict()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="loramux-medusa-load",
                                                           initializer=_one_intra_op_thread)
        self.hits: Counter[str] = Counter()  # by level: ram, disk, store
        self.failures = 0

    # -- loading (worker threads) ------------------------------------------------------------------
    def _load(self, info: MedusaHeadsInfo) -> MedusaHeadsWeights:
        level, data = "disk", self.disk.get(info.digest)
        if data is None:
            level = "store"
            try:
                data = self.store.get(info.storage_key)
            except BlobNotFoundError as exc:
                raise self._failed(info, f"its blob is missing from the object store ({exc})") from None
            except StoreError as exc:
                raise self._failed(info, f"the object store failed ({exc})") from None
        try:
            heads = unpack_medusa(data, self.hidden_size, info.digest)
        except (DigestMismatchError, AdapterFormatError) as exc:
            if level == "disk":
                self.disk.discard(info.digest)
            raise self._failed(info, str(exc)) from None
        if level == "store":
            try:
                self.disk.put(info.digest, data)
            except OSError as exc:  # a full disk slows later loads down but must not fail this one
                log.warning("could not cache Medusa heads %s on disk: %s", info.id, exc)
        with self._lock:
            self.hits[level] += 1
            self._insert(heads)
        return heads

    @staticmethod
    def _failed(info: MedusaHeadsInfo, detail: str) -> MedusaLoadError:
        log.warning("Medusa heads %s (%s): load failed: %s", info.id, info.storage_key, detail)
        return MedusaLoadError(info, detail)

    def _insert(self, heads: MedusaHeadsWeights) -> None:  # caller holds the lock
        if heads.digest in self._host:
            self._host.move_to_end(heads.digest)
            return
        self._host[heads.digest] = heads
        while len(self._host) > 1 and sum(h.nbytes for h in self._host.values()) > self.budget:
            self._host.popitem(last=False)

    def _done(self, digest: str, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._inflight.get(digest) is future:
                del self._inflight[digest]
            if future.exception() is not None:
                self.failures += 1

    def _hit_or_load(self, info: MedusaHeadsInfo) -> MedusaHeadsWeights | concurrent.futures.Future:
        with self._lock:
            heads = self._host.get(info.digest)
            if heads is not None:
                self._host.move_to_end(info.digest)
                self.hits["ram"] += 1
                return heads
            future = self._inflight.get(info.digest)
            started = future is None
            if started:
                future = self._inflight[info.digest] = self._pool.submit(self._load, info)
        if started:  # outside the lock: a load already done runs the callback here, and it takes the lock
            future.add_done_callback(lambda f: self._done(info.digest, f))
        return future

    # -- public API ----------------------------------------------------------------------------------
    def get_nowait(self, digest: str) -> MedusaHeadsWeights | None:
        """The heads if they are in host RAM now (no load)."""
        with self._lock:
            heads = self._host.get(digest)
            if heads is not None:
                self._host.move_to_end(digest)
                self.hits["ram"] += 1
            return heads

    async def get(self, info: MedusaHeadsInfo, timeout: float | None = None) -> MedusaHeadsWeights:
        """The heads in host RAM, loading them if needed; MedusaLoadError, or TimeoutError after `timeout`
        seconds (the shared load goes on, so a later request finds them)."""
        hit = self._hit_or_load(info)
        if isinstance(hit, MedusaHeadsWeights):
            return hit
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(hit)), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"Medusa heads {info.id} did not load within {timeout:.1f} s") from None

    def get_blocking(self, info: MedusaHeadsInfo, timeout: float | None = None) -> MedusaHeadsWeights:
        """`get` for synchronous callers (CLI, scripts); never on an event loop thread."""
        hit = self._hit_or_load(info)
        if isinstance(hit, MedusaHeadsWeights):
            return hit
        try:
            return hit.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"Medusa heads {info.id} did not load within {timeout:.1f} s") from None

    def evict(self, digest: str) -> None:
        """Forget heads everywhere (no live row uses their digest any more)."""
        with self._lock:
            self._host.pop(digest, None)
        self.disk.discard(digest)

    def has_in_ram(self, digest: str) -> bool:
        with self._lock:
            return digest in self._host

    def drain(self, timeout: float | None = None) -> None:
        """Wait until no load is in flight (tests, shutdown)."""
        with self._lock:
            futures = list(self._inflight.values())
        concurrent.futures.wait(futures, timeout)

    def stats(self) -> dict:
        with self._lock:
            return {"host_bytes": sum(h.nbytes for h in self._host.values()), "host_budget_bytes": self.budget,
                    "host_heads": len(self._host), "hits": dict(self.hits), "load_failures": self.failures}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
