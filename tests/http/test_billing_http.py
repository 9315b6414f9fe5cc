"""Ledger and billing end to end, on SQLite and PostgreSQL: 500 concurrent requests leave exactly 500
rows billed exactly, replays do not duplicate, prices apply by time, exports match the summary, and
rows still buffered at shutdown are written."""
from __future__ import annotations

import asyncio
import csv
import io
import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import httpx
import pyarrow.parquet as pq
import pytest
from sqlalchemy import func, select

from conftest import admin_client, live_stack, new_tenant_key
from loramux.db import LedgerEntry

ADMIN_KEY = "lmxa-billing-admin-key-0123456789abcdefghijklmnop"
PRICE = {"input_per_mtok": "0.15", "cached_input_per_mtok": "0.075", "output_per_mtok": "0.60"}


@pytest.fixture
def stack(database_url, tiny_dir, tokenizer, tmp_path):
    records = []
    with live_stack(tmp_path, tiny_dir, tokenizer, engine=dict(max_num_seqs=32), database_url=database_url,
                    admin_key=ADMIN_KEY, ledger_hooks=[records.append]) as server:
        yield server, records, database_url


@pytest.fixture
def admin(stack) -> Iterator[httpx.Client]:
    with admin_client(stack[0], ADMIN_KEY) as client:
        yield client


def set_price(admin: httpx.Client, effective_from: datetime, **price) -> dict:
    resp = admin.post("/admin/prices", json={**PRICE, **price, "effective_from": effective_from.isoformat()})
    assert resp.status_code == 201, resp.text
    return resp.json()


def expected_cost(prompt: int, completion: int, price: dict) -> Decimal:
    return (prompt * Decimal(price["input_per_mtok"]) + completion * Decimal(price["output_per_mtok"])) / 1_000_000


def ledger_rows(server) -> list[LedgerEntry]:
    with server.services.db.session() as s:
        return list(s.scalars(select(LedgerEntry).order_by(LedgerEntry.id)))


def test_500_concurrent_requests_leave_500_rows_billed_exactly(stack, admin):
    server, records, _ = stack
    set_price(admin, datetime(2026, 1, 1, tzinfo=timezone.utc))
    keys = [new_tenant_key(server.services, f"tenant-{i}", "premium") for i in range(5)]

    async def one(i: int):
        async with sem:
            resp = await client.post("/v1/completions", headers={"Authorization": f"Bearer {keys[i % 5]}"},
                                     json={"model": "base", "prompt": f"Request {i}: " + "word " * (i % 9),
                                           "max_tokens": 1 + i % 3, "temperature": 0, "ignore_eos": True})
            return resp

    async def burst():
        nonlocal client, sem
        sem = asyncio.Semaphore(500)
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=500)) as c:
            client = c
            return await asyncio.gather(*(one(i) for i in range(500)))

    client = sem = None
    responses = asyncio.run(burst())
    assert [r.status_code for r in responses].count(200) == 500, {r.status_code for r in responses}
    assert server.services.ledger.flush(30)
    rows = ledger_rows(server)
    assert len(rows) == 500 and len({r.request_id for r in rows}) == 500
    by_id = {r.request_id: r for r in rows}
    total = Decimal(0)
    for resp in responses:
        body = resp.json()
        row = by_id[body["id"]]
        usage = body["usage"]
        assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert row.cost == expected_cost(usage["prompt_tokens"], usage["completion_tokens"], PRICE)
        total += expected_cost(usage["prompt_tokens"], usage["completion_tokens"], PRICE)
    summary = admin.get("/admin/billing/summary").json()
    assert Decimal(summary["total"]["cost"]) == total and summary["total"]["requests"] == 500
    assert {t["tenant_id"] for t in summary["tenants"]} == {server.services.tenancy.tenant(f"tenant-{i}").id
                                                            for i in range(5)}
    # A replayed write (the same finished requests handed over again) adds nothing.
    for record in records[:50]:
        server.services.ledger.submit(record)
    assert server.services.ledger.flush(30)
    assert len(ledger_rows(server)) == 500


def test_each_request_is_billed_at_the_price_in_force_when_it_ran(stack, admin):
    server, _, _ = stack
    key = new_tenant_key(server.services, "acme", "standard")
    headers = {"Authorization": f"Bearer {key}"}
    old = set_price(admin, datetime.now(timezone.utc) - timedelta(days=30))

    def run(n):
        for i in range(n):
            r = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                           json={"model": "base", "prompt": f"hi {i}", "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200

    run(3)
    change = datetime.now(timezone.utc)
    new = set_price(admin, change, output_per_mtok="1.20", input_per_mtok="0.30")
    run(3)
    assert server.services.ledger.flush(30)
    rows = ledger_rows(server)
    assert len(rows) == 6
    for row in rows:
        price = old if row.created_at < change else new
        assert row.output_per_mtok == Decimal(price["output_per_mtok"])
        assert row.cost == expected_cost(row.prompt_tokens, row.completion_tokens, price)
    assert sum(1 for r in rows if r.created_at < change) == 3


def test_exports_parse_back_to_the_summary(stack, admin):
    server, _, _ = stack
    set_price(admin, datetime(2026, 1, 1, tzinfo=timezone.utc))
    for name in ("acme", "globex"):
        key = new_tenant_key(server.services, name, "standard")
        for i in range(3):
            httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "base", "prompt": f"{name} {i}", "max_tokens": 1 + i, "ignore_eos": True})
    summary = admin.get("/admin/billing/summary").json()
    expected = {t["tenant_id"]: Decimal(t["cost"]) for t in summary["tenants"]}
    assert len(expected) == 2 and summary["total"]["requests"] == 6

    def totals(rows) -> dict:
        out: dict = {}
        for row in rows:
            out[row["tenant_id"]] = out.get(row["tenant_id"], Decimal(0)) + Decimal(str(row["cost"]))
        return out

    as_csv = admin.get("/admin/billing/export", params={"format": "csv"})
    assert as_csv.headers["content-type"].startswith("text/csv")
    assert totals(csv.DictReader(io.StringIO(as_csv.text))) == expected
    as_jsonl = admin.get("/admin/billing/export", params={"format": "jsonl"}).text
    assert totals(json.loads(line) for line in as_jsonl.splitlines()) == expected
    table = pq.read_table(io.BytesIO(admin.get("/admin/billing/export", params={"format": "parquet"}).content))
    assert totals(table.to_pylist()) == expected and table.num_rows == 6
    one = list(expected)[0]
    filtered = admin.get("/admin/billing/export", params={"format": "jsonl", "tenant_id": one}).text.splitlines()
    assert len(filtered) == 3
    bad = admin.get("/admin/billing/summary", params={"start": "2026-13-45"})
    assert bad.status_code == 400
    assert admin.get("/admin/billing/export", params={"format": "xlsx"}).status_code == 422


def test_rows_buffered_at_shutdown_are_written(database_url, tiny_dir, tokenizer, tmp_path):
    with live_stack(tmp_path, tiny_dir, tokenizer, database_url=database_url) as server:
        key = new_tenant_key(server.services, "acme", "standard")
        for i in range(5):
            httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "base", "prompt": f"hi {i}", "max_tokens": 2})
        db = server.services.db
    # The server stopped without an explicit flush: its shutdown wrote what was buffered.
    from loramux.db import Database

    fresh = Database(database_url)
    with fresh.session() as s:
        assert s.scalar(select(func.count()).select_from(LedgerEntry)) == 5
    fresh.dispose()
    assert db is not None


def test_a_request_is_billed_at_its_arrival_not_its_finish(stack):
    """A price change while a long request runs does not apply to it: the row's created_at is when the
    request arrived (before its first chunk), not when it finished."""
    server, _, _ = stack
    key = new_tenant_key(server.services, "long-co", "premium")
    body = {"model": "base", "prompt": "Count:", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = datetime.now(timezone.utc)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as resp:
        lines = resp.iter_lines()
        next(lines)
        first_chunk = datetime.now(timezone.utc)
        request_id = resp.headers["x-request-id"]
        for _ in lines:
            pass
    finished = datetime.now(timezone.utc)
    assert server.services.ledger.flush(30)
    (row,) = [r for r in ledger_rows(server) if r.request_id == request_id]
    assert finished - first_chunk > timedelta(milliseconds=50)  # the request ran on after its first chunk
    assert sent <= row.created_at <= first_chunk
