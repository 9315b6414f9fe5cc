"""`Services`: what the server (and scripts) hold; its parts stay independent of each other and of HTTP.
`loramux.services.builder` wires them from Settings.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.adapters.residency.cache_levels import AdapterCache
from loramux.adapters.residency.medusa_cache import MedusaCache
from loramux.adapters.residency.pins import PinnedAdapters
from loramux.adapters.storage.medusa_registry import MedusaRegistry
from loramux.adapters.storage.registry import AdapterRegistry
from loramux.adapters.storage.store import ObjectStore
from loramux.billing.budgets import BudgetBook
from loramux.billing.ledger import LedgerWriter
from loramux.billing.pricing import PriceBook
from loramux.billing.webhook_delivery import WebhookDispatcher
from loramux.db import Database
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
    # Spend limits and the reservations of requests in flight (None only for Services built by hand in tests).
    budgets: BudgetBook | None = None
    # Delivers budget alerts from the webhook outbox (None only for Services built by hand in tests).
    webhooks: WebhookDispatcher | None = None
    pinned: PinnedAdapters = field(init=False)  # adapters operators pin in host RAM (through adapter_cache)

    def __post_init__(self) -> None:
        self.pinned = PinnedAdapters(self.adapter_cache)

    @classmethod
    def from_settings(cls, settings: Settings, engine=None, migrate: bool = True) -> Services:
        """Everything a single server needs, the engine in this process. `engine`: an LLMEngine to use instead
        of building one."""
        from loramux.services.builder import InProcess, build_services

        return build_services(settings, engine=InProcess(engine), migrate=migrate)

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
        self.adapter_cache.shutdown()  # Medusa heads load through it too
        if self.webhooks is not None:
            self.webhooks.close()  # a POST in flight finishes and its outcome is recorded
        self.db.dispose()

