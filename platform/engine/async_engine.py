"""Runs an LLMEngine on a background thread and gives each request an async token stream.

The engine thread owns all engine state: requests and aborts reach it through an inbox, outputs go
back to each request's asyncio queue with `call_soon_threadsafe`. The thread sleeps on a condition
when there is no work, so an idle server uses no CPU.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loramux.adapters.peft_format import LoRAAdapter
from loramux.engine.engine import LLMEngine, RequestOutput
from loramux.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    adapter: str | LoRAAdapter | None
    arrival: float | None
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: deque = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="loramux-engine", daemon=True)
        self._thread.start()

    # -- caller side (event loop) ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, adapter: str | LoRAAdapter | None = None,
                       arrival: float | None = None, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs step by step; leaving the loop early aborts the request.
        `arrival` (time.monotonic()) is when the request reached the server: queue time, TTFT and the
        deadline count from it."""
        if self._stopped:
            raise EngineDeadError("the engine has stopped")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        accepted = loop.create_future()
        self._post(_Add(request_id, prompt, params, priority, adapter, arrival, cache_salt, loop, queue, accepted))
        finished = False
        try:
            await accepted  # raises RequestError for a request the engine refuses
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks are freed at the engine's next step boundary."""
        self._post(("abort", request_id))

    def evict_adapter(self, digest: str) -> None:
        """An adapter version was deleted: its device slot is freed after its running requests."""
        self._post(("evict", digest))

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    # What the HTTP layer needs of the model, so routes never reach inside the engine. Tokenizing is
    # thread-safe and is called from the threadpool, off the event loop.
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no template)."""
        return self.engine.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat messages rendered with the model's chat template (generation prompt added)."""
        return self.engine.encode_chat(messages)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs)."""
        tokenizer = self.engine.tokenizer
        return [tokenizer.decode([i]) for i in ids]

    def estimated_queue_wait_s(self) -> float:
        """See LLMEngine.estimated_queue_wait_s; requests still in the inbox count as waiting."""
        return self.engine.estimated_queue_wait_s(extra_waiting=len(self._inbox))

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

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
        finally:
            with self._wake:
                self._stopped = True
                pending = list(self._inbox)
                self._inbox.clear()
            dead = EngineDeadError("the engine has stopped")
            for item in pending:
                if isinstance(item, _Add):
                    _post_to(item.loop, _settle, item.accepted, dead)
            self._fail_all(dead)

    def _handle(self, item) -> None:
        if isinstance(item, _Add):
            try:
                self.engine.add_request(item.request_id, item.prompt, item.params, item.priority,
                                        arrival=item.arrival, adapter=item.adapter, cache_salt=item.cache_salt)
            except Exception as exc:  # noqa: BLE001 - a refused request (RequestError) or a bug: its caller gets it
                _post_to(item.loop, _settle, item.accepted, exc)
                return
            self._streams[item.request_id] = (item.loop, item.queue)
            _post_to(item.loop, _settle, item.accepted, None)
        elif item[0] == "evict":
            self.engine.evict_adapter(item[1])
        else:
            _, request_id = item
            out = self.engine.abort_request(request_id)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, queue = target
        _post_to(loop, queue.put_nowait, out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for loop, queue in self._streams.values():
            _post_to(loop, queue.put_nowait, exc)
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
