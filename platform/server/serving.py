"""One request from admission to its ledger record, shared by the OpenAI and native routes.

Order of checks, cheapest first (the key and the body's size were checked before, by
`loramux.server.ingress`): timeout within the tier's maximum -> rate limits (429), with the prompt's
token count bounded from its length -> whether the queue can meet the deadline (503) -> a prompt whose
bound cannot fit the context (400) -> tokenizing -> max_tokens against the context (400) -> compiling a
structured-output constraint, off the event loop and bounded in time (400) -> the adapter: resolve in the
registry (404), bring it into host RAM within the deadline (503, or the tenant's fallback) -> the engine
(one request per choice: `n` siblings sharing the prompt's KV blocks). Everything taken on the way (rate
limit admission, adapter lease) is given back exactly once, when a later check refuses the request or when
it ends, however it ends, and the finished request goes to the ledger hooks and the metrics (one record).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from loramux.adapters.registry import BASE_MODEL_ALIAS, AdapterNotFoundError, AdapterVersionInfo
from loramux.adapters.tiers import Acquired, AdapterLoadError
from loramux.db.models import utcnow
from loramux.engine.engine import RequestError, RequestOutput
from loramux.engine.sampling_params import SamplingParams, StructuredOutput
from loramux.server.errors import ApiError, client_disconnected
from loramux.server.logs import request_id_var
from loramux.server.params import GenerationParams, check_logprob_volume, check_prompt_bound, resolve_max_tokens
from loramux.server.prompts import Prompt, tokens_per_message
from loramux.server.ratelimit import Admission, RateLimited, RateLimiter, RequestTooLarge, TierLimits
from loramux.server.response_format import compile_structured
from loramux.server.running import BILLING_WAIT_S, LOST, Running
from loramux.server.sse import guarded
from loramux.tenancy import TenantContext
from loramux.usage import RequestRecord

if TYPE_CHECKING:
    from loramux.server.metrics import ServerMetrics
    from loramux.services.container import Services

__all__ = ["BILLING_WAIT_S", "Admitted", "Running", "RunningStreamingResponse", "Server", "respond"]

log = logging.getLogger(__name__)
SEED_LIMIT = 2**63  # SamplingParams' seed range; sibling seeds wrap around within it


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

    async def admit(self, tenant: TenantContext, timeout_s: float | None, estimated_tokens: int,
                    arrival: float, slots: int = 1) -> Admitted:
        """The checks that cost nothing but a lookup, before any work on the prompt: the timeout within the
        tier's maximum (400), the rate limits with `estimated_tokens` (429; 400 when it can never fit), the
        queue deadline (503). Raises ApiError with nothing held, or returns the admission the caller must
        hand to `launch` or give back (`Admitted.release`). `slots`: the sequences it runs (its `n`
        choices), each counted against the tier's concurrency limit. A limiter that talks to another
        process (Redis) says so with `blocking = True` and is called in the threadpool, never on the
        event loop."""
        timeout = self._timeout(tenant, timeout_s)
        args = (tenant.tenant_id, tenant.tier.name, tenant_limits(tenant), estimated_tokens)
        try:
            if getattr(self.limiter, "blocking", False):
                admission = await run_in_threadpool(self.limiter.admit, *args, slots=slots)
            else:
                admission = self.limiter.admit(*args, slots=slots)
        except RateLimited as exc:
            self.metrics.count_rejected(tenant.tier.name, "rate_limited")
            raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s, code="rate_limit_exceeded") from None
        except RequestTooLarge as exc:
            raise ApiError(400, str(exc), code="request_too_large") from None
        except Exception as exc:
            if type(exc).__name__ != "LimiterUnavailable":  # the shared limiter's "closed" fail mode
                raise
            self.metrics.count_rejected(tenant.tier.name, "rejected")
            raise ApiError(503, str(exc), retry_after_s=exc.retry_after_s, code="limits_unavailable") from None
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
                               default_max_tokens: int, default_temperature: float, n: int = 1,
                               sampling: dict | None = None, logprobs_per_token: int = 0,
                               constraints: Sequence[tuple[StructuredOutput | None, str | None]] = ()) -> Running:
        """A route's request, cheapest checks first: `admit` with the prompt's token count bounded from its
        length (`Prompt.min_tokens`), then refuse a prompt whose bound cannot fit the context, and only then
        tokenize it (the threadpool), resolve max_tokens against the context, apply the route's defaults
        (`sampling`: more `SamplingParams` fields, e.g. `structured`), compile the structured-output
        `constraints` ((constraint, what it is called in messages) pairs: the one `sampling` sets, or one
        compiled only to check it; see `compile_structured`) and `launch` it as `<id_prefix>-<hex>` with
        `n` choices. The
        tokens-per-minute bucket is charged the bound (prompt + n x max_tokens) at admission and settled
        with the real prompt + completion tokens when the request ends. `logprobs_per_token`: the logprob
        entries the answer holds per generated token (top_logprobs + 1 when logprobs are asked for, else 0),
        bounded by `check_logprob_volume`. Raises ApiError with nothing held."""
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        request_id_var.set(request_id)  # log lines of this request carry its id
        engine = self.services.engine
        context = engine.max_model_len
        per_message = await tokens_per_message(engine) if prompt.messages else 0
        at_least = prompt.min_tokens(engine.max_chars_per_token, per_message)
        # Each choice generates at most max_tokens and at most the room the prompt leaves in the context; a
        # prompt bound past the context is charged as the context (it is refused right after admission).
        per_choice = min(max_tokens or default_max_tokens, max(0, context - at_least))
        admitted = await self.admit(tenant, body.timeout_s, min(at_least, context) + n * per_choice, arrival,
                                    slots=n)
        try:
            check_logprob_volume(n, per_choice, logprobs_per_token, self.services.settings.max_logprob_entries)
            check_prompt_bound(at_least, context)  # exact for token ids; a bound from the length for text
            prompt_ids = await prompt.tokenize(engine)
            max_tokens = resolve_max_tokens(max_tokens, len(prompt_ids), context, default_max_tokens)
            params = body.sampling_params(max_tokens, default_temperature, **(sampling or {}))
            for structured, what in constraints:
                await compile_structured(engine, structured, self.services.settings.structured_compile_timeout_s,
                                         what)
        except BaseException:
            admitted.release()
            raise
        return await self.launch(admitted, model, prompt_ids, params, request_id, n=n, user=body.user)

    async def start(self, tenant: TenantContext, model: str | None, prompt_ids: list[int], params: SamplingParams,
                    request_id: str, arrival: float) -> Running:
        """Admit and launch a request whose token ids and parameters are ready, or raise ApiError (nothing
        is held afterwards)."""
        request_id_var.set(request_id)
        admitted = await self.admit(tenant, params.timeout_s, len(prompt_ids) + params.max_tokens, arrival)
        return await self.launch(admitted, model, prompt_ids, params, request_id)

    async def launch(self, admitted: Admitted, model: str | None, prompt_ids: list[int], params: SamplingParams,
                     request_id: str, n: int = 1, user: str | None = None) -> Running:
        """Start an admitted request: its adapter (404, 503 or the tenant's fallback), then the engine.
        From here the admission belongs to the request (given back once when it ends); on an error it is
        given back at once and ApiError raised.

        With `n` > 1 the choices are sibling engine requests `<request_id>`, `<request_id>.1`, ...: choice 0
        starts first, and the others only once it has produced its first token, when its prompt's full KV
        blocks are in the prefix cache, so they reuse them instead of computing the prompt again. With a
        seed, choice i samples with seed + i: reproducible, and distinct from its siblings."""
        tenant, arrival = admitted.tenant, admitted.arrival
        params.timeout_s = admitted.timeout_s
        lease = None
        streams: list[AsyncIterator[RequestOutput]] = []
        ids = [request_id] + [f"{request_id}.{i}" for i in range(1, n)]
        started: list[Running] = []  # the Running, once it exists, for an abort of a stalled reader
        try:
            version, lease, fallback_reason = await self._adapter(
                tenant, model, arrival + admitted.timeout_s - time.monotonic())
            if version is not None:
                self.services.request_rates.record(version.adapter_id)
            salt = tenant.tenant_id if self.services.settings.prefix_cache_per_tenant else None
            engine = self.services.engine

            def generate(i: int) -> AsyncIterator[RequestOutput]:
                own = params if i == 0 or params.seed is None else \
                    dataclasses.replace(params, seed=(params.seed + i) % SEED_LIMIT)
                stream = engine.generate(ids[i], prompt_ids, own, priority=tenant.tier.priority,
                                         adapter=lease.adapter if lease else None, arrival=arrival, cache_salt=salt,
                                         on_abandoned=lambda out: started and self._abandon(started[0], i, out))
                streams.append(stream)
                return stream

            try:
                firsts = [await anext(generate(0))]
                siblings = await asyncio.gather(*(anext(generate(i)) for i in range(1, n)), return_exceptions=True)
                for result in siblings:
                    if isinstance(result, BaseException):
                        raise result
                firsts += siblings
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
        except BaseException:
            for stream in streams:
                await stream.aclose()  # aborts the siblings already in the engine
            admitted.release()
            if lease is not None:
                self.services.adapter_cache.release(lease.adapter.digest)
            raise
        self._admissions[request_id] = admitted.admission
        running = Running(request_id, tenant, model or BASE_MODEL_ALIAS, version, lease, fallback_reason,
                          len(prompt_ids), arrival, ids, streams, firsts, self._finished, user=user,
                          prompt_ids=prompt_ids)
        started.append(running)
        return running

    def _abandon(self, running: Running, index: int, final: RequestOutput) -> None:
        """Choice `index` was aborted for a stalled reader; its siblings share that reader: abort them too."""
        for i, rid in enumerate(running.choice_ids):
            if i != index:
                self.services.engine.abort(rid)
        running.abandon(index, final)

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

    def _finished(self, running: Running, outcome: str) -> list[Future]:
        """Give back what the request held, record its metrics and hand its one record to the ledger hooks;
        returns the futures hooks returned (the ledger's durability), which the answer waits for.

        With several choices the prompt counts once (the siblings reuse choice 0's KV blocks), its cached
        tokens are choice 0's (what the shared prompt found in the prefix cache), completion tokens add up
        over the choices, and queue / TTFT are choice 0's, the total the longest choice's."""
        admission = self._admissions.pop(running.request_id, None)
        outs = [o for o in running.lasts if o is not None]
        completion = sum(len(o.token_ids) for o in outs)
        first = running.lasts[0]
        cached = first.num_cached_tokens if first is not None else 0
        if admission is not None:
            admission.release(running.prompt_tokens + completion)
        if running.lease is not None:
            self.services.adapter_cache.release(running.lease.adapter.digest)
        timings = first.timings if first is not None and first.finished else {}
        totals = [o.timings["total_ms"] for o in outs if o.finished and o.timings.get("total_ms")]
        total_ms = max(totals) if len(totals) == len(running.lasts) else (time.monotonic() - running.arrival) * 1000
        queue_ms, ttft_ms = timings.get("queue_ms"), timings.get("ttft_ms")
        self.metrics.observe_finished(
            tier=running.tenant.tier.name, outcome=outcome, queue_s=None if queue_ms is None else queue_ms / 1000,
            ttft_s=None if ttft_ms is None else ttft_ms / 1000, e2e_s=total_ms / 1000,
            prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion)
        for gap in running.inter_token_s:
            self.metrics.observe_inter_token(gap, running.tenant.tier.name)
        if outcome == LOST:  # the client got a retriable 503 for it: its retry is what gets billed
            log.warning("request %s lost with its engine; not billed", running.request_id)
            return []
        version = running.version
        record = RequestRecord(
            request_id=running.request_id, tenant_id=running.tenant.tenant_id, key_id=running.tenant.key_id,
            tier=running.tenant.tier.name, model=self.model_id, adapter_id=version.adapter_id if version else None,
            adapter_version=version.version if version else None, adapter_digest=version.digest if version else None,
            requested=running.requested, fallback=running.fallback_reason is not None, outcome=outcome,
            prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion, queue_ms=queue_ms,
            ttft_ms=ttft_ms, total_ms=total_ms, end_user=running.user, replica=running.replica,
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
                result.add_done_callback(self._count_if_unbilled)
                billing.append(result)
        return billing

    def _count_if_unbilled(self, future: Future) -> None:
        """A ledger future resolved: count the request when its record was refused or lost (its answer is
        then a 500, see `Running._billed`)."""
        if future.exception() is not None or future.result() is not True:
            self.metrics.count_unbilled()


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


async def respond(request, running: Running, *, stream: bool, final: Callable[[list[RequestOutput]], Response],
                  events: Callable[[], AsyncIterator[str]]) -> Response:
    """The answer to a started request: `final(every choice's final output)` (called in the threadpool)
    once it ends, or with `stream` the SSE `events()`; either way the request ends (and frees what it
    holds) when the client goes away."""
    if stream:
        running.streamed = True
        return RunningStreamingResponse(guarded(events(), running.request_id), running,
                                        media_type="text/event-stream", headers=running.headers())
    outs = await collect_or_cancel(request, running)
    if outs is None:
        return client_disconnected()
    # Built and encoded in the threadpool: an answer with LORAMUX_MAX_LOGPROB_ENTRIES logprobs (131072 by
    # default, ~8 MB) took about a second to build here, which on the event loop would stall every stream.
    return await run_in_threadpool(final, outs)


async def collect_or_cancel(request, running: Running) -> list[RequestOutput] | None:
    """Run a non-streaming request to its end (its choices' final outputs), or cancel it as soon as the
    client disconnects (None)."""
    work = asyncio.ensure_future(running.finals())
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
