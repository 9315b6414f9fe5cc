"""Fan-out: one prompt sent to several adapters in one call (`models` on the OpenAI routes).

The rules (docs/tenant-api.md, "Fan-out"):
- `models` names 1 to `max_fanout` adapters (the tenant tier's, and never above LORAMUX_MAX_FANOUT), each a
  reference as `model` takes it (the base model included); `model` must be the base model or `models[0]`,
  and `n` must be 1 (for several samples of one adapter, send `n` without `models`).
- No two entries may serve the same thing: the same adapter version (`alpha` and `ad_...` of it) or the base
  model twice is a 400 (a duplicate is a client mistake; it would only burn a second sequence).
- Each entry is resolved for the tenant (404 naming `models[i]`, with nothing loaded), then all are brought
  into host RAM at once, each with a single request's fallback rules; a failure gives back every lease
  already taken.
- Part i is the engine request `<request id>` (i = 0) or `<request id>.<i>`, with the part's adapter, the
  request's sampling parameters and the same seed (so each part is exactly the single request to its
  adapter); the parts run in the same engine batches. The prompt is tokenized once but each part computes
  it (a LoRA changes its KV), so each part's ledger row bills the prompt and its own completion; the
  answer's usage is the sum of the rows.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool

from loramux.adapters.residency.cache_levels import Acquired, AdapterCache
from loramux.adapters.storage.registry import AdapterRegistry, AdapterVersionInfo
from loramux.server.http.errors import ApiError
from loramux.server.serving.adapter_choice import load_adapter, resolve_adapter
from loramux.tenancy.tenants import TenantContext, TierInfo

MAX_REFERENCE_CHARS = 300  # as `model`


@dataclass(frozen=True)
class Part:
    """One adapter of a fan-out: the reference the client named, what serves it (after any fallback; None
    = the base model), its host-RAM lease (None for the base model) and why a fallback serves it."""

    requested: str
    version: AdapterVersionInfo | None
    lease: Acquired | None
    fallback_reason: str | None = None


def _invalid(message: str, param: str = "models") -> ApiError:
    return ApiError(400, message, code=f"invalid_{param}", param=param)


def check_fanout(models: Sequence[str], model: str | None, n: int, tier: TierInfo, server_max: int,
                 is_base: Callable[[str | None], bool]) -> None:
    """400 for a fan-out request that breaks a rule above and can be judged without the registry: the
    count (at least one; at most the tier's `max_fanout` and the server's LORAMUX_MAX_FANOUT), empty or
    over-long entries, an entry named twice, `model` neither the base model nor `models[0]`, `n` above 1."""
    if not models:
        raise _invalid("models must name at least one adapter (or the base model); leave it out to ask one model")
    limit = min(tier.max_fanout, server_max)
    if len(models) > limit:
        whose = f"tier {tier.name!r} allows" if tier.max_fanout <= server_max else "this server allows"
        raise _invalid(f"models names {len(models)} adapters; {whose} at most {limit} per request "
                       f"(max_fanout): name at most {limit} (or send several requests)")
    seen: dict[str, int] = {}
    for i, ref in enumerate(models):
        if not ref or len(ref) > MAX_REFERENCE_CHARS:
            raise _invalid(f"models[{i}] must be an adapter reference of 1 to {MAX_REFERENCE_CHARS} characters")
        key = "base" if is_base(ref) else ref
        if key in seen:
            raise _invalid(f"models[{i}] ({ref!r}) names the same model as models[{seen[key]}] "
                           f"({models[seen[key]]!r}); name each adapter once (for several samples of one "
                           "adapter send `n` without `models`)")
        seen[key] = i
    if not (is_base(model) or model == models[0]):
        raise _invalid(f"with models, model must be the base model ('base') or models[0] ({models[0]!r}); "
                       f"got {model!r}", param="model")
    if n != 1:
        raise _invalid(f"n={n} cannot be combined with models: each adapter gives one choice; send n without "
                       "models for several choices of one adapter", param="n")


def _resolve_all(registry: AdapterRegistry, tenant: TenantContext, models: Sequence[str], base_model_id: str,
                 is_base: Callable[[str | None], bool]) -> list[AdapterVersionInfo | None]:
    """Every entry's version (None = the base model), in order; 404 for the first the tenant cannot see and
    400 for two entries that resolve to the same version. Blocking (SQL)."""
    versions: list[AdapterVersionInfo | None] = []
    seen: dict[tuple[str, int], int] = {}
    for i, ref in enumerate(models):
        if is_base(ref):
            versions.append(None)
            continue
        version = resolve_adapter(registry, tenant, ref, base_model_id, what=f"models[{i}]", param="models")
        key = (version.adapter_id, version.version)
        if key in seen:
            raise _invalid(f"models[{i}] ({ref!r}) and models[{seen[key]}] ({models[seen[key]]!r}) are the same "
                           f"adapter version ({version.label}); name each adapter once")
        seen[key] = i
        versions.append(version)
    return versions


def release_parts(cache: AdapterCache, parts: Sequence[Part]) -> None:
    for part in parts:
        if part.lease is not None:
            cache.release(part.lease.adapter.digest)


async def acquire_parts(registry: AdapterRegistry, cache: AdapterCache, tenant: TenantContext,
                        models: Sequence[str], time_left: float, base_model_id: str,
                        is_base: Callable[[str | None], bool]) -> list[Part]:
    """The parts of a fan-out, in the order of `models`, each adapter leased in host RAM (release them with
    `release_parts`). Resolves every entry first (404 / 400 with nothing held), then loads them all at once
    within `time_left`, each with the tenant's fallback rules (`load_adapter`); when one fails (503), or the
    caller is cancelled, the leases the others took are given back before the error goes on."""
    versions = await run_in_threadpool(_resolve_all, registry, tenant, models, base_model_id, is_base)

    async def load(version: AdapterVersionInfo | None):
        if version is None:
            return None, None, None
        return await load_adapter(registry, cache, tenant, version, time_left)

    tasks = [asyncio.ensure_future(load(v)) for v in versions]
    try:
        await asyncio.wait(tasks)
    finally:  # also when cancelled: a load that already finished holds a lease to give back
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        failed = [t for t in tasks if t.cancelled() or t.exception() is not None]
        if failed:
            release_parts(cache, [Part(ref, *t.result()) for ref, t in zip(models, tasks) if t not in failed])
    if failed:
        first = failed[0]
        raise first.exception() if not first.cancelled() else asyncio.CancelledError()
    return [Part(ref, *task.result()) for ref, task in zip(models, tasks)]
