"""The model's tokenizer as engine clients use it (thread-safe; call it off the event loop): one chat-template
encoder, and the bounds that let a server refuse a prompt before paying to tokenize it.

Tokenizing costs time in proportion to the text. One token stands for at most `max_chars_per_token`
characters (the longest token of the vocabulary), so a text of n characters has at least ceil(n / that)
tokens; `template_tokens_per_message` bounds what a chat template adds around each message. No torch.
"""
from __future__ import annotations

import functools
import json
from typing import Any

__all__ = ["TokenizerMethods", "chat_template_ids", "max_chars_per_token", "template_takes_tools",
           "template_tokens_per_message"]

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


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself (it refers to them); SmolLM2's does not."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    return isinstance(template, str) and "tools" in template


class TokenizerMethods:
    """The `EngineClient` members that only the model's tokenizer answers, for an engine client with a
    `tokenizer` attribute (`AsyncEngine`, the cluster's `RemoteEngine`)."""

    tokenizer: Any

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """`max_chars_per_token(self.tokenizer)`, computed once."""
        return max_chars_per_token(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no template; the tokenizer's own special tokens, e.g. BOS, added)."""
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of chat messages (and `tools`) under the model's chat template (see `chat_template_ids`)."""
        return chat_template_ids(self.tokenizer, messages, tools)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, decoded alone (for logprobs)."""
        return [self.tokenizer.decode([i]) for i in ids]
