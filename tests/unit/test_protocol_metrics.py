"""vLLM's metric names, as Kubernetes routers read them (the Gateway API Inference Extension's model server protocol,
llm-d): names, types and labels against the protocol's table; values from fake engine state, single process and
Ray; the residency listings of the device (`AdapterResidency.stats`) and of host RAM and disk (`AdapterCache`)."""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loramux.adapters.residency.locations import AdapterResidency
from loramux.histogram import DurationHistogram
from loramux.server.serving.metrics import ServerMetrics

# From docs/proposals/003-model-server-protocol (gateway-api-inference-extension) and vLLM: name -> (type, the
# labels a router reads). The LoRA residency names are those of vLLM's open PR #54830.
PROTOCOL: dict[str, tuple[str, set[str]]] = {
    "vllm:num_requests_waiting": ("gauge", set()),  # TotalQueuedRequests
    "vllm:num_requests_running": ("gauge", set()),  # TotalRunningRequests
    "vllm:kv_cache_usage_perc": ("gauge", set()),  # KVCacheUtilization
    "vllm:gpu_cache_usage_perc": ("gauge", set()),  # the older name of the same
    "vllm:cache_config_info": ("gauge", {"block_size", "num_gpu_blocks"}),  # BlockSize, NumGPUBlocks
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "vllm:lora_adapter_loaded": ("gauge", {"adapter_name", "level", "pinned", "rank"}),
    "vllm:max_gpu_lora_adapters": ("gauge", set()),
    "vllm:lora_adapter_load_seconds": ("histogram", set()),
}

A, B, C = "a" * 64, "b" * 64, "c" * 64  # digests


def hist(*values: float) -> dict:
    h = DurationHistogram()
    for v in values:
        h.observe(v)
    return h.snapshot()


def device(name: str, digest: str, rank: int = 8, state: str = "resident", running: int = 0) -> dict:
    return {"name": name, "digest": digest, "rank": rank, "state": state, "running": running, "waiting": 0}


def state(**over) -> dict:
    """A single-process server's state: A on the device and in host RAM and on disk, B loading onto the device
    and in host RAM, C on disk only."""
    return {"waiting": 3, "running": 5, "kv_blocks_used": 48, "kv_blocks_total": 64, "kv_block_size": 16,
            "prefix_caching": True,
            "lora": {"running": ["ad_a@1"], "waiting": [], "max_lora": 4, "load_seconds": hist(0.01, 0.02),
                     "adapters": [device("ad_a@1", A, running=1), device("ad_b@2", B, rank=16, state="loading")]},
            "adapter_cache": {"resident": [{"digest": A, "name": "ad_a@1", "rank": 8, "level": "host"},
                                           {"digest": A, "name": "ad_a@1", "rank": 8, "level": "disk"},
                                           {"digest": B, "name": "ad_b@2", "rank": 16, "level": "host"},
                                           {"digest": C, "name": "ad_c@1", "rank": 4, "level": "disk"}]},
            "pinned": [B], **over}


def families(source) -> dict:
    m = ServerMetrics()
    m.set_state_source(source)
    body = m.render()[0].decode()
    return {f.name: f for f in text_string_to_metric_families(body)}


def loaded(found: dict) -> set[tuple[str, str, str, str]]:
    fam = found.get("vllm:lora_adapter_loaded")
    return set() if fam is None else {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"],
                                       s.labels["rank"]) for s in fam.samples}


def value(found: dict, name: str, sample: str | None = None) -> float:
    (v,) = [s.value for s in found[name].samples if s.name == (sample or name)]
    return v


def test_every_protocol_metric_has_its_name_type_and_labels():
    found = families(lambda: state())
    for name, (kind, labels) in PROTOCOL.items():
        assert name in found, name
        assert found[name].type == kind, name
        for s in found[name].samples:
            assert labels <= set(s.labels), (name, s)
            if kind == "gauge":
                assert s.name == name, s  # exposed as named: no _total or other suffix


def test_values_follow_the_engine_state():
    found = families(lambda: state())
    assert value(found, "vllm:num_requests_waiting") == 3
    assert value(found, "vllm:num_requests_running") == 5
    assert value(found, "vllm:kv_cache_usage_perc") == 0.75 == value(found, "vllm:gpu_cache_usage_perc")
    (config,) = found["vllm:cache_config_info"].samples
    assert config.value == 1
    assert config.labels == {"engine": "0", "block_size": "16", "num_gpu_blocks": "64", "enable_prefix_caching": "True"}
    assert value(found, "vllm:max_gpu_lora_adapters") == 4
    assert value(found, "vllm:lora_adapter_load_seconds", "vllm:lora_adapter_load_seconds_count") == 2
    assert value(found, "vllm:lora_adapter_load_seconds", "vllm:lora_adapter_load_seconds_sum") == pytest.approx(0.03)
    # loramux's own names are unchanged beside them
    assert value(found, "loramux_queue_depth") == 3 and value(found, "loramux_kv_cache_usage_ratio") == 0.75


def test_residency_lists_each_level_an_adapter_is_held_at():
    assert loaded(families(lambda: state())) == {
        ("ad_a@1", "device", "false", "8"), ("ad_a@1", "host", "false", "8"), ("ad_a@1", "disk", "false", "8"),
        ("ad_b@2", "host", "true", "16"),  # loading onto the device: not there yet; pinned in host RAM
        ("ad_c@1", "disk", "false", "4")}
    found = families(lambda: state())
    assert all(s.value == 1 for s in found["vllm:lora_adapter_loaded"].samples)


def test_residency_grows_with_held_adapters_only():
    def many(n: int) -> dict:
        rows = [{"digest": f"{i:064x}", "name": f"ad_{i}@1", "rank": 8, "level": "host"} for i in range(n)]
        return state(adapter_cache={"resident": rows}, lora={"max_lora": 4, "adapters": []})

    assert len(loaded(families(lambda: many(3)))) == 3
    assert len(loaded(families(lambda: many(40)))) == 40
    assert loaded(families(lambda: many(0))) == set()


@pytest.mark.parametrize("broken", [
    {"lora": {"adapters": "nope"}},
    {"lora": {"adapters": [None, 3, {"name": "x"}, {"digest": A}, device("", A), {**device("ad_x@1", A), "rank": -1}]}},
    {"adapter_cache": {"resident": [{"digest": A, "name": "ad_a@1", "rank": 8, "level": "moon"},
                                    {"digest": A, "name": "ad_a@1", "rank": 8, "level": "device"}]}},
    {"pinned": "everything"},
    {"kv_block_size": None, "prefix_caching": "yes"},
])
def test_malformed_state_is_left_out_and_never_fails_the_scrape(broken):
    found = families(lambda: {**state(), **broken})
    assert value(found, "loramux_state_source_errors", "loramux_state_source_errors_total") == 0
    rows = loaded(found)
    assert all(name and level in ("device", "host", "disk") for name, level, _, _ in rows)
    if "lora" in broken and isinstance(broken["lora"]["adapters"], list):
        assert ("ad_x@1", "device", "false", "") in rows  # a bad rank leaves the rank label empty, not the row
    if "kv_block_size" in broken:
        assert "vllm:cache_config_info" not in found
    if "pinned" in broken:
        assert {p for _, _, p, _ in rows} == {"false"}


def test_no_state_source_gives_no_protocol_samples():
    m = ServerMetrics()
    names = {f.name for f in text_string_to_metric_families(m.render()[0].decode())}
    assert not names & set(PROTOCOL)


def ray_state(**over) -> dict:
    """Two replicas: r0 holds A on its device and B (a bare digest) in host RAM, r1 holds B on its device and
    A and C in host RAM (C named nowhere: left out)."""
    r0 = {"stats": {"running": 2, "waiting": 1, "kv_block_size": 16, "prefix_caching": True,
                    "lora": {"max_lora": 4, "load_seconds": hist(0.01), "adapters": [device("ad_a@1", A)]}},
          "host": [B]}
    r1 = {"stats": {"running": 1, "waiting": 0, "kv_block_size": 16, "prefix_caching": True,
                    "lora": {"max_lora": 3, "load_seconds": hist(0.02, 0.03),
                             "adapters": [device("ad_b@2", B, rank=16)]}},
          "host": [A, C]}
    return {"running": 3, "waiting": 1, "kv_blocks_used": 10, "kv_blocks_total": 40, "kv_block_size": 32,
            "adapter_cache": {}, "pinned": [A], "replicas": {"r0": r0, "r1": r1, "gone": "not a snapshot"}, **over}


def test_ray_reports_each_adapter_at_its_best_level_across_replicas():
    found = families(lambda: ray_state())
    # The ingress's pins are not the replicas' (their host RAM does not hold them): never "true" on Ray.
    assert loaded(found) == {("ad_a@1", "device", "false", "8"), ("ad_b@2", "device", "false", "16")}
    assert value(found, "vllm:num_requests_running") == 3 and value(found, "vllm:kv_cache_usage_perc") == 0.25
    (config,) = found["vllm:cache_config_info"].samples  # the replicas' block size, not the ingress's sum
    assert config.labels["block_size"] == "16" and config.labels["num_gpu_blocks"] == "40"
    assert value(found, "vllm:max_gpu_lora_adapters") == 3  # the smallest replica's
    assert value(found, "vllm:lora_adapter_load_seconds", "vllm:lora_adapter_load_seconds_count") == 3

    host_only = ray_state()
    host_only["replicas"]["r1"]["stats"]["lora"]["adapters"] = []  # B now in host RAM only, named as replicas
    host_only["replicas"]["r0"]["adapter_cache"] = {  # publish it (EngineReplica.snapshot)
        "resident": [{"digest": B, "name": "ad_b@2", "rank": 16, "level": "host"}]}
    assert loaded(families(lambda: host_only)) == {("ad_a@1", "device", "false", "8"),
                                                   ("ad_b@2", "host", "false", "16")}


def test_ray_replicas_that_disagree_or_lack_keys_are_left_out():
    odd = ray_state()
    odd["replicas"]["r1"]["stats"]["kv_block_size"] = 8
    odd["replicas"]["r1"]["stats"]["lora"]["load_seconds"] = {"buckets": [(1.0, 1), (float("inf"), 1)], "sum": 1}
    del odd["replicas"]["r0"]["host"]
    found = families(lambda: odd)
    assert "vllm:cache_config_info" not in found and "vllm:lora_adapter_load_seconds" not in found
    assert loaded(found) == {("ad_a@1", "device", "false", "8"), ("ad_b@2", "device", "false", "16")}
    found = families(lambda: {"replicas": {}, "pinned": []})
    assert loaded(found) == set() and "vllm:max_gpu_lora_adapters" not in found


# -- the device's listing: AdapterResidency.stats()["adapters"] ----------------------------------------------
@dataclass
class FakeAdapter:
    name: str
    digest: str
    rank: int


class InstantPool:
    """The DevicePool interface, copies done at once; one bucket per rank, 100 bytes per rank."""

    needs_active_prefix = False

    def __init__(self, budget: int):
        self.budget, self.sizes = budget, {}

    @property
    def nbytes(self) -> int:
        return sum(self.slot_bytes(rank) * n for rank, n in self.sizes.items())

    def bucket_of(self, adapter):
        return adapter.rank

    def slot_bytes(self, rank) -> int:
        return rank * 100

    def resize(self, rank, capacity, keep, then=lambda: None):
        self.sizes[rank] = capacity
        then()

    def swap(self, rank, i, j, then=lambda: None):
        then()

    def load(self, rank, slot_of, adapter):
        future = concurrent.futures.Future()
        future.set_result(0.001)
        return future


def test_adapter_residency_lists_placed_adapters_with_their_rank():
    residency = AdapterResidency(InstantPool(budget=10_000), min_residency_s=0.0)
    one, two = FakeAdapter("ad_one@1", A, 8), FakeAdapter("ad_two@3", B, 16)
    for adapter in (one, two):
        residency.add_waiting(adapter)
        assert residency.want(adapter.digest)
    residency.lease(A)
    residency.add_waiting(two)  # a second request on two, still waiting
    listed = residency.stats()["adapters"]
    assert listed == [{"name": "ad_one@1", "digest": A, "rank": 8, "state": "resident", "running": 1, "waiting": 0},
                      {"name": "ad_two@3", "digest": B, "rank": 16, "state": "resident", "running": 0, "waiting": 2}]
    residency.release(A)  # unnamed and unused: the host copy is dropped, the device copy and its rank stay
    assert residency.entries[A].adapter is None
    assert residency.stats()["adapters"][0] == {"name": "ad_one@1", "digest": A, "rank": 8, "state": "resident",
                                                "running": 0, "waiting": 0}


# -- host RAM and disk: AdapterCache.stats()["resident"] ----------------------------------------------------
def test_adapter_cache_lists_what_it_holds_by_reference(tmp_path, tiny_cfg):
    from conftest import adapter_files
    from loramux.adapters.residency.cache_levels import AdapterCache, DiskCache, HostCache
    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Database
    from loramux.testing import write_peft_adapter

    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    store = FileStore(tmp_path / "store")
    registry = AdapterRegistry(db, store, tiny_cfg, "tiny-llama")
    tenant = registry.tenancy.create_tenant("acme")
    versions = [registry.register(tenant.id, f"secret-name-{i}", adapter_files(
        write_peft_adapter(tmp_path / f"src{i}", tiny_cfg, rank, ["q_proj", "v_proj"], seed=i)))
        for i, rank in enumerate((4, 8))]
    one, two = versions
    cache = AdapterCache(store, DiskCache(tmp_path / "disk", 1 << 30), HostCache(1 << 30), max_workers=1)
    ref = {v.digest: f"{v.adapter_id}@{v.version}" for v in versions}
    try:
        assert cache.stats()["resident"] == []
        cache.acquire_blocking(one, timeout=30)
        cache.release(one.digest)
        row = {"digest": one.digest, "name": ref[one.digest], "rank": 4}
        assert cache.stats()["resident"] == [{**row, "level": "host"}, {**row, "level": "disk"}]
        one_bytes = cache.host.nbytes
        cache.acquire_blocking(two, timeout=30)
        cache.host.budget = cache.host.nbytes - one_bytes  # room for two only: one leaves host RAM at the release
        cache.release(two.digest)
        rows = {(r["name"], r["rank"], r["level"]) for r in cache.stats()["resident"]}
        assert rows == {(ref[one.digest], 4, "disk"), (ref[two.digest], 8, "host"), (ref[two.digest], 8, "disk")}
        assert not any("secret-name" in r["name"] for r in cache.stats()["resident"])

        cache.evict(one.digest)  # forgotten everywhere
        assert {r["digest"] for r in cache.stats()["resident"]} == {two.digest}
        assert set(cache._refs) == {two.digest}  # bounded: names only for what the levels hold
    finally:
        cache.shutdown()
        db.dispose()
