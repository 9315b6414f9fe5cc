"""One request from admission to its ledger record, shared by the OpenAI and native routes.

Order of checks, cheapest first (the key and the body's size were checked before, by
`loramux.server.http.ingress`): timeout within the tier's maximum -> rate limits (429), with the prompt's
token count bounded from its length -> whether the queue can meet the deadline (503) -> a prompt whose
bound cannot fit the context (400) -> tokenizing -> max_tokens against the context (400) -> compiling a
structured-output constraint, off the event loop and bounded in time (400) -> the adapter: resolve in the
registry (404), bring it into host RAM within the deadline (503, or the tenant's fallback) -> its Medusa
heads (the version's, else the base model's; never a refusal) -> the engine (one request per choice: `n`
siblings sharing the prompt's KV blocks). A fan-out (`models`, see `fanout`) checks its list first, is
admitted once for all its parts, resolves and loads every adapter, and runs one engine request per adapter.
Everything taken on the way (rate limit admission, adapter leases) is given back exactly once, when a later
check refuses the request or when it ends, however it ends, and the finished request goes to the ledger
hooks (one record; one per part for a fan-out) and the metrics.
The steps live beside this module: `admission`, `adapter_choice`, `running` (outputs), `record` (the end).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from loramux.adapters.composition.cache import CompositionCache
from loramux.adapters.storage.registry import BASE_MODEL_ALIAS
from loramux.billing.usage import RequestRecord
from loramux.engine.factory import device_and_dtype
from loramux.engine.outputs import RequestError, RequestOutput
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import SamplingParams, StructuredOutput
from loramux.server.http.errors import ApiError
from loramux.server.http.logs import request_id_var
from loramux.server.intake.composition import Component, check_base, parse_adapters
from loramux.server.intake.params import GenerationParams, check_logprob_volume, check_prompt_bound, resolve_max_tokens
from loramux.server.intake.prompts import Prompt, tokens_per_message
from loramux.server.intake.response_format import compile_structured
from loramux.server.serving.adapter_choice import acquire_adapter
from loramux.server.serving.admission import Admitted, admit
from loramux.server.serving.composition_choice import Composition, acquire_composition
from loramux.server.serving.fanout import Part, acquire_parts, check_fanout, release_parts
from loramux.server.serving.record import finish
from loramux.server.serving.running import Running
from loramux.services.medusa import heads_for_request
from loramux.tenancy.rate_limits import RateLimiter
from loramux.tenancy.tenants import TenantContext

if TYPE_CHECKING:
    from loramux.server.serving.metrics import ServerMetrics
    from loramux.services.container import Services

log = logging.getLogger(__name__)
SEED_LIMIT = 2**63  # SamplingParams' seed range; sibling seeds wrap around within it


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
        # Composites of requests' `adapters` (loramux.adapters.composition.weighted): in the host RAM cache, built on
        # their own threads.
        settings = services.settings
        self.compositions = CompositionCache(services.adapter_cache, settings.composition_build_threads,
                                             settings.composition_builds_per_tenant)
        self.adapter_dtype = device_and_dtype(settings)[1]  # a composite must fit it (`check_fits`)

    def is_base(self, model: str | None) -> bool:
        return model in (None, "", BASE_MODEL_ALIAS, self.model_id)

    async def admit(self, tenant: TenantContext, timeout_s: float | None, estimated_tokens: int,
                    arrival: float, slots: int = 1, requests: int = 1) -> Admitted:
        """`loramux.server.serving.admission.admit` with this server's limiter, metrics and engine."""
        return await admit(self.limiter, self.metrics, self.services.engine, tenant, timeout_s, estimated_tokens,
                           arrival, slots, requests)

    async def start_generation(self, tenant: TenantContext, model: str | None, prompt: Prompt,
                               body: GenerationParams, arrival: float, *, id_prefix: str, max_tokens: int | None,
                               default_max_tokens: int, default_temperature: float, n: int = 1,
                               sampling: dict | None = None, logprobs_per_token: int = 0,
                               constraints: Sequence[tuple[StructuredOutput | None, str | None]] = (),
                               models: Sequence[str] | None = None) -> Running:
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
        bounded by `check_logprob_volume`. `body.adapters` (a weighted composition; `model` is then the base
        model) is checked first, before admission. With `models` (a fan-out, `check_fanout` first) the request
        runs one sequence per adapter, each computing the prompt: admission holds one slot per adapter, takes one
        request per adapter from the requests-per-minute limit and is charged the prompt bound and max_tokens
        once per adapter. A request has `adapters` or `models`, not
        both. Raises ApiError with nothing held."""
        components = parse_adapters(body.adapters, self.services.settings.composition_max_adapters)
        if components is not None:
            if not self.services.combines_adapters:
                raise ApiError(400, "combining adapters per request (`adapters`) is not available on a scaled-out "
                                    "(Ray Serve) deployment yet: name one adapter in `model`",
                               code="unsupported_parameter", param="adapters")
            if models is not None:
                raise ApiError(400, "send either `adapters` (one weighted composition of adapters) or `models` (the "
                                    "prompt to each of several adapters), not both", param="models")
            check_base(model, self.is_base(model), self.model_id)
        if models is not None:
            check_fanout(models, model, n, tenant.tier, self.services.settings.max_fanout, self.is_base)
        sequences, prompts = (len(models), len(models)) if models is not None else (n, 1)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        request_id_var.set(request_id)  # log lines of this request carry its id
        engine = self.services.engine
        context = engine.max_model_len
        per_message = await tokens_per_message(engine) if prompt.messages else 0
        at_least = prompt.min_tokens(engine.max_chars_per_token, per_message)
        # Each choice generates at most max_tokens and at most the room the prompt leaves in the context; a
        # prompt bound past the context is charged as the context (it is refused right after admission).
        per_choice = min(max_tokens or default_max_tokens, max(0, context - at_least))
        admitted = await self.admit(tenant, body.timeout_s, prompts * min(at_least, context) + sequences * per_choice,
                                    arrival, slots=sequences, requests=prompts)
        try:
            check_logprob_volume(sequences, per_choice, logprobs_per_token, self.services.settings.max_logprob_entries)
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
        if models is not None:
            return await self.launch_fanout(admitted, model, models, prompt_ids, params, request_id, user=body.user)
        return await self.launch(admitted, model, prompt_ids, params, request_id, n=n, user=body.user,
                                 components=components)

    async def launch(self, admitted: Admitted, model: str | None, prompt_ids: list[int], params: SamplingParams,
                     request_id: str, n: int = 1, user: str | None = None,
                     components: list[Component] | None = None) -> Running:
        """Start an admitted request: its adapter (404, 503 or the tenant's fallback), or with `components`
        the composite of those adapters (`acquire_composition`: 404, 400, 503), then the engine.
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
        composition: Composition | None = None
        try:
            if components is not None:
                settings = self.services.settings
                composition = await acquire_composition(
                    self.services.registry, self.compositions, tenant, components,
                    arrival + admitted.timeout_s - time.monotonic(), max_rank=settings.composition_max_rank,
                    max_lora_rank=settings.max_lora_rank, base_model_id=self.model_id, dtype=self.adapter_dtype)
                lease = composition.lease
            version, plain, fallback_reason = (None, None, None) if self.is_base(model) else await acquire_adapter(
                self.services.registry, self.services.adapter_cache, tenant, model,
                arrival + admitted.timeout_s - time.monotonic(), self.model_id)
            lease = lease or plain
            if version is not None:
                self.services.request_rates.record(version.adapter_id)
            # The version's Medusa heads (else the base model's) in host RAM, or None: never a refusal.
            heads = await heads_for_request(self.services, version,
                                            arrival + admitted.timeout_s - time.monotonic())
            engine, placement = self.services.engine, self._placement(tenant)
            served = lease.adapter if lease else None  # the composite's, or the adapter's

            def generate(i: int) -> AsyncIterator[RequestOutput]:
                own = params if i == 0 or params.seed is None else \
                    dataclasses.replace(params, seed=(params.seed + i) % SEED_LIMIT)
                request = EngineRequest(ids[i], prompt_ids, own, adapter=served, arrival=arrival, medusa=heads,
                                        **placement)
                stream = engine.generate(request,
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
                          prompt_ids=prompt_ids, composition=composition)
        started.append(running)
        return running

    async def launch_fanout(self, admitted: Admitted, model: str | None, models: Sequence[str], prompt_ids: list[int],
                            params: SamplingParams, request_id: str, user: str | None = None) -> Running:
        """Start an admitted fan-out (see `fanout`): every adapter of `models` resolved (404 / 400) and in host
        RAM (503 or the tenant's fallback, per adapter), then one engine request per adapter, all at once
        (their prompts' KV differ, so none waits for another's), each with the same parameters and seed. As
        `launch`: the admission belongs to the request from here, and an error gives it and every lease back."""
        tenant, arrival = admitted.tenant, admitted.arrival
        params.timeout_s = admitted.timeout_s
        parts: list[Part] = []
        streams: list[AsyncIterator[RequestOutput]] = []
        ids = [request_id] + [f"{request_id}.{i}" for i in range(1, len(models))]
        started: list[Running] = []  # the Running, once it exists, for an abort of a stalled reader
        try:
            parts = await acquire_parts(self.services.registry, self.services.adapter_cache, tenant, models,
                                        arrival + admitted.timeout_s - time.monotonic(), self.model_id, self.is_base)
            heads = await asyncio.gather(*(
                heads_for_request(self.services, part.version, arrival + admitted.timeout_s - time.monotonic())
                for part in parts))
            for part in parts:
                if part.version is not None:
                    self.services.request_rates.record(part.version.adapter_id)
            engine, placement = self.services.engine, self._placement(tenant)

            def generate(i: int) -> AsyncIterator[RequestOutput]:
                lease = parts[i].lease
                request = EngineRequest(ids[i], prompt_ids, params, adapter=lease.adapter if lease else None,
                                        arrival=arrival, medusa=heads[i], **placement)
                stream = engine.generate(request,
                                         on_abandoned=lambda out: started and self._abandon(started[0], i, out))
                streams.append(stream)
                return stream

            try:
                results = await asyncio.gather(*(anext(generate(i)) for i in range(len(parts))),
                                               return_exceptions=True)
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                firsts = [r for r in results if isinstance(r, RequestOutput)]
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
        except BaseException:
            for stream in streams:
                await stream.aclose()  # aborts the parts already in the engine
            admitted.release()
            release_parts(self.services.adapter_cache, parts)
            raise
        self._admissions[request_id] = admitted.admission
        running = Running(request_id, tenant, model or BASE_MODEL_ALIAS, None, None, None, len(prompt_ids), arrival,
                          ids, streams, firsts, self._finished, user=user, prompt_ids=prompt_ids, parts=parts)
        started.append(running)
        return running

    def _placement(self, tenant: TenantContext) -> dict:
        """What every engine request of `tenant` carries: its tier's priority, who it is and its tier's weight
        (the fair share within a tier), and its prefix-cache namespace (its own when tenants must not share)."""
        settings = self.services.settings
        return {"priority": tenant.tier.priority, "tenant": tenant.tenant_id,
                "share_weight": settings.fair_share_tier_weights.get(tenant.tier.name, 1.0),
                "cache_salt": tenant.tenant_id if settings.prefix_cache_per_tenant else None}

    def _abandon(self, running: Running, index: int, final: RequestOutput) -> None:
        """Choice `index` was aborted for a stalled reader; its siblings share that reader: abort them too."""
        for i, rid in enumerate(running.choice_ids):
            if i != index:
                self.services.engine.abort(rid)
        running.abandon(index, final)

    def _finished(self, running: Running, outcome: str) -> list[Future]:
        """The request ended: see `loramux.server.serving.record.finish`."""
        return finish(running, outcome, self._admissions.pop(running.request_id, None), self.services.adapter_cache,
                      self.metrics, self.ledger_hooks, self.model_id)
