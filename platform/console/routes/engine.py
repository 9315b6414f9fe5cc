"""The engine, live: running and waiting requests, KV-cache use, adapter slots, and TTFT and inter-token
latency per minute over the last 15 minutes (from the ledger's rows). The page's script polls
/console/engine/data every 2 s."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from loramux.console.deps import Operator, render
from loramux.server.deps import ServicesDep
from loramux.services import engine_state

router = APIRouter(prefix="/engine")

WINDOW_MIN = 15


@router.get("")
async def engine_page(request: Request, operator: Operator):
    return render(request, "engine.html", operator, window_min=WINDOW_MIN)


@router.get("/data")
async def engine_data(operator: Operator, services: ServicesDep) -> dict:
    live = await run_in_threadpool(engine_state.live_engine, services)
    return {**live, "latency": await run_in_threadpool(engine_state.latency_per_minute, services.db, WINDOW_MIN)}
