"""What the engine gives: each step's output per request, and the error raised for a request it cannot
take. `loramux.engine.engine` re-exports both."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

__all__ = ["RequestOutput", "RequestError", "SoFar"]

_LATEST = ("text", "token_ids", "logprobs", "finished", "finish_reason", "timings", "num_cached_tokens",
           "top_logprobs", "speculation")


class SoFar(Sequence):
    """The first `n` items of a list that only ever grows (a request's output token ids or logprobs): a
    read-only view in O(1) memory, so an output can report the state so far without copying it."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int):
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._items[i] for i in range(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError("index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator:
        return islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SoFar({list(self)!r})"


@dataclass
class RequestOutput:
    """What one step produced for one request: the new text, tokens and logprobs (`delta_text`,
    `new_token_ids`, `new_logprobs`), and the state so far.

    Memory per output does not grow with the output's length: on an intermediate output (finished=False)
    `token_ids` and `logprobs` are `SoFar` views of the request's own lists (`len(out.token_ids)` is the
    number of tokens generated so far, at no cost) and `text` is "" (the deltas are the text); the final
    output (finished=True, also for a cancelled or timed-out request) carries the whole `text` and plain
    lists of every token and logprob."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    text: str
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    timings: dict[str, Any] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    adapter: str | None = None  # adapter name as requested
    new_logprobs: list[float] = field(default_factory=list)  # one per new_token_ids
    # With SamplingParams.top_logprobs = k > 0: for each generated token, the k most likely tokens of the raw
    # distribution as (token id, logprob), most likely first; `top_logprobs` covers all tokens so far (a SoFar
    # view on intermediate outputs), `new_top_logprobs` one entry per new_token_ids. Empty when k = 0.
    top_logprobs: Sequence[list[tuple[int, float]]] = ()
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    replica: str | None = None  # the engine replica that produced it (scale-out); None in a single process
    # On the final output: draft tokens {method: {"proposed": n, "accepted": m}} verified for this request.
    speculation: dict[str, dict[str, int]] = field(default_factory=dict)

    def absorb(self, later: RequestOutput) -> RequestOutput:
        """Fold in a later output of the same request (a speculative step appends several tokens; a
        stream coalesces outputs its reader has not taken yet): the deltas add up, the state so far is
        the later one's. Returns self."""
        self.delta_text += later.delta_text
        self.new_token_ids += later.new_token_ids
        self.new_logprobs += later.new_logprobs
        self.new_top_logprobs += later.new_top_logprobs
        for name in _LATEST:
            setattr(self, name, getattr(later, name))
        return self


class RequestError(ValueError):
    """A request the engine cannot take (prompt too long, duplicate id, ...); the message says why."""
