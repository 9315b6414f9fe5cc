"""The engine, live: running and waiting requests, KV-cache use, adapter slots, and TTFT and inter-token
latency per minute over the last 15 minutes (from the ledger's rows). The page's script polls
/console/engine/data every 2 s."""
from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select

from loramux.console.deps import Operator, render
from loramux.db.models import LedgerEntry, utcnow

router = APIRouter(prefix="/engine")

WINDOW_MIN = 15


@router.get("")
async def engine_page(request: Request, operator: Operator):
    return render(request, "engine.html", operator, window_min=WINDOW_MIN)


def _latency_per_minute(db) -> list[dict]:
    """Per minute of the window: requests, mean TTFT and mean inter-token gap (ms) of the requests that
    ended in it (inter-token: (total - TTFT) / (completion tokens - 1), for requests of 2+ tokens)."""
    since = utcnow() - timedelta(minutes=WINDOW_MIN)
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


@router.get("/data")
async def engine_data(request: Request, operator: Operator) -> dict:
    services = request.app.state.services
    stats = await run_in_threadpool(services.engine.stats)
    lora = stats.get("lora") or {}
    return {"running": stats.get("running"), "waiting": stats.get("waiting"),
            "kv_blocks_used": stats.get("kv_blocks_used"), "kv_blocks_total": stats.get("kv_blocks_total"),
            "adapter_slots_pinned": stats.get("adapter_slots_pinned"),
            "device_adapters": lora.get("device_adapters"), "device_budget_bytes": lora.get("device_budget_bytes"),
            "device_bytes": lora.get("device_bytes"),
            "latency": await run_in_threadpool(_latency_per_minute, services.db)}
