"""Adapter weights on their way to the engine: object store -> local disk cache -> host RAM cache.

`AdapterCache.acquire(version)` returns the adapter in host RAM, leased until `release`. Loads run on a
small thread pool, never on the caller's event loop or the engine thread, and there is one load per
digest at a time however many requests wait for it ("single flight"). A failed load is not
remembered: the next request tries again, so a store that recovers serves again at once. Every byte
read from the store or the disk cache is checked against the digest before it is parsed.
The same loader (`AdapterCache.load_blob`) brings Medusa heads into host RAM (`medusa_cache`), and composites
live in its host RAM level too (`loramux.adapters.composition.cache`): one budget, LORAMUX_HOST_CACHE_BYTES.
Device slots (the fourth level) belong to the engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.formats.validation_common import AdapterFormatError
from loramux.adapters.residency.leases import LeaseTable
from loramux.adapters.storage.blob import sha256_hex, unpack
from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.adapters.storage.store import BlobNotFoundError, ObjectStore, StoreError
from loramux.histogram import DurationHistogram

log = logging.getLogger(__name__)


class AdapterLoadError(RuntimeError):
    """An adapter version could not be brought into host RAM. The message is shown to tenants (503 bodies), so
    it only names the version: store errors name the store URL, bucket and key, which stay in `detail` and
    in the log."""

    def __init__(self, version: AdapterVersionInfo, detail: str, retryable: bool = True):
        message = (f"adapter {version.label} could not be loaded from storage; retry later" if retryable else
                   f"adapter {version.label} could not be loaded from storage: its stored weights are missing")
        super().__init__(message)
        self.version = version
        self.detail = detail
        self.retryable = retryable

    def __reduce__(self):
        return type(self), (self.version, self.detail, self.retryable)


def _one_intra_op_thread() -> None:
    import torch

    torch.set_num_threads(1)  # this thread's own setting; the engine thread keeps its own


class DiskCache:
    """Blobs on local disk under their digest, within a byte budget (least recently used evicted)."""

    def __init__(self, root: Path, budget_bytes: int):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, oldest use first
        entries = []
        for path in self.root.glob("*.blob"):
            stat = path.stat()
            entries.append((stat.st_mtime, path.stem, stat.st_size))
        for _, digest, size in sorted(entries):
            self._sizes[digest] = size
        for leftover in self.root.glob("*.tmp*"):  # a crash mid-write
            leftover.unlink(missing_ok=True)

    def _path(self, digest: str) -> Path:
        return self.root / f"{digest}.blob"

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._total()

    def _total(self) -> int:  # caller holds the lock
        return sum(self._sizes.values())

    def __contains__(self, digest: str) -> bool:
        return digest in self._sizes

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def get(self, digest: str) -> bytes | None:
        """The verified blob, or None (a file that fails verification is removed)."""
        with self._lock:
            if digest not in self._sizes:
                return None
            self._sizes.move_to_end(digest)
        try:
            data = self._path(digest).read_bytes()
        except FileNotFoundError:
            self.discard(digest)
            return None
        if sha256_hex(data) != digest:
            log.warning("disk cache entry %s… is corrupt; removed", digest[:12])
            self.discard(digest)
            return None
        os.utime(self._path(digest))
        return data

    def put(self, digest: str, data: bytes) -> None:
        if len(data) > self.budget:
            return
        path = self._path(digest)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._sizes[digest] = len(data)
            self._sizes.move_to_end(digest)
            while self._total() > self.budget:
                victim, _ = self._sizes.popitem(last=False)
                self._path(victim).unlink(missing_ok=True)

    def discard(self, digest: str) -> None:
        with self._lock:
            self._sizes.pop(digest, None)
        self._path(digest).unlink(missing_ok=True)


ADAPTER, MEDUSA = "", "medusa"  # the kinds of host RAM entries: adapters and composites, Medusa heads


class HostCache(LeaseTable):
    """Adapters, composites and Medusa heads in host RAM within one byte budget (LORAMUX_HOST_CACHE_BYTES).
    Leased entries (queued or running requests, a composite's build) are never evicted, so the cache can exceed
    its budget only by what is leased. `reserved` bytes (composites being built, `reserve`) count as if
    present: loads make room for them too. Medusa heads (kind `MEDUSA`) also stay within their own cap
    (LORAMUX_MEDUSA_CACHE_BYTES)."""


T = TypeVar("T")  # what a blob becomes in host RAM: a LoRAAdapter, Medusa heads


@dataclass(frozen=True)
class Acquired(Generic[T]):
    adapter: T  # what was brought into host RAM (Medusa heads too, for `load_blob`)
    level: str  # where it came from: "ram", "disk" or "store"
    load_ms: float


class StoredBlob(ABC, Generic[T]):
    """One stored blob for the loader: where it is (the registry's `record`: an AdapterVersionInfo or a
    MedusaHeadsInfo), what names it, what it becomes in host RAM. Read lazily: a host RAM hit only reads
    `digest` (and `kind`)."""

    kind: str = ADAPTER

    def __init__(self, record: Any):
        self.record = record

    @property
    def digest(self) -> str:
        return self.record.digest

    @property
    def storage_key(self) -> str:
        return self.record.storage_key

    @property
    @abstractmethod
    def label(self) -> str:
        """What names it in messages and logs: "adapter bot@1", "Medusa heads md_..."."""

    @abstractmethod
    def parse(self, data: bytes) -> T:
        """The verified bytes -> the host RAM item (with `digest` and `nbytes`); AdapterFormatError if bad."""

    @abstractmethod
    def error(self, detail: str, retryable: bool) -> Exception:
        """What the waiters get when the load fails."""


def adapter_reference(version: AdapterVersionInfo) -> str:
    """The name the engine knows a registry version by, `<adapter id>@<version>` (ad_...@N): a valid `model` for
    it, never the tenant-chosen name. The engine's stats feed the metrics (`vllm:lora_requests_info`,
    `vllm:lora_adapter_loaded`), which anyone who reaches /metrics reads."""
    return f"{version.adapter_id}@{version.version}"


class _AdapterBlob(StoredBlob[LoRAAdapter]):
    record: AdapterVersionInfo

    @property
    def label(self) -> str:
        return f"adapter {self.record.label}"

    def parse(self, data: bytes) -> LoRAAdapter:
        return unpack(data, adapter_reference(self.record), self.record.digest)

    def error(self, detail: str, retryable: bool) -> AdapterLoadError:
        return AdapterLoadError(self.record, detail, retryable)


@dataclass
class LoadCounters:
    """One kind's loads: hits by level (ram, disk, store), failures, downloads, seconds of successful loads."""

    hits: Counter[str] = field(default_factory=Counter)
    failures: int = 0
    downloads: int = 0
    load_seconds: dict[str, DurationHistogram] = field(
        default_factory=lambda: {"disk": DurationHistogram(), "store": DurationHistogram()})


class AdapterCache:
    """The engine-facing side of the levels: acquire / prefetch / release adapter versions; and the one loader of
    stored blobs into host RAM, which Medusa heads (`medusa_cache.MedusaCache`) go through too."""

    def __init__(self, store: ObjectStore, disk: DiskCache, host: HostCache, max_workers: int = 4):
        self.store = store
        self.disk = disk
        self.host = host
        self._lock = threading.Lock()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        # Loads parse and convert tensors: with one intra-op thread each, so they never add OpenMP teams
        # that contend with the engine's for the cores (see DevicePool).
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="loramux-adapter-load",
                                                           initializer=_one_intra_op_thread)
        self.counters: dict[str, LoadCounters] = {ADAPTER: LoadCounters(), MEDUSA: LoadCounters()}
        # Called (with no argument, in the releasing thread) after every release: room may have come free.
        self.release_listeners: list = []
        # digest -> (reference, rank) of the adapters asked for here, for `stats()["resident"]`: kept only while
        # the digest is in host RAM, on disk or loading (pruned whenever a new one is remembered), so it is
        # bounded by the levels' budgets. Changed and read under `_lock`.
        self._refs: dict[str, tuple[str, int]] = {}

    # The adapters' counters (what the metrics show); Medusa heads count theirs apart.
    @property
    def hits(self) -> Counter[str]:
        return self.counters[ADAPTER].hits

    @property
    def failures(self) -> int:
        return self.counters[ADAPTER].failures

    @property
    def downloads(self) -> int:
        return self.counters[ADAPTER].downloads

    @property
    def load_seconds(self) -> dict[str, DurationHistogram]:
        return self.counters[ADAPTER].load_seconds

    # -- loading (worker threads) ----------------------------------------------------------------
    def _load(self, blob: StoredBlob) -> tuple[Any, str]:
        level = "disk"
        data = self.disk.get(blob.digest)
        if data is None:
            level = "store"
            try:
                with self._lock:
                    self.counters[blob.kind].downloads += 1
                data = self.store.get(blob.storage_key)
            except BlobNotFoundError as exc:
                raise self._failed(blob, f"its blob is missing from the object store ({exc})",
                                   retryable=False) from None
            except StoreError as exc:
                raise self._failed(blob, f"the object store failed ({exc})") from None
        try:
            item = blob.parse(data)
        except AdapterFormatError as exc:  # a digest mismatch, or bytes that are not what was stored
            if level == "disk":
                self.disk.discard(blob.digest)
            raise self._failed(blob, str(exc)) from None
        if level == "store":
            try:
                self.disk.put(blob.digest, data)
            except OSError as exc:  # a full disk slows later loads down but must not fail this one
                log.warning("could not cache %s on disk: %s", blob.label, exc)
        return item, level

    @staticmethod
    def _failed(blob: StoredBlob, detail: str, retryable: bool = True) -> Exception:
        """The error for tenants (generic) with the detail for operators, logged here."""
        log.warning("%s (%s): load failed: %s", blob.label, blob.storage_key, detail)
        return blob.error(detail, retryable)

    def _start(self, blob: StoredBlob) -> tuple[concurrent.futures.Future, bool]:
        """The in-flight load of `blob`, starting one if none runs, and whether this call started it
        (caller holds the lock, then passes both to `_watched` once it has let the lock go)."""
        future = self._inflight.get(blob.digest)
        if future is not None:
            return future, False
        future = self._inflight[blob.digest] = self._pool.submit(self._timed_load, blob)
        return future, True

    def _watched(self, blob: StoredBlob, future: concurrent.futures.Future,
                 started: bool) -> concurrent.futures.Future:
        """`future`, with `_done` to run when it ends if this caller started it. Added outside the lock: on a
        load that is already done, add_done_callback runs `_done` at once in this thread, and `_done` takes
        the lock (not reentrant), so a fast load added under the lock deadlocked its caller."""
        if started:
            future.add_done_callback(lambda f: self._done(blob, f))
        return future

    def _timed_load(self, blob: StoredBlob):
        start = time.perf_counter()
        item, level = self._load(blob)
        seconds = time.perf_counter() - start
        self.counters[blob.kind].load_seconds[level].observe(seconds)
        return item, level, seconds * 1000

    def _done(self, blob: StoredBlob, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._inflight.get(blob.digest) is future:
                del self._inflight[blob.digest]
            if future.exception() is not None:
                self.counters[blob.kind].failures += 1
                return
            item, _, _ = future.result()
            # Keep it warm for the waiters (they lease it themselves); a prefetch with no waiter leaves it unleased.
            if item.digest not in self.host:
                self.host.insert_leased(item, blob.kind)
                self.host.release(item.digest)

    def _remember(self, digest: str, reference: str, rank: int) -> None:
        """Name `digest` for `stats()["resident"]` (caller holds the lock); a new one first drops the names of
        digests no level holds any more (evicted, or a load that failed)."""
        if digest not in self._refs:
            for gone in [d for d in self._refs if d not in self.host and d not in self.disk
                         and d not in self._inflight]:
                del self._refs[gone]
        self._refs[digest] = (reference, rank)

    def _remember_blob(self, blob: StoredBlob) -> None:
        """Name an adapter version's digest (Medusa heads are not adapters a request names). A record without
        an id or version (a stand-in) is not named: a listing must never fail a load."""
        record = blob.record
        if isinstance(blob, _AdapterBlob) and hasattr(record, "adapter_id") and hasattr(record, "version"):
            rank = getattr(record, "rank", 0)
            self._remember(blob.digest, adapter_reference(record), rank if isinstance(rank, int) else 0)

    def _lease_or_load(self, blob: StoredBlob[T], lease: bool) -> Acquired[T] | concurrent.futures.Future:
        """A RAM hit (leased when `lease`); or the (shared) load to wait for."""
        with self._lock:
            self._remember_blob(blob)
            item = self.host.lease(blob.digest) if lease else self.host.touch(blob.digest)
            if item is not None:
                self.counters[blob.kind].hits["ram"] += 1
                return Acquired(item, "ram", 0.0)
            future, started = self._start(blob)
        return self._watched(blob, future, started)

    def _loaded(self, blob: StoredBlob[T], result, lease: bool) -> Acquired[T]:
        item, level, load_ms = result
        with self._lock:
            if lease:
                item = self.host.insert_leased(item, blob.kind)  # re-inserted if evicted since the load ended
            self.counters[blob.kind].hits[level] += 1
        return Acquired(item, level, load_ms)

    async def load_blob(self, blob: StoredBlob[T], timeout: float | None = None, lease: bool = True
                        ) -> Acquired[T]:
        """`blob` in host RAM, leased when `lease` (give it back with `release`); raise `blob.error`'s error (or
        TimeoutError after `timeout` seconds: the shared load goes on for the other waiters)."""
        hit = self._lease_or_load(blob, lease)
        if isinstance(hit, Acquired):
            return hit
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(hit)), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{blob.label} did not load within {timeout:.1f} s") from None
        return self._loaded(blob, result, lease)

    def load_blob_blocking(self, blob: StoredBlob[T], timeout: float | None = None, lease: bool = True
                           ) -> Acquired[T]:
        """`load_blob` for synchronous callers (CLI, scripts); never call it on an event loop thread."""
        hit = self._lease_or_load(blob, lease)
        if isinstance(hit, Acquired):
            return hit
        try:
            result = hit.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{blob.label} did not load within {timeout:.1f} s") from None
        return self._loaded(blob, result, lease)

    def cached(self, digest: str, kind: str) -> Any | None:
        """The item `digest` if it is in host RAM now (unleased, counted as a RAM hit of `kind`); no load."""
        with self._lock:
            item = self.host.touch(digest)
            if item is not None:
                self.counters[kind].hits["ram"] += 1
            return item

    # -- adapter versions ------------------------------------------------------------------------
    def prefetch(self, version: AdapterVersionInfo) -> concurrent.futures.Future | None:
        """Start bringing `version` into host RAM without leasing it; None if it is already there."""
        blob = _AdapterBlob(version)
        with self._lock:
            self._remember_blob(blob)
            if version.digest in self.host:
                return None
            future, started = self._start(blob)
        return self._watched(blob, future, started)

    async def acquire(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired[LoRAAdapter]:
        """The adapter in host RAM, leased; raise AdapterLoadError (or TimeoutError after `timeout`
        seconds: the shared load goes on for the other waiters)."""
        return await self.load_blob(_AdapterBlob(version), timeout)

    def acquire_blocking(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired[LoRAAdapter]:
        """`acquire` for synchronous callers (CLI, scripts); never call it on an event loop thread."""
        return self.load_blob_blocking(_AdapterBlob(version), timeout)

    def release(self, digest: str) -> None:
        with self._lock:
            self.host.release(digest)
        for listener in self.release_listeners:
            listener()

    def lease(self, digest: str) -> LoRAAdapter | None:
        """The entry `digest` leased (give it back with `release`), or None when the host RAM cache lacks it."""
        with self._lock:
            return self.host.lease(digest)

    def reserve(self, nbytes: int) -> bool:
        """`HostCache.reserve` under the cache's lock."""
        with self._lock:
            return self.host.reserve(nbytes)

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.host.unreserve(nbytes)
        for listener in self.release_listeners:
            listener()

    def insert_reserved(self, adapter: LoRAAdapter, reserved: int) -> None:
        """`HostCache.insert_reserved` under the cache's lock (a composite: named by its own `name`)."""
        with self._lock:
            self.host.insert_reserved(adapter, reserved)
            rank = getattr(adapter, "rank", 0)
            self._remember(adapter.digest, adapter.name, rank if isinstance(rank, int) else 0)

    def evict(self, digest: str) -> None:
        """Forget a blob everywhere (no live version or heads use it); leased RAM copies go at their last release."""
        with self._lock:
            self.host.discard(digest)
            self._refs.pop(digest, None)
        self.disk.discard(digest)

    def has_in_ram(self, digest: str) -> bool:
        """Whether the blob with this digest is in the host RAM cache now."""
        with self._lock:
            return digest in self.host

    def has_on_disk(self, digest: str) -> bool:
        """Whether the blob with this digest is in the local disk cache now."""
        return digest in self.disk

    def drain(self, timeout: float | None = None) -> None:
        """Wait until no load is in flight (tests, shutdown)."""
        with self._lock:
            futures = list(self._inflight.values())
        concurrent.futures.wait(futures, timeout)

    def stats(self) -> dict:
        """Sizes and counters; read under the locks of the threads that change them (loads, other requests).
        `host_bytes` counts everything in host RAM (the budget's use); `host_adapters` the adapters and
        composites, `host_heads` / `host_heads_bytes` the Medusa heads. `hits`, `downloads`, `load_failures`
        and `load_seconds` ({"disk": ..., "store": ...}, `DurationHistogram.snapshot()` of successful loads) are
        the adapters'. `resident`: the adapters (and composites) held, one dict per level each is held at: digest,
        name (`adapter_reference`: ad_<id>@<version>; a composite's own name), rank, level ("host" or "disk");
        a blob left on disk by an earlier process is listed once a request asks for its version again."""
        disk_bytes, disk_adapters = self.disk.nbytes, len(self.disk)  # under the disk cache's own lock
        load_seconds = {level: hist.snapshot() for level, hist in self.load_seconds.items()}  # their own locks
        with self._lock:  # the host cache and the counters only change under this lock
            heads, heads_bytes = self.host.count(MEDUSA)
            resident = [{"digest": digest, "name": name, "rank": rank, "level": level}
                        for digest, (name, rank) in sorted(self._refs.items(), key=lambda item: item[1])
                        for level, held in (("host", digest in self.host), ("disk", digest in self.disk)) if held]
            return {"host_bytes": self.host.nbytes, "host_reserved_bytes": self.host.reserved,
                    "host_budget_bytes": self.host.budget, "host_adapters": len(self.host) - heads,
                    "host_heads": heads, "host_heads_bytes": heads_bytes,
                    "disk_bytes": disk_bytes, "disk_budget_bytes": self.disk.budget,
                    "disk_adapters": disk_adapters, "hits": dict(self.hits), "downloads": self.downloads,
                    "load_failures": self.failures, "load_seconds": load_seconds, "resident": resident}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
