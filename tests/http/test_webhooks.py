"""Alert webhooks through the server, on SQLite and PostgreSQL: the admin API (set, replace, rotate, read, test,
list events, remove, and its 400 / 404 answers), and budget threshold crossings that reach a real local
receiver exactly once, signed, across a receiver outage (503s, then down) and a server restart between tries."""
from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from test_webhook_delivery import Receiver

from conftest import admin_client, live_stack
from loramux.billing.ledger import write_records
from loramux.billing.usage import RequestRecord
from loramux.billing.webhook_signing import verify_signature
from polling import wait_until

ADMIN_KEY = "lmxa-webhooks-admin-key-0123456789abcdefghijklmnop"
MODEL = "smol"
FAST = dict(webhook_poll_s=0.05, webhook_timeout_s=5.0, webhook_retry_initial_s=0.02, webhook_retry_max_s=0.1,
            webhook_max_attempts=1000)


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.release()
    server.stop()


def serve(tmp_path, tiny_dir, tokenizer, database_url, **settings):
    return live_stack(tmp_path, tiny_dir, tokenizer, database_url=database_url, admin_key=ADMIN_KEY,
                      **{**FAST, **settings})


def events(admin, tenant: str = "acme", **query) -> list[dict]:
    resp = admin.get(f"/admin/tenants/{tenant}/webhook/events", params={"limit": 500, **query})
    assert resp.status_code == 200, resp.text
    return resp.json()["events"]


def refused(resp, status: int, code: str, words: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and words in error["message"], error


def test_admin_api_manages_a_tenants_webhook_with_clear_errors(database_url, tiny_dir, tokenizer, tmp_path, receiver):
    with serve(tmp_path, tiny_dir, tokenizer, database_url) as server, admin_client(server, ADMIN_KEY) as admin:
        tenant = server.services.tenancy.create_tenant("acme")
        base = "/admin/tenants/acme/webhook"
        for method, path in (("PUT", "/admin/tenants/nobody/webhook"), ("GET", "/admin/tenants/nobody/webhook"),
                             ("DELETE", "/admin/tenants/nobody/webhook"),
                             ("GET", "/admin/tenants/nobody/webhook/events"),
                             ("POST", "/admin/tenants/nobody/webhook/test")):
            resp = admin.request(method, path, json={"url": receiver.url} if method == "PUT" else None)
            refused(resp, 404, "tenant_not_found", "nobody")
        refused(admin.get(base), 404, "webhook_not_found", "has no webhook")
        refused(admin.post(f"{base}/test"), 404, "webhook_not_found", "has no webhook")
        refused(admin.delete(base), 404, "webhook_not_found", "has no webhook")
        for url, words in (("ftp://example.com/h", "must start with http:// or https://"),
                           ("https:///h", "needs a host"), ("", "url is required"),
                           ("https://example.com/" + "x" * 2000, "at most 2000")):
            refused(admin.put(base, json={"url": url}), 400, "invalid_webhook", words)
        assert admin.put(base, json={}).status_code == 422
        assert admin.get(base).status_code == 404  # nothing was stored by the refusals

        made = admin.put(base, json={"url": receiver.url})
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
        assert secret.startswith("whsec_") and made.json()["url"] == receiver.url
        receiver.secret = secret
        again = admin.put(f"/admin/tenants/{tenant.id}/webhook", json={"url": receiver.url})  # by id
        assert again.status_code == 200 and "secret" not in again.json()
        shown = admin.get(base).json()
        assert set(shown) == {"tenant_id", "url", "created_at", "updated_at"} and shown["tenant_id"] == tenant.id

        test = admin.post(f"{base}/test")
        assert test.status_code == 202 and test.json()["kind"] == "webhook.test"
        first = test.json()["id"]
        wait_until(lambda: [e["id"] for e in events(admin, state="delivered")] == [first], "the test event delivered")
        assert receiver.delivered() == Counter({first: 1}) and receiver.posts[0].verified
        assert json.loads(receiver.posts[0].body) == {"id": first, "type": "webhook.test", "tenant_id": tenant.id,
                                                      "created_at": test.json()["created_at"]}

        # Rotating the secret: the next event is signed with the new one only.
        rotated = admin.put(base, json={"url": receiver.url, "rotate_secret": True})
        assert rotated.status_code == 200 and rotated.json()["secret"] not in (None, secret)
        second = admin.post(f"{base}/test").json()["id"]
        wait_until(lambda: receiver.delivered()[second] == 1, "the second test event")
        post = next(p for p in receiver.posts if p.event_id == second)
        assert post.verified is False and verify_signature(rotated.json()["secret"], post.body, post.headers)

        listed = events(admin)
        assert [e["id"] for e in listed] == [second, first]  # newest first
        assert set(listed[0]) == {"id", "kind", "state", "attempts", "last_status", "last_error", "created_at",
                                  "next_attempt_at", "delivered_at", "payload"}
        assert listed[0]["state"] == "delivered" and listed[0]["attempts"] == 1 and listed[0]["last_status"] == 200
        assert listed[0]["delivered_at"] and listed[0]["next_attempt_at"] is None
        assert [e["id"] for e in events(admin, limit=1)] == [second]
        refused(admin.get(f"{base}/events", params={"state": "sent"}), 400, "invalid_webhook", "state must be one of")
        refused(admin.get(f"{base}/events", params={"limit": 0}), 400, "invalid_webhook", "limit")

        # Removing the webhook fails what is still pending, saying why.
        receiver.status = 503
        third = admin.post(f"{base}/test").json()["id"]
        wait_until(lambda: events(admin, state="pending") and events(admin, state="pending")[0]["last_status"] == 503,
                   "a refused try of the third event")
        assert admin.delete(base).status_code == 204
        failed = events(admin, state="failed")
        assert [e["id"] for e in failed] == [third] and "webhook was removed" in failed[0]["last_error"]
        refused(admin.get(base), 404, "webhook_not_found", "has no webhook")
        assert receiver.delivered()[third] == 0


def spend(services, tenant_id: str, request_id: str, tokens: int) -> None:
    """A billed request of `tokens` completion tokens (0.10 USD each) that reserved against the tenant's budgets,
    written as the ledger writes it."""
    services.budgets.reserve(request_id, services.budgets.budgets_for(tenant_id), [Decimal("0.1") * tokens])
    record = RequestRecord(request_id=request_id, tenant_id=tenant_id, key_id="key_1", tier="standard", model=MODEL,
                           adapter_id=None, adapter_version=None, adapter_digest=None, requested=MODEL,
                           fallback=False, outcome="stop", prompt_tokens=0, cached_tokens=0,
                           completion_tokens=tokens, queue_ms=1.0, ttft_ms=None, total_ms=2.0)
    assert write_records(services.db, [record]) == (1, 0)


def test_threshold_alerts_arrive_once_across_an_outage_and_a_server_restart(database_url, tiny_dir, tokenizer,
                                                                            tmp_path, receiver):
    receiver.status = 503
    with serve(tmp_path, tiny_dir, tokenizer, database_url) as server, admin_client(server, ADMIN_KEY) as admin:
        services = server.services
        tenant = services.tenancy.create_tenant("acme")
        made = admin.put("/admin/tenants/acme/webhook", json={"url": receiver.url})
        assert made.status_code == 201, made.text
        receiver.secret = made.json()["secret"]
        services.prices.set_price(MODEL, "0", "0", "100000", effective_from=datetime(2020, 1, 1, tzinfo=timezone.utc))
        services.budgets.put(tenant.id, "tenant", "", "1.00", "month", hard=False, alert_at=["0.5", "0.8", "1"])
        for i, tokens in enumerate((6, 3, 2)):  # 0.60, 0.90, 1.10 of 1.00
            spend(services, tenant.id, f"req-{i}", tokens)
        # The receiver answers 503, then goes down: every event is retried, the outcome of each try recorded.
        wait_until(lambda: len(events(admin)) == 3 and all(e["attempts"] >= 2 and e["last_status"] == 503
                                                           for e in events(admin)), "refused tries of each event",
                   detail=lambda: events(admin))
        receiver.stop()
        wait_until(lambda: all(e["last_status"] is None and "Connect" in (e["last_error"] or "")
                               for e in events(admin)), "refused connections recorded", detail=lambda: events(admin))
        ids = {e["id"] for e in events(admin, state="pending")}
        assert len(ids) == 3
        dispatcher = services.webhooks
    assert dispatcher is not None and not dispatcher.running  # stopped by Services.shutdown

    receiver.status = 200
    receiver.start()
    with serve(tmp_path, tiny_dir, tokenizer, database_url) as server, admin_client(server, ADMIN_KEY) as admin:
        wait_until(lambda: {e["id"] for e in events(admin, state="delivered")} == ids,
                   "every event delivered after the restart", detail=lambda: events(admin))
        delivered = events(admin)
    assert receiver.delivered() == Counter({event_id: 1 for event_id in ids})
    assert all(p.verified for p in receiver.posts)
    bodies = [json.loads(p.body) for p in receiver.posts if p.status == 200]
    assert sorted((b["threshold"], b["spent_usd"]) for b in bodies) == [("0.5", "0.60"), ("0.8", "0.90"),
                                                                        ("1", "1.10")]
    assert all(b["type"] == "budget.threshold" and b["budget"]["scope"] == "tenant" for b in bodies)
    assert all(e["attempts"] >= 4 and e["last_status"] == 200 and e["last_error"] is None for e in delivered)
