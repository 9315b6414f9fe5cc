"""Budget gauges on /metrics (`loramux_budget_{limit,spent,reserved}_usd`), on SQLite and PostgreSQL: read from
the budgets at most once per cache period, left out (not failing the scrape) when the database fails, and only
behind a metrics key: an open /metrics never names a tenant's users or tags."""
from __future__ import annotations

import logging
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import OperationalError

from conftest import live_stack
from loramux.billing.budgets import BudgetBook
from loramux.billing.ledger import write_records
from loramux.billing.pricing import PriceInfo
from loramux.billing.usage import RequestRecord
from loramux.server.serving.metrics import ServerMetrics
from loramux.tenancy.tenants import Tenancy

NOW = datetime(2026, 3, 4, 12, 0, tzinfo=timezone.utc)
PRICE = PriceInfo(1, "smol", None, None, Decimal("0.15"), Decimal("0.075"), Decimal("0.6"),
                  datetime(2020, 1, 1, tzinfo=timezone.utc))
GAUGES = ("loramux_budget_limit_usd", "loramux_budget_spent_usd", "loramux_budget_reserved_usd")
METRICS_KEY = "budget-metrics-scrape-key-0123456789"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def parsed(body: str) -> dict[tuple[str, str, str, str], float]:
    """(gauge, tenant, scope, subject) -> value, of the budget gauges in a scrape's text."""
    return {(s.name, s.labels["tenant"], s.labels["scope"], s.labels["subject"]): s.value
            for family in text_string_to_metric_families(body) if family.name in GAUGES for s in family.samples}


def samples(metrics: ServerMetrics) -> dict[tuple[str, str, str, str], float]:
    return parsed(metrics.render()[0].decode())


def record(n: int, tenant: str, tags: list[str] | None = None) -> RequestRecord:
    return RequestRecord(request_id=f"req-{n}", tenant_id=tenant, key_id="key_1", tier="standard", model="smol",
                         adapter_id=None, adapter_version=None, adapter_digest=None, requested="smol", fallback=False,
                         outcome="stop", prompt_tokens=1000, cached_tokens=0, completion_tokens=10, queue_ms=1.0,
                         ttft_ms=2.0, total_ms=3.0, created_at=NOW, tags=tags)


@pytest.fixture
def book(database):
    return BudgetBook(database, holder="test-holder", clock=lambda: NOW)


def test_budget_gauges_show_limit_spent_and_reserved_read_once_per_cache_period(database, book):
    tenancy = Tenancy(database)
    acme = tenancy.ensure_tenant("acme")[0].id
    globex = tenancy.ensure_tenant("globex")[0].id
    write_records(database, [record(1, acme, ["batch"]), record(2, acme)], [PRICE])  # $0.000156 each
    book.put(acme, "tenant", "", "100.50", "month")
    tag = book.put(acme, "tag", "batch", "5", "day")[0].budget
    book.put(globex, "user", "alice@example.com", "7", "week", hard=False)
    book.reserve("req-3", [tag], [Decimal("0.25"), Decimal("0.125")])
    reads = []

    def statuses():
        reads.append(1)
        return book.statuses()

    clock = Clock()
    metrics = ServerMetrics()
    metrics.set_budget_source(statuses, ttl_s=5.0, clock=clock)
    seen = samples(metrics)
    assert seen == {
        ("loramux_budget_limit_usd", acme, "tag", "batch"): 5.0,
        ("loramux_budget_spent_usd", acme, "tag", "batch"): 0.000156,
        ("loramux_budget_reserved_usd", acme, "tag", "batch"): 0.375,
        ("loramux_budget_limit_usd", acme, "tenant", ""): 100.5,
        ("loramux_budget_spent_usd", acme, "tenant", ""): 0.000312,
        ("loramux_budget_reserved_usd", acme, "tenant", ""): 0.0,
        ("loramux_budget_limit_usd", globex, "user", "alice@example.com"): 7.0,
        ("loramux_budget_spent_usd", globex, "user", "alice@example.com"): 0.0,
        ("loramux_budget_reserved_usd", globex, "user", "alice@example.com"): 0.0,
    }
    assert len(reads) == 1
    # Within the cache period a scrape reuses the last read, even after a change...
    book.put(acme, "tenant", "", "200", "month")
    clock.now += 4.9
    metrics.refresh_budgets()
    assert samples(metrics)[("loramux_budget_limit_usd", acme, "tenant", "")] == 100.5 and len(reads) == 1
    # ...and the first scrape after it reads the budgets again, once.
    clock.now += 0.2
    assert samples(metrics)[("loramux_budget_limit_usd", acme, "tenant", "")] == 200.0 and len(reads) == 2
    book.delete(globex, "user", "alice@example.com")
    clock.now += 5.0
    assert {k[1:] for k in samples(metrics)} == {(acme, "tag", "batch"), (acme, "tenant", "")}


def test_a_database_error_leaves_the_budget_gauges_out_of_the_scrape(book, database, caplog):
    acme = Tenancy(database).ensure_tenant("acme")[0].id
    book.put(acme, "tenant", "", "10", "day")
    calls = []

    def failing():
        calls.append(1)
        raise OperationalError("SELECT budgets", {}, ConnectionRefusedError("connection refused"))

    clock = Clock()
    metrics = ServerMetrics()
    metrics.set_budget_source(failing, ttl_s=5.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="loramux.server.serving.metrics"):
        body = metrics.render()[0].decode()
    assert "loramux_budget" not in body and "loramux_requests_total" in body  # the rest of the scrape is served
    assert "reading budgets for /metrics failed" in caplog.text
    metrics.render()
    assert len(calls) == 1  # a failing database is not asked again before the cache period is over
    clock.now += 5.0
    metrics.set_budget_source(book.statuses, ttl_s=5.0, clock=clock)
    assert samples(metrics) == {(g, acme, "tenant", ""): v for g, v in zip(GAUGES, (10.0, 0.0, 0.0))}
    metrics.set_budget_source(None)
    assert "loramux_budget" not in metrics.render()[0].decode()


@pytest.mark.parametrize("metrics_key", [METRICS_KEY, ""])
def test_budget_gauges_are_on_metrics_only_behind_the_metrics_key(tiny_dir, tokenizer, tmp_path, metrics_key):
    with live_stack(tmp_path, tiny_dir, tokenizer, client=True, metrics_key=metrics_key) as client:
        services = client.app.state.services
        acme = services.tenancy.ensure_tenant("acme")[0].id
        services.budgets.put(acme, "tag", "nightly-batch", "12.5", "week")
        services.budgets.put(acme, "user", "alice@example.com", "3", "day")
        headers = {"Authorization": f"Bearer {METRICS_KEY}"} if metrics_key else {}
        resp = client.get("/metrics", headers=headers)
        assert resp.status_code == 200 and "loramux_requests_total" in resp.text
        if not metrics_key:  # not even a HELP line: an open /metrics names no tenant, user or tag
            assert "loramux_budget" not in resp.text and acme not in resp.text and "nightly-batch" not in resp.text
            return
        assert parsed(resp.text) == {
            ("loramux_budget_limit_usd", acme, "tag", "nightly-batch"): 12.5,
            ("loramux_budget_spent_usd", acme, "tag", "nightly-batch"): 0.0,
            ("loramux_budget_reserved_usd", acme, "tag", "nightly-batch"): 0.0,
            ("loramux_budget_limit_usd", acme, "user", "alice@example.com"): 3.0,
            ("loramux_budget_spent_usd", acme, "user", "alice@example.com"): 0.0,
            ("loramux_budget_reserved_usd", acme, "user", "alice@example.com"): 0.0,
        }
