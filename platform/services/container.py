"""Wiring: build the database, object store, registry, adapter cache levels and engine from Settings.

One `Services` object is what the server (and scripts) hold; its parts stay independent of each other
and of HTTP.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.adapters.formats.validation import UploadLimits
from loramux.adapters.residency.cache_levels import AdapterCache, DiskCache, HostCache
from loramux.adapters.residency.medusa_cache import MedusaCache
from loramux.adapters.storage.medusa_registry import MedusaRegistry
from loramux.adapters.storage.registry import AdapterRegistry
from loramux.adapters.storage.store import ObjectStore, open_store
from loramux.billing.ledger import LedgerWriter
from loramux.billing.ledger_wal import WAL_NAME
from loramux.billing.pricing import PriceBook
from loramux.db import Database
from loramux.names import base_model_id
from loramux.request_rates import RequestRates
from loramux.settings import Settings
from loramux.tenancy.admin_keys import AdminKeys
from loramux.tenancy.tenants import Tenancy

if TYPE_CHECKING:  # importing the engine imports torch: only for type checkers
    from loramux.engine.client import EngineClient

log = logging.getLogger(__name__)

LOCAL_TENANT = "local"  # owns the adapters named in LORAMUX_ADAPTERS


@dataclass
class Services:
    settings: Settings
    db: Database
    store: ObjectStore
    registry: AdapterRegistry
    adapter_cache: AdapterCache
    engine: EngineClient
    tenancy: Tenancy
    admin_keys: AdminKeys
    prices: PriceBook
    ledger: LedgerWriter  # every finished request's row, written off the hot path
    admin_pins: dict[str, str] = field(default_factory=dict)  # adapters pinned by operators: id -> digest
    request_rates: RequestRates = field(default_factory=RequestRates)  # recent requests per adapter id
    # Medusa heads: the registry (admin API) and their host-RAM cache (the request path); None where this
    # process serves none (a cluster ingress has the registry but no cache: its replicas run the engine).
    medusa: MedusaRegistry | None = None
    medusa_cache: MedusaCache | None = None
    # Whether requests here ever run with registry Medusa heads. False on a Ray Serve ingress (its replicas get
    # none yet): uploads are then refused with a 409 rather than stored for nothing (`services.medusa`).
    serves_medusa_heads: bool = True
    # Whether requests may combine adapters with weights (`adapters`): the composite is built from weights in
    # this process's host RAM, which a Ray Serve ingress does not hold (its replicas do): False there (a 400).
    combines_adapters: bool = True

    @classmethod
    def from_settings(cls, settings: Settings, engine=None, migrate: bool = True) -> Services:
        """Everything the server needs. `engine`: an LLMEngine to use instead of building one."""
        from loramux.engine.async_engine import AsyncEngine
        from loramux.engine.engine import LLMEngine
        from loramux.engine.structured.compile_pool import CompileLimits

        db = Database(settings.resolved_database_url())
        if migrate:
            db.upgrade()
        store = store_from_settings(settings)
        llm = engine if engine is not None else LLMEngine.from_settings(settings, load_adapters=False)
        limits = UploadLimits(max_total_bytes=settings.max_upload_bytes, max_rank=settings.max_lora_rank,
                              max_head_bytes=settings.max_adapter_head_bytes)
        tenancy = Tenancy(db)
        registry = AdapterRegistry(db, store, llm.model.config, base_model_id(settings.model), limits,
                                   shared_tenant=LOCAL_TENANT, tenancy=tenancy,
                                   device_dtype_bytes=llm.pool.dtype.itemsize if llm.pool else 4)
        disk = DiskCache(Path(settings.data_dir) / "adapter-cache", settings.disk_cache_bytes)
        cache = AdapterCache(store, disk, HostCache(settings.host_cache_bytes))
        hidden_size = llm.model.config.hidden_size
        medusa = MedusaRegistry(db, store, hidden_size, base_model_id(settings.model), limits)
        medusa_cache = MedusaCache(store, disk, hidden_size, settings.medusa_cache_bytes)
        medusa.on_blob_deleted(medusa_cache.evict)
        async_engine = AsyncEngine(llm, stalled_reader_timeout_s=settings.stalled_reader_timeout_s,
                                   compile_limits=CompileLimits.from_settings(settings))
        registry.on_blob_deleted(cache.evict)
        registry.on_blob_deleted(async_engine.evict_adapter)
        admin_keys = AdminKeys(db)
        if settings.admin_key:
            admin_keys.ensure(settings.admin_key)
        ledger = LedgerWriter(db, Path(settings.data_dir) / WAL_NAME)
        ledger.start()
        services = cls(settings, db, store, registry, cache, async_engine, tenancy, admin_keys, PriceBook(db), ledger,
                       medusa=medusa, medusa_cache=medusa_cache)
        services.register_local_adapters()
        return services

    def register_local_adapters(self) -> None:
        """Upload the adapter directories of LORAMUX_ADAPTERS into the registry (as tenant `local`)."""
        dirs = self.settings.adapter_dirs()
        if not dirs:
            return
        tenant_id = self.tenancy.ensure_tenant(LOCAL_TENANT, tier="standard")[0].id
        for name, path in dirs.items():
            path = Path(path)
            files = {f: path / f for f in ("adapter_config.json", "adapter_model.safetensors")}
            missing = [f for f, p in files.items() if not p.is_file()]
            if missing:
                raise ValueError(f"LORAMUX_ADAPTERS {name}={path}: {', '.join(missing)} not found")
            version = self.registry.register(tenant_id, name, files, visibility="public")
            log.info("adapter %s (%s) registered from %s", version.label, version.adapter_id, path)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.ledger.close()  # rows still buffered are written (or spooled to disk when the database is down)
        self.adapter_cache.shutdown()
        if self.medusa_cache is not None:
            self.medusa_cache.shutdown()
        self.db.dispose()


def store_from_settings(settings: Settings) -> ObjectStore:
    """The adapter object store that LORAMUX_STORE_URL and the LORAMUX_S3_* settings describe."""
    return open_store(settings.resolved_store_url(), endpoint_url=settings.s3_endpoint_url, region=settings.s3_region,
                      access_key_id=settings.s3_access_key_id, secret_access_key=settings.s3_secret_access_key,
                      timeout_s=settings.s3_timeout_s, max_attempts=settings.s3_max_attempts)
