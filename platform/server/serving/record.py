"""A request's end: what it held given back, its metrics observed, and its one record handed to the ledger
hooks. The answer waits for the ledger's futures (durability), so an answered request always has its row."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING

from loramux.adapters.cache_levels import AdapterCache
from loramux.db.models import utcnow
from loramux.rate_limits import Admission
from loramux.server.serving.running import LOST, Running
from loramux.usage import RequestRecord

if TYPE_CHECKING:
    from loramux.server.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)


def finish(running: Running, outcome: str, admission: Admission | None, adapter_cache: AdapterCache,
           metrics: ServerMetrics, ledger_hooks: list[Callable[[RequestRecord], object]], model_id: str
           ) -> list[Future]:
    """Release `admission` with the tokens used and the adapter lease, record the metrics and hand the one
    RequestRecord to `ledger_hooks`; returns the futures hooks returned (the ledger's durability).

    With several choices the prompt counts once (the siblings reuse choice 0's KV blocks), its cached
    tokens are choice 0's (what the shared prompt found in the prefix cache), completion tokens add up
    over the choices, and queue / TTFT are choice 0's, the total the longest choice's."""
    outs = [o for o in running.lasts if o is not None]
    completion = sum(len(o.token_ids) for o in outs)
    first = running.lasts[0]
    cached = first.num_cached_tokens if first is not None else 0
    if admission is not None:
        admission.release(running.prompt_tokens + completion)
    if running.lease is not None:
        adapter_cache.release(running.lease.adapter.digest)
    timings = first.timings if first is not None and first.finished else {}
    totals = [o.timings["total_ms"] for o in outs if o.finished and o.timings.get("total_ms")]
    total_ms = max(totals) if len(totals) == len(running.lasts) else (time.monotonic() - running.arrival) * 1000
    queue_ms, ttft_ms = timings.get("queue_ms"), timings.get("ttft_ms")
    metrics.observe_finished(
        tier=running.tenant.tier.name, outcome=outcome, queue_s=None if queue_ms is None else queue_ms / 1000,
        ttft_s=None if ttft_ms is None else ttft_ms / 1000, e2e_s=total_ms / 1000,
        prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion)
    for gap in running.inter_token_s:
        metrics.observe_inter_token(gap, running.tenant.tier.name)
    if outcome == LOST:  # the client got a retriable 503 for it: its retry is what gets billed
        log.warning("request %s lost with its engine; not billed", running.request_id)
        return []
    version = running.version
    record = RequestRecord(
        request_id=running.request_id, tenant_id=running.tenant.tenant_id, key_id=running.tenant.key_id,
        tier=running.tenant.tier.name, model=model_id, adapter_id=version.adapter_id if version else None,
        adapter_version=version.version if version else None, adapter_digest=version.digest if version else None,
        requested=running.requested, fallback=running.fallback_reason is not None, outcome=outcome,
        prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion, queue_ms=queue_ms,
        ttft_ms=ttft_ms, total_ms=total_ms, end_user=running.user, replica=running.replica,
        composition=running.composition.ledger() if running.composition is not None else None,
        # Billed at the price in force when the request arrived: its wall-clock arrival time.
        created_at=utcnow() - timedelta(seconds=time.monotonic() - running.arrival))
    billing = []
    for hook in ledger_hooks:
        try:
            result = hook(record)
        except Exception:  # a ledger problem must never fail or hang the request path
            log.exception("ledger hook failed for request %s", running.request_id)
            continue
        if isinstance(result, Future):
            result.add_done_callback(lambda done: _count_if_unbilled(done, metrics))
            billing.append(result)
    return billing


def _count_if_unbilled(future: Future, metrics: ServerMetrics) -> None:
    """A ledger future resolved: count the request when its record was refused or lost (its answer is then a
    500, see `Running._billed`)."""
    if future.exception() is not None or future.result() is not True:
        metrics.count_unbilled()
