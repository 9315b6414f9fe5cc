"""Whether speculating pays, step by step (torch-free).

Each proposer (prompt lookup "ngram", "medusa" heads, a "draft" model) has, per (adapter, method), a measured
per-token acceptance p: the probability that a draft token is accepted given the ones before it were (a
maximum-likelihood estimate over recent verifications, pulled toward a prior). A row verifying k drafts
then yields 1 + p + p^2 + ... + p^k tokens on average.

Before a step, `SpecPolicy.choose` takes the decoding rows and, for each, its candidate drafts (method,
length) and picks per row the method with the most expected tokens; then it keeps the set of speculating
rows that maximises predicted tokens per second of the whole step, with the step cost model the scheduler
already fits (`StepCostModel`: verification rows are chunks that cost more than plain decode rows) plus the
measured cost of running a draft model. Rows are added best-first; none is kept unless the step's
predicted throughput beats plain decoding by `margin`. At high batch the verification work costs more than
the tokens it gains, and speculation turns itself off.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from loramux.engine.scheduling.step_budget import StepWork

__all__ = ["METHODS", "Candidate", "AcceptanceStats", "SpecPolicy", "expected_tokens"]

METHODS = ("ngram", "medusa", "draft")
_PRIOR_P = {"ngram": 0.5, "medusa": 0.5, "draft": 0.6}
_PRIOR_TRIALS = 8.0  # the prior counts as this many draft tokens
_DECAY = 0.98  # per verification: older evidence fades, so p follows a change of workload


def expected_tokens(p: float, k: int) -> float:
    """Expected accepted drafts of k when each is accepted with probability p after the ones before it."""
    return sum(p ** j for j in range(1, k + 1))


@dataclass
class _Estimate:
    accepted: float
    trials: float

    @property
    def p(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0


@dataclass
class AcceptanceStats:
    """Per (adapter key, method) acceptance estimates, and totals per method for reporting."""

    estimates: dict[tuple[str, str], _Estimate] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))
    verifications: dict[str, int] = field(default_factory=lambda: dict.fromkeys(METHODS, 0))

    def p(self, adapter: str, method: str) -> float:
        est = self.estimates.get((adapter, method))
        return est.p if est is not None else _PRIOR_P[method]

    def record(self, adapter: str, method: str, proposed: int, accepted: int) -> None:
        """One verification of `proposed` drafts of which the first `accepted` were taken."""
        est = self.estimates.get((adapter, method))
        if est is None:
            prior = _PRIOR_P[method]
            est = self.estimates[(adapter, method)] = _Estimate(prior * _PRIOR_TRIALS, _PRIOR_TRIALS)
        # Trials: each accepted token, plus the rejected one when the draft did not survive whole.
        est.accepted = est.accepted * _DECAY + accepted
        est.trials = est.trials * _DECAY + accepted + (accepted < proposed)
        self.proposed[method] += proposed
        self.accepted[method] += accepted
        self.verifications[method] += 1

    def snapshot(self) -> dict:
        """{method: {proposed, accepted, verifications}} since start."""
        return {m: {"proposed": self.proposed[m], "accepted": self.accepted[m], "verifications": self.verifications[m]}
                for m in METHODS}


K = TypeVar("K", bound=Hashable)  # what identifies a row (the engine's Sequence)


@dataclass
class Candidate(Generic[K]):
    """One decoding row's options: `drafts` maps a method to the number of tokens it can propose (known for
    prompt lookup and Medusa, whose drafts exist before the step; the configured length for a draft model,
    which runs only for the rows that choose it). `context` is the row's cached context length."""

    key: K
    adapter: str
    context: int
    drafts: dict[str, int]


class SpecPolicy:
    def __init__(self, predict: Callable[[StepWork], float] | None, stats: AcceptanceStats | None = None,
                 margin: float = 0.02):
        """`predict(work) -> seconds` is the step cost model (None: speculate whenever a draft exists, as
        before the cost model existed: tests that count tokens)."""
        self.predict = predict
        self.stats = stats or AcceptanceStats()
        self.margin = margin
        self.draft_seconds_per_token = 0.0  # measured cost of a draft model per drafted position (EMA)

    def _best_length(self, row: Candidate, method: str, k_max: int) -> tuple[float, str, int]:
        """(expected accepted tokens, method, draft length) of the length that maximises the row's own tokens per
        second (a long draft of a low-acceptance method costs verification rows it rarely gains from); the
        full length without a cost model."""
        p = self.stats.p(row.adapter, method)
        if self.predict is None:
            return expected_tokens(p, k_max), method, k_max
        extra = self.draft_seconds_per_token if method == "draft" else 0.0
        rates = [((1 + expected_tokens(p, k)) / max(self.predict(_one_row(row.context, k)) + k * extra, 1e-9), k)
                 for k in range(1, k_max + 1)]
        _, k = max(rates)
        return expected_tokens(p, k), method, k

    def observe_draft_cost(self, tokens: int, seconds: float) -> None:
        """Fold one draft-model call (`tokens` draft positions for its rows, wall seconds) into its cost."""
        if tokens > 0 and seconds >= 0:
            per = seconds / tokens
            old = self.draft_seconds_per_token
            self.draft_seconds_per_token = per if old == 0.0 else old + 0.2 * (per - old)

    def choose(self, rows: list[Candidate[K]], plain_rows: int = 0) -> dict[K, tuple[str, int]]:
        """{row key: (method, draft length)} for the rows that should speculate this step; the others decode
        plainly. `plain_rows`: decoding rows with no candidate at all (they still share the step)."""
        best = []
        for row in rows:
            options = [self._best_length(row, m, k) for m, k in row.drafts.items() if k > 0]
            if options:
                gain, method, k = max(options, key=lambda o: o[0])
                best.append((gain, method, k, row))
        if not best:
            return {}
        if self.predict is None:
            return {row.key: (method, k) for _, method, k, row in best}
        best.sort(key=lambda b: -b[0] / (b[2] + 1))  # most expected tokens per verified row first
        total_rows = len(rows) + plain_rows
        base = StepWork()
        for row in rows:
            base.add(1, row.context)
        for _ in range(plain_rows):
            base.add(1, 0)
        plain_rate = total_rows / max(self.predict(base), 1e-9)
        chosen: list[tuple[K, tuple[str, int]]] = []
        best_rate, best_n = plain_rate * (1 + self.margin), 0
        work = StepWork(base.seqs, base.chunks, base.tokens, base.attended)
        gained, draft_tokens = 0.0, 0
        for gain, method, k, row in best:
            work.chunks += 1
            work.tokens += k
            work.attended += _extra_attended(k, row.context)
            gained += gain
            if method == "draft":
                draft_tokens = max(draft_tokens, k)
            chosen.append((row.key, (method, k)))
            seconds = self.predict(work) + draft_tokens * self.draft_seconds_per_token
            rate = (total_rows + gained) / max(seconds, 1e-9)
            if rate > best_rate:
                best_rate, best_n = rate, len(chosen)
        return dict(chosen[:best_n])


def _one_row(context: int, k: int) -> StepWork:
    work = StepWork()
    work.add(1 + k, context)
    return work


def _extra_attended(k: int, context: int) -> float:
    """Attention work a row adds by verifying k drafts after its last token instead of decoding one token."""
    n = k + 1
    return (n * (context + (n + 1) / 2) - (context + 1)) / 1024
