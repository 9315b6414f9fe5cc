"""A request's prompt: a cheap lower bound of its token count, and its token ids (in the threadpool, off
the event loop).

Tokenizing (and rendering a chat template) costs time in proportion to the text, so it comes last: after
the key, after the rate limiter, and after `Prompt.min_tokens`, which bounds the token count from the
character count alone. One token stands for at most `max_chars_per_token` characters of text (the
longest token of the vocabulary), so a text of n characters has at least ceil(n / that) tokens, and a
prompt whose bound already fills the context is refused without being tokenized.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

from fastapi.concurrency import run_in_threadpool

from loramux.server.http.errors import ApiError

# Tokenizer parts (HF `tokenizers` JSON types) that never make text shorter: with only these, every
# character of the input is covered by some token. Others (whitespace splitting, stripping, regex
# replacements, WordPiece's [UNK] for a whole word) can drop or fold any number of characters.
_KEEPING_NORMALIZERS = frozenset({"Prepend", "NFD", "NFKD", "Lowercase"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"})


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters one token of `tokenizer` (a Hugging Face fast tokenizer) stands for: the
    length of its longest token, added tokens included. Byte-level tokens are one character per byte and
    a byte-fallback token is longer than the one byte it stands for, so the length never undercounts.
    None when the tokenizer can drop or fold text (see above): no such bound holds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - an unusual tokenizer: no bound rather than a wrong one
        return None
    if not (_keeps_text(spec.get("normalizer"), "normalizers", _KEEPING_NORMALIZERS)
            and _keeps_text(spec.get("pre_tokenizer"), "pretokenizers", _KEEPING_PRE_TOKENIZERS)
            and _model_covers_every_char(spec.get("model") or {})):
        return None
    return max(map(len, tokenizer.get_vocab()), default=0) or None


def _keeps_text(part: dict | None, children: str, keeping: frozenset[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p, children, keeping) for p in part.get(children) or ())
    if kind == "Replace":  # a fixed string replaced by one at least as long
        pattern = part.get("pattern") or {}
        return "String" in pattern and len(part.get("content", "")) >= len(pattern["String"])
    if part.get("behavior") == "Removed":  # Split / Punctuation dropping what they split on
        return False
    return kind in keeping


def _model_covers_every_char(model: dict) -> bool:
    """BPE and Unigram cover every character unless unknown characters fuse into one unknown token."""
    if model.get("type") not in ("BPE", "Unigram"):
        return False
    return bool(model.get("byte_fallback")) or not model.get("fuse_unk", model.get("type") == "Unigram")


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

    async def tokenize(self, engine) -> list[int]:
        """The prompt's token ids; `engine` is the AsyncEngine."""
        if self.token_ids is not None:
            return list(self.token_ids)
        if self.text is not None:
            return await tokenize_text(engine, self.text)
        return await tokenize_chat(engine, self.messages or [], self.tools)


async def tokenize_text(engine, text: str) -> list[int]:
    """Token ids of raw text (no chat template). `engine` is the AsyncEngine."""
    return await run_in_threadpool(engine.encode, text)


async def tokenize_chat(engine, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of chat messages (and `tools`, for a template that takes them) rendered with the model's
    template; 400 when they do not fit it."""
    try:
        if tools:
            return await run_in_threadpool(chat_template_ids, tokenizer_of(engine), messages, tools)
        return await run_in_threadpool(engine.encode_chat, messages)
    except Exception as exc:  # noqa: BLE001 - jinja TemplateError and friends: the messages do not fit
        raise ApiError(400, f"messages do not fit the model's chat template: {exc}") from None


def tokenizer_of(engine):
    """The Hugging Face tokenizer behind an AsyncEngine or a cluster's RemoteEngine (thread-safe for encoding
    and decoding)."""
    return engine.tokenizer


def template_takes_tools(engine) -> bool:
    """Whether the model's chat template renders `tools` itself (it refers to them); SmolLM2's does not."""
    template = getattr(tokenizer_of(engine), "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return isinstance(template, str) and "tools" in template


def chat_template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` (and `tools`, if any) under the tokenizer's chat template, ready for the
    assistant's turn."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# Tokens a content boundary may share with the template around it (a merge at each end of the content).
_BOUNDARY_MERGES = 2
_per_message: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def template_tokens_per_message(tokenizer) -> int:
    """A lower bound of the tokens `tokenizer`'s chat template adds for each message besides its content:
    the smallest growth, over the roles, from one message to two of that role (minus the content's token
    and the merges a content may make with its surroundings). 0 when the template cannot say (no template,
    or one that refuses two messages of a role in a row): then no per-message bound is used."""
    try:
        growth = []
        for role in ("system", "user", "assistant", "tool"):
            message = {"role": role, "content": "x"}
            one = len(chat_template_ids(tokenizer, [message]))
            two = len(chat_template_ids(tokenizer, [message, message]))
            growth.append(two - one - len(tokenizer.encode("x", add_special_tokens=False)))
    except Exception:  # noqa: BLE001 - any template failure: no bound rather than a wrong one
        return 0
    return max(0, min(growth) - _BOUNDARY_MERGES)


async def tokens_per_message(engine) -> int:
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


def decode(engine, ids: list[int]) -> str:
    """The text of token ids (e.g. a prompt given as ids, echoed back)."""
    return tokenizer_of(engine).decode(ids)
