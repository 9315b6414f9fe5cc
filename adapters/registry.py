"""The adapter registry: tenants' adapters and their versions in SQL, weights in the object store.

`register` validates an upload completely before anything is stored, writes the blob under a key made
from its digest, then commits the rows; a failure at any point leaves neither rows nor an orphaned blob.
`resolve` answers "not found" identically for an adapter that does not exist and one the tenant may not
see. Deleting is soft for rows (history and billing keep their references) and hard for blobs no live
version still uses; listeners (the cache tiers) are told so they drop their copies.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loramux.adapters.blob import pack, unpack
from loramux.adapters.store import ObjectStore, StoreError, blob_key
from loramux.adapters.validation import UploadLimits, validate_adapter_files
from loramux.db import Adapter, AdapterVersion, Database, Tenant
from loramux.db.models import utcnow
from loramux.model.config import ModelConfig
from loramux.names import BASE_MODEL_ALIAS, InvalidNameError, check_name
from loramux.tenancy import Tenancy

log = logging.getLogger(__name__)

__all__ = ["AdapterNotFoundError", "AdapterRegistry", "AdapterVersionInfo", "BASE_MODEL_ALIAS", "InvalidNameError",
           "RegistryError"]

VISIBILITIES = ("private", "public")


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
    base_model: str
    created_at: datetime

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"


def _version_info(a: Adapter, v: AdapterVersion) -> AdapterVersionInfo:
    return AdapterVersionInfo(
        adapter_id=a.id, tenant_id=a.tenant_id, name=a.name, visibility=a.visibility, version=v.version,
        digest=v.digest, storage_key=v.storage_key, size_bytes=v.size_bytes, rank=v.rank, alpha=v.alpha,
        use_rslora=v.use_rslora, target_modules=tuple(v.target_modules), base_model=v.base_model,
        created_at=v.created_at)


def _check_visibility(visibility: str) -> None:
    if visibility not in VISIBILITIES:
        raise InvalidNameError(f"visibility must be one of {', '.join(VISIBILITIES)}, got {visibility!r}")


class AdapterRegistry:
    def __init__(self, db: Database, store: ObjectStore, base_config: ModelConfig, base_model_id: str,
                 limits: UploadLimits = UploadLimits(), shared_tenant: str | None = None,
                 tenancy: Tenancy | None = None):
        self.db = db
        self.tenancy = tenancy or Tenancy(db)  # the owner of tenants: uploads check the tenant through it
        self.shared_tenant = shared_tenant  # its public adapters resolve by bare name for every tenant
        self.store = store
        self.base_config = base_config
        self.base_model_id = base_model_id
        self.limits = limits
        self._delete_listeners: list[Callable[[str], None]] = []

    def on_blob_deleted(self, listener: Callable[[str], None]) -> None:
        """Call `listener(digest)` when no live version uses a digest any more (caches drop it)."""
        self._delete_listeners.append(listener)

    # -- adapters --------------------------------------------------------------------------------
    def register(self, tenant_id: str, name: str, files: Mapping[str, bytes | Path],
                 visibility: str = "private") -> AdapterVersionInfo:
        """Validate and store an upload as the next version of `name` (created when new). Uploading the
        bytes of the current version again returns that version instead of adding an identical one."""
        check_name(name)
        _check_visibility(visibility)
        self.tenancy.tenant(tenant_id)
        valid = validate_adapter_files(files, self.base_config, self.limits, self.base_model_id)
        blob, digest = pack(valid.rank, valid.alpha, valid.use_rslora, valid.target_modules, valid.tensors)
        del valid
        key = blob_key(digest)
        self.store.put(key, blob)
        try:
            return self._insert_version(tenant_id, name, visibility, digest, key, len(blob), blob)
        except BaseException:
            self._delete_blob_if_unused(digest, key)
            raise

    def _insert_version(self, tenant_id, name, visibility, digest, key, size, blob) -> AdapterVersionInfo:
        meta = unpack(blob, name)  # the normalised config, as the engine will see it
        for attempt in range(5):  # two uploads of one name racing for the same version number
            try:
                with self.db.session() as s:
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
                        target_modules=list(meta.target_modules), base_model=self.base_model_id, status="ready")
                    s.add(version)
                    s.flush()
                    return _version_info(adapter, version)
            except IntegrityError:
                if attempt == 4:
                    raise
        raise AssertionError("unreachable")

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
            if not version_text.isdigit():
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
        for info in gone:
            self._delete_blob_if_unused(info.digest, info.storage_key)
        return gone

    def _delete_blob_if_unused(self, digest: str, key: str) -> None:
        with self.db.session() as s:
            in_use = s.scalar(select(func.count()).select_from(AdapterVersion)
                              .where(AdapterVersion.digest == digest, AdapterVersion.status == "ready"))
        if in_use:
            return
        try:
            self.store.delete(key)
        except StoreError:
            log.warning("could not delete blob %s from the store; `loramux db gc` removes it later", key)
        for listener in self._delete_listeners:
            listener(digest)

    def collect_garbage(self) -> list[str]:
        """See the module function `collect_garbage`."""
        return collect_garbage(self.db, self.store)


def collect_garbage(db: Database, store: ObjectStore) -> list[str]:
    """Delete store blobs that no ready version references (left by a store outage during a delete);
    return their keys. `loramux db gc` runs it."""
    with db.session() as s:
        live = set(s.scalars(select(AdapterVersion.storage_key).where(AdapterVersion.status == "ready")))
    removed = [k for k in store.list_keys("blobs/") if k not in live]
    for key in removed:
        store.delete(key)
    return removed
