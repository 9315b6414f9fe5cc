"""Rate limits and concurrency caps shared by every ingress replica, kept in Redis (torch-free, no HTTP
types). Same interface and errors as `loramux.server.ratelimit.RateLimiter`, which single-process servers
keep using.

* `requests_per_min`: a moving window (the `limits` library's, on Redis): at most that many admissions in
  any 60 s, across all replicas, exactly.
* `tokens_per_min`: a sliding-window counter (`limits`), charged the request's estimate at admission. It is
  not settled up afterwards as the in-memory limiter is (`limits` windows take no refunds): across
  replicas a tenant is held to its estimates, which bound what it asked for.
* `max_concurrent`: a Redis sorted set per tenant of admissions in flight, each with a lease of
  `lease_s`; checking and adding is one Lua script, so two replicas cannot both take the last slot, and a
  replica that dies holding slots gives them back when their leases run out.

If Redis cannot be reached, requests are admitted (logged): the limits protect capacity, they must not
take the whole service down with them. Billing does not depend on them.
"""
from __future__ import annotations

import logging
import time
import uuid

from loramux.server.ratelimit import RateLimited, RequestTooLarge, TierLimits

log = logging.getLogger(__name__)

_CONCURRENCY_RETRY_S = 1.0
# KEYS[1]: the tenant's in-flight set. ARGV: now, lease end, member, max, key ttl (s).
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class SharedAdmission:
    """One admitted request; `release` gives its concurrency slot back (once)."""

    __slots__ = ("_limiter", "_slot", "tenant_id", "estimated_tokens", "_released")

    def __init__(self, limiter: SharedRateLimiter, tenant_id: str, slot: tuple[str, str] | None,
                 estimated_tokens: int):
        self._limiter, self._slot, self.tenant_id = limiter, slot, tenant_id
        self.estimated_tokens = estimated_tokens
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self, actual_tokens: int | None = None) -> None:
        if self._released:
            return
        self._released = True
        if self._slot is not None:
            self._limiter._release_slot(*self._slot)

    def __enter__(self) -> SharedAdmission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SharedRateLimiter:
    def __init__(self, redis_url: str, prefix: str = "loramux:limits:", lease_s: float = 900.0):
        import redis
        from limits import storage, strategies

        self._store = storage.storage_from_string(redis_url)
        self._requests = strategies.MovingWindowRateLimiter(self._store)
        self._tokens = strategies.SlidingWindowCounterRateLimiter(self._store)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self.prefix, self.lease_s = prefix, lease_s

    def admit(self, tenant_id: str, tier: str, limits: TierLimits, estimated_tokens: int) -> SharedAdmission:
        """As RateLimiter.admit: admit or raise RateLimited / RequestTooLarge."""
        from limits import RateLimitItemPerMinute

        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        if limits.tokens_per_min and estimated_tokens > limits.tokens_per_min:
            raise RequestTooLarge(estimated_tokens, limits.tokens_per_min, tier)
        slot = None
        try:
            if limits.max_concurrent:
                slot = self._take_slot(tenant_id, limits.max_concurrent)
                if slot is None:
                    raise RateLimited("max_concurrent", limits.max_concurrent, tier, _CONCURRENCY_RETRY_S)
            tokens = RateLimitItemPerMinute(limits.tokens_per_min) if limits.tokens_per_min else None
            if tokens is not None and not self._tokens.test(tokens, tenant_id, cost=max(1, estimated_tokens)):
                raise RateLimited("tokens_per_min", limits.tokens_per_min, tier, self._wait(self._tokens, tokens,
                                                                                             tenant_id))
            if limits.requests_per_min:
                requests = RateLimitItemPerMinute(limits.requests_per_min)
                if not self._requests.hit(requests, tenant_id):
                    raise RateLimited("requests_per_min", limits.requests_per_min, tier,
                                      self._wait(self._requests, requests, tenant_id))
            if tokens is not None and not self._tokens.hit(tokens, tenant_id, cost=max(1, estimated_tokens)):
                raise RateLimited("tokens_per_min", limits.tokens_per_min, tier, self._wait(self._tokens, tokens,
                                                                                             tenant_id))
        except RateLimited:
            if slot is not None:
                self._release_slot(*slot)
            raise
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: admit (see the module docstring)
            log.warning("shared rate limits unavailable, admitting tenant %s: %s", tenant_id, exc)
        return SharedAdmission(self, tenant_id, slot, estimated_tokens)

    def in_flight(self, tenant_id: str) -> int:
        key = self._slots_key(tenant_id)
        self._redis.zremrangebyscore(key, "-inf", time.time())
        return int(self._redis.zcard(key))

    def _slots_key(self, tenant_id: str) -> str:
        return f"{self.prefix}inflight:{tenant_id}"

    def _take_slot(self, tenant_id: str, max_concurrent: int) -> tuple[str, str] | None:
        key, member, now = self._slots_key(tenant_id), uuid.uuid4().hex, time.time()
        taken = self._acquire(keys=[key], args=[now, now + self.lease_s, member, max_concurrent,
                                                int(self.lease_s) + 60])
        return (key, member) if taken else None

    def _release_slot(self, key: str, member: str) -> None:
        try:
            self._redis.zrem(key, member)
        except Exception as exc:  # noqa: BLE001 - the lease frees it later
            log.warning("concurrency slot not released (its lease will free it): %s", exc)

    @staticmethod
    def _wait(strategy, item, tenant_id: str) -> float:
        reset_at = strategy.get_window_stats(item, tenant_id).reset_time
        return max(0.001, reset_at - time.time())
