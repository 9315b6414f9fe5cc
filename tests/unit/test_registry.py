"""The adapter registry on SQLite and PostgreSQL: migrations, register / resolve / list / delete,
visibility, versions, and that a refused or failed upload leaves nothing behind."""
from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import event, func, select, text, update

from conftest import ADAPTER_FILES as FILES
from conftest import adapter_files as files_of
from loramux.adapters.formats.validation import AdapterValidationError
from loramux.adapters.storage.blob import unpack
from loramux.adapters.storage.registry import AdapterNotFoundError, AdapterRegistry, InvalidNameError, collect_garbage
from loramux.adapters.storage.store import FileStore, blob_key
from loramux.db import Adapter, AdapterVersion
from loramux.db.models import AdapterBlob, utcnow
from loramux.tenancy.tenants import Tenancy, TenantExistsError
from loramux.testing import write_peft_adapter
from polling import wait_until


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
    assert database.current_revision() == "0014"
    limits = {t.name: t.max_choices for t in Tenancy(database).tiers()}
    assert limits == {"free": 2, "standard": 8, "premium": 16}
    with database.engine.connect() as conn:
        fanout = dict(conn.execute(text("SELECT name, max_fanout FROM tiers")).all())
    assert fanout == {"free": 2, "standard": 8, "premium": 16}
    database.downgrade("base")
    assert set(inspect(database.engine).get_table_names()) <= {"alembic_version"}
    database.upgrade()
    assert {"tenants", "adapters", "adapter_versions", "tiers", "api_keys", "admin_keys", "prices", "ledger",
            "adapter_blobs", "medusa_heads"} <= set(inspect(database.engine).get_table_names())
    database.downgrade("0013")  # 0014 alone goes down and up again
    assert {"budgets", "budget_spend", "budget_holds", "webhooks", "webhook_events"}.isdisjoint(
        inspect(database.engine).get_table_names())
    assert "tags" not in {c["name"] for c in inspect(database.engine).get_columns("ledger")}
    database.upgrade()
    database.downgrade("0012")  # 0013 alone goes down and up again
    assert {"part", "composition"}.isdisjoint(c["name"] for c in inspect(database.engine).get_columns("ledger"))
    assert "provenance" not in {c["name"] for c in inspect(database.engine).get_columns("adapter_versions")}
    database.upgrade()
    database.downgrade("0011")  # 0012 alone goes down and up again
    assert "medusa_heads" not in set(inspect(database.engine).get_table_names())
    database.downgrade("0010")  # 0011 alone goes down and up again
    assert "max_adapter_head_bytes" not in {c["name"] for c in inspect(database.engine).get_columns("tiers")}
    database.downgrade("0009")  # 0010 alone goes down and up again
    assert "summary" not in {c["name"] for c in inspect(database.engine).get_columns("adapter_versions")}
    database.downgrade("0008")  # 0009 alone goes down and up again
    assert "base_family" not in {c["name"] for c in inspect(database.engine).get_columns("adapter_versions")}
    database.downgrade("0007")  # 0008 alone goes down and up again
    assert "console_revoked_sessions" not in set(inspect(database.engine).get_table_names())
    database.downgrade("0006")  # 0007 alone goes down and up again
    assert "replica" not in {c["name"] for c in inspect(database.engine).get_columns("ledger")}
    database.downgrade("0005")  # 0006 alone goes down and up again
    assert "max_choices" not in {c["name"] for c in inspect(database.engine).get_columns("tiers")}
    database.downgrade("0004")  # 0005 alone goes down and up again
    assert "end_user" not in {c["name"] for c in inspect(database.engine).get_columns("ledger")}
    database.downgrade("0003")  # 0004 alone goes down and up again
    assert "adapter_blobs" not in inspect(database.engine).get_table_names()
    database.upgrade()
    assert database.current_revision() == "0014"
    assert "medusa_heads" in set(inspect(database.engine).get_table_names())
    assert {"end_user", "replica"} <= {c["name"] for c in inspect(database.engine).get_columns("ledger")}


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



# -- blob lifecycle: blobs are shared by digest, so a delete must never remove bytes an upload is about to use ----

def blob_rows(registry) -> list[tuple[str, int]]:
    with registry.db.session() as s:
        return [(r.digest, r.pending) for r in s.scalars(select(AdapterBlob))]


def test_a_delete_between_an_uploads_put_and_insert_keeps_the_shared_blob(registry, base_cfg, tmp_path, monkeypatch):
    """Forced interleaving: the last other user of the same bytes is deleted after the new upload wrote its
    blob and before it inserted its version row. The new version must still load."""
    acme, globex = registry.tenancy.create_tenant("acme"), registry.tenancy.create_tenant("globex")
    files = adapter_files(tmp_path, base_cfg, seed=1)
    old = registry.register(acme.id, "bot", files)
    dropped = []
    registry.on_blob_deleted(dropped.append)
    real_put = registry.store.put

    def put_then_delete_the_other(key, data):
        real_put(key, data)
        assert [v.version for v in registry.delete(acme.id, "bot")] == [1]

    monkeypatch.setattr(registry.store, "put", put_then_delete_the_other)
    new = registry.register(globex.id, "bot", files)
    monkeypatch.undo()
    assert new.digest == old.digest and new.storage_key == old.storage_key
    assert registry.store.exists(new.storage_key) and dropped == []
    current = registry.resolve(globex.id, "bot")
    assert unpack(registry.store.get(current.storage_key), "bot", current.digest).rank == 4
    assert blob_rows(registry) == [(new.digest, 0)]  # the reservation became the version row
    assert collect_garbage(registry.db, registry.store, grace_s=0) == []  # and the GC leaves it alone
    registry.delete(globex.id, "bot")  # the last user now: the blob goes
    assert not registry.store.exists(new.storage_key) and dropped == [new.digest] and blob_rows(registry) == []


def test_a_delete_that_runs_first_makes_a_racing_upload_wait_and_write_the_blob_again(registry, base_cfg, tmp_path,
                                                                                        monkeypatch):
    """The other order: the delete has decided and is removing the blob when an upload of the same bytes
    starts in another thread. The upload waits for the blob's row lock, then writes the blob again."""
    acme, globex = registry.tenancy.create_tenant("acme"), registry.tenancy.create_tenant("globex")
    files = adapter_files(tmp_path, base_cfg, seed=1)
    registry.register(acme.id, "bot", files)
    real_delete = registry.store.delete
    results, errors = [], []

    def upload():
        try:
            results.append(registry.register(globex.id, "bot", files))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    racer = threading.Thread(target=upload)
    reserving = threading.Event()
    backend = {}

    def see_the_upload_reserve(conn, cursor, statement, *_):
        if threading.current_thread() is racer and statement.lstrip().upper().startswith("UPDATE ADAPTER_BLOBS"):
            if conn.dialect.name == "postgresql":
                backend["pid"] = conn.connection.dbapi_connection.info.backend_pid
            reserving.set()

    def blocked_on_the_row_lock() -> bool:
        with registry.db.engine.connect() as conn:
            waiting_for = text("SELECT cardinality(pg_blocking_pids(:pid)) > 0")
            return conn.execute(waiting_for, {"pid": backend["pid"]}).scalar()

    def delete_while_an_upload_starts(key):
        racer.start()
        # The upload has validated and reached its reservation, which waits for the lock this delete holds.
        wait_until(reserving.is_set, "the upload to reach its blob reservation", 60)
        if "pid" in backend:  # PostgreSQL shows the wait; SQLite's busy wait cannot be seen, only reached
            wait_until(blocked_on_the_row_lock, "the upload to wait for the blob's row lock", 60)
        real_delete(key)

    event.listen(registry.db.engine, "before_cursor_execute", see_the_upload_reserve)
    monkeypatch.setattr(registry.store, "delete", delete_while_an_upload_starts)
    try:
        registry.delete(acme.id, "bot")
    finally:
        event.remove(registry.db.engine, "before_cursor_execute", see_the_upload_reserve)
    racer.join(timeout=60)
    monkeypatch.undo()
    assert errors == [] and len(results) == 1
    new = registry.resolve(globex.id, "bot")
    assert registry.store.exists(new.storage_key)
    assert unpack(registry.store.get(new.storage_key), "bot", new.digest).rank == 4


def test_gc_between_an_uploads_put_and_insert_keeps_the_blob(registry, base_cfg, tmp_path, monkeypatch):
    """`loramux db gc` running while an upload is between its put and its insert: the blob is no ready
    version's yet, but it is reserved, so the GC leaves it."""
    acme = registry.tenancy.create_tenant("acme")
    real_put = registry.store.put
    collected = []

    def put_then_gc(key, data):
        real_put(key, data)
        collected.extend(collect_garbage(registry.db, registry.store))

    monkeypatch.setattr(registry.store, "put", put_then_gc)
    version = registry.register(acme.id, "bot", adapter_files(tmp_path, base_cfg, seed=1))
    monkeypatch.undo()
    assert collected == [] and registry.store.exists(version.storage_key)
    assert unpack(registry.store.get(version.storage_key), "bot", version.digest).rank == 4


def test_gc_keeps_a_reserved_blob_for_the_grace_period_then_collects_it(registry, base_cfg, tmp_path, monkeypatch):
    """An upload that died between its put and its insert leaves a reserved blob: kept while the reservation
    is younger than the grace period (a live upload may be that slow), collected after it."""
    acme = registry.tenancy.create_tenant("acme")

    def die(*args, **kwargs):
        raise SystemExit("the upload process died")

    monkeypatch.setattr(registry, "_insert_version", die)
    monkeypatch.setattr(registry, "_after_failed_upload", lambda *args: None)  # a dead process cleans nothing
    with pytest.raises(SystemExit):
        registry.register(acme.id, "bot", adapter_files(tmp_path, base_cfg, seed=1))
    monkeypatch.undo()
    (key,) = registry.store.list_keys("blobs/")
    assert collect_garbage(registry.db, registry.store) == [] and registry.store.exists(key)
    with registry.db.session() as s:
        s.execute(update(AdapterBlob).values(updated_at=utcnow() - timedelta(hours=2)))
    assert collect_garbage(registry.db, registry.store, grace_s=3 * 3600) == []
    assert collect_garbage(registry.db, registry.store) == [key]  # the default grace period is one hour
    assert registry.store.list_keys() == [] and blob_rows(registry) == []


def test_a_failed_upload_keeps_a_blob_another_upload_has_reserved(registry, base_cfg, tmp_path, monkeypatch):
    acme = registry.tenancy.create_tenant("acme")
    files = adapter_files(tmp_path, base_cfg, seed=1)
    real_insert = registry._insert_version
    calls = []

    def second_upload_fails_while_the_first_is_between_put_and_insert(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            with pytest.raises(RuntimeError, match="database went away"):
                registry.register(acme.id, "other", files)  # the same bytes, failing
            assert registry.store.exists(args[4])  # this upload's reservation kept the blob
            return real_insert(*args, **kwargs)
        raise RuntimeError("database went away")

    monkeypatch.setattr(registry, "_insert_version", second_upload_fails_while_the_first_is_between_put_and_insert)
    version = registry.register(acme.id, "bot", files)
    monkeypatch.undo()
    assert registry.store.exists(version.storage_key) and blob_rows(registry) == [(version.digest, 0)]


@pytest.mark.parametrize("suffix", ["\u00b2", "\u0663", "1\u00b2", "99999999999999999999", "2147483648", "1 ",
                                    "-1", "+1", "0x1", "1.0"])
def test_a_version_that_is_not_a_plain_number_is_not_found(registry, base_cfg, tmp_path, suffix):
    acme = registry.tenancy.create_tenant("acme")
    registry.register(acme.id, "bot", adapter_files(tmp_path, base_cfg, seed=1))
    with pytest.raises(AdapterNotFoundError, match="not found"):
        registry.resolve(acme.id, f"bot@{suffix}")
    assert registry.resolve(acme.id, "bot@001").version == 1  # ASCII digits still work


def test_the_claimed_base_model_is_recorded_and_a_mismatch_can_be_allowed(registry, base_cfg, tmp_path):
    acme = registry.tenancy.create_tenant("acme")
    path = write_peft_adapter(tmp_path / "local", base_cfg, 4, ["q_proj", "v_proj"], seed=1)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/home/a/tiny"}))
    local = registry.register(acme.id, "local", files_of(path))
    assert (local.base_model, local.claimed_base_model) == ("tiny-llama", "/home/a/tiny")
    assert local.base_family == registry.resolve(acme.id, "local").base_family == "llama"
    assert registry.resolve(acme.id, "local").claimed_base_model == "/home/a/tiny"
    (path / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/other-model",
                                                          "r": 4, "lora_alpha": 3}))
    with pytest.raises(AdapterValidationError) as info:
        registry.register(acme.id, "local", files_of(path))
    assert info.value.code == "base_model_mismatch"
    allowed = registry.register(acme.id, "local", files_of(path), allow_base_mismatch=True)
    assert (allowed.version, allowed.claimed_base_model) == (2, "org/other-model")
    assert [v.claimed_base_model for v in registry.versions(acme.id, "local")] == ["/home/a/tiny", "org/other-model"]


def test_a_tier_caps_the_trained_heads_its_tenants_upload(registry, base_cfg, tmp_path):
    """A tier's max_adapter_head_bytes lowers the server's head limit for its tenants' uploads only; the refusal
    names the tier's setting and stores nothing."""
    import torch
    from safetensors.torch import load_file, save_file

    from loramux.tenancy.tenants import TierInfo

    path = write_peft_adapter(tmp_path / "headed", base_cfg, 4, ["q_proj"], seed=3)
    tensors = load_file(path / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.weight"] = torch.randn(base_cfg.vocab_size, base_cfg.hidden_size)
    save_file(tensors, path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    head_bytes = base_cfg.vocab_size * base_cfg.hidden_size * 4

    tenancy = registry.tenancy
    standard = tenancy.tier("standard")
    tenancy.upsert_tier(TierInfo(**{**standard.__dict__, "name": "small-heads", "max_adapter_head_bytes": 1 << 20}))
    small = tenancy.create_tenant("small", tier="small-heads")
    big = tenancy.create_tenant("big", tier="standard")
    with pytest.raises(AdapterValidationError) as refused:
        registry.register(small.id, "headed", files_of(path))
    assert refused.value.code == "head_too_large"
    assert "tier 'small-heads' max_adapter_head_bytes" in str(refused.value) and str(1 << 20) in str(refused.value)
    assert registry.list_all(small.id) == []
    version = registry.register(big.id, "headed", files_of(path))
    assert version.summary["heads"] == ["lm_head"] and version.summary["device_bytes"]["heads"] == head_bytes
