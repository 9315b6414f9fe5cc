"""The resolver (vLLM's resolver plugins, filesystem and S3): a `model` the registry does not know is looked up at
`<LORAMUX_ADAPTER_RESOLVER>/<tenant name>/<model>/`, validated, registered for the tenant and served.

- **Once.** Concurrent first requests for one (tenant, name) share one fetch and one registration: the first
  starts it, the others wait for its result (in this process; replicas behind one registry may each fetch once,
  and the registry then keeps the bytes as one version: an upload of the current version's bytes is not a new
  version).
- **Misses are remembered** for `adapter_resolver_miss_ttl_s`, so a client asking again and again for a name that
  is not there costs no store round trip; an adapter put there is found once the miss expires. An adapter there
  that fails validation is remembered the same way (a 400 without a second download).
- **Unloaded stays unloaded.** A name the tenant deleted or unloaded is not fetched again (404): an explicit load
  or upload brings it back.
- **Tenants never see the store.** Errors tenants get name their adapter, never the bucket, prefix or path; what
  the store said is logged.
- **Only plain names.** A `model` that cannot be an adapter name (`../x`, a path, control characters) is refused
  before any lookup (`ResolverNameInvalid`, a 400); `owner/name`, `ad_<id>` and `name@version` references are the
  registry's alone (not resolved: their miss stays a 404), as is the base model's alias.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from anyio import CapacityLimiter, to_thread

from loramux.adapters.formats.validation_common import AdapterFormatError
from loramux.adapters.storage.adapter_source import (
    SourceInvalid,
    SourceNotFound,
    SourceUnavailable,
    SourceUnreadable,
    join_location,
)
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterVersionInfo
from loramux.names import InvalidNameError, check_name
from loramux.services.adapter_imports import fetch_and_register, s3_opener
from loramux.services.container import Services

__all__ = ["AdapterResolver", "ResolverNameInvalid", "ResolverMiss", "ResolverRefused", "check_resolver_url"]

log = logging.getLogger(__name__)
_MAX_MISSES = 10_000  # remembered misses; the oldest are forgotten first past this


class ResolverNameInvalid(ValueError):
    """The requested `model` cannot name an adapter in the resolver's store (HTTP 400)."""


class ResolverMiss(LookupError):
    """No adapter of that name in the registry or at the resolver's location (HTTP 404)."""


class ResolverRefused(ValueError):
    """The resolver's store holds an adapter of that name that cannot be served (HTTP 400); the message says why
    without naming the store. `code`: the validation check that failed, where one did."""

    code: str | None = None


def check_resolver_url(url: str) -> str:
    """LORAMUX_ADAPTER_RESOLVER as given if it is an s3://bucket/prefix/ or file:///dir/ URL, else ValueError."""
    parts = urlsplit(url)
    if parts.scheme == "s3" and parts.netloc and not (parts.query or parts.fragment or "@" in parts.netloc):
        return url
    if parts.scheme == "file" and parts.netloc in ("", "localhost") and Path(unquote(parts.path)).is_absolute():
        return url
    raise ValueError(f"LORAMUX_ADAPTER_RESOLVER must be s3://bucket/prefix/ or file:///absolute/dir/, not {url!r}")


def _plain_name(model: str) -> bool:
    """Whether `model` is meant as a name the resolver may look up, rather than a registry reference."""
    return not (model.startswith("ad_") or "@" in model)


class AdapterResolver:
    """Looks up unknown adapter names at `url`; use on the server's event loop."""

    def __init__(self, services: Services, url: str, miss_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, max_fetches: int = 2):
        """`max_fetches`: fetches running at once (each holds a worker thread through its download and validation,
        on threads of their own so that they never starve the server's threadpool)."""
        self.services, self.url = services, check_resolver_url(url)
        if urlsplit(self.url).scheme == "s3":
            s3_opener(services.settings)(self.url)  # a bad bucket name fails the server's start, not each request
        self.miss_ttl_s, self.clock = miss_ttl_s, clock
        self._limiter = CapacityLimiter(max_fetches)
        self._inflight: dict[tuple[str, str], asyncio.Future[AdapterVersionInfo]] = {}
        # (tenant id, name) -> (when it expires, the error to answer with): misses and adapters that failed validation
        self._failures: dict[tuple[str, str], tuple[float, Exception]] = {}  # copied for each answer (tracebacks)
        self.lookups = 0  # fetches started (for tests and operators)

    def _roots(self) -> list[Path]:
        """A file:// resolver's own directory is the one local root its lookups may read."""
        parts = urlsplit(self.url)
        return [Path(unquote(parts.path)).resolve()] if parts.scheme == "file" else []

    async def resolve(self, tenant_id: str, tenant_name: str, model: str) -> AdapterVersionInfo:
        """The adapter `model` names, registered from the resolver's store for the tenant when it is there.
        Raises ResolverNameInvalid (400), ResolverMiss (404: also for a name the tenant deleted or unloaded, which
        only an explicit load or upload brings back), ResolverRefused (400: the adapter there is not servable; its
        message says why without naming the store) and SourceUnavailable (503: the store could not be reached or
        read; what it said is logged for the operator)."""
        if not isinstance(model, str) or not _plain_name(model):
            raise ResolverMiss(f"adapter {model!r} not found")
        try:
            if "\\" in model or any(s in ("", ".", "..") for s in model.split("/")) and "/" in model:
                raise InvalidNameError("it is a path, not an adapter name")
            if "/" in model:  # owner/name: another tenant's public adapter, the registry's alone
                raise ResolverMiss(f"adapter {model!r} not found")
            check_name(model)
        except InvalidNameError as exc:
            raise ResolverNameInvalid(f"model {model[:200]!r} cannot be resolved: {exc}") from None
        key = (tenant_id, model)
        failed = self._failures.get(key)
        if failed is not None:
            if self.clock() < failed[0]:
                raise _copy_of(failed[1])
            del self._failures[key]
        future = self._inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(self._fetch(key, tenant_name))
            self._inflight[key] = future
            future.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(future)  # a waiter cancelled by its client leaves the fetch to the others

    async def _fetch(self, key: tuple[str, str], tenant_name: str) -> AdapterVersionInfo:
        tenant_id, name = key
        registry = self.services.registry
        try:  # registered meanwhile (by a fetch that ended between this request's registry lookup and now)?
            return await to_thread.run_sync(registry.resolve, tenant_id, name)
        except AdapterNotFoundError:
            pass
        if await to_thread.run_sync(registry.was_deleted, tenant_id, name):
            raise self._remember(key, ResolverMiss(f"adapter {name!r} was unloaded or deleted"))
        self.lookups += 1
        location = join_location(self.url, tenant_name, name)
        tenant = await to_thread.run_sync(self.services.tenancy.tenant, tenant_id)
        try:
            version = await to_thread.run_sync(fetch_and_register, self.services, tenant, name, location,
                                               self._roots(), limiter=self._limiter)
        except SourceNotFound:
            raise self._remember(key, ResolverMiss(f"adapter {name!r} not found in the registry or the resolver's "
                                                   "store")) from None
        except (SourceUnreadable, SourceUnavailable) as exc:  # the operator's to fix: logged, not shown
            log.warning("resolver could not read %s: %s", location, exc)
            raise SourceUnavailable(str(exc), f"adapter {name!r} could not be read from the adapter store; "
                                    "retry later") from None
        except SourceInvalid as exc:
            raise self._remember(key, ResolverRefused(f"adapter {name!r} in the adapter store cannot be served: "
                                                      f"{exc.reason}")) from None
        except AdapterFormatError as exc:
            refused = ResolverRefused(f"adapter {name!r} in the adapter store cannot be served: {exc}")
            refused.code = getattr(exc, "code", None)
            raise self._remember(key, refused) from None
        log.info("resolved adapter %s for tenant %s from %s: %s", name, tenant_id, location, version.label)
        return version

    def _remember(self, key: tuple[str, str], error: Exception) -> Exception:
        """Answer `error` for `key` without a lookup for `miss_ttl_s`; returns it, to raise."""
        if self.miss_ttl_s > 0:
            if len(self._failures) >= _MAX_MISSES:
                self._failures.pop(next(iter(self._failures)))
            self._failures[key] = (self.clock() + self.miss_ttl_s, _copy_of(error))
        return error


def _copy_of(error: Exception) -> Exception:
    """A fresh exception like `error` (raising one object again and again would chain its tracebacks)."""
    copy = type(error)(*error.args)
    copy.__dict__.update(error.__dict__)
    return copy
