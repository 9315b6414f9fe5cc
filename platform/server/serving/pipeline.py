"""One request from admission to its ledger record, shared by the OpenAI and native routes.

Order of checks, cheapest first (the key and the body's size were checked before, by
`loramux.server.http.ingress`): timeout within the tier's maximum -> rate limits (429), with the prompt's
token count bounded from its length -> whether the queue can meet the deadline (503) -> a prompt whose
bound cannot fit the context (400) -> tokenizing -> max_tokens against the context (400) -> compiling a
structured-output constraint, off the event loop and bounded in time (400) -> the adapter: resolve in the
registry (404), bring it into host RAM within the deadline (503, or the tenant's fallback) -> its Medusa
heads (the version's, else the base model's; never a refusal) -> the engine (one `EngineRequest` per choice:
`n` siblings sharing the prompt's KV blocks). A fan-out (`models`, see `fanout`) checks its list first, is
admitted once for all its parts, and takes the same path with one part per adapter: every adapter resolved and
loaded, one engine request each.
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loramux.adapters.composition.cache import CompositionCache
from loramux.adapters.storage.registry import BASE_MODEL_ALIAS
from loramux.billing.usage import RequestRecord
from loramux.engine.factory import device_and_dtype
from loramux.engine.outputs import RequestError, RequestOutput
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import SamplingParams
from loramux.server.http.errors import ApiError
from loramux.server.http.logs import request_id_var
from loramux.server.intake.composition import Component, check_base, parse_adapters
from loramux.server.intake.generation import Intake
from loramux.server.intake.params import check_logprob_volume, check_prompt_bound, resolve_max_tokens
from loramux.server.intake.prompts import tokens_per_message
from loramux.server.intake.response_format import compile_structured
from loramux.server.serving.adapter_choice import acquire_adapter
from loramux.server.serving.admission import Admitted, admit
from loramux.server.serving.composition_choice import Composition, acquire_composition
from loramux.server.serving.fanout import Part, acquire_parts, check_fanout, release_parts
from loramux.server.serving.record import finish
from loramux.server.serving.running import Running
from loramux.server.serving.spend import Spend, SpendAsk, reserve_spend
from loramux.services.adapter_resolver import AdapterResolver
from loramux.services.medusa import heads_for_request
from loramux.tenancy.rate_limits import RateLimiter
from loramux.tenancy.tenants import TenantContext

if TYPE_CHECKING:
    from loramux.server.serving.metrics import ServerMetrics
    from loramux.services.container import Services

log = logging.getLogger(__name__)
SEED_LIMIT = 2**63  # SamplingParams' seed range; sibling seeds wrap around within it


@dataclass(frozen=True)
class Target:
    """What a request runs on: the adapter `model` names (None or the base model's name: the base model), or
    the composite of `components` (`adapters`; `model` is then the base model), or with `fanout` (`models`)
    one part per adapter named."""

    model: str | None
    components: list[Component] | None = None
    fanout: Sequence[str] | None = None


class RequestPipeline:
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
        # Names the registry does not know, looked up in LORAMUX_ADAPTER_RESOLVER's store (None: off).
        self.resolver = (AdapterResolver(services, settings.adapter_resolver, settings.adapter_resolver_miss_ttl_s)
                         if settings.adapter_resolver else None)

    def is_base(self, model: str | None) -> bool:
        return model in (None, "", BASE_MODEL_ALIAS, self.model_id)

    async def admit(self, tenant: TenantContext, timeout_s: float | None, estimated_tokens: int,
                    arrival: float, slots: int = 1, requests: int = 1) -> Admitted:
        """`loramux.server.serving.admission.admit` with this pipeline's limiter, metrics and engine."""
        return await admit(self.limiter, self.metrics, self.services.engine, tenant, timeout_s, estimated_tokens,
                           arrival, slots, requests)

    async def start_generation(self, tenant: TenantContext, intake: Intake) -> Running:
        """A route's request, cheapest checks first: `admit` with the prompt's token count bounded from its
        length (`Prompt.min_tokens`), then refuse a prompt whose bound cannot fit the context, and only then
        tokenize it (the threadpool), resolve max_tokens against the context, apply the route's defaults and
        `intake.sampling`, compile the structured-output `intake.constraints` (see `compile_structured`) and
        `launch` it as `<id_prefix>-<hex>` with `intake.n` choices. The tokens-per-minute bucket is charged the
        bound (prompt + n x max_tokens) at admission and settled with the real prompt + completion tokens when
        the request ends. `intake.logprobs_per_token` is bounded by `check_logprob_volume`. `body.adapters` (a
        weighted composition; `model` is then the base model) is checked first, before admission. With
        `intake.models` (a fan-out, `check_fanout` first) the request runs one sequence per adapter, each
        computing the prompt: admission holds one slot per adapter, takes one request per adapter from the
        requests-per-minute limit and is charged the prompt bound and max_tokens once per adapter. A request
        has `adapters` or `models`, not both. Raises ApiError with nothing held."""
        body, model, models, n, prompt = intake.body, intake.model, intake.models, intake.n, intake.prompt
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
        request_id = f"{intake.defaults.id_prefix}-{uuid.uuid4().hex}"
        request_id_var.set(request_id)  # log lines of this request carry its id
        engine = self.services.engine
        context = engine.max_model_len
        per_message = await tokens_per_message(engine) if prompt.messages else 0
        at_least = prompt.min_tokens(engine.max_chars_per_token, per_message)
        # Each choice generates at most max_tokens and at most the room the prompt leaves in the context; a
        # prompt bound past the context is charged as the context (it is refused right after admission).
        per_choice = min(intake.max_tokens or intake.defaults.max_tokens, max(0, context - at_least))
        admitted = await self.admit(tenant, body.timeout_s, prompts * min(at_least, context) + sequences * per_choice,
                                    intake.arrival, slots=sequences, requests=prompts)
        try:
            check_logprob_volume(sequences, per_choice, intake.logprobs_per_token,
                                 self.services.settings.max_logprob_entries)
            check_prompt_bound(at_least, context)  # exact for token ids; a bound from the length for text
            prompt_ids = await prompt.tokenize(engine)
            max_tokens = resolve_max_tokens(intake.max_tokens, len(prompt_ids), context, intake.defaults.max_tokens)
            params = body.sampling_params(max_tokens, intake.defaults.temperature, **intake.sampling)
            for structured, what in intake.constraints:
                await compile_structured(engine, structured, self.services.settings.structured_compile_timeout_s,
                                         what)
        except BaseException:
            admitted.release()
            raise
        return await self.launch(admitted, Target(model, components, models), prompt_ids, params, request_id, n=n,
                                 user=body.user, tags=intake.tags)

    async def launch(self, admitted: Admitted, target: Target, prompt_ids: list[int], params: SamplingParams,
                     request_id: str, n: int = 1, user: str | None = None, tags: Sequence[str] = ()) -> Running:
        """Start an admitted request: what serves it in host RAM (`_parts`: 404, 400, 503 or the tenant's
        fallback), each part's Medusa heads, then the engine. From here the admission belongs to the request
        (given back once when it ends); on an error it and every lease are given back at once and ApiError
        raised.

        Choice i is the engine request `<request_id>` (i = 0) or `<request_id>.<i>`. Without a fan-out there
        are `n` choices of the one part: choice 0 starts first, and the others only once it has produced its
        first token, when its prompt's full KV blocks are in the prefix cache, so they reuse them instead of
        computing the prompt again; with a seed, choice i samples with seed + i (reproducible, and distinct from
        its siblings). A fan-out's choice i is part i, all started at once (their prompts' KV differ, so none
        waits for another's), each with the same parameters and seed.

        Before the engine, the request's worst case is reserved against the budgets that apply to its tenant,
        key, `user` and `tags` (`reserve_spend`: 402 when one cannot hold it)."""
        tenant, arrival, fanout = admitted.tenant, admitted.arrival, target.fanout is not None
        params.timeout_s = admitted.timeout_s
        parts: list[Part] = []
        composition: Composition | None = None
        streams: list[AsyncIterator[RequestOutput]] = []
        started: list[Running] = []  # the Running, once it exists, for an abort of a stalled reader
        spend: Spend | None = None
        try:
            parts, composition = await self._parts(admitted, target)
            spend = await self._reserve(admitted, request_id, parts, composition, len(prompt_ids),
                                        params.max_tokens * (1 if fanout else n), user, tags)
            heads = await asyncio.gather(*(heads_for_request(self.services, part.version, _time_left(admitted))
                                           for part in parts))
            for part in parts:
                if part.version is not None:
                    self.services.request_rates.record(part.version.adapter_id)
            count = len(parts) if fanout else n
            ids = [request_id] + [f"{request_id}.{i}" for i in range(1, count)]
            engine, placement = self.services.engine, self._placement(tenant)

            def generate(i: int) -> AsyncIterator[RequestOutput]:
                part = i if fanout else 0
                own = params if fanout or i == 0 or params.seed is None else \
                    dataclasses.replace(params, seed=(params.seed + i) % SEED_LIMIT)
                lease = parts[part].lease
                request = EngineRequest(ids[i], prompt_ids, own, adapter=lease.adapter if lease else None,
                                        arrival=arrival, medusa=heads[part], **placement)
                stream = engine.generate(request,
                                         on_abandoned=lambda out: started and self._abandon(started[0], i, out))
                streams.append(stream)
                return stream

            try:
                together = count if fanout else 1  # the choices started before the others
                firsts = await _first_outputs([generate(i) for i in range(together)])
                firsts += await _first_outputs([generate(i) for i in range(together, count)])
            except RequestError as exc:
                raise ApiError(400, str(exc)) from None
        except BaseException:
            for stream in streams:
                await stream.aclose()  # aborts the choices already in the engine
            admitted.release()
            release_parts(self.services.adapter_cache, parts)
            if spend is not None:
                spend.release()
            raise
        self._admissions[request_id] = admitted.admission
        single = Part("", None, None) if fanout else parts[0]  # a fan-out's are in `parts`
        running = Running(request_id, tenant, target.model or BASE_MODEL_ALIAS, single.version, single.lease,
                          single.fallback_reason, len(prompt_ids), arrival, ids, streams, firsts, self._finished,
                          user=user, prompt_ids=prompt_ids, composition=composition, parts=parts if fanout else [],
                          spend=spend, tags=list(tags))
        started.append(running)
        return running

    async def _parts(self, admitted: Admitted, target: Target) -> tuple[list[Part], Composition | None]:
        """What serves the request, in host RAM (give the leases back with `release_parts`): with a fan-out one
        part per adapter (`acquire_parts`: 404 / 400, then 503 or the tenant's fallback per adapter); else one
        part: the composite of `target.components` (`acquire_composition`: 404, 400, 503), the adapter
        `target.model` names (`acquire_adapter`: 404, then 503 or the tenant's fallback) or the base model."""
        services, tenant, requested = self.services, admitted.tenant, target.model or BASE_MODEL_ALIAS
        if target.fanout is not None:
            return await acquire_parts(services.registry, services.adapter_cache, tenant, target.fanout,
                                       _time_left(admitted), self.model_id, self.is_base), None
        if target.components is not None:
            settings = services.settings
            composition = await acquire_composition(
                services.registry, self.compositions, tenant, target.components, _time_left(admitted),
                max_rank=settings.composition_max_rank, max_lora_rank=settings.max_lora_rank,
                base_model_id=self.model_id, dtype=self.adapter_dtype)
            return [Part(requested, None, composition.lease)], composition
        if target.model is None or self.is_base(target.model):
            return [Part(requested, None, None)], None
        version, lease, fallback_reason = await acquire_adapter(
            services.registry, services.adapter_cache, tenant, target.model, _time_left(admitted), self.model_id,
            self.resolver)
        return [Part(requested, version, lease, fallback_reason)], None

    async def _reserve(self, admitted: Admitted, request_id: str, parts: list[Part], composition: Composition | None,
                       prompt_tokens: int, max_completion: int, user: str | None, tags: Sequence[str]) -> Spend | None:
        """`reserve_spend` for the parts that serve the request (None where no budget book is kept)."""
        book = self.services.budgets
        if book is None:
            return None
        if composition is not None:  # billed at its dearest component's price or the base model's
            served: list[list[str | None]] = [[*(c.get("adapter_id") for c in composition.ledger()), None]]
        else:
            served = [[part.version.adapter_id if part.version is not None else None] for part in parts]
        ask = SpendAsk(admitted.tenant, request_id, self.model_id, served, prompt_tokens, max_completion,
                       admitted.arrival, user, tags)
        try:
            return await reserve_spend(book, ask, self.services.settings.budget_fail_mode == "open")
        except ApiError as exc:
            self.metrics.count_rejected(admitted.tenant.tier.name,
                                        "budget_exceeded" if exc.status == 402 else "rejected")
            raise

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


def _time_left(admitted: Admitted) -> float:
    """Seconds until the request's deadline."""
    return admitted.arrival + admitted.timeout_s - time.monotonic()


async def _first_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Each stream's first output, taken at once; the first error, once all have answered."""
    results = await asyncio.gather(*(anext(stream) for stream in streams), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if isinstance(result, RequestOutput)]
