"""Adapter cache levels (S3 -> disk -> host RAM) over a real moto S3 server, reached through a fault-injecting
proxy: single-flight loads, the RAM budget, digest checks, and failures that stay contained."""
from __future__ import annotations

import asyncio
import time
import uuid
from urllib.parse import urlsplit

import pytest
import torch

from conftest import adapter_files, server_stats
from loramux.adapters.residency.cache_levels import AdapterCache, AdapterLoadError, DiskCache, HostCache
from loramux.adapters.storage.registry import AdapterRegistry
from loramux.adapters.storage.store import FileStore, S3Store, StoreUnavailableError
from loramux.db import Database
from loramux.testing import MOTO_CREDENTIALS, MOTO_REGION, FaultyProxy, moto_create_bucket, write_peft_adapter


@pytest.fixture(scope="module")
def base_cfg(tiny_cfg):
    return tiny_cfg


@pytest.fixture
def proxy(moto_server):
    parts = urlsplit(moto_server)
    p = FaultyProxy(parts.hostname, parts.port)
    yield p
    p.close()


@pytest.fixture
def setup(proxy, base_cfg, tmp_path):
    """A registry on SQLite whose blobs live in S3 behind the proxy, and a fresh cache on top."""
    bucket = f"tiers-{uuid.uuid4().hex[:12]}"
    moto_create_bucket(proxy.url, bucket)
    # 2 s: well inside the 3 s load deadline the fault tests assert, yet slack enough that moto answering
    # slowly on a loaded CI machine is not read as a store fault.
    store = S3Store(bucket, "adapters", endpoint_url=proxy.url, region=MOTO_REGION, timeout_s=2.0, max_attempts=1,
                    **MOTO_CREDENTIALS)
    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    registry = AdapterRegistry(db, store, base_cfg, "tiny-llama")
    tenant = registry.tenancy.create_tenant("acme")
    counter = iter(range(10_000))

    def upload(name: str, rank: int = 4):
        path = write_peft_adapter(tmp_path / f"src-{next(counter)}", base_cfg, rank, ["q_proj", "v_proj"],
                                  seed=next(counter))
        return registry.register(tenant.id, name, adapter_files(path))

    def make_cache(host_budget: int = 1 << 30) -> AdapterCache:
        cache = AdapterCache(store, DiskCache(tmp_path / f"disk-{next(counter)}", 1 << 30), HostCache(host_budget))
        registry.on_blob_deleted(cache.evict)
        return cache

    yield registry, store, upload, make_cache
    db.dispose()


def test_fifty_concurrent_acquires_of_a_cold_adapter_download_once(setup):
    registry, store, upload, make_cache = setup
    version = upload("bot")
    cache = make_cache()
    gets_before = store.counters["get"]

    async def many():
        return await asyncio.gather(*(cache.acquire(version, timeout=10) for _ in range(50)))

    leases = asyncio.run(many())
    assert store.counters["get"] - gets_before == 1
    assert len({id(lease.adapter) for lease in leases}) == 1 and {lease.level for lease in leases} == {"store"}
    for _ in leases:
        cache.release(version.digest)
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release(version.digest)


def test_each_cache_level_serves_in_turn(setup):
    registry, store, upload, make_cache = setup
    version = upload("bot")
    cache = make_cache()
    first = cache.acquire_blocking(version)
    assert first.level == "store" and first.adapter.digest == version.digest
    again = cache.acquire_blocking(version)
    assert again.level == "ram" and again.adapter is first.adapter
    cache.release(version.digest), cache.release(version.digest)
    cache.host.discard(version.digest)  # pushed out of RAM: the disk copy serves next
    gets = store.counters["get"]
    assert cache.acquire_blocking(version).level == "disk" and store.counters["get"] == gets
    cache.release(version.digest)
    # A corrupt disk copy is noticed, removed, and the store serves instead.
    cache.host.discard(version.digest)
    path = next(cache.disk.root.glob("*.blob"))
    path.write_bytes(b"garbage" + path.read_bytes()[7:])
    assert cache.acquire_blocking(version).level == "store"
    assert cache.stats()["hits"] == {"store": 2, "ram": 1, "disk": 1}


def test_host_ram_stays_within_budget_when_cycling_through_many_adapters(setup):
    registry, store, upload, make_cache = setup
    versions = [upload(f"bot-{i}") for i in range(30)]
    one = max(v.size_bytes for v in versions) * 2  # float32 in RAM; the blobs may be smaller
    cache = make_cache(host_budget=3 * one)  # room for 3: cycling through 10x as many
    peak = 0
    for _rounds in range(2):
        for version in versions:
            lease = cache.acquire_blocking(version, timeout=10)
            peak = max(peak, cache.host.nbytes)
            cache.release(lease.adapter.digest)
            peak = max(peak, cache.host.nbytes)
    assert peak <= cache.host.budget + one
    assert cache.stats()["downloads"] == 30  # the second round is served from the disk tier


@pytest.mark.parametrize("fault", ["refuse", "blackhole", "corrupt"])
def test_a_store_fault_fails_that_load_in_time_and_recovery_serves_again(setup, proxy, fault):
    registry, store, upload, make_cache = setup
    warm, cold = upload("warm"), upload("cold")
    cache = make_cache()
    cache.acquire_blocking(warm)  # leased in RAM, like an adapter with running requests
    good_blob = store.get(cold.storage_key)
    if fault == "corrupt":
        store.put(cold.storage_key, good_blob[:-4] + b"\x00\x00\x80\x7f")  # same size, different bytes
    else:
        proxy.set_mode(fault)

    async def scenario():
        start = time.monotonic()
        failing = asyncio.create_task(cache.acquire(cold, timeout=3.0))
        other = await cache.acquire(warm, timeout=1.0)  # others are served while the cold load struggles
        other_ms = (time.monotonic() - start) * 1000
        with pytest.raises((AdapterLoadError, TimeoutError)) as info:
            await failing
        return other, other_ms, time.monotonic() - start, info.value

    other, other_ms, elapsed, error = asyncio.run(scenario())
    assert other.level == "ram" and other_ms < 500
    assert elapsed < 3.5, f"the failing load took {elapsed:.1f} s, past its 3 s deadline"
    assert "cold@1" in str(error)
    if isinstance(error, AdapterLoadError):  # tenants see the version only; the cause is for operators
        assert str(error) == "adapter cold@1 could not be loaded from storage; retry later"
        assert store.bucket not in str(error) and error.retryable
    if fault == "corrupt":
        assert "corrupt" in error.detail and cold.digest not in cache.disk
    assert cold.digest not in cache.host
    # Recovery: the next attempt loads (a failed load is not remembered).
    if fault == "corrupt":
        store.put(cold.storage_key, good_blob)
    else:
        proxy.set_mode("pass")
    lease = cache.acquire_blocking(cold, timeout=5)
    assert lease.level == "store" and lease.adapter.digest == cold.digest
    assert cache.stats()["load_failures"] >= 1


def test_reupload_is_a_new_version_and_no_tier_returns_the_old_one(setup):
    registry, store, upload, make_cache = setup
    old = upload("bot", rank=4)
    cache = make_cache()
    old_lease = cache.acquire_blocking(registry.resolve(old.tenant_id, "bot"))
    new = upload("bot", rank=8)
    current = registry.resolve(old.tenant_id, "bot")
    assert (current.version, current.digest) == (2, new.digest) and new.digest != old.digest
    new_lease = cache.acquire_blocking(current)
    assert new_lease.adapter.rank == 8 and new_lease.level == "store"
    a_old, _ = old_lease.adapter.weights[(0, "q_proj")]
    a_new, _ = new_lease.adapter.weights[(0, "q_proj")]
    assert a_old.shape != a_new.shape or not torch.equal(a_old, a_new)


def test_delete_drops_every_cached_copy(setup):
    registry, store, upload, make_cache = setup
    version = upload("bot")
    cache = make_cache()
    lease = cache.acquire_blocking(version)  # an in-flight request holds it
    registry.delete(version.tenant_id, "bot")
    assert version.digest not in cache.disk and not store.exists(version.storage_key)
    assert version.digest in cache.host  # still leased: the running request finishes
    cache.release(lease.adapter.digest)
    assert version.digest not in cache.host


def test_over_http_a_hanging_store_fails_one_request_while_others_are_served(proxy, tiny_dir, tokenizer, tmp_path,
                                                                              base_cfg):
    import threading

    from conftest import live_stack, new_tenant_key

    bucket = f"http-{uuid.uuid4().hex[:12]}"
    moto_create_bucket(proxy.url, bucket)
    sources = {name: write_peft_adapter(tmp_path / name, base_cfg, 4, ["q_proj", "v_proj"], seed=i, b_std=1.0)
               for i, name in enumerate(("warm", "cold"))}
    settings = dict(store_url=f"s3://{bucket}/adapters", s3_endpoint_url=proxy.url, s3_region=MOTO_REGION,
                    s3_access_key_id="testing", s3_secret_access_key="testing", s3_timeout_s=5.0, s3_max_attempts=1,
                    adapters=",".join(f"{n}={p}" for n, p in sources.items()))
    body = {"prompt": "Once upon a time", "max_tokens": 6}
    with live_stack(tmp_path, tiny_dir, tokenizer, engine=dict(max_loras=2, max_lora_rank=8), client=True,
                    **settings) as client:
        client.headers["Authorization"] = f"Bearer {new_tenant_key(client.app.state.services)}"
        assert client.post("/generate", json={**body, "adapter": "warm"}).json()["adapter_tier"] == "store"
        proxy.set_mode("blackhole")
        cold_result = {}

        def cold_request():
            start = time.monotonic()
            cold_result["resp"] = client.post("/generate", json={**body, "adapter": "cold", "timeout_s": 2.0})
            cold_result["end"] = time.monotonic()
            cold_result["elapsed"] = cold_result["end"] - start

        thread = threading.Thread(target=cold_request)
        thread.start()
        served = [client.post("/generate", json={**body, "adapter": a}) for a in ("warm", None, "warm", None)]
        finished_others = time.monotonic()
        thread.join()
        assert [r.status_code for r in served] == [200] * 4
        assert served[0].json()["adapter_tier"] == "ram"
        assert finished_others < cold_result["end"]  # served while the cold load hung
        resp = cold_result["resp"]
        assert resp.status_code == 503 and "adapter cold@1 could not be loaded" in resp.json()["error"]["message"]
        assert resp.headers["retry-after"] and cold_result["elapsed"] < 3.0
        proxy.set_mode("pass")  # the store recovers (the hung connection drops): the next attempt succeeds
        client.app.state.services.adapter_cache.drain(timeout=10)
        recovered = client.post("/generate", json={**body, "adapter": "cold"})
        assert recovered.status_code == 200 and recovered.json()["adapter_tier"] == "store"
        stats = server_stats(client)
        assert stats["kv_blocks_used"] == 0 and stats["adapter_slots_pinned"] == 0


def test_tenant_facing_load_errors_name_no_server_path_or_bucket(base_cfg, tmp_path, caplog):
    """A 503 body shows AdapterLoadError's message: it names the version, never the store URL, bucket, key or
    a local path; operators get those in `detail` and in the log."""
    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    store = FileStore(tmp_path / "secret-blob-dir")
    registry = AdapterRegistry(db, store, base_cfg, "tiny-llama")
    path = write_peft_adapter(tmp_path / "src", base_cfg, 4, ["q_proj"], seed=1)
    version = registry.register(registry.tenancy.create_tenant("acme").id, "bot", adapter_files(path))
    (store.root / version.storage_key).unlink()  # the weights vanished from the store
    cache = AdapterCache(store, DiskCache(tmp_path / "disk", 1 << 30), HostCache(1 << 30))
    logger = "loramux.adapters.residency.cache_levels"
    with caplog.at_level("WARNING", logger=logger), pytest.raises(AdapterLoadError) as info:
        cache.acquire_blocking(version, timeout=10)
    message = str(info.value)
    assert message == "adapter bot@1 could not be loaded from storage: its stored weights are missing"
    assert not info.value.retryable and str(tmp_path) in info.value.detail and str(tmp_path) in caplog.text

    class UnreachableS3:
        url = "s3://acme-private-bucket/prefix"

        def get(self, key):
            raise StoreUnavailableError(f"get {key!r} on {self.url}: S3 unreachable: ConnectTimeoutError")

    cache = AdapterCache(UnreachableS3(), DiskCache(tmp_path / "disk2", 1 << 30), HostCache(1 << 30))
    with pytest.raises(AdapterLoadError) as info:
        cache.acquire_blocking(version, timeout=10)
    assert str(info.value) == "adapter bot@1 could not be loaded from storage; retry later" and info.value.retryable
    assert "acme-private-bucket" in info.value.detail and "acme-private-bucket" in caplog.text
    for text in (message, str(info.value)):
        assert "bucket" not in text and "s3://" not in text and "/" not in text.replace("bot@1", "")
    cache.shutdown()
    db.dispose()


class _GuardedDict(dict):
    """A dict that fails the test when read without its owner's lock held (a reader racing the writers)."""

    def __init__(self, data, lock):
        super().__init__(data)
        self.lock = lock

    def values(self):
        assert self.lock.locked(), "read without the lock that guards it"
        return super().values()

    def items(self):
        assert self.lock.locked(), "read without the lock that guards it"
        return super().items()


def test_stats_reads_the_caches_under_their_locks(base_cfg, tmp_path):
    from collections import OrderedDict

    from loramux.adapters.formats.peft import load_adapter_dir

    cache = AdapterCache(FileStore(tmp_path / "blobs"), DiskCache(tmp_path / "disk", 1 << 30), HostCache(1 << 30))
    adapter = load_adapter_dir(write_peft_adapter(tmp_path / "a", base_cfg, 4, ["q_proj"], seed=1), base_cfg)
    cache.host.insert_leased(adapter)
    cache.disk.put("0" * 64, b"x" * 10)

    class Guarded(_GuardedDict, OrderedDict):
        pass

    cache.host._entries = Guarded(cache.host._entries, cache._lock)
    cache.disk._sizes = Guarded(cache.disk._sizes, cache.disk._lock)
    stats = cache.stats()
    assert stats["host_bytes"] == adapter.nbytes and stats["disk_bytes"] == 10
    cache.shutdown()
