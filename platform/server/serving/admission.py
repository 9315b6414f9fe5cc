"""Admission: the checks that cost nothing but a lookup, before any work on a prompt. The timeout within the
tier's maximum (400), the tenant's rate limits and concurrency (429; 400 when a request can never fit; 503
when a shared limiter is down and fails closed), and whether the queue can meet the deadline (503). What an
admission takes is held by `Admitted` until the request runs or is refused."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool

from loramux.server.http.errors import ApiError
from loramux.tenancy.rate_limits import Admission, RateLimited, RateLimiter, RequestTooLarge, TierLimits
from loramux.tenancy.tenants import TenantContext

if TYPE_CHECKING:
    from loramux.engine.client import EngineClient
    from loramux.server.serving.metrics import ServerMetrics


@dataclass
class Admitted:
    """A request past `RequestPipeline.admit`: its timeout and its rate-limit admission, held until
    `RequestPipeline.launch` hands them to the running request or `release` gives them back (a second release
    does nothing)."""

    tenant: TenantContext
    timeout_s: float
    arrival: float
    admission: Admission

    def release(self) -> None:
        self.admission.release(0)  # nothing ran: the tokens taken are refunded


def tier_timeout(tenant: TenantContext, asked: float | None) -> float:
    """The request's timeout: the tier's default, or the one asked for within the tier's maximum (400)."""
    tier = tenant.tier
    if asked is None:
        return tier.default_timeout_s
    if asked > tier.max_timeout_s:
        raise ApiError(400, f"timeout {asked:g} s is above the {tier.max_timeout_s:g} s maximum of tier "
                              f"{tier.name!r}", code="timeout_too_long")
    return asked


async def admit(limiter: RateLimiter, metrics: ServerMetrics, engine: EngineClient, tenant: TenantContext,
                timeout_s: float | None, estimated_tokens: int, arrival: float, slots: int = 1,
                requests: int = 1) -> Admitted:
    """Raise ApiError with nothing held, or return the admission the caller must hand on or give back
    (`Admitted.release`). `slots`: the sequences the request runs (its `n` choices), each counted against
    the tier's concurrency limit. `requests`: what it takes from the requests-per-minute limit (a fan-out:
    one per adapter; more than the limit itself is a 400, more than is left a 429). A limiter that talks to
    another process (Redis) says so with `blocking = True` and is called in the threadpool, never on the event
    loop."""
    timeout = tier_timeout(tenant, timeout_s)
    args = (tenant.tenant_id, tenant.tier.name, TierLimits.of(tenant.tier), estimated_tokens)
    try:
        if getattr(limiter, "blocking", False):
            admission = await run_in_threadpool(limiter.admit, *args, slots=slots, requests=requests)
        else:
            admission = limiter.admit(*args, slots=slots, requests=requests)
    except RateLimited as exc:
        metrics.count_rejected(tenant.tier.name, "rate_limited")
        raise ApiError(429, str(exc), retry_after_s=exc.retry_after_s, code="rate_limit_exceeded") from None
    except RequestTooLarge as exc:
        raise ApiError(400, str(exc), code="request_too_large") from None
    except Exception as exc:
        if type(exc).__name__ != "LimiterUnavailable":  # the shared limiter's "closed" fail mode
            raise
        metrics.count_rejected(tenant.tier.name, "rejected")
        raise ApiError(503, str(exc), retry_after_s=exc.retry_after_s, code="limits_unavailable") from None
    try:
        wait = engine.estimated_queue_wait_s()
        if wait > timeout:
            metrics.count_rejected(tenant.tier.name, "rejected")
            raise ApiError(503, f"the server is saturated: the estimated queue wait of {wait:.1f} s exceeds "
                                  f"this request's {timeout:g} s timeout; retry later",
                             retry_after_s=max(1.0, wait - timeout), code="overloaded")
    except BaseException:
        admission.release(0)
        raise
    return Admitted(tenant, timeout, arrival, admission)
