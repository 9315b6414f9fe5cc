"""Rate limits shared through Redis (two limiter instances stand for two ingress replicas), the replica
stream's wire format, and the single-process server without Ray."""
from __future__ import annotations

import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("limits", reason="the ray extra is not installed")

from loramux.child_python import python_command
from loramux.tenancy.rate_limits import RateLimited, RequestTooLarge, TierLimits  # noqa: E402
from loramux.tenancy.shared_rate_limits import SharedRateLimiter  # noqa: E402


@pytest.fixture
def pair(redis_url):
    """Two limiters on one Redis, under a prefix of their own (tenants are unique per test too)."""
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    return SharedRateLimiter(redis_url, prefix=prefix), SharedRateLimiter(redis_url, prefix=prefix)


def tenant() -> str:
    return f"tn_{uuid.uuid4().hex[:10]}"


def test_requests_per_minute_hold_across_replicas_even_when_they_race(pair):
    limits, who = TierLimits(requests_per_min=30), tenant()
    calls = [pair[i % 2] for i in range(80)]

    def attempt(limiter):
        try:
            limiter.admit(who, "limited", limits, 10).release(10)
            return "ok"
        except RateLimited as exc:
            assert exc.limit == "requests_per_min" and 0 < exc.retry_after_s <= 60
            return "limited"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(attempt, calls))
    assert outcomes.count("ok") == 30 and outcomes.count("limited") == 50


def test_concurrency_cap_is_global_and_slots_come_back_on_release(pair):
    first, second = pair
    limits, who = TierLimits(max_concurrent=2), tenant()
    a = first.admit(who, "t", limits, 1)
    b = second.admit(who, "t", limits, 1)
    with pytest.raises(RateLimited) as refused:
        first.admit(who, "t", limits, 1)
    assert refused.value.limit == "max_concurrent"
    assert first.in_flight(who) == 2
    b.release()
    b.release()  # a second release gives nothing back twice
    c = first.admit(who, "t", limits, 1)
    assert second.in_flight(who) == 2
    for held in (a, c):
        held.release()
    assert first.in_flight(who) == 0


def test_a_replica_that_dies_holding_slots_loses_them_when_their_lease_ends(redis_url):
    prefix = f"test:{uuid.uuid4().hex[:8]}:"
    dying = SharedRateLimiter(redis_url, prefix=prefix, lease_s=0.0)  # every slot it takes is already expired
    survivor = SharedRateLimiter(redis_url, prefix=prefix)
    limits, who = TierLimits(max_concurrent=1), tenant()
    dying.admit(who, "t", limits, 1)  # never released: its process "died"
    held = survivor.admit(who, "t", limits, 1)  # not refused: the dead replica's slot lapsed with its lease
    assert survivor.in_flight(who) == 1 and dying.in_flight(who) == 1  # the survivor's slot, seen by both
    with pytest.raises(RateLimited) as refused:
        dying.admit(who, "t", limits, 1)
    assert refused.value.limit == "max_concurrent"
    held.release()
    assert survivor.in_flight(who) == 0


def test_tokens_per_minute_are_charged_their_estimate_and_settled_with_what_was_used(pair):
    first, second = pair
    limits, who = TierLimits(tokens_per_min=1000), tenant()
    with pytest.raises(RequestTooLarge):
        first.admit(who, "t", limits, 1001)
    held = first.admit(who, "t", limits, 600)
    with pytest.raises(RateLimited) as refused:  # the estimate is charged while the request runs
        second.admit(who, "t", limits, 600)
    assert refused.value.limit == "tokens_per_min" and 0 < refused.value.retry_after_s <= 60
    held.release(5)  # it used 5: the other 595 come back, on every replica
    second.admit(who, "t", limits, 600).release(1300)  # overuse: a debt of 700 beyond the 600 charged
    with pytest.raises(RateLimited):
        first.admit(who, "t", limits, 100)  # 1000 - 5 - 1300 < 0 (plus a moment's refill)


def test_a_request_with_n_choices_holds_n_concurrency_slots_everywhere(pair):
    first, second = pair
    limits, who = TierLimits(max_concurrent=4), tenant()
    three = first.admit(who, "t", limits, 1, slots=3)
    assert second.in_flight(who) == 3
    with pytest.raises(RateLimited) as refused:
        second.admit(who, "t", limits, 1, slots=2)
    assert refused.value.limit == "max_concurrent"
    second.admit(who, "t", limits, 1).release()  # the fourth slot is free
    three.release()
    assert first.in_flight(who) == 0
    first.admit(who, "t", limits, 1, slots=9).release()  # more than the cap: takes the whole cap, not refused


def test_a_refused_request_gives_its_concurrency_slot_back(pair):
    first, _ = pair
    limits, who = TierLimits(requests_per_min=1, max_concurrent=5), tenant()
    first.admit(who, "t", limits, 1).release()
    with pytest.raises(RateLimited):
        first.admit(who, "t", limits, 1)
    assert first.in_flight(who) == 0


def test_redis_unreachable_admits_in_the_open_fail_mode_and_refuses_in_the_closed_one():
    from loramux.tenancy.shared_rate_limits import LimiterUnavailable

    limits = TierLimits(requests_per_min=1, max_concurrent=1, tokens_per_min=100)
    opened = SharedRateLimiter("redis://127.0.0.1:1/0")  # nothing listens on port 1
    for _ in range(3):  # never limited while Redis is away: the limits fail open
        admission = opened.admit(tenant(), "t", limits, 1)
        admission.release(1)
        assert admission.released
    assert opened.unavailable == 3
    closed = SharedRateLimiter("redis://127.0.0.1:1/0", fail_mode="closed")
    with pytest.raises(LimiterUnavailable) as refused:
        closed.admit(tenant(), "t", limits, 1)
    assert refused.value.retry_after_s > 0


def test_the_wire_format_rebuilds_the_outputs_a_local_engine_gives():
    from loramux.cluster.wire import Reassembler, to_wire
    from loramux.engine.outputs import RequestOutput, SoFar

    tokens, logprobs = [], []
    outs = []
    for step, new in enumerate(([5, 6], [7], [8, 9])):
        tokens += new
        logprobs += [-0.5] * len(new)
        done = step == 2
        outs.append(RequestOutput(
            request_id="r", delta_text=f"<{step}>", new_token_ids=list(new), text="<0><1><2>" if done else "",
            token_ids=list(tokens) if done else SoFar(tokens, len(tokens)), new_logprobs=[-0.5] * len(new),
            logprobs=list(logprobs) if done else SoFar(logprobs, len(logprobs)), finished=done,
            finish_reason="length" if done else None, num_prompt_tokens=3))
    rebuild = Reassembler()
    got = [rebuild.feed(to_wire(out, "replica-a")) for out in outs]
    assert [list(o.token_ids) for o in got] == [[5, 6], [5, 6, 7], [5, 6, 7, 8, 9]]
    assert [o.new_token_ids for o in got] == [[5, 6], [7], [8, 9]]
    assert got[-1].text == "<0><1><2>" and got[-1].finish_reason == "length"
    assert all(o.replica == "replica-a" for o in got)
    assert to_wire(outs[0], "x")["output"]["token_ids"] is None  # intermediate outputs carry deltas only


def test_the_single_process_server_needs_no_ray():
    """With `ray` unimportable, the server and the CLI import and `serve --ray` says what to install."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import loramux.server.app, loramux.cli, loramux.admin.routes\n"
            "from loramux.cli import ConfigError, serve_on_ray\n"
            "from loramux.settings import Settings\n"
            "try:\n"
            "    serve_on_ray(type('A', (), {'replicas': 2})(), Settings())\n"
            "except ConfigError as exc:\n"
            "    print('refused:', exc)\n")
    out = subprocess.run(python_command("-c", code), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: --ray needs the ray extra" in out.stdout


def test_a_fan_out_takes_one_request_per_part_across_replicas(pair):
    """As the in-memory limiter: a fan-out to N adapters is N requests' worth of requests_per_min."""
    from loramux.tenancy.rate_limits import TooManyParts

    limits, who = TierLimits(requests_per_min=4), tenant()
    pair[0].admit(who, "free", limits, 0, slots=2, requests=2).release(0)
    pair[1].admit(who, "free", limits, 0).release(0)
    with pytest.raises(RateLimited) as info:  # one left: two parts do not fit, and nothing is taken
        pair[0].admit(who, "free", limits, 0, slots=2, requests=2)
    assert info.value.limit == "requests_per_min"
    pair[1].admit(who, "free", limits, 0).release(0)
    with pytest.raises(RateLimited):
        pair[0].admit(who, "free", limits, 0)
    with pytest.raises(TooManyParts):
        pair[0].admit(tenant(), "free", limits, 0, requests=5)
