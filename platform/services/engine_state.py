"""The engine's live state for operators: batch, queue, KV blocks, adapter slots and caches; where adapters
live across engine replicas; and TTFT / inter-token latency per minute from the ledger's rows."""
from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from loramux.db import Database
from loramux.db.models import LedgerEntry, utcnow
from loramux.services.container import Services

_SHOWN_REPLICA_STATS = ("running", "waiting", "kv_blocks_used", "kv_blocks_total")


def engine_stats(services: Services) -> dict:
    """Every counter of the engine (all tenants' load: for operators only) and of the adapter cache."""
    return {**services.engine.stats(), "adapter_cache": services.adapter_cache.stats()}


def live_engine(services: Services) -> dict:
    """The few numbers the console's engine page polls: requests, KV-cache use, adapter slots and bytes."""
    stats = services.engine.stats()
    lora = stats.get("lora") or {}
    return {"running": stats.get("running"), "waiting": stats.get("waiting"),
            "kv_blocks_used": stats.get("kv_blocks_used"), "kv_blocks_total": stats.get("kv_blocks_total"),
            "adapter_slots_pinned": stats.get("adapter_slots_pinned"),
            "device_adapters": lora.get("device_adapters"), "device_budget_bytes": lora.get("device_budget_bytes"),
            "device_bytes": lora.get("device_bytes")}


def replicas(services: Services) -> dict:
    """Each live engine replica with its counters and the adapter versions it holds (digest, name@version,
    "device" or "loading"); a single-process server has none to list."""
    snapshots = services.engine.stats().get("replicas")
    if snapshots is None:
        return {"mode": "single-process", "replicas": []}
    listed = []
    for replica_id, snap in sorted(snapshots.items()):
        stats, names = snap.get("stats", {}), snap.get("adapter_names", {})
        listed.append({"replica": replica_id, "pid": snap.get("pid"), "queue_wait_s": snap.get("queue_wait_s"),
                       **{key: stats.get(key) for key in _SHOWN_REPLICA_STATS},
                       "adapters": [{"digest": digest, "name": names.get(digest), "state": state}
                                    for digest, state in sorted(snap.get("residency", {}).items())]})
    return {"mode": "ray", "replicas": listed}


def latency_per_minute(db: Database, window_min: int) -> list[dict]:
    """Per minute of the last `window_min`: requests, mean TTFT and mean inter-token gap (ms) of the requests
    that ended in it (inter-token: (total - TTFT) / (completion tokens - 1), for requests of 2+ tokens)."""
    since = utcnow() - timedelta(minutes=window_min)
    with db.session() as s:
        rows = s.execute(select(LedgerEntry.created_at, LedgerEntry.ttft_ms, LedgerEntry.total_ms,
                                LedgerEntry.completion_tokens).where(LedgerEntry.created_at >= since)).all()
    minutes: dict[str, dict] = {}
    for created, ttft, total, completion in rows:
        key = created.strftime("%H:%M")
        bucket = minutes.setdefault(key, {"minute": key, "requests": 0, "ttft": [], "itl": []})
        bucket["requests"] += 1
        if ttft is not None:
            bucket["ttft"].append(ttft)
            if completion and completion > 1:
                bucket["itl"].append((total - ttft) / (completion - 1))
    mean = lambda xs: round(sum(xs) / len(xs), 1) if xs else None  # noqa: E731
    return [{"minute": b["minute"], "requests": b["requests"], "ttft_ms": mean(b["ttft"]), "itl_ms": mean(b["itl"])}
            for b in sorted(minutes.values(), key=lambda b: b["minute"])]
