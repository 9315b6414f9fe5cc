"""Budgets: spend limits in USD per period for a tenant, one of its keys, an end user or a tag, that hold under
concurrency because every request reserves its worst-case cost before it runs (torch-free, no HTTP types).

How the money moves, for one budget and one period:
- `spent` (table budget_spend) is the ledger cost of the requests the budget reserved for. It grows in the
  very transaction that writes their ledger rows (`book_spend`, called by `loramux.billing.ledger`), so it
  can never count a row twice or miss one, whichever process or restart writes the row.
- `reserved` is the sum of the holds (table budget_holds) of requests in flight: each part of a request
  holds its worst case (prompt + max output at the price in force, for all its choices) from admission until
  its ledger row is written, which deletes the hold and adds the real cost to `spent`; or until the request
  ends unbilled (`release`). A request is admitted only if every hard budget that applies still has
  `spent + reserved + worst case <= limit`: so the ledger's sum never passes a hard limit, by construction.
- Reservations are serialized per budget by a row lock (PostgreSQL `FOR NO KEY UPDATE`; SQLite's single
  writer), so every replica sharing the database shares them.
- After kill -9, the process that takes the crashed one's ledger log replays it (which deletes the holds of
  requests that were answered) and then `clear_leftovers` drops the crashed run's remaining holds: their
  requests never reached the log, were never answered and are never billed.

Periods reset at 00:00 UTC: `day`, `week` (Mondays), `month` (the 1st), or never (`total`). A budget set in the
middle of a period starts with what the ledger already holds for it; requests in flight at that moment are
not counted against it. Threshold crossings of `spent` (`alert_at`, fractions of the limit) put one event
per budget, period and threshold in the webhook outbox (table webhook_events) of a tenant with a webhook.
"""
from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation

from sqlalchemy import delete, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loramux.billing.ledger_records import PRICE_RELOAD_S, PriceCache
from loramux.billing.money import MONEY_CONTEXT, sum_money
from loramux.billing.pricing import PriceInfo
from loramux.db import Database
from loramux.db.database import rowcount
from loramux.db.models import (
    Budget,
    BudgetHold,
    BudgetSpend,
    LedgerEntry,
    Money,
    Tenant,
    Webhook,
    WebhookEvent,
    new_id,
    utcnow,
)

log = logging.getLogger(__name__)

SCOPES = ("tenant", "key", "user", "tag")
PERIODS = ("day", "week", "month", "total")
DEFAULT_ALERTS = (Decimal("0.5"), Decimal("0.8"), Decimal("1"))
MAX_LIMIT_USD = Decimal(10) ** 12  # far inside NUMERIC(30, 12)
MAX_TAGS = 8
TAG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
RELEASE_RETRIES = 10  # about 4 minutes of retries (0.5 s doubling, at most 30 s apart)
_ZERO = Decimal(0).quantize(Money.SCALE)
_SUBJECT_MAX = Budget.__table__.c.subject.type.length


class BudgetError(ValueError):
    """A budget that cannot be set, or tags that cannot be used (the message says what to fix)."""


class BudgetConflict(BudgetError):
    """Another request set the same budget at the same moment (409: retry)."""


class BudgetNotFound(LookupError):
    """No budget of that scope and subject."""


class BudgetUnavailable(RuntimeError):
    """The database that keeps the reservations cannot be reached: hard budgets cannot be enforced."""


@dataclass(frozen=True)
class BudgetInfo:
    id: int
    tenant_id: str
    scope: str
    subject: str
    limit_usd: Decimal
    period: str
    hard: bool
    alert_at: tuple[Decimal, ...]

    def applies(self, key_id: str | None, user: str | None, tags: Sequence[str]) -> bool:
        """Whether a request of this tenant with this key, end user and tags counts against the budget."""
        if self.scope == "tenant":
            return True
        if self.scope == "key":
            return key_id == self.subject
        if self.scope == "user":
            return user == self.subject
        return self.subject in tags

    def describe(self) -> str:
        return "the tenant" if self.scope == "tenant" else f"{self.scope} {self.subject!r}"


@dataclass(frozen=True)
class BudgetStatus:
    """A budget in its current period: `spent` (ledger costs), `reserved` (worst cases of requests in flight)
    and what remains of the limit (never below 0), with when the period ends (`resets_at`; None for total)."""

    budget: BudgetInfo
    period_start: datetime
    resets_at: datetime | None
    spent: Decimal
    reserved: Decimal

    @property
    def remaining(self) -> Decimal:
        return max(_ZERO, MONEY_CONTEXT.subtract(MONEY_CONTEXT.subtract(self.budget.limit_usd, self.spent),
                                                 self.reserved))

    def as_dict(self) -> dict:
        b = self.budget
        return {"scope": b.scope, "subject": b.subject or None, "limit_usd": money_text(b.limit_usd),
                "period": b.period, "hard": b.hard, "alert_at": [format(a, "f") for a in b.alert_at],
                "spent_usd": money_text(self.spent), "reserved_usd": money_text(self.reserved),
                "remaining_usd": money_text(self.remaining), "period_start": self.period_start.isoformat(),
                "resets_at": self.resets_at.isoformat() if self.resets_at else None}


class BudgetExceeded(Exception):
    """A request whose worst case does not fit a hard budget: `status` is that budget's (before this request),
    `needed` the request's worst-case cost."""

    def __init__(self, status: BudgetStatus, needed: Decimal):
        self.status, self.needed = status, needed
        b = status.budget
        when = f"; it resets at {status.resets_at.isoformat()}" if status.resets_at else ""
        super().__init__(
            f"the {b.period} budget of {b.describe()} (${money_text(b.limit_usd)}) has ${money_text(status.remaining)} "
            f"left, and this request may cost up to ${money_text(needed)} (its prompt plus max_tokens of output for "
            f"every choice){when}; ask for fewer max_tokens or choices to fit, or raise the budget")


def money_text(value: Decimal) -> str:
    """A money amount as a plain decimal string without trailing zeros past the cents ("0.05", "1.234567")."""
    text = format(value.quantize(Money.SCALE), "f").rstrip("0")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


def period_bounds(period: str, at: datetime) -> tuple[datetime, datetime | None]:
    """The [start, end) of the `period` that holds `at`, in UTC (end None: `total` never resets)."""
    at = at.astimezone(timezone.utc)
    day = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day, day + timedelta(days=1)
    if period == "week":
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    if period == "month":
        start = day.replace(day=1)
        return start, (start + timedelta(days=32)).replace(day=1)
    if period == "total":
        return EPOCH, None
    raise BudgetError(f"period must be one of {', '.join(PERIODS)}, not {period!r}")


def parse_tags(values: Iterable[str]) -> list[str]:
    """A request's tags, checked: at most MAX_TAGS distinct ones, each 1-64 characters of letters, digits and
    `_.:-` (starting with a letter or digit); order kept, duplicates dropped. Raises BudgetError."""
    tags: list[str] = []
    for value in values:
        if not isinstance(value, str) or not TAG_PATTERN.fullmatch(value):
            raise BudgetError(f"tag {str(value)[:80]!r} is not valid: use 1 to 64 letters, digits or '_.:-', "
                              "starting with a letter or digit")
        if value not in tags:
            tags.append(value)
    if len(tags) > MAX_TAGS:
        raise BudgetError(f"{len(tags)} tags: a request may carry at most {MAX_TAGS}")
    return tags


def check_budget(scope: str, subject: str, limit_usd, period: str,
                 alert_at) -> tuple[str, Decimal, tuple[Decimal, ...]]:
    """The subject, limit and thresholds of a budget to set, checked (BudgetError says what to fix)."""
    if scope not in SCOPES:
        raise BudgetError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if period not in PERIODS:
        raise BudgetError(f"period must be one of {', '.join(PERIODS)}, not {period!r}")
    subject = subject or ""
    if scope == "tenant":
        subject = ""
    elif not subject or len(subject) > _SUBJECT_MAX or "\x00" in subject:
        raise BudgetError(f"a {scope} budget needs its {scope} (1 to {_SUBJECT_MAX} characters)")
    if scope == "tag":
        parse_tags([subject])
    if isinstance(limit_usd, (float, bool)):
        raise BudgetError("limit_usd must be a decimal string such as \"500.00\" (a float is inexact)")
    try:
        limit = Decimal(str(limit_usd)) if not isinstance(limit_usd, Decimal) else limit_usd
    except (InvalidOperation, ValueError):
        raise BudgetError(f"limit_usd {str(limit_usd)[:40]!r} is not a decimal number") from None
    if not limit.is_finite() or limit < 0 or limit >= MAX_LIMIT_USD:
        raise BudgetError(f"limit_usd must be at least 0 and below {MAX_LIMIT_USD}, got {limit_usd}")
    if limit != limit.quantize(Money.SCALE):
        raise BudgetError("limit_usd has more than 12 decimal places")
    thresholds = DEFAULT_ALERTS if alert_at is None else alert_at
    try:
        fractions = tuple(sorted({Decimal(str(a)) for a in thresholds}))
    except (InvalidOperation, ValueError, TypeError):
        raise BudgetError("alert_at must be a list of fractions of the limit, such as [0.5, 0.8, 1.0]") from None
    if len(fractions) > 10 or any(not a.is_finite() or a <= 0 or a > 10 for a in fractions):
        raise BudgetError("alert_at takes at most 10 fractions of the limit, each above 0 and at most 10")
    return subject, limit.quantize(Money.SCALE), tuple(f.normalize() for f in fractions)


def _info(row: Budget) -> BudgetInfo:
    return BudgetInfo(row.id, row.tenant_id, row.scope, row.subject, row.limit_usd, row.period, row.hard,
                      tuple(Decimal(a) for a in row.alert_at))


def _insert(session: Session):
    return pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert


def _ledger_spend(session: Session, budget: BudgetInfo, start: datetime, end: datetime | None) -> Decimal:
    """What the ledger holds for `budget`'s scope in [start, end)."""
    t = LedgerEntry
    where = [t.tenant_id == budget.tenant_id, t.created_at >= start]
    if end is not None:
        where.append(t.created_at < end)
    if budget.scope == "key":
        where.append(t.key_id == budget.subject)
    elif budget.scope == "user":
        where.append(t.end_user == budget.subject)
    elif budget.scope == "tag":  # JSON lists: filtered here, the same on every backend
        total = _ZERO
        rows = session.execute(select(t.cost, t.tags).where(*where, t.tags.is_not(None)))
        for cost, tags in rows:
            if budget.subject in (tags or ()):
                total = MONEY_CONTEXT.add(total, cost)
        return total.quantize(Money.SCALE)
    return sum_money(session, t.cost, *where)


def _spent(session: Session, budget_id: int, start: datetime) -> Decimal | None:
    return session.scalar(select(BudgetSpend.spent).where(BudgetSpend.budget_id == budget_id,
                                                          BudgetSpend.period_start == start))


def _add_spend(session: Session, budget_id: int, start: datetime, amount: Decimal) -> tuple[Decimal, Decimal]:
    """Add `amount` to the budget period's spend (creating its row); returns (before, after)."""
    if session.get_bind().dialect.name == "postgresql":  # NUMERIC addition is exact and atomic per row
        stmt = pg_insert(BudgetSpend).values(budget_id=budget_id, period_start=start, spent=amount)
        after = session.scalar(stmt.on_conflict_do_update(
            index_elements=["budget_id", "period_start"],
            set_={"spent": BudgetSpend.spent + stmt.excluded.spent}).returning(BudgetSpend.spent))
        return MONEY_CONTEXT.subtract(after, amount), after
    before = _spent(session, budget_id, start)  # SQLite keeps decimal text: added here, under its write lock
    after = MONEY_CONTEXT.add(before or _ZERO, amount)
    if before is None:
        session.add(BudgetSpend(budget_id=budget_id, period_start=start, spent=after))
        session.flush()
    else:
        session.execute(update(BudgetSpend).where(BudgetSpend.budget_id == budget_id,
                                                  BudgetSpend.period_start == start).values(spent=after))
    return before or _ZERO, after


def book_spend(session: Session, rows: Sequence[dict]) -> None:
    """In the ledger's transaction, for its newly inserted `rows` (ledger row dicts: request_id, part, cost,
    tenant_id, key_id, end_user, tags, created_at): add each row's cost to the spend of every budget it counts
    against, drop its holds, and queue an alert event for each threshold that crossed (for tenants with a
    webhook). A row counts in the period its hold names (the request's arrival, when it reserved), else in the
    period of its `created_at`: a row of a request that reserved nothing (served while reservations could not
    be made, or admitted with a budget list read just before the budget was set) still counts.

    On PostgreSQL the rows' tenants are share-locked first, so a budget being set (`BudgetBook.put`, which counts
    the ledger under the tenant's row lock) either counts these rows or is charged them here, never neither; and
    the budgets are key-share-locked, so one being deleted is either gone here or waits."""
    if not rows:
        return
    by_tenant = _locked_budgets(session, sorted({r["tenant_id"] for r in rows}))
    if not by_tenant:
        return  # no budget, so no hold either (holds go with their budget)
    held = _holds_of(session, sorted({r["request_id"] for r in rows if r["tenant_id"] in by_tenant}))
    added: dict[tuple[int, datetime], Decimal] = {}
    for r in rows:
        for budget in by_tenant.get(r["tenant_id"], ()):
            start = held.get((r["request_id"], r["part"], budget.id))
            if start is None:
                if not budget.applies(r["key_id"], r["end_user"], r["tags"] or ()):
                    continue
                start = period_bounds(budget.period, r["created_at"])[0]
            key = (budget.id, start)
            added[key] = MONEY_CONTEXT.add(added.get(key, _ZERO), r["cost"])
    crossings = []
    for (budget_id, start), amount in sorted(added.items()):
        before, after = _add_spend(session, budget_id, start, amount)
        crossings.append((budget_id, start, before, after))
    inserted = {(r["request_id"], r["part"]) for r in rows}
    keys = sorted({(request_id, part) for request_id, part, _ in held if (request_id, part) in inserted})
    for i in range(0, len(keys), 500):
        session.execute(delete(BudgetHold).where(tuple_(BudgetHold.request_id, BudgetHold.part).in_(keys[i:i + 500])))
    _queue_alerts(session, crossings)


def _locked_budgets(session: Session, tenants: list[str]) -> dict[str, list[BudgetInfo]]:
    """The tenants' budgets, by tenant; on PostgreSQL with the tenants share-locked and the budgets
    key-share-locked (see `book_spend`)."""
    stmt = select(Budget).where(Budget.tenant_id.in_(tenants)).order_by(Budget.id)
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(Tenant.id).where(Tenant.id.in_(tenants)).order_by(Tenant.id)
                        .with_for_update(read=True))
        stmt = stmt.with_for_update(read=True, key_share=True)
    by_tenant: dict[str, list[BudgetInfo]] = {}
    for row in session.scalars(stmt).all():
        by_tenant.setdefault(row.tenant_id, []).append(_info(row))
    return by_tenant


def _holds_of(session: Session, request_ids: list[str]) -> dict[tuple[str, int, int], datetime]:
    """(request id, part, budget id) -> the held period's start, for every hold of these requests."""
    held: dict[tuple[str, int, int], datetime] = {}
    for i in range(0, len(request_ids), 500):
        for h in session.execute(select(BudgetHold.request_id, BudgetHold.part, BudgetHold.budget_id,
                                        BudgetHold.period_start)
                                 .where(BudgetHold.request_id.in_(request_ids[i:i + 500]))):
            held[(h.request_id, h.part, h.budget_id)] = h.period_start
    return held


def _queue_alerts(session: Session, crossings: list[tuple[int, datetime, Decimal, Decimal]]) -> None:
    budgets = {b.id: b for b in session.scalars(select(Budget).where(Budget.id.in_({c[0] for c in crossings})))}
    hooked = set(session.scalars(select(Webhook.tenant_id).where(
        Webhook.tenant_id.in_({b.tenant_id for b in budgets.values()}))))
    for budget_id, start, before, after in crossings:
        row = budgets.get(budget_id)
        if row is None or row.tenant_id not in hooked:
            continue
        budget = _info(row)
        _, end = period_bounds(budget.period, start)
        for fraction in budget.alert_at:
            line = MONEY_CONTEXT.multiply(budget.limit_usd, fraction)
            if not before < line <= after:
                continue
            event_id = new_id("evt")
            payload = {"id": event_id, "type": "budget.threshold", "tenant_id": budget.tenant_id,
                       "budget": {"scope": budget.scope, "subject": budget.subject or None,
                                  "limit_usd": money_text(budget.limit_usd), "period": budget.period,
                                  "hard": budget.hard, "period_start": start.isoformat(),
                                  "resets_at": end.isoformat() if end else None},
                       "threshold": format(fraction, "f"), "spent_usd": money_text(after),
                       "created_at": utcnow().isoformat()}
            stmt = _insert(session)(WebhookEvent).values(
                id=event_id, tenant_id=budget.tenant_id, kind="budget.threshold",
                dedupe_key=f"budget:{budget_id}:{start.isoformat()}:{format(fraction, 'f')}", payload=payload,
                state="pending", attempts=0, next_attempt_at=utcnow(), created_at=utcnow())
            session.execute(stmt.on_conflict_do_nothing(index_elements=["dedupe_key"]))


HOLDER_FILE = "budget-holder"


def holder_of(wal_path) -> str:
    """The holder name of a ledger log: a random id kept in a file beside the log, so it lives as long as the
    log does (a new container on the same volume takes it over with the log, whatever its hostname), and made
    with the log's folder when there is none."""
    import os
    from pathlib import Path

    path = Path(wal_path).parent / HOLDER_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f"{HOLDER_FILE}.{uuid.uuid4().hex}")
    fresh.write_text(uuid.uuid4().hex)
    os.replace(fresh, path)  # the folder is one process's (the log's lock): no one else writes it meanwhile
    return path.read_text().strip()


class BudgetBook:
    """Budgets and their reservations in the database (blocking calls: the server runs them in its threadpool).

    `holder`: the name of the ledger log this process bills into (`holder_of`); `clock`: the time that picks a request's
    period (injectable for tests); `cache_ttl_s`: how long a tenant's list of budgets is reused on the request
    path (changes made through this book apply at once; through another replica within this time)."""

    def __init__(self, db: Database, holder: str, clock: Callable[[], datetime] = utcnow,
                 cache_ttl_s: float = 1.0):
        self.db, self.holder, self.clock, self.cache_ttl_s = db, holder, clock, cache_ttl_s
        self.run = uuid.uuid4().hex
        self._cache: dict[str, tuple[float, list[BudgetInfo]]] = {}
        self._lock = threading.Lock()
        self._prices = PriceCache(PRICE_RELOAD_S)
        self._prices_lock = threading.Lock()
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="budget-release")
        self.release_backoff_s = 0.5  # the first retry of a failed release; doubling, at most 30 s

    # -- admin -------------------------------------------------------------------------------------------
    def put(self, tenant_id: str, scope: str, subject: str, limit_usd, period: str, hard: bool = True,
            alert_at=None) -> tuple[BudgetStatus, bool]:
        """Set (create or replace) a budget; returns its status and whether it was created. A new budget, or
        one whose period changed, starts its current period with what the ledger holds for it."""
        subject, limit, fractions = check_budget(scope, subject, limit_usd, period, alert_at)
        now = self.clock()
        with self.db.session() as session:
            # Ordered against the ledger (`book_spend`) and other PUTs by the tenant's row: its lock on
            # PostgreSQL, the database's write lock (taken by a first write) on SQLite.
            if session.get_bind().dialect.name == "postgresql":
                found = session.scalar(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
            else:
                found = rowcount(session.execute(update(Tenant).where(Tenant.id == tenant_id)
                                                 .values(status=Tenant.status)))
            if not found:
                raise BudgetNotFound(f"no tenant {tenant_id!r}")
            row = session.scalar(select(Budget).where(Budget.tenant_id == tenant_id, Budget.scope == scope,
                                                      Budget.subject == subject).with_for_update(key_share=True))
            created = row is None
            if created:
                row = Budget(tenant_id=tenant_id, scope=scope, subject=subject, created_at=now, lock_version=0)
                session.add(row)
            recount = created or row.period != period
            row.limit_usd, row.period, row.hard = limit, period, bool(hard)
            row.alert_at, row.updated_at = [format(f, "f") for f in fractions], now
            try:
                session.flush()
            except IntegrityError:  # set at the same moment by another request: that one won
                raise BudgetConflict("the budget was set concurrently by another request; retry") from None
            info = _info(row)
            start, end = period_bounds(period, now)
            if recount:
                session.execute(delete(BudgetSpend).where(BudgetSpend.budget_id == row.id))
                # Requests in flight count in the new period: their costs land there.
                session.execute(update(BudgetHold).where(BudgetHold.budget_id == row.id).values(period_start=start))
                session.add(BudgetSpend(budget_id=row.id, period_start=start,
                                        spent=_ledger_spend(session, info, start, end)))
                session.flush()
            status = self._status(session, info, now)
        self._forget(tenant_id)
        return status, created

    def status(self, tenant_id: str, scope: str, subject: str = "") -> BudgetStatus:
        """A budget's current period (BudgetNotFound when there is none)."""
        with self.db.session() as session:
            row = self._row(session, tenant_id, scope, subject)
            return self._status(session, _info(row), self.clock())

    def delete(self, tenant_id: str, scope: str, subject: str = "") -> None:
        """Remove a budget, with its spend and holds (requests in flight go on unbudgeted)."""
        with self.db.session() as session:
            row = self._row(session, tenant_id, scope, subject, lock=True)  # first: the ledger locks it first too
            session.execute(delete(BudgetHold).where(BudgetHold.budget_id == row.id))
            session.execute(delete(BudgetSpend).where(BudgetSpend.budget_id == row.id))
            session.delete(row)
        self._forget(tenant_id)

    def statuses(self, tenant_id: str | None = None) -> list[BudgetStatus]:
        """Every budget (of one tenant), in its current period, by tenant, scope and subject."""
        now = self.clock()
        with self.db.session() as session:
            stmt = select(Budget).order_by(Budget.tenant_id, Budget.scope, Budget.subject)
            if tenant_id is not None:
                stmt = stmt.where(Budget.tenant_id == tenant_id)
            infos = [_info(row) for row in session.scalars(stmt).all()]
            return [status for i in range(0, len(infos), 200)
                    for status in self._statuses(session, infos[i:i + 200], now)]

    # -- the request path --------------------------------------------------------------------------------
    def budgets_for(self, tenant_id: str) -> list[BudgetInfo]:
        """The tenant's budgets (reused for `cache_ttl_s`). Raises BudgetUnavailable when the database cannot
        be read and nothing is cached."""
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(tenant_id)
        if cached is not None and now - cached[0] < self.cache_ttl_s:
            return cached[1]
        try:
            with self.db.session() as session:
                budgets = [_info(r) for r in session.scalars(select(Budget).where(Budget.tenant_id == tenant_id))]
        except Exception as exc:  # noqa: BLE001 - a database outage: the last list read stays in force
            if cached is not None:
                return cached[1]
            raise BudgetUnavailable(f"budgets cannot be read ({type(exc).__name__})") from exc
        with self._lock:
            self._cache[tenant_id] = (now, budgets)
        return budgets

    def reserve(self, request_id: str, budgets: Sequence[BudgetInfo], parts: Sequence[Decimal],
                at: datetime | None = None) -> list[BudgetStatus]:
        """Hold `parts` (each part's worst-case cost) against every budget in `budgets` (those that apply to
        the request), atomically: either all are held or none, in the periods that hold `at` (the request's
        arrival, as on its ledger row; default: now). Raises BudgetExceeded, naming the hard budget
        with the least left, when the request does not fit one; BudgetUnavailable when the database fails.
        Returns each budget's status with this request's holds included."""
        if not budgets:
            return []
        needed = sum(parts, _ZERO)
        now = at or self.clock()  # the request's arrival: the period its ledger row will fall in
        try:
            with self.db.session() as session:
                ids = sorted(b.id for b in budgets)
                if session.get_bind().dialect.name == "postgresql":
                    rows = session.scalars(select(Budget).where(Budget.id.in_(ids)).order_by(Budget.id)
                                           .with_for_update(key_share=True)).all()
                else:  # SQLite: a write first takes the database's write lock, which orders reservations
                    session.execute(update(Budget).where(Budget.id.in_(ids))
                                    .values(lock_version=Budget.lock_version + 1))
                    rows = session.scalars(select(Budget).where(Budget.id.in_(ids)).order_by(Budget.id)).all()
                # The rows as they are now (a budget deleted meanwhile no longer applies).
                statuses = self._statuses(session, [_info(row) for row in rows], now, create=True)
                short = [s for s in statuses if s.budget.hard and MONEY_CONTEXT.add(
                    MONEY_CONTEXT.add(s.spent, s.reserved), needed) > s.budget.limit_usd]
                if short:
                    raise BudgetExceeded(min(short, key=lambda s: (s.remaining, s.budget.id)), needed)
                created = utcnow()
                session.add_all([BudgetHold(request_id=request_id, part=part, budget_id=s.budget.id,
                                            period_start=s.period_start, amount=amount, holder=self.holder,
                                            run=self.run, created_at=created)
                                 for s in statuses for part, amount in enumerate(parts)])
        except (BudgetExceeded, BudgetUnavailable):
            raise
        except Exception as exc:  # noqa: BLE001
            log.warning("budgets: reservation for %s failed: %s", request_id, exc)
            raise BudgetUnavailable(f"budget reservations cannot be made ({type(exc).__name__})") from exc
        return [BudgetStatus(s.budget, s.period_start, s.resets_at, s.spent, MONEY_CONTEXT.add(s.reserved, needed))
                for s in statuses]

    def prices(self) -> list[PriceInfo]:
        """The price table as the ledger writer prices rows (reloaded at most every PRICE_RELOAD_S)."""
        with self._prices_lock:
            return self._prices.get(self.db)

    def release_later(self, request_id: str) -> None:
        """`release` on a thread of the book's own, for callers on an event loop."""
        try:
            self._releases.submit(self.release, request_id)
        except RuntimeError:  # shut down: the next start's `clear_leftovers` drops the holds
            pass

    def close(self) -> None:
        """Finish the releases queued so far."""
        self._releases.shutdown(wait=True)

    def release(self, request_id: str, attempt: int = 0) -> None:
        """Drop a request's holds: it ended without a ledger row (refused after admission, lost, unbilled). While
        the database cannot be reached this is retried with backoff, for a few minutes; after that the holds
        stay until the log's next start (`clear_leftovers`)."""
        try:
            with self.db.session() as session:
                session.execute(delete(BudgetHold).where(BudgetHold.request_id == request_id))
        except Exception as exc:  # noqa: BLE001
            if attempt >= RELEASE_RETRIES:
                log.error("budgets: gave up releasing the holds of %s (%s); the next start drops them", request_id,
                          exc)
                return
            retry = threading.Timer(min(30.0, self.release_backoff_s * 2 ** attempt), self._release_again,
                                    (request_id, attempt + 1))
            retry.daemon = True
            retry.start()

    def _release_again(self, request_id: str, attempt: int) -> None:
        try:
            self._releases.submit(self.release, request_id, attempt)
        except RuntimeError:  # shut down: the next start drops them
            pass

    def clear_leftovers(self, holder: str | None = None) -> int:
        """Drop the holds that earlier runs of `holder` (default: this process's log) left: call it once that
        log's replay is in SQL. Returns how many were dropped."""
        holder = holder or self.holder
        try:
            with self.db.session() as session:
                result = session.execute(delete(BudgetHold).where(BudgetHold.holder == holder,
                                                                  BudgetHold.run != self.run)
                                         .execution_options(preserve_rowcount=True))
                dropped = result.rowcount or 0
        except Exception as exc:  # noqa: BLE001 - they stay reserved (the safe side) until the next start
            log.warning("budgets: could not drop the reservations a crash left: %s", exc)
            return 0
        if dropped:
            log.warning("budgets: dropped %d reservations of requests that a crash cut short", dropped)
        return dropped

    # -- internals ---------------------------------------------------------------------------------------
    def _row(self, session: Session, tenant_id: str, scope: str, subject: str, lock: bool = False) -> Budget:
        if scope not in SCOPES:
            raise BudgetError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
        stmt = select(Budget).where(Budget.tenant_id == tenant_id, Budget.scope == scope,
                                    Budget.subject == ("" if scope == "tenant" else subject))
        row = session.scalar(stmt.with_for_update() if lock else stmt)
        if row is None:
            what = "the tenant" if scope == "tenant" else f"{scope} {subject!r}"
            raise BudgetNotFound(f"no budget is set for {what} of tenant {tenant_id}")
        return row

    def _status(self, session: Session, info: BudgetInfo, now: datetime) -> BudgetStatus:
        return self._statuses(session, [info], now)[0]

    def _statuses(self, session: Session, infos: Sequence[BudgetInfo], now: datetime,
                  create: bool = False) -> list[BudgetStatus]:
        """Each budget in the period that holds `now`, in two queries whatever their number (the reservation
        path's latency). `create`: give a new period its spend row."""
        if not infos:
            return []
        bounds = {info.id: period_bounds(info.period, now) for info in infos}
        keys = [(info.id, bounds[info.id][0]) for info in infos]
        # The holds first: the ledger (`book_spend`) does not wait for a reservation's locks, and one of its
        # commits between the two reads then counts a request twice (held and spent), never zero times.
        reserved: dict[tuple[int, datetime], Decimal] = {}
        for r in session.execute(select(BudgetHold.budget_id, BudgetHold.period_start, BudgetHold.amount)
                                 .where(tuple_(BudgetHold.budget_id, BudgetHold.period_start).in_(keys))):
            key = (r.budget_id, r.period_start)
            reserved[key] = MONEY_CONTEXT.add(reserved.get(key, _ZERO), r.amount)
        spent = {(r.budget_id, r.period_start): r.spent for r in session.execute(
            select(BudgetSpend.budget_id, BudgetSpend.period_start, BudgetSpend.spent)
            .where(tuple_(BudgetSpend.budget_id, BudgetSpend.period_start).in_(keys)))}
        missing = [key for key in keys if key not in spent]
        if create and missing:
            # A new period: every request counted in it reserved first, so nothing was spent before.
            session.execute(_insert(session)(BudgetSpend).values(
                [{"budget_id": b, "period_start": start, "spent": _ZERO} for b, start in missing])
                .on_conflict_do_nothing(index_elements=["budget_id", "period_start"]))
        return [BudgetStatus(info, bounds[info.id][0], bounds[info.id][1], spent.get(key, _ZERO),
                             reserved.get(key, _ZERO).quantize(Money.SCALE)) for info, key in zip(infos, keys)]

    def _forget(self, tenant_id: str) -> None:
        with self._lock:
            self._cache.pop(tenant_id, None)
