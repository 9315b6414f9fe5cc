"""What replicas share through Redis besides rate limits: who is alive and what each one holds, and
adapter evictions.

Each engine replica writes a snapshot (engine counters, adapter residency by digest, predicted queue wait)
under `<prefix>replica:<id>` every `interval_s`, with a time-to-live of `ttl_s`: a replica that dies drops
out of `snapshots()` within `ttl_s`. An adapter version deleted through the admin API is published on
`<prefix>evict`; every replica drops its copies when the message arrives (Redis pub/sub delivers it in
milliseconds to every subscriber that is connected; a replica started later never had the copy).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "loramux:"

_shared: dict[str, ReplicaDirectory] = {}
_shared_lock = threading.Lock()


def shared_directory(redis_url: str, ttl_s: float, timeout_s: float) -> ReplicaDirectory:
    """This process's one reader of `redis_url`'s snapshots, made on first use: the ingress's services
    (`loramux.cluster.ingress_services`) and the engine handle's request router (`loramux.cluster.residency_router`)
    share it, so they see the same snapshots and one thread refreshes them. The first caller's `ttl_s` and
    `timeout_s` stand."""
    with _shared_lock:
        directory = _shared.get(redis_url)
        if directory is None:
            directory = _shared[redis_url] = ReplicaDirectory(redis_url, ttl_s=ttl_s, timeout_s=timeout_s)
        return directory


def snapshot_ttl_s(snapshot_interval_s: float) -> float:
    """How long a reader keeps a replica it no longer hears from: 5 snapshot intervals, at least 5 s."""
    return max(5.0, 5 * snapshot_interval_s)


class ReplicaDirectory:
    def __init__(self, redis_url: str, prefix: str = DEFAULT_PREFIX, ttl_s: float = 5.0, cache_s: float = 0.5,
                 timeout_s: float = 0.25):
        import redis

        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          decode_responses=True)
        self.prefix, self.ttl_s, self.cache_s, self.timeout_s = prefix, ttl_s, cache_s, timeout_s
        self._cached: dict[str, dict] = {}
        self._fresh_at = 0.0  # monotonic time of the last successful refresh
        self._lock = threading.Lock()
        self._refreshed = threading.Event()  # set after the first refresh (successful or not)
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()

    # -- readers (the ingress) -------------------------------------------------------------------------------
    def snapshots(self, wait: bool = True) -> dict[str, dict]:
        """Replica id -> its latest snapshot, for every replica heard from within `ttl_s`. Read from memory:
        a background thread refreshes it every `cache_s` (callers such as /metrics and the queue-wait
        estimate on the event loop never wait on Redis; the very first call waits for the first refresh,
        at most about two `timeout_s`, unless `wait` is False: then it answers {} until that refresh). While
        Redis is unreachable the last snapshots seen are kept for `ttl_s`, then none (the replicas can no
        longer be told alive)."""
        self.watch()
        if wait:
            self._refreshed.wait(2 * self.timeout_s + 0.05)
        with self._lock:
            if time.monotonic() - self._fresh_at > self.ttl_s:
                return {}
            return self._cached

    def watch(self) -> None:
        """Start the background refresher (an ingress calls this at start, so requests never wait)."""
        with self._lock:
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh_loop, name="loramux-replica-directory",
                                                   daemon=True)
                self._refresher.start()

    def close(self) -> None:
        self._stop.set()

    def _refresh_loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                keys = sorted(self.redis.scan_iter(f"{self.prefix}replica:*", count=100))
                values = self.redis.mget(keys) if keys else []
                fresh = {key.rsplit(":", 1)[1]: json.loads(value) for key, value in zip(keys, values) if value}
                with self._lock:
                    self._cached, self._fresh_at = fresh, time.monotonic()
                if failing:
                    log.warning("replica snapshots available again")
                failing = False
            except Exception as exc:  # noqa: BLE001 - state for dashboards: keep the last one seen
                if not failing:
                    log.warning("replica snapshots unavailable (keeping the last ones): %s", exc)
                failing = True
            self._refreshed.set()
            self._stop.wait(self.cache_s)

    def broadcast_eviction(self, digest: str) -> None:
        """Tell every replica to drop `digest` (best effort: with Redis away the replicas keep their copies,
        which no request can reach since the registry refuses the deleted version)."""
        try:
            self.redis.publish(f"{self.prefix}evict", digest)
        except Exception as exc:  # noqa: BLE001 - the delete itself has succeeded
            log.warning("adapter eviction of %s not broadcast (Redis unavailable): %s", digest[:12], exc)

    # -- writers (each engine replica) -----------------------------------------------------------------------
    def publish(self, replica_id: str, snapshot: dict) -> None:
        self.redis.set(f"{self.prefix}replica:{replica_id}", json.dumps(snapshot), px=int(self.ttl_s * 1000))

    def withdraw(self, replica_id: str) -> None:
        self.redis.delete(f"{self.prefix}replica:{replica_id}")

    def start_replica_threads(self, replica_id: str, snapshot: Callable[[], dict], on_evict: Callable[[str], None],
                              interval_s: float = 1.0) -> threading.Event:
        """Publish `snapshot()` every `interval_s` and call `on_evict(digest)` for every eviction broadcast,
        on daemon threads, until the returned event is set."""
        stop = threading.Event()

        def publish_loop() -> None:
            while not stop.is_set():
                try:
                    self.publish(replica_id, snapshot())
                except Exception as exc:  # noqa: BLE001 - Redis away for a moment: try again next tick
                    log.warning("replica snapshot not published: %s", exc)
                stop.wait(interval_s)
            try:
                self.withdraw(replica_id)
            except Exception:  # noqa: BLE001
                pass

        def evict_loop() -> None:
            while not stop.is_set():
                try:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(f"{self.prefix}evict")
                    while not stop.is_set():
                        message = pubsub.get_message(timeout=1.0)
                        if message and message.get("type") == "message":
                            on_evict(message["data"])
                except Exception as exc:  # noqa: BLE001 - reconnect after a Redis restart
                    log.warning("eviction subscription lost: %s", exc)
                    stop.wait(1.0)

        for target, name in ((publish_loop, "snapshots"), (evict_loop, "evictions")):
            threading.Thread(target=target, name=f"loramux-{name}", daemon=True).start()
        return stop
