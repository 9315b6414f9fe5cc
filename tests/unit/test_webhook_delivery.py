"""Alert webhooks without the engine, on SQLite and PostgreSQL: signatures, URL checks, and delivery of the outbox
to a real local HTTP receiver: each threshold crossing arrives exactly once through an outage, a dispatcher
restart and a claim cut short; a dead endpoint ends failed; two dispatchers never send one event at once.
(Named apart from tests/http/test_webhooks.py: test modules share one import namespace.)"""
from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from loramux.billing import webhooks as hooks
from loramux.billing.budgets import BudgetBook
from loramux.billing.ledger import write_records
from loramux.billing.pricing import PriceInfo
from loramux.billing.usage import RequestRecord
from loramux.billing.webhook_delivery import DeliveryPolicy, WebhookDispatcher, retry_delay
from loramux.billing.webhook_signing import (
    EVENT_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    signed_headers,
    verify_signature,
)
from loramux.billing.webhooks import WebhookError, WebhookNotFound, check_url
from loramux.db import Database, Webhook, WebhookEvent
from loramux.db.models import utcnow
from loramux.settings import Settings
from loramux.tenancy.tenants import Tenancy
from polling import wait_until

MODEL = "smol"
# 0.10 USD per completion token: a request of n tokens spends n x 0.10 of a 1.00 budget.
PRICE = PriceInfo(1, MODEL, None, None, Decimal(0), Decimal(0), Decimal(100_000),
                  datetime(2020, 1, 1, tzinfo=timezone.utc))
FAST = dict(poll_s=0.05, timeout_s=5.0, retry_initial_s=0.02, retry_max_s=0.1)


def policy(**overrides) -> DeliveryPolicy:
    """Quick polls and retries, for tests."""
    return DeliveryPolicy(**{**FAST, **overrides})


# --- the receiver: a real HTTP endpoint on 127.0.0.1 ----------------------------------------------------
@dataclass
class Post:
    event_id: str | None
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered
    verified: bool | None  # the signature checked with the receiver's secret (None: no secret set yet)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that gave up (a timeout under test) leaves a broken pipe: not news


class Receiver:
    """A webhook endpoint (http.server in a thread on 127.0.0.1) that records every POST and checks its signature
    with `secret`. It answers `status` (settable while running); `hold`, while set, makes each POST wait
    until `release()`; `stop()` takes it down (connections refused) and `start()` brings it back on the same
    port."""

    def __init__(self, status: int = 200, secret: str | None = None):
        self.status, self.secret = status, secret
        self.posts: list[Post] = []
        self.arrived = 0  # POSTs that reached the handler (counted before any hold)
        self.hold = False
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/loramux"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.arrived += 1
                    hold = receiver.hold
                if hold:
                    receiver._gate.wait(30)
                with receiver._lock:
                    status, secret = receiver.status, receiver.secret
                    verified = None if secret is None else verify_signature(secret, body, self.headers)
                    receiver.posts.append(Post(self.headers.get(EVENT_ID_HEADER), dict(self.headers.items()), body,
                                               status, verified))
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", f"http://127.0.0.1:{receiver.port}/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        server = _QuietServer(("127.0.0.1", self.port), Handler)
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def release(self) -> None:
        self._gate.set()

    def delivered(self) -> Counter:
        """Event id -> POSTs of it answered with a 2xx."""
        with self._lock:
            return Counter(p.event_id for p in self.posts if 200 <= p.status < 300)

    def tries(self, event_id: str) -> int:
        with self._lock:
            return sum(p.event_id == event_id for p in self.posts)


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.release()
    server.stop()


# --- events, made as the ledger makes them --------------------------------------------------------------
def budgeted_tenant(db: Database, name: str = "acme", alert_at=("0.5", "0.8", "1")) -> tuple[str, BudgetBook]:
    """A tenant with a soft 1.00 USD monthly budget alerting at `alert_at`; returns (tenant id, its book)."""
    tenant = Tenancy(db).create_tenant(name)
    book = BudgetBook(db, holder="test")
    book.put(tenant.id, "tenant", "", "1.00", "month", hard=False, alert_at=list(alert_at))
    return tenant.id, book


def spend(db: Database, book: BudgetBook, tenant_id: str, request_id: str, tokens: int) -> None:
    """Bill a request of `tokens` completion tokens (0.10 USD each) that reserved against the tenant's budgets."""
    book.reserve(request_id, book.budgets_for(tenant_id), [Decimal("0.1") * tokens])
    record = RequestRecord(request_id=request_id, tenant_id=tenant_id, key_id="key_1", tier="standard", model=MODEL,
                           adapter_id=None, adapter_version=None, adapter_digest=None, requested=MODEL,
                           fallback=False, outcome="stop", prompt_tokens=0, cached_tokens=0,
                           completion_tokens=tokens, queue_ms=1.0, ttft_ms=None, total_ms=2.0)
    assert write_records(db, [record], prices=[PRICE]) == (1, 0)


def events(db: Database, tenant_id: str | None = None) -> list[WebhookEvent]:
    with db.session() as session:
        stmt = select(WebhookEvent).order_by(WebhookEvent.created_at, WebhookEvent.id)
        if tenant_id is not None:
            stmt = stmt.where(WebhookEvent.tenant_id == tenant_id)
        return list(session.scalars(stmt))


def three_crossings(db: Database, url: str) -> tuple[str, str, list[WebhookEvent]]:
    """A tenant with a webhook at `url` whose spend crosses 0.5, 0.8 and 1 of its budget in three requests;
    returns (tenant id, the webhook's secret, the three events)."""
    tenant_id, book = budgeted_tenant(db)
    hook, created = hooks.put_webhook(db, tenant_id, url)
    assert created and hook.secret
    for i, tokens in enumerate((6, 3, 2)):  # 0.60, 0.90, 1.10
        spend(db, book, tenant_id, f"req-{tenant_id}-{i}", tokens)
    queued = events(db, tenant_id)
    assert [e.payload["threshold"] for e in queued] == ["0.5", "0.8", "1"]
    return tenant_id, hook.secret, queued


def states(db: Database) -> dict[str, str]:
    return {e.id: e.state for e in events(db)}


# --- pure ---------------------------------------------------------------------------------------------
def test_signatures_verify_with_the_secret_only_and_within_the_tolerance():
    body = b'{"id":"evt_1","type":"budget.threshold"}'
    headers = signed_headers("whsec_right", "evt_1", body, timestamp=1_000_000)
    assert headers[EVENT_ID_HEADER] == "evt_1" and headers[TIMESTAMP_HEADER] == "1000000"
    assert headers[SIGNATURE_HEADER].startswith("v1=") and len(headers[SIGNATURE_HEADER]) == 3 + 64
    assert verify_signature("whsec_right", body, headers, now=1_000_000)
    assert verify_signature("whsec_right", body.decode(), {k.lower(): v for k, v in headers.items()}, now=1_000_100)
    assert not verify_signature("whsec_wrong", body, headers, now=1_000_000)
    assert not verify_signature("whsec_right", body + b" ", headers, now=1_000_000)  # the body was altered
    assert not verify_signature("whsec_right", body, headers, now=1_000_301)  # too old: a replay
    assert verify_signature("whsec_right", body, headers, tolerance_s=400, now=1_000_301)
    assert not verify_signature("whsec_right", body, headers, now=999_699)  # from the future
    forged = {**headers, TIMESTAMP_HEADER: "1000200"}  # a fresh timestamp on an old signature
    assert not verify_signature("whsec_right", body, forged, now=1_000_200)
    several = {**headers, SIGNATURE_HEADER: "v1=00," + headers[SIGNATURE_HEADER]}
    assert verify_signature("whsec_right", body, several, now=1_000_000)
    for broken in ({}, {**headers, TIMESTAMP_HEADER: "soon"}, {**headers, SIGNATURE_HEADER: ""},
                   {k: v for k, v in headers.items() if k != SIGNATURE_HEADER}):
        assert not verify_signature("whsec_right", body, broken, now=1_000_000)


def test_retry_delay_doubles_from_the_initial_delay_up_to_the_cap():
    assert [retry_delay(n, 30, 3600) for n in range(1, 10)] == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600]
    assert retry_delay(10_000, 0.5, 7.0) == 7.0


def test_the_delivery_policy_comes_from_the_settings(monkeypatch):
    monkeypatch.setenv("LORAMUX_WEBHOOK_MAX_ATTEMPTS", "4")
    monkeypatch.setenv("LORAMUX_WEBHOOK_RETRY_INITIAL_S", "1.5")
    settled = DeliveryPolicy.from_settings(Settings())
    assert (settled.max_attempts, settled.retry_initial_s, settled.retry_max_s) == (4, 1.5, 3600.0)
    assert (settled.poll_s, settled.timeout_s, settled.lease) == (2.0, 10.0, 70.0)
    for bad in ({"max_attempts": 0}, {"timeout_s": 0}, {"lease_s": 0}):
        with pytest.raises(ValueError, match="webhook delivery needs"):
            DeliveryPolicy(**bad)
    with pytest.raises(ValidationError, match="webhook_timeout_s"):
        Settings(webhook_timeout_s=0)


@pytest.mark.parametrize("url, message", [
    ("", "url is required"),
    ("ftp://example.com/hook", "must start with http:// or https://, not ftp://"),
    ("example.com/hook", "must start with http:// or https://, not no scheme"),
    ("https://", "needs a host"),
    ("https:///path", "needs a host"),
    ("https://exa mple.com/", "spaces or control characters"),
    ("https://example.com:99999/", "not a valid address"),
    ("https://example.com/" + "a" * 2000, "at most 2000"),
])
def test_bad_urls_are_refused_saying_what_to_fix(url, message):
    with pytest.raises(WebhookError, match=message):
        check_url(url)


def test_good_urls_are_kept():
    assert check_url("  https://hooks.example.com:8443/loramux?team=a  ") == "https://hooks.example.com:8443/loramux?team=a"
    assert check_url("http://127.0.0.1:9000/x") == "http://127.0.0.1:9000/x"


# --- the endpoint's data ------------------------------------------------------------------------------
def test_a_webhook_is_set_replaced_rotated_and_removed(database):
    tenant_id = Tenancy(database).create_tenant("acme").id
    with pytest.raises(WebhookNotFound, match="has no webhook"):
        hooks.get_webhook(database, tenant_id)
    with pytest.raises(WebhookNotFound, match="no tenant"):
        hooks.put_webhook(database, "tn_nobody", "https://example.com/h")
    with pytest.raises(WebhookNotFound, match="has no webhook"):
        hooks.queue_test_event(database, tenant_id)
    created, new = hooks.put_webhook(database, tenant_id, "https://example.com/a")
    assert new and created.secret.startswith("whsec_") and len(created.secret) == 6 + 64
    replaced, new = hooks.put_webhook(database, tenant_id, "https://example.com/b")
    assert not new and replaced.secret is None and replaced.url == "https://example.com/b"
    assert replaced.created_at == created.created_at and replaced.updated_at >= created.updated_at
    rotated, _ = hooks.put_webhook(database, tenant_id, "https://example.com/b", rotate_secret=True)
    assert rotated.secret.startswith("whsec_") and rotated.secret != created.secret
    shown = hooks.get_webhook(database, tenant_id)
    assert shown.secret is None and "secret" not in shown.as_dict() and shown.url == "https://example.com/b"
    with database.session() as session:
        assert session.get(Webhook, tenant_id).secret == rotated.secret
    with pytest.raises(WebhookError, match="https://"):
        hooks.put_webhook(database, tenant_id, "gopher://example.com")
    test = hooks.queue_test_event(database, tenant_id)
    assert test.kind == "webhook.test" and test.state == "pending" and test.payload["id"] == test.id
    assert [e.id for e in hooks.list_events(database, tenant_id, "pending")] == [test.id]
    assert hooks.list_events(database, tenant_id, "delivered") == []
    for state, limit, message in (("sent", 10, "state must be one of"), (None, 0, "limit"), (None, 501, "limit")):
        with pytest.raises(WebhookError, match=message):
            hooks.list_events(database, tenant_id, state, limit)
    assert hooks.delete_webhook(database, tenant_id) == 1
    (failed,) = hooks.list_events(database, tenant_id)
    assert failed.state == "failed" and failed.last_error == hooks.REMOVED and failed.next_attempt_at is None
    with pytest.raises(WebhookNotFound):
        hooks.delete_webhook(database, tenant_id)


def test_events_are_listed_newest_first_and_limited(database):
    tenant_id = Tenancy(database).create_tenant("acme").id
    hooks.put_webhook(database, tenant_id, "https://example.com/a")
    queued = [hooks.queue_test_event(database, tenant_id).id for _ in range(4)]
    assert [e.id for e in hooks.list_events(database, tenant_id, limit=3)] == queued[::-1][:3]


# --- delivery -----------------------------------------------------------------------------------------
def test_each_threshold_crossing_is_delivered_once_through_an_outage(database, receiver):
    receiver.status = 503
    tenant_id, secret, queued = three_crossings(database, receiver.url)
    receiver.secret = secret
    ids = {e.id for e in queued}
    dispatcher = WebhookDispatcher(database, policy(max_attempts=1000))
    try:
        # The receiver answers 503: every event is retried, its status and attempts recorded.
        wait_until(lambda: all(e.attempts >= 2 and e.last_status == 503 and e.last_error == "HTTP 503"
                               for e in events(database)), "two refused tries of each event",
                   detail=lambda: [(e.attempts, e.last_status) for e in events(database)])
        receiver.stop()  # then it is down: connections are refused
        wait_until(lambda: all(e.last_status is None and e.last_error and "Connect" in e.last_error
                               for e in events(database)), "refused connections recorded",
                   detail=lambda: [(e.attempts, e.last_error) for e in events(database)])
        receiver.status = 200
        receiver.start()
        wait_until(lambda: set(states(database).values()) == {"delivered"}, "every event delivered",
                   detail=lambda: states(database))
    finally:
        dispatcher.close()
    assert receiver.delivered() == Counter({event_id: 1 for event_id in ids})
    assert all(p.verified for p in receiver.posts) and len(receiver.posts) >= 6
    for event in events(database):
        assert event.delivered_at is not None and event.last_status == 200 and event.last_error is None
        assert event.attempts >= receiver.tries(event.id)  # refused connections are tries the receiver never saw
    delivered = {p.event_id: p for p in receiver.posts if p.status == 200}
    for event in queued:
        post = delivered[event.id]
        payload = json.loads(post.body)
        assert payload == event.payload and payload["type"] == "budget.threshold"
        assert payload["tenant_id"] == tenant_id and payload["budget"]["limit_usd"] == "1.00"
        assert post.headers["Content-Type"] == "application/json"
        assert post.headers["User-Agent"].startswith("loramux-webhooks/")
    assert sorted(json.loads(delivered[e].body)["spent_usd"] for e in ids) == ["0.60", "0.90", "1.10"]


def test_a_restart_between_attempts_delivers_the_pending_event_once(database_url, receiver):
    db = Database(database_url)
    db.upgrade()
    receiver.status = 503
    tenant_id, secret, queued = three_crossings(db, receiver.url)
    receiver.secret = secret
    first = WebhookDispatcher(db, policy(max_attempts=1000))
    wait_until(lambda: all(e.attempts >= 1 and e.last_status == 503 for e in events(db)), "a refused try of each")
    first.close()
    tried = {e.id: e.attempts for e in events(db)}
    assert set(states(db).values()) == {"pending"}
    db.dispose()
    receiver.status = 200
    # A new process: its own database handle, dispatcher and clock, the same database.
    db = Database(database_url)
    second = WebhookDispatcher(db, policy(max_attempts=1000))
    try:
        wait_until(lambda: set(states(db).values()) == {"delivered"}, "every event delivered after the restart",
                   detail=lambda: states(db))
    finally:
        second.close()
        db.dispose()
    assert receiver.delivered() == Counter({e.id: 1 for e in queued})
    assert all(p.verified for p in receiver.posts)
    assert all(receiver.tries(event_id) == attempts + 1 for event_id, attempts in tried.items())


def test_a_permanently_failing_endpoint_ends_failed_after_max_attempts(database, receiver):
    receiver.status = 500
    tenant_id = Tenancy(database).create_tenant("acme").id
    receiver.secret = hooks.put_webhook(database, tenant_id, receiver.url)[0].secret
    event = hooks.queue_test_event(database, tenant_id)
    dispatcher = WebhookDispatcher(database, policy(max_attempts=3))
    try:
        dispatcher.wake()
        wait_until(lambda: hooks.list_events(database, tenant_id)[0].state == "failed", "the event failed")
        assert dispatcher.run_once() == 0
    finally:
        dispatcher.close()
    (failed,) = hooks.list_events(database, tenant_id)
    assert (failed.attempts, failed.last_status, failed.last_error) == (3, 500, "HTTP 500")
    assert failed.next_attempt_at is None and failed.delivered_at is None
    assert receiver.tries(event.id) == 3 and all(p.verified for p in receiver.posts)


def test_two_dispatchers_never_send_one_event_at_the_same_time(database_url, receiver):
    db_a, db_b = Database(database_url), Database(database_url)
    db_a.upgrade()
    tenant_id = Tenancy(db_a).create_tenant("acme").id
    receiver.secret = hooks.put_webhook(db_a, tenant_id, receiver.url)[0].secret
    event = hooks.queue_test_event(db_a, tenant_id)
    a = WebhookDispatcher(db_a, policy(), start=False)
    b = WebhookDispatcher(db_b, policy(), start=False)
    receiver.hold = True
    sent: list[int] = []
    sending = threading.Thread(target=lambda: sent.append(a.run_once()))
    sending.start()
    try:
        wait_until(lambda: receiver.arrived == 1, "dispatcher A's POST at the receiver")
        assert b.run_once() == 0  # claimed by A: B leaves it alone
    finally:
        receiver.release()
        sending.join(30)
    assert sent == [1] and b.run_once() == 0
    assert hooks.list_events(db_b, tenant_id)[0].state == "delivered"
    assert receiver.tries(event.id) == 1 and receiver.delivered() == Counter({event.id: 1})
    for d, db in ((a, db_a), (b, db_b)):
        d.close()
        db.dispose()


def test_replicas_sharing_the_database_send_each_event_once(database_url, receiver):
    dbs = [Database(database_url) for _ in range(3)]
    dbs[0].upgrade()
    tenant_id = Tenancy(dbs[0]).create_tenant("acme").id
    receiver.secret = hooks.put_webhook(dbs[0], tenant_id, receiver.url)[0].secret
    queued = {hooks.queue_test_event(dbs[0], tenant_id).id for _ in range(30)}
    replicas = [WebhookDispatcher(db, policy(batch=4)) for db in dbs]
    try:
        wait_until(lambda: len(hooks.list_events(dbs[0], tenant_id, "delivered", limit=500)) == 30,
                   "every event delivered")
    finally:
        for replica in replicas:
            replica.close()
        for db in dbs:
            db.dispose()
    assert receiver.delivered() == Counter({event_id: 1 for event_id in queued})
    assert len(receiver.posts) == 30 and all(p.verified for p in receiver.posts)


def test_a_claim_cut_short_is_taken_again_once_its_lease_ends(database, receiver):
    """A process that stops after its claim (kill -9 mid-POST) leaves the event leased: another sends it once the
    lease runs out, and an event whose last try was the one cut short ends failed."""
    tenant_id = Tenancy(database).create_tenant("acme").id
    receiver.secret = hooks.put_webhook(database, tenant_id, receiver.url)[0].secret
    event = hooks.queue_test_event(database, tenant_id)
    crashed = WebhookDispatcher(database, policy(lease_s=0.3), start=False)
    assert crashed._claim(event.id) is not None  # claimed, never sent
    other = WebhookDispatcher(database, policy(), start=False)
    assert other.run_once() == 0  # leased
    wait_until(other.run_once, "the lease to end and the event to go out")
    (delivered,) = hooks.list_events(database, tenant_id)
    assert (delivered.state, delivered.attempts) == ("delivered", 2)
    assert receiver.delivered() == Counter({event.id: 1})

    last = hooks.queue_test_event(database, tenant_id)
    short = WebhookDispatcher(database, policy(lease_s=0.3, max_attempts=1), start=False)
    assert short._claim(last.id) is not None

    def given_up() -> bool:
        short.run_once()
        return not hooks.list_events(database, tenant_id, "pending")

    wait_until(given_up, "the cut-short last attempt to be given up")
    failed = hooks.list_events(database, tenant_id, "failed")[0]
    assert failed.id == last.id and failed.attempts == 2 and "gave up after 1 attempts" in failed.last_error
    assert receiver.tries(last.id) == 0
    for d in (crashed, other, short):
        d.close()


def test_redirects_timeouts_and_lost_webhooks_are_failed_tries_that_name_no_secret(database, receiver):
    tenant_id = Tenancy(database).create_tenant("acme").id
    hooks.put_webhook(database, tenant_id, receiver.url)
    dispatcher = WebhookDispatcher(database, policy(max_attempts=5, timeout_s=0.3), start=False)
    receiver.status = 302
    redirected = hooks.queue_test_event(database, tenant_id)
    assert dispatcher.run_once() == 1
    (event,) = hooks.list_events(database, tenant_id)
    assert (event.state, event.last_status) == ("pending", 302)
    assert event.last_error == "HTTP 302 (redirects are not followed)"
    assert receiver.arrived == 1  # the Location was not followed
    with database.session() as session:
        session.execute(update(WebhookEvent).where(WebhookEvent.id == redirected.id).values(state="delivered"))

    receiver.hold = True  # the receiver takes longer than the timeout
    slow = hooks.queue_test_event(database, tenant_id)
    assert dispatcher.run_once() == 1
    receiver.hold = False
    receiver.release()
    event = next(e for e in hooks.list_events(database, tenant_id) if e.id == slow.id)
    assert event.last_status is None and event.last_error == "no answer within 0.3 s" and event.attempts == 1

    # A URL whose query holds a token, on a closed port: the reason names neither.
    closed = Receiver()
    closed.stop()
    token = "s3cr3t-token-value"
    hooks.put_webhook(database, tenant_id, f"http://user:pw-{token}@127.0.0.1:{closed.port}/h?token={token}")
    with database.session() as session:
        session.execute(update(WebhookEvent).where(WebhookEvent.id == slow.id).values(next_attempt_at=utcnow()))
    assert dispatcher.run_once() == 1
    event = next(e for e in hooks.list_events(database, tenant_id) if e.id == slow.id)
    assert event.last_error and "Connect" in event.last_error and token not in event.last_error
    assert "pw-" not in event.last_error and event.attempts == 2

    # The webhook row gone (removed outside the admin API): its pending event fails, saying why.
    with database.session() as session:
        session.execute(update(WebhookEvent).where(WebhookEvent.id == slow.id).values(next_attempt_at=utcnow()))
        session.delete(session.get(Webhook, tenant_id))
    assert dispatcher.run_once() == 0
    event = next(e for e in hooks.list_events(database, tenant_id) if e.id == slow.id)
    assert (event.state, event.last_error) == ("failed", "the tenant has no webhook")
    dispatcher.close()
