"""Ledger durability: what awaiting the write-ahead log adds before a request's final chunk.

The server sends a request's final response only after `await durable(ledger.submit(record))`: the
record's line is appended to the ledger's write-ahead log and fsync'd by the "ledger-wal" thread, in
groups (one fsync for every record queued meanwhile). This measures, on one asyncio event loop as in the
server, the time from `submit` to the resumption of the awaiting task:

- open loop: Poisson arrivals at `--rate` requests/s for `--seconds`, each one a task that submits its
  record and awaits durability (the ledger's SQL thread writes the rows to the database meanwhile, as in
  production); vs no ledger (the same task awaiting an already resolved future: the event loop's own cost);
- closed loop: 64 threads each submitting and waiting, back to back (saturation: records/s, records per fsync);
- the raw fdatasync latency of a small append on the same disk, for reference.

Median over `--rounds` rounds of each round's p50 / p99. SQLite in a temporary directory by default
(`--database-url` names a PostgreSQL server: the bench works in a scratch database it creates and drops). Prints the CPU
model and flags, one line per round as it goes (with the elapsed seconds), and ends with FIGURE
ledger_final_chunk_p99_ms (target <= 10). The default (5 rounds of 2 s phases) takes well under a minute; it is
also the full run (`--full` is accepted, for the same command line as the other benches, and changes nothing).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from loramux.billing.ledger import LedgerWriter, durable
from loramux.billing.usage import RequestRecord
from loramux.db import Database
from loramux.testing import describe_cpu, percentile


def make_record(rid: str) -> RequestRecord:
    return RequestRecord(request_id=rid, tenant_id="tn_bench", key_id="key_bench", tier="standard", model="smol",
                         adapter_id="ad_bench", adapter_version=3, adapter_digest="sha256:" + "ab" * 32,
                         requested="ad_bench", fallback=False, outcome="stop", prompt_tokens=412, cached_tokens=128,
                         completion_tokens=96, queue_ms=3.25, ttft_ms=41.5, total_ms=812.75,
                         created_at=datetime.now(timezone.utc))


async def open_loop(submit, rate: float, seconds: float, prefix: str, seed: int) -> list[float]:
    """Poisson arrivals; each task times submit -> durable. Returns the latencies in ms."""
    rng = random.Random(seed)
    latencies: list[float] = []
    tasks = []

    async def one(i: int) -> None:
        record = make_record(f"{prefix}-{i}")
        t0 = time.perf_counter()
        await durable(submit(record), timeout=30)
        latencies.append((time.perf_counter() - t0) * 1000)

    loop = asyncio.get_running_loop()
    start = loop.time()
    at, i = start, 0
    while at < start + seconds:
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
        i += 1
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return latencies


def no_ledger(record: RequestRecord) -> Future:
    future: Future = Future()
    future.set_result(True)
    return future


def closed_loop(writer: LedgerWriter, threads: int, seconds: float, prefix: str) -> tuple[list[float], int]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        mine, i = [], 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            writer.submit(make_record(f"{prefix}-{k}-{i}")).result(30)
            mine.append((time.perf_counter() - t0) * 1000)
            i += 1
        with lock:
            latencies.extend(mine)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return latencies, len(latencies)


def raw_fdatasync(directory: Path, n: int = 200) -> list[float]:
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    line = b"x" * 400 + b"\n"
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, line)
            os.fdatasync(fd)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        os.close(fd)
        path.unlink()
    return times


@contextmanager
def scratch_database(server_url: str | None):
    """A database of its own on the server `server_url` names (created, then dropped), so the bench never
    writes into a database someone else uses; None (SQLite in the temp dir) when no URL is given."""
    if not server_url:
        yield None
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"loramux_bench_{time.time_ns():x}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database-url", help="a PostgreSQL server URL (the bench makes a scratch database there); "
                        "default: SQLite in a temporary directory")
    parser.add_argument("--rate", type=float, default=500.0, help="open-loop arrivals per second (default 500)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each open-loop phase")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=64, help="closed-loop submitters")
    parser.add_argument("--smoke", "--quick", dest="quick", action="store_true",
                        help="smoke run (what the tests run): 1 round of 0.5 s phases")
    parser.add_argument("--full", action="store_true", help="the full run: the default already is (no change)")
    args = parser.parse_args()
    t_start = time.perf_counter()
    if args.quick:
        args.rounds, args.seconds = 1, 0.5

    print(describe_cpu(), flush=True)
    with tempfile.TemporaryDirectory(prefix="loramux-ledger-bench-") as tmp, \
            scratch_database(args.database_url) as scratch_url:
        tmp_path = Path(tmp)
        url = scratch_url or f"sqlite:///{tmp_path / 'ledger.db'}"
        db = Database(url)
        db.upgrade()
        print(f"database: {db.engine.dialect.name}; write-ahead log in {tmp_path}")
        writer = LedgerWriter(db, tmp_path / "ledger-wal.jsonl")
        writer.start()
        run = f"{time.time_ns():x}"
        submitted = 0
        keys = ("base50", "base99", "led50", "led99", "thr50", "thr99", "tps", "fs50", "fs99")
        rows: dict[str, list[float]] = {k: [] for k in keys}
        try:
            for r in range(args.rounds):
                base = asyncio.run(open_loop(no_ledger, args.rate, args.seconds, f"{run}-b{r}", seed=r))
                syncs0, lines0 = writer.stats()["wal_syncs"], writer.stats()["wal_lines"]
                led = asyncio.run(open_loop(writer.submit, args.rate, args.seconds, f"{run}-o{r}", seed=r))
                stats = writer.stats()
                per_sync = (stats["wal_lines"] - lines0) / max(1, stats["wal_syncs"] - syncs0)
                thr, n = closed_loop(writer, args.threads, args.seconds / 2, f"{run}-t{r}")
                submitted += len(led) + n
                fsync_ms = raw_fdatasync(tmp_path)
                for key, values in (("base", base), ("led", led), ("thr", thr), ("fs", fsync_ms)):
                    rows[key + "50"].append(percentile(values, 50))
                    rows[key + "99"].append(percentile(values, 99))
                rows["tps"].append(n / (args.seconds / 2))
                print(f"round {r + 1}/{args.rounds} [{time.perf_counter() - t_start:.0f} s]: open loop {len(led)} "
                      f"requests at {args.rate:.0f}/s: durable p50 "
                      f"{percentile(led, 50):.2f} ms p99 {percentile(led, 99):.2f} ms ({per_sync:.1f} records per "
                      f"fsync); no ledger p50 {percentile(base, 50):.3f} ms p99 {percentile(base, 99):.3f} ms; "
                      f"{args.threads} threads: "
                      f"{n / (args.seconds / 2):.0f} records/s, p99 {percentile(thr, 99):.2f} ms; raw fdatasync p50 "
                      f"{percentile(fsync_ms, 50):.2f} ms p99 {percentile(fsync_ms, 99):.2f} ms", flush=True)
            t0 = time.perf_counter()
            flushed = writer.flush(120)
            flush_s = time.perf_counter() - t0
        finally:
            writer.close()
        stats = writer.stats()
        db.dispose()
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nmedian of {args.rounds} rounds | p50 ms | p99 ms")
    print(f"no ledger (await a resolved future) | {med['base50']:.3f} | {med['base99']:.3f}")
    print(f"raw fdatasync of a 401-byte append (same disk, for reference) | {med['fs50']:.2f} | {med['fs99']:.2f}")
    print(f"durable submit, open loop {args.rate:.0f}/s | {med['led50']:.2f} | {med['led99']:.2f}")
    print(f"durable submit, {args.threads} threads closed loop ({med['tps']:.0f} records/s) | {med['thr50']:.2f} | "
          f"{med['thr99']:.2f}")
    added = med["led99"] - med["base99"]
    print(f"added p99 over no ledger: {added:.2f} ms; SQL caught up {flush_s:.2f} s after the last round; "
          f"rows written {stats['written']} of {submitted} submitted, lost {stats['lost']}")
    if not flushed or stats["written"] != submitted or stats["lost"]:
        print("LEDGER BUG: not every submitted record reached SQL exactly once", file=sys.stderr)
        return 1
    print(f"FIGURE ledger_final_chunk_p99_ms {med['led99']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
