"""Scheduler and block manager, without torch: a simulated engine drives them."""
from __future__ import annotations

import random

import pytest

from loramux.child_python import python_command
from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.block_manager import BlockManager, OutOfBlocksError
from loramux.engine.scheduling.scheduler import Scheduler
from loramux.engine.sequence import FinishReason, Sequence, SequenceStatus


def seq(rid: str, prompt_len: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 100) -> Sequence:
    return Sequence(rid, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), priority=priority,
                    arrival=arrival)


def advance(scheduler: Scheduler, batch) -> None:
    """What the engine does after the model ran: append a sampled token where one is due, then let the
    scheduler account for the step."""
    for s, n in batch.prefills:
        if s.num_computed_tokens + n == s.num_tokens:
            s.output_token_ids.append(7)
    for s in batch.decodes:
        s.output_token_ids.append(7)
    scheduler.complete(batch)


def test_scheduler_block_manager_sequence_and_residency_are_torch_free():
    import subprocess

    modules = ["loramux.engine.scheduling.scheduler", "loramux.engine.scheduling.block_manager",
               "loramux.engine.sequence", "loramux.adapters.residency.locations"]
    code = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run(python_command("-c", code), check=True)


def test_engine_step_reads_schedule_run_postprocess_in_a_few_lines():
    import inspect

    from loramux.engine.engine import LLMEngine

    lines = inspect.getsource(LLMEngine.step).splitlines()[1:]  # the body, docstring included
    assert len(lines) <= 12, "\n".join(lines)
    code = "\n".join(lines[1:])  # after the docstring
    assert code.index("scheduler.schedule(") < code.index("self._postprocess(") < code.index("runner.run(")


def test_long_prompt_is_chunked_and_decodes_keep_running():
    blocks = BlockManager(200, 16)
    s = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=64)
    short = seq("short", 10)
    s.add(short)
    advance(s, s.schedule())  # short is now decoding
    long = seq("long", 1000, arrival=1.0)
    s.add(long)
    steps = 0
    while long.output_token_ids == []:
        batch = s.schedule()
        assert short in batch.decodes, "a running decode was stalled by a long prefill"
        assert batch.num_tokens <= 64
        advance(s, batch)
        steps += 1
    assert steps == -(-1000 // 63)  # 63 prefill tokens per step beside the one decode


def test_priority_orders_admission():
    blocks = BlockManager(100, 16)
    s = Scheduler(blocks, max_num_seqs=1, max_num_batched_tokens=64)
    low, high = seq("low", 5, priority=0, arrival=0.0), seq("high", 5, priority=2, arrival=1.0)
    s.add(low)
    s.add(high)
    assert [x for x, _ in s.schedule().prefills] == [high]


def test_request_that_does_not_fit_waits_then_runs():
    blocks = BlockManager(4, 4)  # 16 token slots
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq("a", 10), seq("b", 10, arrival=1.0)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [x for x, _ in batch.prefills] == [a] and b.status is SequenceStatus.WAITING
    advance(s, batch)
    s.finish(a, FinishReason.STOP)
    assert [x for x, _ in s.schedule().prefills] == [b]


def test_pool_running_dry_preempts_lowest_priority_latest():
    blocks = BlockManager(6, 4)
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    vip = seq("vip", 7, priority=1, arrival=0.0)
    old, new = seq("old", 7, arrival=1.0), seq("new", 7, arrival=2.0)
    for x in (vip, old, new):
        s.add(x)
    advance(s, s.schedule())  # 2 blocks each: the pool is full
    batch = s.schedule()
    while not batch.preempted:  # decode until a third block is needed: someone must go
        assert len(vip.output_token_ids) < 4
        advance(s, batch)
        batch = s.schedule()
    assert batch.preempted[0] is new
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert vip in batch.decodes
    blocks.check_invariants(s.running)


def test_allocation_is_all_or_nothing():
    blocks = BlockManager(2, 4)
    x = seq("x", 20)
    with pytest.raises(OutOfBlocksError):
        blocks.allocate(x, 20)
    assert blocks.num_free_blocks == 2 and x.block_table == []


def test_no_block_leaks_after_1000_random_events():
    rng = random.Random(1234)
    blocks = BlockManager(48, 4)
    s = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=24)
    live: dict[str, Sequence] = {}
    counts = {"add": 0, "cancel": 0, "finish": 0, "step": 0, "preempted": 0}
    for i in range(1000):
        event = rng.choices(["add", "cancel", "finish", "step"], weights=[3, 1, 1, 5])[0]
        if event == "add" and len(live) < 20:
            x = seq(f"r{i}", rng.randint(1, 40), priority=rng.randint(0, 2), arrival=float(i))
            live[x.request_id] = x
            s.add(x)
        elif event in ("cancel", "finish") and live:
            x = live.pop(rng.choice(sorted(live)))
            s.finish(x, FinishReason.CANCELLED if event == "cancel" else FinishReason.STOP)
            assert x.block_table == []
        elif event == "step":
            batch = s.schedule()
            counts["preempted"] += len(batch.preempted)
            advance(s, batch)
            for x in [x for x in live.values() if len(x.output_token_ids) >= 12]:
                s.finish(x, FinishReason.LENGTH)
                del live[x.request_id]
        counts[event] += 1
        blocks.check_invariants(s.running)
        assert all(not x.block_table for x in s.waiting), "a waiting sequence holds blocks"
    assert counts["preempted"] > 0 and counts["cancel"] > 50, counts  # the run exercised every path
    for x in list(live.values()):
        s.finish(x, FinishReason.CANCELLED)
    assert blocks.num_free_blocks == blocks.num_blocks and not s.has_unfinished()


def test_admission_allocates_the_whole_prompt_at_once():
    blocks = BlockManager(20, 4)
    s = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=8)
    long = seq("long", 40)
    s.add(long)
    batch = s.schedule()
    assert batch.prefills == [(long, 8)] and len(long.block_table) == 10  # 40 tokens, not just the chunk
    advance(s, batch)
    other = seq("other", 30, arrival=1.0)  # needs 8 of the 10 free blocks: must wait, not steal long's
    s.add(other)
    while long.output_token_ids == []:
        batch = s.schedule()
        assert not batch.preempted
        advance(s, batch)


def test_waiting_ages_into_priority_so_low_tiers_never_starve():
    blocks = BlockManager(64, 16)
    sched = Scheduler(blocks, max_num_seqs=1, max_num_batched_tokens=64, aging_s=10.0)
    old_free = seq("old-free", 8, priority=0, arrival=0.0)
    new_premium = seq("new-premium", 8, priority=2, arrival=15.0)  # 1.5 levels younger: still ahead
    newest_premium = seq("newest-premium", 8, priority=2, arrival=25.0)  # 2.5 levels younger: behind
    for s in (newest_premium, new_premium, old_free):
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["new-premium", "old-free", "newest-premium"]
    batch = sched.schedule(now=30.0)
    assert [s.request_id for s, _ in batch.prefills] == ["new-premium"]


def test_equal_effective_priority_prefers_the_cheaper_request():
    sched = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=64)
    big = seq("big", 40, arrival=1.0, max_tokens=200)
    small = seq("small", 4, arrival=1.0, max_tokens=10)
    sched.add(big)
    sched.add(small)
    assert [s.request_id for s in sched.waiting] == ["small", "big"]
