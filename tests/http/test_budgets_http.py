"""Budgets end to end, on SQLite and PostgreSQL: the admin API, reservations that never let the ledger pass a
hard limit under 200 concurrent requests, the 402's fields, tags / users / keys, the cost and remaining budget
in every answer, and a period reset at `resets_at` (an injected clock)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import httpx
import pytest
from sqlalchemy import select

from conftest import admin_client, live_stack, new_tenant_key
from loramux.billing.money import sum_money
from loramux.db import BudgetHold, LedgerEntry
from polling import wait_until

ADMIN_KEY = "lmxa-budgets-admin-key-0123456789abcdefghijklmnopq"
# $10 per 1M input tokens, $100 per 1M output tokens: a 20-token prompt with 8 tokens out costs about $0.001.
PRICE = {"input_per_mtok": "10", "cached_input_per_mtok": "5", "output_per_mtok": "100"}


@pytest.fixture
def stack(database_url, tiny_dir, tokenizer, tmp_path):
    with live_stack(tmp_path, tiny_dir, tokenizer, engine=dict(max_num_seqs=32), database_url=database_url,
                    admin_key=ADMIN_KEY) as server:
        yield server


@pytest.fixture
def admin(stack) -> Iterator[httpx.Client]:
    with admin_client(stack, ADMIN_KEY) as client:
        resp = client.post("/admin/prices", json={**PRICE, "effective_from": "2026-01-01T00:00:00+00:00"})
        assert resp.status_code == 201, resp.text
        yield client


def cost(prompt: int, completion: int) -> Decimal:
    return (prompt * Decimal(PRICE["input_per_mtok"]) + completion * Decimal(PRICE["output_per_mtok"])) / 1_000_000


def ledger(server) -> list[LedgerEntry]:
    assert server.services.ledger.flush(30)
    with server.services.db.session() as s:
        return list(s.scalars(select(LedgerEntry).order_by(LedgerEntry.id)))


def holds(server) -> int:
    with server.services.db.session() as s:
        return len(s.scalars(select(BudgetHold)).all())


def complete(server, key: str, max_tokens: int = 8, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **extra.pop("headers", {})}
    return httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=120,
                      json={"model": "base", "prompt": "one two three four five six seven", "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0, **extra})


def test_admin_api_sets_reads_and_removes_budgets_with_clear_errors(stack, admin):
    services = stack.services
    new_tenant_key(services, "acme")
    tenant = services.tenancy.tenant("acme")
    key = services.tenancy.list_keys(tenant.id)[0]
    body = {"limit_usd": "500.00", "period": "month", "hard": True, "alert_at": [0.5, 0.8, 1.0]}
    made = admin.put("/admin/tenants/acme/budget", json=body)
    assert made.status_code == 201, made.text
    got = made.json()
    assert got["limit_usd"] == "500.00" and got["spent_usd"] == "0.00" and got["reserved_usd"] == "0.00"
    assert got["remaining_usd"] == "500.00" and got["alert_at"] == ["0.5", "0.8", "1"]
    start = datetime.fromisoformat(got["period_start"])
    assert start.day == 1 and start.hour == 0 and datetime.fromisoformat(got["resets_at"]) > start
    assert admin.put(f"/admin/tenants/{tenant.id}/budget", json={**body, "limit_usd": "20"}).status_code == 200
    assert admin.get("/admin/tenants/acme/budget").json()["limit_usd"] == "20.00"
    for path in (f"keys/{key.id}", "users/alice@example.com", "tags/team-a"):
        assert admin.put(f"/admin/tenants/acme/{path}/budget", json={"limit_usd": "1.5", "period": "day"}
                         ).status_code == 201
        assert admin.get(f"/admin/tenants/acme/{path}/budget").json()["period"] == "day"
    slashed = admin.put("/admin/tenants/acme/users/team%2Falice/budget", json={"limit_usd": "1", "period": "day"})
    assert slashed.status_code == 201 and slashed.json()["subject"] == "team/alice"  # a user id may hold a '/'
    assert admin.delete("/admin/tenants/acme/users/team/alice/budget").status_code == 204
    listed = admin.get("/admin/tenants/acme/budgets").json()["budgets"]
    assert sorted(b["scope"] for b in listed) == ["key", "tag", "tenant", "user"]
    assert admin.delete("/admin/tenants/acme/tags/team-a/budget").status_code == 204
    assert admin.get("/admin/tenants/acme/tags/team-a/budget").status_code == 404
    # What to fix, said plainly.
    errors = {
        "float": admin.put("/admin/tenants/acme/budget", json={"limit_usd": 5.5, "period": "day"}),
        "negative": admin.put("/admin/tenants/acme/budget", json={"limit_usd": "-1", "period": "day"}),
        "period": admin.put("/admin/tenants/acme/budget", json={"limit_usd": "1", "period": "year"}),
        "alerts": admin.put("/admin/tenants/acme/budget", json={"limit_usd": "1", "period": "day", "alert_at": [0]}),
        "tag": admin.put("/admin/tenants/acme/tags/bad tag!/budget", json={"limit_usd": "1", "period": "day"}),
    }
    for name, resp in errors.items():
        assert resp.status_code in (400, 422), (name, resp.text)
    assert errors["period"].json()["error"]["code"] == "invalid_budget" and "month" in errors["period"].text
    assert admin.put("/admin/tenants/nobody/budget", json={"limit_usd": "1", "period": "day"}).status_code == 404
    assert admin.put("/admin/tenants/acme/keys/key_nope/budget",
                     json={"limit_usd": "1", "period": "day"}).status_code == 404
    assert admin.get("/admin/tenants/acme/keys/key_nope/budget").status_code == 404


def test_200_concurrent_requests_never_spend_past_a_hard_budget(stack, admin):
    """The acceptance run: $0.05 on a tenant, 200 requests of about $0.001 worst case from 50 clients."""
    server = stack
    key = new_tenant_key(server.services, "acme", "premium")
    assert admin.put("/admin/tenants/acme/budget", json={"limit_usd": "0.05", "period": "month"}).status_code == 201

    async def client_run(client: httpx.AsyncClient, c: int) -> list[httpx.Response]:
        answers = []
        for i in range(4):
            answers.append(await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
                "model": "base", "prompt": f"client {c} request {i}: " + "word " * (c % 7), "max_tokens": 8,
                "ignore_eos": True, "temperature": 0}))
        return answers

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=60)) as client:
            return [r for rs in await asyncio.gather(*(client_run(client, c) for c in range(50))) for r in rs]

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 402]
    assert len(ok) + len(refused) == 200, {r.status_code for r in responses}
    for resp in refused:
        error = resp.json()["error"]
        assert error["code"] == "budget_exceeded" and error["scope"] == "tenant" and error["param"] == "max_tokens"
        assert Decimal(error["remaining_usd"]) < Decimal(error["needed_usd"])  # refused only when it could not fit
        assert error["limit_usd"] == "0.05" and error["resets_at"] and "max_tokens" in error["message"]
    rows = ledger(server)
    assert sorted(r.request_id for r in rows) == sorted(r.json()["id"] for r in ok)  # each billed exactly once
    spent = sum((r.cost for r in rows), Decimal(0))
    assert spent <= Decimal("0.05")
    assert spent >= Decimal("0.04"), spent  # at least 80 % used
    for resp in ok:
        usage, ext = resp.json()["usage"], resp.json()["loramux"]
        assert Decimal(ext["cost"]) == cost(usage["prompt_tokens"], usage["completion_tokens"])
        assert ext["budgets"][0]["scope"] == "tenant" and "X-Loramux-Budget-Remaining" in resp.headers
    status = admin.get("/admin/tenants/acme/budget").json()
    assert Decimal(status["spent_usd"]) == spent and status["reserved_usd"] == "0.00"
    assert holds(server) == 0


def test_a_request_that_cannot_fit_is_refused_with_what_to_change_and_nothing_is_billed(stack, admin):
    server = stack
    key = new_tenant_key(server.services, "acme")
    assert admin.put("/admin/tenants/acme/budget", json={"limit_usd": "0.0005", "period": "day"}).status_code == 201
    big = complete(server, key, max_tokens=16)  # worst case ~ $0.0017
    assert big.status_code == 402, big.text
    error = big.json()["error"]
    assert error["remaining_usd"] == "0.0005" and Decimal(error["needed_usd"]) > Decimal("0.0005")
    assert "max_tokens" in error["message"] and error["type"] == "insufficient_quota"
    small = complete(server, key, max_tokens=2)  # fits: the lever the error names
    assert small.status_code == 200, small.text
    ext = small.json()["loramux"]
    assert Decimal(ext["cost"]) > 0
    assert Decimal(small.headers["X-Loramux-Budget-Remaining"]) == Decimal("0.0005") - Decimal(ext["cost"])
    rows = ledger(server)
    assert [r.request_id for r in rows] == [small.json()["id"]]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'loramux_requests_total{outcome="budget_exceeded",tier="standard"} 1.0' in metrics
    assert holds(server) == 0
    # A soft budget only watches: it never refuses.
    assert admin.put("/admin/tenants/acme/budget", json={"limit_usd": "0.0001", "period": "day", "hard": False}
                     ).status_code == 200
    assert complete(server, key, max_tokens=16).status_code == 200


def test_key_user_and_tag_budgets_apply_only_to_their_requests(stack, admin):
    server = stack
    key_a = new_tenant_key(server.services, "acme")
    key_b = new_tenant_key(server.services, "acme")
    tenant = server.services.tenancy.tenant("acme")
    key_a_id = next(k.id for k in server.services.tenancy.list_keys(tenant.id) if key_a.startswith(k.prefix))
    tiny = {"limit_usd": "0.0002", "period": "week"}
    assert admin.put(f"/admin/tenants/acme/keys/{key_a_id}/budget", json=tiny).status_code == 201
    assert admin.put("/admin/tenants/acme/users/alice/budget", json=tiny).status_code == 201
    assert admin.put("/admin/tenants/acme/tags/batch/budget", json=tiny).status_code == 201
    refused = {
        "key": complete(server, key_a),
        "user": complete(server, key_b, user="alice"),
        "header tag": complete(server, key_b, headers={"X-Loramux-Tags": "web, batch"}),
        "metadata tag": complete(server, key_b, metadata={"tags": ["batch"]}),
    }
    for what, resp in refused.items():
        assert resp.status_code == 402, (what, resp.text)
    assert {r.json()["error"]["scope"] for r in refused.values()} == {"key", "user", "tag"}
    served = complete(server, key_b, user="bob", headers={"X-Loramux-Tags": "web"}, metadata={"tags": "eu,web"})
    assert served.status_code == 200, served.text
    [row] = ledger(server)
    assert row.tags == ["web", "eu"] and row.end_user == "bob"
    bad = complete(server, key_b, headers={"X-Loramux-Tags": "ok, not ok!"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_tags"
    assert "X-Loramux-Tags" in bad.json()["error"]["message"]
    assert complete(server, key_b, metadata={"tags": [1, 2]}).status_code == 400
    assert complete(server, key_b, metadata={f"k{i}": "v" for i in range(17)}).status_code == 400
    assert holds(server) == 0


def test_a_period_reset_frees_the_budget_at_resets_at(stack, admin):
    server = stack
    key = new_tenant_key(server.services, "acme")
    book = server.services.budgets
    now = [datetime(2026, 12, 6, 23, 59, 0, tzinfo=timezone.utc)]
    book.clock = lambda: now[0]
    made = admin.put("/admin/tenants/acme/budget", json={"limit_usd": "0.0012", "period": "day"}).json()
    assert made["resets_at"] == "2026-12-07T00:00:00+00:00"
    assert complete(server, key).status_code == 200
    wait_until(lambda: holds(server) == 0 and ledger(server), what="the first request's ledger row")
    refused = complete(server, key)
    assert refused.status_code == 402 and refused.json()["error"]["resets_at"] == "2026-12-07T00:00:00+00:00"
    # The new day (a request counts in the period of its arrival: a few seconds in): the budget is whole again.
    now[0] = datetime(2026, 12, 7, 0, 0, 5, tzinfo=timezone.utc)
    again = complete(server, key)
    assert again.status_code == 200, again.text
    ledger(server)
    status = admin.get("/admin/tenants/acme/budget").json()
    assert status["period_start"] == "2026-12-07T00:00:00+00:00"
    assert Decimal(status["spent_usd"]) == Decimal(again.json()["loramux"]["cost"])
    with server.services.db.session() as s:
        total = sum_money(s, LedgerEntry.cost)
    assert total == Decimal(again.json()["loramux"]["cost"]) * 2
    now[0] += timedelta(days=1)
    assert admin.get("/admin/tenants/acme/budget").json()["spent_usd"] == "0.00"


def test_choices_fanouts_and_streams_reserve_their_worst_case_and_say_what_they_cost(stack, admin, tiny_cfg, tmp_path):
    from loramux.testing import write_peft_adapter

    server = stack
    key = new_tenant_key(server.services, "acme", "premium")
    tenant = server.services.tenancy.tenant("acme")
    directory = write_peft_adapter(tmp_path / "ad1", tiny_cfg, 4, ["q_proj", "v_proj"], seed=1)
    server.services.registry.register(tenant.id, "ad1", {f: directory / f for f in
                                                         ("adapter_config.json", "adapter_model.safetensors")})
    assert admin.put("/admin/tenants/acme/budget", json={"limit_usd": "0.0005", "period": "month"}).status_code == 201
    # n choices reserve n x max_tokens of output: 3 x 2 tokens here, over what is left.
    three = complete(server, key, max_tokens=2, n=3)
    assert three.status_code == 402
    prompt = len(server.services.engine.tokenizer.encode("one two three four five six seven"))
    assert Decimal(three.json()["error"]["needed_usd"]) == cost(prompt, 6)
    assert admin.put("/admin/tenants/acme/budget", json={"limit_usd": "1", "period": "month"}).status_code == 200
    answer = complete(server, key, max_tokens=2, n=3)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    assert Decimal(answer.json()["loramux"]["cost"]) == cost(usage["prompt_tokens"], usage["completion_tokens"])
    # A fan-out holds one reservation per part, each replaced by its own row.
    fanout = complete(server, key, max_tokens=3, models=["base", "ad1"])
    assert fanout.status_code == 200, fanout.text
    rows = [r for r in ledger(server) if r.request_id == fanout.json()["id"]]
    assert sorted(r.part for r in rows) == [0, 1]
    assert Decimal(fanout.json()["loramux"]["cost"]) == sum((r.cost for r in rows), Decimal(0))
    # A stream: the header as of admission (its whole reservation held), the cost in the final usage chunk.
    before = Decimal(admin.get("/admin/tenants/acme/budget").json()["remaining_usd"])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      timeout=120, json={"model": "base", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 4, "ignore_eos": True, "stream": True,
                                         "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        held = before - Decimal(resp.headers["X-Loramux-Budget-Remaining"])
        chunks = [line for line in resp.iter_lines() if line.startswith("data: {")]
    import json

    last = [event for event in map(lambda c: json.loads(c[6:]), chunks) if "loramux" in event][-1]
    spent = Decimal(last["loramux"]["cost"])
    assert spent == cost(last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]) and held >= spent > 0
    assert Decimal(last["loramux"]["budgets"][0]["remaining_usd"]) == before - spent
    ledger(server)
    wait_until(lambda: holds(server) == 0, "every reservation to be replaced by its row")
    status = admin.get("/admin/tenants/acme/budget").json()
    with server.services.db.session() as s:
        assert Decimal(status["spent_usd"]) == sum_money(s, LedgerEntry.cost)


@pytest.mark.parametrize("fail_mode", ["closed", "open"])
def test_a_database_outage_refuses_budgeted_tenants_or_serves_them_unreserved(stack, admin, fail_mode, monkeypatch):
    from sqlalchemy.exc import OperationalError

    server = stack
    key = new_tenant_key(server.services, "acme")
    other = new_tenant_key(server.services, "free-spirit")
    assert admin.put("/admin/tenants/acme/budget", json={"limit_usd": "1", "period": "month"}).status_code == 201
    for warm in (key, other):  # keys and the budget list cached, as on a busy server
        assert complete(server, warm, max_tokens=1).status_code == 200
    book = server.services.budgets
    monkeypatch.setattr(server.services.settings, "budget_fail_mode", fail_mode)

    def down():
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(book.db, "session", down)
    budgeted = complete(server, key, max_tokens=2)
    if fail_mode == "closed":
        assert budgeted.status_code == 503 and budgeted.json()["error"]["code"] == "budgets_unavailable"
        assert "Retry-After" in budgeted.headers
    else:
        assert budgeted.status_code == 200 and "budgets" not in budgeted.json()["loramux"]
    assert complete(server, other, max_tokens=2).status_code == 200  # no budget: not affected
