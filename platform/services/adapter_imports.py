"""Adapters imported from where they already are (vLLM's `load_lora_adapter` / `unload_lora_adapter`): an
`s3://` prefix or a directory under LORAMUX_ADAPTER_IMPORT_ROOTS, fetched (`loramux.adapters.storage.adapter_source`)
and registered through the ordinary upload path (validation, digest, versions) for one tenant.

Unloading is the admin API's delete: the adapter is soft-deleted (later requests get 404), requests running on it
finish, and once its blob is unused its host RAM and device copies are dropped. Caches are keyed by the version's
content digest, so an adapter loaded again under the same name never meets the old one's copies or KV blocks.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from loramux.adapters.storage.adapter_source import fetch_adapter, parse_roots
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterVersionInfo
from loramux.adapters.storage.store import ObjectStore
from loramux.names import check_name
from loramux.services.builder import store_at
from loramux.services.container import Services
from loramux.settings import Settings
from loramux.tenancy.tenants import TenantInfo

__all__ = ["AdapterAlreadyLoaded", "import_tenant", "load_adapter", "unload_adapter", "fetch_and_register",
           "s3_opener"]


class AdapterAlreadyLoaded(ValueError):
    """`lora_name` already names a live adapter of the tenant and the request did not ask to replace it (400, as
    vLLM answers a second load of one name)."""


class ImportTenantMissing(ValueError):
    """No tenant was named for an import: neither the header nor LORAMUX_ADAPTER_IMPORT_TENANT (400)."""


def s3_opener(settings: Settings):
    """`open_s3(url)` for `fetch_adapter`: an S3 store at `url` with the server's endpoint and credentials."""
    def open_s3(url: str) -> ObjectStore:
        return store_at(settings, url)
    return open_s3


def import_tenant(services: Services, named: str | None) -> TenantInfo:
    """The tenant an import is for: `named` (the X-Loramux-Tenant header: an id or a name), else
    LORAMUX_ADAPTER_IMPORT_TENANT (TenantNotFoundError, ImportTenantMissing)."""
    ref = (named or "").strip() or services.settings.adapter_import_tenant
    if not ref:
        raise ImportTenantMissing("name the tenant the adapter is for: send the X-Loramux-Tenant header (a tenant "
                                  "id or name) or set LORAMUX_ADAPTER_IMPORT_TENANT")
    return services.tenancy.tenant(ref)


def fetch_and_register(services: Services, tenant: TenantInfo, name: str, location: str,
                       roots: list[Path]) -> AdapterVersionInfo:
    """Fetch the adapter at `location` (under `roots` when local) into a temporary directory, always removed, and
    register it as the next version of (tenant, name). Blocking: run it in a worker thread. Raises the
    adapter_source errors, AdapterFormatError (validation) and RegistryError."""
    import torch

    torch.set_num_threads(1)  # as an upload: no second OpenMP team competing with the engine's
    settings = services.settings
    tmp = Path(tempfile.mkdtemp(prefix="loramux-import-"))
    try:
        files = fetch_adapter(location, tmp, roots=roots, open_s3=s3_opener(settings),
                              max_weights_bytes=settings.max_upload_bytes)
        return services.registry.register(tenant.id, name, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_adapter(services: Services, tenant: TenantInfo, name: str, location: str,
                 replace: bool = False) -> AdapterVersionInfo:
    """vLLM's load: register the adapter at `location` as `name` for `tenant`. A live adapter of that name is
    AdapterAlreadyLoaded unless `replace` (vLLM's `load_inplace`), which adds a new version (the same bytes again
    return the current version). Blocking."""
    check_name(name)
    if not replace:
        try:
            current = services.registry.resolve(tenant.id, name)
        except AdapterNotFoundError:
            current = None
        if current is not None and current.tenant_id == tenant.id:
            raise AdapterAlreadyLoaded(f"adapter {name!r} is already loaded (version {current.version}): unload it "
                                       "first, or send load_inplace: true to load a new version")
    return fetch_and_register(services, tenant, name, location, parse_roots(services.settings.adapter_import_roots))


def unload_adapter(services: Services, tenant: TenantInfo, name: str) -> list[AdapterVersionInfo]:
    """vLLM's unload: soft-delete the tenant's adapter `name` (AdapterNotFoundError when it has none of that name;
    a public adapter of another tenant is not its to unload). Blocking."""
    from loramux.services.adapters import delete_adapter

    check_name(name)  # a name: not `ad_<id>` or `name@version`, which would delete more than the caller named
    version = services.registry.resolve(tenant.id, name)
    if version.tenant_id != tenant.id:
        raise AdapterNotFoundError(f"adapter {name!r} not found")
    return delete_adapter(services, version.adapter_id)
