"""Runs an LLMEngine on a background thread and gives each request an async token stream.

The engine thread owns all engine state: requests and aborts reach it through an inbox, outputs go
into each request's bounded buffer (`_Stream`) and wake its reader with `call_soon_threadsafe`. The
thread sleeps on a condition when there is no work, so an idle server uses no CPU.

Backpressure: the engine thread never waits for a reader. A reader that falls behind gets its outputs
coalesced (past `max_buffered_outputs` undelivered outputs, new ones fold into the last: its memory is
the text itself, never a copy per step); a reader that takes nothing for `stalled_reader_timeout_s`
while outputs wait has its request aborted, so its KV blocks and adapter slot go to other requests, and
reads, if it ever reads again, the outputs so far ending in one with finish_reason "cancelled".

Structured output never compiles on the engine thread: `generate` compiles the request's grammar first
(in a killable worker process of the grammar cache's `CompilePool`, within `compile_limits`; a cache hit
when the server checked the spec before) and hands the engine the CompiledGrammar, which the request
holds until it ends, so neither a slow spec nor an LRU eviction can freeze the other streams.

Medusa heads are copied to the device off the engine thread too: `generate` has the request's heads placed
(`LLMEngine.prepare_medusa`, on a helper thread, within LORAMUX_MEDUSA_DEVICE_BYTES) before the request enters
the engine, and hands the engine the leased device copy, or nothing when they cannot be placed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from loramux.adapters.formats.medusa import MedusaHeadsWeights
from loramux.engine.engine import LLMEngine, RequestError, RequestOutput
from loramux.engine.request import EngineRequest
from loramux.engine.sampling.params import StructuredOutput
from loramux.engine.speculation.medusa_heads import MedusaHeads
from loramux.engine.structured.compile_pool import CompileBusy, CompileLimits
from loramux.engine.structured.grammar import StructuredOutputError
from loramux.engine.tokens import TokenizerMethods

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineStepError(RuntimeError):
    """An engine step failed, so the requests in flight were cancelled. Each request gets its own error
    naming only itself: the cause (which may concern another tenant's request) is logged, never shown."""


@dataclass
class _Add:
    request: EngineRequest  # its `medusa`: the prepared device heads (leased), or None
    grammar: object  # params.structured's CompiledGrammar (None: unconstrained)
    loop: asyncio.AbstractEventLoop
    stream: _Stream
    accepted: asyncio.Future

    @property
    def heads(self) -> MedusaHeads | None:
        heads = self.request.medusa
        assert heads is None or isinstance(heads, MedusaHeads)  # generate put the prepared heads there
        return heads


class _Stream:
    """One request's outputs its reader has not taken yet: the engine thread appends, the reader's event
    loop takes, both under `AsyncEngine._lock` (held for a few list operations, never across a wait)."""

    __slots__ = ("loop", "items", "waiter", "since", "pieces", "closed", "on_abandoned")

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_abandoned: Callable[[RequestOutput], None] | None = None):
        self.loop = loop
        self.on_abandoned = on_abandoned  # called on `loop` with the final output when a stall aborts it
        self.items: deque[RequestOutput | BaseException] = deque()
        self.waiter: asyncio.Future | None = None  # the reader's, while it waits for an item
        self.since: float | None = None  # since when the reader has had an item to take and has not taken one
        self.pieces: list[str] | None = None  # delta_text of outputs coalesced into items[-1], joined when taken
        self.closed = False  # the reader is gone: drop whatever comes


class AsyncEngine(TokenizerMethods):
    """The `EngineClient` of an LLMEngine in this process, run on its own thread."""

    def __init__(self, engine: LLMEngine, stalled_reader_timeout_s: float = 30.0, max_buffered_outputs: int = 64,
                 compile_limits: CompileLimits | None = None):
        """`stalled_reader_timeout_s`: abort a request whose reader has taken nothing for this long while
        outputs wait (LORAMUX_STALLED_READER_TIMEOUT_S); `max_buffered_outputs`: undelivered outputs kept
        apart per request before later ones are coalesced into the last; `compile_limits`: how grammar
        compiles are bounded (LORAMUX_STRUCTURED_COMPILE_*; the defaults when None)."""
        if stalled_reader_timeout_s <= 0 or max_buffered_outputs < 1:
            raise ValueError("stalled_reader_timeout_s must be > 0 and max_buffered_outputs >= 1")
        self.engine = engine
        engine.grammars.use_pool(compile_limits or CompileLimits())
        self.stalled_reader_timeout_s = stalled_reader_timeout_s
        self.max_buffered_outputs = max_buffered_outputs
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, _Stream] = {}  # engine thread only: streams of requests still in the engine
        self._lock = threading.Lock()  # guards every _Stream and the gauges below
        self._buffered_outputs = 0  # outputs in all buffers (gauge)
        self._buffered_tokens = 0  # their new tokens (gauge)
        self._stalled_aborts = 0  # requests aborted because their reader stalled (counter)
        self._stopped = False
        self._medusa_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="loramux-medusa-device")
        self._thread = threading.Thread(target=self._run, name="loramux-engine", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """Whether the engine loop has ended (shut down, or died): every new request gets EngineDeadError."""
        return self._stopped

    # -- caller side (event loop) ----------------------------------------------------------------
    async def generate(self, request: EngineRequest, on_abandoned: Callable[[RequestOutput], None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; leaving the loop early aborts the request.
        `request.arrival` (time.monotonic()) is when the request reached the server: queue time, TTFT and the
        deadline count from it. `on_abandoned(final output)` runs on this event loop if the request is
        aborted because its reader stalled: the reader may be stuck (a client that never reads) and never
        see that final output, but whoever holds resources for the request must still let them go.
        A constrained request's grammar is compiled first (see the module docstring): a spec refused or
        stopped by the compile limits raises RequestError, busy compile workers EngineDeadError (retry).
        `request.medusa` (Medusa heads in host RAM) is copied to the device first, off the engine thread (see the
        module docstring), and the engine's add_request gets the request with those heads when they could be
        placed, else with none."""
        if self._stopped:
            raise EngineDeadError("the engine has stopped")
        structured = request.params.structured
        grammar = await self._grammar(structured) if structured is not None else None
        heads = await self._medusa(request.medusa) if request.medusa is not None else None
        if self._stopped:
            self._release_heads(heads)
            raise EngineDeadError("the engine has stopped")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, on_abandoned)
        accepted = loop.create_future()
        self._post(_Add(replace(request, medusa=heads), grammar, loop, stream, accepted))
        finished = False
        try:
            await accepted  # raises RequestError for a request the engine refuses
            while True:
                out = await self._take(stream)
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            self._close(stream)
            if not finished:
                self.abort(request.request_id)

    async def _grammar(self, spec: StructuredOutput):
        """`spec`'s CompiledGrammar, compiled off the engine thread and the event loop within the limits."""
        try:  # shielded: a caller that leaves does not cancel a compile other requests may share
            return await asyncio.shield(asyncio.wrap_future(self.engine.grammars.compile_future(spec)))
        except StructuredOutputError as exc:
            raise RequestError(str(exc)) from None
        except CompileBusy as exc:
            raise EngineDeadError(f"structured output cannot be compiled now ({exc}); retry the request") from None

    async def _medusa(self, weights: MedusaHeadsWeights | MedusaHeads) -> MedusaHeads | None:
        """`weights`' pinned device copy, made (or found cached) on the helper thread; None: the request runs
        without them. RequestError when they do not fit the model. Heads already placed pass as they are."""
        if isinstance(weights, MedusaHeads):
            return weights
        heads = self.engine.medusa_device.cached(weights.digest)  # a hit costs no thread hop
        if heads is not None:
            return heads
        try:
            future = asyncio.get_running_loop().run_in_executor(self._medusa_pool, self.engine.prepare_medusa, weights)
        except RuntimeError:  # the helper is shut down
            raise EngineDeadError("the engine has stopped") from None
        try:  # shielded: a caller that leaves gives back the copy once it is made
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():  # not the caller leaving (the shield holds then): the helper was shut down
                raise EngineDeadError("the engine has stopped") from None
            future.add_done_callback(lambda f: self._release_heads(
                None if f.cancelled() or f.exception() is not None else f.result()))
            raise
        except RequestError:
            raise
        except Exception:  # noqa: BLE001 - heads only speed a request up: never fail it for them
            log.exception("Medusa heads could not be placed on the device; the request runs without them")
            return None

    def _release_heads(self, heads: MedusaHeads | None) -> None:
        if heads is not None:
            self.engine.release_medusa(heads)

    async def _take(self, stream: _Stream) -> RequestOutput | BaseException:
        """The next item of `stream`, waiting for the engine thread to put one there."""
        while True:
            with self._lock:
                if stream.items:
                    item = stream.items.popleft()
                    if not stream.items and stream.pieces is not None:  # the coalesced last output
                        assert isinstance(item, RequestOutput)  # pieces fold only into an output
                        item.delta_text = "".join(stream.pieces)
                        stream.pieces = None
                    stream.since = time.monotonic() if stream.items else None
                    self._buffered_outputs -= 1
                    if isinstance(item, RequestOutput):
                        self._buffered_tokens -= len(item.new_token_ids)
                    return item
                waiter = stream.waiter = stream.loop.create_future()
            await waiter

    def _close(self, stream: _Stream) -> None:
        """The reader is done with `stream`: free what it still buffers and drop what comes later."""
        with self._lock:
            stream.closed = True
            self._buffered_outputs -= len(stream.items)
            self._buffered_tokens -= sum(len(i.new_token_ids) for i in stream.items if isinstance(i, RequestOutput))
            stream.items.clear()
            stream.pieces = None

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the engine's next step boundary."""
        self._post(("abort", request_id))

    def evict_adapter(self, digest: str) -> None:
        """An adapter version was deleted: its device slot is freed after its running requests."""
        self._post(("evict", digest))

    def stats(self) -> dict[str, int]:
        """The engine's state, plus `buffered_outputs` / `buffered_tokens` (outputs, and their new tokens,
        waiting for their readers) and `stalled_reader_aborts` (requests aborted for a stalled reader)."""
        with self._lock:
            buffered = {"buffered_outputs": self._buffered_outputs, "buffered_tokens": self._buffered_tokens,
                        "stalled_reader_aborts": self._stalled_aborts}
        return {**self.engine.stats(), **buffered}

    def compile_structured(self, spec: StructuredOutput) -> None:
        """Compile a structured-output constraint into the engine's grammar cache, in a worker process
        within the compile limits; raise StructuredOutputError (a ValueError whose message is fit for the
        user; StructuredOutputTooComplex when a limit stopped it) or CompileBusy (no worker free in time).
        Thread-safe and blocking: call it in a worker thread before `generate`. It returns only once the
        compile has finished or its process is dead, so a caller that holds the request's admission
        until then counts the whole compile against the tenant."""
        self.engine.grammars.compile(spec)

    def adapter_residency(self, digest: str) -> str | None:
        """See LLMEngine.adapter_residency: "device", "loading" or None."""
        return self.engine.adapter_residency(digest)

    # What the HTTP layer needs of the model, so routes never reach inside the engine (the tokenizer's
    # part: TokenizerMethods).
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        """The model's Hugging Face tokenizer (thread-safe for encoding and decoding)."""
        return self.engine.tokenizer

    def estimated_queue_wait_s(self) -> float:
        """See LLMEngine.estimated_queue_wait_s; requests still in the inbox count as waiting."""
        return self.engine.estimated_queue_wait_s(extra_waiting=len(self._inbox))

    async def connect(self) -> None:
        """Nothing to learn: the engine is in this process."""

    def shutdown(self) -> None:
        """Stop the engine thread (requests in flight end with EngineDeadError), the compile workers and
        the adapter pool's copy thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self._medusa_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.grammars.shutdown()
        if self.engine.pool is not None:
            self.engine.pool.shutdown()

    def _post(self, item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.engine.has_unfinished() and not self._stopped:
                        self._wake.wait()
                    if self._stopped:
                        break
                    items = list(self._inbox)
                    self._inbox.clear()
                try:
                    for item in items:
                        self._handle(item)
                    outputs = self.engine.step()
                except Exception as exc:  # a bug must not hang every client: fail in-flight requests
                    log.exception("engine step failed; failing in-flight requests")
                    self._fail_all(exc)
                    continue
                for out in outputs:
                    self._deliver(out)
                self._abort_stalled()
        finally:
            with self._wake:
                self._stopped = True
                pending = list(self._inbox)
                self._inbox.clear()
            dead = EngineDeadError("the engine has stopped")
            for item in pending:
                if isinstance(item, _Add):
                    self._release_heads(item.heads)
                    _post_to(item.loop, _settle, item.accepted, dead)
            self._fail_all(dead)

    def _handle(self, item) -> None:
        if isinstance(item, _Add):
            try:
                self.engine.add_request(item.request, grammar=item.grammar)
            except Exception as exc:  # noqa: BLE001 - a refused request (RequestError) or a bug: its caller gets it
                self._release_heads(item.heads)  # a refused request never took its heads' pin over
                _post_to(item.loop, _settle, item.accepted, exc)
                return
            self._streams[item.request.request_id] = item.stream
            _post_to(item.loop, _settle, item.accepted, None)
        elif item[0] == "evict":
            self.engine.evict_adapter(item[1])
        else:
            _, request_id = item
            out = self.engine.abort_request(request_id)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        self._push(stream, out)

    def _push(self, stream: _Stream, item: RequestOutput | BaseException) -> None:
        """Hand `item` to the stream's reader without ever waiting for it: past `max_buffered_outputs`
        undelivered outputs, an output folds into the last one instead of queueing."""
        with self._lock:
            if stream.closed:
                return
            items = stream.items
            tail = items[-1] if items else None
            if (isinstance(item, RequestOutput) and isinstance(tail, RequestOutput) and not tail.finished
                    and len(items) >= self.max_buffered_outputs):
                if stream.pieces is None:
                    stream.pieces = [tail.delta_text]
                stream.pieces.append(item.delta_text)  # joined once when taken, not copied per step
                item.delta_text = ""
                tail.absorb(item)
            else:
                if stream.pieces is not None:
                    assert isinstance(tail, RequestOutput)  # pieces fold only into an output
                    tail.delta_text = "".join(stream.pieces)
                    stream.pieces = None
                items.append(item)
                self._buffered_outputs += 1
            if isinstance(item, RequestOutput):
                self._buffered_tokens += len(item.new_token_ids)
            if stream.since is None:
                stream.since = time.monotonic()
            waiter, stream.waiter = stream.waiter, None
        if waiter is not None:
            _post_to(stream.loop, _settle, waiter, None)

    def _abort_stalled(self) -> None:
        """Abort the requests whose reader has left an output untaken for `stalled_reader_timeout_s`."""
        cutoff = time.monotonic() - self.stalled_reader_timeout_s
        with self._lock:
            stalled = [rid for rid, s in self._streams.items() if s.since is not None and s.since < cutoff]
            self._stalled_aborts += len(stalled)
        for request_id in stalled:
            log.warning("request %s: its reader took nothing for %.1f s; aborting it (LORAMUX_STALLED_READER_"
                        "TIMEOUT_S)", request_id, self.stalled_reader_timeout_s)
            stream = self._streams.get(request_id)
            out = self.engine.abort_request(request_id)
            if out is not None:
                if stream is not None and stream.on_abandoned is not None:
                    _post_to(stream.loop, stream.on_abandoned, out)
                self._deliver(out)

    def _fail_all(self, exc: BaseException) -> None:
        """Cancel every request in flight; each reader gets `exc` if it is EngineDeadError, else its own
        EngineStepError."""
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for request_id, stream in self._streams.items():
            self._push(stream, exc if isinstance(exc, EngineDeadError) else EngineStepError(
                f"request {request_id} was cancelled: the server failed while generating (the failure is logged)"))
        self._streams.clear()


def _post_to(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's event loop is closed: nobody is listening any more
        pass


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
