"""Fair share within a tier (virtual token counters, loramux.engine.scheduling.fair_share), on a simulated engine:
the scheduler and block manager driven step by step, without torch."""
from __future__ import annotations

import random

from test_scheduler import advance

from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.block_manager import BlockManager
from loramux.engine.scheduling.fair_share import FairShare
from loramux.engine.scheduling.scheduler import Scheduler
from loramux.engine.sequence import FinishReason, Sequence

MAX_NUM_SEQS = 4
LONGEST_PROMPT = 48
MOST_NEW_TOKENS = 16


def request(tenant: str, i: int, rng: random.Random, priority: int = 0, arrival: float = 0.0) -> Sequence:
    prompt = [rng.randrange(1000) for _ in range(rng.randint(8, LONGEST_PROMPT))]
    return Sequence(f"{tenant}-{i}", prompt, SamplingParams(max_tokens=rng.randint(4, MOST_NEW_TOKENS)),
                    priority=priority, tenant=tenant, arrival=arrival)


def scheduler() -> Scheduler:
    return Scheduler(BlockManager(4096, 16), max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=64)


def step(s: Scheduler, now: float = 0.0) -> None:
    """One engine step: schedule, 'run' (a token for every sequence due one), account, finish at max_tokens."""
    advance(s, s.schedule(now=now))
    for seq in list(s.running):
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            s.finish(seq, FinishReason.LENGTH)


def served(seqs: list[Sequence], fair: FairShare) -> float:
    """Weighted tokens the sequences were given, counted from the sequences themselves: their prompt once
    computed (first admission; none of these prompts share blocks) and every output token."""
    return sum(fair.input_weight * len(q.prompt_token_ids) * (q.num_computed_tokens > 0 or q.is_finished)
               + fair.output_weight * len(q.output_token_ids) for q in seqs)


def run_backlogged(s: Scheduler, heavy: list[Sequence], light: list[Sequence]) -> list[float]:
    """Step until the light tenant's last request is admitted (both stay backlogged until then); the
    difference in service between the two at every step."""
    gaps = []
    while any(q.num_computed_tokens == 0 and not q.is_finished for q in light):
        step(s)
        gaps.append(served(heavy, s.fair) - served(light, s.fair))
    return gaps


def interleaved(heavy_tenant: str, light_tenant: str, rounds: int) -> tuple[list[Sequence], list[Sequence]]:
    """The heavy tenant sends 10 requests for each of the light one's, all queued at once."""
    rng = random.Random(7)
    heavy, light = [], []
    for r in range(rounds):
        heavy += [request(heavy_tenant, 10 * r + k, rng) for k in range(10)]
        light.append(request(light_tenant, r, rng))
    return heavy, light


def test_two_backlogged_tenants_stay_within_the_bound_at_every_step():
    s = scheduler()
    heavy, light = interleaved("heavy", "light", rounds=20)
    for q in [q for pair in zip(heavy[::10], light) for q in pair] + [q for q in heavy if q not in heavy[::10]]:
        s.add(q)
    bound = s.fair.bound(LONGEST_PROMPT, MOST_NEW_TOKENS, MAX_NUM_SEQS)
    gaps = run_backlogged(s, heavy, light)
    assert len(gaps) > 100  # a long run, every step of it checked
    assert max(abs(g) for g in gaps) <= bound
    # Served equally, not 10:1: the light tenant got its 20 requests while the heavy one got about as many.
    assert sum(q.num_computed_tokens > 0 or q.is_finished for q in heavy) <= 2 * len(light)


def test_without_separate_tenants_the_flood_takes_the_service():
    """The same arrivals as one tenant (fair share cannot tell them apart): arrival order serves the heavy
    sender ten times as much, and the gap leaves the bound, which shows the test above can fail."""
    s = scheduler()
    heavy, light = interleaved("", "", rounds=20)
    for r in range(20):
        for q in heavy[10 * r:10 * r + 10] + [light[r]]:
            s.add(q)
    bound = s.fair.bound(LONGEST_PROMPT, MOST_NEW_TOKENS, MAX_NUM_SEQS)
    assert max(run_backlogged(s, heavy, light)) > 3 * bound


def test_a_tenant_returning_from_idle_gets_no_burst_of_credit():
    s = scheduler()
    rng = random.Random(11)
    heavy = [request("heavy", i, rng) for i in range(400)]
    for q in heavy:
        s.add(q)
    for _ in range(300):  # the heavy tenant alone: its counter grows
        step(s)
    before = served(heavy, s.fair)
    light = [request("light", i, rng) for i in range(30)]
    for q in light:
        s.add(q)
    assert s.fair.counter("light") >= s.fair.counter("heavy") - 1e-9  # lifted to the backlogged one's
    bound = s.fair.bound(LONGEST_PROMPT, MOST_NEW_TOKENS, MAX_NUM_SEQS)
    steps = 0
    while any(q.num_computed_tokens == 0 and not q.is_finished for q in light):
        step(s)
        steps += 1
        # From its return on, the light tenant gets its share, not everything until it caught up.
        assert served(light, s.fair) - (served(heavy, s.fair) - before) <= bound
    assert steps > 50 and served(heavy, s.fair) - before >= 0.25 * served(light, s.fair)


def test_tier_priority_still_decides_across_levels():
    """A premium tenant served far more than a standard one still goes first: fair share orders tenants
    within a level only."""
    s = scheduler()
    rng = random.Random(3)
    s.fair.charge_output("premium-tenant", 10_000)
    standard = [request("standard-tenant", i, rng, priority=1) for i in range(4)]
    premium = [request("premium-tenant", i, rng, priority=2) for i in range(4)]
    for q in standard + premium:
        s.add(q)
    batch = s.schedule(now=0.0)
    assert {q.tenant for q, _ in batch.prefills} == {"premium-tenant"}


def test_waiting_ages_across_levels_into_the_longest_waiting_request():
    s = Scheduler(BlockManager(4096, 16), max_num_seqs=1, max_num_batched_tokens=64, aging_s=1.0)
    rng = random.Random(5)
    old_low = request("low", 0, rng, priority=0, arrival=0.0)
    new_high = request("high", 0, rng, priority=1, arrival=5.0)  # waited 1 level less than `old_low` aged
    s.add(new_high)
    s.add(old_low)
    batch = s.schedule(now=5.0)
    assert [q for q, _ in batch.prefills] == [old_low]


def test_preemption_takes_the_tenant_served_most_in_the_lowest_level():
    s = Scheduler(BlockManager(8, 16), max_num_seqs=8, max_num_batched_tokens=256)
    quiet = Sequence("quiet", list(range(40)), SamplingParams(max_tokens=100), tenant="quiet")
    greedy = Sequence("greedy", list(range(40)), SamplingParams(max_tokens=100), tenant="greedy")
    s.fair.charge_output("greedy", 500)
    s.add(quiet)
    s.add(greedy)
    step(s)
    assert {q.request_id for q in s.running} == {"quiet", "greedy"}  # 6 of 8 blocks
    for _ in range(60):  # decodes grow until the pool runs dry
        step(s)
        if quiet.num_preemptions or greedy.num_preemptions:
            break
    assert (quiet.num_preemptions, greedy.num_preemptions) == (0, 1)


def test_counters_charge_prompts_once_and_outputs_by_weight():
    fair = FairShare(input_weight=1.0, output_weight=2.0)
    s = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=64, fair_share=fair)
    q = Sequence("a", list(range(20)), SamplingParams(max_tokens=5), tenant="t", share_weight=2.0)
    s.add(q)
    while not q.is_finished:
        step(s)
    assert fair.stats()["t"] == {"counter": (20 + 2 * 5) / 2, "service": (20 + 2 * 5) / 2, "input_tokens": 20,
                                 "output_tokens": 5}
    assert s.num_waiting == 0 and s.blocks.num_free_blocks == 64


def full_batch(max_num_seqs: int, waiting: int) -> Scheduler:
    """Tenant "a" holds every slot of a batch of `max_num_seqs` (all decoding, none near its end) and has
    `waiting` more requests queued."""
    s = Scheduler(BlockManager(4096, 16), max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
    for i in range(max_num_seqs + waiting):
        s.add(Sequence(f"a-{i}", list(range(40)), SamplingParams(max_tokens=1000), tenant="a", arrival=i * 1e-3))
    step(s)
    step(s)
    assert len(s.running) == max_num_seqs and s.num_waiting == waiting
    assert not any(q.is_prefill for q in s.running)
    return s


def test_a_full_batch_admits_another_tenants_request_at_the_next_step():
    """64 running + 64 waiting of tenant a: b's request does not wait for one of a's to end (with requests
    of one length that come and go together, that is a whole request's time): it takes the slot of a's
    latest request at the next step, and a's request goes back to a's queue."""
    s = full_batch(64, 64)
    latest = max(s.running, key=lambda q: q.arrival)
    light = Sequence("b-0", list(range(40)), SamplingParams(max_tokens=8), tenant="b", arrival=1.0)
    s.add(light)
    batch = s.schedule(now=1.0)
    assert [q for q, _ in batch.prefills] == [light]
    assert batch.preempted == [latest] and latest.num_preemptions == 1 and latest in s.waiting
    assert len(s.running) == 64 and batch.decodes == []  # a's 63 sit this step out (see below)


def test_a_below_share_admission_runs_without_the_above_share_decodes_for_one_step():
    """63 of a running (above its share of 32 once b has work) and b's request: the step that starts b's
    prompt carries none of a's decodes, so b's first token waits for a step of its prompt only; the next
    step carries a's 63 decodes and b's first decode. Nothing of a's is preempted or freed for it."""
    s = full_batch(64, 0)
    s.finish(max(s.running, key=lambda q: q.arrival), FinishReason.LENGTH)  # a free slot: no _share_slot
    a = list(s.running)
    computed = {q: q.num_computed_tokens for q in a}
    light = Sequence("b-0", list(range(40)), SamplingParams(max_tokens=8), tenant="b", arrival=1.0)
    s.add(light)
    batch = s.schedule(now=1.0)
    assert batch.prefills == [(light, 40)] and batch.decodes == [] and not batch.preempted
    advance(s, batch)
    assert all(q.num_computed_tokens == computed[q] and q.block_table for q in a)
    batch = s.schedule(now=1.0)
    assert not batch.prefills and set(batch.decodes) == {*a, light}


def test_the_newcomers_step_carries_no_prompt_work_of_the_held_tenants_either():
    """With no decodes, a step is bounded by the token cap only: a's prompts (a chunk in progress, a's
    own waiting requests) would fill b's step. They wait a step too, then run."""
    s = Scheduler(BlockManager(4096, 16), max_num_seqs=64, max_num_batched_tokens=4096)
    for i in range(62):
        s.add(Sequence(f"a-{i}", list(range(40)), SamplingParams(max_tokens=1000), tenant="a", arrival=i * 1e-3))
    step(s)
    step(s)
    assert len(s.running) == 62 and not any(q.is_prefill for q in s.running)
    s.max_num_batched_tokens = 512  # a's long prompt then takes several steps
    long = Sequence("a-long", list(range(2000)), SamplingParams(max_tokens=8), tenant="a", arrival=0.5)
    s.add(long)
    first = s.schedule(now=0.5)  # a's 62 decodes and the first chunk of its long prompt
    advance(s, first)
    assert long.is_prefill and long.num_computed_tokens > 0
    light = Sequence("b-0", list(range(40)), SamplingParams(max_tokens=8), tenant="b", arrival=1.0)
    more = Sequence("a-more", list(range(40)), SamplingParams(max_tokens=8), tenant="a", arrival=1.1)
    s.add(light)
    s.add(more)
    batch = s.schedule(now=1.0)
    assert batch.prefills == [(light, 40)] and batch.decodes == [] and more in s.waiting
    advance(s, batch)
    batch = s.schedule(now=1.0)
    assert long in {q for q, _ in batch.prefills} and len(batch.decodes) == 63  # a's 62 and b's first


def test_a_tenant_within_its_share_keeps_decoding_in_the_newcomers_step():
    """a holds 32 of 64 slots, its share once b has work: its decodes stay in b's prefill step."""
    s = Scheduler(BlockManager(4096, 16), max_num_seqs=64, max_num_batched_tokens=4096)
    for i in range(32):
        s.add(Sequence(f"a-{i}", list(range(40)), SamplingParams(max_tokens=1000), tenant="a", arrival=i * 1e-3))
    step(s)
    light = Sequence("b-0", list(range(40)), SamplingParams(max_tokens=8), tenant="b", arrival=1.0)
    s.add(light)
    batch = s.schedule(now=1.0)
    assert batch.prefills == [(light, 40)] and len(batch.decodes) == 32


def test_a_tenant_alone_in_its_level_is_never_held_back():
    """One tenant (63 running, one more arriving), or a newcomer of another level: every decode runs."""
    s = full_batch(64, 0)
    s.finish(max(s.running, key=lambda q: q.arrival), FinishReason.LENGTH)
    s.add(Sequence("a-new", list(range(40)), SamplingParams(max_tokens=8), tenant="a", arrival=1.0))
    batch = s.schedule(now=1.0)
    assert len(batch.prefills) == 1 and len(batch.decodes) == 63
    advance(s, batch)
    s.finish(s.running[-1], FinishReason.LENGTH)
    s.add(Sequence("c-0", list(range(40)), SamplingParams(max_tokens=8), tenant="c", priority=-1, arrival=1.0))
    batch = s.schedule(now=1.0)
    assert len(batch.prefills) == 1 and len(batch.decodes) == 63


def test_held_back_decodes_run_in_the_same_step_when_the_newcomer_is_not_admitted():
    """b's request is peeked at but does not fit the KV pool: a's decodes are not held back for nothing."""
    s = Scheduler(BlockManager(8, 16), max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(3):
        s.add(Sequence(f"a-{i}", list(range(20)), SamplingParams(max_tokens=1000), tenant="a", arrival=i * 1e-3))
    step(s)
    s.add(Sequence("b-0", list(range(40)), SamplingParams(max_tokens=8), tenant="b", arrival=1.0))
    assert s._held_back()[0] == {(0, "a")}  # a holds 3 of 4, above its share of 2
    batch = s.schedule(now=1.0)
    assert not batch.prefills and len(batch.decodes) == 3


def test_a_tenant_takes_slots_up_to_its_share_only():
    """b sends as many requests as a: it takes slots until it holds its share (half of them), then waits
    for slots to free like everyone; neither takes slots back from the other afterwards."""
    s = full_batch(4, 4)
    for i in range(4):
        s.add(Sequence(f"b-{i}", list(range(40)), SamplingParams(max_tokens=1000), tenant="b", arrival=1.0 + i))
    preempted = 0
    for _ in range(20):
        batch = s.schedule(now=2.0)
        preempted += len(batch.preempted)
        advance(s, batch)
    assert preempted == 2
    assert sorted(q.tenant for q in s.running) == ["a", "a", "b", "b"]


def test_a_full_batch_is_not_preempted_for_a_tenant_served_more_or_of_another_level():
    s = full_batch(4, 0)
    s.fair.charge_output("b", 10_000)  # served more than a
    s.add(Sequence("b-0", list(range(40)), SamplingParams(max_tokens=8), tenant="b", arrival=1.0))
    s.add(Sequence("c-0", list(range(40)), SamplingParams(max_tokens=8), tenant="c", priority=-1, arrival=1.0))
    for _ in range(5):
        batch = s.schedule(now=1.0)
        assert not batch.preempted and not batch.prefills
        advance(s, batch)
    assert {q.tenant for q in s.running} == {"a"}


def reference_pick(s: Scheduler) -> Sequence:
    """The admission choice as a scan of every waiting request: the level of the oldest aged request, and in
    it the oldest request of the tenant with the smallest (counter, oldest request)."""
    waiting = s.waiting  # by rank
    oldest: dict[tuple[int, str], Sequence] = {}
    for q in waiting:
        oldest.setdefault((q.priority, q.tenant), q)
    level = waiting[0].priority
    return min((q for (p, _), q in oldest.items() if p == level),
               key=lambda q: (s.fair.counter(q.tenant), s._rank(q)))


def test_admission_heaps_choose_as_a_scan_of_every_tenant_would():
    """Many tenants in three levels, arriving, finishing and cancelling at random: every admission picks
    what the full scan picks."""
    rng = random.Random(23)
    s = Scheduler(BlockManager(8192, 16), max_num_seqs=6, max_num_batched_tokens=128, aging_s=5.0)
    tenants = [f"t{i}" for i in range(40)]
    n = admissions = 0
    for t in range(400):
        for _ in range(rng.randint(0, 3)):
            s.add(request(rng.choice(tenants), n, rng, priority=rng.randint(0, 2), arrival=t * 0.1))
            n += 1
        if s.waiting and rng.random() < 0.2:
            s.finish(rng.choice(s.waiting), FinishReason.CANCELLED)
        expected = reference_pick(s) if s.waiting else None
        was_waiting, free_slot = set(s.waiting), len(s.running) < s.max_num_seqs
        batch = s.schedule(now=t * 0.1)
        admitted = [q for q, _ in batch.prefills if q in was_waiting]
        if admitted and free_slot:  # (a full batch's first admission is fair share's slot: tests above)
            assert admitted[0] is expected
            admissions += 1
        advance(s, batch)
        for q in list(s.running):
            if len(q.output_token_ids) >= q.params.max_tokens:
                s.finish(q, FinishReason.LENGTH)
    assert admissions > 100


def test_admission_does_not_scan_the_waiting_tenants():
    s = Scheduler(BlockManager(8192, 16), max_num_seqs=1, max_num_batched_tokens=64)
    rng = random.Random(1)
    for i in range(2000):
        s.add(request(f"t{i}", i, rng))
    calls = 0
    counter = s.fair.counter

    def counted(tenant: str) -> float:
        nonlocal calls
        calls += 1
        return counter(tenant)

    s.fair.counter = counted
    s.add(request("late", 0, rng))
    s.schedule(now=0.0)
    assert calls < 50


def test_idle_tenants_are_pruned_from_the_counters_and_metrics():
    from loramux.server.serving.metrics import _fair_share_families

    s = Scheduler(BlockManager(64, 16), max_num_seqs=4, max_num_batched_tokens=64,
                  fair_share=FairShare(idle_prune_s=60.0))
    rng = random.Random(2)
    gone, stays = request("gone", 0, rng), request("stays", 0, rng, arrival=0.0)
    stays.params.max_tokens = 10_000
    s.add(gone)
    s.add(stays)
    while not gone.is_finished:
        advance(s, s.schedule(now=0.0))
        if len(gone.output_token_ids) >= gone.params.max_tokens:
            s.finish(gone, FinishReason.LENGTH, now=1.0)
    s.schedule(now=60.0)  # idle for 59 s: kept
    assert set(s.fair.stats()) == {"gone", "stays"}
    s.schedule(now=61.0)
    assert set(s.fair.stats()) == {"stays"}  # "stays" has had a request running all along
    counter, service = _fair_share_families(s.fair.stats())
    assert {sample.labels["tenant"] for sample in counter.samples + service.samples} == {"stays"}
    s.add(request("gone", 1, rng))  # back: a fresh account (then lifted as any rejoin)
    assert s.fair.stats()["gone"]["service"] == 0 and s.fair.stats()["gone"]["output_tokens"] == 0
