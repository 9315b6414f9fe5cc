"""Wiring: the database, object store, registries, adapter cache levels, engine, tenancy, keys, prices and ledger
built from Settings, once for every way loramux runs.

    single server      build_services(settings, engine=InProcess())            (`Services.from_settings`)
    Ray Serve ingress  build_services(settings, engine=Remote(...), ledger_slots=..., migrate=False)
    Ray engine replica build_engine_side(settings, store, disk_dir)            (no database: the ingress has it)
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.adapters.formats.validation import UploadLimits
from loramux.adapters.residency.cache_levels import AdapterCache, DiskCache, HostCache
from loramux.adapters.residency.medusa_cache import MedusaCache
from loramux.adapters.storage.medusa_registry import MedusaRegistry
from loramux.adapters.storage.registry import AdapterRegistry
from loramux.adapters.storage.store import ObjectStore, open_store
from loramux.billing.budgets import BudgetBook, holder_of
from loramux.billing.ledger import LedgerWriter
from loramux.billing.ledger_wal import WAL_NAME
from loramux.billing.pricing import PriceBook
from loramux.billing.recovery import claim_ledger
from loramux.billing.webhook_delivery import WebhookDispatcher
from loramux.db import Database
from loramux.names import base_model_id
from loramux.services.container import LOCAL_TENANT, Services
from loramux.settings import Settings
from loramux.tenancy.admin_keys import AdminKeys
from loramux.tenancy.tenants import Tenancy

if TYPE_CHECKING:  # importing the engine imports torch: only for type checkers
    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.client import EngineClient
    from loramux.engine.engine import LLMEngine
    from loramux.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InProcess:
    """The engine runs in this process, its adapter cache levels (store -> disk -> host RAM) beside it."""

    llm: LLMEngine | None = None  # the engine to serve with; None: one is built from the settings


@dataclass(frozen=True)
class Remote:
    """The engine runs elsewhere (Ray Serve replicas), each replica with its own adapter cache levels. Requests
    here run without registry Medusa heads and cannot combine adapters: both need weights in this process's
    host RAM, which only the replicas hold."""

    client: EngineClient  # e.g. `loramux.cluster.remote_engine:RemoteEngine`
    adapter_cache: AdapterCache  # a stand-in with its methods that loads nothing here (`RemoteAdapterCache`)
    model_config: ModelConfig  # the served model's, read from its folder (no weights loaded here)


@dataclass(frozen=True)
class EngineSide:
    """An engine running in this process and the adapter cache levels that feed it."""

    llm: LLMEngine
    engine: AsyncEngine
    adapter_cache: AdapterCache  # Medusa heads load through it too


def store_from_settings(settings: Settings) -> ObjectStore:
    """The adapter object store that LORAMUX_STORE_URL and the LORAMUX_S3_* settings describe."""
    return store_at(settings, settings.resolved_store_url())


def store_at(settings: Settings, url: str) -> ObjectStore:
    """A store at `url` (file:// or s3://) reached with the server's LORAMUX_S3_* endpoint and credentials."""
    return open_store(url, endpoint_url=settings.s3_endpoint_url, region=settings.s3_region,
                      access_key_id=settings.s3_access_key_id, secret_access_key=settings.s3_secret_access_key,
                      timeout_s=settings.s3_timeout_s, max_attempts=settings.s3_max_attempts)


def build_engine_side(settings: Settings, store: ObjectStore, disk_dir: Path, llm: LLMEngine | None = None,
                      ) -> EngineSide:
    """The engine loop (`AsyncEngine`) over `llm` (built from the settings when None) and the adapter cache
    levels store -> disk (`disk_dir`) -> host RAM."""
    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.engine import LLMEngine
    from loramux.engine.structured.compile_pool import CompileLimits

    llm = llm if llm is not None else LLMEngine.from_settings(settings, load_adapters=False)
    engine = AsyncEngine(llm, stalled_reader_timeout_s=settings.stalled_reader_timeout_s,
                         compile_limits=CompileLimits.from_settings(settings))
    cache = AdapterCache(store, DiskCache(disk_dir, settings.disk_cache_bytes), HostCache(settings.host_cache_bytes))
    return EngineSide(llm, engine, cache)


def build_services(settings: Settings, *, engine: InProcess | Remote, ledger_slots: Path | None = None,
                   migrate: bool = True) -> Services:
    """Everything a server process holds.

    engine: `InProcess` (the engine, the adapter cache levels and the Medusa heads cache live here) or `Remote`
      (on engine replicas: this process serves neither registry Medusa heads nor combined adapters).
    ledger_slots: None: this process owns the ledger log in the data dir. A folder: processes share it (Ray
      ingresses); this one claims a free slot and drains the logs nobody holds (`loramux.billing.recovery`).
    migrate: upgrade the database first (a cluster's driver does it once, before any ingress starts)."""
    db = Database(settings.resolved_database_url())
    if migrate:
        db.upgrade()
    store = store_from_settings(settings)
    limits = UploadLimits(max_total_bytes=settings.max_upload_bytes, max_rank=settings.max_lora_rank,
                          max_head_bytes=settings.max_adapter_head_bytes)
    tenancy = Tenancy(db)
    if isinstance(engine, InProcess):
        side = build_engine_side(settings, store, Path(settings.data_dir) / "adapter-cache", engine.llm)
        client, cache, model_config = side.engine, side.adapter_cache, side.llm.model.config
        dtype_bytes = side.llm.pool.dtype.itemsize if side.llm.pool else 4
    else:
        side, client, cache, model_config = None, engine.client, engine.adapter_cache, engine.model_config
        # The engines' device is not this process's: summaries count adapter bytes at the configured dtype, or
        # float32 for "auto" (the CPU default; a GPU engine's bfloat16 holds half).
        dtype_bytes = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}.get(settings.dtype, 4)
    local = side is not None
    registry = AdapterRegistry(db, store, model_config, base_model_id(settings.model), limits,
                               shared_tenant=LOCAL_TENANT, tenancy=tenancy, device_dtype_bytes=dtype_bytes)
    registry.on_blob_deleted(cache.evict)
    registry.on_blob_deleted(client.evict_adapter)
    medusa = MedusaRegistry(db, store, model_config.hidden_size, base_model_id(settings.model), limits)
    medusa_cache = None
    if side is not None:
        medusa_cache = MedusaCache(side.adapter_cache, model_config.hidden_size, settings.medusa_cache_bytes)
        medusa.on_blob_deleted(medusa_cache.evict)
    admin_keys = AdminKeys(db)
    if settings.admin_key:
        admin_keys.ensure(settings.admin_key)
    if ledger_slots is None:
        ledger = LedgerWriter(db, Path(settings.data_dir) / WAL_NAME)
        ledger.start()
    else:
        ledger = claim_ledger(db, ledger_slots)
    budgets = BudgetBook(db, holder_of(ledger.wal_path))
    # The holds an earlier run left: its log's replay (in SQL once this flush returns) drops those of requests it
    # billed; the rest never reached the log, and go.
    threading.Thread(target=lambda: ledger.flush() and budgets.clear_leftovers(), daemon=True,
                     name="budget-leftovers").start()
    services = Services(settings, db, store, registry, cache, client, tenancy, admin_keys, PriceBook(db), ledger,
                        medusa=medusa, medusa_cache=medusa_cache, serves_medusa_heads=local, combines_adapters=local,
                        budgets=budgets, webhooks=WebhookDispatcher.from_settings(db, settings))
    if not local and (stored := medusa.list()):
        # Uploads are refused (409); heads a single-process server stored can still be listed and deleted.
        log.warning("%d Medusa heads upload(s) in the registry are not used on a scaled-out deployment: requests "
                    "run without them", len(stored))
    services.register_local_adapters()
    return services
