"""Prices per base model, adapter and tier, by the time they take effect: /admin/prices."""
from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from fastapi import APIRouter
from pydantic import Field

from loramux.admin.routes.schemas import Price, PriceList
from loramux.billing.pricing import PriceInfo
from loramux.server.deps import PipelineDep, ServicesDep
from loramux.server.http.bodies import RequestBody
from loramux.services import prices as ops

router = APIRouter(prefix="/prices")


class PriceBody(RequestBody):
    base_model: str | None = Field(default=None, description="default: the served base model")
    adapter_id: str | None = None
    tier: str | None = None
    input_per_mtok: Decimal = Field(ge=0, description="USD per 1M prompt tokens (not cached)")
    cached_input_per_mtok: Decimal = Field(ge=0, description="USD per 1M cached prompt tokens")
    output_per_mtok: Decimal = Field(ge=0, description="USD per 1M completion tokens")
    effective_from: datetime | None = Field(default=None, description="default: now; timezone required")


@router.post("", status_code=201, response_model=Price)
def set_price(body: PriceBody, services: ServicesDep, pipeline: PipelineDep) -> PriceInfo:
    return ops.set_price(services, body.base_model or pipeline.model_id, body.input_per_mtok,
                         body.cached_input_per_mtok, body.output_per_mtok, adapter_id=body.adapter_id,
                         tier=body.tier, effective_from=body.effective_from)


@router.get("", response_model=PriceList)
def list_prices(services: ServicesDep, base_model: str | None = None) -> dict:
    return {"prices": ops.list_prices(services, base_model)}
