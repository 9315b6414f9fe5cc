"""Per-tenant rate limits and concurrency caps (loramux.tenancy.rate_limits): fake clock, no sleeps."""
from __future__ import annotations

import sys
import threading

import pytest

from loramux.tenancy.rate_limits import Admission, RateLimited, RateLimiter, RequestTooLarge, TierLimits


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock():
    return FakeClock()


def limiter_with(clock, **kw) -> RateLimiter:
    return RateLimiter(clock=clock, **kw)


def drain(lim: RateLimiter, tenant: str, limits: TierLimits, n: int, tokens: int = 0) -> list[Admission]:
    return [lim.admit(tenant, "free", limits, tokens) for _ in range(n)]


# -- requests per minute ---------------------------------------------------------------------------

@pytest.mark.parametrize("rpm", [60, 7, 1, 1000])
def test_requests_bucket_drains_and_retry_after_is_exact(clock, rpm):
    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=rpm)
    drain(lim, "t1", limits, rpm)  # starts full: a whole minute's worth passes at once
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 0)
    err = info.value
    assert err.limit == "requests_per_min"
    assert err.retry_after_s == pytest.approx(60.0 / rpm)
    assert f"{rpm} requests per minute" in str(err) and "'free'" in str(err) and "retry in" in str(err)

    clock.advance(err.retry_after_s * 0.9)  # before: still refused, with the remaining wait
    with pytest.raises(RateLimited) as again:
        lim.admit("t1", "free", limits, 0)
    assert again.value.retry_after_s == pytest.approx(err.retry_after_s * 0.1, rel=1e-6)

    clock.advance(again.value.retry_after_s)  # exactly when promised: passes, and only one passes
    lim.admit("t1", "free", limits, 0)
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limits, 0)


def test_requests_bucket_refills_continuously_up_to_capacity(clock):
    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=60)
    drain(lim, "t1", limits, 60)
    clock.advance(10.0)  # 1 per second -> 10 back
    drain(lim, "t1", limits, 10)
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limits, 0)
    clock.advance(3600.0)  # long idle: capped at capacity, not 3600
    drain(lim, "t1", limits, 60)
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limits, 0)


def test_tenants_are_independent(clock):
    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=2)
    drain(lim, "a", limits, 2)
    with pytest.raises(RateLimited):
        lim.admit("a", "free", limits, 0)
    drain(lim, "b", limits, 2)


# -- tokens per minute -----------------------------------------------------------------------------

def test_tokens_bucket_uses_estimates(clock):
    lim = limiter_with(clock)
    limits = TierLimits(tokens_per_min=1200)  # 20 tokens/s
    lim.admit("t1", "pro", limits, 1000)
    lim.admit("t1", "pro", limits, 200)
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "pro", limits, 100)
    assert info.value.limit == "tokens_per_min"
    assert info.value.retry_after_s == pytest.approx(5.0)  # 100 tokens at 20/s
    assert "1200 tokens per minute" in str(info.value) and "'pro'" in str(info.value)
    clock.advance(4.999)
    with pytest.raises(RateLimited):
        lim.admit("t1", "pro", limits, 100)
    clock.advance(0.001)
    lim.admit("t1", "pro", limits, 100)


def test_refusal_is_atomic(clock):
    """A token-limit refusal takes no request token (and vice versa nothing is taken from tokens)."""
    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=2, tokens_per_min=100)
    lim.admit("t1", "free", limits, 90)
    for _ in range(5):
        with pytest.raises(RateLimited) as info:
            lim.admit("t1", "free", limits, 50)
        assert info.value.limit == "tokens_per_min"
    lim.admit("t1", "free", limits, 10)  # the second request token is still there
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 0)
    assert info.value.limit == "requests_per_min"
    # the requests refusal took no tokens either: after refilling both, a full-size-1 estimate passes
    clock.advance(60.0)
    lim.admit("t1", "free", limits, 100)


def test_concurrency_refusal_takes_nothing(clock):
    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=3, tokens_per_min=300, max_concurrent=1)
    adm = lim.admit("t1", "free", limits, 100)
    for _ in range(10):
        with pytest.raises(RateLimited) as info:
            lim.admit("t1", "free", limits, 100)
        assert info.value.limit == "max_concurrent"
    adm.release()
    lim.admit("t1", "free", limits, 100).release()
    lim.admit("t1", "free", limits, 100).release()  # 3 requests and 300 tokens: all were still there
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limits, 0)


def test_retry_after_reports_the_longest_wait(clock):
    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=60, tokens_per_min=60, max_concurrent=1)
    lim.admit("t1", "free", limits, 60)  # tokens empty (1/s), one request in flight, 59 requests left
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 30)
    assert info.value.limit == "tokens_per_min"
    assert info.value.retry_after_s == pytest.approx(30.0)


def test_request_too_large(clock):
    lim = limiter_with(clock)
    limits = TierLimits(tokens_per_min=1000, requests_per_min=5)
    with pytest.raises(RequestTooLarge) as info:
        lim.admit("t1", "free", limits, 1001)
    assert not isinstance(info.value, RateLimited)
    assert info.value.tokens == 1001 and info.value.limit == 1000
    assert "1001 tokens exceed your tier's limit of 1000 tokens per minute" in str(info.value)
    assert "lower max_tokens" in str(info.value)
    drain(lim, "t1", limits, 1, tokens=1000)  # exactly the capacity is fine; the refusal took nothing
    drain(lim, "t1", limits, 4)
    assert lim.in_flight("t1") == 5


def test_negative_inputs_rejected(clock):
    lim = limiter_with(clock)
    with pytest.raises(ValueError):
        lim.admit("t1", "free", TierLimits(), -1)
    with pytest.raises(ValueError):
        TierLimits(requests_per_min=-1)


# -- concurrency and release -----------------------------------------------------------------------

def test_max_concurrent_and_release(clock):
    lim = limiter_with(clock)
    limits = TierLimits(max_concurrent=2)
    a = lim.admit("t1", "free", limits, 10)
    b = lim.admit("t1", "free", limits, 10)
    assert lim.in_flight("t1") == 2
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 10)
    assert info.value.limit == "max_concurrent" and info.value.retry_after_s == 1.0
    assert "2 requests in flight" in str(info.value)
    a.release()
    assert lim.in_flight("t1") == 1
    c = lim.admit("t1", "free", limits, 10)
    b.release(5)
    c.release()
    assert lim.in_flight("t1") == 0
    assert lim.in_flight("unknown") == 0


def test_release_is_idempotent(clock):
    lim = limiter_with(clock)
    limits = TierLimits(tokens_per_min=600, max_concurrent=1)
    a = lim.admit("t1", "free", limits, 500)
    a.release(100)
    a.release(100)  # no second refund, no negative in-flight count
    a.release(0)
    assert a.released and lim.in_flight("t1") == 0
    lim.admit("t1", "free", limits, 500)  # 100 left + 400 refunded = 500
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 1)
    assert info.value.limit in ("tokens_per_min", "max_concurrent")
    assert lim.in_flight("t1") == 1


def test_context_manager_releases(clock):
    lim = limiter_with(clock)
    limits = TierLimits(max_concurrent=1)
    with lim.admit("t1", "free", limits, 0):
        assert lim.in_flight("t1") == 1
    assert lim.in_flight("t1") == 0


def test_release_refunds_unused_tokens_but_not_above_capacity(clock):
    lim = limiter_with(clock)
    limits = TierLimits(tokens_per_min=600)  # 10 tokens/s
    a = lim.admit("t1", "free", limits, 500)
    a.release(100)  # 400 refunded -> 500 back in the bucket
    lim.admit("t1", "free", limits, 500).release()  # None keeps the estimate: nothing refunded
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 1)
    assert info.value.retry_after_s == pytest.approx(0.1)

    clock.advance(60.0)  # full again
    b = lim.admit("t1", "free", limits, 300)
    clock.advance(60.0)  # refilled to capacity while in flight
    b.release(0)  # a refund of 300 must not push it past 600
    lim.admit("t1", "free", limits, 600)
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limits, 1)


def test_release_overuse_is_debited(clock):
    lim = limiter_with(clock)
    limits = TierLimits(tokens_per_min=600)  # 10 tokens/s
    a = lim.admit("t1", "free", limits, 500)
    a.release(1100)  # 600 more than estimated: bucket at 100 - 600 = -500
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 0)  # even a zero estimate waits for the debt to be paid
    assert info.value.retry_after_s == pytest.approx(50.0)
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", limits, 100)
    assert info.value.retry_after_s == pytest.approx(60.0)
    clock.advance(60.0)
    lim.admit("t1", "free", limits, 100)


def test_release_with_unlimited_tokens_is_harmless(clock):
    lim = limiter_with(clock)
    a = lim.admit("t1", "free", TierLimits(max_concurrent=1), 100)
    a.release(10_000)
    assert lim.in_flight("t1") == 0


# -- unlimited and tier changes --------------------------------------------------------------------

def test_unlimited_limits(clock):
    lim = limiter_with(clock)
    limits = TierLimits()
    held = [lim.admit("t1", "enterprise", limits, 10_000_000) for _ in range(1000)]
    assert lim.in_flight("t1") == 1000
    for adm in held:
        adm.release(50_000_000)
    assert lim.in_flight("t1") == 0
    # one limited dimension does not limit the others
    only_tokens = TierLimits(tokens_per_min=100)
    held = [lim.admit("t2", "x", only_tokens, 0) for _ in range(500)]
    assert lim.in_flight("t2") == 500


def test_tier_change_rescales_not_resets(clock):
    lim = limiter_with(clock)
    free = TierLimits(requests_per_min=10, tokens_per_min=1000)
    pro = TierLimits(requests_per_min=100, tokens_per_min=10_000)
    drain(lim, "t1", free, 5, tokens=100)  # half of both buckets used
    drain(lim, "t1", pro, 50, tokens=0)  # upgrade: 50 % of 100 requests left, and no more
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "pro", pro, 0)
    assert info.value.limit == "requests_per_min" and "tier 'pro'" in str(info.value)
    assert info.value.retry_after_s == pytest.approx(0.6)  # new rate: 100/min

    clock.advance(60.0)
    drain(lim, "t1", pro, 89)  # full at 100; 11 left; tokens still full (10 000)
    lim.admit("t1", "pro", pro, 10_000)  # 10 of 100 requests and 0 of 10 000 tokens left
    # downgrade: 10 % of requests -> 1 of 10; 0 % tokens -> 0 of 1000
    lim.admit("t1", "free", free, 0)
    with pytest.raises(RateLimited) as info:
        lim.admit("t1", "free", free, 0)
    assert info.value.limit in ("requests_per_min", "tokens_per_min")
    assert info.value.retry_after_s == pytest.approx(6.0)  # one request at 10/min (tokens: 0 needed, 0 held)


def test_tier_change_to_and_from_unlimited(clock):
    lim = limiter_with(clock)
    limited = TierLimits(requests_per_min=2, max_concurrent=1)
    a = lim.admit("t1", "free", limited, 0)
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limited, 0)
    b = lim.admit("t1", "unlimited", TierLimits(), 0)  # unlimited now: passes at once
    assert lim.in_flight("t1") == 2
    a.release()
    b.release()
    lim.admit("t1", "free", limited, 0)  # back to limited: the bucket starts full (2)
    assert lim.in_flight("t1") == 1


def test_max_concurrent_lowered_below_in_flight(clock):
    lim = limiter_with(clock)
    held = drain(lim, "t1", TierLimits(max_concurrent=5), 4)
    low = TierLimits(max_concurrent=2)
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", low, 0)
    for adm in held[:3]:
        adm.release()
    lim.admit("t1", "free", low, 0)
    assert lim.in_flight("t1") == 2


# -- memory bounds ---------------------------------------------------------------------------------

def test_idle_tenants_are_evicted(clock):
    lim = limiter_with(clock, idle_evict_s=600.0)
    limits = TierLimits(requests_per_min=60, tokens_per_min=6000, max_concurrent=4)
    for i in range(10_000):
        lim.admit(f"t{i}", "free", limits, 100).release(50)
    assert lim.tracked_tenants() == 10_000
    held = lim.admit("busy", "free", limits, 100)  # in flight: must survive eviction
    debtor = lim.admit("debtor", "free", limits, 100)
    debtor.release(100_000)  # deep in debt: ~16 min to refill, must survive too
    clock.advance(601.0)
    lim.admit("fresh", "free", limits, 10).release()
    assert lim.tracked_tenants() <= 3
    assert lim.in_flight("busy") == 1
    with pytest.raises(RateLimited) as info:
        lim.admit("debtor", "free", limits, 0)
    assert info.value.limit == "tokens_per_min"
    held.release()
    clock.advance(2000.0)
    lim.admit("fresh", "free", limits, 10).release()
    assert lim.tracked_tenants() == 1  # busy and debtor are idle and full now


def test_not_evicted_before_idle_period(clock):
    lim = limiter_with(clock, idle_evict_s=600.0)
    limits = TierLimits(requests_per_min=60)
    lim.admit("a", "free", limits, 0).release()
    clock.advance(599.0)
    lim.admit("b", "free", limits, 0).release()
    assert lim.tracked_tenants() == 2
    clock.advance(2.0)
    lim.admit("b", "free", limits, 0).release()
    assert lim.tracked_tenants() == 1


def test_max_tenants_cap(clock):
    lim = limiter_with(clock, max_tenants=100)
    limits = TierLimits(requests_per_min=1)
    held = lim.admit("busy", "free", limits, 0)
    for i in range(1000):
        lim.admit(f"t{i}", "free", limits, 0).release()  # each leaves a bucket not yet full: no idle eviction
        assert lim.tracked_tenants() <= 100
    assert lim.in_flight("busy") == 1  # the one with a request in flight was never dropped
    held.release()
    assert lim.in_flight("busy") == 0
    # the most recent tenants are still tracked (their empty buckets still refuse)
    with pytest.raises(RateLimited):
        lim.admit("t999", "free", limits, 0)


def test_tenants_with_requests_in_flight_are_never_dropped(clock):
    """At the cap with every tenant busy, the count may pass the cap (by the busy tenants only) rather
    than lose a concurrency count."""
    lim = limiter_with(clock, max_tenants=10)
    limits = TierLimits(max_concurrent=1)
    held = [lim.admit(f"t{i}", "free", limits, 0) for i in range(20)]
    assert lim.tracked_tenants() == 20
    assert all(lim.in_flight(f"t{i}") == 1 for i in range(20))
    for adm in held:
        adm.release()
    lim.admit("new", "free", limits, 0).release()
    assert lim.tracked_tenants() <= 10


def test_rate_limited_message_and_header(clock):
    err = RateLimited("requests_per_min", 60, "free", 0.75)
    assert str(err) == "rate limit: 60 requests per minute for tier 'free'; retry in 0.8 s"
    assert err.retry_after_header == "1"
    assert RateLimited("tokens_per_min", 10, "free", 0.0).retry_after_s == 0.001
    assert RateLimited("max_concurrent", 4, "x", 61.2).retry_after_header == "62"


# -- threads ---------------------------------------------------------------------------------------

def test_threads_never_exceed_max_concurrent():
    lim = RateLimiter()  # real clock
    cap = 3
    limits = TierLimits(tokens_per_min=10_000_000, max_concurrent=cap)
    tenants = ["a", "b"]
    guard = threading.Lock()
    current = {t: 0 for t in tenants}
    peak = {t: 0 for t in tenants}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        tenant = tenants[k % 2]
        try:
            start.wait()
            for i in range(2000):
                try:
                    adm = lim.admit(tenant, "free", limits, 100)
                except RateLimited as e:
                    assert e.limit == "max_concurrent"
                    continue
                with guard:
                    current[tenant] += 1
                    peak[tenant] = max(peak[tenant], current[tenant])
                    assert current[tenant] <= cap
                with guard:
                    current[tenant] -= 1
                adm.release(i % 200)
                if i % 7 == 0:
                    adm.release()  # a racing second release must do nothing
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[0]
    assert all(1 <= peak[t] <= cap for t in tenants)
    assert all(lim.in_flight(t) == 0 for t in tenants)


def test_threads_shared_admissions_released_from_other_threads():
    lim = RateLimiter()
    limits = TierLimits(max_concurrent=50)
    admissions = [lim.admit("t", "free", limits, 0) for _ in range(50)]

    def releaser() -> None:
        for adm in admissions:  # every thread tries to release every admission once
            adm.release()

    threads = [threading.Thread(target=releaser) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert lim.in_flight("t") == 0


# -- fan-out: a request of N parts is N requests' worth ------------------------------------------------

def test_a_fan_out_takes_one_request_per_part_and_is_refused_whole_when_its_parts_do_not_fit(clock):
    """A free tier with max_fanout 2 got twice its requests-per-minute rate when a fan-out took one."""
    from loramux.tenancy.rate_limits import TooManyParts

    lim = limiter_with(clock)
    limits = TierLimits(requests_per_min=4)
    lim.admit("t1", "free", limits, 0, slots=2, requests=2)
    lim.admit("t1", "free", limits, 0, requests=1)
    with pytest.raises(RateLimited) as info:  # one request left: a 2-part fan-out does not fit
        lim.admit("t1", "free", limits, 0, slots=2, requests=2)
    assert info.value.limit == "requests_per_min" and info.value.retry_after_s == pytest.approx(15.0)
    lim.admit("t1", "free", limits, 0)  # the refusal took nothing: the last one still passes
    with pytest.raises(RateLimited):
        lim.admit("t1", "free", limits, 0)
    clock.advance(30.0)  # two requests' worth back
    lim.admit("t1", "free", limits, 0, requests=2)

    with pytest.raises(TooManyParts) as never:  # more parts than the whole minute holds: a 400, not a 429
        lim.admit("t2", "free", limits, 0, requests=5)
    assert isinstance(never.value, RequestTooLarge) and not isinstance(never.value, RateLimited)
    assert "fans out to 5 adapters" in str(never.value) and "4 requests per minute" in str(never.value)
    lim.admit("t2", "free", limits, 0, requests=4)  # exactly the capacity is fine
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            lim.admit("t3", "free", limits, 0, requests=bad)
