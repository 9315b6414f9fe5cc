"""Medusa heads in the registry: one `medusa_heads` row per upload, for the base model or one adapter version,
weights in the object store; and the lookup the request path makes ("which heads serve this version?").

Upload. `upload` validates the two files completely against the served model's hidden size
(`validate_medusa_files`) before anything is stored, then takes the steps of every upload (`blob_lifecycle`):

1. inserts its row as `pending` and commits (the row is the upload's claim on its blob key);
2. writes the blob (`pack_medusa`: both files, length-prefixed; its sha256 is the heads' digest) under the
   server-made key `medusa/sha256/<ab>/<digest>/<row id>`;
3. in one transaction makes the row `ready` and retires the target's previous heads (`deleted_at`,
   `replaced_by`): at most one ready live row per (kind, target), which two partial unique indexes enforce,
   so two uploads racing for one target end with exactly one active (the loser retries).

A failure at any step removes the blob and the row, so nothing is left half-written; a process that dies
between 1 and 3 leaves a pending row, which `collect_garbage` removes with its blob after the grace period.
Each row owns its blob (the row id is part of the key), so deleting one row's blob can never take bytes
another upload of the same heads is about to reference; caches still key on the digest.

Delete is soft for rows (history: `GET /admin/medusa?include_deleted=true`) and hard for the row's blob;
listeners (the host-RAM and disk caches) hear of digests no live row uses any more.

Lookup. `active(version)` answers the version's own heads, else the base model's, else None, from an
in-process cache per (adapter id, version) (a version number's content never changes) that this registry's
uploads and deletes clear and that expires after `lookup_ttl_s`, so another replica's change shows within it.
"""
from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from loramux.adapters.formats.medusa import (
    MEDUSA_CONFIG,
    MEDUSA_WEIGHTS,
    MedusaHeadsWeights,
    validate_medusa_files,
)
from loramux.adapters.formats.safetensors_header import read_upload
from loramux.adapters.formats.validation_common import AdapterFormatError, UploadLimits
from loramux.adapters.storage.blob import check_digest, sha256_hex
from loramux.adapters.storage.blob_lifecycle import DEFAULT_GC_GRACE_S, BlobListeners, in_transaction, store_upload
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterVersionInfo, RegistryError
from loramux.adapters.storage.store import ObjectStore, StoreError
from loramux.db import Adapter, AdapterVersion, Database
from loramux.db.database import rowcount
from loramux.db.models import MedusaHeads, new_id, utcnow

log = logging.getLogger(__name__)

__all__ = ["MEDUSA_KIND", "MEDUSA_KEY_PREFIX", "MedusaHeadsInfo", "MedusaNotFoundError", "MedusaRegistry",
           "collect_medusa_garbage", "medusa_key", "pack_medusa", "unpack_medusa"]

MEDUSA_KIND = "medusa"
MEDUSA_KEY_PREFIX = "medusa/"
DEFAULT_LOOKUP_TTL_S = 10.0
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_ID_RE = re.compile(r"md_[0-9a-f]{16}")
_BASE = None  # the lookup cache's key for the base model's heads


class MedusaNotFoundError(RegistryError, LookupError):
    """No live heads with this id."""


@dataclass(frozen=True)
class MedusaHeadsInfo:
    """One heads upload as the API and the request path see it; plain data, safe across threads."""

    id: str
    kind: str
    adapter_id: str | None  # None: heads for the base model
    adapter_name: str | None
    tenant_id: str | None
    version: int | None
    base_model: str
    digest: str
    storage_key: str
    size_bytes: int
    num_heads: int
    hidden_size: int
    created_at: datetime
    deleted_at: datetime | None = None
    replaced_by: str | None = None
    config: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def target(self) -> str:
        """"base", or the adapter version as `<adapter id>@<version>`."""
        return "base" if self.adapter_id is None else f"{self.adapter_id}@{self.version}"

    @property
    def active(self) -> bool:
        return self.deleted_at is None


def medusa_key(digest: str, heads_id: str) -> str:
    """The server-made key of one upload's blob: ``medusa/sha256/ab/<digest>/<heads id>``."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise ValueError("heads digest must be 64 lowercase hex characters (a sha256 hexdigest)")
    if not isinstance(heads_id, str) or not _ID_RE.fullmatch(heads_id):
        raise ValueError("heads id must be md_ and 16 hex characters")
    return f"{MEDUSA_KEY_PREFIX}sha256/{digest[:2]}/{digest}/{heads_id}"


def pack_medusa(config_bytes: bytes, weights_bytes: bytes) -> bytes:
    """The stored blob: both files, each after its length (8 bytes, little endian), exactly what
    `medusa_digest` hashes, so sha256(blob) is the heads' digest and every cache level can check it."""
    return b"".join((len(config_bytes).to_bytes(8, "little"), config_bytes,
                     len(weights_bytes).to_bytes(8, "little"), weights_bytes))


def unpack_medusa(blob: bytes, hidden_size: int, digest: str | None = None) -> MedusaHeadsWeights:
    """Heads from a blob written by `pack_medusa`, validated again for `hidden_size` (the operator's stored
    bytes: no upload size cap); verify `digest` first when given (DigestMismatchError)."""
    if digest is not None:
        check_digest(blob, digest)
    view = memoryview(blob)
    n = int.from_bytes(view[:8], "little")
    config = bytes(view[8:8 + n])
    m = int.from_bytes(view[8 + n:16 + n], "little")
    weights = bytes(view[16 + n:16 + n + m])
    if 16 + n + m != len(blob):
        raise AdapterFormatError("the stored heads blob is not one pack_medusa wrote (lengths do not add up)")
    return validate_medusa_files({MEDUSA_CONFIG: config, MEDUSA_WEIGHTS: weights}, hidden_size,
                                 UploadLimits(max_total_bytes=sys.maxsize))


def _info(row: MedusaHeads, version: AdapterVersion | None, adapter: Adapter | None) -> MedusaHeadsInfo:
    return MedusaHeadsInfo(
        id=row.id, kind=row.kind, adapter_id=adapter.id if adapter else None,
        adapter_name=adapter.name if adapter else None, tenant_id=adapter.tenant_id if adapter else None,
        version=version.version if version else None, base_model=row.base_model, digest=row.digest,
        storage_key=row.storage_key, size_bytes=row.size_bytes, num_heads=row.num_heads,
        hidden_size=row.hidden_size, created_at=row.created_at, deleted_at=row.deleted_at,
        replaced_by=row.replaced_by, config=dict(row.config or {}))


def _with_target():
    """Heads rows with their adapter version and adapter (None, None for base heads)."""
    return (select(MedusaHeads, AdapterVersion, Adapter)
            .outerjoin(AdapterVersion, AdapterVersion.id == MedusaHeads.adapter_version_id)
            .outerjoin(Adapter, Adapter.id == AdapterVersion.adapter_id))


def _live_ready():
    return (MedusaHeads.status == "ready") & MedusaHeads.deleted_at.is_(None)


class MedusaRegistry(BlobListeners):
    """Medusa heads of this server's base model and of its adapter versions (see the module docstring)."""

    def __init__(self, db: Database, store: ObjectStore, hidden_size: int, base_model_id: str,
                 limits: UploadLimits = UploadLimits(), lookup_ttl_s: float = DEFAULT_LOOKUP_TTL_S):
        self.db = db
        self.store = store
        self.hidden_size = hidden_size
        self.base_model_id = base_model_id
        self.limits = limits
        self.lookup_ttl_s = lookup_ttl_s
        super().__init__()
        self._lock = threading.Lock()
        self._lookups: dict[tuple[str, int] | None, tuple[float, MedusaHeadsInfo | None]] = {}
        self._generation = 0  # bumped by every invalidation: a lookup begun before one is not cached
        self.lookup_queries = 0  # database lookups made for the request path (tests, metrics)

    # -- upload ------------------------------------------------------------------------------------------
    def upload(self, files: Mapping[str, bytes | Path], target: AdapterVersionInfo | None = None,
               kind: str = MEDUSA_KIND) -> MedusaHeadsInfo:
        """Validate and store heads for `target` (an adapter version; None: the base model), replacing its
        active heads. Raises MedusaFormatError (an AdapterValidationError: `code` + what to fix),
        AdapterNotFoundError (the version is gone), StoreError; leaves nothing behind when it raises."""
        if kind != MEDUSA_KIND:
            raise RegistryError(f"speculator kind must be {MEDUSA_KIND!r}, got {kind!r}")
        valid = validate_medusa_files(files, self.hidden_size, self.limits)
        blob = pack_medusa(read_upload(files[MEDUSA_CONFIG]), read_upload(files[MEDUSA_WEIGHTS]))
        digest = sha256_hex(blob)
        if digest != valid.digest:  # what is stored must be exactly what was validated
            raise RegistryError("the uploaded files changed while they were validated; upload them again")
        heads_id = new_id("md")
        key = medusa_key(digest, heads_id)
        pending = MedusaHeads(id=heads_id, kind=kind, base_model=self.base_model_id, digest=digest, storage_key=key,
                              size_bytes=len(blob), num_heads=valid.num_heads, hidden_size=valid.hidden_size,
                              config=valid.config, status="pending")
        del valid
        info, retired = store_upload(self.store, key, blob, lambda: self._reserve(pending, target),
                                     lambda: self._activate(heads_id, target),
                                     lambda: self._discard_upload(heads_id, key))
        self._after_change(retired)
        return info

    def _reserve(self, pending: MedusaHeads, target: AdapterVersionInfo | None) -> None:
        """Commit the upload's pending row (AdapterNotFoundError, nothing stored, when `target` is gone)."""
        with self.db.session() as s:
            pending.adapter_version_id = self._version_row_id(s, target)
            s.add(pending)

    @staticmethod
    def _version_row_id(s, target: AdapterVersionInfo | None) -> int | None:
        """The adapter_versions row of a live, ready `target` (AdapterNotFoundError), None for the base."""
        if target is None:
            return None
        row_id = s.scalar(select(AdapterVersion.id).join(Adapter, Adapter.id == AdapterVersion.adapter_id)
                          .where(Adapter.id == target.adapter_id, Adapter.deleted_at.is_(None),
                                 AdapterVersion.version == target.version, AdapterVersion.status == "ready"))
        if row_id is None:
            raise AdapterNotFoundError(f"adapter {target.label} not found")
        return row_id

    def _activate(self, heads_id: str, target: AdapterVersionInfo | None
                  ) -> tuple[MedusaHeadsInfo, list[MedusaHeadsInfo]]:
        """Make the pending row ready and retire the target's previous heads, in one transaction; returns the
        new heads and the retired ones."""

        def activate(s: Session) -> tuple[MedusaHeadsInfo, list[MedusaHeadsInfo]]:
            # Run again when another upload for the same target activated between our read and write.
            version_id = self._version_row_id(s, target)  # still there (an adapter delete may have won)
            row = s.get(MedusaHeads, heads_id)
            if row is None or row.status != "pending":
                raise RegistryError("the upload took longer than the grace period and was collected; "
                                    "upload the heads again")
            same = (MedusaHeads.adapter_version_id == version_id if version_id is not None else
                    MedusaHeads.adapter_version_id.is_(None) & (MedusaHeads.base_model == row.base_model))
            old = s.execute(_with_target().where(same, MedusaHeads.kind == row.kind, _live_ready())).all()
            now = utcnow()
            if old:
                s.execute(update(MedusaHeads)
                          .where(MedusaHeads.id.in_([r.id for r, _, _ in old]), MedusaHeads.deleted_at.is_(None))
                          .values(deleted_at=now, replaced_by=heads_id)
                          .execution_options(synchronize_session=False))
            s.flush()  # the old rows leave the unique index before the new one enters it
            row.status, row.created_at = "ready", now
            s.flush()
            version = s.get(AdapterVersion, version_id) if version_id is not None else None
            adapter = s.get(Adapter, version.adapter_id) if version is not None else None
            retired = [replace(_info(r, v, a), deleted_at=now, replaced_by=heads_id) for r, v, a in old]
            return _info(row, version, adapter), retired

        return in_transaction(self.db, activate)

    def _discard_upload(self, heads_id: str, key: str) -> None:
        """A failed upload: its blob and its (never ready) row go; never hide the upload's own error."""
        try:
            self.store.delete(key)
        except Exception:  # noqa: BLE001 - `loramux db gc` removes it later (no row references it)
            log.exception("could not delete blob %s of a failed heads upload", key)
        try:
            with self.db.session() as s:
                s.execute(delete(MedusaHeads).where(MedusaHeads.id == heads_id, MedusaHeads.status == "pending"))
        except Exception:  # noqa: BLE001 - a pending row older than the grace period is collected
            log.exception("could not remove the row of failed heads upload %s", heads_id)

    # -- list, show, delete --------------------------------------------------------------------------------
    def list(self, adapter_id: str | None = None, base_only: bool = False, include_deleted: bool = False,
             tenant_id: str | None = None) -> list[MedusaHeadsInfo]:
        """Heads uploads, newest first: every live one (and with `include_deleted` the retired and deleted
        ones too); only those of one adapter's versions, of one tenant's adapters, or of the base model."""
        stmt = _with_target().where(MedusaHeads.status == "ready")
        if not include_deleted:
            stmt = stmt.where(MedusaHeads.deleted_at.is_(None))
        if adapter_id is not None:
            stmt = stmt.where(AdapterVersion.adapter_id == adapter_id)
        elif tenant_id is not None:
            stmt = stmt.where(Adapter.tenant_id == tenant_id)
        elif base_only:
            stmt = stmt.where(MedusaHeads.adapter_version_id.is_(None))
        with self.db.session() as s:
            rows = s.execute(stmt.order_by(MedusaHeads.created_at.desc(), MedusaHeads.id)).all()
            return [_info(r, v, a) for r, v, a in rows]

    def get(self, heads_id: str) -> MedusaHeadsInfo:
        """One upload by id, live or not (MedusaNotFoundError)."""
        with self.db.session() as s:
            found = s.execute(_with_target().where(MedusaHeads.id == heads_id, MedusaHeads.status == "ready")).first()
            if found is None:
                raise MedusaNotFoundError(f"Medusa heads {heads_id!r} not found")
            return _info(*found)

    def delete(self, heads_id: str) -> MedusaHeadsInfo:
        """Soft-delete live heads (MedusaNotFoundError for unknown or already deleted ones); requests already
        running keep the copy they hold. The target falls back to the base model's heads (or none)."""
        with self.db.session() as s:
            found = s.execute(_with_target().where(MedusaHeads.id == heads_id, _live_ready())).first()
            if found is None:
                raise MedusaNotFoundError(f"Medusa heads {heads_id!r} not found (or already deleted)")
            now = utcnow()
            done = rowcount(s.execute(update(MedusaHeads)
                                      .where(MedusaHeads.id == heads_id, MedusaHeads.deleted_at.is_(None))
                                      .values(deleted_at=now).execution_options(synchronize_session=False)))
            if not done:  # replaced or deleted a moment ago by another call
                raise MedusaNotFoundError(f"Medusa heads {heads_id!r} not found (or already deleted)")
            gone = replace(_info(*found), deleted_at=now)
        self._after_change([gone])
        return gone

    def retire_for_adapter(self, adapter_id: str) -> list[MedusaHeadsInfo]:
        """Soft-delete the live heads of every version of an adapter (the adapter was deleted)."""
        with self.db.session() as s:
            found = s.execute(_with_target().where(AdapterVersion.adapter_id == adapter_id, _live_ready())).all()
            if not found:
                return []
            now = utcnow()
            s.execute(update(MedusaHeads).where(MedusaHeads.id.in_([r.id for r, _, _ in found]),
                                                MedusaHeads.deleted_at.is_(None))
                      .values(deleted_at=now).execution_options(synchronize_session=False))
            gone = [replace(_info(r, v, a), deleted_at=now) for r, v, a in found]
        self._after_change(gone)
        return gone

    def _after_change(self, gone: list[MedusaHeadsInfo]) -> None:
        """Heads were added, retired or deleted: forget cached lookups; remove the blobs of `gone` and tell the
        listeners of digests no live heads use any more."""
        self.invalidate()
        for info in gone:
            try:
                self.store.delete(info.storage_key)
            except StoreError:
                log.warning("could not delete heads blob %s; `loramux db gc` removes it later", info.storage_key)
        digests = {info.digest for info in gone}
        if not digests:
            return
        with self.db.session() as s:
            live = set(s.scalars(select(MedusaHeads.digest).where(MedusaHeads.digest.in_(digests), _live_ready())))
        self._tell_deleted(sorted(digests - live))

    # -- the request path ----------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget every cached lookup (heads were uploaded or deleted)."""
        with self._lock:
            self._lookups.clear()
            self._generation += 1

    def cached_active(self, version: AdapterVersionInfo | None) -> tuple[bool, MedusaHeadsInfo | None]:
        """(found in the lookup cache, the answer): no database access, for callers on an event loop."""
        key = _BASE if version is None else (version.adapter_id, version.version)
        with self._lock:
            hit = self._lookups.get(key)
        if hit is None or hit[0] < time.monotonic():
            return False, None
        return True, hit[1]

    def active(self, version: AdapterVersionInfo | None) -> MedusaHeadsInfo | None:
        """The heads requests for `version` use: its own active heads, else the base model's, else None.
        Cached (see the module docstring); blocking on a miss: call it in a worker thread."""
        found, info = self.cached_active(version)
        if found:
            return info
        with self._lock:
            generation = self._generation
        own = self._query_version(version) if version is not None else None
        base_found, base = self.cached_active(None)
        if own is None and not base_found:
            base = self._query_base()
            self._remember(_BASE, base, generation)
        answer = own if own is not None else base
        if version is not None:
            self._remember((version.adapter_id, version.version), answer, generation)
        return answer

    def _remember(self, key, info: MedusaHeadsInfo | None, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._lookups[key] = (time.monotonic() + self.lookup_ttl_s, info)

    def _query_version(self, version: AdapterVersionInfo) -> MedusaHeadsInfo | None:
        self.lookup_queries += 1
        with self.db.session() as s:
            found = s.execute(_with_target().where(AdapterVersion.adapter_id == version.adapter_id,
                                                   AdapterVersion.version == version.version,
                                                   AdapterVersion.status == "ready",
                                                   MedusaHeads.kind == MEDUSA_KIND,
                                                   MedusaHeads.hidden_size == self.hidden_size, _live_ready())
                              ).first()
            return _info(*found) if found is not None else None

    def _query_base(self) -> MedusaHeadsInfo | None:
        self.lookup_queries += 1
        with self.db.session() as s:
            found = s.execute(_with_target().where(MedusaHeads.adapter_version_id.is_(None),
                                                   MedusaHeads.base_model == self.base_model_id,
                                                   MedusaHeads.kind == MEDUSA_KIND,
                                                   MedusaHeads.hidden_size == self.hidden_size, _live_ready())
                              ).first()
            return _info(*found) if found is not None else None

    def collect_garbage(self, grace_s: float = DEFAULT_GC_GRACE_S) -> list[str]:
        """See the module function `collect_medusa_garbage`; forgets cached lookups."""
        removed = collect_medusa_garbage(self.db, self.store, grace_s)
        self.invalidate()
        return removed


def collect_medusa_garbage(db: Database, store: ObjectStore, grace_s: float = DEFAULT_GC_GRACE_S) -> list[str]:
    """Retire heads whose adapter version is no longer ready (the adapter was deleted), remove uploads that
    died before they became ready (pending rows older than `grace_s`) and delete every heads blob no live
    row or recent upload references; return the deleted keys. `loramux db gc` runs it."""
    cutoff = utcnow() - timedelta(seconds=grace_s)
    # Keys first: an upload commits its pending row before it writes its blob, so every key listed here
    # whose upload is under way has its row in the query below.
    keys = store.list_keys(MEDUSA_KEY_PREFIX)
    with db.session() as s:
        orphaned = select(AdapterVersion.id).where(AdapterVersion.status != "ready")
        s.execute(update(MedusaHeads).where(MedusaHeads.adapter_version_id.in_(orphaned), _live_ready())
                  .values(deleted_at=utcnow()).execution_options(synchronize_session=False))
        s.execute(delete(MedusaHeads).where(MedusaHeads.status == "pending", MedusaHeads.created_at < cutoff))
        keep = set(s.scalars(select(MedusaHeads.storage_key).where(
            _live_ready() | ((MedusaHeads.status == "pending") & (MedusaHeads.created_at >= cutoff)))))
    removed = []
    for key in keys:
        if key not in keep:
            store.delete(key)
            removed.append(key)
    return removed
