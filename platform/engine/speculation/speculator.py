"""The engine's speculative decoding: which rows speculate each step, with which proposer, and what the
verification taught us. Three proposers share one verifier (`spec_decode.verify_draft`):

* **ngram** (prompt lookup): the context's last n-gram looked up earlier in it; free to propose.
* **medusa**: Medusa-1 heads over the final hidden state of the row's previous step (the model runner
  projects them in the same LM-head call as the step's logits, for the rows that want them); free to
  propose, a few LM-head rows to compute. Heads come with the request (its adapter version's, else the base
  model's; `loramux.adapters.formats.medusa`).
* **draft**: a second resident model with its own paged KV (`loramux.engine.speculation.draft_runner.DraftRunner`),
  run only for the rows that chose it, all of them in one batched forward per drafted position.

Every step, `propose` builds each eligible row's candidates and lets the `SpecPolicy` pick, per row, the
method with the most expected tokens and, for the step, the rows whose speculation raises predicted
throughput (so speculation turns itself off under load). Drafts are cut where the request's grammar
rejects a token. Greedy rows stay exact and sampled rows keep the target's distribution: every proposal is
a deterministic draft, verified as a point-mass proposal (see `spec_decode`).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from loramux.engine.speculation.policy import METHODS, AcceptanceStats, Candidate, SpecPolicy
from loramux.engine.speculation.verification import propose_ngram

if TYPE_CHECKING:
    from loramux.engine.sequence import Sequence
    from loramux.engine.speculation.medusa_heads import MedusaHeads
    from loramux.engine.structured.constraint import Constraint

__all__ = ["Speculator", "parse_methods"]

_BACKOFF_MISSES = 3  # verifications in a row that accepted nothing before a sequence backs off
_BACKOFF_EVERY = 8  # ... after which it tries again every this many output tokens


def parse_methods(text: str) -> tuple[str, ...]:
    """`LORAMUX_SPECULATIVE_METHODS` ("ngram,medusa,draft"; order breaks ties) as a tuple; ValueError names an
    unknown method."""
    methods = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown speculative method {unknown[0]!r}: choose from {', '.join(METHODS)}")
    return methods


class Speculator:
    def __init__(self, config, max_model_len: int, policy: SpecPolicy, draft=None):
        """`config`: the EngineConfig, read at every step (speculative_tokens, _methods, _max_batch)."""
        self.config = config
        self.max_model_len = max_model_len
        self.policy = policy
        self.draft = draft  # a DraftRunner, or None
        self._methods: tuple[str, str, tuple[str, ...]] | None = None

    @property
    def num_tokens(self) -> int:
        return self.config.speculative_tokens

    @property
    def max_batch(self) -> int:
        return self.config.speculative_max_batch

    @property
    def methods(self) -> tuple[str, ...]:
        text = self.config.speculative_methods
        if self._methods is None or self._methods[0] != text:
            self._methods = (text, text, parse_methods(text))
        return self._methods[2]

    @property
    def stats(self) -> AcceptanceStats:
        return self.policy.stats

    def propose(self, decoding: list[Sequence], prefilling: list[Sequence],
                constraint_of: Callable[[Sequence], Constraint | None],
                heads_of: Callable[[Sequence], MedusaHeads | None]) -> None:
        """Set `draft_token_ids` and `spec_method` of each decoding sequence ([] and None: a plain decode), and
        `medusa_wanted` of every running sequence (whether the step computes its Medusa proposals for the next
        step)."""
        candidates, plain, medusa_capable = [], 0, []
        for seq in decoding:
            seq.draft_token_ids, seq.spec_method = [], None
            room = self._room(seq) if len(decoding) <= self.max_batch else 0
            drafts: dict[str, list[int] | int] = {}
            if room > 0:
                for method in self.methods:
                    if method == "ngram":
                        drafts["ngram"] = propose_ngram(seq.token_ids, room)
                    elif method == "medusa" and seq.medusa_next:
                        drafts["medusa"] = seq.medusa_next[:room]
                    elif method == "draft" and self.draft is not None:
                        drafts["draft"] = room
                if (constraint := constraint_of(seq)) is not None:
                    drafts = {m: constraint.cut_draft(d) if isinstance(d, list) else d for m, d in drafts.items()}
            lengths = {m: (len(d) if isinstance(d, list) else d) for m, d in drafts.items()}
            if any(lengths.values()):
                candidates.append((seq, drafts, Candidate(seq, seq.adapter or "", seq.num_computed_tokens, lengths)))
            else:
                plain += 1
            if room > 0 and "medusa" in self.methods and heads_of(seq) is not None:
                medusa_capable.append((seq, room))
        chosen = self.policy.choose([c for _, _, c in candidates], plain) if candidates else {}
        for seq, drafts, _ in candidates:
            if seq in chosen:
                method, k = chosen[seq]
                seq.spec_method = method
                if method != "draft":
                    draft = drafts[method]
                    assert isinstance(draft, list)  # proposed tokens; only the draft model's entry is a length
                    seq.draft_token_ids = list(draft)[:k]
        self._run_draft_model({seq: k for seq, (method, k) in chosen.items() if method == "draft"}, constraint_of)
        self._want_medusa(decoding, prefilling, medusa_capable, heads_of)

    def _room(self, seq: Sequence) -> int:
        """How many drafts the sequence may verify this step: 0 when it must not speculate (not asked, seeded
        sampling, whose reproducibility must not depend on the batch, or backing off after misses)."""
        p = seq.params
        if not p.speculative or (p.seed is not None and p.temperature > 0):
            return 0
        if seq.spec_misses >= _BACKOFF_MISSES and len(seq.output_token_ids) % _BACKOFF_EVERY:
            return 0
        # Drafts count as output: no more than the tokens still to produce (a bonus token past max_tokens is
        # dropped by the length stop).
        return max(0, min(self.num_tokens, p.max_tokens - len(seq.output_token_ids),
                          self.max_model_len - seq.num_tokens - 1))

    def _run_draft_model(self, seqs: dict[Sequence, int], constraint_of) -> None:
        """Drafts of the rows that chose the draft model ({seq: length}), in one batched proposal."""
        if not seqs:
            return
        k = max(seqs.values())
        assert self.draft is not None  # rows choose the draft model only when there is one
        t0 = time.perf_counter()
        drafts = self.draft.propose([(seq.request_id, seq.token_ids, n) for seq, n in seqs.items()])
        self.policy.observe_draft_cost(k, time.perf_counter() - t0)
        for seq in seqs:
            draft = drafts.get(seq.request_id, [])
            if draft and (constraint := constraint_of(seq)) is not None:
                draft = constraint.cut_draft(draft)
            seq.draft_token_ids = draft
            if not draft:
                seq.spec_method = None

    def _want_medusa(self, decoding, prefilling, capable, heads_of) -> None:
        """Medusa proposals cost LM-head rows every step: compute them only for rows that would speculate with
        them next step, as the policy judges a step in which every capable row had a full Medusa draft."""
        for seq in decoding:
            seq.medusa_wanted = False
        if capable:
            rows = [Candidate(seq, seq.adapter or "", seq.num_computed_tokens, {"medusa": room})
                    for seq, room in capable]
            for seq in self.policy.choose(rows, len(decoding) - len(rows)):
                seq.medusa_wanted = True
        for seq in prefilling:  # the prompt's last row gives the first proposals
            seq.medusa_wanted = "medusa" in self.methods and heads_of(seq) is not None and seq.params.speculative

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Account one verification of the sequence's draft (by `seq.spec_method`; `spec_decode.verify_draft`
        counts the misses)."""
        method = seq.spec_method or "ngram"
        self.stats.record(seq.adapter or "", method, proposed, accepted)
        counts = seq.spec_counts.setdefault(method, [0, 0])
        counts[0] += proposed
        counts[1] += accepted
        seq.spec_method = None

    def release(self, seq: Sequence) -> None:
        """A request ended: its draft-model KV is freed."""
        if self.draft is not None:
            self.draft.release(seq.request_id)
