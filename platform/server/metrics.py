"""Prometheus metrics for the server, on a registry of their own (never the process-global one).

Label cardinality is bounded by construction: the only labels are `tier` (the fixed set given to
`ServerMetrics`, anything else counted as "other"), `outcome` (`OUTCOMES`, else "other"), `kind`
(`TOKEN_KINDS`) and `cache_tier` (`CACHE_TIERS`). Tenant ids, adapter names and request ids never
become labels: they belong in the logs and the cost ledger.

Request-level numbers are pushed by the server (`observe_finished`, `observe_inter_token`,
`count_rejected`); engine and adapter-cache state is pulled at scrape time from a callable
(`set_state_source`), so gauges are always current and the hot path does no extra work for them.
Recording never raises: a metric must not fail a request.
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

OTHER = "other"
OUTCOMES: tuple[str, ...] = ("stop", "length", "timeout", "cancelled", "error", "rejected", "rate_limited")
TOKEN_KINDS: tuple[str, ...] = ("prompt", "cached", "completion")
CACHE_TIERS: tuple[str, ...] = ("ram", "disk", "store", "slot")
_OUTCOME_LABELS: dict[str, str] = {o: o for o in OUTCOMES}  # canonical plain str, also for str enums
BYTES_CACHE_TIERS: dict[str, str] = {"ram": "host_bytes", "disk": "disk_bytes"}  # label -> state key

# Queue wait, time to first token and end-to-end latency: 5 ms .. 120 s.
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                      20.0, 30.0, 60.0, 120.0)
# Gap between two streamed tokens of one request: 1 ms .. 5 s.
INTER_TOKEN_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                                          0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


def _finite(value) -> float | None:
    """`value` as a finite float, or None (missing, a bool, not a number, NaN or infinite)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _seconds(value: float | None) -> float | None:
    """A duration fit to observe, or None; negatives -> 0."""
    value = _finite(value)
    return None if value is None else max(0.0, value)


def _count(value) -> float | None:
    """A non-negative finite number (counter increment or state value), or None."""
    value = _finite(value)
    return None if value is None or value < 0 else value


class _StateCollector(Collector):
    """Reads the engine/cache state from a callable at scrape time and yields gauge/counter families."""

    def __init__(self):
        self._fn: Callable[[], dict] | None = None
        self._errors = 0
        self._lock = threading.Lock()

    def set_source(self, fn: Callable[[], dict] | None) -> None:
        self._fn = fn

    def describe(self) -> Iterator[Metric]:
        # Names only (for the registry's clash check); fn is not called at registration.
        return iter([*self._families({}), self._errors_family(0)])

    def collect(self) -> Iterator[Metric]:
        families = self._read()
        with self._lock:
            errors = self._errors
        return iter([*families, self._errors_family(errors)])

    def _read(self) -> list[Metric]:
        fn = self._fn
        if fn is None:
            return []
        try:
            state = fn()
            if not isinstance(state, Mapping):
                raise TypeError(f"state source returned {type(state).__name__}, not a dict")
            families = self._families(state)
        except Exception:  # never break the scrape: log, count, serve the rest
            log.exception("metrics state source failed; engine and cache gauges left out of this scrape")
            with self._lock:
                self._errors += 1
            return []
        return [family for family in families if family.samples]

    @staticmethod
    def _errors_family(errors: int) -> Metric:
        family = CounterMetricFamily("loramux_state_source_errors",
                                     "Scrapes where reading the engine/cache state failed.")
        family.add_metric([], errors)
        return family

    @staticmethod
    def _families(state: Mapping) -> list[Metric]:
        queue = GaugeMetricFamily("loramux_queue_depth", "Requests waiting to be scheduled.")
        running = GaugeMetricFamily("loramux_running_requests", "Requests in the running batch.")
        kv = GaugeMetricFamily("loramux_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).")
        pinned = GaugeMetricFamily("loramux_adapter_slots_pinned",
                                   "Device adapter slots pinned by scheduled requests.")
        cache_bytes = GaugeMetricFamily("loramux_adapter_cache_bytes", "Bytes of adapter weights held per cache tier.",
                                        labels=["cache_tier"])
        hits = CounterMetricFamily("loramux_adapter_cache_hits", "Adapter lookups served by each cache tier.",
                                   labels=["cache_tier"])
        misses = CounterMetricFamily("loramux_adapter_cache_misses",
                                     "Adapter lookups missing every local tier (downloads from the object store).")
        failures = CounterMetricFamily("loramux_adapter_load_failures", "Adapter loads that failed.")

        for family, key in ((queue, "waiting"), (running, "running"), (pinned, "adapter_slots_pinned")):
            value = _count(state.get(key))
            if value is not None:
                family.add_metric([], value)

        used, total = _count(state.get("kv_blocks_used")), _count(state.get("kv_blocks_total"))
        if used is not None and total:
            kv.add_metric([], min(1.0, used / total))

        cache = state.get("adapter_cache")
        if isinstance(cache, Mapping):
            for label, key in BYTES_CACHE_TIERS.items():
                value = _count(cache.get(key))
                if value is not None:
                    cache_bytes.add_metric([label], value)
            tier_hits = cache.get("hits")
            if isinstance(tier_hits, Mapping):
                for label in CACHE_TIERS:  # unknown tiers are left out: the label set stays fixed
                    value = _count(tier_hits.get(label))
                    if value is not None:
                        hits.add_metric([label], value)
            for family, key in ((misses, "downloads"), (failures, "load_failures")):
                value = _count(cache.get(key))
                if value is not None:
                    family.add_metric([], value)
        return [queue, running, kv, pinned, cache_bytes, hits, misses, failures]


class ServerMetrics:
    """All server metrics on one private `CollectorRegistry`; `render()` gives the /metrics response."""

    def __init__(self, tiers: Iterable[str] = ("free", "standard", "premium")):
        if isinstance(tiers, str):
            raise TypeError("tiers must be an iterable of tier names, not one string")
        names = list(dict.fromkeys(str(t) for t in tiers))
        if not names or any(not t for t in names):
            raise ValueError(f"tiers must be non-empty names, got {names!r}")
        self._tiers: dict[str, str] = {t: t for t in names}
        self.tiers: tuple[str, ...] = tuple(names)
        self.registry = CollectorRegistry()
        r = self.registry

        self._queue = Histogram("loramux_queue_seconds", "Time from arrival to first scheduling.",
                                ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self._ttft = Histogram("loramux_ttft_seconds", "Time from arrival to the first generated token.",
                               ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("loramux_e2e_seconds", "Time from arrival to the end of the request.",
                              ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("loramux_inter_token_seconds", "Time between two streamed tokens of one request.",
                              ["tier"], buckets=INTER_TOKEN_BUCKETS, registry=r)
        self._requests = Counter("loramux_requests_total", "Requests by tier and outcome (finished or refused).",
                                 ["tier", "outcome"], registry=r)
        self._tokens = Counter("loramux_tokens_total",
                               "Tokens processed: prompt, cached (prompt tokens served from cache), completion.",
                               ["kind"], registry=r)

        # Pre-create every series so rates and dashboards see zeros instead of gaps.
        label_tiers = (*self.tiers, OTHER) if OTHER not in self._tiers else self.tiers
        for tier in label_tiers:
            for hist in (self._queue, self._ttft, self._e2e, self._itl):
                hist.labels(tier=tier)
            for outcome in (*OUTCOMES, OTHER):
                self._requests.labels(tier=tier, outcome=outcome)
        for kind in TOKEN_KINDS:
            self._tokens.labels(kind=kind)

        self._state = _StateCollector()
        r.register(self._state)

    # -- label normalisation -------------------------------------------------------------------
    def tier_label(self, tier: object) -> str:
        """`tier` if it is one of the configured tiers, else "other"."""
        if isinstance(tier, str):
            return self._tiers.get(tier, OTHER)
        return OTHER

    @staticmethod
    def outcome_label(outcome: object) -> str:
        """`outcome` if it is one of `OUTCOMES`, else "other"."""
        if isinstance(outcome, str):
            return _OUTCOME_LABELS.get(outcome, OTHER)
        return OTHER

    # -- recording (never raises) ----------------------------------------------------------------
    def observe_finished(self, *, tier: str, outcome: str, queue_s: float | None, ttft_s: float | None,
                         e2e_s: float, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> None:
        """Record one finished request: latencies (None = not reached, skipped), outcome and token counts."""
        try:
            t = self.tier_label(tier)
            self._requests.labels(tier=t, outcome=self.outcome_label(outcome)).inc()
            for hist, value in ((self._queue, queue_s), (self._ttft, ttft_s), (self._e2e, e2e_s)):
                seconds = _seconds(value)
                if seconds is not None:
                    hist.labels(tier=t).observe(seconds)
            for kind, value in (("prompt", prompt_tokens), ("cached", cached_tokens),
                                ("completion", completion_tokens)):
                n = _count(value)
                if n:
                    self._tokens.labels(kind=kind).inc(n)
        except Exception:  # pragma: no cover - defensive: metrics must not fail a request
            log.exception("recording request metrics failed")

    def observe_inter_token(self, seconds: float, tier: str) -> None:
        """Record the gap between two streamed tokens of one request."""
        try:
            value = _seconds(seconds)
            if value is not None:
                self._itl.labels(tier=self.tier_label(tier)).observe(value)
        except Exception:  # pragma: no cover
            log.exception("recording inter-token metrics failed")

    def count_rejected(self, tier: str, outcome: str) -> None:
        """Count a request refused before it ran (rate limited, overloaded, invalid...)."""
        try:
            self._requests.labels(tier=self.tier_label(tier), outcome=self.outcome_label(outcome)).inc()
        except Exception:  # pragma: no cover
            log.exception("recording rejected-request metrics failed")

    def set_state_source(self, fn: Callable[[], dict] | None) -> None:
        """Read engine/cache state from `fn()` at each scrape (replaces any earlier source; None removes it).

        Keys used: waiting, running, kv_blocks_used, kv_blocks_total, adapter_slots_pinned and
        adapter_cache = {hits: {ram, disk, store, slot}, downloads, load_failures, host_bytes,
        disk_bytes}. Missing or non-numeric values are left out; if `fn` raises, the error is logged,
        `loramux_state_source_errors_total` goes up and the rest of the scrape is served.
        """
        self._state.set_source(fn)

    # -- exposition ------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition of this registry."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
