"""One request from admission to its ledger record, shared by the OpenAI and native routes.

Order of checks, cheapest first: timeout within the tier's maximum -> rate limits (429) -> whether
the queue can meet the deadline (503) -> the adapter: resolve in the registry (404), bring it into host
RAM within the deadline (503, or the tenant's fallback) -> the engine. Everything taken on the way (rate
limit admission, adapter lease) is given back exactly once when the request ends, however it ends, and
the finished request goes to the ledger hooks and the metrics.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from loramux.adapters.registry import BASE_MODEL_ALIAS, AdapterNotFoundError, AdapterVersionInfo
from loramux.adapters.tiers import Acquired, AdapterLoadError
from loramux.engine.engine import RequestError, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.server.errors import ApiError, client_disconnected
from loramux.server.logs import request_id_var
from loramux.server.params import GenerationParams, resolve_max_tokens
from loramux.server.ratelimit import RateLimited, RateLimiter, RequestTooLarge, TierLimits
from loramux.server.sse import guarded
from loramux.tenancy import TenantContext
from loramux.usage import RequestRecord

if TYPE_CHECKING:
    from loramux.server.metrics import ServerMetrics
    from loramux.services import Services

log = logging.getLogger(__name__)


@dataclass
class Running:
    """A request the engine accepted: iterate `outputs()` once; it cleans up however it ends."""

    request_id: str
    tenant: TenantContext
    requested: str
    version: AdapterVersionInfo | None
    lease: Acquired | None
    fallback_reason: str | None
    prompt_tokens: int
    arrival: float
    _stream: AsyncIterator[RequestOutput]
    _first: RequestOutput
    _on_end: Callable[[Running, RequestOutput | None, str], None]
    _ended: bool = field(default=False, init=False)
    inter_token_s: list[float] = field(default_factory=list, init=False)

    @property
    def adapter_tier(self) -> str | None:
        return self.lease.tier if self.lease else None

    def extension(self, out: RequestOutput | None = None) -> dict:
        """The `loramux` extension field of responses."""
        timings = out.timings if out is not None else {}
        ext = {"request_id": self.request_id, "queue_ms": timings.get("queue_ms"), "ttft_ms": timings.get("ttft_ms"),
               "tokens_per_s": timings.get("decode_tokens_per_s"), "total_ms": timings.get("total_ms"),
               "adapter": None, "tier": self.tenant.tier.name}
        if self.version is not None:
            ext["adapter"] = {"id": self.version.adapter_id, "name": self.version.name,
                              "version": self.version.version, "cache_tier": self.adapter_tier}
        if self.fallback_reason is not None:
            ext["fallback"] = {"requested": self.requested, "reason": self.fallback_reason}
        return ext

    def headers(self) -> dict[str, str]:
        headers = {"X-Request-Id": self.request_id}
        if self.version is not None:
            headers["X-Loramux-Adapter-Version"] = f"{self.version.adapter_id}@{self.version.version}"
            headers["X-Loramux-Adapter-Tier"] = self.adapter_tier or ""
        if self.fallback_reason is not None:
            headers["X-Loramux-Fallback"] = "base" if self.version is None else self.version.name
        return headers

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs; leaving early (client gone) cancels it in the engine."""
        last = self._first
        outcome = "error"
        previous = time.monotonic() if last.new_token_ids else None
        try:
            yield last
            while not last.finished:
                last = await anext(self._stream)
                if last.new_token_ids:
                    now = time.monotonic()
                    if previous is not None:
                        self.inter_token_s.append(now - previous)
                    previous = now
                yield last
            outcome = last.finish_reason or "stop"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            await self._stream.aclose()  # aborts the engine request if it had not finished
            self.end(last, outcome)

    async def final(self) -> RequestOutput:
        last = None
        async for out in self.outputs():
            last = out
        return last

    def end(self, last: RequestOutput | None, outcome: str) -> None:
        if not self._ended:
            self._ended = True
            self._on_end(self, last, outcome)

    async def close(self) -> None:
        """Safety net for a request whose outputs were never (fully) consumed, e.g. a client gone before
        the first chunk: cancel it in the engine and give back what it holds. A no-op once it ended."""
        if not self._ended:
            await self._stream.aclose()  # aborts the engine request if it is still running
            self.end(None, "cancelled")


class Server:
    """Admission and bookkeeping around the engine for the HTTP routes."""

    def __init__(self, services: Services, limiter: RateLimiter, metrics: ServerMetrics,
                 ledger_hooks: list[Callable[[RequestRecord], None]], model_id: str):
        self.services = services
        self.limiter = limiter
        self.metrics = metrics
        self.ledger_hooks = ledger_hooks
        self.model_id = model_id
        self._admissions: dict[str, object] = {}

    def is_base(self, model: str | None) -> bool:
        return model in (None, "", BASE_MODEL_ALIAS, self.model_id)

    def _timeout(self, tenant: TenantContext, asked: float | None) -> float:
        tier = tenant.tier
        if asked is None:
            return tier.default_timeout_s
        if asked > tier.max_timeout_s:
            raise ApiError(400, f"timeout {asked:g} s is above the {tier.max_timeout_s:g} s maximum of tier "
                                  f"{tier.name!r}", code="timeout_too_long")
        return asked

    async def start_generation(self, tenant: TenantContext, model: str | None, prompt_ids: list[int],
                               body: GenerationParams, arrival: float, *, id_prefix: str, max_tokens: int | None,
                               default_max_tokens: int, default_temperature: float) -> Running:
        """`start` for a route's parameters: resolve max_tokens against the context, apply the route's
        defaults, make the request id (`<id_prefix>-<hex>`)."""
        max_tokens = resolve_max_tokens(max_tokens, len(prompt_ids), self.services.engine.max_model_len,
                                        default_max_tokens)
        params = body.sampling_params(max_tokens, default_temperature)
        return await self.start(tenant, model, prompt_ids, params, f"{id_prefix}-{uuid.uuid4().hex}", arrival)

    async def start(self, tenant: TenantContext, model: str | None, prompt_ids: list[int], params: SamplingParams,
                    request_id: str, arrival: float) -> Running:
        """Admit and start a request, or raise ApiError (nothing is held afterwards)."""
        request_id_var.set(request_id)  # log lines of this request carry its id
        timeout = self._timeout(tenant, params.timeout_s)
        params.timeout_s = timeout
        try:
            admission = self.limiter.admit(tenant.tenant_id, tenant.tier.name, tenant_limits(tenant),
                                           len(prompt_ids) + params.max_tokens)
        except RateLimited as exc:
            self.metrics.count_rejected(tenant.tier.name, "rate_limited")
            raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s, code="rate_limit_exceeded") from None
        except RequestTooLarge as exc:
            raise ApiError(400, str(exc), code="request_too_large") from None
        lease = None
        try:
            wait = self.services.engine.estimated_queue_wait_s()
            if wait > timeout:
                self.metrics.count_rejected(tenant.tier.name, "rejected")
                raise ApiError(503, f"the server is saturated: the estimated queue wait of {wait:.1f} s exceeds "
                                      f"this request's {timeout:g} s timeout; retry later",
                                 retry_after_s=max(1.0, wait - timeout), code="overloaded")
            version, lease, fallback_reason = await self._adapter(tenant, model, arrival + timeout - time.monotonic())
            salt = tenant.tenant_id if self.services.settings.prefix_cache_per_tenant else None
            stream = self.services.engine.generate(request_id, prompt_ids, params, priority=tenant.tier.priority,
                                                   adapter=lease.adapter if lease else None, arrival=arrival,
                                                   cache_salt=salt)
            try:
                first = await anext(stream)
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
        except BaseException:
            admission.release(0)
            if lease is not None:
                self.services.adapter_cache.release(lease.adapter.digest)
            raise
        self._admissions[request_id] = admission
        return Running(request_id, tenant, model or BASE_MODEL_ALIAS, version, lease, fallback_reason,
                       len(prompt_ids), arrival, stream, first, self._finished)

    async def _adapter(self, tenant: TenantContext, model: str | None, time_left: float
                       ) -> tuple[AdapterVersionInfo | None, Acquired | None, str | None]:
        if self.is_base(model):
            return None, None, None
        registry, cache = self.services.registry, self.services.adapter_cache
        try:
            version = await run_in_threadpool(registry.resolve, tenant.tenant_id, model)
        except AdapterNotFoundError:
            raise ApiError(404, f"model {model!r} not found: use the base model ({self.model_id!r} or 'base') "
                                  "or an adapter listed by GET /v1/models", code="model_not_found") from None
        try:
            return version, await cache.acquire(version, max(0.001, time_left)), None
        except (AdapterLoadError, TimeoutError) as exc:
            reason = f"adapter {version.label} could not be loaded: {exc}"
            if tenant.fallback in ("", "none"):
                raise ApiError(503, reason, retry_after_s=5.0, code="adapter_unavailable") from None
            log.warning("serving the fallback %r instead: %s", tenant.fallback, reason)
            if tenant.fallback == BASE_MODEL_ALIAS:
                return None, None, reason
            try:  # the fallback adapter must itself be visible and loadable
                fallback = await run_in_threadpool(registry.resolve, tenant.tenant_id, tenant.fallback)
                return fallback, await cache.acquire(fallback, max(0.001, time_left)), reason
            except Exception as fallback_exc:  # noqa: BLE001
                raise ApiError(503, f"{reason}; the fallback {tenant.fallback!r} failed too: {fallback_exc}",
                                 retry_after_s=5.0, code="adapter_unavailable") from None

    def _finished(self, running: Running, last: RequestOutput | None, outcome: str) -> None:
        admission = self._admissions.pop(running.request_id, None)
        completion = len(last.token_ids) if last is not None else 0
        cached = last.num_cached_tokens if last is not None else 0
        if admission is not None:
            admission.release(running.prompt_tokens + completion)
        if running.lease is not None:
            self.services.adapter_cache.release(running.lease.adapter.digest)
        timings = last.timings if last is not None and last.finished else {}
        total_ms = timings.get("total_ms") or (time.monotonic() - running.arrival) * 1000
        queue_ms, ttft_ms = timings.get("queue_ms"), timings.get("ttft_ms")
        self.metrics.observe_finished(
            tier=running.tenant.tier.name, outcome=outcome, queue_s=None if queue_ms is None else queue_ms / 1000,
            ttft_s=None if ttft_ms is None else ttft_ms / 1000, e2e_s=total_ms / 1000,
            prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion)
        for gap in running.inter_token_s:
            self.metrics.observe_inter_token(gap, running.tenant.tier.name)
        version = running.version
        record = RequestRecord(
            request_id=running.request_id, tenant_id=running.tenant.tenant_id, key_id=running.tenant.key_id,
            tier=running.tenant.tier.name, model=self.model_id, adapter_id=version.adapter_id if version else None,
            adapter_version=version.version if version else None, adapter_digest=version.digest if version else None,
            requested=running.requested, fallback=running.fallback_reason is not None, outcome=outcome,
            prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion, queue_ms=queue_ms,
            ttft_ms=ttft_ms, total_ms=total_ms)
        for hook in self.ledger_hooks:
            try:
                hook(record)
            except Exception:  # a ledger problem must never fail or hang the request path
                log.exception("ledger hook failed for request %s", running.request_id)


def tenant_limits(tenant: TenantContext) -> TierLimits:
    t = tenant.tier
    return TierLimits(requests_per_min=t.requests_per_min, tokens_per_min=t.tokens_per_min,
                      max_concurrent=t.max_concurrent)


class RunningStreamingResponse(StreamingResponse):
    """A streamed response that always ends its request, even when the client leaves before the body
    generator ever starts (its `finally` would then never run)."""

    def __init__(self, content, running: Running, **kwargs):
        super().__init__(content, **kwargs)
        self.running = running

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.running.close()


async def until_disconnected(request) -> None:
    """Return when the HTTP client goes away (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def respond(request, running: Running, *, stream: bool, final: Callable[[RequestOutput], Response],
                  events: Callable[[], AsyncIterator[str]]) -> Response:
    """The answer to a started request: `final(last output)` once it ends, or with `stream` the SSE
    `events()`; either way the request ends (and frees what it holds) when the client goes away."""
    if stream:
        return RunningStreamingResponse(guarded(events(), running.request_id), running,
                                        media_type="text/event-stream", headers=running.headers())
    out = await collect_or_cancel(request, running)
    return client_disconnected() if out is None else final(out)


async def collect_or_cancel(request, running: Running) -> RequestOutput | None:
    """Run a non-streaming request to its end, or cancel it as soon as the client disconnects."""
    work = asyncio.ensure_future(running.final())
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        try:
            await work
        except asyncio.CancelledError:
            pass
        return None
    finally:
        gone.cancel()
        await running.close()  # a no-op when the request ended normally
