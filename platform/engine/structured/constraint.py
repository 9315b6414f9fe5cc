"""Structured output inside the engine: each constrained request's grammar state (`Constraint`), the token
masks one sampler call applies to the constrained rows of a batch, and speculative drafts cut to what the
grammar allows (`Constraint.cut_draft`), with a mask for every verified position (`Constraint.draft_masker`).

A constrained request ends with finish_reason "stop" when the grammar is complete and allows nothing more
(right after its last token: no EOS is generated), or when it picks a stop token (EOS / end-of-turn) that
the grammar allows because it is complete. min_tokens does not hold back a constrained request's stop.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from loramux.engine.sampling.params import StructuredOutput
from loramux.engine.structured.grammar import GrammarCache, Matcher, allocate_mask, apply_mask_

__all__ = ["Constraint", "batch_masker"]

Masker = Callable[[torch.Tensor], None]


class Constraint:
    """One request's grammar state: `mask` ([1, W] packed bitmask) holds the tokens allowed next and is
    refreshed after every accepted token; `done` says the grammar is complete and allows no other token
    than a stop token, so the request must end now. Engine thread only."""

    def __init__(self, grammars: GrammarCache, spec: StructuredOutput, compiled=None):
        """`compiled`: `spec`'s CompiledGrammar, compiled by the caller off the engine thread (AsyncEngine
        does), held here until the request ends so that cache eviction never makes the engine thread
        compile; without it the spec is compiled here (the sync engine). Raise StructuredOutputError for a
        spec that cannot be compiled."""
        self.grammar = compiled if compiled is not None else grammars.compile(spec)
        self.matcher = Matcher(self.grammar, grammars.stop_token_ids)
        self._extra = grammars.extra_mask(spec)  # JSON: no raw control characters
        self.stop_token_ids = frozenset(grammars.stop_token_ids)
        self._vocab = grammars.vocab_size
        self._non_stop = grammars.non_stop_mask
        self.mask = allocate_mask(1, self._vocab)
        self.done = self._refresh(self.mask)
        self._draft: tuple[int, ...] = ()
        self._draft_masks = self.mask

    def _refresh(self, mask: torch.Tensor) -> bool:
        """Fill `mask` with the tokens allowed now; True when those are stop tokens only (or none)."""
        if self.matcher.is_terminated():
            return True
        self.matcher.fill_mask(mask)
        if self._extra is not None:
            mask &= self._extra
        return not bool((mask & self._non_stop).any())

    def accept(self, token: int) -> bool:
        """Advance by a chosen token; False when the grammar rejects it (an engine bug: the token was masked)."""
        if not self.matcher.accept(token):
            return False
        self.done = self._refresh(self.mask)
        return True

    def cut_draft(self, draft: Sequence[int]) -> list[int]:
        """The longest prefix of `draft` the grammar accepts, stopping before a stop token and after a token
        that completes the grammar; the matcher walks it (recording the mask at each position) and rolls
        back, so its state is unchanged."""
        masks, n = [self.mask], 0
        if not self.done:
            for token in draft:
                allowed = (int(masks[-1][0, token >> 5]) >> (token & 31)) & 1
                if not allowed or token in self.stop_token_ids or not self.matcher.accept(token):
                    break
                n += 1
                masks.append(allocate_mask(1, self._vocab))
                if self._refresh(masks[-1]):
                    break
            self.matcher.rollback(n)
        self._draft, self._draft_masks = tuple(draft[:n]), torch.cat(masks)
        return list(self._draft)

    def draft_masker(self, draft: Sequence[int]) -> Masker:
        """Masks the logits rows [len(draft) + 1, V] of a speculative decode: row j with the tokens allowed
        after draft[:j] (what plain decoding would allow there, had it produced those tokens)."""
        if tuple(draft) != self._draft:  # cut since it was proposed (the scheduler drops drafts)
            self.cut_draft(draft)
        masks = self._draft_masks
        return lambda logits: apply_mask_(logits, masks)


def batch_masker(constraints: Sequence[Constraint | None]) -> Masker | None:
    """Masks the logits [B, V] of a batch whose row i belongs to `constraints[i]` (None = unconstrained,
    left untouched); None when no row is constrained."""
    live = [(i, c) for i, c in enumerate(constraints) if c is not None]
    if not live:
        return None
    rows = [i for i, _ in live]
    bitmask = allocate_mask(len(constraints), live[0][1]._vocab)
    bitmask[rows] = torch.cat([c.mask for _, c in live])
    return lambda logits: apply_mask_(logits, bitmask, rows)
