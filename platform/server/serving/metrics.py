"""Prometheus metrics for the server, on a registry of their own (never the process-global one).

Label cardinality is bounded by construction: the only labels are `tier` (the fixed set given to
`ServerMetrics`, anything else counted as "other"), `outcome` (`OUTCOMES`, else "other"), `kind`
(`TOKEN_KINDS`) and `cache_tier` (`CACHE_LEVELS`: the adapter cache levels device, ram, disk, store; "device"
is the engine's adapter memory, once labelled "slot"). In code "tier" means a tenant's tier only; the label
`cache_tier` keeps the name dashboards query, though its values are cache levels. Tenant ids, adapter names and
request ids never become labels: they belong in the logs and the cost ledger. A mixture-of-experts base adds
`layer` and `expert` (`loramux_moe_expert_tokens_total`): numbers fixed by the model (layers x experts series,
e.g. 48 x 128 for Qwen3-30B-A3B), absent for a dense model.

The exceptions, and the only places adapter references appear in a label value, are vLLM's LoRA metrics. First
`vllm:lora_requests_info`: vLLM's gauge of the same name and shape, which LoRA-affinity routers (the Kubernetes
Gateway API Inference Extension, llm-d) scrape to send a request where its adapter already is. It has exactly
one sample per scrape, whatever the adapters: labels `running_lora_adapters` and `waiting_lora_adapters` (comma-joined
references of the adapters with running / waiting requests, "" when none: `ad_<id>@<version>` for registry
adapters, a valid `model` for them, never the tenant-chosen name; the name an operator gave an adapter
loaded straight into the engine) and `max_lora` (the most distinct
adapters one batch may hold), value the current Unix time, as vLLM sets it. So the exposition never grows
with the number of adapters or tenants (a Prometheus server storing it sees a new series whenever the set
of names changes, as it does for vLLM; routers read only the latest sample).

Then `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}` (vllm_metrics.py, with the other vLLM names the
Kubernetes routers read: queue, batch, KV-cache use, cache config, max adapters, device load times): one series per
adapter per cache level it is held at (device, host RAM, disk), named by the same references. It grows with the
adapters held only, which the levels' byte budgets bound (not with the adapters registered, tenants or requests),
and a series goes when its adapter leaves that level. `level` and `pinned` take fixed values; `rank` the few LoRA
ranks served.

Budgets are the last exception: `loramux_budget_limit_usd`, `loramux_budget_spent_usd` and
`loramux_budget_reserved_usd` (labels `tenant` (id), `scope`, `subject`: a key id, end user or tag, "" for a
tenant's own budget) have one series per budget, so they grow with the budgets operators set, and they name
tenants' users and tags: the server gives them a source (`set_budget_source`) only when /metrics is behind a
metrics key, and without a source they are not in the exposition at all.

Request-level numbers are pushed by the server (`observe_finished`, `observe_inter_token`,
`count_rejected`); engine and adapter-cache state is pulled at scrape time from a callable
(`set_state_source`), so gauges are always current and the hot path does no extra work for them.
Recording never raises: a metric must not fail a request.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from loramux.engine.speculation.policy import METHODS
from loramux.server.serving.metric_values import count as _count
from loramux.server.serving.metric_values import histogram as _histogram
from loramux.server.serving.metric_values import names as _names
from loramux.server.serving.metric_values import seconds as _seconds
from loramux.server.serving.vllm_metrics import vllm_families

if TYPE_CHECKING:
    from loramux.billing.budgets import BudgetStatus

log = logging.getLogger(__name__)

OTHER = "other"
OUTCOMES: tuple[str, ...] = ("stop", "length", "timeout", "cancelled", "error", "rejected", "rate_limited",
                             "budget_exceeded")
TOKEN_KINDS: tuple[str, ...] = ("prompt", "cached", "completion")
CACHE_LEVELS: tuple[str, ...] = ("device", "ram", "disk", "store")
_OUTCOME_LABELS: dict[str, str] = {o: o for o in OUTCOMES}  # canonical plain str, also for str enums
# cache_tier label -> key in state["adapter_cache"]; the device level's numbers come from state["lora"].
BYTES_CACHE_LEVELS: dict[str, str] = {"ram": "host_bytes", "disk": "disk_bytes"}
BUDGET_CACHE_LEVELS: dict[str, str] = {"ram": "host_budget_bytes", "disk": "disk_budget_bytes"}
RESIDENT_CACHE_LEVELS: dict[str, str] = {"ram": "host_adapters", "disk": "disk_adapters"}
LOAD_CACHE_LEVELS: tuple[str, ...] = ("disk", "store")  # adapter_cache.load_seconds (host RAM loads)
LORA_INFO = "vllm:lora_requests_info"
LORA_INFO_LABELS: tuple[str, ...] = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")

# Queue wait, time to first token and end-to-end latency: 5 ms .. 120 s.
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                                      20.0, 30.0, 60.0, 120.0)
# Gap between two streamed tokens of one request: 1 ms .. 5 s.
INTER_TOKEN_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
                                          0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


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
        pinned = GaugeMetricFamily("loramux_adapter_slots_pinned",  # published name: running requests lease slots
                                   "Device adapter slots leased by running requests.")
        cache_bytes = GaugeMetricFamily(
            "loramux_adapter_cache_bytes",
            "Bytes held per cache level (ram: adapters, composites and Medusa heads, which share its budget).",
            labels=["cache_tier"])
        budget = GaugeMetricFamily("loramux_adapter_cache_budget_bytes",
                                   "Byte budget of each adapter cache level (device: the device adapter pool).",
                                   labels=["cache_tier"])
        resident = GaugeMetricFamily("loramux_adapters_resident", "Adapter versions held per cache level.",
                                     labels=["cache_tier"])
        loading = GaugeMetricFamily("loramux_adapter_device_loading", "Adapter copies to the device in flight.")
        device_loads = CounterMetricFamily("loramux_adapter_device_loads",
                                           "Adapter copies from host RAM to the device.")
        evictions = CounterMetricFamily("loramux_adapter_device_evictions", "Adapters evicted from the device.")
        load_seconds = HistogramMetricFamily(
            "loramux_adapter_load_seconds",
            "Time to load an adapter into a cache level: device (copy from host RAM), disk or store (into host RAM "
            "from the local disk cache or the object store).", labels=["cache_tier"])
        lora_info = GaugeMetricFamily(
            LORA_INFO, "Running stats on LoRA requests (vLLM's shape): adapters with running and waiting requests, "
            "max_lora; value: Unix time of the scrape.", labels=list(LORA_INFO_LABELS))
        hits = CounterMetricFamily("loramux_adapter_cache_hits", "Adapter lookups served by each cache level.",
                                   labels=["cache_tier"])
        misses = CounterMetricFamily(
            "loramux_adapter_cache_misses",
            "Adapter lookups missing every local cache level (downloads from the object store).")
        failures = CounterMetricFamily("loramux_adapter_load_failures", "Adapter loads that failed.")
        replica_running = GaugeMetricFamily("loramux_replica_running_requests",
                                            "Requests in each engine replica's running batch (scale-out).",
                                            labels=["replica"])
        replica_adapters = GaugeMetricFamily(
            "loramux_replica_adapters_resident", "Adapter versions on each engine replica's device (scale-out); the "
            "`adapters` label lists their digests' first 12 characters, comma-joined (/admin/replicas has names).",
            labels=["replica", "adapters"])

        for family, key in ((queue, "waiting"), (running, "running"), (pinned, "adapter_slots_pinned")):
            value = _count(state.get(key))
            if value is not None:
                family.add_metric([], value)

        used, total = _count(state.get("kv_blocks_used")), _count(state.get("kv_blocks_total"))
        if used is not None and total:
            kv.add_metric([], min(1.0, used / total))

        replicas = state.get("replicas")
        if isinstance(replicas, Mapping):
            for replica_id, snap in sorted(replicas.items()):
                if not isinstance(snap, Mapping):
                    continue
                running_now = _count((snap.get("stats") or {}).get("running"))
                if running_now is not None:
                    replica_running.add_metric([str(replica_id)], running_now)
                held = sorted(d for d, where in (snap.get("residency") or {}).items() if where == "device")
                replica_adapters.add_metric([str(replica_id), ",".join(d[:12] for d in held)], len(held))

        lora = state.get("lora")
        if isinstance(lora, Mapping):
            max_lora = _count(lora.get("max_lora"))
            lora_info.add_metric([_names(lora.get("running")), _names(lora.get("waiting")),
                                  str(int(max_lora)) if max_lora is not None else "0"], time.time())
            for family, key in ((resident, "device_adapters"), (cache_bytes, "device_bytes"),
                                (budget, "device_budget_bytes")):
                value = _count(lora.get(key))
                if value is not None:
                    family.add_metric(["device"], value)
            for family, key in ((loading, "loading"), (device_loads, "loads"), (evictions, "evictions")):
                value = _count(lora.get(key))
                if value is not None:
                    family.add_metric([], value)
            hist = _histogram(lora.get("load_seconds"))
            if hist is not None:
                load_seconds.add_metric(["device"], hist[0], hist[1])

        cache = state.get("adapter_cache")
        if isinstance(cache, Mapping):
            for family, keys in ((cache_bytes, BYTES_CACHE_LEVELS), (budget, BUDGET_CACHE_LEVELS),
                                 (resident, RESIDENT_CACHE_LEVELS)):
                for label, key in keys.items():
                    value = _count(cache.get(key))
                    if value is not None:
                        family.add_metric([label], value)
            loads = cache.get("load_seconds")
            if isinstance(loads, Mapping):
                for label in LOAD_CACHE_LEVELS:
                    hist = _histogram(loads.get(label))
                    if hist is not None:
                        load_seconds.add_metric([label], hist[0], hist[1])
            level_hits = cache.get("hits")
            if isinstance(level_hits, Mapping):
                for label in CACHE_LEVELS:  # unknown levels are left out: the label set stays fixed
                    value = _count(level_hits.get(label))
                    if value is not None:
                        hits.add_metric([label], value)
            for family, key in ((misses, "downloads"), (failures, "load_failures")):
                value = _count(cache.get(key))
                if value is not None:
                    family.add_metric([], value)
        return [queue, running, kv, pinned, cache_bytes, budget, resident, hits, misses, failures, loading,
                device_loads, evictions, load_seconds, lora_info, replica_running, replica_adapters,
                *_step_families(state.get("steps")), *_speculation_families(state.get("speculation")),
                *_fair_share_families(state.get("fair_share")), _expert_family(state.get("moe_expert_tokens")),
                *vllm_families(state)]


def _expert_family(rows) -> Metric:
    """(token, expert) routing pairs per layer and expert of a mixture-of-experts model (routing skew shows as
    uneven rates across a layer's experts); no samples for a dense model, whose `moe_expert_tokens` is []."""
    family = CounterMetricFamily("loramux_moe_expert_tokens",
                                 "(token, expert) routing pairs of a mixture-of-experts model, per layer and expert.",
                                 labels=["layer", "expert"])
    if not isinstance(rows, (list, tuple)):
        return family
    for layer, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            continue
        for expert, n in enumerate(row):
            value = _count(n)
            if value is not None:
                family.add_metric([str(layer), str(expert)], value)
    return family


def _fair_share_families(shares) -> list[Metric]:
    """Each tenant's virtual token counter (fair share within its tier) and the weighted tokens it was served
    (its service rate is this counter's rate)."""
    counter = GaugeMetricFamily("loramux_fair_share_counter",
                                "Virtual token counter of each tenant (fair share within a tier; lifted on rejoin).",
                                labels=["tenant"])
    service = CounterMetricFamily("loramux_fair_share_service_tokens",
                                  "Weighted tokens served to each tenant (input and output weights, tier weight).",
                                  labels=["tenant"])
    if isinstance(shares, Mapping):
        for tenant, share in shares.items():
            if not isinstance(share, Mapping):
                continue
            for family, key in ((counter, "counter"), (service, "service")):
                value = share.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                    family.add_metric([str(tenant) or "-"], float(value))
    return [counter, service]


def _speculation_families(spec) -> list[Metric]:
    """Draft tokens proposed and accepted per speculative method (ngram, medusa, draft), and verifications."""
    proposed = CounterMetricFamily("loramux_spec_proposed_tokens", "Draft tokens proposed, per speculative method.",
                                   labels=["method"])
    accepted = CounterMetricFamily("loramux_spec_accepted_tokens", "Draft tokens accepted, per speculative method.",
                                   labels=["method"])
    verifications = CounterMetricFamily("loramux_spec_verifications", "Drafts verified, per speculative method.",
                                        labels=["method"])
    if isinstance(spec, Mapping):
        for method in METHODS:  # a fixed label set, whatever the source holds
            counts = spec.get(method)
            if not isinstance(counts, Mapping):
                continue
            for family, key in ((proposed, "proposed"), (accepted, "accepted"), (verifications, "verifications")):
                value = _count(counts.get(key))
                if value is not None:
                    family.add_metric([str(method)], value)
    return [proposed, accepted, verifications]


def _step_families(steps) -> list[Metric]:
    """The engine's steps (StepBudget.stats()): how long they take and what they carry, so stalls show."""
    seconds = HistogramMetricFamily("loramux_step_seconds", "Wall time of one engine step (schedule to tokens).")
    tokens = HistogramMetricFamily("loramux_step_tokens", "Tokens computed in one engine step (prefill + decode).")
    prefill = HistogramMetricFamily("loramux_step_prefill_tokens", "Prompt tokens computed in one engine step.")
    delayed = GaugeMetricFamily("loramux_decodes_delayed_by_prefill",
                                "Decode streams that shared the last step with prefill work.")
    delayed_total = CounterMetricFamily("loramux_decode_tokens_delayed_by_prefill",
                                        "Decode tokens produced in steps that also carried prefill work.")
    families = [seconds, tokens, prefill, delayed, delayed_total]
    if not isinstance(steps, Mapping):
        return families
    for family, key in ((seconds, "step_seconds"), (tokens, "step_tokens"), (prefill, "step_prefill_tokens")):
        hist = _histogram(steps.get(key))
        if hist is not None:
            family.add_metric([], hist[0], hist[1])
    for family, key in ((delayed, "decodes_delayed_by_prefill"), (delayed_total, "decodes_delayed_by_prefill_total")):
        value = _count(steps.get(key))
        if value is not None:
            family.add_metric([], value)
    return families


BUDGET_LABELS: tuple[str, ...] = ("tenant", "scope", "subject")
BUDGET_CACHE_S = 5.0


class _BudgetCollector(Collector):
    """Every budget's limit, spent and reserved USD, read from a callable at most once per `ttl_s` (a scrape in
    between gets the last read); nothing at all without a source, or while the last read failed."""

    def __init__(self):
        self._fn: Callable[[], Sequence[BudgetStatus]] | None = None
        self._ttl_s = BUDGET_CACHE_S
        self._clock: Callable[[], float] = time.monotonic
        self._read_at: float | None = None
        self._statuses: list[BudgetStatus] | None = None
        self._lock = threading.Lock()

    def set_source(self, fn: Callable[[], Sequence[BudgetStatus]] | None, ttl_s: float,
                   clock: Callable[[], float]) -> None:
        with self._lock:
            self._fn, self._ttl_s, self._clock = fn, ttl_s, clock
            self._read_at = self._statuses = None

    def refresh(self) -> None:
        """Read the budgets when the last read is older than `ttl_s`; a blocking call (one query). When another
        thread is reading them already, return at once: this scrape gets the last read."""
        if self._fn is None or not self._lock.acquire(blocking=False):
            return
        try:
            fn = self._fn
            if fn is None or (self._read_at is not None and self._clock() - self._read_at < self._ttl_s):
                return
            try:
                statuses: list[BudgetStatus] | None = list(fn())
            except Exception:  # a database outage must not fail /metrics: these gauges sit this one out
                log.exception("reading budgets for /metrics failed; budget gauges left out until the next read")
                statuses = None
            self._statuses, self._read_at = statuses, self._clock()
        finally:
            self._lock.release()

    def describe(self) -> Iterator[Metric]:
        return iter(self._families([]))

    def collect(self) -> Iterator[Metric]:
        self.refresh()
        statuses = self._statuses if self._fn is not None else None
        if not statuses:
            return iter([])
        return iter(self._families(statuses))

    @staticmethod
    def _families(statuses: Sequence[BudgetStatus]) -> list[Metric]:
        limit = GaugeMetricFamily("loramux_budget_limit_usd", "Each budget's limit in USD per period.",
                                  labels=list(BUDGET_LABELS))
        spent = GaugeMetricFamily("loramux_budget_spent_usd",
                                  "Each budget's ledger spend in its current period, in USD.",
                                  labels=list(BUDGET_LABELS))
        reserved = GaugeMetricFamily("loramux_budget_reserved_usd",
                                     "Worst-case cost of each budget's requests in flight, in USD.",
                                     labels=list(BUDGET_LABELS))
        for status in statuses:
            b = status.budget
            labels = [b.tenant_id, b.scope, b.subject or ""]
            for family, value in ((limit, b.limit_usd), (spent, status.spent), (reserved, status.reserved)):
                family.add_metric(labels, float(value))
        return [limit, spent, reserved]


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

        self._unbilled = Counter("loramux_unbilled_requests_total",
                                 "Finished requests whose ledger record was refused or could not be stored: each "
                                 "was answered with a server error, never a 200.", registry=r)
        self._unbilled.inc(0)

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
        self._budgets = _BudgetCollector()
        r.register(self._budgets)

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

    def count_unbilled(self) -> None:
        """Count a finished request whose ledger record was refused or lost (its answer became a 500)."""
        try:
            self._unbilled.inc()
        except Exception:  # pragma: no cover
            log.exception("recording unbilled-request metrics failed")

    def set_state_source(self, fn: Callable[[], dict] | None) -> None:
        """Read engine/cache state from `fn()` at each scrape (replaces any earlier source; None removes it).

        Keys used: waiting, running, kv_blocks_used, kv_blocks_total, adapter_slots_pinned (if present),
        lora = {running, waiting (adapter names), max_lora, device_adapters, device_bytes, device_budget_bytes,
        loading, loads, evictions, load_seconds (a DurationHistogram snapshot)} and adapter_cache = {hits:
        {ram, disk, store}, downloads, load_failures, host_bytes, host_budget_bytes, host_adapters, disk_bytes,
        disk_budget_bytes, disk_adapters, load_seconds: {disk, store}}, moe_expert_tokens (per layer, a list of
        counts per expert: `loramux_moe_expert_tokens_total`); for the vLLM-named metrics (vllm_metrics.py) also
        kv_block_size, prefix_caching, lora.adapters ([{name, digest, rank, state, ...}]), adapter_cache.resident
        ([{digest, name, rank, level}]), pinned (digests pinned in host RAM) and, on Ray, replicas. Missing or
        non-numeric values are left
        out (`vllm:lora_requests_info` is there whenever `lora` is); if `fn` raises, the error is logged,
        `loramux_state_source_errors_total` goes up and the rest of the scrape is served.
        """
        self._state.set_source(fn)

    def set_budget_source(self, fn: Callable[[], Sequence[BudgetStatus]] | None, ttl_s: float = BUDGET_CACHE_S,
                          clock: Callable[[], float] = time.monotonic) -> None:
        """Export every budget from `fn()` (e.g. `BudgetBook.statuses`, `BudgetStatus`es) as
        `loramux_budget_{limit,spent,reserved}_usd`, read at most once per `ttl_s` seconds of `clock`. Set it only
        when /metrics needs a key: the labels name tenants' end users and tags. None removes the gauges. If `fn`
        raises, the error is logged and the gauges are left out until the next read (`ttl_s` later)."""
        self._budgets.set_source(fn, ttl_s, clock)

    def refresh_budgets(self) -> None:
        """Read the budgets now if the last read is older than the source's `ttl_s`: a blocking database query,
        for the server to run off its event loop before `render()` (which then only reads the cache)."""
        self._budgets.refresh()

    # -- exposition ------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition of this registry."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
