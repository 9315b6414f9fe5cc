"""Prices: USD per 1M tokens for a base model, narrowed by adapter and/or tier, each in force from
`effective_from` on; and the exact cost of a request under a price.

Prices are never edited: a change is a new row with a later `effective_from`, so the ledger can always
tell which price applied when a request ran. `price_for` and `cost_of` are pure functions; `PriceBook`
reads and writes the `prices` table.
"""
from __future__ import annotations

import decimal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loramux.billing.money import MONEY_CONTEXT
from loramux.db import Database
from loramux.db.models import Adapter, Money, Price, Tier, utcnow

# A price at or above this (USD per 1M tokens) is refused: it keeps every cost well inside NUMERIC(30, 12).
MAX_PRICE_PER_MTOK = Decimal(10) ** 9
_ZERO = Decimal(0).quantize(Money.SCALE)
_MTOK = 1_000_000
_BASE_MODEL_MAX = Price.__table__.c.base_model.type.length


@dataclass(frozen=True)
class PriceInfo:
    id: int
    base_model: str
    adapter_id: str | None
    tier: str | None
    input_per_mtok: Decimal
    cached_input_per_mtok: Decimal
    output_per_mtok: Decimal
    effective_from: datetime

    @property
    def scope(self) -> str:
        parts = [self.base_model]
        if self.adapter_id is not None:
            parts.append(f"adapter {self.adapter_id}")
        if self.tier is not None:
            parts.append(f"tier {self.tier}")
        return ", ".join(parts)


class PriceError(ValueError):
    """A price that cannot be set (the message says why)."""


# Bumped by every PriceBook.set_price in this process, so a LedgerWriter here sees a new price at once
# (other processes see it at their next periodic reload).
_generation = 0
_generation_lock = threading.Lock()


def price_generation() -> int:
    """A number that changes whenever this process sets a price."""
    return _generation


def _bump_generation() -> None:
    global _generation
    with _generation_lock:
        _generation += 1


def _price_decimal(name: str, value) -> Decimal:
    if isinstance(value, bool) or isinstance(value, float):
        raise PriceError(f"{name}: give prices as decimal strings or Decimals (a float such as {value!r} is "
                         "inexact)")
    if isinstance(value, Decimal):
        d = value
    elif isinstance(value, int):
        d = Decimal(value)
    elif isinstance(value, str):
        try:
            d = Decimal(value.strip())
        except decimal.InvalidOperation:
            raise PriceError(f"{name}: {value!r} is not a decimal number") from None
    else:
        raise PriceError(f"{name}: expected a decimal string or Decimal, got {type(value).__name__}")
    if not d.is_finite():
        raise PriceError(f"{name}: {value!r} is not a finite number")
    if d < 0:
        raise PriceError(f"{name}: a price cannot be negative (got {value})")
    if d >= MAX_PRICE_PER_MTOK:
        raise PriceError(f"{name}: {value} USD per 1M tokens is too large (limit {MAX_PRICE_PER_MTOK})")
    exponent = d.as_tuple().exponent
    if isinstance(exponent, int) and exponent < -12 and d != d.quantize(Money.SCALE, context=MONEY_CONTEXT):
        raise PriceError(f"{name}: {value} has more than 12 decimal places")
    return d.quantize(Money.SCALE, context=MONEY_CONTEXT)


def _info(row: Price) -> PriceInfo:
    return PriceInfo(id=row.id, base_model=row.base_model, adapter_id=row.adapter_id, tier=row.tier,
                     input_per_mtok=row.input_per_mtok, cached_input_per_mtok=row.cached_input_per_mtok,
                     output_per_mtok=row.output_per_mtok, effective_from=row.effective_from)


def load_prices(session: Session, base_model: str | None = None) -> list[PriceInfo]:
    """Every price row (of one base model), ordered by base model, effective_from, id."""
    stmt = select(Price).order_by(Price.base_model, Price.effective_from, Price.id)
    if base_model is not None:
        stmt = stmt.where(Price.base_model == base_model)
    return [_info(row) for row in session.execute(stmt).scalars()]


def _scope_filter(column, value):
    return column.is_(None) if value is None else column == value


class PriceBook:
    def __init__(self, db: Database):
        self.db = db

    def set_price(self, base_model: str, input_per_mtok, cached_input_per_mtok, output_per_mtok, *,
                  adapter_id: str | None = None, tier: str | None = None,
                  effective_from: datetime | None = None) -> PriceInfo:
        """Add a price (USD per 1M tokens, as Decimal or decimal text such as "0.15") for `base_model`,
        narrowed to one adapter and/or tier, in force from `effective_from` (timezone-aware; default now)."""
        if not isinstance(base_model, str) or not base_model.strip():
            raise PriceError("base_model is required")
        if len(base_model) > _BASE_MODEL_MAX:
            raise PriceError(f"base_model is longer than {_BASE_MODEL_MAX} characters")
        for name, value in (("adapter_id", adapter_id), ("tier", tier)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise PriceError(f"{name} must be a non-empty string or None")
        prices = {name: _price_decimal(name, value) for name, value in (
            ("input_per_mtok", input_per_mtok), ("cached_input_per_mtok", cached_input_per_mtok),
            ("output_per_mtok", output_per_mtok))}
        if effective_from is None:
            effective_from = utcnow()
        elif not isinstance(effective_from, datetime):
            raise PriceError(f"effective_from must be a datetime, got {type(effective_from).__name__}")
        elif effective_from.tzinfo is None or effective_from.utcoffset() is None:
            raise PriceError("effective_from must be timezone-aware (a naive datetime is ambiguous)")
        effective_from = effective_from.astimezone(timezone.utc)
        scope = PriceInfo(0, base_model, adapter_id, tier, _ZERO, _ZERO, _ZERO, effective_from).scope
        try:
            with self.db.session() as session:
                if adapter_id is not None:
                    adapter = session.get(Adapter, adapter_id)
                    if adapter is None:
                        raise PriceError(f"unknown adapter {adapter_id!r}")
                    if adapter.deleted_at is not None:
                        raise PriceError(f"adapter {adapter_id!r} is deleted")
                if tier is not None and session.get(Tier, tier) is None:
                    raise PriceError(f"unknown tier {tier!r}")
                # The unique constraint cannot see duplicates whose adapter or tier is NULL (NULLs differ in SQL).
                duplicate = session.execute(select(Price.id).where(
                    Price.base_model == base_model, _scope_filter(Price.adapter_id, adapter_id),
                    _scope_filter(Price.tier, tier), Price.effective_from == effective_from)).first()
                if duplicate is not None:
                    raise PriceError(f"a price for {scope} from {effective_from.isoformat()} already exists "
                                     f"(id {duplicate[0]}); set a new one with a later effective_from")
                row = Price(base_model=base_model, adapter_id=adapter_id, tier=tier, effective_from=effective_from,
                            **prices)
                session.add(row)
                session.flush()
                info = _info(row)
        except IntegrityError:  # a concurrent set_price for the same scope and time won the race
            raise PriceError(f"a price for {scope} from {effective_from.isoformat()} already exists (or its "
                             "adapter was deleted meanwhile)") from None
        _bump_generation()
        return info

    def list_prices(self, base_model: str | None = None) -> list[PriceInfo]:
        with self.db.session() as session:
            return load_prices(session, base_model)


def price_for(prices: Sequence[PriceInfo], base_model: str, adapter_id: str | None, tier: str | None,
              at: datetime) -> PriceInfo | None:
    """The price in force at `at` for a request: among the prices of `base_model` with effective_from <= at
    whose scope covers the request, the most specific scope wins — (adapter, tier) > (adapter, any tier) >
    (base, tier) > (base, any tier) — and within that scope the latest effective_from. None: no price."""
    if at.tzinfo is None or at.utcoffset() is None:
        raise ValueError("price_for needs a timezone-aware time")
    best: PriceInfo | None = None
    best_key = None
    for price in prices:
        if price.base_model != base_model or price.effective_from > at:
            continue
        if price.adapter_id is not None and price.adapter_id != adapter_id:
            continue
        if price.tier is not None and price.tier != tier:
            continue
        key = (price.adapter_id is not None, price.tier is not None, price.effective_from, price.id)
        if best_key is None or key > best_key:
            best, best_key = price, key
    return best


def price_for_composition(prices: Sequence[PriceInfo], base_model: str, adapter_ids: Sequence[str],
                          tier: str | None, at: datetime, prompt_tokens: int, cached_tokens: int,
                          completion_tokens: int) -> PriceInfo | None:
    """The price of a request that combined adapters (`adapters`): of the prices each component would have
    been billed at alone (`price_for` with that adapter) and the base model's price for the tier, the one
    that costs this request the most; on a tie the first component's (the base's only when it costs strictly
    more). So a composition never costs less than its most expensive component, nor than the base model
    itself: an adapter priced below the base (a $0 demo adapter) cannot buy base-model output cheaper
    through a composition, whatever its weight. Every listed component counts, weight 0 included: it is
    computed like any other (its rows are in the composite). Admins set it with the ordinary prices.
    None: no price at all."""
    best: PriceInfo | None = None
    best_cost = None
    # The base model's price comes last, so it wins only when it costs strictly more than every component's.
    for adapter_id in [*adapter_ids, None]:
        price = price_for(prices, base_model, adapter_id, tier, at)
        cost = cost_of(prompt_tokens, cached_tokens, completion_tokens, price)
        if best_cost is None or cost > best_cost:
            best, best_cost = price, cost
    return best


def cost_of(prompt_tokens: int, cached_tokens: int, completion_tokens: int, price: PriceInfo | None) -> Decimal:
    """Exact cost in USD: uncached prompt tokens at the input price, cached ones at the cached-input price,
    completion tokens at the output price (all per 1M tokens), rounded half-even to 12 decimal places."""
    for name, value in (("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens),
                        ("completion_tokens", completion_tokens)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} cannot be negative (got {value})")
    if cached_tokens > prompt_tokens:
        raise ValueError(f"cached_tokens ({cached_tokens}) cannot exceed prompt_tokens ({prompt_tokens})")
    if price is None:
        return _ZERO
    ctx = MONEY_CONTEXT
    total = ctx.add(ctx.add(ctx.multiply(Decimal(prompt_tokens - cached_tokens), price.input_per_mtok),
                            ctx.multiply(Decimal(cached_tokens), price.cached_input_per_mtok)),
                    ctx.multiply(Decimal(completion_tokens), price.output_per_mtok))
    return ctx.divide(total, Decimal(_MTOK)).quantize(Money.SCALE, context=ctx)


def cost_bound(prompt_tokens: int, completion_tokens: int, price: PriceInfo | None) -> Decimal:
    """The most `cost_of` can be for a request of `prompt_tokens` with at most `completion_tokens`, however many
    prompt tokens the prefix cache holds: every prompt token at the dearer of the input and cached-input price
    (cost_of is linear in the cached count, so one of the two ends is the maximum)."""
    return max(cost_of(prompt_tokens, 0, completion_tokens, price),
               cost_of(prompt_tokens, prompt_tokens, completion_tokens, price))


def worst_case_cost(prices: Sequence[PriceInfo], base_model: str, candidates: Sequence[str | None], tier: str | None,
                    at: datetime, prompt_tokens: int, completion_tokens: int) -> Decimal:
    """What a request can cost at most: `prompt_tokens` in, at most `completion_tokens` out, billed at the price of
    one of `candidates` (adapter ids; None: the base model), at most the dearest. One adapter: [its id]. A
    composition: its components and None, as `price_for_composition` bills it (never below the base model)."""
    return max((cost_bound(prompt_tokens, completion_tokens, price_for(prices, base_model, adapter_id, tier, at))
                for adapter_id in candidates or [None]), default=_ZERO)
