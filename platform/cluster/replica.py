"""One engine replica: an engine, its own adapter cache levels (S3 -> disk -> host RAM -> device) and its snapshot
publisher. Ray Serve wraps it in a deployment (`loramux.cluster.app`); nothing here imports Ray.

Adapters reach a replica by digest: the ingress resolves a request's adapter in the registry and sends the
version (plain data) with the request, and the replica loads that version through its own cache levels, so a
deleted or re-uploaded adapter can never be served stale (a new upload is a new digest).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.cluster.residency_score import device_room
from loramux.cluster.shared_state import ReplicaDirectory
from loramux.cluster.wire import to_wire
from loramux.settings import Settings

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0


class EngineReplica:
    def __init__(self, settings: Settings, replica_id: str):
        import torch

        from loramux.services.builder import build_engine_side, store_from_settings

        if settings.cluster_threads_per_replica:
            torch.set_num_threads(settings.cluster_threads_per_replica)
        self.settings, self.replica_id = settings, replica_id
        disk_dir = Path(settings.data_dir) / "replicas" / replica_id / "adapter-cache"  # not shared between replicas
        side = build_engine_side(settings, store_from_settings(settings), disk_dir)
        self.engine, self.cache = side.engine, side.adapter_cache
        self._versions: dict[str, AdapterVersionInfo] = {}  # digest -> version, set before the multiplexed load
        self._sent: dict[str, int] = {}  # request id -> tokens this replica has sent for it so far, while it runs
        self.directory = ReplicaDirectory(settings.redis_url)
        self._stop = self.directory.start_replica_threads(replica_id, self.snapshot, self.evict,
                                                          settings.cluster_snapshot_interval_s)

    # -- adapters ----------------------------------------------------------------------------------------------
    def remember(self, version: AdapterVersionInfo) -> None:
        self._versions[version.digest] = version

    async def load_adapter(self, digest: str):
        """The adapter of a remembered version, in host RAM (called through Serve's multiplexed loader)."""
        version = self._versions[digest]
        lease = await self.cache.acquire(version, LOAD_TIMEOUT_S)
        self.cache.release(digest)  # the host cache keeps it within its budget; the engine holds what it uses
        return lease.adapter

    async def warm_host(self, version: AdapterVersionInfo) -> dict:
        """Remember `version` and bring it into this replica's host RAM (object store -> disk -> RAM, not onto the
        device), so its snapshots list it under `host` and the residency router scores this replica at host level
        for it. An operator's warm-up hook (pre-load an adapter before its traffic), and how the system test
        leaves an adapter in exactly one replica's host RAM. Unlike a request, it does not go through Serve's
        multiplexed loader, so Serve's own record of what each replica holds does not know of it: only routing
        by the snapshots sends its requests here. Returns {"replica": this replica's id}."""
        self.remember(version)
        await self.load_adapter(version.digest)
        return {"replica": self.replica_id}

    def evict(self, digest: str) -> None:
        self._versions.pop(digest, None)
        self.cache.evict(digest)
        self.engine.evict_adapter(digest)

    def offload(self, digest: str) -> dict:
        """Drop the version's device copy (once no request runs on it) and keep it in host RAM: its device room
        goes to other adapters, and its next request here copies it back from RAM. Any replica may be asked
        (one that has no device copy changes nothing); returns {"replica": this replica's id}."""
        self.engine.evict_adapter(digest)
        return {"replica": self.replica_id}

    # -- requests --------------------------------------------------------------------------------------------
    async def generate(self, payload: dict, adapter):
        """The request's outputs as `to_wire` messages; errors the ingress must see arrive as messages.
        `payload["request"]`: the EngineRequest's wire form (RemoteEngine.generate), run with `adapter`, the
        version's LoRAAdapter this replica loaded (None: the base model)."""
        from loramux.engine.async_engine import EngineDeadError
        from loramux.engine.engine import RequestError
        from loramux.engine.request import EngineRequest

        request = EngineRequest.from_wire(payload["request"], adapter=adapter)
        stream = self.engine.generate(request)
        rid = request.request_id
        self._sent[rid] = 0
        try:
            async for out in stream:
                self._sent[rid] += len(out.new_token_ids)
                yield to_wire(out, self.replica_id)
        except RequestError as exc:
            yield {"error": "request", "message": str(exc)}
        except EngineDeadError as exc:
            yield {"error": "dead", "message": str(exc)}
        finally:
            self._sent.pop(rid, None)
            await stream.aclose()  # cancelled by the ingress: the request is aborted in the engine

    def info(self) -> dict:
        """Who this replica is, and now (not as of its last snapshot): `streaming`, request id -> tokens sent
        so far, for every request it is generating."""
        return {"replica": self.replica_id, "pid": os.getpid(), "max_model_len": self.engine.max_model_len,
                "streaming": dict(self._sent)}

    def check_health(self) -> None:
        """Raise RuntimeError once the engine loop has died (Serve's health check then replaces the replica)."""
        if self.engine.stopped:
            raise RuntimeError("engine stopped")

    def snapshot(self) -> dict:
        """What the ingress shows of this replica, and what the engine deployment's request router scores it by
        (`loramux.cluster.residency_score`): engine counters; `residency`, digest -> "device" | "loading", and
        `host`, the digests in this replica's host RAM, both for the versions it has been sent; the device
        pool's `free_device_bytes` (None: LoRA off) and `evictable` adapters (resident, no request running on
        them); `adapter_cache.resident`, the host RAM copies by reference and rank; queue wait; `at`, this
        replica's wall-clock time when it took the snapshot."""
        stats = self.engine.stats()
        digests = list(self._versions)
        residency = {digest: state for digest in digests
                     if (state := self.engine.adapter_residency(digest)) is not None}
        host = [digest for digest in digests if self.cache.has_in_ram(digest)]
        free_device_bytes, evictable = device_room(stats.get("lora"))
        # Host RAM copies by reference and rank, for the ingress's vllm:lora_adapter_loaded (disk copies stay out:
        # many, and routers score device and host residency only).
        in_ram = [r for r in self.cache.stats().get("resident", ()) if r.get("level") == "host"]
        return {"stats": stats, "residency": residency, "host": host, "free_device_bytes": free_device_bytes,
                "evictable": evictable, "adapter_cache": {"resident": in_ram},
                "queue_wait_s": self.engine.estimated_queue_wait_s(),
                "adapter_names": {d: v.label for d, v in list(self._versions.items()) if d in residency or d in host},
                "pid": os.getpid(), "at": time.time()}

    def shutdown(self) -> None:
        self._stop.set()
        self.engine.shutdown()
        self.cache.shutdown()
