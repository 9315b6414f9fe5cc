"""Where adapters live across engine replicas (/admin/replicas), for operators of a scale-out deployment.

Each live replica (heard from within a few seconds) with its engine counters and the adapter versions it
holds: digest, name@version and state ("device" or "loading"). A single-process server has no replicas to
list: it answers `{"mode": "single-process", "replicas": []}` (its adapters are in /admin/adapters).
"""
from __future__ import annotations

from fastapi import APIRouter

from loramux.server.deps import ServicesDep
from loramux.services import engine_state

router = APIRouter(prefix="/replicas")


@router.get("")
def replicas(services: ServicesDep) -> dict:
    return engine_state.replicas(services)
