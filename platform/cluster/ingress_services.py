"""The ingress's Services: registry, tenancy, prices, ledger and keys as in one process, with the engine and
the adapter cache levels on the engine replicas instead (`RemoteEngine`, `RemoteAdapterCache`), and a ledger
log slot of its own among the ingresses' (`loramux.billing.recovery`). The wiring is
`loramux.services.builder:build_services`.

Migrations are not run here: the driver (`loramux serve --ray`) runs them once before any replica starts.
"""
from __future__ import annotations

import logging
from pathlib import Path

from loramux.adapters.residency.cache_levels import Acquired
from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.cluster.remote_engine import RemoteAdapter, RemoteEngine
from loramux.cluster.shared_state import shared_directory, snapshot_ttl_s
from loramux.services.builder import Remote, build_services
from loramux.services.container import Services
from loramux.settings import Settings

log = logging.getLogger(__name__)


class RemoteAdapterCache:
    """The ingress side of the adapter cache levels: nothing is loaded here; a lease names the version, which the
    replica that serves the request loads through its own levels. Nothing is ever leased here either: combining
    adapters per request (`CompositionCache`) is refused on a scaled-out deployment (its components' weights
    are not on the ingress), so a composite is never built or looked up here."""

    def __init__(self):
        self.release_listeners: list = []  # CompositionCache subscribes; nothing is released here

    def lease(self, digest: str) -> None:
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


def ingress_services(settings: Settings, engine_handle, ingress_id: str) -> Services:
    """Services for one ingress replica; `engine_handle`: the engine deployment's DeploymentHandle."""
    from transformers import AutoTokenizer

    from loramux.model.loader import read_model_config, resolve_model_dir

    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    model_config, _ = read_model_config(model_dir)
    directory = shared_directory(settings.redis_url, snapshot_ttl_s(settings.cluster_snapshot_interval_s),
                                 settings.redis_timeout_s)  # the engine handle's request router reads it too
    directory.watch()
    engine = RemoteEngine(engine_handle, AutoTokenizer.from_pretrained(model_dir), 0, directory,
                          max_repetition=settings.structured_max_repetition)
    services = build_services(settings, engine=Remote(engine, RemoteAdapterCache(), model_config),
                              ledger_slots=Path(settings.data_dir) / "ingress", migrate=False)
    log.info("ingress %s writes its ledger log in %s", ingress_id, services.ledger.wal_path.parent)
    return services


__all__ = ["RemoteAdapterCache", "ingress_services"]
