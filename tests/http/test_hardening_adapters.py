"""Adapter hardening over real HTTP and on the data layer: a catastrophic-backtracking target_modules pattern
does not freeze the server, adapters trained from a local copy of the base are accepted (and a clearly
different base only with the admin override), odd version suffixes are 404s, tier names are checked."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import admin_client, serve_admin_stack
from loramux.adapters.storage import registry as registry_module
from loramux.names import InvalidNameError, check_name
from loramux.tenancy.tenants import Tenancy, TierInfo
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-test-admin-key-hardening-0123456789abcdefghij"


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    yield from serve_admin_stack(tmp_path_factory.mktemp("hardening"), tiny_dir, tokenizer, ADMIN_KEY)


@pytest.fixture(scope="module")
def admin(stack) -> Iterator[httpx.Client]:
    with admin_client(stack[0], ADMIN_KEY) as client:
        yield client


def adapter_dir(stack, name: str, seed: int, **config) -> Path:
    _, _, cfg, tmp = stack
    path = write_peft_adapter(tmp / f"{name}-{seed}", cfg, 4, ["q_proj", "v_proj"], seed=seed)
    written = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**written, **config}))
    return path


def upload(stack, name: str, directory: Path, timeout: float = 60, **fields) -> httpx.Response:
    server = stack[0]
    files = {"adapter_config": ("adapter_config.json", (directory / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", (directory / "adapter_model.safetensors").read_bytes())}
    acme = server.services.tenancy.tenant("acme")
    return httpx.post(f"{server.url}/admin/adapters", data={"tenant_id": acme.id, "name": name, **fields},
                      files=files, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=timeout)


@pytest.mark.timeout(180)
def test_health_keeps_answering_while_a_redos_pattern_is_validated(stack, monkeypatch):
    """A backtracking matcher would hold the GIL for minutes and freeze every request. The guarantee, free of
    wall-clock noise: each validation spends under a second of its own thread's CPU (all the time it could
    hold the GIL), and health answers (within the client's 5 s timeout) throughout."""
    server = stack[0]
    hostile = adapter_dir(stack, "redos", 1, target_modules="(?:.*){60}z")
    validation_cpu_s: list[float] = []
    real_validate = registry_module.validate_adapter_files

    def validate_on_the_cpu_clock(*args, **kwargs):
        start = time.thread_time()
        try:
            return real_validate(*args, **kwargs)
        finally:
            validation_cpu_s.append(time.thread_time() - start)

    monkeypatch.setattr(registry_module, "validate_adapter_files", validate_on_the_cpu_clock)
    results: list[httpx.Response] = []
    done = threading.Event()

    def uploads():
        try:
            for _ in range(5):
                results.append(upload(stack, "redos", hostile, timeout=120))
        finally:
            done.set()

    worker = threading.Thread(target=uploads, daemon=True)
    worker.start()
    health = 0
    with httpx.Client(base_url=server.url, timeout=5) as client:
        while not done.is_set() or not health:
            assert client.get("/health").status_code == 200
            health += 1
    worker.join()
    assert len(validation_cpu_s) == 5 and max(validation_cpu_s) < 1.0, validation_cpu_s
    assert [r.status_code for r in results] == [400] * 5
    assert {r.json()["error"]["code"] for r in results} == {"target_mismatch"}
    assert "matched whole (fullmatch, as PEFT does)" in results[0].json()["error"]["message"]


def test_an_adapter_trained_from_a_local_copy_uploads_and_shows_its_claimed_base(stack, admin):
    server = stack[0]
    local = upload(stack, "local-base", adapter_dir(stack, "local", 2,
                                                    base_model_name_or_path="/home/alice/models/smol-copy"))
    assert local.status_code == 201, local.text
    shown = admin.get(f"/admin/adapters/{local.json()['id']}").json()["versions"][0]
    assert shown["claimed_base_model"] == "/home/alice/models/smol-copy"
    assert shown["base_family"] == "llama"
    assert shown["base_model"] == server.services.registry.base_model_id

    other = adapter_dir(stack, "other", 3, base_model_name_or_path="meta-llama/Llama-2-7b-hf")
    refused = upload(stack, "other-base", other)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "base_model_mismatch"
    assert "set base_model_name_or_path in adapter_config.json" in error["message"]
    assert "allow_base_mismatch=true" in error["message"]
    bad_flag = upload(stack, "other-base", other, allow_base_mismatch="perhaps")
    assert bad_flag.status_code == 400 and "allow_base_mismatch must be true or false" in bad_flag.text
    allowed = upload(stack, "other-base", other, allow_base_mismatch="true")
    assert allowed.status_code == 201, allowed.text
    listed = {a["name"]: a for a in admin.get("/admin/adapters").json()["adapters"]}
    assert listed["other-base"]["claimed_base_model"] == "meta-llama/Llama-2-7b-hf"


@pytest.mark.parametrize("suffix", ["\u00b2", "99999999999999999999"])
def test_a_version_suffix_that_is_no_plain_number_is_a_404_not_a_500(stack, suffix):
    server, tenant_key, _, _ = stack
    assert upload(stack, "versioned", adapter_dir(stack, "versioned", 4)).status_code == 201
    response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {tenant_key}"},
                          json={"model": f"versioned@{suffix}", "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"


# -- tier names are names ------------------------------------------------------------------------------

BAD_TIER_NAMES = ["", " gold", "gold tier", "gold\n", "../x", "x" * 33, "é", "<script>"]


def tier(name: str) -> TierInfo:
    return TierInfo(name, 1, 0, 0, 0, 60.0, 120.0)


@pytest.mark.parametrize("name", BAD_TIER_NAMES)
def test_invalid_tier_names_are_refused_by_the_data_layer(database, name):
    tenancy = Tenancy(database)
    with pytest.raises(InvalidNameError, match="tier name"):
        tenancy.upsert_tier(tier(name))
    with pytest.raises(InvalidNameError, match="tier name"):
        tenancy.create_tenant("acme", tier=name)
    tenant = tenancy.create_tenant("acme")
    with pytest.raises(InvalidNameError, match="tier name"):
        tenancy.set_tenant(tenant.id, tier=name)
    assert name not in {t.name for t in tenancy.tiers()} and tenancy.tenant("acme").tier == "standard"


def test_valid_tier_names_still_work(database):
    tenancy = Tenancy(database)
    assert tenancy.upsert_tier(tier("gold.v2_" + "x" * 24)).name == "gold.v2_" + "x" * 24  # 32 characters
    assert tenancy.create_tenant("acme", tier="gold.v2_" + "x" * 24).tier == "gold.v2_" + "x" * 24


def test_names_with_a_trailing_newline_are_refused():
    for what in ("adapter", "tenant", "tier"):
        with pytest.raises(InvalidNameError):
            check_name("acme\n", what)
        assert check_name("acme", what) == "acme"
