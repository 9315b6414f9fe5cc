"""The ingress's Services: registry, tenancy, prices, ledger and keys as in one process, with the engine and
the adapter cache levels on the engine replicas instead (`RemoteEngine`, `RemoteAdapterCache`).

Migrations are not run here: the driver (`loramux serve --ray`) runs them once before any replica starts.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from loramux.adapters.formats.validation import UploadLimits
from loramux.adapters.residency.cache_levels import Acquired
from loramux.adapters.storage.medusa_registry import MedusaRegistry
from loramux.adapters.storage.registry import AdapterRegistry, AdapterVersionInfo
from loramux.billing.ledger import LedgerWriter
from loramux.billing.ledger_wal import LEGACY_WAL_NAMES, WAL_NAME, LogInUseError
from loramux.billing.pricing import PriceBook
from loramux.cluster.remote_engine import RemoteAdapter, RemoteEngine
from loramux.cluster.shared_state import ReplicaDirectory
from loramux.db import Database
from loramux.names import base_model_id
from loramux.services.container import LOCAL_TENANT, Services, store_from_settings
from loramux.settings import Settings
from loramux.tenancy.admin_keys import AdminKeys
from loramux.tenancy.tenants import Tenancy

log = logging.getLogger(__name__)


class RemoteAdapterCache:
    """The ingress side of the adapter cache levels: nothing is loaded here; a lease names the version, which the
    replica that serves the request loads through its own tiers. Nothing is ever pinned here either: combining
    adapters per request (`CompositionCache`) is refused on a scaled-out deployment (its components' weights
    are not on the ingress), so a composite is never built or looked up here."""

    def __init__(self):
        self.release_listeners: list = []  # CompositionCache subscribes; nothing is released here

    def pin(self, digest: str) -> None:
        return None

    async def acquire(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired:
        return Acquired(RemoteAdapter(version), level="remote", load_ms=0.0)

    def acquire_blocking(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired:
        return Acquired(RemoteAdapter(version), level="remote", load_ms=0.0)

    def release(self, digest: str) -> None:
        pass

    def evict(self, digest: str) -> None:
        pass  # the replicas drop their copies on RemoteEngine.evict_adapter's broadcast

    def has_in_ram(self, digest: str) -> bool:
        return False  # host RAM and disk are each replica's own: /admin/replicas shows where adapters live

    def has_on_disk(self, digest: str) -> bool:
        return False

    def stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


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
    lock; returns how many logs were drained. A log whose database writes fail stays for the next start."""
    drained = 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p != own):
        logs = [p for name in (WAL_NAME, *LEGACY_WAL_NAMES) for p in folder.glob(name + "*")
                if not p.name.endswith((".lock", ".rejected"))]
        if not any(p.stat().st_size for p in logs):
            continue  # no log, or an empty one: nothing to replay
        writer = LedgerWriter(db, folder / WAL_NAME)
        try:
            writer.start()
        except LogInUseError:
            continue  # a live ingress holds it
        try:
            if writer.flush(timeout_s):
                drained += 1
                log.warning("ledger: drained the orphaned log in %s", folder)
        finally:
            writer.close()
    return drained


def ingress_services(settings: Settings, engine_handle, ingress_id: str) -> Services:
    """Services for one ingress replica; `engine_handle`: the engine deployment's DeploymentHandle."""
    from transformers import AutoTokenizer

    from loramux.model.loader import read_model_config, resolve_model_dir

    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    model_config, _ = read_model_config(model_dir)
    db = Database(settings.resolved_database_url())
    store = store_from_settings(settings)
    tenancy = Tenancy(db)
    limits = UploadLimits(max_total_bytes=settings.max_upload_bytes, max_rank=settings.max_lora_rank,
                          max_head_bytes=settings.max_adapter_head_bytes)
    # The engines' device is not this process's: summaries count adapter bytes at the configured dtype, or
    # float32 for "auto" (the CPU default; a GPU engine's bfloat16 holds half).
    dtype_bytes = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}.get(settings.dtype, 4)
    registry = AdapterRegistry(db, store, model_config, base_model_id(settings.model), limits,
                               shared_tenant=LOCAL_TENANT, tenancy=tenancy, device_dtype_bytes=dtype_bytes)
    directory = ReplicaDirectory(settings.redis_url, ttl_s=max(5.0, 5 * settings.cluster_snapshot_interval_s),
                                 timeout_s=settings.redis_timeout_s)
    directory.watch()
    engine = RemoteEngine(engine_handle, AutoTokenizer.from_pretrained(model_dir), 0, directory,
                          max_repetition=settings.structured_max_repetition)
    registry.on_blob_deleted(engine.evict_adapter)
    admin_keys = AdminKeys(db)
    if settings.admin_key:
        admin_keys.ensure(settings.admin_key)
    ledger = claim_ledger(db, Path(settings.data_dir) / "ingress")
    log.info("ingress %s writes its ledger log in %s", ingress_id, ledger.wal_path.parent)
    # Medusa heads are not handed to the replicas yet (no medusa_cache: requests run without them), so uploads
    # are refused (409); heads stored by a single-process server can still be listed and deleted.
    medusa = MedusaRegistry(db, store, model_config.hidden_size, base_model_id(settings.model), limits)
    services = Services(settings, db, store, registry, RemoteAdapterCache(), engine, tenancy, admin_keys,
                        PriceBook(db), ledger, medusa=medusa, serves_medusa_heads=False,
                        combines_adapters=False)
    stored = medusa.list()
    if stored:
        log.warning("%d Medusa heads upload(s) in the registry are not used on a scaled-out deployment: requests "
                    "run without them", len(stored))
    services.register_local_adapters()
    return services


__all__ = ["RemoteAdapterCache", "adopt_orphans", "claim_ledger", "ingress_services"]
