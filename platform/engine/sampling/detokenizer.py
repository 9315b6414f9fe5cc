"""Incremental detokenisation with stop strings.

An inference engine produces output token ids one (or a few) at a time and wants to stream text
as it goes. Re-decoding the whole output each step is O(n) per step (O(n^2) per request), and
naively decoding each token on its own breaks multi-byte UTF-8 characters that byte-level BPE
splits over several tokens. :class:`IncrementalDetokenizer` uses the prefix/read-offset window
technique of vLLM and TGI: every step decodes only a small window of recent tokens and emits the
part of the text that the newest tokens added.

Stop strings are handled on the decoded text: once one occurs, the text is cut right before its
earliest occurrence and nothing from there on is ever emitted. Because a stop string can span
several tokens, a tail of the text that could still turn into a stop string is held back from
the deltas until it is known not to (or until :meth:`IncrementalDetokenizer.finish`).

No torch import: this module only needs a Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DetokenizerUpdate", "IncrementalDetokenizer"]

# Decoding a partial UTF-8 sequence yields U+FFFD; text ending in it means "wait for more bytes".
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerUpdate:
    """Result of one :meth:`IncrementalDetokenizer.add_tokens` call.

    ``delta`` is new text that is safe to emit now (never a broken character, never part of a
    stop string). ``stopped`` is True once a stop string matched; the caller must then finish
    the request with reason ``"stop"``. ``matched_stop`` is the stop string that matched.
    """

    delta: str
    stopped: bool = False
    matched_stop: str | None = None


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, one call per new token (or several).

    Guarantees (for normal text): concatenating every ``delta`` (plus :meth:`finish` when the
    request did not stop on a stop string) equals
    ``tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)``, cut right before
    the earliest stop-string occurrence when one matched. Each step costs O(window + stop
    lengths), independent of how long the output already is.

    ``prompt_token_ids`` is accepted for API parity with other engines but deliberately not used
    as decoding context: the text is defined as the decode of the output ids alone (so, for
    SentencePiece tokenizers, the first output token's leading space is dropped exactly as
    ``decode`` drops it, and a prompt ending mid-character does not leak into the output).

    Stop strings match as soon as they are complete, as in a real decode loop that halts there.
    Among matches found in the same step the earliest occurrence wins. The only case in which
    this differs from "cut the final text at the earliest occurrence" is when one stop string
    contains another (stops ``["b", "abc"]`` on ``"abc"``): ``"b"`` completes first and wins,
    because waiting for the longer one would mean generating past a complete stop string.

    Not thread-safe; one instance per request.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int] | None = None,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str):
            # A bare string would otherwise be iterated as single-character stop strings.
            stop = (stop,)
        self._tokenizer = tokenizer
        self._prompt_token_ids = list(prompt_token_ids) if prompt_token_ids else []
        self._skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; duplicates only cost search time.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_stop_len = max((len(s) for s in self._stops), default=0)

        # Token strings of the output (special tokens already dropped when skipping them).
        self._tokens: list[str] = []
        # tokens[prefix_offset:read_offset] is already decoded context; tokens[read_offset:]
        # is not yet turned into text (e.g. it ends inside a multi-byte character).
        self._prefix_offset = 0
        self._read_offset = 0

        self._text = ""  # all complete text decoded so far (cut at the stop string once matched)
        self._emitted = 0  # len(text) already handed out as deltas
        self._stopped = False
        self._matched_stop: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ properties

    @property
    def text(self) -> str:
        """All text decoded so far, including the held-back tail; once a stop string matched,
        the stop string and everything after it are removed."""
        return self._text

    @property
    def stopped(self) -> bool:
        """True once a stop string matched (no further text will ever be produced)."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched, or None."""
        return self._matched_stop

    # ------------------------------------------------------------------ public API

    def add_tokens(self, new_token_ids: list[int]) -> DetokenizerUpdate:
        """Append newly generated token ids and return the text that may be emitted now.

        After a stop string matched, further calls return an empty delta with ``stopped=True``.
        """
        if self._stopped or self._finished:
            return DetokenizerUpdate("", self._stopped, self._matched_stop)
        for token_id in new_token_ids:
            prev_len = len(self._text)
            self._decode_next(int(token_id))
            # Check after each token so a stop cuts at the earliest point even when a batch of
            # tokens arrives at once; tokens after the stop are never decoded.
            if len(self._text) > prev_len and self._check_stop(prev_len):
                break
        return self._make_update()

    def finish(self) -> str:
        """Flush: return all text not yet emitted (held-back tail and any incomplete trailing
        bytes, decoded as ``decode`` gives them, i.e. possibly with U+FFFD).

        Call when the request ends for a reason other than a stop string. Returns ``""`` after a
        stop matched. Idempotent: a second call returns ``""``.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._stopped:
            return ""
        if self._read_offset < len(self._tokens):
            prev_len = len(self._text)
            prefix_text = self._decode_tokens(self._tokens[self._prefix_offset : self._read_offset])
            full_text = self._decode_tokens(self._tokens[self._prefix_offset :])
            self._text += full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._tokens)
            # The flushed bytes may complete a stop string (e.g. a token holding " " plus the
            # first byte of a character), so the cut must still be applied.
            self._check_stop(prev_len)
        delta = self._text[self._emitted :]
        self._emitted = len(self._text)
        return delta

    # ------------------------------------------------------------------ internals

    def _decode_tokens(self, tokens: list[str]) -> str:
        return self._tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def _decode_next(self, token_id: int) -> None:
        """Append one token and extend ``self._text`` by whatever complete text it yields."""
        new_tokens = self._tokenizer.convert_ids_to_tokens(
            [token_id], skip_special_tokens=self._skip_special_tokens
        )
        # Ids past the tokenizer's vocabulary (models pad their embedding) have no text: skip them.
        new_tokens = [t for t in new_tokens if t is not None]
        if not new_tokens:
            return  # a skipped special token contributes no text
        self._tokens.extend(new_tokens)

        # Decode the context window with and without the unread tokens; the difference is the
        # new text. Decoding with context (not the new token alone) is what keeps byte-level
        # pieces of one character together and spacing decoders (SentencePiece) consistent.
        prefix_text = self._decode_tokens(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode_tokens(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Incomplete UTF-8 sequence at the end (or nothing new yet): keep the tokens unread
            # so the next step decodes them together with the bytes that complete them.
            return
        self._text += new_text[len(prefix_text) :]
        # The just-read tokens become the context of the next window, bounding its size.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)

    def _check_stop(self, prev_len: int) -> bool:
        """Look for a stop string that can only now be present; cut the text if one is found.

        Only ``text[prev_len - max_stop_len + 1:]`` can contain a new occurrence: anything
        ending before ``prev_len`` would have matched on an earlier step.
        """
        if not self._stops:
            return False
        start = max(0, prev_len - self._max_stop_len + 1)
        best_idx = -1
        best_stop: str | None = None
        for s in self._stops:
            idx = self._text.find(s, start)
            # Earliest occurrence wins; on a tie the stop string listed first wins.
            if idx != -1 and (best_idx == -1 or idx < best_idx):
                best_idx, best_stop = idx, s
        if best_stop is None:
            return False
        # best_idx >= emitted always holds: the hold-back never released a possible stop start.
        self._text = self._text[:best_idx]
        self._stopped = True
        self._matched_stop = best_stop
        return True

    def _holdback(self) -> int:
        """Number of trailing characters that could still be the start of a stop string.

        That is the longest suffix of the text that is a proper prefix of some stop string (at
        most ``max_stop_len - 1``); text before it can never become part of a match.
        """
        text = self._text
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            suffix = text[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in self._stops):
                return k
        return 0

    def _make_update(self) -> DetokenizerUpdate:
        if self._stopped:
            end = len(self._text)  # already cut before the stop string
        else:
            end = len(self._text) - self._holdback()
        if end <= self._emitted:
            return DetokenizerUpdate("", self._stopped, self._matched_stop)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return DetokenizerUpdate(delta, self._stopped, self._matched_stop)
