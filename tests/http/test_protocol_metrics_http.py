"""The vLLM-named metrics of a live server under load, as a Kubernetes router scrapes them: queue, batch and KV-cache
use agree with /admin/stats read around the scrape, and `vllm:lora_adapter_loaded` follows an adapter from the
device to host RAM when another one takes its place, under its reference, never its tenant-chosen name."""
from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import live_stack, make_engine, new_tenant_key
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES
from loramux.model.loader import read_model_config
from loramux.testing import write_peft_adapter
from polling import wait_until

ADMIN_KEY = "lmxa-test-protocol-metrics-key-0123456789abcdefgh"
BATCH = 3  # max_num_seqs: with 2 x BATCH long requests, BATCH run and BATCH wait
RANK, TARGETS = 4, ("q_proj", "v_proj")
SECRET = "tenant-secret-name"  # the tenant-chosen names start with this: never in the open /metrics


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    """A live server whose device adapter pool holds one adapter (a second one evicts it at once: no minimum
    residency), and a tenant's key."""
    tmp = tmp_path_factory.mktemp("protocol-metrics")
    engine = make_engine(tiny_dir, tokenizer, max_num_seqs=BATCH, max_lora_rank=8, adapter_min_residency_s=0.0)
    paths = {PROJECTION_SLICES[t][0] for t in TARGETS}
    engine.pool.budget = engine.pool.slot_bytes((RANK, tuple(p for p in LORA_MODULES if p in paths)))
    with live_stack(tmp, engine=engine, admin_key=ADMIN_KEY, max_upload_bytes=256 * 1024,
                    auth_failures_per_min=0) as server:
        yield server, new_tenant_key(server.services, "acme", "standard"), read_model_config(tiny_dir)[0], tmp


def admin(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)


def upload(stack, name: str, seed: int) -> dict:
    server, _, cfg, tmp = stack
    directory = write_peft_adapter(tmp / f"{name}-{seed}", cfg, RANK, list(TARGETS), seed=seed)
    with admin(server) as c:
        files = {field: (f, (directory / f).read_bytes()) for field, f in
                 (("adapter_config", "adapter_config.json"), ("adapter_model", "adapter_model.safetensors"))}
        response = c.post("/admin/adapters", data={"tenant_id": "acme", "name": name}, files=files)
    assert response.status_code == 201, response.text
    return response.json()


def families(server) -> dict:
    body = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(body)}


def one(found: dict, name: str) -> float:
    (value,) = [s.value for s in found[name].samples]
    return value


def loaded(found: dict) -> set[tuple[str, str]]:
    fam = found.get("vllm:lora_adapter_loaded")
    return set() if fam is None else {(s.labels["adapter_name"], s.labels["level"]) for s in fam.samples}


def stream(server, key: str, model: str, results: list) -> None:
    """One streamed completion of 300 tokens; appends (status, chunks) to `results`."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        chunks = sum(1 for line in response.iter_lines() if line.startswith("data: "))
        results.append((response.status_code, chunks))


def test_queue_batch_and_kv_agree_with_admin_stats_under_load(stack):
    server, key, _, _ = stack
    alpha = upload(stack, f"{SECRET}-alpha", seed=31)
    results: list = []
    threads = [threading.Thread(target=stream, args=(server, key, model, results), daemon=True)
               for model in ["base"] * BATCH + [alpha["id"]] * BATCH]
    with admin(server) as c:
        def stats() -> dict:
            return c.get("/admin/stats").json()

        for t in threads:
            t.start()
        wait_until(lambda: (s := stats())["running"] == BATCH and s["waiting"] == BATCH,
                   "a full batch running and as many requests waiting", detail=stats)
        for _ in range(3):  # the scrape lies between two reads of the engine's state
            before = stats()
            found = families(server)
            after = stats()
            for vllm_name, key_ in (("vllm:num_requests_waiting", "waiting"), ("vllm:num_requests_running", "running")):
                low, high = sorted((before[key_], after[key_]))
                assert low <= one(found, vllm_name) <= high, (vllm_name, before, after)
            low, high = sorted(s["kv_blocks_used"] / s["kv_blocks_total"] for s in (before, after))
            assert low <= one(found, "vllm:kv_cache_usage_perc") <= high, (before, after)
            assert one(found, "vllm:gpu_cache_usage_perc") == one(found, "vllm:kv_cache_usage_perc")
            (config,) = found["vllm:cache_config_info"].samples
            assert config.labels["block_size"] == "16" and config.value == 1
            assert config.labels["num_gpu_blocks"] == str(after["kv_blocks_total"])
        assert 0 < one(found, "vllm:kv_cache_usage_perc") <= 1
    for t in threads:
        t.join(timeout=300)
    assert [status for status, _ in results] == [200] * (2 * BATCH)
    assert all(chunks > 1 for _, chunks in results)  # streamed, not answered at once


def chat(server, key: str, model: str) -> None:
    response = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 200, response.text


def test_an_adapter_moves_from_device_to_host_under_its_reference(stack):
    server, key, _, _ = stack
    first, second = upload(stack, f"{SECRET}-first", seed=41), upload(stack, f"{SECRET}-second", seed=42)
    ref = {a["name"]: f"{a['id']}@{a['version']}" for a in (first, second)}
    first_ref, second_ref = ref[first["name"]], ref[second["name"]]

    chat(server, key, first["name"])  # by the tenant's name: the metrics still show the reference
    found = families(server)
    assert {(first_ref, "device"), (first_ref, "host"), (first_ref, "disk")} <= loaded(found)
    (sample,) = [s for s in found["vllm:lora_adapter_loaded"].samples
                 if s.labels["adapter_name"] == first_ref and s.labels["level"] == "device"]
    assert sample.labels["rank"] == str(RANK) and sample.labels["pinned"] == "false" and sample.value == 1

    chat(server, key, second["name"])  # the pool holds one adapter: the first one leaves the device
    assert server.services.engine.adapter_residency(first["digest"]) is None
    found = families(server)
    rows = loaded(found)
    assert (second_ref, "device") in rows
    assert (first_ref, "host") in rows and (first_ref, "device") not in rows
    engine_lora = server.services.engine.stats()["lora"]
    assert one(found, "vllm:max_gpu_lora_adapters") == engine_lora["max_lora"] == 1
    (count,) = [s.value for s in found["vllm:lora_adapter_load_seconds"].samples
                if s.name == "vllm:lora_adapter_load_seconds_count"]
    assert count == engine_lora["load_seconds"]["count"] >= 2

    with admin(server) as c:  # an operator's pin shows on every level the adapter is held at
        assert c.post(f"/admin/adapters/{first['id']}/pin").status_code == 200
        pinned = {s.labels["level"]: s.labels["pinned"] for s in families(server)["vllm:lora_adapter_loaded"].samples
                  if s.labels["adapter_name"] == first_ref}
        assert pinned == {"host": "true", "disk": "true"}
        assert c.delete(f"/admin/adapters/{first['id']}/pin").status_code == 200

    body = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert SECRET not in body  # the open /metrics never names an adapter as its tenant did
