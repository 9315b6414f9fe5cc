"""Per-tenant rate limits and concurrency caps (torch-free, no HTTP types).

Each tenant's tier sets three limits, 0 meaning unlimited:

* `requests_per_min`: a token bucket of that capacity, refilled continuously at `requests_per_min / 60`
  per second; each request takes one, a fan-out to N adapters N (`requests`: it is N requests' worth of
  work, and a tier's rate must not double with its `max_fanout`). A request of more parts than the
  capacity can never pass and raises `TooManyParts`.
* `tokens_per_min`: a second bucket, same shape; a request takes its estimate (prompt tokens +
  max_tokens) on admission and settles up with the actual count on release: unused tokens are
  refunded (never above capacity), overuse is debited, so the bucket may go negative and the next
  requests wait until it has paid the debt back.
* `max_concurrent`: sequences admitted and not yet released (a request with `n` choices counts n).

Buckets start full. Admission is atomic: every check is made first and, if one fails, nothing is
taken; the `RateLimited` raised carries the limit whose wait is longest and the time after which a
retry can pass (for concurrency, which depends on other requests finishing, a guess of 1 s). An estimate
above the tokens-per-minute capacity can never pass and raises `RequestTooLarge` (a client error: the
caller should lower max_tokens), not `RateLimited`.

A tier change (different limits for a tenant) applies at once: each bucket keeps its fill fraction
(a debt scales too); a bucket that was unlimited starts full.

Memory stays bounded: a tenant idle for longer than `idle_evict_s` whose buckets are full and with
nothing in flight is dropped (lazily, on later admissions, oldest first; it would be recreated full,
so dropping it changes nothing). At most `max_tenants` are tracked: past that, the least recently
used tenants with nothing in flight are dropped, forgiving whatever debt their buckets held. Tenants
with requests in flight are never dropped (their concurrency count must survive), so the count can
pass `max_tenants` only by the number of tenants that have requests in flight.

One lock guards everything; `admit` and `Admission.release` are safe from threads and from asyncio
handlers (they never block beyond that short lock). Callers must release every admission (use
try/finally, or the admission as a context manager); a lost admission holds its concurrency slot.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loramux.tenancy.tenants import TierInfo

__all__ = ["Admission", "RateLimited", "RateLimiter", "RequestTooLarge", "TierLimits"]

# Refill arithmetic is float: a retry made exactly `retry_after_s` later must pass even when the
# refilled level lands a hair below the need.
_EPS = 1e-9
_MIN_RETRY_S = 0.001
_CONCURRENCY_RETRY_S = 1.0
_LIMIT_VALUE_NAMES = {
    "requests_per_min": "requests per minute",
    "tokens_per_min": "tokens per minute",
    "max_concurrent": "requests in flight",
}


@dataclass(frozen=True)
class TierLimits:
    requests_per_min: int = 0
    tokens_per_min: int = 0
    max_concurrent: int = 0

    def __post_init__(self) -> None:
        for name in ("requests_per_min", "tokens_per_min", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 = unlimited), got {value!r}")

    @classmethod
    def of(cls, tier: TierInfo) -> TierLimits:
        """The limits a tier sets."""
        return cls(requests_per_min=tier.requests_per_min, tokens_per_min=tier.tokens_per_min,
                   max_concurrent=tier.max_concurrent)


def check_parts(requests: int, limits: TierLimits, tier: str) -> None:
    """ValueError for `requests` < 1; `TooManyParts` when more than the requests-per-minute capacity."""
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ValueError(f"requests must be an int >= 1, got {requests!r}")
    if limits.requests_per_min and requests > limits.requests_per_min:
        raise TooManyParts(requests, limits.requests_per_min, tier)


class RateLimited(Exception):
    """A limit of the tenant's tier refuses the request for now (HTTP 429 + Retry-After)."""

    def __init__(self, limit: str, value: int, tier: str, retry_after_s: float):
        self.limit = limit
        self.value = value
        self.tier = tier
        self.retry_after_s = max(_MIN_RETRY_S, float(retry_after_s))
        kind = "concurrency limit" if limit == "max_concurrent" else "rate limit"
        shown = math.ceil(self.retry_after_s * 10) / 10  # never promise an earlier retry than the real one
        super().__init__(f"{kind}: {value} {_LIMIT_VALUE_NAMES[limit]} for tier {tier!r}; retry in {shown:.1f} s")

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, rounded up, for an HTTP Retry-After header."""
        return str(max(1, math.ceil(self.retry_after_s)))


class RequestTooLarge(ValueError):
    """The request's token estimate exceeds the tier's tokens-per-minute capacity: it can never pass."""

    def __init__(self, tokens: int, limit: int, tier: str):
        self.tokens = tokens
        self.limit = limit
        self.tier = tier
        super().__init__(f"this request's {tokens} tokens exceed your tier's limit of {limit} tokens per minute"
                         f" (tier {tier!r}); lower max_tokens")


class TooManyParts(RequestTooLarge):
    """A fan-out of more parts (requests' worth) than the tier's requests-per-minute capacity: it can never
    pass."""

    def __init__(self, parts: int, limit: int, tier: str):
        ValueError.__init__(self, f"this request fans out to {parts} adapters, {parts} requests' worth, above your "
                                  f"tier's limit of {limit} requests per minute (tier {tier!r}); name fewer adapters")
        self.tokens, self.limit, self.tier = parts, limit, tier


class _Bucket:
    __slots__ = ("capacity", "level", "stamp")

    def __init__(self, capacity: int, now: float):
        self.capacity = capacity
        self.level = float(capacity)
        self.stamp = now

    @property
    def rate(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(float(self.capacity), self.level + (now - self.stamp) * self.rate)
        self.stamp = max(self.stamp, now)

    def wait_for(self, need: float) -> float:
        """Seconds until `need` is available (0 if it is now); call after `refill`."""
        if self.level >= need - _EPS * max(1.0, need):
            return 0.0
        return (need - self.level) / self.rate

    def is_full(self) -> bool:
        return self.level >= self.capacity * (1 - _EPS)

    def rescale(self, capacity: int) -> None:
        self.level = self.level * capacity / self.capacity
        self.capacity = capacity


class _Tenant:
    __slots__ = ("tier", "limits", "requests", "tokens", "in_flight", "evict_at")

    def __init__(self, tier: str, limits: TierLimits, now: float):
        self.tier = tier
        self.limits = limits
        self.requests = _Bucket(limits.requests_per_min, now) if limits.requests_per_min else None
        self.tokens = _Bucket(limits.tokens_per_min, now) if limits.tokens_per_min else None
        self.in_flight = 0
        self.evict_at = now  # earliest time the sweep looks at this tenant again (set on every touch)

    def refill(self, now: float) -> None:
        for bucket in (self.requests, self.tokens):
            if bucket is not None:
                bucket.refill(now)

    def set_limits(self, limits: TierLimits, now: float) -> None:
        """Apply new limits at once, keeping each bucket's fill fraction (call after `refill`)."""
        self.requests = _rescaled(self.requests, limits.requests_per_min, now)
        self.tokens = _rescaled(self.tokens, limits.tokens_per_min, now)
        self.limits = limits

    def evictable(self, now: float) -> bool:
        if self.in_flight:
            return False
        self.refill(now)
        return all(b is None or b.is_full() for b in (self.requests, self.tokens))

    def seconds_to_full(self) -> float:
        """Time until both buckets are full again (call after `refill`)."""
        return max([(b.capacity - b.level) / b.rate for b in (self.requests, self.tokens) if b is not None],
                   default=0.0)


def _rescaled(bucket: _Bucket | None, capacity: int, now: float) -> _Bucket | None:
    if not capacity:
        return None
    if bucket is None:
        return _Bucket(capacity, now)
    if bucket.capacity != capacity:
        bucket.rescale(capacity)
    return bucket


class Admission:
    """One admitted request: holds a concurrency slot and the tokens taken until `release`."""

    __slots__ = ("_limiter", "_tenant", "tenant_id", "estimated_tokens", "slots", "_charged", "_released")

    def __init__(self, limiter: RateLimiter, tenant: _Tenant, tenant_id: str, estimated_tokens: int, charged: bool,
                 slots: int = 1):
        self._limiter = limiter
        self._tenant = tenant
        self.tenant_id = tenant_id
        self.estimated_tokens = estimated_tokens
        self.slots = slots  # concurrency units held (one per sequence: a request with n choices holds n)
        self._charged = charged  # the estimate was taken from a token bucket
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self, actual_tokens: int | None = None) -> None:
        """End the concurrency slot and settle the token bucket with `actual_tokens` (prompt + completion
        actually generated; None keeps the estimate; a negative count counts as 0). A second call does
        nothing."""
        self._limiter._release(self, actual_tokens)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic, idle_evict_s: float = 600.0,
                 max_tenants: int = 100_000):
        if idle_evict_s < 0 or max_tenants < 1:
            raise ValueError(f"need idle_evict_s >= 0 and max_tenants >= 1, got {idle_evict_s}, {max_tenants}")
        self._clock = clock
        self._idle_evict_s = idle_evict_s
        self._max_tenants = max_tenants
        self._lock = threading.Lock()
        # Least recently touched first (admit and release move a tenant to the end).
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()

    def admit(self, tenant_id: str, tier: str, limits: TierLimits, estimated_tokens: int,
              slots: int = 1, requests: int = 1) -> Admission:
        """Admit one request of `estimated_tokens` (prompt + n x max_tokens) running `slots` sequences (its
        `n` choices: each counts against `max_concurrent`; capped at `max_concurrent`, so a request that
        fits an idle tenant is never refused for good) and taking `requests` from the requests-per-minute
        bucket (a fan-out's parts), or raise `RateLimited` / `RequestTooLarge` (`TooManyParts`); on
        success nothing else is needed until `Admission.release`."""
        if estimated_tokens < 0:
            raise ValueError(f"estimated_tokens must be >= 0, got {estimated_tokens}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        check_parts(requests, limits, tier)
        if limits.max_concurrent:
            slots = min(slots, limits.max_concurrent)
        if limits.tokens_per_min and estimated_tokens > limits.tokens_per_min:
            raise RequestTooLarge(estimated_tokens, limits.tokens_per_min, tier)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            state = self._tenants.get(tenant_id)
            if state is None:
                self._make_room()
                state = self._tenants[tenant_id] = _Tenant(tier, limits, now)
            else:
                state.refill(now)
                if state.limits != limits:
                    state.set_limits(limits, now)
                state.tier = tier
            state.evict_at = now + self._idle_evict_s
            self._tenants.move_to_end(tenant_id)

            refusals: list[tuple[float, str, int]] = []
            if limits.max_concurrent and state.in_flight + slots > limits.max_concurrent:
                refusals.append((_CONCURRENCY_RETRY_S, "max_concurrent", limits.max_concurrent))
            if state.requests is not None and (wait := state.requests.wait_for(float(requests))) > 0:
                refusals.append((wait, "requests_per_min", limits.requests_per_min))
            if state.tokens is not None and (wait := state.tokens.wait_for(estimated_tokens)) > 0:
                refusals.append((wait, "tokens_per_min", limits.tokens_per_min))
            if refusals:
                wait, limit, value = max(refusals, key=lambda r: r[0])
                raise RateLimited(limit, value, tier, wait)

            if state.requests is not None:
                state.requests.level -= float(requests)
            if state.tokens is not None:
                state.tokens.level -= estimated_tokens
            state.in_flight += slots
            return Admission(self, state, tenant_id, estimated_tokens, charged=state.tokens is not None, slots=slots)

    def in_flight(self, tenant_id: str) -> int:
        with self._lock:
            state = self._tenants.get(tenant_id)
            return state.in_flight if state is not None else 0

    def tracked_tenants(self) -> int:
        """How many tenants have state (for stats and tests)."""
        with self._lock:
            return len(self._tenants)

    # -- internals (called with the lock held) ---------------------------------------------------

    def _release(self, admission: Admission, actual_tokens: int | None) -> None:
        with self._lock:
            if admission._released:
                return
            admission._released = True
            state = admission._tenant
            state.in_flight -= admission.slots
            now = self._clock()
            if admission._charged and actual_tokens is not None and state.tokens is not None:
                state.tokens.refill(now)
                delta = admission.estimated_tokens - max(0, actual_tokens)
                state.tokens.level = min(float(state.tokens.capacity), state.tokens.level + delta)
            state.evict_at = now + self._idle_evict_s
            if self._tenants.get(admission.tenant_id) is state:
                self._tenants.move_to_end(admission.tenant_id)

    def _sweep(self, now: float) -> None:
        """Drop idle tenants from the least recently touched end, stopping at the first one not yet due.
        One that is due but can't go (requests in flight, or a bucket still paying back a debt) gets a
        new due time (an idle period, or when its buckets will be full) and moves to the other end, so
        the amortised cost per call stays O(1)."""
        for _ in range(len(self._tenants)):
            tenant_id, state = next(iter(self._tenants.items()))
            if state.evict_at > now:
                return
            if state.evictable(now):
                del self._tenants[tenant_id]
            else:
                wait = self._idle_evict_s if state.in_flight else state.seconds_to_full()
                state.evict_at = now + max(wait, 1.0)
                self._tenants.move_to_end(tenant_id)

    def _make_room(self) -> None:
        """Before adding a tenant at the cap: drop the least recently used ones with nothing in flight."""
        excess = len(self._tenants) - self._max_tenants + 1
        if excess <= 0:
            return
        victims = []
        for tenant_id, state in self._tenants.items():
            if not state.in_flight:
                victims.append(tenant_id)
                if len(victims) == excess:
                    break
        for tenant_id in victims:
            del self._tenants[tenant_id]
