"""The adapter registry: tenants' adapters and their versions in SQL, weights in the object store.

`register` validates an upload completely before anything is stored, writes the blob under a key made
from its digest, then commits the rows; a failure at any point leaves neither rows nor an orphaned blob.
`resolve` answers "not found" identically for an adapter that does not exist and one the tenant may not
see. Deleting is soft for rows (history and billing keep their references) and hard for blobs no live
version still uses; listeners (the cache levels) are told so they drop their copies.

Blob lifecycle (the steps every registry shares are `blob_lifecycle`'s; this is the adapters' ownership rule).
Blobs are shared by digest (two uploads of the same bytes are one object), so deleting
one adapter must never remove bytes another upload is about to reference. Every decision about a blob's
fate takes the lock of its `adapter_blobs` row (an UPDATE: a row lock on PostgreSQL, the write lock on
SQLite) and all of it lives in three functions here:

- `_reserve_blob`: before its `put`, an upload adds itself to the row's `pending` count and commits;
- `_insert_version` removes the reservation in the same transaction that inserts the version row;
- `_drop_blob_if_unused` (delete, a failed upload, `collect_garbage`): with the row locked, deletes the
  blob only when no ready version uses the digest and no upload is pending, then drops the row.

So a delete that races an upload of the same bytes either runs first (the upload then writes the blob
again) or sees the reservation and keeps the blob. A reservation older than the grace period
(`DEFAULT_GC_GRACE_S`) is an upload that died between its put and its insert; `collect_garbage` removes
such blobs, and blobs a store outage left behind.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

from loramux.adapters.formats.summary import describe
from loramux.adapters.formats.validation import UploadLimits, validate_adapter_files
from loramux.adapters.storage.blob import pack, unpack
from loramux.adapters.storage.blob_lifecycle import DEFAULT_GC_GRACE_S, BlobListeners, in_transaction, store_upload
from loramux.adapters.storage.store import ObjectStore, StoreError, blob_key
from loramux.db import Adapter, AdapterVersion, Database, Tenant
from loramux.db.database import rowcount
from loramux.db.models import AdapterBlob, utcnow
from loramux.model.config import ModelConfig
from loramux.names import BASE_MODEL_ALIAS, InvalidNameError, check_name
from loramux.tenancy.tenants import Tenancy

log = logging.getLogger(__name__)

__all__ = ["AdapterNotFoundError", "AdapterRegistry", "AdapterVersionInfo", "BASE_MODEL_ALIAS", "DEFAULT_GC_GRACE_S",
           "InvalidNameError", "RegistryError", "collect_garbage"]

VISIBILITIES = ("private", "public")
_MAX_VERSION_DIGITS = 9  # versions are SQL INTEGERs: a longer number is no version there is


class RegistryError(Exception):
    """Base of the registry's errors; messages are safe to show to the caller."""


class AdapterNotFoundError(RegistryError, LookupError):
    """Unknown adapter, or one the tenant may not see: the same error, so existence is not revealed."""


@dataclass(frozen=True)
class AdapterVersionInfo:
    """Everything the engine and the API need about one version; plain data, safe across threads."""

    adapter_id: str
    tenant_id: str
    name: str
    visibility: str
    version: int
    digest: str
    storage_key: str
    size_bytes: int
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    base_model: str  # the model this server served at upload
    created_at: datetime
    claimed_base_model: str | None = None  # base_model_name_or_path from the adapter's config
    base_family: str | None = None  # model_type of the base it was validated against (None: not recorded)
    # What the adapter changes (adapters/formats/summary.py); None for versions uploaded before it was recorded (0010).
    summary: dict | None = field(default=None, hash=False, compare=False)
    # Where a merged version came from (adapters/composition/merge.py): {"method", "parameters", "components":
    # [{"adapter_id",
    # "version", "digest", "weight"}]}; None for an upload.
    provenance: dict | None = field(default=None, hash=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


def _version_info(a: Adapter, v: AdapterVersion) -> AdapterVersionInfo:
    return AdapterVersionInfo(
        adapter_id=a.id, tenant_id=a.tenant_id, name=a.name, visibility=a.visibility, version=v.version,
        digest=v.digest, storage_key=v.storage_key, size_bytes=v.size_bytes, rank=v.rank, alpha=v.alpha,
        use_rslora=v.use_rslora, target_modules=tuple(v.target_modules), base_model=v.base_model,
        created_at=v.created_at, claimed_base_model=v.claimed_base_model, base_family=v.base_family,
        summary=v.summary, provenance=v.provenance)


def _check_visibility(visibility: str) -> None:
    if visibility not in VISIBILITIES:
        raise InvalidNameError(f"visibility must be one of {', '.join(VISIBILITIES)}, got {visibility!r}")


class AdapterRegistry(BlobListeners):
    def __init__(self, db: Database, store: ObjectStore, base_config: ModelConfig, base_model_id: str,
                 limits: UploadLimits = UploadLimits(), shared_tenant: str | None = None,
                 tenancy: Tenancy | None = None, device_dtype_bytes: int = 4):
        self.db = db
        self.device_dtype_bytes = device_dtype_bytes  # the engine's adapter weights: what summaries count
        self.tenancy = tenancy or Tenancy(db)  # the owner of tenants: uploads check the tenant through it
        self.shared_tenant = shared_tenant  # its public adapters resolve by bare name for every tenant
        self.store = store
        self.base_config = base_config
        self.base_model_id = base_model_id
        self.limits = limits
        super().__init__()

    # -- adapters --------------------------------------------------------------------------------
    def register(self, tenant_id: str, name: str, files: Mapping[str, bytes | Path],
                 visibility: str = "private", allow_base_mismatch: bool = False,
                 provenance: dict | None = None) -> AdapterVersionInfo:
        """Validate and store an upload as the next version of `name` (created when new). Uploading the
        bytes of the current version again returns that version instead of adding an identical one.
        `allow_base_mismatch`: accept a config naming another hub model (the operator knows the shapes match).
        `provenance`: recorded with a new version made by a merge (see adapters/composition/merge.py)."""
        check_name(name)
        _check_visibility(visibility)
        tenant = self.tenancy.tenant(tenant_id)
        valid = validate_adapter_files(files, self.base_config, self._limits_for(tenant.tier), self.base_model_id,
                                       allow_base_mismatch)
        claimed_base = valid.base_model
        blob, digest = pack(valid.rank, valid.alpha, valid.use_rslora, valid.target_modules, valid.tensors,
                            module_scales=valid.module_scales, magnitudes=valid.magnitudes,
                            embedding=valid.embedding, heads=valid.heads, experts=valid.experts)
        del valid
        key = blob_key(digest)
        return store_upload(self.store, key, blob, lambda: _reserve_blob(self.db, digest, key),
                            lambda: self._insert_version(tenant_id, name, visibility, digest, key, len(blob), blob,
                                                         claimed_base, provenance),
                            lambda: self._after_failed_upload(digest, key))

    def _limits_for(self, tier: str) -> UploadLimits:
        """The server's upload limits, with the head cap lowered to the tenant tier's where the tier sets one."""
        tier_cap = self.tenancy.tier(tier).max_adapter_head_bytes
        if not tier_cap:
            return self.limits
        server_cap = self.limits.max_head_bytes
        return replace(self.limits, max_head_bytes=tier_cap if server_cap is None else min(tier_cap, server_cap),
                       head_limit_source=f"tier {tier!r} max_adapter_head_bytes")

    def _after_failed_upload(self, digest: str, key: str) -> None:
        """Give back the failed upload's reservation; remove the blob if nothing else uses or reserves it."""
        try:
            unused = _drop_blob_if_unused(self.db, self.store, digest, key, release=True)
        except Exception:  # noqa: BLE001 - never hide the upload's own error; `loramux db gc` cleans up
            log.exception("could not clean up after a failed upload of blob %s", key)
            return
        if unused:
            self._tell_deleted([digest])

    def _insert_version(self, tenant_id, name, visibility, digest, key, size, blob,
                        claimed_base: str | None = None, provenance: dict | None = None) -> AdapterVersionInfo:
        meta = unpack(blob, name)  # the normalised config, as the engine will see it

        def insert(s: Session) -> AdapterVersionInfo:  # run again when two uploads of a name race for a number
            # First, with the blob's row locked: this upload's reservation becomes its version row,
            # atomically (a delete that locks the row next sees the version, one before saw the reservation).
            mine = (AdapterBlob.digest == digest) & (AdapterBlob.pending > 0)
            released = rowcount(s.execute(update(AdapterBlob).where(mine)
                                          .values(pending=AdapterBlob.pending - 1, updated_at=utcnow())
                                          .execution_options(synchronize_session=False)))
            if not released:
                raise RegistryError("the upload took longer than the blob grace period and its stored "
                                    "weights were collected; upload it again")
            adapter = s.scalar(select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name,
                                                     Adapter.deleted_at.is_(None)))
            if adapter is None:
                adapter = Adapter(tenant_id=tenant_id, name=name, visibility=visibility)
                s.add(adapter)
                s.flush()
            current = s.scalar(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id)
                               .order_by(AdapterVersion.version.desc()).limit(1))
            if current is not None and current.digest == digest and current.status == "ready":
                return _version_info(adapter, current)  # the same bytes again: no new version
            latest = current.version if current is not None else 0
            version = AdapterVersion(
                adapter_id=adapter.id, version=latest + 1, digest=digest, storage_key=key, size_bytes=size,
                rank=meta.rank, alpha=meta.alpha, use_rslora=meta.use_rslora,
                target_modules=list(meta.target_modules), base_model=self.base_model_id,
                claimed_base_model=claimed_base, base_family=self.base_config.model_type,
                summary=describe(meta, self.base_config, self.device_dtype_bytes), provenance=provenance,
                status="ready")
            s.add(version)
            s.flush()
            return _version_info(adapter, version)

        return in_transaction(self.db, insert)

    def resolve(self, tenant_id: str, ref: str) -> AdapterVersionInfo:
        """The version a request for `ref` uses: `name` (the tenant's own, else a public adapter of the
        shared tenant), `ad_<id>`, `owner/name` (a public adapter of another tenant), each optionally
        `@<version>`; the latest ready version by default."""
        with self.db.session() as s:
            adapter, version = self._find(s, tenant_id, ref)
            stmt = select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id,
                                                AdapterVersion.status == "ready")
            stmt = (stmt.where(AdapterVersion.version == version) if version is not None
                    else stmt.order_by(AdapterVersion.version.desc()).limit(1))
            row = s.scalar(stmt)
            if row is None:
                raise AdapterNotFoundError(f"adapter {ref!r} not found")
            return _version_info(adapter, row)

    def _find(self, s: Session, tenant_id: str, ref: str) -> tuple[Adapter, int | None]:
        not_found = AdapterNotFoundError(f"adapter {ref!r} not found")
        if not isinstance(ref, str) or not ref:
            raise not_found
        base_ref, _, version_text = ref.partition("@")
        version = None
        if version_text:
            # ASCII digits only ('²'.isdigit() is true), and no number too big for the SQL INTEGER column.
            if not (version_text.isascii() and version_text.isdigit()) or len(version_text) > _MAX_VERSION_DIGITS:
                raise not_found
            version = int(version_text)
        live = select(Adapter).where(Adapter.deleted_at.is_(None))
        if base_ref.startswith("ad_"):
            adapter = s.scalar(live.where(Adapter.id == base_ref))
        elif "/" in base_ref:
            owner, _, name = base_ref.partition("/")
            adapter = s.scalar(live.join(Tenant, Tenant.id == Adapter.tenant_id)
                               .where(Tenant.name == owner, Adapter.name == name))
        else:
            adapter = s.scalar(live.where(Adapter.tenant_id == tenant_id, Adapter.name == base_ref))
            if adapter is None and self.shared_tenant:  # the operator's public adapters go by bare name too
                adapter = s.scalar(live.join(Tenant, Tenant.id == Adapter.tenant_id)
                                   .where(Tenant.name == self.shared_tenant, Adapter.name == base_ref,
                                          Adapter.visibility == "public"))
        if adapter is None or (adapter.tenant_id != tenant_id and adapter.visibility != "public"):
            raise not_found
        return adapter, version

    def was_deleted(self, tenant_id: str, name: str) -> bool:
        """Whether the tenant deleted (or unloaded) an adapter of this name and has no live one of it now."""
        with self.db.session() as s:
            rows = s.scalars(select(Adapter.deleted_at).where(Adapter.tenant_id == tenant_id,
                                                              Adapter.name == name)).all()
        return bool(rows) and all(deleted is not None for deleted in rows)

    def list(self, tenant_id: str, include_public: bool = True) -> list[AdapterVersionInfo]:
        """The latest version of each adapter the tenant may use: its own, then other tenants' public ones."""
        with self.db.session() as s:
            cond = Adapter.tenant_id == tenant_id
            if include_public:
                cond = cond | (Adapter.visibility == "public")
            latest = (select(AdapterVersion.adapter_id, func.max(AdapterVersion.version).label("v"))
                      .where(AdapterVersion.status == "ready").group_by(AdapterVersion.adapter_id).subquery())
            rows = s.execute(
                select(Adapter, AdapterVersion)
                .join(latest, latest.c.adapter_id == Adapter.id)
                .join(AdapterVersion,
                      (AdapterVersion.adapter_id == Adapter.id) & (AdapterVersion.version == latest.c.v))
                .where(Adapter.deleted_at.is_(None), cond)
                .order_by(Adapter.tenant_id != tenant_id, Adapter.name)).all()
            return [_version_info(a, v) for a, v in rows]

    def owner_of(self, adapter_id: str) -> str:
        """The tenant id owning a live adapter (for operators acting on any tenant's adapters)."""
        with self.db.session() as s:
            adapter = s.scalar(select(Adapter).where(Adapter.id == adapter_id, Adapter.deleted_at.is_(None)))
            if adapter is None:
                raise AdapterNotFoundError(f"adapter {adapter_id!r} not found")
            return adapter.tenant_id

    def list_all(self, tenant_id: str | None = None) -> list[AdapterVersionInfo]:
        """Latest version of every live adapter (of one tenant, or all): the operator's view."""
        with self.db.session() as s:
            latest = (select(AdapterVersion.adapter_id, func.max(AdapterVersion.version).label("v"))
                      .where(AdapterVersion.status == "ready").group_by(AdapterVersion.adapter_id).subquery())
            stmt = (select(Adapter, AdapterVersion)
                    .join(latest, latest.c.adapter_id == Adapter.id)
                    .join(AdapterVersion, (AdapterVersion.adapter_id == Adapter.id)
                          & (AdapterVersion.version == latest.c.v))
                    .where(Adapter.deleted_at.is_(None)).order_by(Adapter.tenant_id, Adapter.name))
            if tenant_id is not None:
                stmt = stmt.where(Adapter.tenant_id == tenant_id)
            return [_version_info(a, v) for a, v in s.execute(stmt).all()]

    def versions(self, tenant_id: str, ref: str) -> list[AdapterVersionInfo]:
        """Every ready version of one visible adapter, oldest first."""
        with self.db.session() as s:
            adapter, _ = self._find(s, tenant_id, ref.partition("@")[0])
            rows = s.scalars(select(AdapterVersion).where(AdapterVersion.adapter_id == adapter.id,
                                                          AdapterVersion.status == "ready")
                             .order_by(AdapterVersion.version)).all()
            return [_version_info(adapter, v) for v in rows]

    def set_visibility(self, tenant_id: str, ref: str, visibility: str) -> AdapterVersionInfo:
        _check_visibility(visibility)
        with self.db.session() as s:
            adapter, _ = self._find(s, tenant_id, ref.partition("@")[0])
            if adapter.tenant_id != tenant_id:
                raise AdapterNotFoundError(f"adapter {ref!r} not found")  # public but not yours to change
            adapter.visibility = visibility
        return self.resolve(tenant_id, adapter.id)

    def delete(self, tenant_id: str, ref: str) -> list[AdapterVersionInfo]:
        """Soft-delete an adapter the tenant owns and all its versions; in-flight requests finish."""
        with self.db.session() as s:
            adapter, _ = self._find(s, tenant_id, ref.partition("@")[0])
            if adapter.tenant_id != tenant_id:
                raise AdapterNotFoundError(f"adapter {ref!r} not found")
            adapter.deleted_at = utcnow()
            gone = []
            for v in adapter.versions:
                if v.status == "ready":
                    gone.append(_version_info(adapter, v))
                    v.status = "deleted"
        for digest, key in dict.fromkeys((info.digest, info.storage_key) for info in gone):
            try:
                unused = _drop_blob_if_unused(self.db, self.store, digest, key)
            except Exception:  # noqa: BLE001 - the rows are deleted; `loramux db gc` removes the blob later
                log.exception("could not check blob %s after deleting adapter %s", key, ref)
                continue
            if unused:
                self._tell_deleted([digest])
        return gone

    def collect_garbage(self, grace_s: float = DEFAULT_GC_GRACE_S) -> list[str]:
        """See the module function `collect_garbage`."""
        return collect_garbage(self.db, self.store, grace_s)


# -- the blob lifecycle: the only code that decides whether a blob may be deleted -------------------------

def _reserve_blob(db: Database, digest: str, key: str) -> None:
    """Record (and commit) an upload about to write the blob, before it writes it."""

    def reserve(s: Session) -> None:  # run again when another upload of the same bytes created the row meanwhile
        done = rowcount(s.execute(update(AdapterBlob).where(AdapterBlob.digest == digest)
                                  .values(pending=AdapterBlob.pending + 1, updated_at=utcnow())
                                  .execution_options(synchronize_session=False)))
        if not done:
            s.add(AdapterBlob(digest=digest, storage_key=key, pending=1, updated_at=utcnow()))

    in_transaction(db, reserve)


def _drop_blob_if_unused(db: Database, store: ObjectStore, digest: str, key: str,
                         grace_s: float = DEFAULT_GC_GRACE_S, release: bool = False) -> bool:
    """With the blob's row locked: delete the blob if no ready version uses `digest` and no upload younger
    than `grace_s` has reserved it (`release`: first give back the caller's own reservation). Returns whether
    the digest is unused (its blob deleted, or left for `collect_garbage` when the store failed)."""

    def drop(s: Session) -> bool:  # run again when an upload created the row meanwhile: then lock that one
        now = utcnow()
        pending = (case((AdapterBlob.pending > 0, AdapterBlob.pending - 1), else_=0) if release
                   else AdapterBlob.pending)
        locked = rowcount(s.execute(update(AdapterBlob).where(AdapterBlob.digest == digest).values(pending=pending)
                                    .execution_options(synchronize_session=False)))
        if not locked:  # a blob from before this table, or a leftover: lock a new row for it
            s.add(AdapterBlob(digest=digest, storage_key=key, pending=0, updated_at=now))
            s.flush()
        row = s.scalar(select(AdapterBlob).where(AdapterBlob.digest == digest))
        assert row is not None  # locked above, or added
        in_use = s.scalar(select(func.count()).select_from(AdapterVersion)
                          .where(AdapterVersion.digest == digest, AdapterVersion.status == "ready"))
        if in_use or (row.pending > 0 and row.updated_at > now - timedelta(seconds=grace_s)):
            return False
        try:
            store.delete(key)
        except StoreError:
            log.warning("could not delete blob %s from the store; `loramux db gc` removes it later", key)
            row.pending, row.updated_at = 0, now
            return True
        s.delete(row)
        return True

    return in_transaction(db, drop)


def _digest_of(key: str) -> str | None:
    digest = key.rsplit("/", 1)[-1]
    try:
        return digest if blob_key(digest) == key else None
    except ValueError:
        return None


def collect_garbage(db: Database, store: ObjectStore, grace_s: float = DEFAULT_GC_GRACE_S) -> list[str]:
    """Delete store blobs that no ready version references and no upload younger than `grace_s` seconds
    has reserved (left by a store outage during a delete, or by an upload that died between its put and
    its insert); return their keys. `loramux db gc` runs it."""
    with db.session() as s:
        live = set(s.scalars(select(AdapterVersion.storage_key).where(AdapterVersion.status == "ready")))
        rows = {r.storage_key: r.digest for r in s.scalars(select(AdapterBlob))}
    removed = []
    for key in store.list_keys("blobs/"):
        if key in live:
            continue
        digest = _digest_of(key)
        if digest is None:  # not a name the registry makes: nothing references or reserves it
            store.delete(key)
            removed.append(key)
        elif _drop_blob_if_unused(db, store, digest, key, grace_s):
            removed.append(key)
        rows.pop(key, None)
    for key, digest in rows.items():  # rows of blobs the store no longer has (e.g. an upload died before its put)
        if key not in live:
            _drop_blob_if_unused(db, store, digest, key, grace_s)
    return removed
