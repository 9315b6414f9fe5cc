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


class ReplicaDirectory:
    def __init__(self, redis_url: str, prefix: str = DEFAULT_PREFIX, ttl_s: float = 5.0, cache_s: float = 0.5):
        import redis

        self.redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, decode_responses=True)
        self.prefix, self.ttl_s, self.cache_s = prefix, ttl_s, cache_s
        self._cached: tuple[float, dict[str, dict]] = (0.0, {})
        self._lock = threading.Lock()

    # -- readers (the ingress) -------------------------------------------------------------------------------
    def snapshots(self) -> dict[str, dict]:
        """Replica id -> its latest snapshot, for every replica heard from within `ttl_s` (cached `cache_s`)."""
        with self._lock:
            stamp, cached = self._cached
            if time.monotonic() - stamp < self.cache_s:
                return cached
        try:
            keys = sorted(self.redis.scan_iter(f"{self.prefix}replica:*", count=100))
            values = self.redis.mget(keys) if keys else []
        except Exception as exc:  # noqa: BLE001 - state for dashboards: never fail a request over it
            log.warning("replica snapshots unavailable: %s", exc)
            return cached
        fresh = {key.rsplit(":", 1)[1]: json.loads(value) for key, value in zip(keys, values) if value}
        with self._lock:
            self._cached = (time.monotonic(), fresh)
        return fresh

    def broadcast_eviction(self, digest: str) -> None:
        self.redis.publish(f"{self.prefix}evict", digest)

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
