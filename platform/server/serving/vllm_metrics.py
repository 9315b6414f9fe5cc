"""The engine's state under vLLM's metric names, for the routers that read them (see metrics.py's docstring).

Kubernetes routers (the Gateway API Inference Extension's "model server protocol", llm-d) scrape a model server
for vLLM's names, so loramux exports them beside its own metrics, from the same state (read at scrape time):

* `vllm:num_requests_waiting`, `vllm:num_requests_running` (gauges): the engine's queue and batch.
* `vllm:kv_cache_usage_perc` (gauge, 0..1: KV blocks in use / all blocks, as vLLM v1 counts them: a cached block
  no request holds is free) and the same value under vLLM's older name `vllm:gpu_cache_usage_perc`.
* `vllm:cache_config_info` (gauge, value 1): labels `engine` ("0": one engine per server, as vLLM numbers them),
  `block_size` (tokens per KV block), `num_gpu_blocks` (KV blocks in all) and `enable_prefix_caching`
  ("True" / "False", as vLLM writes it).
* `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}` (gauge, value 1): one series per adapter per
  cache level it is held at (level `device`: resident in the engine's adapter memory, not while its copy is in
  flight; `host`: host RAM; `disk`: the local disk cache), `pinned` "true" when an operator pinned it in host
  RAM (on every level it is held at), `rank` its LoRA rank. `adapter_name` is the reference the engine knows it
  by (`ad_<id>@<version>` for registry adapters: the `model` value a request names it by, the same as in
  `vllm:lora_requests_info`; a composite's or an engine-loaded adapter's own name), never a tenant-chosen name.
  The series grow with the adapters held only, which the levels' byte budgets bound.
* `vllm:max_gpu_lora_adapters` (gauge): the most adapters the device holds at once (`max_lora`).
* `vllm:lora_adapter_load_seconds` (histogram): adapter copies into the device (loramux_adapter_load_seconds's
  device series, under vLLM's name).

On a Ray deployment (`state["replicas"]`, each replica's snapshot) the queue, batch and KV numbers are the sums
the ingress already keeps; the block size, prefix caching and max_lora are the replicas' own when they agree
(max_lora: the smallest otherwise), the load histograms are added up when their buckets agree, and each adapter
is reported once, at the best level any replica holds it at (device, then host RAM, then disk). What a snapshot
lacks is left out.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from loramux.server.serving.metric_values import count, histogram

__all__ = ["CACHE_CONFIG_INFO", "CACHE_CONFIG_LABELS", "LORA_LOADED", "LORA_LOADED_LABELS", "RESIDENCY_LEVELS",
           "vllm_families"]

CACHE_CONFIG_INFO = "vllm:cache_config_info"
CACHE_CONFIG_LABELS: tuple[str, ...] = ("engine", "block_size", "num_gpu_blocks", "enable_prefix_caching")
LORA_LOADED = "vllm:lora_adapter_loaded"
LORA_LOADED_LABELS: tuple[str, ...] = ("adapter_name", "level", "pinned", "rank")
RESIDENCY_LEVELS: tuple[str, ...] = ("device", "host", "disk")  # best first


def vllm_families(state: Mapping) -> list[Metric]:
    """Every vLLM-named family, with the samples `state` (the metrics' state source) supports; with an empty
    state, the families alone (for the registry's name check)."""
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
    running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.")
    kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
    kv_old = GaugeMetricFamily("vllm:gpu_cache_usage_perc",
                               "GPU KV-cache usage. 1 means 100 percent usage (vllm:kv_cache_usage_perc's older name).")
    cache_config = GaugeMetricFamily(CACHE_CONFIG_INFO, "Information of the engine's KV cache configuration.",
                                     labels=list(CACHE_CONFIG_LABELS))
    loaded = GaugeMetricFamily(LORA_LOADED, "LoRA adapters held, one series per adapter and level (device, host, "
                               "disk); value 1.", labels=list(LORA_LOADED_LABELS))
    max_adapters = GaugeMetricFamily("vllm:max_gpu_lora_adapters",
                                     "The most LoRA adapters the device holds at once (max_lora).")
    load_seconds = HistogramMetricFamily("vllm:lora_adapter_load_seconds",
                                         "Time to load a LoRA adapter into device memory.")
    families: list[Metric] = [waiting, running, kv, kv_old, cache_config, loaded, max_adapters, load_seconds]
    if not state:
        return families

    for family, key in ((waiting, "waiting"), (running, "running")):
        value = count(state.get(key))
        if value is not None:
            family.add_metric([], value)
    used, total = count(state.get("kv_blocks_used")), count(state.get("kv_blocks_total"))
    if used is not None and total:
        kv.add_metric([], min(1.0, used / total))
        kv_old.add_metric([], min(1.0, used / total))

    replicas = _replica_stats(state)
    block_size = _agreed(replicas, "kv_block_size") if replicas is not None else state.get("kv_block_size")
    prefix = _agreed(replicas, "prefix_caching") if replicas is not None else state.get("prefix_caching")
    block_size = count(block_size)
    if block_size and total is not None:
        cache_config.add_metric(["0", str(int(block_size)), str(int(total)),
                                 str(prefix) if isinstance(prefix, bool) else "None"], 1.0)

    sources = replicas if replicas is not None else [state]
    loras = [lora for source in sources if isinstance(lora := source.get("lora"), Mapping)]
    limits = [v for lora in loras if (v := count(lora.get("max_lora"))) is not None]
    if limits:
        max_adapters.add_metric([], min(limits))
    hist = _summed([histogram(lora.get("load_seconds")) for lora in loras])
    if hist is not None:
        load_seconds.add_metric([], hist[0], hist[1])

    pinned = state.get("pinned")
    pinned = {d for d in pinned if isinstance(d, str)} if isinstance(pinned, (list, tuple, set, frozenset)) else set()
    if replicas is not None:  # a Ray ingress records pins, but its replicas' host RAM does not hold them (yet)
        pinned = set()
    rows = _ray_residency(state) if replicas is not None else _residency(state)
    for labels in sorted({(name, level, "true" if digest in pinned else "false", rank)
                          for digest, name, rank, level in rows}):
        loaded.add_metric(list(labels), 1.0)
    return families


def _replica_stats(state: Mapping) -> list[Mapping] | None:
    """Each replica's engine stats on a Ray deployment (None on a single-process server)."""
    replicas = state.get("replicas")
    if not isinstance(replicas, Mapping):
        return None
    return [stats for snap in replicas.values()
            if isinstance(snap, Mapping) and isinstance(stats := snap.get("stats"), Mapping)]


def _agreed(stats: list[Mapping], key: str):
    """The replicas' common value of `key`, or None when they lack it or disagree."""
    values = {stats_.get(key) for stats_ in stats if isinstance(stats_.get(key), (int, float, str))}
    return values.pop() if len(values) == 1 else None


def _summed(hists: list[tuple[list[tuple[str, float]], float] | None]
            ) -> tuple[list[tuple[str, float]], float] | None:
    """Histograms with the same buckets added up; None if there are none, or their buckets differ."""
    found = [h for h in hists if h is not None]
    if not found or any([b for b, _ in h[0]] != [b for b, _ in found[0][0]] for h in found):
        return None
    buckets = [(bound, sum(h[0][i][1] for h in found)) for i, (bound, _) in enumerate(found[0][0])]
    return buckets, sum(h[1] for h in found)


Row = tuple[str, str, str, str]  # digest, name, rank (as a label value), level


def _row(item, level: str | None = None) -> Row | None:
    """(digest, name, rank, level) of one listed adapter (`lora.adapters` or `adapter_cache.resident`), or None
    when it lacks a digest, a name or a known level. A device entry counts only once resident."""
    if not isinstance(item, Mapping):
        return None
    digest, name = item.get("digest"), item.get("name")
    level = level if level is not None else item.get("level")
    if level == "device" and item.get("state") != "resident":
        return None
    if not (isinstance(digest, str) and digest and isinstance(name, str) and name and level in RESIDENCY_LEVELS):
        return None
    rank = count(item.get("rank"))
    return digest, name, str(int(rank)) if rank is not None else "", level


def _listed(items, level: str | None = None) -> Iterator[Row]:
    if isinstance(items, (list, tuple)):
        yield from (row for item in items if (row := _row(item, level)) is not None)


def _residency(state: Mapping) -> list[Row]:
    """Single process: the engine's device entries and the adapter cache's host RAM and disk ones."""
    lora, cache = state.get("lora"), state.get("adapter_cache")
    rows = list(_listed(lora.get("adapters"), "device")) if isinstance(lora, Mapping) else []
    if isinstance(cache, Mapping):
        rows += [row for row in _listed(cache.get("resident")) if row[3] != "device"]
    return rows


def _ray_residency(state: Mapping) -> list[Row]:
    """Ray: each adapter once, at the best level a replica holds it at. A replica's `host` list may name bare
    digests: they take the name and rank another row gave them (else they are left out)."""
    rows: list[Row] = []
    bare: list[str] = []  # digests a replica holds in host RAM, named nowhere in its snapshot
    for snap in state["replicas"].values():
        if not isinstance(snap, Mapping):
            continue
        stats = snap.get("stats")
        lora = stats.get("lora") if isinstance(stats, Mapping) else None
        if isinstance(lora, Mapping):
            rows += _listed(lora.get("adapters"), "device")
        host = snap.get("host")
        if isinstance(host, (list, tuple)):
            rows += _listed([h for h in host if isinstance(h, Mapping)], "host")
            bare += [h for h in host if isinstance(h, str) and h]
        cache = snap.get("adapter_cache")
        if isinstance(cache, Mapping):
            rows += [row for row in _listed(cache.get("resident")) if row[3] != "device"]
    rows += _residency({"adapter_cache": state.get("adapter_cache")})  # the ingress's own (none today)
    named = {digest: (name, rank) for digest, name, rank, _ in rows}
    rows += [(digest, *named[digest], "host") for digest in bare if digest in named]
    best: dict[str, Row] = {}
    for row in rows:
        held = best.get(row[0])
        if held is None or RESIDENCY_LEVELS.index(row[3]) < RESIDENCY_LEVELS.index(held[3]):
            best[row[0]] = row
    return list(best.values())
