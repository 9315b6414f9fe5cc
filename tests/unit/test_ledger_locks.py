"""One process per ledger log: a lock that keeps two servers on one data dir from truncating each other's
log, stable slot folders for ingress replicas, replay of logs nobody holds, and a bounded memory queue
while the log cannot be written."""
from __future__ import annotations

import subprocess
import textwrap

import pytest
from sqlalchemy import func, select
from test_ledger import record

from loramux.billing import ledger_wal
from loramux.billing.ledger import LedgerBacklogError, LedgerWriter
from loramux.billing.ledger_wal import WAL_NAME, LogInUseError
from loramux.billing.recovery import adopt_orphans, claim_ledger
from loramux.child_python import python_command
from loramux.db import LedgerEntry
from polling import wait_until


def rows(db) -> int:
    with db.session() as session:
        return session.scalar(select(func.count()).select_from(LedgerEntry))


def test_a_second_writer_on_the_same_log_is_refused_until_the_first_closes(database, tmp_path):
    spool = tmp_path / WAL_NAME
    first = LedgerWriter(database, spool)
    first.start()
    second = LedgerWriter(database, spool)
    with pytest.raises(LogInUseError, match="LORAMUX_DATA_DIR"):
        second.start()
    assert first.submit(record(1)).result(10)
    first.close()
    second.start()  # free again
    try:
        assert second.flush(10) and rows(database) == 1
    finally:
        second.close()


def test_the_lock_of_a_killed_process_is_free_at_once(database, tmp_path):
    spool = tmp_path / WAL_NAME
    holder = subprocess.Popen(python_command("-c", textwrap.dedent(f"""
        import sys
        from loramux.billing.ledger_wal import WriteAheadLog
        WriteAheadLog({str(spool)!r}).open()
        print("locked", flush=True)
        sys.stdin.read()
        """)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LogInUseError):
            LedgerWriter(database, spool).start()
    finally:
        holder.kill()
        holder.wait()
    writer = LedgerWriter(database, spool)
    writer.start()  # the kernel dropped the dead process's lock
    writer.close()


def test_ingress_slots_are_stable_and_orphaned_logs_are_written_to_sql(database, tmp_path, monkeypatch):
    root = tmp_path / "ingress"
    # A dead ingress left acknowledged records in a folder of the old naming (its Ray replica id).
    orphan = LedgerWriter(database, root / "replica-abc123" / WAL_NAME)
    monkeypatch.setattr(orphan, "_write", lambda records: (_ for _ in ()).throw(ConnectionError("db down")))
    orphan.start()
    assert all(orphan.submit(record(i)).result(10) for i in range(5))
    orphan.close(timeout=0.2)
    assert rows(database) == 0

    first = claim_ledger(database, root)
    second = claim_ledger(database, root)
    try:
        assert first.wal_path.parent.name == "slot-0" and second.wal_path.parent.name == "slot-1"
        # The claims drain the orphan on a background thread.
        wait_until(lambda: rows(database) >= 5, "the orphaned log to be replayed", 30, poll_s=0.05)
        assert rows(database) == 5
        assert adopt_orphans(database, root, first.wal_path.parent) == 0  # drained: empty now; slot-1 is held
        assert rows(database) == 5
    finally:
        second.close()
    again = claim_ledger(database, root)  # a restarted ingress takes the freed slot back
    try:
        assert again.wal_path.parent.name == "slot-1"
    finally:
        again.close()
        first.close()


def test_a_full_disk_refuses_new_records_instead_of_growing_memory(database, tmp_path, monkeypatch):
    def full(self, lines):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_wal.WriteAheadLog, "append", full)
    writer = LedgerWriter(database, tmp_path / WAL_NAME, max_pending=3, retry_initial_s=0.05, retry_max_s=0.1)
    writer.start()
    try:
        waiting = [writer.submit(record(i)) for i in range(3)]
        refused = writer.submit(record(99))
        with pytest.raises(LedgerBacklogError):
            refused.result(5)
        assert writer.stats()["refused_backlog"] == 1
        assert not any(f.done() for f in waiting)  # still waiting for the disk
        monkeypatch.undo()  # the disk has room again
        assert all(f.result(10) for f in waiting)
    finally:
        writer.close()


# -- a log an older version left under its old name ----------------------------------------------------------
def _legacy_log(folder, records) -> None:
    """What an older loramux left in `folder`: a sealed segment, an active one and a rejected file."""
    from loramux.billing.ledger_lines import encode

    old = folder / ledger_wal.LEGACY_WAL_NAMES[0]
    folder.mkdir(parents=True, exist_ok=True)
    old.with_name(old.name + ".00000003").write_bytes(b"".join(encode(r) for r in records[:2]))
    old.write_bytes(b"".join(encode(r) for r in records[2:]))
    old.with_name(old.name + ".rejected").write_text('{"reason": "an old refusal"}\n')


def test_a_log_left_under_the_old_name_is_adopted_and_replayed(database, tmp_path):
    records = [record(i) for i in range(4)]
    _legacy_log(tmp_path, records)
    (tmp_path / (WAL_NAME + ".rejected")).write_text('{"reason": "a newer refusal"}\n')
    writer = LedgerWriter(database, tmp_path / WAL_NAME)
    writer.start()
    try:
        assert writer.flush(30) and rows(database) == 4
    finally:
        writer.close()
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(ledger_wal.LEGACY_WAL_NAMES[0]))
    assert left in ([], [ledger_wal.LEGACY_WAL_NAMES[0] + ".lock"])  # nothing but its lock file stays behind
    assert (tmp_path / (WAL_NAME + ".rejected")).read_text().splitlines() == [
        '{"reason": "a newer refusal"}', '{"reason": "an old refusal"}']


def test_an_old_log_still_held_by_its_server_stops_the_start(database, tmp_path):
    _legacy_log(tmp_path, [record(i) for i in range(3)])
    held = ledger_wal.try_lock(tmp_path / (ledger_wal.LEGACY_WAL_NAMES[0] + ".lock"))  # the older server
    try:
        with pytest.raises(LogInUseError, match="an older loramux"):
            LedgerWriter(database, tmp_path / WAL_NAME).start()
    finally:
        ledger_wal.unlock(held)
    assert rows(database) == 0 and (tmp_path / ledger_wal.LEGACY_WAL_NAMES[0]).exists()  # untouched


def test_an_orphaned_slot_folder_with_an_old_log_is_drained(database, tmp_path):
    root = tmp_path / "ingress"
    _legacy_log(root / "replica-old", [record(i) for i in range(3)])
    assert adopt_orphans(database, root, None) == 1 and rows(database) == 3  # one log drained, its 3 rows
