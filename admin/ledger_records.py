"""What a ledger row is made of: `check_record` (does a RequestRecord fit the ledger table on every
backend?) and `ledger_row` (the row of a record, priced at the price in force when it ran).

`loramux.admin.ledger` re-exports both names and calls them through its own namespace.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import String

from loramux.admin.pricing import PriceInfo, cost_of, price_for
from loramux.db.models import LedgerEntry, Money
from loramux.usage import RequestRecord

_INT32_MAX = 2**31 - 1
_ZERO = Money.SCALE * 0
_STRINGS = {c.name: c.type.length for c in LedgerEntry.__table__.columns if isinstance(c.type, String)}
_INTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "adapter_version")


class LedgerRecordError(ValueError):
    """A RequestRecord that cannot become a ledger row (the message says which and why)."""


def check_record(record) -> None:
    """Raise LedgerRecordError unless `record` fits the ledger table on every backend."""
    if not isinstance(record, RequestRecord):
        raise LedgerRecordError(f"expected a RequestRecord, got {type(record).__name__}")
    rid = record.request_id if isinstance(record.request_id, str) else repr(record.request_id)

    def bad(message: str) -> LedgerRecordError:
        return LedgerRecordError(f"request {rid[:80]}: {message}")

    for name, length in _STRINGS.items():
        value = getattr(record, name, None)
        if value is None and name == "adapter_id":
            continue
        if not isinstance(value, str) or not value:
            raise bad(f"{name} must be a non-empty string")
        if length is not None and len(value) > length:
            raise bad(f"{name} is longer than {length} characters")
    for name in _INTS:
        value = getattr(record, name)
        if value is None and name == "adapter_version":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32_MAX:
            raise bad(f"{name} must be an int in [0, {_INT32_MAX}], got {value!r}")
    if record.cached_tokens > record.prompt_tokens:
        raise bad(f"cached_tokens ({record.cached_tokens}) exceeds prompt_tokens ({record.prompt_tokens})")
    for name in ("queue_ms", "ttft_ms", "total_ms"):
        value = getattr(record, name)
        if value is None and name != "total_ms":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(f"{name} must be a finite number, got {value!r}")
    if not isinstance(record.fallback, bool):
        raise bad("fallback must be a bool")
    if not isinstance(record.created_at, datetime) or record.created_at.utcoffset() is None:
        raise bad("created_at must be a timezone-aware datetime")


def ledger_row(record: RequestRecord, prices: Sequence[PriceInfo]) -> dict:
    price = price_for(prices, record.model, record.adapter_id, record.tier, record.created_at)
    return dict(
        request_id=record.request_id, tenant_id=record.tenant_id, key_id=record.key_id, model=record.model,
        adapter_id=record.adapter_id, adapter_version=record.adapter_version, tier=record.tier,
        outcome=record.outcome, fallback=record.fallback, prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens, completion_tokens=record.completion_tokens,
        queue_ms=None if record.queue_ms is None else float(record.queue_ms),
        ttft_ms=None if record.ttft_ms is None else float(record.ttft_ms), total_ms=float(record.total_ms),
        price_id=price.id if price else None,
        input_per_mtok=price.input_per_mtok if price else _ZERO,
        cached_input_per_mtok=price.cached_input_per_mtok if price else _ZERO,
        output_per_mtok=price.output_per_mtok if price else _ZERO,
        cost=cost_of(record.prompt_tokens, record.cached_tokens, record.completion_tokens, price),
        created_at=record.created_at)
