"""Adapter weights on their way to the engine: object store -> local disk cache -> host RAM cache.

`AdapterCache.acquire(version)` returns the adapter in host RAM, pinned until `release`. Loads run on a
small thread pool, never on the caller's event loop or the engine thread, and there is one load per
version at a time however many requests wait for it ("single flight"). A failed load is not
remembered: the next request tries again, so a store that recovers serves again at once. Every byte
read from the store or the disk cache is checked against the version's digest before it is parsed.
Device slots (the fourth level) belong to the engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.storage.blob import DigestMismatchError, sha256_hex, unpack
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


@dataclass
class _Entry:
    adapter: LoRAAdapter
    pins: int = 0
    doomed: bool = False  # deleted while pinned: dropped at the last release


class HostCache:
    """Adapters in host RAM within a byte budget. Pinned entries (queued or running requests) are never
    evicted, so the cache can exceed its budget only by what is pinned. `reserved` bytes (composites being
    built, `reserve`) count as if present: loads make room for them too."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.reserved = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(e.adapter.nbytes for e in self._entries.values())

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def pin(self, digest: str) -> LoRAAdapter | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        entry.pins += 1
        self._entries.move_to_end(digest)
        return entry.adapter

    def insert_pinned(self, adapter: LoRAAdapter) -> LoRAAdapter:
        entry = self._entries.get(adapter.digest)
        if entry is None:
            self._make_room(adapter.nbytes)
            entry = self._entries[adapter.digest] = _Entry(adapter)
        entry.pins += 1
        self._entries.move_to_end(adapter.digest)
        return entry.adapter

    def release(self, digest: str) -> None:
        entry = self._entries.get(digest)
        if entry is None or entry.pins <= 0:
            raise RuntimeError(f"adapter {digest[:12]}… released more often than acquired")
        entry.pins -= 1
        if entry.pins == 0 and entry.doomed:
            del self._entries[digest]
        elif self.nbytes > self.budget:
            self._make_room(0)

    def discard(self, digest: str) -> None:
        entry = self._entries.get(digest)
        if entry is None:
            return
        if entry.pins:
            entry.doomed = True
        else:
            del self._entries[digest]

    def reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` for an entry to come (`insert_reserved`), evicting unpinned entries (least recently
        used first) as needed; False, with nothing reserved, when pinned entries and other reservations leave
        too little room: unlike `insert_pinned`, a reservation never takes the cache past its budget."""
        self._make_room(nbytes)
        if self.nbytes + self.reserved + nbytes > self.budget:
            return False
        self.reserved += nbytes
        return True

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def insert_reserved(self, adapter: LoRAAdapter, reserved: int) -> None:
        """Turn a reservation of `reserved` bytes into the unpinned entry `adapter` (the most recently used)."""
        self.reserved -= reserved
        if adapter.digest not in self._entries:
            self._entries[adapter.digest] = _Entry(adapter)
        self._entries.move_to_end(adapter.digest)

    def _make_room(self, incoming: int) -> None:
        for digest in [d for d, e in self._entries.items() if e.pins == 0]:
            if self.nbytes + self.reserved + incoming <= self.budget:
                return
            del self._entries[digest]


@dataclass(frozen=True)
class Acquired:
    adapter: LoRAAdapter
    level: str  # where it came from: "ram", "disk" or "store"
    load_ms: float


class AdapterCache:
    """The engine-facing side of the levels: acquire / prefetch / release adapter versions."""

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
        self.hits: Counter[str] = Counter()  # by level: ram, disk, store
        # Called (with no argument, in the releasing thread) after every release: room may have come free.
        self.release_listeners: list = []
        self.failures = 0
        self.downloads = 0
        # Seconds each successful load into host RAM took, by where it came from (each has its own lock).
        self.load_seconds: dict[str, DurationHistogram] = {"disk": DurationHistogram(), "store": DurationHistogram()}

    # -- loading (worker threads) ----------------------------------------------------------------
    def _load(self, version: AdapterVersionInfo) -> tuple[LoRAAdapter, str]:
        level = "disk"
        data = self.disk.get(version.digest)
        if data is None:
            level = "store"
            try:
                with self._lock:
                    self.downloads += 1
                data = self.store.get(version.storage_key)
            except BlobNotFoundError as exc:
                raise self._failed(version, f"its weights are missing from the object store ({exc})",
                                   retryable=False) from None
            except StoreError as exc:
                raise self._failed(version, f"the object store failed ({exc})") from None
        try:
            # The engine knows a version by its id, never by the tenant-chosen name: its stats feed the
            # metrics (`vllm:lora_requests_info`), which anyone who reaches /metrics reads.
            adapter = unpack(data, f"{version.adapter_id}@{version.version}", version.digest)
        except DigestMismatchError as exc:
            raise self._failed(version, str(exc)) from None
        if level == "store":
            try:
                self.disk.put(version.digest, data)
            except OSError as exc:  # a full disk slows later loads down but must not fail this one
                log.warning("could not cache adapter %s on disk: %s", version.label, exc)
        return adapter, level

    @staticmethod
    def _failed(version: AdapterVersionInfo, detail: str, retryable: bool = True) -> AdapterLoadError:
        """The error for tenants (generic) with the detail for operators, logged here."""
        log.warning("adapter %s (%s): load failed: %s", version.label, version.storage_key, detail)
        return AdapterLoadError(version, detail, retryable)

    def _start(self, version: AdapterVersionInfo) -> tuple[concurrent.futures.Future, bool]:
        """The in-flight load of `version`, starting one if none runs, and whether this call started it
        (caller holds the lock, then passes both to `_watched` once it has let the lock go)."""
        future = self._inflight.get(version.digest)
        if future is not None:
            return future, False
        future = self._inflight[version.digest] = self._pool.submit(self._timed_load, version)
        return future, True

    def _watched(self, digest: str, future: concurrent.futures.Future, started: bool) -> concurrent.futures.Future:
        """`future`, with `_done` to run when it ends if this caller started it. Added outside the lock: on a
        load that is already done, add_done_callback runs `_done` at once in this thread, and `_done` takes
        the lock (not reentrant), so a fast load added under the lock deadlocked its caller."""
        if started:
            future.add_done_callback(lambda f: self._done(digest, f))
        return future

    def _timed_load(self, version: AdapterVersionInfo):
        start = time.perf_counter()
        adapter, level = self._load(version)
        seconds = time.perf_counter() - start
        self.load_seconds[level].observe(seconds)
        return adapter, level, seconds * 1000

    def _done(self, digest: str, future: concurrent.futures.Future) -> None:
        with self._lock:
            if self._inflight.get(digest) is future:
                del self._inflight[digest]
            if future.exception() is not None:
                self.failures += 1
                return
            adapter, _, _ = future.result()
            # Keep it warm for the waiters (they pin it themselves); a prefetch with no waiter leaves it unpinned.
            if adapter.digest not in self.host:
                self.host.insert_pinned(adapter)
                self.host.release(adapter.digest)

    # -- public API --------------------------------------------------------------------------------
    def prefetch(self, version: AdapterVersionInfo) -> concurrent.futures.Future | None:
        """Start bringing `version` into host RAM without pinning it; None if it is already there."""
        with self._lock:
            if version.digest in self.host:
                return None
            future, started = self._start(version)
        return self._watched(version.digest, future, started)

    def _pin_or_load(self, version: AdapterVersionInfo) -> Acquired | concurrent.futures.Future:
        """A RAM hit, pinned; or the (shared) load to wait for."""
        with self._lock:
            adapter = self.host.pin(version.digest)
            if adapter is not None:
                self.hits["ram"] += 1
                return Acquired(adapter, "ram", 0.0)
            future, started = self._start(version)
        return self._watched(version.digest, future, started)

    def _pin_loaded(self, result) -> Acquired:
        adapter, level, load_ms = result
        with self._lock:
            adapter = self.host.insert_pinned(adapter)  # re-inserted if evicted since the load ended
            self.hits[level] += 1
        return Acquired(adapter, level, load_ms)

    async def acquire(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired:
        """The adapter in host RAM, pinned; raise AdapterLoadError (or TimeoutError after `timeout`
        seconds: the shared load goes on for the other waiters)."""
        hit = self._pin_or_load(version)
        if isinstance(hit, Acquired):
            return hit
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(hit)), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"adapter {version.label} did not load within {timeout:.1f} s") from None
        return self._pin_loaded(result)

    def acquire_blocking(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired:
        """`acquire` for synchronous callers (CLI, scripts); never call it on an event loop thread."""
        hit = self._pin_or_load(version)
        if isinstance(hit, Acquired):
            return hit
        try:
            result = hit.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"adapter {version.label} did not load within {timeout:.1f} s") from None
        return self._pin_loaded(result)

    def release(self, digest: str) -> None:
        with self._lock:
            self.host.release(digest)
        for listener in self.release_listeners:
            listener()

    def pin(self, digest: str) -> LoRAAdapter | None:
        """The entry `digest` pinned (give it back with `release`), or None when the host RAM cache lacks it."""
        with self._lock:
            return self.host.pin(digest)

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
        """`HostCache.insert_reserved` under the cache's lock."""
        with self._lock:
            self.host.insert_reserved(adapter, reserved)

    def evict(self, digest: str) -> None:
        """Forget a version everywhere (its adapter was deleted); pinned RAM copies go at their last release."""
        with self._lock:
            self.host.discard(digest)
        self.disk.discard(digest)

    def has_in_ram(self, digest: str) -> bool:
        """Whether the version with this digest is in the host RAM cache now."""
        with self._lock:
            return digest in self.host

    def has_on_disk(self, digest: str) -> bool:
        """Whether the version with this digest is in the local disk cache now."""
        return digest in self.disk

    def drain(self, timeout: float | None = None) -> None:
        """Wait until no load is in flight (tests, shutdown)."""
        with self._lock:
            futures = list(self._inflight.values())
        concurrent.futures.wait(futures, timeout)

    def stats(self) -> dict:
        """Sizes and counters; read under the locks of the threads that change them (loads, other requests).
        `load_seconds`: {"disk": ..., "store": ...}, `DurationHistogram.snapshot()` of successful loads."""
        disk_bytes, disk_adapters = self.disk.nbytes, len(self.disk)  # under the disk cache's own lock
        load_seconds = {level: hist.snapshot() for level, hist in self.load_seconds.items()}  # their own locks
        with self._lock:  # the host cache and the counters only change under this lock
            return {"host_bytes": self.host.nbytes, "host_reserved_bytes": self.host.reserved,
                    "host_budget_bytes": self.host.budget,
                    "host_adapters": len(self.host), "disk_bytes": disk_bytes, "disk_budget_bytes": self.disk.budget,
                    "disk_adapters": disk_adapters, "hits": dict(self.hits), "downloads": self.downloads,
                    "load_failures": self.failures, "load_seconds": load_seconds}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
