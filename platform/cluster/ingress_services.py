"""The ingress's Services: registry, tenancy, prices, ledger and keys as in one process, with the engine and
the adapter tiers on the engine replicas instead (`RemoteEngine`, `RemoteAdapterCache`).

Migrations are not run here: the driver (`loramux serve --ray`) runs them once before any replica starts.
"""
from __future__ import annotations

from pathlib import Path

from loramux.adapters.registry import AdapterRegistry, AdapterVersionInfo
from loramux.adapters.tiers import Acquired
from loramux.adapters.validation import UploadLimits
from loramux.admin.keys import AdminKeys
from loramux.admin.ledger import LedgerWriter
from loramux.admin.pricing import PriceBook
from loramux.cluster.remote_engine import RemoteAdapter, RemoteEngine
from loramux.cluster.shared_state import ReplicaDirectory
from loramux.db import Database
from loramux.names import base_model_id
from loramux.services import LOCAL_TENANT, Services, store_from_settings
from loramux.settings import Settings
from loramux.tenancy import Tenancy


class RemoteAdapterCache:
    """The ingress side of the adapter tiers: nothing is loaded here; a lease names the version, which the
    replica that serves the request loads through its own tiers."""

    async def acquire(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired:
        return Acquired(RemoteAdapter(version), tier="remote", load_ms=0.0)

    def acquire_blocking(self, version: AdapterVersionInfo, timeout: float | None = None) -> Acquired:
        return Acquired(RemoteAdapter(version), tier="remote", load_ms=0.0)

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


def ingress_services(settings: Settings, engine_handle, ingress_id: str) -> Services:
    """Services for one ingress replica; `engine_handle`: the engine deployment's DeploymentHandle."""
    from transformers import AutoTokenizer

    from loramux.model.loader import read_model_config, resolve_model_dir

    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    model_config, _ = read_model_config(model_dir)
    db = Database(settings.resolved_database_url())
    store = store_from_settings(settings)
    tenancy = Tenancy(db)
    limits = UploadLimits(max_total_bytes=settings.max_upload_bytes, max_rank=settings.max_lora_rank)
    registry = AdapterRegistry(db, store, model_config, base_model_id(settings.model), limits,
                               shared_tenant=LOCAL_TENANT, tenancy=tenancy)
    directory = ReplicaDirectory(settings.redis_url, ttl_s=max(5.0, 5 * settings.cluster_snapshot_interval_s))
    engine = RemoteEngine(engine_handle, AutoTokenizer.from_pretrained(model_dir), 0, directory)
    registry.on_blob_deleted(engine.evict_adapter)
    admin_keys = AdminKeys(db)
    if settings.admin_key:
        admin_keys.ensure(settings.admin_key)
    # One spool per ingress replica: two writers must never share a write-ahead log.
    spool_dir = Path(settings.data_dir) / "ingress" / ingress_id
    spool_dir.mkdir(parents=True, exist_ok=True)
    ledger = LedgerWriter(db, spool_dir / "ledger-spool.jsonl")
    ledger.start()
    services = Services(settings, db, store, registry, RemoteAdapterCache(), engine, tenancy, admin_keys,
                        PriceBook(db), ledger)
    services.register_local_adapters()
    return services


__all__ = ["RemoteAdapterCache", "ingress_services"]
