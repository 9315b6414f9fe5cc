"""Which adapter serves a request: the one it names, resolved for its tenant (in the registry, else through the
resolver when one is configured) and brought into host RAM within the request's deadline, or, when that fails,
the tenant's fallback (another adapter or the base model)."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi.concurrency import run_in_threadpool

from loramux.adapters.residency.cache_levels import Acquired, AdapterCache, AdapterLoadError
from loramux.adapters.storage.adapter_source import SourceUnavailable
from loramux.adapters.storage.registry import (
    BASE_MODEL_ALIAS,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterVersionInfo,
)
from loramux.server.http.errors import ApiError
from loramux.services.adapter_resolver import AdapterResolver, ResolverMiss, ResolverNameInvalid, ResolverRefused
from loramux.tenancy.tenants import TenantContext

log = logging.getLogger(__name__)


async def acquire_adapter(registry: AdapterRegistry, cache: AdapterCache, tenant: TenantContext, model: str,
                          time_left: float, base_model_id: str, resolver: AdapterResolver | None = None
                          ) -> tuple[AdapterVersionInfo | None, Acquired | None, str | None]:
    """(version, its host-RAM lease, why the fallback serves instead or None) for the adapter `model`
    names: resolved in the registry for the tenant (404 when it cannot see it; with a `resolver`, a name the
    registry does not know is looked up in its store first: `resolve_unknown`) and brought into host RAM
    within `time_left`; when that fails, the tenant's fallback (the base model: no version) or a 503."""
    deadline = time.monotonic() + time_left
    try:
        version = await run_in_threadpool(resolve_adapter, registry, tenant, model, base_model_id)
    except ApiError as exc:
        if resolver is None or exc.status != 404:
            raise
        version = await resolve_unknown(resolver, tenant, model, deadline - time.monotonic(), exc)
    return await load_adapter(registry, cache, tenant, version, deadline - time.monotonic())


async def resolve_unknown(resolver: AdapterResolver, tenant: TenantContext, model: str, time_left: float,
                          not_found: ApiError) -> AdapterVersionInfo:
    """`model`, unknown to the registry, registered from the resolver's store within `time_left`: `not_found`
    when it is not there either; 400 for a name that cannot be looked up (`../x`) or an adapter there that does
    not validate (the message names the problem, never the store's location); 503 when the store cannot be
    reached or read, or the fetch outlasts the request (the fetch goes on: a retry finds it registered)."""
    try:
        return await asyncio.wait_for(resolver.resolve(tenant.tenant_id, tenant.tenant_name, model),
                                      max(0.001, time_left))
    except ResolverMiss:
        raise not_found from None
    except ResolverNameInvalid as exc:
        raise ApiError(400, str(exc), code="invalid_model", param="model") from None
    except ResolverRefused as exc:
        raise ApiError(400, str(exc), code=exc.code or "invalid_adapter", param="model") from None
    except SourceUnavailable as exc:
        raise ApiError(503, exc.reason, retry_after_s=5.0, code="adapter_unavailable") from None
    except TimeoutError:
        raise ApiError(503, f"adapter {model!r} is still being fetched from the adapter store; retry shortly",
                       retry_after_s=2.0, code="adapter_unavailable") from None


def resolve_adapter(registry: AdapterRegistry, tenant: TenantContext, model: str, base_model_id: str,
                    what: str = "model", param: str | None = None) -> AdapterVersionInfo:
    """The version `model` names for the tenant; 404 naming it (`what`: where the request named it, e.g.
    `models[2]`) when the tenant cannot see it, unknown or another tenant's private adapter alike. Blocking
    (SQL): call it in the threadpool."""
    try:
        return registry.resolve(tenant.tenant_id, model)
    except AdapterNotFoundError:
        raise ApiError(404, f"{what} {model!r} not found: use the base model ({base_model_id!r} or 'base') "
                            "or an adapter listed by GET /v1/models", code="model_not_found", param=param) from None


async def load_adapter(registry: AdapterRegistry, cache: AdapterCache, tenant: TenantContext,
                       version: AdapterVersionInfo, time_left: float
                       ) -> tuple[AdapterVersionInfo | None, Acquired | None, str | None]:
    """`version` brought into host RAM within `time_left` (its lease, to release once), or when that fails
    the tenant's fallback (the base model: no version and no lease) or a 503; as `acquire_adapter`."""
    try:
        return version, await cache.acquire(version, max(0.001, time_left)), None
    except (AdapterLoadError, TimeoutError) as exc:
        # AdapterLoadError's message is written for tenants (no store URL, bucket or path); its detail is logged.
        reason = (str(exc) if isinstance(exc, AdapterLoadError)
                  else f"adapter {version.label} could not be loaded within the request's deadline")
        if tenant.fallback in ("", "none"):
            raise ApiError(503, reason, retry_after_s=5.0, code="adapter_unavailable") from None
        log.warning("serving the fallback %r instead: %s", tenant.fallback, reason)
        if tenant.fallback == BASE_MODEL_ALIAS:
            return None, None, reason
        try:  # the fallback adapter must itself be visible and loadable
            fallback = await run_in_threadpool(registry.resolve, tenant.tenant_id, tenant.fallback)
            return fallback, await cache.acquire(fallback, max(0.001, time_left)), reason
        except Exception as fallback_exc:  # noqa: BLE001 - any failure of the fallback is a 503 too
            log.warning("the fallback %r failed too: %r", tenant.fallback, fallback_exc)
            shown = str(fallback_exc) if isinstance(fallback_exc, (AdapterLoadError, AdapterNotFoundError)) \
                else "it could not be loaded"
            raise ApiError(503, f"{reason}; the fallback {tenant.fallback!r} failed too: {shown}",
                           retry_after_s=5.0, code="adapter_unavailable") from None
