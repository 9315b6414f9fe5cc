"""One request from admission to its ledger record, shared by the OpenAI and native routes.

Order of checks, cheapest first (the key and the body's size were checked before, by
`loramux.server.ingress`): timeout within the tier's maximum -> rate limits (429), with the prompt's
token count bounded from its length -> whether the queue can meet the deadline (503) -> a prompt whose
bound cannot fit the context (400) -> tokenizing -> max_tokens against the context (400) -> the adapter:
resolve in the registry (404), bring it into host RAM within the deadline (503, or the tenant's
fallback) -> the engine. Everything taken on the way (rate limit admission, adapter lease) is given back
exactly once, when a later check refuses the request or when it ends, however it ends, and the finished
request goes to the ledger hooks and the metrics.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from loramux.adapters.registry import BASE_MODEL_ALIAS, AdapterNotFoundError, AdapterVersionInfo
from loramux.adapters.tiers import Acquired, AdapterLoadError
from loramux.admin.ledger import durable
from loramux.db.models import utcnow
from loramux.engine.engine import RequestError, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.server.errors import ApiError, client_disconnected
from loramux.server.logs import request_id_var
from loramux.server.params import GenerationParams, check_prompt_bound, resolve_max_tokens
from loramux.server.prompts import Prompt
from loramux.server.ratelimit import Admission, RateLimited, RateLimiter, RequestTooLarge, TierLimits
from loramux.server.sse import guarded
from loramux.tenancy import TenantContext
from loramux.usage import RequestRecord

if TYPE_CHECKING:
    from loramux.server.metrics import ServerMetrics
    from loramux.services import Services

log = logging.getLogger(__name__)

BILLING_WAIT_S = 5.0  # longest an answer waits for its ledger row to be durable (a stuck disk)


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
    _on_end: Callable[[Running, RequestOutput | None, str], list[Future]]
    _ended: bool = field(default=False, init=False)
    _billing: list[Future] = field(default_factory=list, init=False)  # the ledger's durability futures
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
        """The request's outputs; leaving early (client gone) cancels it in the engine. When the last one
        has been taken, the loop ends only once the request's ledger row is durable, so whatever the
        caller sends next (the final chunk, the usage, the JSON answer) is never sent for an unbilled
        request."""
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
        await self._billed()  # only after a normal end: nobody is waiting for a cancelled request's answer

    async def _billed(self) -> None:
        """Wait until the ledger holds this request durably (its write-ahead log line is fsync'd). A stuck
        disk delays the answer at most BILLING_WAIT_S; then it goes out anyway, logged, and the record is
        still written once the disk recovers (unless the process dies first)."""
        for future in self._billing:
            try:
                await durable(future, BILLING_WAIT_S)
            except Exception:  # noqa: BLE001 - never fail a finished request because of the ledger
                log.exception("request %s: its ledger row is not durable yet; answering anyway", self.request_id)

    async def final(self) -> RequestOutput:
        last = None
        async for out in self.outputs():
            last = out
        return last

    def abandon(self, final: RequestOutput) -> None:
        """The engine aborted this request because its reader stalled (a client that stopped reading):
        give back what it holds and bill what was generated now, even if the stuck reader never returns."""
        self.end(final, "cancelled")

    def end(self, last: RequestOutput | None, outcome: str) -> None:
        if not self._ended:
            self._ended = True
            self._billing = self._on_end(self, last, outcome)

    async def close(self) -> None:
        """Safety net for a request whose outputs were never (fully) consumed, e.g. a client gone before
        the first chunk: cancel it in the engine and give back what it holds. A no-op once it ended."""
        if not self._ended:
            await self._stream.aclose()  # aborts the engine request if it is still running
            self.end(None, "cancelled")


@dataclass
class Admitted:
    """A request past `Server.admit`: its timeout and its rate-limit admission, held until `Server.launch`
    hands them to the running request or `release` gives them back (a second release does nothing)."""

    tenant: TenantContext
    timeout_s: float
    arrival: float
    admission: Admission

    def release(self) -> None:
        self.admission.release(0)  # nothing ran: the tokens taken are refunded


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

    def admit(self, tenant: TenantContext, timeout_s: float | None, estimated_tokens: int,
              arrival: float) -> Admitted:
        """The checks that cost nothing but a lookup, before any work on the prompt: the timeout within the
        tier's maximum (400), the rate limits with `estimated_tokens` (429; 400 when it can never fit), the
        queue deadline (503). Raises ApiError with nothing held, or returns the admission the caller must
        hand to `launch` or give back (`Admitted.release`)."""
        timeout = self._timeout(tenant, timeout_s)
        try:
            admission = self.limiter.admit(tenant.tenant_id, tenant.tier.name, tenant_limits(tenant),
                                           estimated_tokens)
        except RateLimited as exc:
            self.metrics.count_rejected(tenant.tier.name, "rate_limited")
            raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s, code="rate_limit_exceeded") from None
        except RequestTooLarge as exc:
            raise ApiError(400, str(exc), code="request_too_large") from None
        try:
            wait = self.services.engine.estimated_queue_wait_s()
            if wait > timeout:
                self.metrics.count_rejected(tenant.tier.name, "rejected")
                raise ApiError(503, f"the server is saturated: the estimated queue wait of {wait:.1f} s exceeds "
                                      f"this request's {timeout:g} s timeout; retry later",
                                 retry_after_s=max(1.0, wait - timeout), code="overloaded")
        except BaseException:
            admission.release(0)
            raise
        return Admitted(tenant, timeout, arrival, admission)

    async def start_generation(self, tenant: TenantContext, model: str | None, prompt: Prompt,
                               body: GenerationParams, arrival: float, *, id_prefix: str, max_tokens: int | None,
                               default_max_tokens: int, default_temperature: float) -> Running:
        """A route's request, cheapest checks first: `admit` with the prompt's token count bounded from its
        length (`Prompt.min_tokens`), then refuse a prompt whose bound cannot fit the context, and only then
        tokenize it (the threadpool), resolve max_tokens against the context, apply the route's defaults and
        `launch` it as `<id_prefix>-<hex>`. The tokens-per-minute bucket is charged the bound at admission
        and settled with the real prompt + completion tokens when the request ends. Raises ApiError with
        nothing held."""
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        request_id_var.set(request_id)  # log lines of this request carry its id
        engine = self.services.engine
        context = engine.max_model_len
        at_least = prompt.min_tokens(engine.max_chars_per_token)
        # Nothing that runs takes more than the context, so a bound past it is charged as the context.
        admitted = self.admit(tenant, body.timeout_s, min(context, at_least + (max_tokens or default_max_tokens)),
                              arrival)
        try:
            check_prompt_bound(at_least, context)  # exact for token ids; a bound from the length for text
            prompt_ids = await prompt.tokenize(engine)
            max_tokens = resolve_max_tokens(max_tokens, len(prompt_ids), context, default_max_tokens)
            params = body.sampling_params(max_tokens, default_temperature)
        except BaseException:
            admitted.release()
            raise
        return await self.launch(admitted, model, prompt_ids, params, request_id)

    async def start(self, tenant: TenantContext, model: str | None, prompt_ids: list[int], params: SamplingParams,
                    request_id: str, arrival: float) -> Running:
        """Admit and launch a request whose token ids and parameters are ready, or raise ApiError (nothing
        is held afterwards)."""
        request_id_var.set(request_id)
        admitted = self.admit(tenant, params.timeout_s, len(prompt_ids) + params.max_tokens, arrival)
        return await self.launch(admitted, model, prompt_ids, params, request_id)

    async def launch(self, admitted: Admitted, model: str | None, prompt_ids: list[int], params: SamplingParams,
                     request_id: str) -> Running:
        """Start an admitted request: its adapter (404, 503 or the tenant's fallback), then the engine.
        From here the admission belongs to the request (given back once when it ends); on an error it is
        given back at once and ApiError raised."""
        tenant, arrival = admitted.tenant, admitted.arrival
        params.timeout_s = admitted.timeout_s
        lease = None
        try:
            version, lease, fallback_reason = await self._adapter(
                tenant, model, arrival + admitted.timeout_s - time.monotonic())
            if version is not None:
                self.services.request_rates.record(version.adapter_id)
            salt = tenant.tenant_id if self.services.settings.prefix_cache_per_tenant else None
            started: list[Running] = []  # the Running, once it exists, for an abort of a stalled reader
            stream = self.services.engine.generate(request_id, prompt_ids, params, priority=tenant.tier.priority,
                                                   adapter=lease.adapter if lease else None, arrival=arrival,
                                                   cache_salt=salt,
                                                   on_abandoned=lambda out: started and started[0].abandon(out))
            try:
                first = await anext(stream)
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
        except BaseException:
            admitted.release()
            if lease is not None:
                self.services.adapter_cache.release(lease.adapter.digest)
            raise
        self._admissions[request_id] = admitted.admission
        running = Running(request_id, tenant, model or BASE_MODEL_ALIAS, version, lease, fallback_reason,
                          len(prompt_ids), arrival, stream, first, self._finished)
        started.append(running)
        return running

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

    def _finished(self, running: Running, last: RequestOutput | None, outcome: str) -> list[Future]:
        """Give back what the request held, record its metrics and hand its record to the ledger hooks;
        returns the futures hooks returned (the ledger's durability), which the answer waits for."""
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
            ttft_ms=ttft_ms, total_ms=total_ms,
            # Billed at the price in force when the request arrived: its wall-clock arrival time.
            created_at=utcnow() - timedelta(seconds=time.monotonic() - running.arrival))
        billing = []
        for hook in self.ledger_hooks:
            try:
                result = hook(record)
            except Exception:  # a ledger problem must never fail or hang the request path
                log.exception("ledger hook failed for request %s", running.request_id)
                continue
            if isinstance(result, Future):
                billing.append(result)
        return billing


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
