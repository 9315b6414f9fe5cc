"""What a ledger row is made of: `check_record` (does a RequestRecord fit the ledger table on every
backend?) and `ledger_row` (the row of a record, priced at the price in force when it ran); the writer's
price cache, and how it tells a row the database refuses from a database that is down.

`loramux.billing.ledger` re-exports `check_record` and calls it through its own namespace.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime

from sqlalchemy import String
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

from loramux.billing.pricing import (
    PriceInfo,
    cost_of,
    load_prices,
    price_for,
    price_for_composition,
    price_generation,
)
from loramux.billing.usage import RequestRecord
from loramux.db.models import LedgerEntry, Money

log = logging.getLogger("loramux.billing.ledger")  # the writer's own logger: these are its messages

PRICE_RELOAD_S = 1.0  # the writer reloads the price table at most this often (and when this process sets a price)
_INT32_MAX = 2**31 - 1
_ZERO = Money.SCALE * 0
_STRINGS = {c.name: c.type.length for c in LedgerEntry.__table__.columns if isinstance(c.type, String)}
_NULLABLE = frozenset(c.name for c in LedgerEntry.__table__.columns if c.nullable)
_RECORD_FIELDS = [f.name for f in fields(RequestRecord)]
_INTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "adapter_version", "part")


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
        if value is None and name in _NULLABLE:
            continue
        if not isinstance(value, str) or not value:
            raise bad(f"{name} must be a non-empty string{' or None' if name in _NULLABLE else ''}")
        if length is not None and len(value) > length:
            raise bad(f"{name} is longer than {length} characters")
        if "\x00" in value:  # PostgreSQL text cannot hold NUL: refuse it here, before the row is acknowledged
            raise bad(f"{name} contains a NUL character")
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
    if record.composition is not None and not (
            isinstance(record.composition, list) and record.composition
            and all(isinstance(c, dict) for c in record.composition)):
        raise bad("composition must be None or a non-empty list of objects")
    if record.tags is not None and not (isinstance(record.tags, list) and all(
            isinstance(t, str) and 0 < len(t) <= 64 and "\x00" not in t for t in record.tags)):
        raise bad("tags must be None or a list of strings of 1 to 64 characters")
    if not isinstance(record.created_at, datetime) or record.created_at.utcoffset() is None:
        raise bad("created_at must be a timezone-aware datetime")


def ledger_row(record: RequestRecord, prices: Sequence[PriceInfo]) -> dict:
    if record.composition:  # combined adapters: the costliest component's price (price_for_composition)
        price = price_for_composition(prices, record.model, [c.get("adapter_id") for c in record.composition],
                                      record.tier, record.created_at, record.prompt_tokens, record.cached_tokens,
                                      record.completion_tokens)
    else:
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
        created_at=record.created_at, end_user=record.end_user, replica=record.replica, part=record.part,
        composition=record.composition, tags=record.tags or None)


def short_error(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def is_data_error(exc: BaseException) -> bool:
    """True when a write failed because of the rows themselves (retrying cannot help), not the database."""
    if isinstance(exc, DBAPIError):
        return not exc.connection_invalidated and isinstance(exc, (DataError, IntegrityError))
    if isinstance(exc, StatementError):  # raised while binding parameters, before reaching the database
        return isinstance(exc.orig, (ValueError, TypeError, ArithmeticError))
    return isinstance(exc, (ValueError, TypeError, ArithmeticError))


def loose(record) -> object:
    """As much of a (possibly malformed) record as JSON can hold."""
    if isinstance(record, RequestRecord):
        return {k: getattr(record, k) for k in _RECORD_FIELDS}
    return repr(record)[:2000]


def write_batch(write, records: list[RequestRecord], rejected_path) -> tuple[int, int, list[dict]]:
    """`write(records)`; when the database refuses the batch as data, `write([record])` each record.
    Returns (inserted, duplicates, rejected entries for the records the database refuses); any other error
    propagates (the batch is retried)."""
    try:
        return (*write(records), [])
    except Exception as exc:  # noqa: BLE001
        if not is_data_error(exc):
            raise
        log.error("ledger: a batch of %d rows was refused (%s); writing them one by one", len(records),
                  short_error(exc))
    inserted = duplicates = 0
    rejected = []
    for record in records:
        try:
            i, d = write([record])
        except Exception as exc:  # noqa: BLE001
            if not is_data_error(exc):
                raise
            log.error("ledger: request %s refused by the database (%s); kept in %s", record.request_id,
                      short_error(exc), rejected_path)
            rejected.append({"error": short_error(exc), "record": loose(record)})
            continue
        inserted += i
        duplicates += d
    return inserted, duplicates, rejected


class PriceCache:
    """The price table as the writer's SQL thread sees it: reloaded at most every `reload_s` seconds, and at
    once after a price was set in this process (one thread uses it)."""

    def __init__(self, reload_s: float):
        self.reload_s = reload_s
        self._prices: list[PriceInfo] | None = None
        self._at, self._generation = 0.0, -1

    def get(self, db) -> list[PriceInfo]:
        generation = price_generation()
        if (self._prices is None or generation != self._generation
                or time.monotonic() - self._at >= self.reload_s):
            loaded_at = time.monotonic()
            with db.session() as session:
                self._prices = load_prices(session)
            self._at, self._generation = loaded_at, generation
        return self._prices
