"""Server-sent events: framing, the one guard that turns a mid-stream failure into a final error event,
and the OpenAPI description of routes that answer either JSON or a stream."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from loramux.server.http.errors import ApiError, error_body

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"

# A route that can stream documents the server-sent-event media type next to its JSON body.
STREAMED = {200: {"description": "The result: JSON, or a stream of server-sent events with `stream: true`",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def sse_event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def guarded(events: AsyncIterator[str], request_id: str) -> AsyncIterator[str]:
    """Stream `events`. Once the headers are out a failure can no longer change the status, so it becomes
    a final event in the error shape (with the request id, never internals). A client that goes away
    closes this generator, which closes `events` and so cancels the request in the engine."""
    try:
        async for event in events:
            yield event
    except ApiError as exc:  # e.g. billing_failed: its message is written for the client
        log.error("stream of request %s ended with %d %s: %s", request_id, exc.status, exc.code, exc)
        yield sse_event(error_body(exc.status, str(exc), exc.code, exc.param))
    except Exception:  # noqa: BLE001 - reported to the client as an event, logged in full here
        log.exception("stream of request %s failed", request_id)
        body = error_body(500, f"the server failed while generating; request id {request_id}", "server_error")
        yield sse_event(body)
    finally:
        await events.aclose()  # RunningStreamingResponse then ends the request if it has not ended
