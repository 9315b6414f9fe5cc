"""Ledger logs shared by several processes under one folder (the ingress replicas of a Ray Serve deployment): each
process claims a slot folder of its own, and the logs nobody holds any more are drained into SQL."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from loramux.billing.budgets import HOLDER_FILE, BudgetBook, holder_of
from loramux.billing.ledger import LedgerWriter
from loramux.billing.ledger_wal import LEGACY_WAL_NAMES, WAL_NAME, LogInUseError
from loramux.db import Database

log = logging.getLogger(__name__)


def claim_ledger(db: Database, root: Path, max_slots: int = 1024) -> LedgerWriter:
    """A started LedgerWriter in the first free slot folder `root/slot-<n>` (free: no live process holds its
    log's lock). Names are stable, so an ingress that restarts takes a slot back and replays what its
    predecessor left; the log folders no live ingress holds (a slot of a scaled-down ingress, or a folder of
    an older naming) are drained into SQL by `adopt_orphans`, on a background thread."""
    for n in range(max_slots):
        ledger = LedgerWriter(db, root / f"slot-{n}" / WAL_NAME)
        try:
            ledger.start()
        except LogInUseError:
            continue
        threading.Thread(target=adopt_orphans, args=(db, root, ledger.wal_path.parent), daemon=True,
                         name="ledger-orphans").start()
        return ledger
    raise RuntimeError(f"all {max_slots} ledger slots under {root} are in use")


def adopt_orphans(db: Database, root: Path, own: Path, timeout_s: float = 300.0) -> int:
    """Write into SQL every ledger log under `root` (but `own`) that no live process holds, each under its
    lock, then drop the budget reservations its process left (their requests never reached the log); returns
    how many logs were drained. A log whose database writes fail stays, with its reservations, for the next
    start."""
    drained = 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p != own):
        logs = [p for name in (WAL_NAME, *LEGACY_WAL_NAMES) for p in folder.glob(name + "*")
                if not p.name.endswith((".lock", ".rejected"))]
        replay = any(p.stat().st_size for p in logs)
        if not replay and not (folder / HOLDER_FILE).exists():
            continue  # nothing to replay, and no reservation can name it
        writer = LedgerWriter(db, folder / WAL_NAME)
        try:
            writer.start()
        except LogInUseError:
            continue  # a live ingress holds it
        try:
            if writer.flush(timeout_s):
                if replay:
                    drained += 1
                    log.warning("ledger: drained the orphaned log in %s", folder)
                if (folder / HOLDER_FILE).exists():
                    BudgetBook(db, holder_of(writer.wal_path)).clear_leftovers()
        finally:
            writer.close()
    return drained
