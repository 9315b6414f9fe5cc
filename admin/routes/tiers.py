"""Tenant tiers (priority, rate limits, timeouts): /admin/tiers."""
from __future__ import annotations

from fastapi import APIRouter
from pydantic import Field

from loramux.admin.routes.schemas import Tier, TierList
from loramux.server.deps import ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import tenants as ops
from loramux.tenancy.tenants import TierInfo

router = APIRouter(prefix="/tiers")


INT32_MAX = 2**31 - 1  # the limits are INTEGER columns: larger values would fail in the database (a 500)


class TierBody(RequestBody):
    priority: int = Field(ge=-100, le=100)
    requests_per_min: int = Field(default=0, ge=0, le=INT32_MAX)
    tokens_per_min: int = Field(default=0, ge=0, le=INT32_MAX)
    max_concurrent: int = Field(default=0, ge=0, le=INT32_MAX)
    default_timeout_s: float = Field(gt=0, le=86_400)
    max_timeout_s: float = Field(gt=0, le=86_400)
    max_choices: int = Field(default=8, ge=1, le=128, description="the most choices (OpenAI's `n`) per request")
    max_adapter_head_bytes: int = Field(
        default=0, ge=0, le=2**62, description="the most bytes of trained heads / embeddings (modules_to_save, "
                                               "embedding LoRA, trainable tokens) in an adapter its tenants upload; "
                                               "0 = only the server's LORAMUX_MAX_ADAPTER_HEAD_BYTES")
    max_fanout: int = Field(default=8, ge=1, le=128, description="the most adapters one fan-out request "
                                                                 "(`models`) may name")


@router.get("", response_model=TierList)
def list_tiers(services: ServicesDep) -> dict:
    return {"tiers": ops.list_tiers(services.tenancy)}


@router.put("/{name}", response_model=Tier)
def put_tier(name: str, body: TierBody, services: ServicesDep) -> TierInfo:
    """Create or replace a tier (0 = unlimited for the per-minute and concurrency limits)."""
    return ops.put_tier(services.tenancy, TierInfo(name=name, **body.model_dump()))
