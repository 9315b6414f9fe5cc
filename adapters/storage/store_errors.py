"""The three exception types of every object store; import them from `loramux.adapters.storage.store`.

- `BlobNotFoundError`: the key does not exist;
- `StoreUnavailableError`: unreachable, timed out, 5xx, throttled: the caller may retry later;
- `StoreError`: anything else (access denied, missing bucket, bad configuration, local disk error).
"""
from __future__ import annotations


class StoreError(RuntimeError):
    """Base of every object-store failure. Messages never contain credentials."""


class StoreUnavailableError(StoreError):
    """The store is unreachable, timed out, answered 5xx or throttled: retry later."""


class BlobNotFoundError(StoreError):
    """The key does not exist in the store."""
