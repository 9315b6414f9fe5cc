"""A request's prompt: a cheap lower bound of its token count, and its token ids (in the threadpool, off
the event loop).

Tokenizing (and rendering a chat template) costs time in proportion to the text, so it comes last: after
the key, after the rate limiter, and after `Prompt.min_tokens`, which bounds the token count from the
character count alone (the engine's `max_chars_per_token` and `template_tokens_per_message`, see
`loramux.engine.tokens`), so a prompt whose bound already fills the context is refused without being
tokenized.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool

from loramux.engine.client import EngineClient
from loramux.engine.tokens import template_takes_tools, template_tokens_per_message
from loramux.server.http.errors import ApiError


@dataclass(frozen=True)
class Prompt:
    """What a request asks the model to continue: raw `text` (no template), chat `messages` (the model's
    template applied) or `token_ids`; exactly one is set."""

    text: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    tools: list[dict] | None = None  # with messages: tools for a chat template that takes them

    def chars(self) -> int:
        """Characters of text the tokenizer will see at least (a template may trim each message)."""
        if self.text is not None:
            return len(self.text)
        return sum(len((m.get("content") or "").strip()) for m in self.messages or ())

    def min_tokens(self, max_chars_per_token: int | None, tokens_per_message: int = 0) -> int:
        """A lower bound of the prompt's token count, without tokenizing (exact for token ids; 0 when the
        tokenizer gives no bound): the text's characters at `max_chars_per_token` each, plus for chat
        messages `tokens_per_message` each (what the template adds around a message's content, see
        `template_tokens_per_message`), so 100k empty messages cannot pass as an empty prompt."""
        if self.token_ids is not None:
            return len(self.token_ids)
        if not max_chars_per_token:
            return 0
        return -(-self.chars() // max_chars_per_token) + len(self.messages or ()) * tokens_per_message

    async def tokenize(self, engine: EngineClient) -> list[int]:
        """The prompt's token ids."""
        if self.token_ids is not None:
            return list(self.token_ids)
        if self.text is not None:
            return await tokenize_text(engine, self.text)
        return await tokenize_chat(engine, self.messages or [], self.tools)


async def tokenize_text(engine: EngineClient, text: str) -> list[int]:
    """Token ids of raw text (no chat template)."""
    return await run_in_threadpool(engine.encode, text)


async def tokenize_chat(engine: EngineClient, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of chat messages (and `tools`, for a template that takes them) rendered with the model's
    template; 400 when they do not fit it."""
    try:
        return await run_in_threadpool(engine.encode_chat, messages, tools)
    except Exception as exc:  # noqa: BLE001 - jinja TemplateError and friends: the messages do not fit
        raise ApiError(400, f"messages do not fit the model's chat template: {exc}") from None


_per_message: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def tokens_per_message(engine: EngineClient) -> int:
    """`template_tokens_per_message` of the engine's tokenizer, computed once (in the threadpool)."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return 0
    try:
        cached = _per_message.get(tokenizer)
    except TypeError:  # not weakly referenceable: computed each time
        return await run_in_threadpool(template_tokens_per_message, tokenizer)
    if cached is None:
        cached = _per_message[tokenizer] = await run_in_threadpool(template_tokens_per_message, tokenizer)
    return cached


def decode(engine: EngineClient, ids: list[int]) -> str:
    """The text of token ids (e.g. a prompt given as ids, echoed back)."""
    return engine.tokenizer.decode(ids)


def renders_tools(engine: EngineClient) -> bool:
    """Whether the engine's chat template renders `tools` itself; if not, the tool prompt goes into the messages."""
    return template_takes_tools(engine.tokenizer)
