"""Engine-wide operational state (/admin/stats): batch, queue, KV blocks, adapter slots and caches. It shows
every tenant's load, so it is for operators only; tenants see their own requests' timings in responses."""
from __future__ import annotations

from fastapi import APIRouter

from loramux.server.deps import ServicesDep
from loramux.services import engine_state

router = APIRouter(prefix="/stats")


@router.get("")
def engine_stats(services: ServicesDep) -> dict:
    return engine_state.engine_stats(services)
