"""The engine deployment's Ray Serve request router: adapter requests go to the replica where their adapter
already is (device > host RAM > free device slot > evictable slot), from the snapshots the replicas publish.

Serve runs a router in every process that holds a handle to the engine deployment: the ingress (which sends
the requests) and any driver. For a request keyed by an adapter digest (`multiplexed_model_id`), each
candidate replica gets the score `loramux.cluster.residency_score.residency_score` gives it from its latest
snapshot in Redis (replica id = `ReplicaID.unique_id`, the id `EngineReplica` publishes under), and the
router offers Serve its replicas best score first, each score group in random pairs; Serve probes a pair's
queue lengths and takes the shorter queue that accepts, moving to the next pair, and to the next group only when
every replica of this one is full. Within a group (ties) this is Serve's power of two choices; base-model
requests (no digest) get plain power of two choices: two replicas drawn at random, the shorter queue wins.

Snapshots lag (a replica publishes every `LORAMUX_CLUSTER_SNAPSHOT_INTERVAL_S`, and the reader refreshes
every 0.5 s), so the router also remembers where it sent each digest and counts that replica as holding it
until a snapshot taken `settle_s` later says otherwise: a burst of requests for a cold adapter goes to one
replica, not to every replica with room. Serve's own multiplexing record (the replica's loader holds the
version) counts as host residency. Without snapshots (no `LORAMUX_REDIS_URL` in this process, Redis away,
a replica not yet heard from) a replica scores by those two alone, so the router degrades to Serve's.
"""
from __future__ import annotations

import logging
import random
import time
import weakref
from typing import Any

from ray.serve.request_router import MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from loramux.cluster.deployment_settings import secret_from_env
from loramux.cluster.residency_score import rank, residency_score
from loramux.cluster.shared_state import ReplicaDirectory, shared_directory

log = logging.getLogger(__name__)


class ResidencyRouter(MultiplexMixin, RequestRouter):
    """Set on the engine deployment (`loramux.cluster.app`) with `request_router_kwargs` from
    `router_kwargs(settings)`; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_age_s, self.settle_s, self.ttl_s, self.redis_timeout_s = 4.0, 2.0, 5.0, 0.25
        self._hints: dict[str, dict[str, float]] = {}  # digest -> replica unique id -> when routed there
        self._watched: weakref.WeakSet = weakref.WeakSet()  # the pending requests' futures seen
        self._directory_tried, self._replica_directory = False, None

    def initialize_state(self, max_age_s: float = 4.0, settle_s: float = 2.0, ttl_s: float = 5.0,
                         redis_timeout_s: float = 0.25, **_: Any) -> None:
        """`max_age_s`: older snapshots are ignored; `settle_s`: how long a routed request counts as placing
        its adapter on its replica; `ttl_s` / `redis_timeout_s`: this process's ReplicaDirectory's, if the
        router is the first to need one."""
        self.max_age_s, self.settle_s, self.ttl_s, self.redis_timeout_s = max_age_s, settle_s, ttl_s, redis_timeout_s

    # -- Serve's hook --------------------------------------------------------------------------------------
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        digest = ""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every group full: back off, then retry
            digest = pending_request.metadata.multiplexed_model_id or ""
            if digest:
                self._remember_placement(digest, pending_request)
        if not digest:
            return [_two_choices(candidate_replicas)]
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        scores = self.scores(digest, candidate_replicas, _slot_bytes(pending_request))
        return [pair for group in rank(scores) for pair in _pairs([by_id[replica_id] for replica_id in group])]

    def scores(self, digest: str, replicas: list[RunningReplica], slot_bytes: int | None = None) -> dict[str, float]:
        """Replica unique id -> its residency score for `digest`, now."""
        snapshots, now = self._snapshots(), time.time()
        hints = self._hints.get(digest, {})
        holders = self._multiplexed_model_id_to_replica_ids.get(digest, set())
        scores = {r.replica_id.unique_id: residency_score(
            digest, snapshots.get(r.replica_id.unique_id), now=now, max_age_s=self.max_age_s, slot_bytes=slot_bytes,
            hinted_at=hints.get(r.replica_id.unique_id), settle_s=self.settle_s, serve_holds=r.replica_id in holders)
            for r in replicas}
        log.debug("adapter %s: replica scores %s", digest[:12], scores)
        return scores

    # -- where this router sent each digest ------------------------------------------------------------------
    def _remember_placement(self, digest: str, pending_request: PendingRequest) -> None:
        """Once the request is assigned a replica (its future resolves; a retry gets a new future), note it."""
        hints, future = self._hints, pending_request.future
        if future in self._watched:
            return
        self._watched.add(future)

        def assigned(done) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            now = time.time()
            hints.setdefault(digest, {})[done.result().replica_id.unique_id] = now
            horizon = now - self.max_age_s - self.settle_s
            for key in [d for d, where in hints.items() if max(where.values()) < horizon]:
                del hints[key]

        future.add_done_callback(assigned)

    # -- snapshots -------------------------------------------------------------------------------------------
    def _snapshots(self) -> dict[str, dict]:
        directory = self._directory()
        return directory.snapshots(wait=False) if directory is not None else {}

    def _directory(self) -> ReplicaDirectory | None:
        """This process's ReplicaDirectory (the ingress's, or one made here from the Redis URL this process's
        environment carries, as the deployment's runtime env sets it); None, once and for all, without one."""
        if not self._directory_tried:
            self._directory_tried = True
            try:
                url = secret_from_env("redis_url")
            except ValueError as exc:  # the environment's settings do not validate: route without snapshots
                log.warning("settings unreadable in the request router's process: %s", exc)
                url = ""
            if not url:
                log.info("no LORAMUX_REDIS_URL in this process: adapter requests are routed without replica "
                         "snapshots (Serve's multiplexing only)")
            else:
                try:
                    self._replica_directory = shared_directory(url, self.ttl_s, self.redis_timeout_s)
                    self._replica_directory.watch()
                except Exception as exc:  # noqa: BLE001 - routing goes on without snapshots
                    log.warning("replica snapshots unavailable to the request router: %s", exc)
        return self._replica_directory


def router_kwargs(snapshot_interval_s: float, redis_timeout_s: float) -> dict:
    """The engine deployment's `request_router_kwargs` (no secrets: they are shown in Serve's config)."""
    from loramux.cluster.shared_state import snapshot_ttl_s

    return {"max_age_s": max(2.0, 4 * snapshot_interval_s), "settle_s": max(1.0, 2 * snapshot_interval_s),
            "ttl_s": snapshot_ttl_s(snapshot_interval_s), "redis_timeout_s": redis_timeout_s}


def _pairs(replicas: list[RunningReplica]) -> list[list[RunningReplica]]:
    """A score group offered to Serve two at a time, in random order: Serve tries each pair (the less loaded of
    the two first) before the next, so every replica of a better group is tried before any of a worse one."""
    shuffled = random.sample(replicas, len(replicas))
    return [shuffled[i:i + 2] for i in range(0, len(shuffled), 2)]


def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Power of two choices: two of `replicas` at random (all of them, shuffled, if two or fewer)."""
    return random.sample(replicas, min(2, len(replicas)))


def _slot_bytes(pending_request: PendingRequest | None) -> int | None:
    """The adapter's device slot size from the upload's summary (`device_bytes`: lora + dora), when the
    request is an engine `generate` call whose version carries one."""
    try:
        device = pending_request.args[0]["version"].summary["device_bytes"]
        return int(device["lora"]) + int(device.get("dora") or 0)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None
