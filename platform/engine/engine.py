"""The engine: add requests, then `step()` = schedule -> run -> postprocess, until all are done."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.adapters.formats.peft import LoRAAdapter
from loramux.adapters.residency.locations import LOADING, RESIDENT, AdapterResidency
from loramux.engine.config import EngineConfig
from loramux.engine.model_runner import ModelRunner, StepLogits
from loramux.engine.outputs import RequestError, RequestOutput, SoFar
from loramux.engine.request import EngineRequest
from loramux.engine.request_checks import check_prompt, check_servable, resolve_adapter
from loramux.engine.sampling.detokenizer import IncrementalDetokenizer
from loramux.engine.sampling.params import SamplingParams, StructuredOutput
from loramux.engine.sampling.sampler import Sampler, SamplingRow
from loramux.engine.scheduling.block_manager import BlockManager
from loramux.engine.scheduling.fair_share import FairShare
from loramux.engine.scheduling.scheduler import ScheduledBatch, Scheduler
from loramux.engine.scheduling.step_budget import step_budget_for
from loramux.engine.sequence import FinishReason, Sequence
from loramux.engine.speculation.medusa_device_cache import MedusaDeviceCache, device_bytes
from loramux.engine.speculation.medusa_heads import MedusaHeads
from loramux.engine.speculation.policy import SpecPolicy
from loramux.engine.speculation.speculator import Speculator
from loramux.engine.speculation.verification import verify_draft
from loramux.engine.stats import EngineCounters, ExpertTokens, engine_stats
from loramux.engine.structured.constraint import Constraint, batch_masker
from loramux.engine.structured.grammar import GrammarCache, StructuredOutputError
from loramux.engine.tokens import chat_template_ids
from loramux.histogram import DurationHistogram
from loramux.names import base_model_id

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestOutput", "RequestError"]


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    stop_string_hit: bool = False
    adapter_name: str | None = None
    constraint: Constraint | None = None  # structured output: the grammar's state
    medusa: MedusaHeads | None = None  # the request's own Medusa heads (its adapter version's)


@dataclass
class _Sampled:
    """A request's tokens from one step: one sampled, or a verified draft prefix + one (`accepted`)."""

    req: _Request
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # top_logprobs per token ([] each when not asked for)
    accepted: int | None = None  # speculative decodes only


def state_slots(config: EngineConfig, state_bytes: int) -> int:
    """How many sequences of a hybrid model hold linear-attention state at once: one per running sequence
    (`max_num_seqs`), within half of `kv_cache_bytes` (the paged KV of its attention layers gets the rest); 0 for a
    model without such state."""
    if not state_bytes:
        return 0
    return max(1, min(config.max_num_seqs, config.kv_cache_bytes // 2 // state_bytes))


def _hybrid_config(config: EngineConfig) -> EngineConfig:
    """`config` with what a hybrid model cannot serve exactly turned off, said once: prefix caching (a cached block
    holds attention KV, not the linear layers' state after it) and speculation (a rejected draft token would have to
    be rolled back out of the recurrent state)."""
    off = [name for name, on in (("prefix caching", config.prefix_caching),
                                 ("speculative decoding", config.speculative_tokens > 0)) if on]
    if off:
        log.info("%s off for this hybrid model: its linear-attention layers keep one running state per sequence, "
                 "which a cached prefix does not carry and a rejected draft token cannot be taken back out of",
                 " and ".join(off))
    return replace(config, prefix_caching=False, speculative_tokens=0)


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.model = model
        self.model_name: str | None = None  # the served model as configured (from_settings sets it)
        self.tokenizer = tokenizer
        mcfg = model.config
        config = _hybrid_config(config) if mcfg.linear_attention is not None else config
        self.config = config
        element = torch.finfo(dtype).bits // 8
        self.num_state_slots = state_slots(config, mcfg.state_bytes_per_sequence(element))
        num_blocks = config.num_blocks
        if num_blocks is None:  # the KV pool gets what the state slots leave of kv_cache_bytes
            per_block = config.block_size * mcfg.kv_bytes_per_token(element)
            kv_bytes = config.kv_cache_bytes - self.num_state_slots * mcfg.state_bytes_per_sequence(element)
            num_blocks = max(1, kv_bytes // per_block)
        # A sequence must fit the whole KV pool on its own, or it could be preempted forever.
        self.max_model_len = min(config.max_model_len, mcfg.max_position_embeddings, num_blocks * config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.prefix_caching, mcfg.sliding_window,
                                          self.num_state_slots)
        self.load_histogram = DurationHistogram()  # host RAM -> device copies
        self.pool = self.adapters = None  # the device adapter pool and the one owner of what is in it
        if config.max_lora_rank > 0:
            from loramux.adapters.residency.device_pool import DevicePool

            self.pool = DevicePool(model, config.adapter_pool_bytes or config.kv_cache_bytes, dtype, device,
                                   config.lora_impl, config.async_adapter_loads)
            self.adapters = AdapterResidency(self.pool, config.max_loras, config.adapter_min_residency_s,
                                             config.adapter_drain_after_s, on_load=self.load_histogram.observe)
        self.step_budget = step_budget_for(config.step_target_ms, device.type, min_chunk=config.block_size)
        long_after = [rope.long_after for rope in model.ropes if rope.long_after is not None]
        self.long_rope_after = min(long_after) if long_after else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.adapters, aging_s=config.priority_aging_s, step_budget=self.step_budget,
                                   fair_share=FairShare(config.fair_share_input_weight,
                                                        config.fair_share_output_weight),
                                   long_rope_after=self.long_rope_after)
        self.runner = ModelRunner(model, num_blocks, config.block_size, dtype, device,
                                  self.pool.wrapper if self.pool else None,
                                  self.adapters.location if self.adapters else None, config, self.max_model_len,
                                  self.num_state_slots)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = GrammarCache(tokenizer, mcfg.vocab_size, self.eos_token_ids)  # built on first use
        self.requests: dict[str, _Request] = {}
        self.counters = EngineCounters(expert_tokens=ExpertTokens.attach(model))  # tokens per expert: /metrics
        adaptive = self.step_budget if config.speculative_adaptive else None  # the budget's step-time model
        policy = SpecPolicy(adaptive.model.predict if adaptive is not None else None)
        self.speculator = Speculator(config, self.max_model_len, policy)
        self.medusa_base: MedusaHeads | None = None  # heads for requests that bring none (set_medusa_heads)
        # Requests' own heads on the device, by digest, within LORAMUX_MEDUSA_DEVICE_BYTES (prepare_medusa).
        self.medusa_device = MedusaDeviceCache(config.medusa_device_bytes, self._medusa_module,
                                               lambda w: device_bytes(w, self.runner.kv.k.dtype))
        self.runner.medusa_of = self._medusa_of

    # -- speculators ------------------------------------------------------------------------------
    def set_medusa_heads(self, weights: MedusaHeadsWeights | None) -> None:
        """Medusa heads for requests that bring no heads of their own (None: none)."""
        self.medusa_base = None if weights is None else self._medusa_module(weights)

    def set_draft_model(self, draft) -> None:
        """A DraftRunner whose proposals rows may verify (None: no draft model)."""
        self.speculator.draft = draft

    def _check_medusa(self, weights: MedusaHeadsWeights) -> None:
        if weights.hidden_size != self.model.config.hidden_size:
            raise RequestError(f"Medusa heads of hidden size {weights.hidden_size} do not fit this model's "
                               f"{self.model.config.hidden_size}")

    def _medusa_module(self, weights: MedusaHeadsWeights) -> MedusaHeads:
        self._check_medusa(weights)
        return MedusaHeads(weights, self.runner.kv.k.dtype, self.runner.device)

    def prepare_medusa(self, weights: MedusaHeadsWeights) -> MedusaHeads | None:
        """A request's own heads on the device, for add_request's `medusa`: the cached copy of their digest, else
        one made now within LORAMUX_MEDUSA_DEVICE_BYTES, leased until the request that gets it ends (or
        `release_medusa`, when it never reaches add_request); None when they cannot be placed (the request runs
        without them). Any thread, and it may block while copying: call it off the step thread (AsyncEngine
        does). RequestError when they do not fit this model."""
        self._check_medusa(weights)
        return self.medusa_device.acquire(weights)

    def release_medusa(self, heads: MedusaHeads) -> None:
        """Give back prepared heads that no request took over (any thread)."""
        self.medusa_device.release(heads)

    def _medusa_of(self, seq: Sequence) -> MedusaHeads | None:
        req = self.requests.get(seq.request_id)
        if req is None:
            return None
        return req.medusa if req.medusa is not None else self.medusa_base

    # -- construction from settings --------------------------------------------------------------
    @classmethod
    def from_settings(cls, settings, load_adapters: bool = True) -> LLMEngine:
        """The engine for `settings`; `load_adapters`: also load LORAMUX_ADAPTERS directly (without the
        registry, as the CLI does)."""
        from loramux.engine.factory import engine_from_settings

        return engine_from_settings(cls, settings, load_adapters)

    # -- adapters --------------------------------------------------------------------------------
    def register_adapter(self, adapter: LoRAAdapter) -> None:
        """Make `adapter` servable under `adapter.name`; a new version under the same name replaces it
        for later requests (running ones finish on the version they started with)."""
        adapter = check_servable(adapter, self.adapters, self.config.max_lora_rank)
        assert self.adapters is not None  # check_servable refuses every adapter when LoRA is off
        self.adapters.register(adapter)

    def evict_adapter(self, digest: str) -> None:
        """A version was replaced or deleted: its device slot is freed once no request uses it."""
        if self.adapters is not None:
            self.adapters.retire(digest)

    def load_adapter_dir(self, path, name: str | None = None, *, allow_base_mismatch: bool = False) -> LoRAAdapter:
        """Load, validate (the same rules as an upload, the base model's name included when the engine
        knows it) and register a PEFT adapter directory."""
        from loramux.adapters.formats.peft import load_adapter_dir

        base = base_model_id(self.model_name) if self.model_name else None
        adapter = load_adapter_dir(path, self.model.config, name, self.config.max_lora_rank, base_model_id=base,
                                   allow_base_mismatch=allow_base_mismatch)
        self.register_adapter(adapter)
        return adapter

    # -- requests --------------------------------------------------------------------------------
    def compile_structured(self, spec: StructuredOutput) -> None:
        """Compile a structured-output constraint into the engine's cache, so that add_request finds it
        (any thread; raises StructuredOutputError, whose message is fit for the user)."""
        self.grammars.compile(spec)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`) under the model's chat template, ready for the assistant's
        turn (`loramux.engine.tokens.chat_template_ids`)."""
        return chat_template_ids(self.tokenizer, messages, tools)


    def add_request(self, request: EngineRequest | str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, grammar=None, **fields: Any) -> Sequence:
        """Queue `request` (see EngineRequest) for the base model or an adapter: a registered name, or an
        adapter object the caller holds in host RAM until the request finishes. `grammar`: the CompiledGrammar
        of `request.params.structured`, compiled by the caller (AsyncEngine, off this thread) and pinned by the
        request until it ends; without it the spec is compiled here. `request.medusa`: the request's own Medusa
        heads (its adapter version's), else the engine's: heads from `prepare_medusa` (the request takes their
        lease over when add_request returns; the caller keeps it when it raises), or weights, whose device copy is
        used only if it is cached (never made here, on the step thread: without it the request runs without
        them). Raise RequestError when it can never run.

        The short form for scripts and tests, `add_request(request_id, prompt, params, **fields)` with the other
        EngineRequest fields by name, builds the EngineRequest."""
        if isinstance(request, str):
            if prompt is None:
                raise TypeError("add_request(request_id, prompt, ...) needs the prompt")
            request = EngineRequest(request, prompt, params or SamplingParams(), **fields)
        elif prompt is not None or params is not None or fields:
            raise TypeError("add_request(EngineRequest) takes no other request fields")
        request_id, params, adapter = request.request_id, request.params, request.adapter
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        lora = resolve_adapter(adapter, self.adapters, self.config.max_lora_rank)
        adapter_name = adapter if adapter is None or isinstance(adapter, str) else adapter.name
        # Raw text gets the tokenizer's own special tokens (e.g. BOS for Llama), as HF's tokenizer(text) does.
        prompt = request.prompt
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, params, self.model.config.vocab_size, self.max_model_len, self.block_manager)
        arrival: dict[str, Any] = {"arrival": request.arrival} if request.arrival is not None else {}
        seq = Sequence(request_id, ids, params, priority=request.priority, adapter=lora.digest if lora else None,
                       tenant=request.tenant, share_weight=request.share_weight,
                       cache_salt=f"{lora.digest if lora else 'base'}|{request.cache_salt or ''}",
                       **arrival)
        if self.long_rope_after is not None and len(ids) > self.long_rope_after:
            # LongRoPE computes a prompt past the original context with the long factors throughout (as HF
            # does): its blocks never mix with those of a shorter prompt, computed with the short ones.
            seq.long_rope = True
            seq.cache_salt += "|longrope"
        generator = Sampler.make_generator(params.seed) if params.seed is not None else None
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        try:  # the grammar decides when a constrained request stops: its EOS ends it even with ignore_eos
            constraint = Constraint(self.grammars, params.structured, grammar) if params.structured else None
        except StructuredOutputError as exc:
            raise RequestError(str(exc)) from None
        stop_ids |= constraint.stop_token_ids if constraint else frozenset()
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        heads = self._hold_medusa(request.medusa) if request.medusa is not None else None
        self.requests[request_id] = _Request(seq, detok, generator, stop_ids, adapter_name=adapter_name,
                                             constraint=constraint, medusa=heads)
        # The prompt's last row gives the first Medusa proposals (the step decides again once it decodes).
        seq.medusa_wanted = (params.speculative and self.config.speculative_tokens > 0
                             and self._medusa_of(seq) is not None)
        if lora is not None:
            assert self.adapters is not None  # resolve_adapter finds adapters only when LoRA is on
            self.adapters.add_waiting(lora)  # the residency holds the host copy until the request ends
        self.scheduler.add(seq)
        return seq

    def _hold_medusa(self, medusa: MedusaHeadsWeights | MedusaHeads) -> MedusaHeads | None:
        """add_request's `medusa` as leased device heads: prepared ones as they are, weights only if cached."""
        if isinstance(medusa, MedusaHeads):
            return medusa
        self._check_medusa(medusa)
        return self.medusa_device.cached(medusa.digest)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request: its KV blocks are freed at once. Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req.seq, FinishReason.CANCELLED)
        self._forget(req)
        return self._output(req, "", [])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run the model -> sample and account (see _postprocess)."""
        now = time.monotonic()
        outputs = self._expire(now)
        if self.adapters is not None:
            self.adapters.poll()  # device copies finished since the last step
        self._propose_drafts()
        batch = self.scheduler.schedule(now)
        self.counters.preemptions += len(batch.preempted)
        if not batch:
            self._idle()
            return outputs
        return outputs + self._postprocess(batch, self.runner.run(batch))

    def _idle(self) -> None:
        """Nothing could run (requests wait for adapters being copied in): wait briefly, not spin."""
        if self.adapters is not None and self.scheduler.num_waiting:
            self.adapters.wait_for_load(timeout=0.01)

    def _postprocess(self, batch: ScheduledBatch, step: StepLogits) -> list[RequestOutput]:
        """Append each sequence's new tokens (stop checks included), let the scheduler account for the
        step (computed tokens, prefix-cache commits), then finish the requests that stopped."""
        sampled = self._sample(step)
        now = time.monotonic()
        appended = [(s, *self._append_tokens(s, now)) for s in sampled]
        self.scheduler.complete(batch, {s.req.seq: s.accepted for s in sampled if s.accepted is not None})
        outputs = []
        for s, delta, n, reason in appended:
            if reason is not None:
                self.scheduler.finish(s.req.seq, reason, now)
                self._forget(s.req)
            outputs.append(self._output(s.req, delta, s.tokens[:n], s.logprobs[:n], s.top[:n]))
        return outputs

    def _sample(self, step: StepLogits) -> list[_Sampled]:
        """One token per plain sequence (sampled together), a verified draft prefix + one per speculative one."""
        plain = [(self.requests[seq.request_id], row) for seq, row, n in step.rows if n == 1]
        result: list[_Sampled] = []
        if plain:
            reqs, rows = [req for req, _ in plain], [row for _, row in plain]
            logits = step.logits if len(rows) == step.logits.shape[0] else step.logits[rows]
            logits = self._suppress_early_stops(logits, reqs, [0] * len(reqs))
            out = self.sampler(logits, [self._sampling_row(req.seq) for req in reqs], [req.generator for req in reqs],
                               batch_masker([req.constraint for req in reqs]))
            result += [_Sampled(req, [t], [lp], [top])
                       for req, t, lp, top in zip(reqs, out.token_ids, out.logprobs, out.top_logprobs)]
        for seq, row, n in step.rows:
            if n > 1:
                result.append(self._verify(self.requests[seq.request_id], step.logits[row:row + n]))
        for s in result:  # Medusa's proposals from the row whose logits gave the last token
            proposals = step.medusa.get(s.req.seq)
            s.req.seq.medusa_next = proposals[s.accepted or 0] if proposals else []
        return result

    def _suppress_early_stops(self, logits: torch.Tensor, reqs: list[_Request], ahead: list[int]) -> torch.Tensor:
        """Mask stop token ids on rows whose request has not reached min_tokens (row i sits `ahead[i]`
        tokens past the request's current output); a constrained request's grammar decides alone."""
        early = [(i, list(req.stop_ids)) for i, req in enumerate(reqs) if req.stop_ids and req.constraint is None
                 and len(req.seq.output_token_ids) + ahead[i] < req.seq.params.min_tokens]
        if early:
            logits = logits.clone()  # the runner's output is an inference tensor
            for i, ids in early:
                logits[i, ids] = float("-inf")  # too early to stop
        return logits

    # -- speculative decoding by prompt lookup (loramux.engine.speculation.verification) -----------------------
    def _propose_drafts(self) -> None:
        """Drafts for the decoding sequences, when speculation is on (LORAMUX_SPECULATIVE_TOKENS)."""
        if self.config.speculative_tokens > 0:
            running = self.scheduler.running
            self.speculator.propose([s for s in running if not s.is_prefill], [s for s in running if s.is_prefill],
                                    lambda seq: self.requests[seq.request_id].constraint, self._medusa_of)

    def _verify(self, req: _Request, logits: torch.Tensor) -> _Sampled:
        """The verified prefix of the request's draft plus one token from the target model."""
        seq = req.seq
        logits = self._suppress_early_stops(logits, [req] * logits.shape[0], list(range(logits.shape[0])))
        proposed = len(seq.draft_token_ids)
        self.counters.spec_proposed += proposed
        verdict, top = verify_draft(seq, logits, self._sampling_row(seq), self.sampler, req.generator, req.constraint)
        self.counters.spec_accepted += verdict.accepted
        self.speculator.verified(seq, proposed, verdict.accepted)
        return _Sampled(req, verdict.tokens, verdict.logprobs, top, verdict.accepted)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        return SamplingRow(**p.sampling_controls(),
                           prompt_token_ids=seq.prompt_token_ids if p.repetition_penalty != 1.0 else (),
                           output_token_ids=seq.output_token_ids, logit_bias=p.logit_bias, top_logprobs=p.top_logprobs)

    def _append_tokens(self, s: _Sampled, now: float) -> tuple[str, int, FinishReason | None]:
        """Append tokens until one ends the request; returns (new text, number of tokens kept, why it ends
        or None). The caller finishes the request."""
        req, seq, delta, reason, constraint = s.req, s.req.seq, "", None, s.req.constraint
        if seq.timings.first_token is None:
            seq.timings.first_token = now
        for n, (token, logprob, top) in enumerate(zip(s.tokens, s.logprobs, s.top), 1):
            seq.output_token_ids.append(token)
            seq.output_logprobs.append(logprob)
            if seq.params.top_logprobs:
                seq.output_top_logprobs.append(top)
            if constraint is not None and not constraint.accept(token):
                reason = FinishReason.ERROR  # the grammar masked this token: a bug, never a wrong output
            elif token in req.stop_ids:
                reason = FinishReason.STOP
            else:
                update = req.detok.add_tokens([token])
                delta += update.delta
                if update.stopped or (constraint is not None and constraint.done):
                    reason = FinishReason.STOP
                    req.stop_string_hit = update.stopped
                elif len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                    reason = FinishReason.LENGTH
            if reason is not None:
                return delta, n, reason
        return delta, len(s.tokens), None

    def _forget(self, req: _Request) -> None:
        """Drop a finished request (the scheduler has released its blocks and its adapter)."""
        del self.requests[req.seq.request_id]
        self.counters.record_finished(req.seq)
        self.speculator.release(req.seq)
        if req.medusa is not None:
            self.medusa_device.release(req.medusa)

    def _expire(self, now: float) -> list[RequestOutput]:
        outputs = []
        for req in [r for r in self.requests.values() if r.seq.deadline is not None and r.seq.deadline <= now]:
            self.scheduler.finish(req.seq, FinishReason.TIMEOUT, now)
            self._forget(req)
            outputs.append(self._output(req, "", []))
        return outputs

    def _output(self, req: _Request, delta: str, new_ids: list[int], new_logprobs: list[float] | None = None,
                new_top: list | None = None) -> RequestOutput:
        """The output of one step: the deltas, and the state so far as O(1) views (whole copies on the
        final output only), so no step costs memory or time in proportion to the output's length."""
        seq, tops = req.seq, req.seq.output_top_logprobs
        finished, n = seq.is_finished, len(seq.output_token_ids)
        if finished and not req.stop_string_hit:
            delta += req.detok.finish()  # release text held back in case it began a stop string
        return RequestOutput(
            request_id=seq.request_id, delta_text=delta, new_token_ids=new_ids, new_logprobs=new_logprobs or [],
            text=req.detok.text if finished else "", finished=finished,
            token_ids=list(seq.output_token_ids) if finished else SoFar(seq.output_token_ids, n),
            logprobs=list(seq.output_logprobs) if finished else SoFar(seq.output_logprobs, n),
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            num_prompt_tokens=len(seq.prompt_token_ids), timings=seq.timings.as_dict(n) if finished else {},
            adapter=req.adapter_name, num_cached_tokens=seq.num_cached_tokens,
            top_logprobs=list(tops) if finished else SoFar(tops, len(tops)),
            new_top_logprobs=new_top if seq.params.top_logprobs and new_top else [],
            speculation={m: {"proposed": p, "accepted": a} for m, (p, a) in seq.spec_counts.items()}
            if finished else {},
        )

    # -- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion as one continuous batch; outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(EngineRequest(rid, prompt, p))
        except RequestError:
            for rid in ids:
                self.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def estimated_queue_wait_s(self, extra_waiting: int = 0) -> float:
        """Roughly how long a request arriving now waits before it is scheduled, with `extra_waiting` more
        requests ahead of it than the scheduler holds (see EngineCounters.queue_wait_s)."""
        return self.counters.queue_wait_s(len(self.scheduler.running), self.scheduler.num_waiting + extra_waiting,
                                          self.config.max_num_seqs)

    def stats(self) -> dict:
        """See loramux.engine.stats.engine_stats."""
        return engine_stats(self)

    def adapter_residency(self, digest: str) -> str | None:
        """Where an adapter version is on this engine: "device", "loading" (being copied there) or None.
        Safe to call from any thread."""
        if self.adapters is None:
            return None
        return {RESIDENT: "device", LOADING: "loading"}.get(self.adapters.state(digest))
