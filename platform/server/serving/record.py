"""A request's end: what it held given back, its metrics observed, and its record (one per part for a fan-out)
handed to the ledger hooks. The answer waits for the ledger's futures (durability), so an answered request
always has its rows."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from loramux.adapters.residency.cache_levels import AdapterCache
from loramux.adapters.storage.registry import AdapterVersionInfo
from loramux.billing.usage import RequestRecord
from loramux.db.models import utcnow
from loramux.server.serving.running import LOST, Running, combined_outcome
from loramux.tenancy.rate_limits import Admission

if TYPE_CHECKING:
    from loramux.server.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)


def finish(running: Running, outcome: str, admission: Admission | None, adapter_cache: AdapterCache,
           metrics: ServerMetrics, ledger_hooks: list[Callable[[RequestRecord], object]], model_id: str
           ) -> list[Future]:
    """Release `admission` with the tokens used and the adapter leases, record the metrics and hand the
    request's RequestRecords to `ledger_hooks` (one; one per part for a fan-out); returns the futures hooks
    returned (the ledger's durability).

    With several choices the prompt counts once (the siblings reuse choice 0's KV blocks), its cached
    tokens are choice 0's (what the shared prompt found in the prefix cache), completion tokens add up
    over the choices, and queue / TTFT are choice 0's, the total the longest choice's. A fan-out's part i
    gets its own row (`part` = i, the same request id): the prompt (each adapter computes it), its own cached
    and completion tokens, timings and outcome (its finish reason if it finished, else the request's)."""
    outs = [o for o in running.lasts if o is not None]
    completion = sum(len(o.token_ids) for o in outs)
    first = running.lasts[0]
    prompt, cached = running.billed_prompt_tokens, running.cached_tokens
    if admission is not None:
        admission.release(prompt + completion)
    for lease in running.leases():
        adapter_cache.release(lease.adapter.digest)
    timings = first.timings if first is not None and first.finished else {}
    totals = [o.timings["total_ms"] for o in outs if o.finished and o.timings.get("total_ms")]
    elapsed_ms = (time.monotonic() - running.arrival) * 1000
    total_ms = max(totals) if len(totals) == len(running.lasts) else elapsed_ms
    queue_ms, ttft_ms = timings.get("queue_ms"), timings.get("ttft_ms")
    metrics.observe_finished(
        tier=running.tenant.tier.name, outcome=outcome, queue_s=None if queue_ms is None else queue_ms / 1000,
        ttft_s=None if ttft_ms is None else ttft_ms / 1000, e2e_s=total_ms / 1000,
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)
    for gap in running.inter_token_s:
        metrics.observe_inter_token(gap, running.tenant.tier.name)
    if outcome == LOST:  # the client got a retriable 503 for it: its retry is what gets billed
        log.warning("request %s lost with its engine; not billed", running.request_id)
        if running.spend is not None:
            running.spend.release()
        return []
    # Billed at the price in force when the request arrived: its wall-clock arrival time.
    created_at = running.spend.arrived_at if running.spend is not None and running.spend.arrived_at else \
        utcnow() - timedelta(seconds=time.monotonic() - running.arrival)
    if running.parts:
        records = [_part_record(running, i, outcome, model_id, created_at, elapsed_ms)
                   for i in range(len(running.parts))]
    else:
        records = [_record(running, model_id, created_at, version=running.version, requested=running.requested,
                           fallback=running.fallback_reason is not None, outcome=outcome,
                           prompt_tokens=running.prompt_tokens, cached_tokens=cached, completion_tokens=completion,
                           queue_ms=queue_ms, ttft_ms=ttft_ms, total_ms=total_ms, replica=running.replica,
                           composition=running.composition.ledger() if running.composition is not None else None,
                           tags=running.tags or None)]
    if running.spend is not None:
        running.spend.settle(records)
    billing = _submit(records, ledger_hooks, metrics, running.request_id)
    if running.spend is not None:
        running.spend.watch(billing)
    return billing


def _submit(records: list[RequestRecord], ledger_hooks: list[Callable[[RequestRecord], object]],
            metrics: ServerMetrics, request_id: str) -> list[Future]:
    """Hand each record to every hook; the futures hooks return (the ledger's durability)."""
    billing = []
    for record in records:
        for hook in ledger_hooks:
            try:
                result = hook(record)
            except Exception:  # a ledger problem must never fail or hang the request path
                log.exception("ledger hook failed for request %s", request_id)
                continue
            if isinstance(result, Future):
                result.add_done_callback(lambda done: _count_if_unbilled(done, metrics))
                billing.append(result)
    return billing


def _record(running: Running, model_id: str, created_at: datetime, *, version: AdapterVersionInfo | None,
            part: int = 0, **fields) -> RequestRecord:
    """A ledger record of `running` served by `version` (None = the base model), with the other `fields`."""
    return RequestRecord(
        request_id=running.request_id, tenant_id=running.tenant.tenant_id, key_id=running.tenant.key_id,
        tier=running.tenant.tier.name, model=model_id, adapter_id=version.adapter_id if version else None,
        adapter_version=version.version if version else None, adapter_digest=version.digest if version else None,
        end_user=running.user, created_at=created_at, part=part, **fields)


def _part_record(running: Running, index: int, outcome: str, model_id: str, created_at: datetime,
                 elapsed_ms: float) -> RequestRecord:
    """Fan-out part `index`'s own row (see `finish`)."""
    part, out = running.parts[index], running.lasts[index]
    finished = out is not None and out.finished
    timings = out.timings if out is not None and finished else {}
    return _record(running, model_id, created_at, version=part.version, part=index, requested=part.requested,
                   fallback=part.fallback_reason is not None,
                   outcome=combined_outcome([out.finish_reason]) if out is not None and finished else outcome,
                   prompt_tokens=running.prompt_tokens, cached_tokens=out.num_cached_tokens if out else 0,
                   completion_tokens=len(out.token_ids) if out else 0, queue_ms=timings.get("queue_ms"),
                   ttft_ms=timings.get("ttft_ms"), total_ms=timings.get("total_ms") or elapsed_ms,
                   replica=out.replica if out else None, tags=running.tags or None)


def _count_if_unbilled(future: Future, metrics: ServerMetrics) -> None:
    """A ledger future resolved: count the request when its record was refused or lost (its answer is then a
    500, see `Running._billed`)."""
    if future.exception() is not None or future.result() is not True:
        metrics.count_unbilled()
