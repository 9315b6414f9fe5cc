"""The answer to a started request: the final JSON once every choice ended (built in the threadpool), or an
SSE stream; either way the request ends, and frees what it holds, when the client goes away."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse

from loramux.engine.outputs import RequestOutput
from loramux.server.http.errors import client_disconnected
from loramux.server.http.sse import guarded
from loramux.server.serving.running import Running


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
