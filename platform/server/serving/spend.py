"""A request's money: before the engine starts, its worst-case cost is reserved against every budget that applies
(402 `budget_exceeded` when a hard one cannot hold it, nothing held); when it ends, its cost at the price in
force (what its ledger rows will say) goes into the answer with what each budget has left.

The worst case: the prompt at the dearer of the input and cached-input prices, plus `max_tokens` for every
choice at the output price, per part of a fan-out (each part is billed on its own row and holds on its own);
a composition at its costliest component's (or the base model's) price. The reservation is held until the
ledger row is written (`loramux.billing.budgets`), or released when the request ends without one."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from fastapi.concurrency import run_in_threadpool

from loramux.billing.budgets import (
    BudgetBook,
    BudgetExceeded,
    BudgetStatus,
    BudgetUnavailable,
    money_text,
)
from loramux.billing.ledger_records import ledger_row
from loramux.billing.money import MONEY_CONTEXT
from loramux.billing.pricing import PriceInfo, worst_case_cost
from loramux.billing.usage import RequestRecord
from loramux.server.http.errors import ApiError
from loramux.tenancy.tenants import TenantContext

log = logging.getLogger(__name__)
_ZERO = Decimal("0.000000000000")
REMAINING_HEADER = "X-Loramux-Budget-Remaining"


@dataclass
class Spend:
    """What a running request holds against its budgets (`statuses`: each budget as of its reservation, this
    request's `held` included) and, once it ended, its `cost` (None when no price could be read)."""

    request_id: str
    book: BudgetBook | None
    prices: list[PriceInfo] | None
    statuses: list[BudgetStatus] = field(default_factory=list)
    held: Decimal = _ZERO
    cost: Decimal | None = None
    arrived_at: datetime | None = None  # the request's arrival by the book's clock: its ledger rows' created_at

    def settle(self, records: Sequence[RequestRecord]) -> None:
        """The request ended with these ledger records: its cost is theirs, priced as the ledger will."""
        if self.prices is None:
            return
        try:
            total = _ZERO
            for record in records:
                total = MONEY_CONTEXT.add(total, ledger_row(record, self.prices)["cost"])
            self.cost = total
        except Exception:  # noqa: BLE001 - the answer goes without its cost; the ledger prices the row itself
            log.exception("request %s: its cost could not be computed for the answer", self.request_id)

    def release(self) -> None:
        """The request ended without a ledger row: drop its holds (off the event loop)."""
        if self.statuses and self.book is not None:
            self.book.release_later(self.request_id)

    def watch(self, billing: Sequence[Future]) -> None:
        """Release the holds if the ledger refuses or loses a record (the request is then answered 500)."""
        if not self.statuses:
            return

        def done(future: Future) -> None:
            if future.exception() is not None or future.result() is not True:
                self.release()

        for future in billing:
            future.add_done_callback(done)

    def remaining(self, status: BudgetStatus) -> Decimal:
        """What `status`'s budget has left as of this request's reservation, with its cost (once known) in place
        of what it held."""
        own = self.cost if self.cost is not None else self.held
        left = MONEY_CONTEXT.add(MONEY_CONTEXT.subtract(status.remaining, own), self.held)
        return max(_ZERO, min(left, status.budget.limit_usd))

    def extension(self) -> dict:
        """The `loramux` extension's `cost` (a decimal string in USD) and `budgets` (each that applied)."""
        ext: dict = {"cost": money_text(self.cost) if self.cost is not None else None}
        if self.statuses:
            ext["budgets"] = [{"scope": s.budget.scope, "subject": s.budget.subject or None,
                               "period": s.budget.period, "hard": s.budget.hard,
                               "limit_usd": money_text(s.budget.limit_usd),
                               "remaining_usd": money_text(self.remaining(s)),
                               "resets_at": s.resets_at.isoformat() if s.resets_at else None}
                              for s in self.statuses]
        return ext

    def headers(self) -> dict[str, str]:
        """`X-Loramux-Budget-Remaining`: the least any hard budget (else any budget) of the request has left."""
        statuses = [s for s in self.statuses if s.budget.hard] or self.statuses
        if not statuses:
            return {}
        return {REMAINING_HEADER: money_text(min(self.remaining(s) for s in statuses))}


@dataclass(frozen=True)
class SpendAsk:
    """What a request may cost: `parts` per part the adapter ids that serve it (one: an adapter, or None for the
    base model; several: a composition); `max_completion` the most completion tokens one part generates (n x
    max_tokens); `arrival` its time.monotonic() arrival (prices are those in force then); `user` and `tags`
    pick the user and tag budgets."""

    tenant: TenantContext
    request_id: str
    model_id: str
    parts: Sequence[Sequence[str | None]]
    prompt_tokens: int
    max_completion: int
    arrival: float
    user: str | None = None
    tags: Sequence[str] = ()


async def reserve_spend(book: BudgetBook, ask: SpendAsk, fail_open: bool = False) -> Spend:
    """Reserve the request's worst case against the tenant's budgets that apply to its key, user and tags.

    Raises ApiError 402 `budget_exceeded` (naming the budget, what it has left, what the request needs and when
    it resets) or, when the database cannot be reached and the tenant has budgets, 503 `budgets_unavailable`
    (unless `fail_open`: then the request runs unreserved, logged)."""
    # The arrival, by the book's clock: the prices, the budgets' periods and the ledger rows' created_at.
    at = book.clock() - timedelta(seconds=time.monotonic() - ask.arrival)
    tenant, request_id = ask.tenant, ask.request_id

    def blocking() -> Spend:
        budgets = [b for b in book.budgets_for(tenant.tenant_id) if b.applies(tenant.key_id, ask.user, ask.tags)]
        try:
            prices = book.prices()
        except Exception as exc:  # noqa: BLE001
            if budgets:
                raise BudgetUnavailable(f"prices cannot be read ({type(exc).__name__})") from exc
            return Spend(request_id, book, None, arrived_at=at)  # no budget: the answer goes without its cost
        amounts = [worst_case_cost(prices, ask.model_id, ids, tenant.tier.name, at, ask.prompt_tokens,
                                   ask.max_completion) for ids in ask.parts]
        statuses = book.reserve(request_id, budgets, amounts, at) if budgets else []
        return Spend(request_id, book, prices, statuses, sum(amounts, _ZERO) if statuses else _ZERO, arrived_at=at)

    # Shielded: a cancelled request (its client gone) cannot stop the thread, whose reservation may still
    # commit; it is then released as soon as it has.
    reserving = asyncio.ensure_future(run_in_threadpool(blocking))
    try:
        return await asyncio.shield(reserving)
    except asyncio.CancelledError:
        reserving.add_done_callback(_release_if_reserved)
        raise
    except BudgetExceeded as exc:
        status = exc.status
        raise ApiError(402, str(exc), code="budget_exceeded", param="max_tokens", extra={
            "scope": status.budget.scope, "subject": status.budget.subject or None,
            "period": status.budget.period, "limit_usd": money_text(status.budget.limit_usd),
            "remaining_usd": money_text(status.remaining), "needed_usd": money_text(exc.needed),
            "resets_at": status.resets_at.isoformat() if status.resets_at else None}) from None
    except BudgetUnavailable as exc:
        if fail_open:
            log.warning("request %s runs without its budget reservation: %s", request_id, exc)
            return Spend(request_id, book, None, arrived_at=at)
        raise ApiError(503, f"spend limits cannot be checked right now ({exc}); retry shortly",
                       retry_after_s=5, code="budgets_unavailable") from None


def _release_if_reserved(reserving: asyncio.Future) -> None:
    if not reserving.cancelled() and reserving.exception() is None:
        reserving.result().release()
