"""Where adapters live across engine replicas (/admin/replicas), for operators of a scale-out deployment.

Each live replica (heard from within a few seconds) with its engine counters and the adapter versions it
holds: digest, name@version and state ("device" or "loading"). A single-process server has no replicas to
list: it answers `{"mode": "single-process", "replicas": []}` (its adapters are in /admin/adapters).
"""
from __future__ import annotations

from fastapi import APIRouter

from loramux.server.deps import ServicesDep

router = APIRouter(prefix="/replicas")

_SHOWN_STATS = ("running", "waiting", "kv_blocks_used", "kv_blocks_total")


@router.get("")
def replicas(services: ServicesDep) -> dict:
    snapshots = services.engine.stats().get("replicas")
    if snapshots is None:
        return {"mode": "single-process", "replicas": []}
    listed = []
    for replica_id, snap in sorted(snapshots.items()):
        stats, names = snap.get("stats", {}), snap.get("adapter_names", {})
        listed.append({"replica": replica_id, "pid": snap.get("pid"), "queue_wait_s": snap.get("queue_wait_s"),
                       **{key: stats.get(key) for key in _SHOWN_STATS},
                       "adapters": [{"digest": digest, "name": names.get(digest), "state": state}
                                    for digest, state in sorted(snap.get("residency", {}).items())]})
    return {"mode": "ray", "replicas": listed}
