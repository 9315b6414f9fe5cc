"""`EngineClient`: what the HTTP layer (tenant routes, admin, console) and the services hold of an engine.

Two engines provide it: `loramux.engine.async_engine.AsyncEngine` (an `LLMEngine` on a thread of this
process) and `loramux.cluster.remote_engine.RemoteEngine` (engine replicas behind Ray Serve). Routes call
nothing else on `Services.engine`, so either serves them unchanged. No torch here.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from loramux.engine.outputs import RequestOutput
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import StructuredOutput

__all__ = ["EngineClient"]


@runtime_checkable
class EngineClient(Protocol):
    # -- generation --------------------------------------------------------------------------------------
    def generate(self, request: EngineRequest, on_abandoned: Callable[[RequestOutput], None] | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Run one request; an async generator of its outputs step by step, the last one `finished`.

        `request` (see EngineRequest): its `adapter` is None for the base model, else what the adapter cache's
        lease holds for this engine (a LoRAAdapter in host RAM; a RemoteAdapter on a cluster); its `medusa` the
        Medusa heads the registry holds for the request's adapter version (else the base model's), validated
        for this model, in host RAM, or None when there are none. `on_abandoned(final output)` runs on the
        caller's event loop if the engine aborts the request because its reader stalled, so whoever holds
        resources for it can let them go even if the reader never reads again.

        Raises RequestError (the engine can never run it: HTTP 400) before the first output, or
        EngineDeadError (the engine, or its replica, stopped: retriable). Leaving the loop early (or
        `aclose()`) aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """Cancel a request (its KV blocks and adapter slot are freed at the engine's next step); unknown
        or finished ids are ignored. Thread-safe, does not wait."""
        ...

    def compile_structured(self, spec: StructuredOutput) -> None:
        """Check, and where this engine compiles, compile `spec` ahead of `generate`, so a refused spec is a
        400 before the request is queued. Blocking: call it in a worker thread. Raises StructuredOutputError
        (a ValueError whose message is fit for the user; StructuredOutputTooComplex when a compile limit
        stopped it) or CompileBusy (no compile worker free in time)."""
        ...

    # -- adapters ------------------------------------------------------------------------------------------
    def evict_adapter(self, digest: str) -> None:
        """An adapter version was deleted or replaced: drop it from the device once no running request
        uses it (on a cluster: on every replica). Requests already running finish on it."""
        ...

    def adapter_residency(self, digest: str) -> str | None:
        """Where an adapter version is: "device" (resident, on some replica), "loading" (being copied
        there) or None. Thread-safe."""
        ...

    # -- load and state ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """A snapshot of engine counters and gauges (running, waiting, KV blocks, prefix cache, speculative
        tokens, preemptions, adapter slots, `lora` residency, `steps`, reader buffers); on a cluster the
        counters summed over live replicas plus `replicas`, each one's own. Thread-safe."""
        ...

    def estimated_queue_wait_s(self) -> float:
        """Roughly how long a request arriving now waits before it runs (0.0 while the batch has room), for
        refusing a request whose deadline cannot be met. Thread-safe."""
        ...

    # -- the model, as routes need it (thread-safe; tokenizing runs in the threadpool) ---------------------
    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + output) one request may hold."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (thread-safe for encoding and decoding)."""
        ...

    @property
    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for (None: this tokenizer has no such bound),
        so a prompt too long for the context is refused before it is tokenized. Computed once (see
        `loramux.engine.tokens.max_chars_per_token`); the first read may take a moment."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no template; the tokenizer's own special tokens, e.g. BOS, added)."""
        ...

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of chat messages (and `tools`, for a template that renders them) under the model's
        chat template, ready for the assistant's turn; the template's own exception when they do not fit."""
        ...

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, decoded alone (for logprobs)."""
        ...

    # -- life cycle ----------------------------------------------------------------------------------------
    async def connect(self) -> None:
        """Learn what the engine needs from elsewhere before serving (a cluster: the replicas' context
        length); called once at the server's start. Nothing to do in process."""
        ...

    def shutdown(self) -> None:
        """Stop serving: the requests in flight end, and this engine's threads and worker processes stop (a
        cluster's replicas are Ray Serve's to stop). Called once, when the server stops."""
        ...
