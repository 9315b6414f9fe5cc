"""Turning a request's text into token ids, in the threadpool (off the event loop)."""
from __future__ import annotations

from fastapi.concurrency import run_in_threadpool

from loramux.server.errors import ApiError


async def tokenize_text(engine, text: str) -> list[int]:
    """Token ids of raw text (no chat template). `engine` is the AsyncEngine."""
    return await run_in_threadpool(engine.encode, text)


async def tokenize_chat(engine, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of chat messages rendered with the model's template; 400 when they do not fit it."""
    try:
        return await run_in_threadpool(engine.encode_chat, messages)
    except Exception as exc:  # noqa: BLE001 - jinja TemplateError and friends: the messages do not fit
        raise ApiError(400, f"messages do not fit the model's chat template: {exc}") from None
