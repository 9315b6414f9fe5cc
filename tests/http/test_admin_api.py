"""The admin API over real HTTP: the auth matrix over every route, tenants and keys, adapter uploads
(and upload abuse), tiers, prices, and that raw keys are stored and logged nowhere."""
from __future__ import annotations

import concurrent.futures
import csv
import io
import json
import logging
import pickle
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import MetaData, select

from conftest import admin_client, serve_admin_stack
from loramux.billing.reports import COLUMN_NAMES
from loramux.db import Adapter, AdapterVersion
from loramux.server.http.ingress import ADMIN_PATHS_OUTSIDE_ADMIN
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-test-admin-key-0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    yield from serve_admin_stack(tmp_path_factory.mktemp("admin-api"), tiny_dir, tokenizer, ADMIN_KEY)


@pytest.fixture(scope="module")
def admin(stack) -> Iterator[httpx.Client]:
    with admin_client(stack[0], ADMIN_KEY) as client:
        yield client


def adapter_dir(stack, name: str, seed: int, rank: int = 4) -> Path:
    _, _, cfg, tmp = stack
    return write_peft_adapter(tmp / f"{name}-{seed}", cfg, rank, ["q_proj", "v_proj"], seed=seed)


def upload(admin: httpx.Client, tenant_id: str, name: str, directory: Path, **fields):
    files = {"adapter_config": ("adapter_config.json", (directory / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", (directory / "adapter_model.safetensors").read_bytes())}
    return admin.post("/admin/adapters", data={"tenant_id": tenant_id, "name": name, **fields}, files=files)


def fill(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x_does_not_exist", path)


def test_auth_matrix_over_every_route(stack):
    server, tenant_key, _, _ = stack
    # Every operation the server documents (the OpenAPI schema is the route table).
    routes = [(path, method.upper()) for path, ops in server.app.openapi()["paths"].items() for method in ops]
    open_paths = {"/health", "/ready", "/metrics"}
    checked = 0
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for route_path, method in routes:
            path = fill(route_path)
            if route_path in open_paths:
                assert c.request(method, path).status_code == 200
                continue
            no_key = c.request(method, path)
            assert no_key.status_code == 401, (method, route_path, no_key.text)
            admin_route = route_path.startswith("/admin") or route_path in ADMIN_PATHS_OUTSIDE_ADMIN
            if admin_route:
                as_tenant = c.request(method, path, headers={"Authorization": f"Bearer {tenant_key}"})
                assert as_tenant.status_code == 403, (method, route_path)
                assert "tenant API keys are not accepted" in as_tenant.text
                as_admin = c.request(method, path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert as_admin.status_code not in (401, 403), (method, route_path, as_admin.text)
            else:
                as_admin = c.request(method, path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert as_admin.status_code == 403, (method, route_path)
                assert "admin keys are not accepted" in as_admin.text
                as_tenant = c.request(method, path, headers={"Authorization": f"Bearer {tenant_key}"})
                assert as_tenant.status_code not in (401, 403), (method, route_path, as_tenant.text)
            wrong = "lmxa-wrong" if admin_route else "lmx-wrong"
            bad = c.request(method, path, headers={"Authorization": f"Bearer {wrong}"})
            assert bad.status_code == 401
            checked += 1
    assert checked >= 25  # every admin and tenant route was exercised


def test_tenants_and_keys_lifecycle(stack, admin):
    server = stack[0]
    created = admin.post("/admin/tenants", json={"name": "globex", "tier": "premium"})
    assert created.status_code == 201, created.text
    tenant = created.json()
    assert admin.post("/admin/tenants", json={"name": "globex"}).status_code == 409
    bad_tier = admin.post("/admin/tenants", json={"name": "initech", "tier": "gold"})
    assert bad_tier.status_code == 400 and "unknown tier 'gold'" in bad_tier.text
    assert any(t["name"] == "globex" for t in admin.get("/admin/tenants").json()["tenants"])

    key = admin.post(f"/admin/tenants/{tenant['id']}/keys").json()
    assert key["key"].startswith("lmx-") and key["prefix"] == key["key"][:12]
    listed = admin.get(f"/admin/tenants/{tenant['id']}/keys").json()["keys"]
    assert [k["id"] for k in listed] == [key["id"]] and "key" not in listed[0]
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key['key']}"})
    assert models.status_code == 200
    rotated = admin.post(f"/admin/tenants/{tenant['id']}/keys/{key['id']}/rotate").json()
    assert rotated["revoked"] == key["id"] and rotated["key"] != key["key"]
    old = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key['key']}"})
    assert old.status_code == 401
    new = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {rotated['key']}"})
    assert new.status_code == 200
    assert admin.delete(f"/admin/tenants/{tenant['id']}/keys/{rotated['id']}").json()["revoked_at"]
    revoked = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {rotated['key']}"})
    assert revoked.status_code == 401

    suspended = admin.patch(f"/admin/tenants/{tenant['id']}", json={"status": "suspended", "tier": "free"}).json()
    assert (suspended["status"], suspended["tier"]) == ("suspended", "free")
    assert admin.patch(f"/admin/tenants/{tenant['id']}", json={"tier": "gold"}).status_code == 400
    assert admin.get("/admin/tenants/tn_missing").status_code == 404


def test_adapter_upload_versions_visibility_warm_pin_delete(stack, admin):
    server, tenant_key, _, _ = stack
    acme = server.services.tenancy.tenant("acme")
    first = upload(admin, acme.id, "bot", adapter_dir(stack, "bot", 1))
    assert first.status_code == 201, first.text
    body = first.json()
    assert set(body) >= {"id", "name", "version", "digest"} and body["version"] == 1
    second = upload(admin, acme.id, "bot", adapter_dir(stack, "bot", 2)).json()
    assert (second["id"], second["version"]) == (body["id"], 2) and second["digest"] != body["digest"]
    versions = admin.get(f"/admin/adapters/{body['id']}").json()["versions"]
    assert [v["version"] for v in versions] == [1, 2]
    listed = admin.get("/admin/adapters", params={"tenant_id": acme.id}).json()["adapters"]
    assert any(a["id"] == body["id"] for a in listed)
    assert admin.patch(f"/admin/adapters/{body['id']}", json={"visibility": "public"}).json()["visibility"] == "public"

    warm = admin.post(f"/admin/adapters/{body['id']}/warm").json()
    assert warm["version"] == 2 and warm["loaded_from"] in ("store", "disk", "ram")
    assert admin.post(f"/admin/adapters/{body['id']}/pin").json()["pinned"] is True
    assert second["digest"] in server.services.adapter_cache.host
    assert admin.delete(f"/admin/adapters/{body['id']}/pin").json()["pinned"] is False

    # Concurrent pin calls record one pin holding exactly one host-RAM lease (unpin gives it back).
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pinned = list(pool.map(lambda _: admin.post(f"/admin/adapters/{body['id']}/pin"), range(8)))
    assert all(r.status_code == 200 for r in pinned)
    host = server.services.adapter_cache.host
    assert host._entries[second["digest"]].leases == 1
    assert admin.delete(f"/admin/adapters/{body['id']}/pin").json()["pinned"] is False
    assert host._entries[second["digest"]].leases == 0

    # The tenant uses it by name, then it is deleted: 404 afterwards, like any unknown model.
    headers = {"Authorization": f"Bearer {tenant_key}"}
    payload = {"model": "bot", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=payload, headers=headers).status_code == 200
    assert admin.delete(f"/admin/adapters/{body['id']}").json()["deleted_versions"] == [1, 2]
    assert httpx.post(f"{server.url}/v1/completions", json=payload, headers=headers).status_code == 404
    assert admin.get(f"/admin/adapters/{body['id']}").status_code == 404


def test_upload_says_what_the_adapter_changes(stack, admin):
    """The upload's answer and the adapter's versions carry validation's summary: the modules and layers it
    changes, rank and scale, no DoRA / embedding / heads, and its exact device bytes (r=4 on q and v: the
    merged qkv projection holds A rows for q, k and v and B for each slice, float32)."""
    server, _, cfg, _ = stack
    acme = server.services.tenancy.tenant("acme")
    answer = upload(admin, acme.id, "summarised", adapter_dir(stack, "summarised", 5))
    assert answer.status_code == 201, answer.text
    summary = answer.json()["summary"]
    every_layer = list(range(cfg.num_layers))
    assert summary["modules"] == {t: {"layers": every_layer, "rank_min": 4, "rank_max": 4, "scale_min": 2.0,
                                      "scale_max": 2.0} for t in ("q_proj", "v_proj")}
    assert (summary["layout"], summary["dora"], summary["embedding"], summary["heads"]) == ("plain", False, None, [])
    qkv_out = cfg.q_size + 2 * cfg.kv_size
    lora = cfg.num_layers * 4 * (3 * cfg.hidden_size + qkv_out) * 4
    assert summary["device_bytes"] == {"lora": lora, "dora": 0, "embedding": 0, "heads": 0, "experts": 0, "total": lora}
    pool = server.services.engine.engine.pool
    assert summary["device_bytes"]["lora"] == pool.slot_bytes((4, ("self_attn.qkv_proj",)))
    detail = admin.get(f"/admin/adapters/{answer.json()['id']}").json()
    assert detail["versions"][-1]["summary"] == summary
    assert admin.delete(f"/admin/adapters/{answer.json()['id']}").status_code == 200


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def upload_dirs_left() -> list[str]:
    return [p.name for p in Path(tempfile.gettempdir()).glob("loramux-upload-*")]


def test_upload_abuse_is_refused_and_leaves_nothing(stack, admin, tmp_path, monkeypatch):
    # The server runs in this process: its upload dirs go to a temp dir of this test's own, where another test's
    # upload in flight (another xdist worker's, say) is never counted as left behind.
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    server = stack[0]
    acme = server.services.tenancy.tenant("acme")
    good = adapter_dir(stack, "good", 5)
    config = (good / "adapter_config.json").read_bytes()
    weights = (good / "adapter_model.safetensors").read_bytes()
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Payload(marker))
    with server.services.db.session() as s:
        before = (len(s.scalars(select(Adapter)).all()), len(s.scalars(select(AdapterVersion)).all()))
    blobs_before = set(server.services.store.list_keys())
    cases = [
        ("pickle named .bin", {"adapter_model": ("adapter_model.bin", evil)}, 400, "pickle weights are refused"),
        ("pickle as safetensors", {"adapter_model": ("adapter_model.safetensors", evil)}, 400, "holds a pickle"),
        ("traversal name", {"adapter_model": ("../../etc/passwd", weights)}, 400, "file name"),
        ("traversal config", {"adapter_config": ("..\\adapter_config.json", config)}, 400, "file name"),
        ("malformed safetensors",
         {"adapter_model": ("adapter_model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{]")},
         400, "safetensors"),
        ("truncated", {"adapter_model": ("adapter_model.safetensors", weights[:-10])}, 400, ""),
        ("weights above the cap", {"adapter_model": ("adapter_model.safetensors", weights + b"\x00" * 400_000)}, 413,
         "above this server's limit"),
        ("body above the cap", {"adapter_model": ("adapter_model.safetensors", b"\x00" * 1_600_000)}, 413, "at most"),
        ("missing part", {"adapter_config": None}, 400, "missing file field 'adapter_config'"),
    ]
    for label, overrides, status, needle in cases:
        files = {"adapter_config": ("adapter_config.json", config),
                 "adapter_model": ("adapter_model.safetensors", weights)}
        files.update(overrides)
        files = {k: v for k, v in files.items() if v is not None}
        resp = admin.post("/admin/adapters", data={"tenant_id": acme.id, "name": "evil"}, files=files)
        assert resp.status_code == status, (label, resp.text)
        assert needle in resp.json()["error"]["message"], (label, resp.text)
        assert "/tmp" not in resp.text and str(tmp_path) not in resp.text, label
    # A chunked body with no Content-Length is counted as it arrives.
    def chunks():
        yield (b"--x\r\nContent-Disposition: form-data; name=\"adapter_model\"; "
               b"filename=\"adapter_model.safetensors\"\r\n\r\n")
        for _ in range(100):  # 1.6 MB, above the 1.25 MB body cap
            yield b"\x00" * 16384

    resp = admin.post("/admin/adapters", content=chunks(), headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert resp.status_code == 413
    not_multipart = admin.post("/admin/adapters", json={"tenant_id": acme.id})
    assert not_multipart.status_code == 415 and "multipart/form-data" in not_multipart.text
    assert not marker.exists()  # the pickle never ran
    with server.services.db.session() as s:
        after = (len(s.scalars(select(Adapter)).all()), len(s.scalars(select(AdapterVersion)).all()))
    assert after == before and set(server.services.store.list_keys()) == blobs_before
    assert upload_dirs_left() == []


def test_tiers_and_prices(admin):
    tiers = {t["name"]: t for t in admin.get("/admin/tiers").json()["tiers"]}
    assert set(tiers) >= {"free", "standard", "premium"}
    put = admin.put("/admin/tiers/enterprise", json={"priority": 3, "requests_per_min": 0, "tokens_per_min": 0,
                                                     "max_concurrent": 256, "default_timeout_s": 600,
                                                     "max_timeout_s": 3600})
    assert put.status_code == 200 and put.json()["priority"] == 3
    bad = admin.put("/admin/tiers/odd", json={"priority": 0, "default_timeout_s": 100, "max_timeout_s": 10})
    assert bad.status_code == 400 and "default_timeout_s <= max_timeout_s" in bad.text
    huge = admin.put("/admin/tiers/odd", json={"priority": 0, "tokens_per_min": 2**40, "default_timeout_s": 1,
                                               "max_timeout_s": 10})  # beyond the INTEGER column: a clear 422, no 500
    assert huge.status_code == 422 and "tokens_per_min" in huge.text
    price = admin.post("/admin/prices", json={"input_per_mtok": "0.10", "cached_input_per_mtok": "0.05",
                                              "output_per_mtok": "0.40", "effective_from": "2026-01-01T00:00:00Z"})
    assert price.status_code == 201, price.text
    assert price.json()["output_per_mtok"].startswith("0.4")
    assert admin.post("/admin/prices", json={"input_per_mtok": "-1", "cached_input_per_mtok": "0",
                                             "output_per_mtok": "0"}).status_code == 422
    assert admin.post("/admin/prices", json={"input_per_mtok": "1", "cached_input_per_mtok": "1",
                                             "output_per_mtok": "1", "tier": "gold"}).status_code == 400
    assert any(p["id"] == price.json()["id"] for p in admin.get("/admin/prices").json()["prices"])


def test_raw_keys_are_stored_and_logged_nowhere(stack, admin, caplog):
    server, tenant_key, _, tmp = stack
    caplog.set_level(logging.DEBUG)
    tenant = admin.post("/admin/tenants", json={"name": "secretive"}).json()
    raw_tenant = admin.post(f"/admin/tenants/{tenant['id']}/keys").json()["key"]
    raw_admin = admin.post("/admin/keys", json={"name": "second"}).json()["key"]
    for key in (raw_tenant, tenant_key):
        httpx.post(f"{server.url}/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {key}"})
    httpx.get(f"{server.url}/admin/tenants", headers={"Authorization": f"Bearer {raw_admin}"})
    server.services.ledger.flush(10)
    secrets = [raw_tenant, raw_admin, tenant_key, ADMIN_KEY]
    dump = io.StringIO()
    metadata = MetaData()
    metadata.reflect(server.services.db.engine)
    with server.services.db.engine.connect() as conn:
        for table in metadata.sorted_tables:
            for row in conn.execute(table.select()):
                dump.write(json.dumps([str(v) for v in row]) + "\n")
    stored = dump.getvalue()
    logged = "\n".join(r.getMessage() + json.dumps({k: str(v) for k, v in r.__dict__.items()}) for r in caplog.records)
    db_files = b"".join(p.read_bytes() for p in (tmp / "data").glob("loramux.db*"))
    for secret in secrets:
        assert secret not in stored and secret not in logged
        assert secret.encode() not in db_files


def test_admin_cli_mirrors_the_api(stack, tmp_path):
    import os
    import subprocess

    from loramux.child_python import python_command

    server = stack[0]
    # `admin tenants|keys` are `loramux tenants|keys`: they work on the database, like before a server runs.
    env = {**os.environ, "LORAMUX_ADMIN_KEY": ADMIN_KEY, "PYTHONUNBUFFERED": "1",
           "LORAMUX_DATABASE_URL": server.services.db.url}

    def cli(*args) -> subprocess.CompletedProcess:
        return subprocess.run(python_command("-m", "loramux.cli", "admin", "--url", server.url, *args),
                              capture_output=True, text=True, timeout=120, env=env)

    created = cli("tenants", "create", "cli-co", "--tier", "free")
    assert created.returncode == 0, created.stderr
    tenant_id = json.loads(created.stdout)["id"]
    key = json.loads(cli("keys", "create", tenant_id).stdout)
    assert key["key"].startswith("lmx-")
    up = cli("adapters", "upload", tenant_id, "cli-bot", str(adapter_dir(stack, "cli", 9)), "--public")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["version"] == 1 and "uploading cli-bot" in up.stderr  # the progress bar
    assert cli("adapters", "warm", json.loads(up.stdout)["id"]).returncode == 0
    out = tmp_path / "bill.csv"
    assert cli("billing", "export", "--format", "csv", "--out", str(out)).returncode == 0
    header, *rows = csv.reader(io.StringIO(out.read_text()))
    assert tuple(header) == COLUMN_NAMES and all(len(row) == len(COLUMN_NAMES) for row in rows)
    denied = subprocess.run(python_command("-m", "loramux.cli", "admin", "--url", server.url, "--key",
                                           key["key"], "adapters", "list"), capture_output=True, text=True, timeout=120)
    assert denied.returncode == 1 and "403" in denied.stderr
