"""Medusa speculative-decoding heads, as operators manage them and as requests use them: upload for the base
model or for an adapter version (validated against the served model by `loramux.adapters.storage.medusa_registry`),
list, delete; and `heads_for_request`, which the serving path calls for every request it starts."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.adapters.residency.medusa_cache import MedusaLoadError
from loramux.adapters.storage.medusa_registry import MedusaHeadsInfo, MedusaRegistry
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterVersionInfo, RegistryError
from loramux.services.adapters import UploadError
from loramux.services.container import Services
from loramux.text import reject_lone_surrogates

log = logging.getLogger(__name__)

UPLOAD_FIELDS = ("tenant_id", "adapter", "version")
_MAX_VERSION_DIGITS = 9  # versions are SQL INTEGERs


class MedusaUnavailableError(RegistryError):
    """This process keeps no Medusa registry (answered as a 400)."""


class MedusaNotServedError(UploadError):
    """Heads uploaded where no request would ever run with them (a scaled-out deployment): a 409, before
    anything is stored."""

    def __init__(self):
        super().__init__(409, "Medusa heads are not served on a scaled-out (Ray Serve) deployment yet: its engine "
                              "replicas run every request without them, so this upload is refused and nothing is "
                              "stored. Requests are unaffected (heads only speed decoding up); upload the heads "
                              "to a single-process server (loramux serve without --ray) to use them")


def check_heads_served(services: Services) -> None:
    """Raise MedusaNotServedError where requests never run with registry heads (`Services.serves_medusa_heads`
    off: a Ray Serve ingress)."""
    if not services.serves_medusa_heads:
        raise MedusaNotServedError()


def _registry(services: Services) -> MedusaRegistry:
    if services.medusa is None:
        raise MedusaUnavailableError("this server keeps no Medusa heads")
    return services.medusa


def check_medusa_fields(fields: dict) -> None:
    """The text fields of an upload: only `tenant_id`, `adapter` and `version` (a misspelt field must not
    silently attach heads to the base model), no lone surrogates, `version` a number and only with `adapter`,
    an adapter name only with its `tenant_id` (UploadError 400 naming what to fix)."""
    unknown = sorted(set(fields) - set(UPLOAD_FIELDS))
    if unknown:
        raise UploadError(400, f"unexpected form field {unknown[0][:64]!r}: a Medusa upload takes the optional fields "
                               f"{', '.join(UPLOAD_FIELDS)} and the files medusa_config and medusa_heads")
    try:
        reject_lone_surrogates(fields)
    except ValueError as exc:
        raise UploadError(400, f"form fields {exc}") from None
    adapter, version = fields.get("adapter") or "", fields.get("version") or ""
    if version and not adapter:
        raise UploadError(400, "form field version needs adapter: name the adapter whose version gets the heads")
    if version and not (version.isascii() and version.isdigit() and len(version) <= _MAX_VERSION_DIGITS):
        raise UploadError(400, "form field version must be a version number (e.g. 3); leave it out for the latest")
    if adapter and not adapter.startswith("ad_") and not fields.get("tenant_id"):
        raise UploadError(400, "form field adapter names an adapter by name: give its owner's tenant_id too "
                               "(or name it by id, ad_...)")


def resolve_target(services: Services, tenant_ref: str | None, adapter_ref: str | None,
                   version: int | None = None) -> AdapterVersionInfo | None:
    """The adapter version heads attach to: `adapter_ref` (a name of the tenant `tenant_ref`, by id or name,
    or an adapter id), `version` or the latest ready one; None (the base model) without `adapter_ref`.
    Only the tenant's own adapters: a public adapter of another tenant is not found (AdapterNotFoundError),
    like an unknown one."""
    if not adapter_ref:
        return None
    registry = services.registry
    if tenant_ref:
        owner = services.tenancy.tenant(tenant_ref).id
    else:
        owner = registry.owner_of(adapter_ref)  # an ad_ id (AdapterNotFoundError for anything else)
    ref = adapter_ref if version is None else f"{adapter_ref}@{version}"
    found = registry.resolve(owner, ref)
    if found.tenant_id != owner:
        raise AdapterNotFoundError(f"adapter {ref!r} not found")
    return found


def upload_heads(services: Services, fields: dict, files: dict[str, Path]) -> MedusaHeadsInfo:
    """Validate and store uploaded heads for the adapter version the fields name (else the base model),
    replacing its active heads; `files` maps the file names to validate to their temporary paths. Runs on a
    worker thread (it reads and checks tensors). Refused first (MedusaNotServedError, 409) where no request
    would run with them."""
    import torch

    check_heads_served(services)
    torch.set_num_threads(1)  # as adapter uploads: no second OpenMP team contending with the engine's
    check_medusa_fields(fields)
    version = int(fields["version"]) if fields.get("version") else None
    target = resolve_target(services, fields.get("tenant_id") or None, fields.get("adapter") or None, version)
    return _registry(services).upload(files, target)


def list_heads(services: Services, tenant_ref: str | None = None, adapter_ref: str | None = None,
               base_only: bool = False, include_deleted: bool = False) -> list[MedusaHeadsInfo]:
    """Heads uploads, newest first: all live ones, those of one adapter (a name of `tenant_ref`'s or an
    ad_ id: AdapterNotFoundError), of one tenant's adapters, or the base model's only; `include_deleted` adds
    the history."""
    adapter_id = tenant_id = None
    if adapter_ref:
        owner = services.tenancy.tenant(tenant_ref).id if tenant_ref else services.registry.owner_of(adapter_ref)
        found = services.registry.resolve(owner, adapter_ref)
        if found.tenant_id != owner:
            raise AdapterNotFoundError(f"adapter {adapter_ref!r} not found")
        adapter_id = found.adapter_id
    elif tenant_ref:
        tenant_id = services.tenancy.tenant(tenant_ref).id
    return _registry(services).list(adapter_id, base_only=base_only, include_deleted=include_deleted,
                                    tenant_id=tenant_id)


def delete_heads(services: Services, heads_id: str) -> MedusaHeadsInfo:
    """Soft delete (MedusaNotFoundError): later requests use the base model's heads or none; running ones
    keep theirs."""
    return _registry(services).delete(heads_id)


async def heads_for_request(services: Services, version: AdapterVersionInfo | None,
                            time_left_s: float) -> MedusaHeadsWeights | None:
    """The Medusa heads a request for `version` (None: the base model) runs with: the version's own, else the
    base model's, in host RAM. Waits at most LORAMUX_MEDUSA_LOAD_WAIT_S (and `time_left_s`) for a load;
    anything that goes wrong means no heads (the request's output is the same, only not sped up by them).
    A cached lookup and a RAM hit cost no thread hop and no database query."""
    registry, cache = services.medusa, services.medusa_cache
    if registry is None or cache is None:
        return None
    try:
        found, info = registry.cached_active(version)
        if not found:
            info = await asyncio.to_thread(registry.active, version)
        if info is None:
            return None
        heads = cache.get_nowait(info.digest)
        if heads is not None:
            return heads
        wait = min(services.settings.medusa_load_wait_s, max(0.0, time_left_s))
        return await cache.get(info, wait)
    except (MedusaLoadError, TimeoutError) as exc:
        log.info("request runs without Medusa heads: %s", exc)
        return None
    except Exception:  # noqa: BLE001 - heads only speed a request up: never fail it for them
        log.exception("Medusa heads lookup failed; the request runs without them")
        return None
