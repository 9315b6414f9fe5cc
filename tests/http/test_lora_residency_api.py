"""Where an adapter is and how much it is used: the request-rate tracker (fake clock), the adapter cache's
residency answers and load timings, and GET /admin/adapters/{id} and /metrics of a live server."""
from __future__ import annotations

import concurrent.futures
import sys
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import adapter_files, serve_admin_stack
from loramux.request_rates import LONG_WINDOW_S, RecentRequests, RequestRates
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-test-residency-key-0123456789abcdefghijklmn"


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the request-rate tracker ------------------------------------------------------------------------------
def test_request_rates_count_the_last_minute_and_five_minutes():
    clock = FakeClock()
    rates = RequestRates(clock=clock)
    assert rates.recent("ad_x") == RecentRequests(0, 0, 0.0)
    assert len(rates) == 0  # reading an unknown id tracks nothing

    for _ in range(3):
        rates.record("ad_a")
    rates.record("ad_b")
    assert rates.recent("ad_a") == RecentRequests(last_60s=3, last_300s=3, per_minute=0.6)
    assert rates.recent("ad_b") == RecentRequests(1, 1, 0.2)

    clock.now += 59.5  # the same 60 s window still (counted per second: this is second 59 after the first)
    rates.record("ad_a")
    assert rates.recent("ad_a").last_60s == 4
    clock.now += 1
    assert rates.recent("ad_a") == RecentRequests(last_60s=1, last_300s=4, per_minute=0.8)
    clock.now += 240  # 300.5 s after the first three: they left both windows
    assert rates.recent("ad_a") == RecentRequests(0, 1, 0.2)
    clock.now += 60
    assert rates.recent("ad_a") == RecentRequests(0, 0, 0.0)
    assert rates.recent("ad_b") == RecentRequests(0, 0, 0.0)


def test_request_rates_memory_is_bounded():
    clock = FakeClock()
    rates = RequestRates(max_adapters=100, clock=clock)
    for i in range(10_000):  # many ids: the least recently recorded are dropped
        rates.record(f"ad_{i}")
    assert len(rates) == 100
    assert rates.recent("ad_0") == RecentRequests(0, 0, 0.0)
    assert rates.recent("ad_9999").last_60s == 1

    rates.record("ad_9900")  # recording again makes it the most recent: the next new id drops ad_9901
    rates.record("ad_new")
    assert rates.recent("ad_9900").last_60s == 2 and rates.recent("ad_9901").last_60s == 0

    busy = RequestRates(clock=clock)
    for _ in range(3 * LONG_WINDOW_S * 10):  # ten requests a second for 15 minutes
        clock.now += 0.1
        busy.record("ad_hot")
    buckets = busy._seconds["ad_hot"]
    assert len(buckets) <= LONG_WINDOW_S  # one (second, count) pair per second of the window, at most
    counts = busy.recent("ad_hot")
    assert 595 <= counts.last_60s <= 600 and 2995 <= counts.last_300s <= 3000
    assert counts.per_minute == pytest.approx(counts.last_300s / 5)

    with pytest.raises(ValueError):
        RequestRates(max_adapters=0)


def test_request_rates_are_thread_safe():
    rates = RequestRates(max_adapters=8, clock=FakeClock())
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        def work(n: int):
            for i in range(2000):
                rates.record(f"ad_{(n + i) % 4}")
                rates.recent(f"ad_{i % 16}")

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert sum(rates.recent(f"ad_{i}").last_60s for i in range(4)) == 8000


# -- the adapter cache: residency answers and load timings --------------------------------------------------
def _registered_version(tmp_path, tiny_cfg, seed: int):
    """A registry on SQLite and a file store holding one adapter version: (database, store, version)."""
    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Database

    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    store = FileStore(tmp_path / "store")
    registry = AdapterRegistry(db, store, tiny_cfg, "tiny-llama")
    tenant = registry.tenancy.create_tenant("acme")
    source = write_peft_adapter(tmp_path / "src", tiny_cfg, 4, ["q_proj", "v_proj"], seed=seed)
    return db, store, registry.register(tenant.id, "bot", adapter_files(source))


def test_adapter_cache_residency_and_load_seconds(tmp_path, tiny_cfg):
    from loramux.adapters.residency.cache_levels import AdapterCache, DiskCache, HostCache

    db, store, version = _registered_version(tmp_path, tiny_cfg, seed=3)
    disk = DiskCache(tmp_path / "disk", 1 << 30)
    cache = AdapterCache(store, disk, HostCache(1 << 30), max_workers=1)
    other = AdapterCache(store, disk, HostCache(1 << 30), max_workers=1)  # a second cache on the same disk
    try:
        stats = cache.stats()
        assert (stats["host_adapters"], stats["disk_adapters"]) == (0, 0)
        assert {t: s["count"] for t, s in stats["load_seconds"].items()} == {"disk": 0, "store": 0}
        assert not cache.has_in_ram(version.digest) and not cache.has_on_disk(version.digest)

        assert cache.acquire_blocking(version, timeout=30).level == "store"
        cache.release(version.digest)
        assert cache.has_in_ram(version.digest) and cache.has_on_disk(version.digest)
        assert other.acquire_blocking(version, timeout=30).level == "disk"
        other.release(version.digest)
        assert cache.acquire_blocking(version, timeout=30).level == "ram"  # RAM hits are not load timings
        cache.release(version.digest)

        stats, other_stats = cache.stats(), other.stats()
        assert (stats["host_adapters"], stats["disk_adapters"]) == (1, 1)
        store_loads = stats["load_seconds"]["store"]
        assert store_loads["count"] == 1 and store_loads["sum"] > 0 and stats["load_seconds"]["disk"]["count"] == 0
        assert store_loads["buckets"][-1] == (float("inf"), 1)
        assert other_stats["load_seconds"]["disk"]["count"] == 1 and other_stats["load_seconds"]["store"]["count"] == 0

        cache.evict(version.digest)
        assert not cache.has_in_ram(version.digest) and not cache.has_on_disk(version.digest)
        assert other.has_in_ram(version.digest)  # the other cache's RAM copy is its own
    finally:
        cache.shutdown()
        other.shutdown()
        db.dispose()


class DoneFirstFuture(concurrent.futures.Future):
    """A future that takes a callback only once it is done: the load has won the race with add_done_callback,
    which then runs the callback at once, in the thread that adds it."""

    def add_done_callback(self, fn):
        concurrent.futures.wait([self], timeout=10)
        super().add_done_callback(fn)


class DoneFirstPool:
    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def submit(self, fn, *args):
        future = DoneFirstFuture()

        def run():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the future's waiters
                future.set_exception(exc)

        self.pool.submit(run)
        return future

    def shutdown(self, **kwargs):
        self.pool.shutdown(**kwargs)


def test_a_load_done_before_its_callback_is_added_does_not_deadlock(tmp_path, tiny_cfg):
    from loramux.adapters.residency.cache_levels import AdapterCache, DiskCache, HostCache

    db, store, version = _registered_version(tmp_path, tiny_cfg, seed=4)
    disk = DiskCache(tmp_path / "disk", 1 << 30)
    disk.put(version.digest, store.get(version.storage_key))  # a disk hit: the load needs no lock of the cache
    cache = AdapterCache(store, disk, HostCache(1 << 30), max_workers=1)
    cache._pool.shutdown()
    cache._pool = DoneFirstPool()
    tiers = []
    worker = threading.Thread(target=lambda: tiers.append(cache.acquire_blocking(version, timeout=5).level),
                              daemon=True)
    try:
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "acquire deadlocked on the cache's own lock"
        assert tiers == ["disk"] and cache.has_in_ram(version.digest) and cache.stats()["load_failures"] == 0
        cache.release(version.digest)
        assert cache.prefetch(version) is None  # in RAM already
    finally:
        cache.shutdown()
        db.dispose()


# -- GET /admin/adapters/{id} and /metrics of a live server --------------------------------------------------
@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    yield from serve_admin_stack(tmp_path_factory.mktemp("residency-api"), tiny_dir, tokenizer, ADMIN_KEY)


def admin(stack) -> httpx.Client:
    return httpx.Client(base_url=stack[0].url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)


def upload(stack, name: str, seed: int) -> dict:
    _, _, cfg, tmp = stack
    directory = write_peft_adapter(tmp / f"{name}-{seed}", cfg, 4, ["q_proj", "v_proj"], seed=seed)
    files = {f: (f, (directory / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
    response = admin(stack).post("/admin/adapters", data={"tenant_id": "acme", "name": name},
                                 files={"adapter_config": files["adapter_config.json"],
                                        "adapter_model": files["adapter_model.safetensors"]})
    assert response.status_code == 201, response.text
    return response.json()


def chat(stack, model: str) -> None:
    server, key, _, _ = stack
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200, response.text


DEVICE = {"device": "resident", "loading": "loading", None: "absent"}  # engine answer -> API answer


def test_adapter_detail_shows_residency_and_recent_requests(stack):
    server = stack[0]
    used, idle = upload(stack, "used-bot", seed=11), upload(stack, "idle-bot", seed=12)
    c = admin(stack)

    cold = c.get(f"/admin/adapters/{used['id']}").json()
    assert cold["residency"] == {"version": 1, "device": "absent", "ram": False, "disk": False, "store": True}
    assert cold["recent_requests"] == {"last_60s": 0, "last_300s": 0, "per_minute": 0.0}

    chat(stack, "used-bot")
    chat(stack, "used-bot")
    chat(stack, used["id"])  # by id: the same adapter
    chat(stack, "base")  # the base model counts for no adapter

    detail = c.get(f"/admin/adapters/{used['id']}").json()
    residency = detail["residency"]
    assert residency["ram"] is True and residency["disk"] is True and residency["store"] is True
    assert residency["device"] == DEVICE[server.services.engine.adapter_residency(used["digest"])]
    assert detail["recent_requests"] == {"last_60s": 3, "last_300s": 3, "per_minute": pytest.approx(0.6)}
    assert detail["versions"][-1]["digest"] == used["digest"] and detail["pinned"] is False

    untouched = c.get(f"/admin/adapters/{idle['id']}").json()
    assert untouched["residency"] == {"version": 1, "device": "absent", "ram": False, "disk": False, "store": True}
    assert untouched["recent_requests"]["last_300s"] == 0

    newer = upload(stack, "used-bot", seed=13)  # a new version: residency follows the latest
    assert newer["version"] == 2
    shown = c.get(f"/admin/adapters/{used['id']}").json()
    assert shown["residency"] == {"version": 2, "device": "absent", "ram": False, "disk": False, "store": True}
    assert shown["recent_requests"]["last_60s"] == 3  # counted per adapter, whatever the version

    assert c.get("/admin/adapters/ad_does_not_exist").status_code == 404
    schema = server.app.openapi()["components"]["schemas"]
    assert {"residency", "recent_requests"} <= set(schema["AdapterDetail"]["properties"])
    assert schema["AdapterResidency"]["properties"]["device"]["description"]


def test_metrics_show_residency_and_lora_requests_info(stack):
    server = stack[0]
    upload(stack, "metrics-bot", seed=21)
    chat(stack, "metrics-bot")
    body = httpx.get(f"{server.url}/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(body)}

    (info,) = families["vllm:lora_requests_info"].samples  # idle now: nothing running or waiting
    max_lora = str(server.services.engine.stats()["lora"]["max_lora"])
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": max_lora}

    def sample(name: str, **labels) -> float:
        family = families[name.removesuffix("_total").removesuffix("_count")]
        (found,) = [s.value for s in family.samples if s.name == name and s.labels == labels]
        return found

    assert sample("loramux_adapters_resident", cache_tier="ram") >= 1
    assert sample("loramux_adapters_resident", cache_tier="disk") >= 1
    assert sample("loramux_adapter_cache_budget_bytes", cache_tier="ram") > 0
    assert sample("loramux_adapter_load_seconds_count", cache_tier="store") >= 1
    assert sample("loramux_adapter_device_loads_total") >= 1
    assert sample("loramux_adapters_resident", cache_tier="device") == \
        server.services.engine.stats()["lora"]["device_adapters"]
