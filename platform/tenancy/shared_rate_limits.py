"""Rate limits and concurrency caps shared by every ingress replica, kept in Redis (torch-free, no HTTP
types). Same interface and errors as `loramux.tenancy.rate_limits.RateLimiter`, which single-process servers
keep using.

* `requests_per_min`: a moving window (the `limits` library's, on Redis): at most that many admissions in
  any 60 s, across all replicas, exactly.
* `tokens_per_min`: a token bucket in one Redis hash (a Lua script, Redis' own clock), the same shape as
  the in-memory limiter's: a request takes its estimate (prompt + n x max_tokens) at admission and is
  settled with the tokens it really used at release (refund, or a debt the next requests pay back).
* `max_concurrent`: a Redis sorted set per tenant of the sequences in flight (a request with n choices
  holds n members), each with a lease of `lease_s`; checking and adding is one Lua script, so two replicas
  cannot both take the last slot, and a replica that dies holding slots gives them back when their leases
  run out.

Redis is never waited on for long and never from the event loop: the class says `blocking = True`, so the
server calls `admit` in its threadpool; every call has `timeout_s` as its socket and connect timeout;
`release` from the event loop hands its Redis work to one background thread. After a failure a circuit
breaker skips Redis for `cooldown_s`. While Redis is unavailable the fail mode decides: "open" admits
(logged, counted in `unavailable`: the limits protect capacity, they must not take the whole service down
with them), "closed" refuses with `LimiterUnavailable` (HTTP 503 with Retry-After). Billing never depends
on them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from loramux.tenancy.rate_limits import RateLimited, RequestTooLarge, TierLimits, check_parts

log = logging.getLogger(__name__)

_CONCURRENCY_RETRY_S = 1.0
FailMode = Literal["open", "closed"]

# KEYS[1]: the tenant's in-flight set. ARGV: now, lease end, max, key ttl (s), members...
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) + #ARGV - 4 > tonumber(ARGV[3]) then return 0 end
for i = 5, #ARGV do redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""
# A token bucket {level, stamp} refilled at capacity / 60 per second by Redis' clock. KEYS[1]: the bucket.
# ARGV: capacity, amount, mode ("take": take `amount` if available, else return the wait in ms; "settle":
# add `amount`, which may be negative, never above capacity). Returns {taken (1/0), wait ms}.
_BUCKET = """
local capacity, amount = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'level', 'stamp')
local level, stamp = tonumber(state[1]) or capacity, tonumber(state[2]) or now
if now > stamp then level = math.min(capacity, level + (now - stamp) * capacity / 60) end
local taken, wait = 1, 0
if ARGV[3] == 'take' then
  if level + 1e-9 * math.max(1, amount) >= amount then level = level - amount
  else taken = 0; wait = math.ceil((amount - level) * 60000 / capacity) end
else
  level = math.min(capacity, level + amount)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'stamp', tostring(math.max(now, stamp)))
redis.call('EXPIRE', KEYS[1], 120)
return {taken, wait}
"""


class LimiterUnavailable(Exception):
    """Redis cannot be reached and the fail mode is "closed": the request is refused for now (HTTP 503)."""

    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s
        super().__init__("rate limits are unavailable (their store cannot be reached); retry later")


class SharedAdmission:
    """One admitted request; `release(actual_tokens)` gives its concurrency slots back and settles its
    tokens (once; never raises, never blocks the event loop)."""

    __slots__ = ("_limiter", "_slots", "_bucket", "tenant_id", "estimated_tokens", "_released")

    def __init__(self, limiter: SharedRateLimiter, tenant_id: str, slots: tuple[str, list[str]] | None,
                 bucket: tuple[str, int] | None, estimated_tokens: int):
        self._limiter, self._slots, self._bucket, self.tenant_id = limiter, slots, bucket, tenant_id
        self.estimated_tokens = estimated_tokens
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self, actual_tokens: int | None = None) -> None:
        if self._released:
            return
        self._released = True
        refund = None
        if self._bucket is not None and actual_tokens is not None:
            refund = (*self._bucket, self.estimated_tokens - max(0, actual_tokens))
        if self._slots is not None or refund is not None:
            self._limiter._in_background(self._limiter._give_back, self._slots, refund)

    def __enter__(self) -> SharedAdmission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SharedRateLimiter:
    blocking = True  # every call may wait up to `timeout_s` on the network: call `admit` off the event loop

    def __init__(self, redis_url: str, prefix: str = "loramux:limits:", lease_s: float = 900.0, *,
                 timeout_s: float = 0.25, cooldown_s: float = 5.0, fail_mode: FailMode = "open"):
        import redis
        from limits import storage, strategies

        if fail_mode not in ("open", "closed"):
            raise ValueError(f"fail_mode must be 'open' or 'closed', got {fail_mode!r}")
        timeouts = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._store = storage.storage_from_string(redis_url, **timeouts)
        self._requests = strategies.MovingWindowRateLimiter(self._store)
        self._redis = redis.Redis.from_url(redis_url, **timeouts)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._bucket = self._redis.register_script(_BUCKET)
        self.prefix, self.lease_s = prefix, lease_s
        self.fail_mode, self.cooldown_s = fail_mode, cooldown_s
        self._open_until = 0.0  # circuit breaker: Redis is not tried before this (monotonic)
        self._lock = threading.Lock()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="loramux-limits")
        self.unavailable = 0  # admissions decided by the fail mode because Redis was unavailable

    def admit(self, tenant_id: str, tier: str, limits: TierLimits, estimated_tokens: int,
              slots: int = 1, requests: int = 1) -> SharedAdmission:
        """As RateLimiter.admit: admit or raise RateLimited / RequestTooLarge (and LimiterUnavailable while
        Redis is unavailable in the "closed" fail mode). Blocks up to a few `timeout_s`."""
        from limits import RateLimitItemPerMinute

        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        check_parts(requests, limits, tier)  # a fan-out takes one request per part, as in memory
        if limits.tokens_per_min and estimated_tokens > limits.tokens_per_min:
            raise RequestTooLarge(estimated_tokens, limits.tokens_per_min, tier)
        if limits.max_concurrent:
            slots = min(slots, limits.max_concurrent)  # as the in-memory limiter: never refused for good
        if self._breaker_open():
            return self._unavailable(tenant_id, "the circuit breaker is open")
        held = bucket = None
        try:
            if limits.max_concurrent:
                held = self._take_slots(tenant_id, limits.max_concurrent, slots)
                if held is None:
                    raise RateLimited("max_concurrent", limits.max_concurrent, tier, _CONCURRENCY_RETRY_S)
            per_min = RateLimitItemPerMinute(limits.requests_per_min) if limits.requests_per_min else None
            if per_min is not None and not self._requests.test(per_min, tenant_id, cost=requests):
                raise RateLimited("requests_per_min", limits.requests_per_min, tier, self._wait(per_min, tenant_id))
            if limits.tokens_per_min:
                key = self._bucket_key(tenant_id)
                taken, wait_ms = self._bucket(keys=[key], args=[limits.tokens_per_min, estimated_tokens, "take"])
                if not taken:
                    raise RateLimited("tokens_per_min", limits.tokens_per_min, tier, int(wait_ms) / 1000)
                bucket = (key, limits.tokens_per_min)
            if per_min is not None and not self._requests.hit(per_min, tenant_id, cost=requests):  # lost a race
                raise RateLimited("requests_per_min", limits.requests_per_min, tier, self._wait(per_min, tenant_id))
        except RateLimited:
            self._give_back(held, (*bucket, estimated_tokens) if bucket else None)
            raise
        except Exception as exc:  # noqa: BLE001 - Redis unreachable or slow: the fail mode decides
            self._trip()
            self._in_background(self._give_back, held, (*bucket, estimated_tokens) if bucket else None)
            return self._unavailable(tenant_id, exc)
        return SharedAdmission(self, tenant_id, held, bucket, estimated_tokens)

    def in_flight(self, tenant_id: str) -> int:
        key = self._slots_key(tenant_id)
        self._redis.zremrangebyscore(key, "-inf", time.time())
        return int(self._redis.zcard(key))

    def close(self) -> None:
        self._background.shutdown(wait=False)

    # -- internals -------------------------------------------------------------------------------------------
    def _breaker_open(self) -> bool:
        with self._lock:
            return time.monotonic() < self._open_until

    def _trip(self) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self.cooldown_s

    def _unavailable(self, tenant_id: str, why) -> SharedAdmission:
        with self._lock:
            self.unavailable += 1
        if self.fail_mode == "closed":
            log.warning("shared rate limits unavailable, refusing tenant %s (fail mode closed): %s", tenant_id, why)
            raise LimiterUnavailable(self.cooldown_s)
        log.warning("shared rate limits unavailable, admitting tenant %s (fail mode open): %s", tenant_id, why)
        return SharedAdmission(self, tenant_id, None, None, 0)

    def _in_background(self, fn, *args) -> None:
        """Run `fn(*args)` on the background thread when called from the event loop, else here."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            fn(*args)
            return
        try:
            self._background.submit(fn, *args)
        except RuntimeError:  # shut down: the leases free the slots
            pass

    def _slots_key(self, tenant_id: str) -> str:
        return f"{self.prefix}inflight:{tenant_id}"

    def _bucket_key(self, tenant_id: str) -> str:
        return f"{self.prefix}tokens:{tenant_id}"

    def _take_slots(self, tenant_id: str, max_concurrent: int, slots: int) -> tuple[str, list[str]] | None:
        key, now = self._slots_key(tenant_id), time.time()
        members = [uuid.uuid4().hex for _ in range(slots)]
        taken = self._acquire(keys=[key], args=[now, now + self.lease_s, max_concurrent, int(self.lease_s) + 60,
                                                *members])
        return (key, members) if taken else None

    def _give_back(self, slots: tuple[str, list[str]] | None, refund: tuple[str, int, int] | None) -> None:
        """Remove held slots and settle a token bucket by `refund` (may be negative); never raises."""
        if self._breaker_open():
            return  # the leases free the slots; the refund is forgone
        try:
            if slots is not None:
                self._redis.zrem(slots[0], *slots[1])
            if refund is not None and refund[2]:
                key, capacity, amount = refund
                self._bucket(keys=[key], args=[capacity, amount, "settle"])
        except Exception as exc:  # noqa: BLE001 - the lease frees the slots later
            self._trip()
            log.warning("concurrency slots not released (their lease will free them): %s", exc)

    def _wait(self, item, tenant_id: str) -> float:
        reset_at = self._requests.get_window_stats(item, tenant_id).reset_time
        return max(0.001, reset_at - time.time())
