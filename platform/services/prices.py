"""Prices per base model, adapter and tier: set one (checked against the tiers and adapters that exist),
list them, and tell the ones in force from the scheduled ones."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from loramux.billing.pricing import PriceInfo
from loramux.db.models import utcnow
from loramux.services.container import Services


@dataclass(frozen=True)
class PriceBoard:
    """`current`: the price in force now for each scope (base model, adapter, tier); `scheduled`: later ones."""
    current: list[PriceInfo]
    scheduled: list[PriceInfo]


def set_price(services: Services, base_model: str, input_per_mtok, cached_input_per_mtok, output_per_mtok, *,
              adapter_id: str | None = None, tier: str | None = None,
              effective_from: datetime | None = None) -> PriceInfo:
    """A new price row (UnknownTierError, AdapterNotFoundError, PriceError for a bad amount or instant)."""
    if tier is not None:
        services.tenancy.tier(tier)
    if adapter_id is not None:
        services.registry.owner_of(adapter_id)
    return services.prices.set_price(base_model, str(input_per_mtok), str(cached_input_per_mtok),
                                     str(output_per_mtok), adapter_id=adapter_id, tier=tier,
                                     effective_from=effective_from)


def list_prices(services: Services, base_model: str | None = None) -> list[PriceInfo]:
    return services.prices.list_prices(base_model)


def price_board(services: Services) -> PriceBoard:
    prices = services.prices.list_prices(None)
    now = utcnow()
    in_force: dict = {}
    for price in sorted(prices, key=lambda p: p.effective_from):  # the latest started one per scope wins
        if price.effective_from <= now:
            in_force[(price.base_model, price.adapter_id, price.tier)] = price
    return PriceBoard(list(in_force.values()), [p for p in prices if p.effective_from > now])
