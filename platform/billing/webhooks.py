"""Alert webhooks: each tenant's endpoint (table webhooks) and the delivery of its outbox (table webhook_events,
filled by `loramux.billing.budgets` in the transactions whose ledger rows cross a budget threshold) (torch-free,
no HTTP-framework types).

Delivery is at least once:
- `WebhookDispatcher` (a daemon thread) polls the due events (state pending, `next_attempt_at` reached) and
  claims each one with a conditional UPDATE that moves its `next_attempt_at` a lease ahead and counts the
  attempt: only one UPDATE matches, on SQLite and PostgreSQL alike, so processes sharing the database never send
  the same event at the same time.
- It POSTs the event's payload as JSON to the tenant's URL (read at each try: a new URL or secret applies to
  the retries of events already queued), signed, and records the outcome: a 2xx marks the event delivered;
  anything else (another status, a redirect, which is never followed, a timeout, a refused connection) puts
  the next try `retry_delay` ahead (`DeliveryPolicy`: doubling from `retry_initial_s`, at most `retry_max_s`); after
  `max_attempts` tries the event is failed.
- A process that stops between the receiver's 2xx and the commit of that outcome (kill -9, a lost database)
  leaves the event claimed: once its lease runs out it is sent again. Receivers dedupe by event id (the
  `X-Loramux-Event-Id` header, the payload's `id`).

Requests are signed as Stripe signs its webhooks: `X-Loramux-Timestamp: <unix seconds>` and
`X-Loramux-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>`; `verify_signature` checks
both, for receivers and tests.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from loramux.db import Database
from loramux.db.database import rowcount
from loramux.db.models import Tenant, Webhook, WebhookEvent, new_id, utcnow

log = logging.getLogger(__name__)

EVENT_ID_HEADER = "X-Loramux-Event-Id"
TIMESTAMP_HEADER = "X-Loramux-Timestamp"
SIGNATURE_HEADER = "X-Loramux-Signature"
SECRET_PREFIX = "whsec_"
USER_AGENT = "loramux-webhooks/1"
STATES = ("pending", "delivered", "failed")
MAX_URL_LENGTH: int = Webhook.__table__.c.url.type.length  # type: ignore[attr-defined]
MAX_EVENTS_LISTED = 500
_ERROR_LENGTH = 200
REMOVED = "the tenant's webhook was removed before this event was delivered"


class WebhookError(ValueError):
    """A webhook that cannot be set, or a query that cannot be answered (the message says what to fix)."""


class WebhookNotFound(LookupError):
    """The tenant has no webhook (or there is no such tenant)."""


@dataclass(frozen=True)
class WebhookInfo:
    """A tenant's endpoint. `secret` is set only in the answer that created or rotated it."""

    tenant_id: str
    url: str
    created_at: datetime
    updated_at: datetime
    secret: str | None = None

    def as_dict(self) -> dict:
        answer = {"tenant_id": self.tenant_id, "url": self.url, "created_at": self.created_at.isoformat(),
                  "updated_at": self.updated_at.isoformat()}
        if self.secret is not None:
            answer["secret"] = self.secret
        return answer


@dataclass(frozen=True)
class EventInfo:
    """One outbox event. `attempts`: the tries made so far (the one that delivered it included);
    `next_attempt_at`: when a pending event is tried next (None once delivered or failed)."""

    id: str
    tenant_id: str
    kind: str
    state: str
    attempts: int
    last_status: int | None
    last_error: str | None
    created_at: datetime
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    payload: dict

    def as_dict(self) -> dict:
        def iso(value: datetime | None) -> str | None:
            return value.isoformat() if value is not None else None

        return {"id": self.id, "kind": self.kind, "state": self.state, "attempts": self.attempts,
                "last_status": self.last_status, "last_error": self.last_error, "created_at": iso(self.created_at),
                "next_attempt_at": iso(self.next_attempt_at), "delivered_at": iso(self.delivered_at),
                "payload": self.payload}


def _event_info(row: WebhookEvent) -> EventInfo:
    return EventInfo(row.id, row.tenant_id, row.kind, row.state, row.attempts, row.last_status, row.last_error,
                     row.created_at, row.next_attempt_at if row.state == "pending" else None, row.delivered_at,
                     row.payload)


# -- signatures ----------------------------------------------------------------------------------------
def new_secret() -> str:
    """A signing secret: `whsec_` and 64 hex digits (256 random bits)."""
    return SECRET_PREFIX + secrets.token_hex(32)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The `X-Loramux-Signature` value of `body` sent at `timestamp`: `v1=<hex HMAC-SHA256>` of
    "<timestamp>.<body>" keyed by `secret`."""
    mac = hmac.new(secret.encode(), str(int(timestamp)).encode() + b"." + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def signed_headers(secret: str, event_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The three headers that identify and sign one request carrying `body`."""
    timestamp = int(time.time()) if timestamp is None else int(timestamp)
    return {EVENT_ID_HEADER: event_id, TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: signature(secret, timestamp, body)}


def _header(headers: Any, name: str) -> str | None:
    """A header by name, case-insensitively, from any mapping with `items()` (a dict, httpx's or Starlette's
    headers, http.server's message)."""
    wanted = name.lower()
    for key, value in headers.items():
        if str(key).lower() == wanted:
            return str(value)
    return None


def verify_signature(secret: str, body: bytes | str, headers: Any, tolerance_s: float = 300,
                     now: float | None = None) -> bool:
    """Whether `headers` sign `body` (the raw request body, exactly as received) with `secret`, at a timestamp
    within `tolerance_s` seconds of `now` (unix seconds; default the clock), which refuses replays of old
    requests. `X-Loramux-Signature` may hold several comma-separated `v1=` values; one valid is enough."""
    stamp, signed = _header(headers, TIMESTAMP_HEADER), _header(headers, SIGNATURE_HEADER)
    if not stamp or not signed:
        return False
    try:
        timestamp = int(stamp.strip())
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    raw = body.encode() if isinstance(body, str) else bytes(body)
    expected = signature(secret, timestamp, raw).encode()
    return any(hmac.compare_digest(expected, candidate.strip().encode()) for candidate in signed.split(","))


def retry_delay(attempts: int, initial_s: float, max_s: float) -> float:
    """Seconds from the `attempts`-th failed try to the next: `initial_s`, doubling with each try, at most
    `max_s`."""
    return min(max_s, initial_s * 2.0 ** min(max(attempts - 1, 0), 60))


# -- endpoints and events (the admin side) ---------------------------------------------------------------
def check_url(url: object) -> str:
    """An endpoint URL, checked: http(s), at most MAX_URL_LENGTH characters, with a host (WebhookError says
    what to fix)."""
    example = "such as https://example.com/hooks/loramux"
    if not isinstance(url, str) or not url.strip():
        raise WebhookError(f"url is required: an http:// or https:// address {example}")
    url = url.strip()
    if len(url) > MAX_URL_LENGTH:
        raise WebhookError(f"url is {len(url)} characters long; it may have at most {MAX_URL_LENGTH}")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise WebhookError("url must not contain spaces or control characters (percent-encode them)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0-65535
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        raise WebhookError(f"url is not a valid address ({exc}); use one {example}") from None
    if parts.scheme.lower() not in ("http", "https"):
        scheme = f"{parts.scheme}://" if parts.scheme else "no scheme"
        raise WebhookError(f"url must start with http:// or https://, not {scheme}; use one {example}")
    if not parts.hostname:
        raise WebhookError(f"url needs a host after {parts.scheme}://, {example}")
    return url


def _webhook_info(row: Webhook, secret: str | None = None) -> WebhookInfo:
    return WebhookInfo(row.tenant_id, row.url, row.created_at, row.updated_at, secret)


def put_webhook(db: Database, tenant_id: str, url: object, rotate_secret: bool = False,
                clock: Callable[[], datetime] = utcnow) -> tuple[WebhookInfo, bool]:
    """Set (create or replace) the tenant's endpoint; returns it and whether it was created. A new webhook gets
    a secret, and `rotate_secret` replaces it; the answer holds the secret only then (it is never shown again).
    Events already queued are sent to the new URL, signed with the secret in force at each try."""
    url = check_url(url)
    now = clock()
    with db.session() as session:
        if session.get(Tenant, tenant_id) is None:
            raise WebhookNotFound(f"no tenant {tenant_id!r}")
        row = session.get(Webhook, tenant_id, with_for_update=True)
        created, secret = row is None, None
        if row is None:
            secret = new_secret()
            row = Webhook(tenant_id=tenant_id, url=url, secret=secret, created_at=now, updated_at=now)
            session.add(row)
        else:
            row.url, row.updated_at = url, now
            if rotate_secret:
                secret = row.secret = new_secret()
        try:
            session.flush()
        except IntegrityError:  # created at the same moment by another request: that one won
            raise WebhookError("the webhook was set concurrently by another request; retry") from None
        return _webhook_info(row, secret), created


def _hook(session, tenant_id: str) -> Webhook:
    row = session.get(Webhook, tenant_id)
    if row is None:
        raise WebhookNotFound(f"tenant {tenant_id} has no webhook; set one with PUT /admin/tenants/{tenant_id}/webhook")
    return row


def get_webhook(db: Database, tenant_id: str) -> WebhookInfo:
    """The tenant's endpoint, without its secret (WebhookNotFound when it has none)."""
    with db.session() as session:
        return _webhook_info(_hook(session, tenant_id))


def delete_webhook(db: Database, tenant_id: str) -> int:
    """Remove the tenant's endpoint and fail its pending events (saying why); returns how many were failed. An
    event being sent at that moment may still arrive."""
    with db.session() as session:
        session.delete(_hook(session, tenant_id))
        result = session.execute(update(WebhookEvent).where(WebhookEvent.tenant_id == tenant_id,
                                                            WebhookEvent.state == "pending")
                                 .values(state="failed", last_error=REMOVED))
        return rowcount(result)


def list_events(db: Database, tenant_id: str, state: str | None = None, limit: int = 50) -> list[EventInfo]:
    """The tenant's events, newest first, optionally only those in `state`, at most `limit` (1 to
    MAX_EVENTS_LISTED)."""
    if state is not None and state not in STATES:
        raise WebhookError(f"state must be one of {', '.join(STATES)}, not {str(state)[:40]!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_EVENTS_LISTED:
        raise WebhookError(f"limit must be a whole number from 1 to {MAX_EVENTS_LISTED}")
    stmt = select(WebhookEvent).where(WebhookEvent.tenant_id == tenant_id)
    if state is not None:
        stmt = stmt.where(WebhookEvent.state == state)
    stmt = stmt.order_by(WebhookEvent.created_at.desc(), WebhookEvent.id.desc()).limit(limit)
    with db.session() as session:
        return [_event_info(row) for row in session.scalars(stmt)]


def queue_test_event(db: Database, tenant_id: str, clock: Callable[[], datetime] = utcnow) -> EventInfo:
    """Queue a `webhook.test` event for the tenant's endpoint (WebhookNotFound when it has none)."""
    now = clock()
    event_id = new_id("evt")
    payload = {"id": event_id, "type": "webhook.test", "tenant_id": tenant_id, "created_at": now.isoformat()}
    with db.session() as session:
        _hook(session, tenant_id)
        row = WebhookEvent(id=event_id, tenant_id=tenant_id, kind="webhook.test", dedupe_key=f"test:{event_id}",
                           payload=payload, state="pending", attempts=0, next_attempt_at=now, created_at=now)
        session.add(row)
        session.flush()
        return _event_info(row)


# -- delivery ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Claim:
    event_id: str
    tenant_id: str
    attempt: int  # the attempts count this claim set: the outcome is recorded only while it still holds
    url: str
    secret: str
    body: bytes


def _describe(exc: Exception, url: str) -> str:
    """A short reason for a failed try that names no secret: the URL's query, password and the URL itself are
    cut from the message."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    parts = urlsplit(url)
    for secret in sorted(filter(None, {url, parts.query, parts.password, parts.username}), key=len, reverse=True):
        text = text.replace(secret, "...")
    return text[:_ERROR_LENGTH]


@dataclass(frozen=True)
class DeliveryPolicy:
    """How the outbox is delivered. `poll_s`: the longest pause between passes (a pass also starts when the next
    event falls due, and at `wake()`); `timeout_s`: each POST's connect, write and read timeout; `max_attempts`
    tries per event, `retry_initial_s` doubling up to `retry_max_s` between them; `lease_s`: how long a claim
    keeps other processes off an event (None: 4 x timeout_s + 30 s, well past the longest try);
    `concurrency`: POSTs in flight at once; `batch`: events claimed per pass."""

    poll_s: float = 2.0
    timeout_s: float = 10.0
    max_attempts: int = 10
    retry_initial_s: float = 30.0
    retry_max_s: float = 3600.0
    lease_s: float | None = None
    concurrency: int = 4
    batch: int = 32

    def __post_init__(self) -> None:
        if min(self.max_attempts, self.concurrency, self.batch) < 1 or min(
                self.poll_s, self.timeout_s, self.retry_initial_s, self.retry_max_s, self.lease) <= 0:
            raise ValueError("webhook delivery needs max_attempts, concurrency and batch >= 1 and positive times")

    @property
    def lease(self) -> float:
        return self.lease_s if self.lease_s is not None else 4 * self.timeout_s + 30

    @classmethod
    def from_settings(cls, settings, **overrides) -> DeliveryPolicy:
        """The LORAMUX_WEBHOOK_* settings (`overrides` for the rest)."""
        return cls(poll_s=settings.webhook_poll_s, timeout_s=settings.webhook_timeout_s,
                   max_attempts=settings.webhook_max_attempts, retry_initial_s=settings.webhook_retry_initial_s,
                   retry_max_s=settings.webhook_retry_max_s, **overrides)


class WebhookDispatcher:
    """Delivers the outbox (see the module's docstring) as `policy` says, from a daemon thread started unless
    `start` is False (then call `run_once`). `clock`: the time of claims, outcomes and signatures (injectable
    for tests); `transport`: httpx's, for tests."""

    def __init__(self, db: Database, policy: DeliveryPolicy | None = None, *, clock: Callable[[], datetime] = utcnow,
                 transport: httpx.BaseTransport | None = None, start: bool = True):
        self.db, self.clock = db, clock
        self.policy = policy = policy if policy is not None else DeliveryPolicy()
        self._client = httpx.Client(timeout=policy.timeout_s, follow_redirects=False, transport=transport,
                                    headers={"User-Agent": USER_AGENT})
        self._pool = (ThreadPoolExecutor(policy.concurrency, thread_name_prefix="webhook-send")
                      if policy.concurrency > 1 else None)
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def from_settings(cls, db: Database, settings, **kwargs) -> WebhookDispatcher:
        """A started dispatcher with the LORAMUX_WEBHOOK_* settings."""
        return cls(db, DeliveryPolicy.from_settings(settings), **kwargs)

    def start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, daemon=True, name="webhook-dispatcher")
            self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the delivery thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Start a pass now (events just queued go out without waiting for the poll)."""
        self._wake.set()

    def close(self) -> None:
        """Stop: no new claims; requests in flight finish (within their timeout) and their outcome is recorded."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.policy.timeout_s + 10)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._client.close()

    def run_once(self) -> int:
        """One pass: claim the events due now (at most `batch`) and send them; returns how many were sent."""
        now = self.clock()
        with self.db.session() as session:
            due = session.scalars(select(WebhookEvent.id)
                                  .where(WebhookEvent.state == "pending", WebhookEvent.next_attempt_at <= now)
                                  .order_by(WebhookEvent.next_attempt_at, WebhookEvent.id)
                                  .limit(self.policy.batch)).all()
        claims = []
        for event_id in due:
            if self._stop.is_set():
                break
            claim = self._claim(event_id)
            if claim is not None:
                claims.append(claim)
        if self._pool is not None and len(claims) > 1:
            list(self._pool.map(self._send, claims))
        else:
            for claim in claims:
                self._send(claim)
        return len(claims)

    # -- internals ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            self._wake.clear()  # before the pass: a wake() during it starts the next one at once
            try:
                wait = 0.0 if self.run_once() >= self.policy.batch else self._idle_s()
                if failing:
                    log.warning("webhooks: delivery resumed")
                failing = False
            except Exception as exc:  # noqa: BLE001 - the database is down: try again at the next poll
                if not failing:
                    log.warning("webhooks: delivery paused, the outbox cannot be read: %s", exc)
                failing, wait = True, self.policy.poll_s
            if wait > 0 and not self._stop.is_set():
                self._wake.wait(wait)

    def _idle_s(self) -> float:
        """How long to wait for the next pass: until the next pending event is due, at most `poll_s`."""
        with self.db.session() as session:
            due = session.scalar(select(func.min(WebhookEvent.next_attempt_at)).where(WebhookEvent.state == "pending"))
        if due is None:
            return self.policy.poll_s
        return min(self.policy.poll_s, max((due - self.clock()).total_seconds(), 0.01))

    def _claim(self, event_id: str) -> _Claim | None:
        """Take the event if it is still pending and due: count the attempt and move it a lease ahead, which
        no other process's claim then matches. None when another process got it first, or when it cannot be
        sent (failed here, saying why)."""
        now = self.clock()
        with self.db.session() as session:
            claimed = session.execute(
                update(WebhookEvent)
                .where(WebhookEvent.id == event_id, WebhookEvent.state == "pending",
                       WebhookEvent.next_attempt_at <= now)
                .values(next_attempt_at=now + timedelta(seconds=self.policy.lease), attempts=WebhookEvent.attempts + 1)
                .execution_options(synchronize_session=False))
            if rowcount(claimed) != 1:
                return None
            event = session.get(WebhookEvent, event_id, populate_existing=True)
            if event is None:  # removed with its tenant meanwhile
                return None
            hook = session.get(Webhook, event.tenant_id)
            if hook is None:
                event.state, event.last_error = "failed", "the tenant has no webhook"
                return None
            if event.attempts > self.policy.max_attempts:  # the last try was cut short (the process stopped)
                event.state = "failed"
                event.last_error = f"gave up after {self.policy.max_attempts} attempts (the last one was cut short)"
                return None
            body = json.dumps(event.payload, separators=(",", ":"), ensure_ascii=False).encode()
            return _Claim(event.id, event.tenant_id, event.attempts, hook.url, hook.secret, body)

    def _send(self, claim: _Claim) -> None:
        status: int | None = None
        error: str | None = None
        try:
            headers = {"Content-Type": "application/json",
                       **signed_headers(claim.secret, claim.event_id, claim.body, int(self.clock().timestamp()))}
            with self._client.stream("POST", claim.url, content=claim.body, headers=headers) as response:
                status = response.status_code  # the body is not read: only the status counts
            if not 200 <= status < 300:
                error = f"HTTP {status}" + (" (redirects are not followed)" if 300 <= status < 400 else "")
        except httpx.TimeoutException:
            error = f"no answer within {self.policy.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure to send is one failed try
            error = _describe(exc, claim.url)
        try:
            self._record(claim, status, error)
        except Exception as exc:  # noqa: BLE001 - left claimed: tried again once the lease runs out
            log.warning("webhooks: the outcome of event %s could not be recorded: %s", claim.event_id, exc)

    def _record(self, claim: _Claim, status: int | None, error: str | None) -> None:
        now = self.clock()
        pending = update(WebhookEvent).where(WebhookEvent.id == claim.event_id, WebhookEvent.state == "pending")
        with self.db.session() as session:
            if error is None:  # delivered, whoever holds the claim now
                session.execute(pending.values(state="delivered", delivered_at=now, last_status=status,
                                               last_error=None))
                log.info("webhooks: event %s delivered to tenant %s (attempt %d)", claim.event_id, claim.tenant_id,
                         claim.attempt)
                return
            values: dict = {"last_status": status, "last_error": error[:_ERROR_LENGTH]}
            final = claim.attempt >= self.policy.max_attempts
            delay = retry_delay(claim.attempt, self.policy.retry_initial_s, self.policy.retry_max_s)
            if final:
                values["state"] = "failed"
            else:
                values["next_attempt_at"] = now + timedelta(seconds=delay)
            # Only while this claim holds: past its lease another process may have claimed (and counted) again.
            if rowcount(session.execute(pending.where(WebhookEvent.attempts == claim.attempt).values(**values))):
                if final:
                    log.warning("webhooks: event %s to tenant %s failed after %d attempts (%s)", claim.event_id,
                                claim.tenant_id, claim.attempt, error)
                else:
                    log.info("webhooks: event %s to tenant %s: attempt %d failed (%s); next in %g s", claim.event_id,
                             claim.tenant_id, claim.attempt, error, delay)
