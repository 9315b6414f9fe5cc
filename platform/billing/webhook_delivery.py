"""Alert webhook delivery: the outbox (table webhook_events, filled by `loramux.billing.budgets` in the
transactions whose ledger rows cross a budget threshold) POSTed to each tenant's endpoint (torch-free, no
HTTP-framework types).

Delivery is at least once:
- `WebhookDispatcher` (a daemon thread) polls the due events (state pending, `next_attempt_at` reached) and
  claims each one with a conditional UPDATE that moves its `next_attempt_at` a lease ahead and counts the
  attempt: only one UPDATE matches, on SQLite and PostgreSQL alike, so processes sharing the database never send
  the same event at the same time.
- It POSTs the event's payload as JSON to the tenant's URL (read at each try: a new URL or secret applies to
  the retries of events already queued), signed (`loramux.billing.webhook_signing`), and records the outcome:
  a 2xx marks the event delivered; anything else (another status, a redirect, which is never followed, a
  timeout, a refused connection) puts the next try `retry_delay` ahead (`DeliveryPolicy`: doubling from
  `retry_initial_s`, at most `retry_max_s`); after `max_attempts` tries the event is failed.
- A process that stops between the receiver's 2xx and the commit of that outcome (kill -9, a lost database)
  leaves the event claimed: once its lease runs out it is sent again. Receivers dedupe by event id (the
  `X-Loramux-Event-Id` header, the payload's `id`).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

import httpx
from sqlalchemy import func, select, update

from loramux.billing.webhook_signing import signed_headers
from loramux.db import Database
from loramux.db.database import rowcount
from loramux.db.models import Webhook, WebhookEvent, utcnow

log = logging.getLogger(__name__)

USER_AGENT = "loramux-webhooks/1"
_ERROR_LENGTH = 200


def retry_delay(attempts: int, initial_s: float, max_s: float) -> float:
    """Seconds from the `attempts`-th failed try to the next: `initial_s`, doubling with each try, at most
    `max_s`."""
    return min(max_s, initial_s * 2.0 ** min(max(attempts - 1, 0), 60))



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
