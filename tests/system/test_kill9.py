"""Billing survives kill -9: a real server (its own process) under 64 concurrent streaming clients across
tenants and adapters is SIGKILLed mid-load and started again on the same database and data dir. Every
request whose client received the final usage chunk has exactly one ledger row, and the rows' tokens are
what the clients were told. The budgets those requests reserved against end with no reservation left and
their spend equal to the ledger. On SQLite and PostgreSQL."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from loramux.billing.budgets import BudgetBook
from loramux.billing.pricing import PriceBook
from loramux.child_python import python_command
from loramux.db import BudgetHold, Database, LedgerEntry
from loramux.model.loader import read_model_config
from loramux.names import base_model_id
from loramux.tenancy.tenants import Tenancy
from loramux.testing import free_port, write_peft_adapter
from polling import wait_until

CLIENTS = 64
KILL_AFTER = 96  # completed (billed) requests before the kill
TENANTS = ("kill-a", "kill-b", "kill-c")
MODELS = ("base", "alpha", "beta")


def start_server(env: dict, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(python_command("-m", "loramux.cli", "serve", "--port", str(port)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, "the server to become ready", 120, poll_s=0.1)
    except BaseException:
        proc.kill()
        raise
    return proc


@pytest.fixture
def model_dir(tiny_dir, tokenizer, tmp_path) -> Path:
    """The tiny model with its tokenizer beside it, as `loramux serve --model` reads it."""
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    tokenizer.save_pretrained(path)
    return path


async def run_clients(url: str, keys: list[str], done: list[dict], stop: asyncio.Event) -> None:
    """64 streaming clients; each finished request (final usage chunk received) is appended to `done`."""
    async def client(k: int) -> None:
        headers = {"Authorization": f"Bearer {keys[k % len(keys)]}"}
        headers["X-Loramux-Tags"] = "load"
        body = {"model": MODELS[k % len(MODELS)], "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": 12 + k % 8, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"client {k} says hello"}]}
        async with httpx.AsyncClient(timeout=30) as http:
            while not stop.is_set():
                try:
                    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                        usage = None
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                event = json.loads(line[6:])
                                if event.get("usage") and not event.get("choices"):
                                    usage = event["usage"]  # the final usage chunk
                        if r.status_code == 200 and usage is not None:
                            done.append({"id": r.headers["x-request-id"], **usage})
                            if len(done) >= KILL_AFTER:
                                stop.set()
                except (httpx.HTTPError, json.JSONDecodeError):
                    if stop.is_set():
                        return
                    # The server is gone: retry shortly, until told to stop.
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.05)

    await asyncio.gather(*(client(k) for k in range(CLIENTS)))


def test_every_answered_request_is_billed_exactly_once_after_kill_9(database_url, model_dir, tmp_path):
    cfg, _ = read_model_config(model_dir)
    adapters = {name: write_peft_adapter(tmp_path / name, cfg, 4, ["q_proj", "v_proj"], seed=i)
                for i, name in enumerate(("alpha", "beta"))}
    db = Database(database_url)
    db.upgrade()
    tenancy = Tenancy(db)
    keys = []
    for name in TENANTS:
        tenancy.create_tenant(name, tier="premium")
        keys.append(tenancy.create_key(name)[1])
    # Budgets far above what the load spends: every request reserves, none is refused.
    PriceBook(db).set_price(base_model_id(str(model_dir)), "10", "5", "100",
                            effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc))
    book = BudgetBook(db, "the test")
    budgets = [(tenancy.tenant(name).id, "tenant", "") for name in TENANTS]
    budgets.append((tenancy.tenant("kill-b").id, "tag", "load"))
    for tenant_id, scope, subject in budgets:
        book.put(tenant_id, scope, subject, "1000", "month")
    env = {**os.environ, "LORAMUX_MODEL": str(model_dir), "LORAMUX_DATA_DIR": str(tmp_path / "data"),
           "LORAMUX_DATABASE_URL": database_url, "LORAMUX_JSON_LOGS": "false", "LORAMUX_MAX_LORAS": "2",
           "LORAMUX_MAX_LORA_RANK": "8", "LORAMUX_MAX_MODEL_LEN": "256", "LORAMUX_KV_CACHE_BYTES": str(64 << 20),
           "LORAMUX_ADAPTERS": ",".join(f"{n}={p}" for n, p in adapters.items()), "PYTHONUNBUFFERED": "1"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(env, port)
    done: list[dict] = []

    async def load_then_kill() -> None:
        stop = asyncio.Event()
        clients = asyncio.ensure_future(run_clients(url, keys, done, stop))
        await stop.wait()
        os.killpg(server.pid, signal.SIGKILL)  # mid-load: 64 streams are in flight
        await clients

    try:
        asyncio.run(load_then_kill())
        assert server.wait(timeout=30) == -signal.SIGKILL
        answered = list(done)
        assert len(answered) >= KILL_AFTER
        restarted = start_server(env, port)  # same database, same data dir: the ledger's log is replayed
        # The replay drops the reservations of the requests it bills; the rest (never answered) go after it.
        wait_until(lambda: _holds(db) == 0, "the reservations the kill left to be dropped", 60,
                   detail=lambda: f"{_holds(db)} left")
        restarted.send_signal(signal.SIGTERM)  # a clean shutdown writes every replayed row
        restarted.wait(timeout=60)  # uvicorn re-raises SIGTERM after its graceful shutdown
        log = restarted.stderr.read().decode()
        assert "Application shutdown complete" in log, log[-2000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)

    ids = [a["id"] for a in answered]
    assert len(set(ids)) == len(ids)
    with db.session() as s:
        counts = dict(s.execute(select(LedgerEntry.request_id, func.count()).where(LedgerEntry.request_id.in_(ids))
                                .group_by(LedgerEntry.request_id)).all())
        rows = {e.request_id: e for e in s.scalars(select(LedgerEntry).where(LedgerEntry.request_id.in_(ids)))}
    missing = [i for i in ids if i not in counts]
    assert missing == [], f"{len(missing)} answered requests have no ledger row"
    assert set(counts.values()) == {1}
    for a in answered:
        row = rows[a["id"]]
        assert (row.prompt_tokens, row.completion_tokens) == (a["prompt_tokens"], a["completion_tokens"])
        assert row.cached_tokens == a["prompt_tokens_details"]["cached_tokens"]
    assert sum(r.completion_tokens for r in rows.values()) == sum(a["completion_tokens"] for a in answered)
    for tenant_id, scope, subject in budgets:
        status = book.status(tenant_id, scope, subject)
        with db.session() as s:
            ledger = [(r.cost, r.tags) for r in s.scalars(select(LedgerEntry)
                                                           .where(LedgerEntry.tenant_id == tenant_id))]
        assert status.reserved == 0
        assert status.spent == sum((c for c, tags in ledger if scope == "tenant" or subject in (tags or ())),
                                   Decimal(0)) > 0
    db.dispose()


def _holds(db: Database) -> int:
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(BudgetHold)) or 0
