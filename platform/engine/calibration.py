"""Seed the step-cost model before serving: a few steps of synthetic work on the real model, measured.

Without this the first steps of a server are planned with a rough prior (loramux.engine.scheduling.step_budget); with
it the fitted model already knows this machine, model and dtype. The work mixes what serving sees: a
batch of short prompts that then decode, and a long prompt whose chunks share steps with those decodes.
The first round pays one-time costs (allocations, kernel selection) and is forgotten; the engine's own
counters are left as they were, so /metrics starts at zero.
"""
from __future__ import annotations

import dataclasses
import random
import time

from loramux.engine.sampling.params import SamplingParams


def calibrate_step_cost(engine, rounds: int = 2, seed: int = 0) -> float:
    """Run `rounds` rounds of synthetic requests through `engine` (idle: nothing else queued) and refit
    its step-cost model on all but the first; returns the seconds it took. No-op without a step budget."""
    budget = engine.step_budget
    if budget is None or engine.has_unfinished():
        return 0.0
    t0 = time.monotonic()
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    long_len = max(1, min(256, engine.max_model_len - 8))
    params = SamplingParams(max_tokens=6, ignore_eos=True, speculative=False)
    counters = dataclasses.replace(engine.counters)
    experts = counters.expert_tokens  # shared with the copy: set back in place, where the model's MoE blocks count
    held = experts.snapshot() if experts is not None else None
    for r in range(rounds):
        lengths = [min(24, long_len)] * 8 + [long_len]
        for i, n in enumerate(lengths):
            ids = [rng.randrange(vocab) for _ in range(n)]
            engine.add_request(f"calibration-{seed}-{r}-{i}", ids, params, cache_salt=f"calibration-{r}")
        while engine.has_unfinished():
            engine.step()
        if r == 0 and rounds > 1:
            budget.model.forget()
    budget.model.fit()
    budget.reset_stats()
    engine.counters = counters
    if experts is not None and held is not None:
        experts.restore(held)
    return time.monotonic() - t0
