"""How much work the next step may carry: a step-time target and a cost model fitted online (torch-free).

Every running stream waits for the whole step. A step that carries a 500-token prefill chunk next to the
decodes makes each stream's next token as late as that chunk, so a fixed token budget either stalls the
streams (large budget) or starves prefills (small one). The scheduler therefore fills a step up to a time
target instead, as Sarathi-Serve's stall-free batching does: decodes first, then prefill chunks while the
predicted step time stays within the target.

- **The target** (`target_s`, LORAMUX_STEP_TARGET_MS): how long a step that carries prefill work may take
  while streams decode. 0 = auto: twice what the step's decodes alone are predicted to cost, so a
  stream's gap between two tokens is at most about twice a plain decode step's, whatever the batch size,
  model or machine. A step with no decodes has nothing to stall: only the token cap applies.
- **Progress**: the first prefill of a step always gets at least `min_chunk` tokens, so a long prompt
  finishes even when the decodes alone use up the target.
- **The cost model** (`StepCostModel`): seconds = fixed + per_seq * sequences + per_chunk * chunks +
  per_token * tokens + per_kv * attended, where chunks are the sequences computing several tokens (prefill
  chunks and speculative verifications: each runs its own attention call per layer) and attended counts
  each new token times the context it attends to (in thousands of tokens). It is fitted by least squares
  over the last `window` steps, pulled toward a prior so a run of similar steps cannot swing it;
  loramux.engine.calibration seeds it at start (a few steps of synthetic work), and every real step refines
  it.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from loramux.histogram import DurationHistogram

STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Priors (fixed, per_seq, per_chunk, per_token, per_kv seconds) until steps have been measured: rough figures
# for a ~100M-parameter model on a few CPU cores and on a GPU. They only shape the first steps.
CPU_PRIOR = (0.02, 0.0005, 0.003, 0.002, 0.0005)
GPU_PRIOR = (0.005, 0.00002, 0.0002, 0.00002, 0.00001)


@dataclass
class StepWork:
    """What one step computes: sequences, chunks (sequences computing several tokens), new tokens, and
    attended = sum of new tokens x context / 1024."""

    seqs: int = 0
    chunks: int = 0
    tokens: int = 0
    attended: float = 0.0

    def add(self, num_tokens: int, context: int) -> None:
        """A sequence computing `num_tokens` new tokens after `context` already in its KV cache."""
        self.seqs += 1
        self.chunks += num_tokens > 1
        self.tokens += num_tokens
        self.attended += attended_work(num_tokens, context)

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.seqs), float(self.chunks), float(self.tokens), self.attended)


def attended_work(num_tokens: int, context: int) -> float:
    """Attention work of `num_tokens` new tokens after `context` cached ones: each attends to all before it."""
    return num_tokens * (context + (num_tokens + 1) / 2) / 1024


class StepCostModel:
    """Predicts a step's wall time from its `StepWork` (see the module docstring)."""

    def __init__(self, prior: tuple[float, ...] = CPU_PRIOR, window: int = 256,
                 refit_every: int = 8, prior_weight: float = 4.0):
        self.prior = tuple(float(c) for c in prior)
        self.coefficients = self.prior
        self.prior_weight = prior_weight  # the prior counts as this many steps of each feature's typical size
        self.refit_every = refit_every
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._since_fit = 0

    def predict(self, work: StepWork) -> float:
        return sum(c * x for c, x in zip(self.coefficients, work.features()))

    def observe(self, work: StepWork, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0 or work.seqs == 0:
            return
        self._samples.append((work.features(), seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self.fit()

    def forget(self) -> None:
        """Drop the measured steps (e.g. warm-up steps that paid one-time costs); keep the current fit."""
        self._samples.clear()
        self._since_fit = 0

    def fit(self) -> None:
        """Least squares of the relative error over the window (timing noise grows with the step, and the
        small decode-only steps matter as much as the big ones), with the prior as pseudo-steps: for each
        feature, `prior_weight` steps of its root-mean-square size costing what the prior says. Negative
        coefficients are clipped."""
        self._since_fit = 0
        if not self._samples:
            return
        n = len(self.prior)
        rows = [(tuple(v / max(y, 1e-6) for v in x), y / max(y, 1e-6)) for x, y in self._samples]
        for j in range(n):
            scale = math.sqrt(sum(x[j] ** 2 for x, _ in rows) / len(rows)) or 1.0
            weight = math.sqrt(self.prior_weight) * scale
            unit = tuple(weight if i == j else 0.0 for i in range(n))
            rows.append((unit, weight * self.prior[j]))
        ata = [[sum(x[i] * x[k] for x, _ in rows) for k in range(n)] for i in range(n)]
        aty = [sum(x[i] * y for x, y in rows) for i in range(n)]
        solved = _solve(ata, aty)
        if solved is not None:
            self.coefficients = tuple(max(0.0, c) for c in solved)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class StepPlan:
    """The scheduler's running account of one step: what it holds so far and how many prefill tokens fit."""

    budget: StepBudget
    work: StepWork = field(default_factory=StepWork)
    decodes: int = 0
    decode_s: float = 0.0  # predicted cost of the decodes alone
    prefill_tokens: int = 0

    def add_decode(self, num_tokens: int, context: int) -> None:
        self.work.add(num_tokens, context)
        self.decodes += 1
        self.decode_s = self.budget.model.predict(self.work)

    def prefill_allowance(self, context: int, remaining: int) -> int:
        """How many of `remaining` prompt tokens (after `context` computed) this step may take."""
        if remaining <= 0:
            return 0
        if not self.decodes:  # nothing to stall: only the token cap applies
            return remaining
        _, per_seq, per_chunk, _, _ = self.budget.model.coefficients  # the chunk's sequence joins the step
        left = self.budget.target_for(self.decode_s) - self.budget.model.predict(self.work) - per_seq - per_chunk
        n = self.budget.tokens_within(left, context)
        if self.prefill_tokens == 0:
            n = max(n, self.budget.min_chunk)  # progress: a long prompt always moves
        return max(0, min(n, remaining))

    def add_prefill(self, num_tokens: int, context: int) -> None:
        self.work.add(num_tokens, context)
        self.prefill_tokens += num_tokens

    @property
    def predicted_s(self) -> float:
        return self.budget.model.predict(self.work)


class StepBudget:
    """The step-time target, the cost model, and what the steps that ran looked like (for /metrics)."""

    def __init__(self, target_s: float = 0.0, model: StepCostModel | None = None, min_chunk: int = 16):
        if target_s < 0 or min_chunk < 1:
            raise ValueError("target_s must be >= 0 (0 = auto) and min_chunk >= 1")
        self.target_s = target_s
        self.model = model or StepCostModel()
        self.min_chunk = min_chunk
        self.step_seconds = DurationHistogram(STEP_SECONDS_BUCKETS)
        self.step_tokens = DurationHistogram(STEP_TOKEN_BUCKETS)
        self.step_prefill_tokens = DurationHistogram(STEP_TOKEN_BUCKETS)
        self.decodes_delayed_last_step = 0  # decode streams that shared the last step with prefill work
        self.decodes_delayed_total = 0

    def reset_stats(self) -> None:
        """Forget what the steps so far looked like (the fitted model stays)."""
        for hist in (self.step_seconds, self.step_tokens, self.step_prefill_tokens):
            hist.reset()
        self.decodes_delayed_last_step = self.decodes_delayed_total = 0

    def plan(self) -> StepPlan:
        return StepPlan(self)

    def target_for(self, decode_s: float) -> float:
        """The time a step whose decodes alone cost `decode_s` may take."""
        return self.target_s if self.target_s > 0 else 2.0 * decode_s

    def tokens_within(self, seconds: float, context: int) -> int:
        """Most prompt tokens, after `context` cached ones, whose predicted marginal cost fits `seconds`:
        per_token * n + per_kv * n * (context + (n + 1) / 2) / 1024 <= seconds."""
        if seconds <= 0:
            return 0
        *_, per_token, per_kv = self.model.coefficients
        a = per_kv / 2048  # n^2 term
        b = per_token + per_kv * (context + 0.5) / 1024
        if a <= 0:
            return int(seconds / b) if b > 0 else 1 << 30
        return int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a))

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A planned step ran in `seconds` (schedule -> tokens appended)."""
        self.model.observe(plan.work, seconds)
        self.step_seconds.observe(seconds)
        self.step_tokens.observe(plan.work.tokens)
        self.step_prefill_tokens.observe(plan.prefill_tokens)
        delayed = plan.decodes if plan.prefill_tokens else 0
        self.decodes_delayed_last_step = delayed
        self.decodes_delayed_total += delayed

    def stats(self) -> dict:
        """Histogram snapshots (step_seconds, step_tokens, step_prefill_tokens), the delayed-decode gauge
        and counter, the target (0 = auto) and the fitted coefficients. Safe to call from any thread."""
        return {"step_seconds": self.step_seconds.snapshot(), "step_tokens": self.step_tokens.snapshot(),
                "step_prefill_tokens": self.step_prefill_tokens.snapshot(),
                "decodes_delayed_by_prefill": self.decodes_delayed_last_step,
                "decodes_delayed_by_prefill_total": self.decodes_delayed_total,
                "target_s": self.target_s, "cost_coefficients": list(self.model.coefficients)}


def step_budget_for(target_ms: float | None, device_type: str, min_chunk: int = 16) -> StepBudget | None:
    """An engine's budget: `target_ms` (0 = auto) with the prior of its device type; None for None (the
    token cap alone)."""
    if target_ms is None:
        return None
    return StepBudget(target_ms / 1000, StepCostModel(GPU_PRIOR if device_type == "cuda" else CPU_PRIOR), min_chunk)
