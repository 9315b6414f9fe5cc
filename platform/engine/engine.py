"""The engine: add requests, then `step()` = schedule -> run -> postprocess, until all are done."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.adapters.peft_format import LoRAAdapter
from loramux.adapters.slots import SlotTable
from loramux.engine.block_manager import BlockManager
from loramux.engine.detokenizer import IncrementalDetokenizer
from loramux.engine.model_runner import ModelRunner
from loramux.engine.outputs import EngineConfig, RequestError, RequestOutput, SoFar
from loramux.engine.sampler import Sampler, SamplingRow
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import FinishReason, Sequence
from loramux.engine.spec_decode import build_verdict, propose_ngram, verify
from loramux.names import base_model_id

__all__ = ["LLMEngine", "EngineConfig", "RequestOutput", "RequestError"]


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    stop_string_hit: bool = False
    adapter_name: str | None = None


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig, eos_token_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.model = model
        self.model_name: str | None = None  # the served model as configured (from_settings sets it)
        self.tokenizer = tokenizer
        self.config = config
        mcfg = model.config
        num_blocks = config.num_blocks
        if num_blocks is None:
            per_block = config.block_size * mcfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
            num_blocks = max(1, config.kv_cache_bytes // per_block)
        # A sequence must fit the whole KV pool on its own, or it could be preempted forever.
        self.max_model_len = min(config.max_model_len, mcfg.max_position_embeddings, num_blocks * config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.slots = SlotTable(config.max_loras)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.slots,
                                   aging_s=config.priority_aging_s)
        self.slot_pool = None
        if config.max_loras > 0:
            from loramux.adapters.slot_pool import DeviceSlotPool

            self.slot_pool = DeviceSlotPool(model, config.max_loras, config.max_lora_rank, dtype, device,
                                            config.lora_impl)
        self.runner = ModelRunner(model, num_blocks, config.block_size, dtype, device,
                                  self.slot_pool.wrapper if self.slot_pool else None)
        # Adapters by name (loaded from directories, or handed over by the server's adapter cache) and by digest.
        self.adapters: dict[str, LoRAAdapter] = {}
        self._by_digest: dict[str, LoRAAdapter] = {}
        self._evicting: set[str] = set()  # replaced or deleted versions: slot freed after their last request
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self.num_preemptions = 0
        self.spec_proposed = self.spec_accepted = 0  # draft tokens proposed / accepted so far
        self._service_s_ewma: float | None = None  # how long a request runs once scheduled

    # -- construction from settings --------------------------------------------------------------
    @classmethod
    def from_settings(cls, settings, load_adapters: bool = True) -> LLMEngine:
        """The engine for `settings`; `load_adapters`: also load LORAMUX_ADAPTERS directly (without the
        registry, as the CLI does)."""
        from transformers import AutoTokenizer

        from loramux.model.loader import build_model, end_of_turn_ids, resolve_model_dir, torch_dtype

        device = torch.device("cuda" if settings.device == "auto" and torch.cuda.is_available()
                              else ("cpu" if settings.device == "auto" else settings.device))
        dtype = torch_dtype(settings.dtype, device)
        model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
        model, mcfg = build_model(model_dir, dtype, device, max_positions=settings.max_model_len)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = EngineConfig(block_size=settings.block_size, kv_cache_bytes=settings.kv_cache_bytes,
                              max_num_seqs=settings.max_num_seqs,
                              max_num_batched_tokens=settings.max_num_batched_tokens,
                              max_model_len=settings.max_model_len, max_loras=settings.max_loras,
                              max_lora_rank=settings.max_lora_rank, lora_impl=settings.lora_impl,
                              priority_aging_s=settings.priority_aging_s,
                              enable_prefix_caching=settings.prefix_caching,
                              num_speculative_tokens=settings.speculative_tokens,
                              speculative_max_batch=settings.speculative_max_batch)
        engine = cls(model, tokenizer, config, end_of_turn_ids(tokenizer, mcfg, model_dir), dtype, device)
        engine.model_name = settings.model
        for name, path in (settings.adapter_dirs() if load_adapters else {}).items():
            engine.load_adapter_dir(path, name)
        return engine

    # -- adapters --------------------------------------------------------------------------------
    def register_adapter(self, adapter: LoRAAdapter) -> None:
        """Make `adapter` servable under `adapter.name`; a new version under the same name replaces it
        for later requests (running ones finish on the version they started with)."""
        self._check_servable(adapter)
        old = self.adapters.get(adapter.name)
        self.adapters[adapter.name] = adapter
        self._by_digest[adapter.digest] = adapter
        if old is not None and old.digest != adapter.digest:
            self.evict_adapter(old.digest)

    def _check_servable(self, adapter: LoRAAdapter) -> LoRAAdapter:
        if self.slot_pool is None:
            raise RequestError("LoRA is disabled on this engine (max_loras = 0)")
        if adapter.rank > self.config.max_lora_rank:
            raise RequestError(f"adapter {adapter.name!r} has rank {adapter.rank}; this server's maximum LoRA rank "
                               f"is {self.config.max_lora_rank} (LORAMUX_MAX_LORA_RANK)")
        return adapter

    def evict_adapter(self, digest: str) -> None:
        """A version was replaced or deleted: free its device slot once no running request uses it."""
        self._evicting.add(digest)
        self._drop_if_unused(digest)

    def _drop_if_unused(self, digest: str) -> None:
        """Drop the engine's reference to a version no name and no live request uses. Its slot keeps the
        weights for the next request (slots are keyed by content digest) unless the version is evicted."""
        if any(a.digest == digest for a in self.adapters.values()):
            return
        if any(r.seq.adapter == digest for r in self.requests.values()):
            return
        self._by_digest.pop(digest, None)
        if digest in self._evicting:
            self._evicting.discard(digest)
            self.slots.evict(digest)

    def load_adapter_dir(self, path, name: str | None = None, *, allow_base_mismatch: bool = False) -> LoRAAdapter:
        """Load, validate (the same rules as an upload, the base model's name included when the engine
        knows it) and register a PEFT adapter directory."""
        from loramux.adapters.peft_format import load_adapter_dir

        base = base_model_id(self.model_name) if self.model_name else None
        adapter = load_adapter_dir(path, self.model.config, name, self.config.max_lora_rank, base_model_id=base,
                                   allow_base_mismatch=allow_base_mismatch)
        self.register_adapter(adapter)
        return adapter

    # -- requests --------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for the assistant's turn."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival: float | None = None,
                    adapter: str | LoRAAdapter | None = None, cache_salt: str | None = None) -> Sequence:
        """Queue a request for the base model or an adapter: a registered name, or an adapter object the
        caller holds in host RAM until the request finishes. `cache_salt` namespaces its prefix-cache
        blocks (the tenant, when tenants must not share them). Raise RequestError when it can never run."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        lora = None
        if isinstance(adapter, LoRAAdapter):
            lora = self._check_servable(adapter)
            adapter = adapter.name
        elif adapter is not None:
            lora = self.adapters.get(adapter)
            if lora is None:
                raise RequestError(f"unknown adapter {adapter!r}")
        # Raw text gets the tokenizer's own special tokens (e.g. BOS for Llama), as HF's tokenizer(text) does.
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids) or any(t >= vocab for t in params.stop_token_ids):
            raise RequestError(f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model accepts at most "
                               f"{self.max_model_len - 1} prompt tokens")
        blocks = self.block_manager.blocks_for_tokens(len(ids) + 1)
        if blocks > self.block_manager.num_blocks:
            raise RequestError(f"the prompt needs {blocks} KV blocks but the cache has {self.block_manager.num_blocks}")
        if lora is not None:
            self._by_digest.setdefault(lora.digest, lora)
        seq = Sequence(request_id, ids, params, priority=priority, adapter=lora.digest if lora else None,
                       cache_salt=f"{lora.digest if lora else 'base'}|{cache_salt or ''}",
                       **({"arrival": arrival} if arrival is not None else {}))
        generator = Sampler.make_generator(params.seed) if params.seed is not None else None
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        self.requests[request_id] = _Request(seq, detok, generator, stop_ids, adapter_name=adapter)
        self.scheduler.add(seq)
        return seq

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
        now = time.monotonic()
        outputs = self._expire(now)
        self._propose_drafts()
        batch = self.scheduler.schedule(now)
        self.num_preemptions += len(batch.preempted)
        if not batch:
            return outputs
        for slot, digest in batch.adapter_loads:
            try:
                self.slot_pool.load(slot, self._by_digest[digest])
            except Exception:
                self.slots.key_of[slot] = None  # never leave a half-copied adapter marked resident
                raise
        logits, sampled = self.runner.run(batch)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        plain_rows, plain, speculated, row = [], [], [], 0
        for seq in sampled:  # logits rows: one per sequence, 1 + len(draft) for a speculative decode
            if seq.draft_token_ids:
                speculated.append((seq, row))
                row += 1 + len(seq.draft_token_ids)
            else:
                plain.append(seq)
                plain_rows.append(row)
                row += 1
        for seq in batch.decodes:
            if not seq.draft_token_ids:
                seq.num_computed_tokens += 1
                self.block_manager.commit(seq)
        if plain:
            reqs = [self.requests[seq.request_id] for seq in plain]
            rows = [self._sampling_row(req.seq) for req in reqs]
            plain_logits = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            plain_logits = self._suppress_early_stops(plain_logits, reqs, [0] * len(reqs))
            result = self.sampler(plain_logits, rows, [req.generator for req in reqs])
            now = time.monotonic()
            for req, token, logprob in zip(reqs, result.token_ids, result.logprobs):
                outputs.append(self._append_token(req, token, logprob, now))
        for seq, row in speculated:
            outputs.append(self._verify(seq, logits[row:row + 1 + len(seq.draft_token_ids)]))
        return outputs

    def _suppress_early_stops(self, logits: torch.Tensor, reqs: list[_Request], ahead: list[int]) -> torch.Tensor:
        """Mask stop token ids on rows whose request has not reached min_tokens (row i sits `ahead[i]`
        tokens past the request's current output)."""
        early = [(i, list(req.stop_ids)) for i, req in enumerate(reqs)
                 if len(req.seq.output_token_ids) + ahead[i] < req.seq.params.min_tokens and req.stop_ids]
        if early:
            logits = logits.clone()  # the runner's output is an inference tensor
            for i, ids in early:
                logits[i, ids] = float("-inf")  # too early to stop
        return logits

    # -- speculative decoding by prompt lookup ----------------------------------------------------
    def _propose_drafts(self) -> None:
        """Draft tokens for the decoding sequences from n-gram matches in their own context. Off when
        the batch is too large for verification to pay, for seeded sampling (whose reproducibility must
        not depend on the batch), and for a while after drafts keep missing."""
        k = self.config.num_speculative_tokens
        if k <= 0:
            return
        decoding = [s for s in self.scheduler.running if not s.is_prefill]
        enabled = len(decoding) <= self.config.speculative_max_batch
        for seq in decoding:
            seq.draft_token_ids = []
            p = seq.params
            if not enabled or not p.speculative or (p.seed is not None and p.temperature > 0):
                continue
            if seq.spec_misses >= 3 and len(seq.output_token_ids) % 8:
                continue  # back off: try again every 8 tokens
            # Drafts count as output: no more than the tokens still to produce (a bonus token past
            # max_tokens is dropped by the length stop).
            room = min(k, p.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                seq.draft_token_ids = propose_ngram(seq.token_ids, room)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> RequestOutput:
        """Accept the longest valid prefix of the draft (rejection sampling keeps the distribution),
        then append it and one more token from the target model."""
        req = self.requests[seq.request_id]
        draft = seq.draft_token_ids
        base = self._sampling_row(seq)
        rows = [dataclasses.replace(base, output_token_ids=seq.output_token_ids + draft[:j])
                for j in range(len(draft) + 1)]
        logits = self._suppress_early_stops(logits, [req] * len(rows), list(range(len(rows))))
        probs, raw_logprobs = self.sampler.probs(logits, rows)
        greedy = seq.params.temperature < 1e-5
        accepted, next_token = verify(probs, draft, req.generator, greedy)
        verdict = build_verdict(draft, accepted, next_token, raw_logprobs)
        self.spec_proposed += len(draft)
        self.spec_accepted += accepted
        seq.spec_misses = seq.spec_misses + 1 if accepted == 0 else 0
        seq.draft_token_ids = []
        seq.num_computed_tokens += 1 + accepted  # KV of rejected positions is dead: overwritten later
        self.block_manager.commit(seq)
        now = time.monotonic()
        merged = None
        for token, logprob in zip(verdict.tokens, verdict.logprobs):
            out = self._append_token(req, token, logprob, now)
            merged = out if merged is None else merged.absorb(out)
            if out.finished:
                break
        return merged

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        return SamplingRow(**p.sampling_controls(),
                           prompt_token_ids=seq.prompt_token_ids if p.repetition_penalty != 1.0 else (),
                           output_token_ids=seq.output_token_ids)

    def _append_token(self, req: _Request, token: int, logprob: float, now: float) -> RequestOutput:
        seq = req.seq
        seq.output_token_ids.append(token)
        seq.output_logprobs.append(logprob)
        if seq.timings.first_token is None:
            seq.timings.first_token = now
        reason = None
        if token in req.stop_ids:
            reason = FinishReason.STOP
            update_delta = ""
        else:
            update = req.detok.add_tokens([token])
            update_delta = update.delta
            if update.stopped:
                reason = FinishReason.STOP
                req.stop_string_hit = True
            elif len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is None:
            return self._output(req, update_delta, [token], [logprob])
        self.scheduler.finish(seq, reason, now)
        self._forget(req)
        return self._output(req, update_delta, [token], [logprob])

    def _forget(self, req: _Request) -> None:
        """Drop a finished request; a replaced adapter version goes with its last request."""
        del self.requests[req.seq.request_id]
        t = req.seq.timings
        if req.seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and t.first_scheduled and t.finished:
            service = t.finished - t.first_scheduled
            ewma = self._service_s_ewma
            self._service_s_ewma = service if ewma is None else 0.8 * ewma + 0.2 * service
        if req.seq.adapter is not None:
            self._drop_if_unused(req.seq.adapter)

    def _expire(self, now: float) -> list[RequestOutput]:
        outputs = []
        for req in [r for r in self.requests.values() if r.seq.deadline is not None and r.seq.deadline <= now]:
            self.scheduler.finish(req.seq, FinishReason.TIMEOUT, now)
            self._forget(req)
            outputs.append(self._output(req, "", []))
        return outputs

    def _output(self, req: _Request, delta: str, new_ids: list[int], new_logprobs: list[float] | None = None
                ) -> RequestOutput:
        """The output of one step: the deltas, and the state so far as O(1) views (whole copies on the
        final output only), so no step costs memory or time in proportion to the output's length."""
        seq = req.seq
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
        )

    # -- conveniences ----------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion as one continuous batch; outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(rid, prompt, p)
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
        """A rough estimate of how long a request arriving now waits before it is scheduled: zero while
        the batch has room, else one average service time per full batch of requests ahead of it."""
        waiting = self.scheduler.num_waiting + extra_waiting
        if len(self.scheduler.running) + waiting < self.config.max_num_seqs or self._service_s_ewma is None:
            return 0.0
        batches_ahead = (waiting + self.config.max_num_seqs) // self.config.max_num_seqs
        return batches_ahead * self._service_s_ewma

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.scheduler.running),
            "waiting": self.scheduler.num_waiting,
            "kv_blocks_used": self.block_manager.num_used_blocks,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "kv_blocks_total": self.block_manager.num_blocks,
            "prefix_cache_blocks": self.block_manager.num_cached_blocks,
            "prefix_cache_hit_blocks": self.block_manager.hits,
            "spec_proposed_tokens": self.spec_proposed,
            "spec_accepted_tokens": self.spec_accepted,
            "preemptions": self.num_preemptions,
            "adapter_slots_pinned": self.slots.num_pinned,
            "adapter_slot_loads": self.slots.loads,
        }
