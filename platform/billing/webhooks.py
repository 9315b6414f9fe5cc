"""Alert webhooks: each tenant's endpoint (table webhooks) and the events of its outbox (table
webhook_events): set, read and remove the endpoint, list the events, queue a test event (torch-free, no
HTTP-framework types). Delivery is `loramux.billing.webhook_delivery`; signatures
`loramux.billing.webhook_signing`."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from loramux.billing.webhook_signing import new_secret
from loramux.db import Database
from loramux.db.database import rowcount
from loramux.db.models import Tenant, Webhook, WebhookEvent, new_id, utcnow

STATES = ("pending", "delivered", "failed")
MAX_URL_LENGTH: int = Webhook.__table__.c.url.type.length  # type: ignore[attr-defined]
MAX_EVENTS_LISTED = 500
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

