"""The adapter registry on SQLite and PostgreSQL: migrations, register / resolve / list / delete,
visibility, versions, and that a refused or failed upload leaves nothing behind."""
from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from conftest import ADAPTER_FILES as FILES
from conftest import adapter_files as files_of
from conftest import write_peft_adapter
from loramux.adapters.blob import unpack
from loramux.adapters.registry import AdapterNotFoundError, AdapterRegistry, InvalidNameError
from loramux.adapters.store import FileStore, blob_key
from loramux.adapters.validation import AdapterValidationError
from loramux.db import Adapter, AdapterVersion
from loramux.tenancy import TenantExistsError


@pytest.fixture(scope="module")
def base_cfg(tiny_cfg):
    return tiny_cfg


@pytest.fixture
def registry(database, base_cfg, tmp_path):
    return AdapterRegistry(database, FileStore(tmp_path / "blobs"), base_cfg, "tiny-llama")


def adapter_files(tmp_path, cfg, seed: int, rank: int = 4, targets=("q_proj", "v_proj")) -> dict:
    path = write_peft_adapter(tmp_path / f"adapter-{seed}-{rank}", cfg, rank, list(targets), seed=seed)
    return files_of(path)


def row_counts(registry) -> tuple[int, int]:
    with registry.db.session() as s:
        return (s.scalar(select(func.count()).select_from(Adapter)),
                s.scalar(select(func.count()).select_from(AdapterVersion)))


def test_migrations_match_the_models_and_downgrade_cleanly(database):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import inspect

    from loramux.db import Base

    with database.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    assert database.current_revision() == "0003"
    database.downgrade("base")
    assert set(inspect(database.engine).get_table_names()) <= {"alembic_version"}
    database.upgrade()
    assert {"tenants", "adapters", "adapter_versions", "tiers", "api_keys", "admin_keys", "prices", "ledger"} <= set(
        inspect(database.engine).get_table_names())


def test_register_resolve_list_versions(registry, base_cfg, tmp_path):
    acme = registry.tenancy.create_tenant("acme", tier="premium")
    v1 = registry.register(acme.id, "support-bot", adapter_files(tmp_path, base_cfg, seed=1))
    assert (v1.name, v1.version, v1.rank, v1.target_modules) == ("support-bot", 1, 4, ("q_proj", "v_proj"))
    assert v1.adapter_id.startswith("ad_") and len(v1.digest) == 64
    for ref in ("support-bot", v1.adapter_id, "acme/support-bot", "support-bot@1"):
        assert registry.resolve(acme.id, ref) == v1
    blob = registry.store.get(v1.storage_key)
    adapter = unpack(blob, "support-bot", v1.digest)
    assert adapter.rank == 4
    assert set(adapter.weights) == {(layer, t) for layer in range(2) for t in ("q_proj", "v_proj")}

    v2 = registry.register(acme.id, "support-bot", adapter_files(tmp_path, base_cfg, seed=2, rank=8))
    assert (v2.adapter_id, v2.version, v2.rank) == (v1.adapter_id, 2, 8) and v2.digest != v1.digest
    assert registry.resolve(acme.id, "support-bot") == v2  # later requests use the new version
    assert registry.resolve(acme.id, "support-bot@1") == v1
    assert [v.version for v in registry.versions(acme.id, "support-bot")] == [1, 2]
    assert registry.register(acme.id, "support-bot", adapter_files(tmp_path, base_cfg, seed=2, rank=8)) == v2
    assert [v.label for v in registry.list(acme.id)] == ["support-bot@2"]
    assert row_counts(registry) == (1, 2)


def test_private_adapters_are_invisible_exactly_like_unknown_ones(registry, base_cfg, tmp_path):
    acme, globex = registry.tenancy.create_tenant("acme"), registry.tenancy.create_tenant("globex")
    private = registry.register(acme.id, "secret", adapter_files(tmp_path, base_cfg, seed=1))
    public = registry.register(acme.id, "shared", adapter_files(tmp_path, base_cfg, seed=2), visibility="public")
    messages = []
    for ref in ("secret", private.adapter_id, "acme/secret", "does-not-exist", "ad_0000000000000000", "x@y", ""):
        with pytest.raises(AdapterNotFoundError) as info:
            registry.resolve(globex.id, ref)
        messages.append(str(info.value).replace(repr(ref), "REF"))
    assert set(messages) == {"adapter REF not found"}
    assert registry.resolve(globex.id, "acme/shared") == public
    assert registry.resolve(globex.id, public.adapter_id) == public
    assert [v.name for v in registry.list(globex.id)] == ["shared"]
    assert [v.name for v in registry.list(acme.id)] == ["secret", "shared"]
    with pytest.raises(AdapterNotFoundError):  # public is usable, not changeable, by others
        registry.delete(globex.id, "acme/shared")
    registry.set_visibility(acme.id, "shared", "private")
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(globex.id, "acme/shared")


def test_names_are_checked(registry, base_cfg, tmp_path):
    acme = registry.tenancy.create_tenant("acme")
    with pytest.raises(TenantExistsError):
        registry.tenancy.create_tenant("acme")
    files = adapter_files(tmp_path, base_cfg, seed=1)
    for bad in ("", "../etc", "base", "ad_123", "a/b", "x" * 129, " lead"):
        with pytest.raises(InvalidNameError):
            registry.register(acme.id, bad, files)
    with pytest.raises(InvalidNameError, match="visibility"):
        registry.register(acme.id, "ok", files, visibility="everyone")
    assert row_counts(registry) == (0, 0) and registry.store.list_keys() == []


def test_a_refused_upload_leaves_nothing(registry, base_cfg, tmp_path):
    acme = registry.tenancy.create_tenant("acme")
    files = adapter_files(tmp_path, base_cfg, seed=1)
    bad_config = tmp_path / "bad.json"
    bad_config.write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], '
                          '"auto_map": {"AutoModel": "evil.Model"}}')
    cases = [
        {**files, "adapter_config.json": bad_config},
        {**files, "adapter_model.safetensors": b"\x80\x04\x95not really a pickle"},
        {"../adapter_config.json": files["adapter_config.json"], FILES[1]: files[FILES[1]]},
        {FILES[0]: files[FILES[0]], FILES[1]: b"\x10\x00\x00\x00\x00\x00\x00\x00{}"},
    ]
    for case in cases:
        with pytest.raises(AdapterValidationError):
            registry.register(acme.id, "bot", case)
    assert row_counts(registry) == (0, 0) and registry.store.list_keys() == []


def test_a_failed_commit_removes_the_blob(registry, base_cfg, tmp_path, monkeypatch):
    acme = registry.tenancy.create_tenant("acme")

    def broken(*args, **kwargs):
        raise RuntimeError("database went away")

    monkeypatch.setattr(registry, "_insert_version", broken)
    with pytest.raises(RuntimeError, match="database went away"):
        registry.register(acme.id, "bot", adapter_files(tmp_path, base_cfg, seed=1))
    assert row_counts(registry) == (0, 0) and registry.store.list_keys() == []


def test_delete_is_soft_for_rows_and_hard_for_unused_blobs(registry, base_cfg, tmp_path):
    acme, globex = registry.tenancy.create_tenant("acme"), registry.tenancy.create_tenant("globex")
    dropped = []
    registry.on_blob_deleted(dropped.append)
    files = adapter_files(tmp_path, base_cfg, seed=1)
    mine = registry.register(acme.id, "bot", files)
    twin = registry.register(globex.id, "bot", files)  # the same bytes uploaded by another tenant
    assert twin.digest == mine.digest and twin.adapter_id != mine.adapter_id
    other = registry.register(acme.id, "other", adapter_files(tmp_path, base_cfg, seed=2))

    assert [v.version for v in registry.delete(acme.id, "bot")] == [1]
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(acme.id, "bot")
    assert registry.store.exists(mine.storage_key) and dropped == []  # globex still uses these bytes
    registry.delete(globex.id, "bot")
    assert not registry.store.exists(mine.storage_key) and dropped == [mine.digest]
    assert registry.store.list_keys() == [other.storage_key]
    assert row_counts(registry) == (3, 3)  # soft: history (and billing) keep their rows
    again = registry.register(acme.id, "bot", adapter_files(tmp_path, base_cfg, seed=3))
    assert again.version == 1 and again.adapter_id != mine.adapter_id  # a deleted name can be reused


def test_concurrent_uploads_of_one_name_get_distinct_versions(registry, base_cfg, tmp_path):
    acme = registry.tenancy.create_tenant("acme")
    uploads = [adapter_files(tmp_path, base_cfg, seed=s) for s in range(4)]
    results, errors = [], []

    def upload(files):
        try:
            results.append(registry.register(acme.id, "bot", files))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=upload, args=(f,)) for f in uploads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(v.version for v in results) == [1, 2, 3, 4]
    assert len({v.adapter_id for v in results}) == 1


def test_db_gc_deletes_only_unreferenced_blobs(database, base_cfg, tmp_path, monkeypatch, capsys):
    from loramux.cli import main

    store = FileStore(tmp_path / "blobs")
    registry = AdapterRegistry(database, store, base_cfg, "tiny-llama")
    live = registry.register(registry.tenancy.create_tenant("acme").id, "bot", adapter_files(tmp_path, base_cfg, 1))
    orphan = blob_key("0" * 64)
    store.put(orphan, b"left behind by a store outage during a delete")
    monkeypatch.setenv("LORAMUX_STORE_URL", f"file://{tmp_path / 'blobs'}")
    assert main(["db", "gc", "--url", database.url]) == 0
    assert capsys.readouterr().out.split() == ["deleted", orphan]
    assert store.list_keys("blobs/") == [live.storage_key]

