"""The life of a stored blob, shared by the adapter registry (`registry`) and the Medusa heads registry
(`medusa_registry`).

Upload. Everything is validated before anything is stored; then `store_upload`:

1. `reserve` commits the upload's claim on its blob key;
2. the blob is written (`ObjectStore.put`);
3. `commit` turns the claim into the live row in one transaction.

A failure at any step runs `abandon`, which gives the claim back and removes the blob unless another row uses
or claims it, so nothing is left half-written. A process that dies between 1 and 3 leaves a claim that the
registry's `collect_garbage` removes, with its blob, once it is older than `DEFAULT_GC_GRACE_S`.

Ownership is each registry's own rule, because their keys differ: adapter versions share blobs by digest (an
`adapter_blobs` row counts the uploads under way), while each Medusa heads row owns its blob (the row id is in
its key; its pending row is the claim).

Delete. Rows are deleted softly (`deleted_at`: history and billing keep their references), blobs no live row
uses any more are removed, and the listeners (the cache levels) hear of each such digest (`BlobListeners`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loramux.adapters.storage.store import ObjectStore
from loramux.db import Database

__all__ = ["DEFAULT_GC_GRACE_S", "BlobListeners", "in_transaction", "store_upload"]

# How long an upload may hold its claim (between its put and its commit) before it counts as abandoned; far
# longer than any upload takes, so no live upload ever loses its blob.
DEFAULT_GC_GRACE_S = 3600.0
_ATTEMPTS = 5

T = TypeVar("T")


def in_transaction(db: Database, work: Callable[[Session], T]) -> T:
    """`work(session)` in one transaction, run again (a few times) when it loses a race for a unique row to
    another upload or delete (IntegrityError)."""
    for attempt in range(_ATTEMPTS):
        try:
            with db.session() as s:
                return work(s)
        except IntegrityError:
            if attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def store_upload(store: ObjectStore, key: str, blob: bytes, reserve: Callable[[], object],
                 commit: Callable[[], T], abandon: Callable[[], object]) -> T:
    """Steps 1 to 3 of the module docstring: `reserve`, write `blob` under `key`, `commit` (its result is
    returned); `abandon` when the put or the commit raises, and the error goes on."""
    reserve()
    try:
        store.put(key, blob)
        return commit()
    except BaseException:
        abandon()
        raise


class BlobListeners:
    """Who hears that no live row uses a digest any more (caches drop their copies)."""

    def __init__(self) -> None:
        self._delete_listeners: list[Callable[[str], None]] = []

    def on_blob_deleted(self, listener: Callable[[str], None]) -> None:
        """Call `listener(digest)` when no live row uses a digest any more."""
        self._delete_listeners.append(listener)

    def _tell_deleted(self, digests: Iterable[str]) -> None:
        for digest in digests:
            for listener in self._delete_listeners:
                listener(digest)
