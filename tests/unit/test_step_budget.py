"""Stall-free steps: the step-time budget, its cost model, and what the scheduler plans with them."""
from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_scheduler import advance  # the simulated engine's bookkeeping after a step

from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.block_manager import BlockManager
from loramux.engine.scheduling.scheduler import Scheduler
from loramux.engine.scheduling.step_budget import StepBudget, StepCostModel, StepWork, attended_work
from loramux.engine.sequence import Sequence

# A machine where a step costs 20 ms + 0.5 ms per sequence + 3 ms per prefill chunk + 2 ms per token + 1 ms per
# 1024 attended.
TRUE = (0.02, 0.0005, 0.003, 0.002, 0.001)


def frozen_model(coefficients=TRUE) -> StepCostModel:
    """A cost model that never refits (the scheduler tests run no model: their step times mean nothing)."""
    return StepCostModel(prior=coefficients, refit_every=10**9)


def seq(rid: str, prompt_len: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 1000) -> Sequence:
    return Sequence(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), priority=priority,
                    arrival=arrival)


def decoding(scheduler: Scheduler, n: int, prompt_len: int = 20) -> list[Sequence]:
    """`n` sequences admitted and prefilled, so the next step decodes them all."""
    seqs = [seq(f"d{i}", prompt_len) for i in range(n)]
    for s in seqs:
        scheduler.add(s)
    while any(s.is_prefill for s in seqs):
        advance(scheduler, scheduler.schedule(now=0.0))
    return seqs


def test_cost_model_recovers_the_machine_from_measured_steps():
    rng = random.Random(0)
    model = StepCostModel()  # starts from the CPU prior, which is not this machine
    for _ in range(300):
        work = StepWork()
        for _ in range(rng.randint(1, 12)):
            work.add(rng.choice([1, 1, 1, rng.randint(2, 300)]), rng.randint(0, 2000))
        truth = sum(c * x for c, x in zip(TRUE, work.features()))
        model.observe(work, truth * rng.uniform(0.97, 1.03))  # a little timing noise
    fixed, _, per_chunk, per_token, per_kv = model.coefficients  # per-sequence cost is small next to the noise
    assert (fixed, per_chunk, per_token, per_kv) == pytest.approx((TRUE[0], *TRUE[2:]), rel=0.15)
    for decodes, chunk in ((1, 0), (16, 0), (8, 64), (2, 400)):
        work = StepWork()
        for _ in range(decodes):
            work.add(1, 300)
        if chunk:
            work.add(chunk, 0)
        assert model.predict(work) == pytest.approx(sum(c * x for c, x in zip(TRUE, work.features())), rel=0.05)


def test_cost_model_ignores_nonsense_and_never_goes_negative():
    model = StepCostModel(refit_every=1)
    work = StepWork()
    work.add(1, 10)
    for bad in (float("nan"), float("inf"), -1.0):
        model.observe(work, bad)
    model.observe(StepWork(), 1.0)  # an empty step is no sample
    assert model.coefficients == model.prior
    for _ in range(50):
        model.observe(work, 0.0)  # a step that cost nothing pulls toward zero, never below it
    assert all(c >= 0 for c in model.coefficients)


def test_tokens_within_inverts_the_marginal_cost():
    budget = StepBudget(0.1, frozen_model())
    *_, per_token, per_kv = TRUE
    for context in (0, 500, 4000):
        n = budget.tokens_within(0.05, context)
        costs = [per_token * k + per_kv * attended_work(k, context) for k in (n, n + 1)]
        assert costs[0] <= 0.05 < costs[1]
    assert budget.tokens_within(0.0, 0) == 0 and budget.tokens_within(-1.0, 0) == 0


def test_a_long_prefill_among_running_decodes_never_stretches_a_step_past_the_budget():
    """Eight streams decode; a 3000-token prompt arrives. Every step until its prefill is done still carries
    all eight decodes, and its predicted time (the plan's own account) stays within the auto target: twice
    the decodes' cost. The old plan (a fixed 512-token budget) would have made those streams wait 6x longer.
    The plan is asserted, not wall time: the cost model is fixed, so the test is exact on any machine."""
    budget = StepBudget(0.0, frozen_model())
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=16, max_num_batched_tokens=512, step_budget=budget)
    streams = decoding(s, 8)
    long = seq("long", 3000)
    s.add(long)
    steps = 0
    while long.is_prefill:
        batch = s.schedule(now=1.0)
        plan = batch.plan
        assert set(batch.decodes) == set(streams)  # no stream skips a step
        assert plan.decodes == 8 and plan.prefill_tokens > 0  # the prompt moves every step
        # Within the target (twice the decodes' cost), or the guaranteed minimum chunk (or the prompt's last
        # tokens, fewer) once the prompt's own context makes its tokens dear: progress beats the target then.
        assert plan.predicted_s <= 2 * plan.decode_s + 1e-12 or plan.prefill_tokens <= budget.min_chunk
        advance(s, batch)
        steps += 1
    assert long.output_token_ids == [7]  # the prefill finished and sampled its first token
    per_step = 3000 / steps
    assert per_step >= 16  # not starved: chunks of dozens of tokens

    old = Scheduler(BlockManager(1000, 16), max_num_seqs=16, max_num_batched_tokens=512,
                    step_budget=StepBudget(10.0, frozen_model()))  # a target that never binds = the old plan
    decoding(old, 8)
    old.add(seq("long", 3000))
    batch = old.schedule(now=1.0)
    assert batch.plan.predicted_s > 6 * batch.plan.decode_s


def test_an_explicit_target_bounds_every_step_and_a_tiny_one_still_makes_progress():
    budget = StepBudget(0.08, frozen_model())
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=16, max_num_batched_tokens=512, step_budget=budget)
    decoding(s, 4)
    s.add(seq("long", 1000))
    while s.num_waiting or any(x.is_prefill for x in s.running):
        batch = s.schedule(now=1.0)
        assert batch.plan.predicted_s <= 0.08 + 1e-12 or batch.plan.prefill_tokens <= budget.min_chunk
        advance(s, batch)

    tiny = StepBudget(0.001, frozen_model())  # less than the decodes alone
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=16, max_num_batched_tokens=512, step_budget=tiny)
    decoding(s, 4)
    long = seq("long", 100)
    s.add(long)
    chunks = []
    while long.is_prefill:
        batch = s.schedule(now=1.0)
        chunks += [n for x, n in batch.prefills if x is long]
        advance(s, batch)
    assert chunks == [16] * 6 + [4]  # the guaranteed minimum chunk each step, until the prompt is done


def test_without_decodes_a_prefill_takes_the_whole_token_cap():
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=16, max_num_batched_tokens=512,
                  step_budget=StepBudget(0.0, frozen_model()))
    s.add(seq("long", 3000))
    batch = s.schedule(now=0.0)
    assert batch.prefills[0][1] == 512  # nothing decodes: nothing to stall, first token as soon as possible


def test_priority_still_orders_the_chunks():
    s = Scheduler(BlockManager(1000, 16), max_num_seqs=16, max_num_batched_tokens=512,
                  step_budget=StepBudget(0.0, frozen_model()))
    decoding(s, 8)
    low, high = seq("free", 2000, priority=0, arrival=1.0), seq("premium", 2000, priority=2, arrival=1.0)
    s.add(low)
    s.add(high)
    while high.is_prefill:
        batch = s.schedule(now=1.0)
        assert batch.prefills[0][0] is high  # the premium prompt takes what the step allows first
        advance(s, batch)
    assert low.is_prefill  # still going: it got what was left


def test_engine_steps_are_measured_and_exported(tiny_dir, tokenizer):
    from conftest import make_engine
    from loramux.server.serving.metrics import ServerMetrics

    tiny_engine = make_engine(tiny_dir, tokenizer, prefix_caching=False)  # every prompt token computed
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(6):
        tiny_engine.add_request(f"r{i}", list(range(5, 5 + 30 * (i + 1))), params)
    steps = 0
    while tiny_engine.has_unfinished():
        tiny_engine.step()
        steps += 1
    stats = tiny_engine.stats()["steps"]
    assert stats["step_seconds"]["count"] == stats["step_tokens"]["count"] == steps
    assert stats["step_tokens"]["sum"] == sum(30 * (i + 1) for i in range(6)) + 6 * 11  # every prompt + decode token
    assert stats["decodes_delayed_by_prefill_total"] >= 1  # later prompts chunked in next to earlier decodes
    m = ServerMetrics()
    m.set_state_source(tiny_engine.stats)
    families = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    assert families["loramux_step_seconds"].type == "histogram"
    count = [x.value for x in families["loramux_step_tokens"].samples if x.name.endswith("_count")]
    assert count == [steps]
    assert "loramux_decodes_delayed_by_prefill" in families
    assert "loramux_decode_tokens_delayed_by_prefill" in families


def test_calibration_fits_the_model_and_leaves_the_engine_as_it_was(tiny_engine):
    from loramux.engine.calibration import calibrate_step_cost

    before = tiny_engine.step_budget.model.coefficients
    took = calibrate_step_cost(tiny_engine)
    assert took > 0 and tiny_engine.step_budget.model.coefficients != before
    stats = tiny_engine.stats()
    assert stats["steps"]["step_seconds"]["count"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and not tiny_engine.requests
    out = tiny_engine.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3
