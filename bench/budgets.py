"""Budgets: what a reservation adds to a request, and how many admissions one budget takes per second when many
clients race for it (they are serialized by its row lock).

- one client: reservations back to back against three budgets that apply (the tenant's, its key's, a tag's),
  each then replaced by its ledger row as the ledger writer does it (a batch of `--batch` rows); p50 / p99 ms of
  `BudgetBook.reserve` beside the cached lookup a tenant without budgets pays (`budgets_for`);
- `--threads` clients racing for one tenant budget: admissions per second (reserve, then release);
- the ledger's batch of `--batch` rows with their holds vs the same batch without any: what charging the
  budgets (`book_spend`) adds to a batch commit, as a ratio.

Median over `--rounds` rounds. SQLite in a temporary directory by default (`--database-url` names a PostgreSQL
server: the bench works in a scratch database it creates and drops). Prints the CPU model and flags, and ends
with FIGURE budget_reserve_p50_ms, budget_admissions_per_s and budget_ledger_batch_ratio. The default takes
under a minute; `--smoke` (what the tests run) one short round.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

from ledger_durability import scratch_database

from loramux.billing.budgets import BudgetBook
from loramux.billing.ledger import write_records
from loramux.billing.pricing import PriceBook
from loramux.billing.usage import RequestRecord
from loramux.db import Database
from loramux.tenancy.tenants import Tenancy
from loramux.testing import describe_cpu, percentile

WORST = Decimal("0.00125")


def record(rid: str, tenant_id: str, key_id: str) -> RequestRecord:
    return RequestRecord(request_id=rid, tenant_id=tenant_id, key_id=key_id, tier="standard", model="smol",
                         adapter_id=None, adapter_version=None, adapter_digest=None, requested="base", fallback=False,
                         outcome="length", prompt_tokens=412, cached_tokens=128, completion_tokens=96, queue_ms=3.0,
                         ttft_ms=40.0, total_ms=800.0, created_at=datetime.now(timezone.utc), tags=["batch"])


def one_client(book: BudgetBook, db: Database, tenant_id: str, key_id: str, n: int, batch: int,
               prefix: str) -> tuple[list[float], list[float]]:
    """ms per reservation (3 budgets) and per cached budget lookup; the rows are written batch by batch."""
    reserve_ms, lookup_ms, pending = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        budgets = [b for b in book.budgets_for(tenant_id) if b.applies(key_id, None, ["batch"])]
        t1 = time.perf_counter()
        book.reserve(f"{prefix}-{i}", budgets, [WORST])
        t2 = time.perf_counter()
        lookup_ms.append((t1 - t0) * 1000)
        reserve_ms.append((t2 - t1) * 1000)
        pending.append(record(f"{prefix}-{i}", tenant_id, key_id))
        if len(pending) == batch:
            write_records(db, pending)
            pending = []
    write_records(db, pending)
    return reserve_ms, lookup_ms


def racing(book: BudgetBook, tenant_id: str, threads: int, seconds: float, prefix: str) -> float:
    """Admissions per second of `threads` clients reserving against the tenant budget (each releases its own)."""
    budgets = [b for b in book.budgets_for(tenant_id) if b.scope == "tenant"]
    counts = [0] * threads
    stop = threading.Event()

    def worker(k: int) -> None:
        i = 0
        while not stop.is_set():
            rid = f"{prefix}-{k}-{i}"
            book.reserve(rid, budgets, [WORST])
            book.release(rid)
            counts[k] += 1
            i += 1

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def batch_ratio(book: BudgetBook, db: Database, tenant_id: str, key_id: str, batch: int, prefix: str) -> float:
    """Commit time of a ledger batch whose rows hold reservations (3 budgets each), over one whose rows hold none."""
    budgets = [b for b in book.budgets_for(tenant_id) if b.applies(key_id, None, ["batch"])]
    held = [record(f"{prefix}-h{i}", tenant_id, key_id) for i in range(batch)]
    for r in held:
        book.reserve(r.request_id, budgets, [WORST])
    plain = [record(f"{prefix}-p{i}", tenant_id, key_id) for i in range(batch)]
    t0 = time.perf_counter()
    write_records(db, plain)
    t1 = time.perf_counter()
    write_records(db, held)
    t2 = time.perf_counter()
    return (t2 - t1) / (t1 - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="a PostgreSQL server URL (the bench makes a scratch database there); "
                        "default: SQLite in a temporary directory")
    parser.add_argument("--requests", type=int, default=400, help="one client's reservations per round")
    parser.add_argument("--batch", type=int, default=200, help="ledger rows per batch")
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=2.0, help="length of the racing phase")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", "--quick", dest="quick", action="store_true", help="one short round")
    parser.add_argument("--full", action="store_true", help="the full run: the default already is (no change)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.batch, args.threads, args.seconds = 1, 40, 20, 8, 0.3
    print(describe_cpu(), flush=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loramux-budget-bench-") as tmp, \
            scratch_database(args.database_url) as scratch_url:
        db = Database(scratch_url or f"sqlite:///{Path(tmp) / 'budgets.db'}")
        db.upgrade()
        tenancy = Tenancy(db)
        tenant = tenancy.create_tenant("bench")
        key_id = tenancy.create_key("bench")[0].id
        PriceBook(db).set_price("smol", "10", "5", "100", effective_from=datetime(2026, 1, 1, tzinfo=timezone.utc))
        book = BudgetBook(db, "bench")
        for scope, subject in (("tenant", ""), ("key", key_id), ("tag", "batch")):
            book.put(tenant.id, scope, subject, "1000000", "month")
        print(f"database: {db.engine.dialect.name}", flush=True)
        figures: dict[str, list[float]] = {"p50": [], "p99": [], "lookup": [], "rate": [], "ratio": []}
        for r in range(args.rounds):
            reserve_ms, lookup_ms = one_client(book, db, tenant.id, key_id, args.requests, args.batch, f"c{r}")
            rate = racing(book, tenant.id, args.threads, args.seconds, f"t{r}")
            ratio = batch_ratio(book, db, tenant.id, key_id, args.batch, f"b{r}")
            for key, value in (("p50", percentile(reserve_ms, 50)), ("p99", percentile(reserve_ms, 99)),
                               ("lookup", percentile(lookup_ms, 50)), ("rate", rate), ("ratio", ratio)):
                figures[key].append(value)
            print(f"round {r + 1}/{args.rounds} [{time.perf_counter() - t_start:.0f} s]: reserve (3 budgets) p50 "
                  f"{percentile(reserve_ms, 50):.2f} ms p99 {percentile(reserve_ms, 99):.2f} ms; cached lookup p50 "
                  f"{percentile(lookup_ms, 50) * 1000:.1f} us; {args.threads} racing clients: {rate:.0f} "
                  f"admissions/s; a ledger batch of {args.batch} with holds / without: {ratio:.2f}", flush=True)
        status = book.status(tenant.id, "tenant")
        if status.reserved != 0:
            print(f"BUDGET BUG: {status.reserved} still reserved after every row was written", file=sys.stderr)
            return 1
        db.dispose()
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"median of {args.rounds} rounds: reserve p50 {med['p50']:.2f} ms p99 {med['p99']:.2f} ms, "
          f"{med['rate']:.0f} admissions/s, ledger batch ratio {med['ratio']:.2f}")
    print(f"FIGURE budget_reserve_p50_ms {med['p50']:.3f}")
    print(f"FIGURE budget_admissions_per_s {med['rate']:.1f}")
    print(f"FIGURE budget_ledger_batch_ratio {med['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
