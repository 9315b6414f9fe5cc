"""Medusa heads in the registry, on SQLite and PostgreSQL: upload / list / replace / delete, the lookup the request
path makes (the version's heads, else the base model's), refused uploads that leave nothing behind, garbage
collection; the admin API and CLI over it; and the heads reaching the engine with each request."""
from __future__ import annotations

import json
import pickle
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save as safetensors_bytes
from sqlalchemy import func, select

from conftest import adapter_files as files_of
from conftest import live_stack, make_engine, make_services, new_tenant_key
from loramux.adapters.formats.medusa import MEDUSA_CONFIG, MEDUSA_WEIGHTS, save_medusa_dir
from loramux.adapters.formats.validation import AdapterValidationError
from loramux.adapters.storage.medusa_registry import (
    MedusaNotFoundError,
    MedusaRegistry,
    collect_medusa_garbage,
    medusa_key,
    unpack_medusa,
)
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterRegistry
from loramux.adapters.storage.store import FileStore
from loramux.db import MedusaHeads
from loramux.db.models import new_id, utcnow
from loramux.server.app import create_app
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-medusa-test-admin-key-0123456789abcdefghij"


# -- heads files ------------------------------------------------------------------------------------
def heads_dir(path: Path, hidden: int, num_heads: int = 2, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    blocks = [(torch.randn(hidden, hidden, generator=g) * 0.02, torch.randn(hidden, generator=g) * 0.02)
              for _ in range(num_heads)]
    return save_medusa_dir(path, blocks, base_model="tiny-llama")


def heads_files(path: Path) -> dict[str, bytes]:
    return {MEDUSA_CONFIG: (path / MEDUSA_CONFIG).read_bytes(), MEDUSA_WEIGHTS: (path / MEDUSA_WEIGHTS).read_bytes()}


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def hostile_cases(tmp: Path, hidden: int) -> list[tuple[str, dict[str, bytes], str, str]]:
    """(label, files, validator code, words the message must hold) for uploads that must be refused."""
    good = heads_files(heads_dir(tmp / "good", hidden))
    wrong = heads_files(heads_dir(tmp / "wrong-hidden", hidden // 2))
    tensors = {}
    for i in range(2):
        tensors[f"medusa_head.{i}.0.linear.weight"] = torch.zeros(hidden, hidden)
        tensors[f"medusa_head.{i}.0.linear.bias"] = torch.zeros(hidden)
    extra = safetensors_bytes({**tensors, "lm_head.weight": torch.zeros(4, hidden)})
    return [
        ("wrong hidden size", wrong, "base_mismatch", f"the served model's is {hidden}"),
        ("extra tensor", {**good, MEDUSA_WEIGHTS: extra}, "unexpected_tensor", "'lm_head.weight' is not part of"),
        ("pickle", {**good, MEDUSA_WEIGHTS: pickle.dumps(Payload(tmp / "pwned"))}, "pickle_refused",
         "save the heads as safetensors"),
        ("missing weights", {MEDUSA_CONFIG: good[MEDUSA_CONFIG]}, "missing_file",
         "medusa_heads.safetensors is missing"),
        ("non-JSON config", {**good, MEDUSA_CONFIG: b"{not json"}, "bad_config",
         "medusa_config.json is not valid JSON"),
        ("truncated weights", {**good, MEDUSA_WEIGHTS: good[MEDUSA_WEIGHTS][:-9]}, "", ""),
    ]


# -- the registry itself --------------------------------------------------------------------------------
@pytest.fixture
def registries(database, tiny_cfg, tmp_path):
    store = FileStore(tmp_path / "blobs")
    adapters = AdapterRegistry(database, store, tiny_cfg, "tiny-llama")
    return adapters, MedusaRegistry(database, store, tiny_cfg.hidden_size, "tiny-llama")


def new_adapter(adapters: AdapterRegistry, tenant_id: str, name: str, cfg, tmp: Path, seed: int):
    path = write_peft_adapter(tmp / f"{name}-{seed}", cfg, 4, ["q_proj", "v_proj"], seed=seed)
    return adapters.register(tenant_id, name, files_of(path))


def heads_rows(medusa: MedusaRegistry) -> int:
    with medusa.db.session() as s:
        return s.scalar(select(func.count()).select_from(MedusaHeads))


def medusa_keys(medusa: MedusaRegistry) -> list[str]:
    return medusa.store.list_keys("medusa/")


def test_upload_lookup_replace_delete(registries, tiny_cfg, tmp_path):
    adapters, medusa = registries
    hidden = tiny_cfg.hidden_size
    acme = adapters.tenancy.create_tenant("acme")
    v1 = new_adapter(adapters, acme.id, "bot", tiny_cfg, tmp_path, 1)
    v2 = new_adapter(adapters, acme.id, "bot", tiny_cfg, tmp_path, 2)
    assert medusa.active(v1) is None and medusa.active(None) is None

    base = medusa.upload(heads_files(heads_dir(tmp_path / "base", hidden, seed=1)))
    own = medusa.upload(heads_files(heads_dir(tmp_path / "own", hidden, 3, seed=2)), v1)
    assert (base.target, base.adapter_id, base.num_heads, base.hidden_size) == ("base", None, 2, hidden)
    assert (own.target, own.adapter_name, own.tenant_id, own.version, own.num_heads) == \
        (f"{v1.adapter_id}@1", "bot", acme.id, 1, 3)
    assert own.storage_key == medusa_key(own.digest, own.id) and own.id.startswith("md_")
    # The stored blob is both files, and its sha256 is the heads' digest.
    loaded = unpack_medusa(medusa.store.get(own.storage_key), hidden, own.digest)
    assert (loaded.num_heads, loaded.digest) == (3, own.digest)

    assert medusa.active(v1) == own  # the version's own heads
    assert medusa.active(v2) == base  # a version without heads: the base model's
    assert medusa.active(None) == base

    # A later upload for the same target replaces the active heads and keeps the history.
    newer = medusa.upload(heads_files(heads_dir(tmp_path / "own2", hidden, 2, seed=3)), v1)
    assert medusa.active(v1) == newer
    history = medusa.list(v1.adapter_id, include_deleted=True)
    assert [(h.id, h.active, h.replaced_by) for h in history] == [(newer.id, True, None), (own.id, False, newer.id)]
    assert [h.id for h in medusa.list(v1.adapter_id)] == [newer.id]
    assert [h.id for h in medusa.list(base_only=True)] == [base.id]
    assert {h.id for h in medusa.list()} == {base.id, newer.id}
    assert sorted(medusa_keys(medusa)) == sorted([base.storage_key, newer.storage_key])  # the replaced blob went

    # Deleting the version's heads falls back to the base model's; deleting those leaves none.
    gone = medusa.delete(newer.id)
    assert gone.deleted_at is not None and medusa.active(v1) == base
    with pytest.raises(MedusaNotFoundError):
        medusa.delete(newer.id)
    with pytest.raises(MedusaNotFoundError):
        medusa.delete("md_0000000000000000")
    medusa.delete(base.id)
    assert medusa.active(v1) is None and medusa.active(v2) is None and medusa.active(None) is None
    assert medusa_keys(medusa) == [] and heads_rows(medusa) == 3  # rows stay as history, blobs go
    assert medusa.get(newer.id).deleted_at is not None


def test_lookup_is_cached_and_invalidated_by_changes(registries, tiny_cfg, tmp_path):
    adapters, medusa = registries
    acme = adapters.tenancy.create_tenant("acme")
    v1 = new_adapter(adapters, acme.id, "bot", tiny_cfg, tmp_path, 1)
    medusa.active(v1)
    queries = medusa.lookup_queries
    for _ in range(20):  # the request path: no query while the answer is cached
        assert medusa.active(v1) is None and medusa.active(None) is None
    assert medusa.lookup_queries == queries
    assert medusa.cached_active(v1) == (True, None)
    base = medusa.upload(heads_files(heads_dir(tmp_path / "base", tiny_cfg.hidden_size)))
    assert medusa.cached_active(v1) == (False, None)  # the upload cleared it
    medusa.lookup_ttl_s = 0.0  # another replica's change shows once the entry expires
    assert medusa.active(v1) == base
    with medusa.db.session() as s:
        s.get(MedusaHeads, base.id).deleted_at = utcnow()
    assert medusa.active(v1) is None


@pytest.mark.parametrize("case", range(6))
def test_refused_uploads_say_what_to_fix_and_leave_nothing(registries, tiny_cfg, tmp_path, case):
    adapters, medusa = registries
    acme = adapters.tenancy.create_tenant("acme")
    v1 = new_adapter(adapters, acme.id, "bot", tiny_cfg, tmp_path, 1)
    label, files, code, words = hostile_cases(tmp_path, tiny_cfg.hidden_size)[case]
    for target in (None, v1):
        with pytest.raises(AdapterValidationError) as info:
            medusa.upload(files, target)
        if code:
            assert info.value.code == code, label
        assert words in str(info.value), (label, str(info.value))
    assert heads_rows(medusa) == 0 and medusa_keys(medusa) == []
    assert not (tmp_path / "pwned").exists()


def test_failures_after_validation_leave_nothing(registries, tiny_cfg, tmp_path, monkeypatch):
    adapters, medusa = registries
    acme = adapters.tenancy.create_tenant("acme")
    v1 = new_adapter(adapters, acme.id, "bot", tiny_cfg, tmp_path, 1)
    files = heads_files(heads_dir(tmp_path / "h", tiny_cfg.hidden_size))

    from loramux.adapters.storage.store import StoreUnavailableError

    def broken_put(key, data):
        raise StoreUnavailableError("the store is down")

    with monkeypatch.context() as m:  # the blob cannot be written: the pending row goes
        m.setattr(medusa.store, "put", broken_put)
        with pytest.raises(StoreUnavailableError):
            medusa.upload(files, v1)
    assert heads_rows(medusa) == 0 and medusa_keys(medusa) == []

    real_activate = medusa._activate

    def adapter_deleted_meanwhile(heads_id, target):  # the adapter goes between the blob's put and the row
        adapters.delete(acme.id, "bot")
        return real_activate(heads_id, target)

    with monkeypatch.context() as m:
        m.setattr(medusa, "_activate", adapter_deleted_meanwhile)
        with pytest.raises(AdapterNotFoundError):
            medusa.upload(files, v1)
    assert heads_rows(medusa) == 0 and medusa_keys(medusa) == []
    with pytest.raises(AdapterNotFoundError):  # a version that is gone: refused before anything is stored
        medusa.upload(files, v1)
    assert heads_rows(medusa) == 0 and medusa_keys(medusa) == []


def test_racing_uploads_for_one_target_leave_one_active(registries, tiny_cfg, tmp_path):
    _, medusa = registries
    uploads = [heads_files(heads_dir(tmp_path / f"h{i}", tiny_cfg.hidden_size, seed=i)) for i in range(4)]
    errors, done = [], []
    barrier = threading.Barrier(len(uploads))

    def run(files):
        barrier.wait()
        try:
            done.append(medusa.upload(files))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(f,)) for f in uploads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and len(done) == 4
    live = medusa.list(base_only=True)
    assert len(live) == 1 and medusa.active(None) == live[0]
    assert medusa_keys(medusa) == [live[0].storage_key]
    assert len(medusa.list(include_deleted=True)) == 4


def test_garbage_collection(registries, tiny_cfg, tmp_path):
    adapters, medusa = registries
    acme = adapters.tenancy.create_tenant("acme")
    v1 = new_adapter(adapters, acme.id, "bot", tiny_cfg, tmp_path, 1)
    files = heads_files(heads_dir(tmp_path / "h", tiny_cfg.hidden_size))
    base = medusa.upload(files)
    own = medusa.upload(heads_files(heads_dir(tmp_path / "own", tiny_cfg.hidden_size, seed=5)), v1)
    # An upload that died between its put and its activation, long ago, and one under way now.
    stale_id, fresh_id = new_id("md"), new_id("md")
    with medusa.db.session() as s:
        for heads_id, age in ((stale_id, 7200), (fresh_id, 0)):
            s.add(MedusaHeads(id=heads_id, kind="medusa", base_model="tiny-llama", digest=base.digest,
                              storage_key=medusa_key(base.digest, heads_id), size_bytes=1, num_heads=2,
                              hidden_size=tiny_cfg.hidden_size, config={}, status="pending",
                              created_at=utcnow() - timedelta(seconds=age)))
    for heads_id in (stale_id, fresh_id):
        medusa.store.put(medusa_key(base.digest, heads_id), b"partial")
    medusa.store.put(f"medusa/sha256/{'0' * 2}/{'0' * 64}/md_0123456789abcdef", b"orphan")
    adapters.delete(acme.id, "bot")  # its heads are retired by the next collection (no service ran here)

    removed = collect_medusa_garbage(medusa.db, medusa.store)
    assert sorted(removed) == sorted([medusa_key(base.digest, stale_id), own.storage_key,
                                      f"medusa/sha256/00/{'0' * 64}/md_0123456789abcdef"])
    assert sorted(medusa_keys(medusa)) == sorted([base.storage_key, medusa_key(base.digest, fresh_id)])
    with medusa.db.session() as s:
        assert s.get(MedusaHeads, stale_id) is None and s.get(MedusaHeads, fresh_id) is not None
        assert s.get(MedusaHeads, own.id).deleted_at is not None
    # The adapter registry's own collection never touches heads blobs.
    assert adapters.collect_garbage() == [] and base.storage_key in medusa_keys(medusa)


# -- the admin API and the request path ------------------------------------------------------------------
@pytest.fixture
def app_client(database_url, tiny_dir, tokenizer, tmp_path):
    """A TestClient of the whole app on the tiny model (speculating with Medusa heads only), its registry on
    SQLite or PostgreSQL; the LLMEngine's add_request records the `medusa` it is given."""
    seen: list = []

    def factory():
        engine = make_engine(tiny_dir, tokenizer, max_loras=2, max_lora_rank=8, speculative_tokens=2,
                             speculative_methods="medusa", speculative_max_batch=64)
        original = engine.add_request

        def add_request(request, **kwargs):
            seen.append(request.medusa)
            return original(request, **kwargs)

        engine.add_request = add_request
        return make_services(tmp_path, engine, admin_key=ADMIN_KEY, database_url=database_url,
                             max_upload_bytes=256 * 1024, auth_failures_per_min=0)

    with TestClient(create_app(factory)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        client.seen = seen
        yield client


def post_heads(client, files: dict[str, bytes], **fields):
    parts = {}
    if MEDUSA_CONFIG in files:
        parts["medusa_config"] = (MEDUSA_CONFIG, files[MEDUSA_CONFIG])
    if MEDUSA_WEIGHTS in files:
        parts["medusa_heads"] = (MEDUSA_WEIGHTS, files[MEDUSA_WEIGHTS])
    return client.post("/admin/medusa", data=fields, files=parts)


def post_adapter(client, tenant_id: str, name: str, path: Path):
    files = {"adapter_config": ("adapter_config.json", (path / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", (path / "adapter_model.safetensors").read_bytes())}
    resp = client.post("/admin/adapters", data={"tenant_id": tenant_id, "name": name}, files=files)
    assert resp.status_code == 201, resp.text
    return resp.json()


def complete(client, key: str, model: str):
    resp = client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3},
                       headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    medusa = client.seen[-1]
    # The engine speculated with the heads it was given: the response reports their drafts.
    proposed = resp.json()["loramux"].get("speculation", {}).get("medusa", {}).get("proposed", 0)
    assert (proposed > 0) == (medusa is not None), resp.json()["loramux"]
    return medusa.digest if medusa is not None else None


def test_admin_api_upload_list_delete_and_serving(app_client, tiny_cfg, tmp_path):
    client = app_client
    services = client.app.state.services
    hidden = tiny_cfg.hidden_size
    key = new_tenant_key(services, "acme")
    acme = services.tenancy.tenant("acme")
    adapter = post_adapter(client, acme.id, "bot",
                           write_peft_adapter(tmp_path / "bot1", tiny_cfg, 4, ["q_proj", "v_proj"], seed=1))
    post_adapter(client, acme.id, "bot", write_peft_adapter(tmp_path / "bot2", tiny_cfg, 4, ["q_proj"], seed=2))

    assert complete(client, key, "bot") is None and complete(client, key, "base") is None  # no heads yet

    base = post_heads(client, heads_files(heads_dir(tmp_path / "base", hidden, seed=1)))
    assert base.status_code == 201, base.text
    base = base.json()
    assert (base["target"], base["adapter_id"], base["num_heads"], base["active"]) == ("base", None, 2, True)
    own = post_heads(client, heads_files(heads_dir(tmp_path / "own", hidden, 3, seed=2)),
                     tenant_id="acme", adapter="bot", version="1")
    assert own.status_code == 201, own.text
    own = own.json()
    assert (own["adapter_id"], own["adapter_name"], own["version"], own["target"]) == \
        (adapter["id"], "bot", 1, f"{adapter['id']}@1")
    latest = post_heads(client, heads_files(heads_dir(tmp_path / "latest", hidden, seed=3)), adapter=adapter["id"])
    assert latest.status_code == 201 and latest.json()["version"] == 2  # by id; the latest version by default

    listed = client.get("/admin/medusa").json()["heads"]
    assert {h["id"] for h in listed} == {base["id"], own["id"], latest.json()["id"]}
    by_adapter = client.get("/admin/medusa", params={"tenant_id": "acme", "adapter": "bot"}).json()["heads"]
    assert {h["version"] for h in by_adapter} == {1, 2}
    by_tenant = client.get("/admin/medusa", params={"tenant_id": "acme"}).json()["heads"]
    assert {h["id"] for h in by_tenant} == {own["id"], latest.json()["id"]}
    assert [h["id"] for h in client.get("/admin/medusa", params={"base": "true"}).json()["heads"]] == [base["id"]]
    assert client.get("/admin/medusa", params={"adapter": "ad_0000000000000000"}).status_code == 404

    # The request path: each request's engine call gets its version's heads, else the base model's.
    assert complete(client, key, "bot@1") == own["digest"]
    assert complete(client, key, "bot") == latest.json()["digest"]
    assert complete(client, key, "base") == base["digest"]
    cache = services.medusa_cache
    assert cache.has_in_ram(own["digest"])
    ram_hits = cache.hits["ram"]
    assert complete(client, key, "bot@1") == own["digest"] and cache.hits["ram"] == ram_hits + 1

    # Delete: the version falls back to the base model's heads, and the deleted ones leave the caches.
    deleted = client.delete(f"/admin/medusa/{own['id']}")
    assert deleted.status_code == 200 and deleted.json()["active"] is False
    assert not cache.has_in_ram(own["digest"])
    assert complete(client, key, "bot@1") == base["digest"]
    again = client.delete(f"/admin/medusa/{own['id']}")
    assert again.status_code == 404 and again.json()["error"]["code"] == "medusa_not_found"
    history = client.get("/admin/medusa", params={"adapter": adapter["id"], "include_deleted": "true"}).json()
    assert {(h["id"], h["active"]) for h in history["heads"]} == {(own["id"], False), (latest.json()["id"], True)}
    assert client.delete(f"/admin/medusa/{base['id']}").status_code == 200
    assert complete(client, key, "bot@1") is None and complete(client, key, "base") is None

    # Deleting the adapter retires its versions' heads (and their blobs).
    assert client.delete(f"/admin/adapters/{adapter['id']}").status_code == 200
    assert client.get("/admin/medusa").json()["heads"] == []
    assert services.store.list_keys("medusa/") == []


def test_heads_the_device_cannot_hold_serve_the_request_without_them(app_client, tiny_cfg, tmp_path):
    """Out of device memory while copying a request's heads is no 500: the request runs without them (200, the
    engine gets no heads), and the next request, with room again, gets them."""
    client = app_client
    services = client.app.state.services
    key = new_tenant_key(services, "acme")
    base = post_heads(client, heads_files(heads_dir(tmp_path / "base", tiny_cfg.hidden_size, seed=1)))
    assert base.status_code == 201, base.text
    device = services.engine.engine.medusa_device
    real_build = device._build

    def out_of_memory(weights):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    device._build = out_of_memory
    assert complete(client, key, "base") is None
    assert device.stats()["build_failures"] == 1 and device.stats()["bytes"] == 0
    device._build = real_build
    assert complete(client, key, "base") == base.json()["digest"]
    assert device.stats()["builds"] == 1 and device.stats()["sets_in_use"] == 0


def test_admin_api_refuses_bad_uploads_and_leaves_nothing(app_client, tiny_cfg, tmp_path):
    client = app_client
    services = client.app.state.services
    hidden = tiny_cfg.hidden_size
    acme = services.tenancy.ensure_tenant("acme")[0]
    other = services.tenancy.ensure_tenant("other")[0]
    post_adapter(client, acme.id, "bot", write_peft_adapter(tmp_path / "bot", tiny_cfg, 4, ["q_proj"], seed=1))
    theirs = post_adapter(client, other.id, "theirs",
                          write_peft_adapter(tmp_path / "theirs", tiny_cfg, 4, ["q_proj"], seed=2))
    client.patch(f"/admin/adapters/{theirs['id']}", json={"visibility": "public"})
    good = heads_files(heads_dir(tmp_path / "good", hidden))

    for label, files, code, words in hostile_cases(tmp_path, hidden):
        resp = post_heads(client, files, tenant_id="acme", adapter="bot")
        expected = 400
        if label == "missing weights":  # refused by the upload itself: a form without the file field
            code, words = "upload_rejected", "missing file field 'medusa_heads' (medusa_heads.safetensors)"
        assert resp.status_code == expected, (label, resp.text)
        error = resp.json()["error"]
        if code:
            assert error["code"] == code, (label, error)
        assert words in error["message"], (label, error)
        assert str(tmp_path) not in resp.text and "/tmp" not in resp.text, label

    big = {**good, MEDUSA_WEIGHTS: good[MEDUSA_WEIGHTS] + b"\x00" * 300_000}
    too_large = post_heads(client, big)
    assert too_large.status_code == 413 and "above this server's limit" in too_large.json()["error"]["message"]
    refusals = [
        ({"tenant_id": "acme", "adapter": "nope"}, 404, "adapter 'nope' not found"),
        ({"tenant_id": "acme", "adapter": "bot", "version": "7"}, 404, "adapter 'bot@7' not found"),
        ({"tenant_id": "acme", "adapter": "theirs"}, 404, "not found"),  # another tenant's, even public
        ({"tenant_id": "acme", "adapter": theirs["id"]}, 404, "not found"),
        ({"tenant_id": "nobody", "adapter": "bot"}, 404, "nobody"),
        ({"adapter": "bot"}, 400, "give its owner's tenant_id"),
        ({"version": "1"}, 400, "version needs adapter"),
        ({"tenant_id": "acme", "adapter": "bot", "version": "one"}, 400, "must be a version number"),
        ({"adaptor": "bot"}, 400, "unexpected form field 'adaptor'"),
    ]
    for fields, status, words in refusals:
        resp = post_heads(client, good, **fields)
        assert resp.status_code == status, (fields, resp.text)
        assert words in resp.json()["error"]["message"], (fields, resp.text)
    wrong_part = client.post("/admin/medusa", files={"medusa_model": ("x.safetensors", b"x"),
                                                     "medusa_config": (MEDUSA_CONFIG, good[MEDUSA_CONFIG])})
    assert wrong_part.status_code == 400 and "send medusa_config and medusa_heads" in wrong_part.text
    not_multipart = client.post("/admin/medusa", json={})
    assert not_multipart.status_code == 415 and "medusa_heads.safetensors" in not_multipart.text
    with services.db.session() as s:
        assert s.scalar(select(func.count()).select_from(MedusaHeads)) == 0
    assert services.store.list_keys("medusa/") == []
    assert not (tmp_path / "pwned").exists()
    no_key = client.get("/admin/medusa", headers={"Authorization": ""})
    assert no_key.status_code == 401


def test_admin_cli_uploads_lists_and_deletes_heads(tiny_dir, tokenizer, tmp_path, tiny_cfg):
    import os
    import subprocess

    from loramux.child_python import python_command

    env = {**os.environ, "LORAMUX_ADMIN_KEY": ADMIN_KEY, "PYTHONUNBUFFERED": "1"}
    directory = heads_dir(tmp_path / "heads", tiny_cfg.hidden_size)
    with live_stack(tmp_path, tiny_dir, tokenizer, admin_key=ADMIN_KEY, max_upload_bytes=256 * 1024,
                    auth_failures_per_min=0) as server:
        def cli(*args) -> subprocess.CompletedProcess:
            return subprocess.run(python_command("-m", "loramux.cli", "admin", "--url", server.url, "medusa", *args),
                                  capture_output=True, text=True, timeout=120, env=env)

        up = cli("upload", str(directory))
        assert up.returncode == 0, up.stderr
        heads = json.loads(up.stdout)
        assert heads["target"] == "base" and "uploading Medusa heads for the base model" in up.stderr
        listed = cli("list", "--base")
        assert [h["id"] for h in json.loads(listed.stdout)["heads"]] == [heads["id"]]
        unknown = cli("upload", str(directory), "--adapter", "nope", "--tenant-id", "acme")
        assert unknown.returncode == 1 and "404" in unknown.stderr
        assert cli("delete", heads["id"]).returncode == 0
        assert json.loads(cli("list").stdout)["heads"] == []
