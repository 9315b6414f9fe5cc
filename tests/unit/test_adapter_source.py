"""Fetching an adapter directory for import (`loramux.adapters.storage.adapter_source`) and the resolver's
memory of misses (`loramux.services.adapter_resolver`), without a server: the object store is a FileStore
standing in for S3, the clock a fake."""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from loramux.adapters.storage.adapter_source import (
    SourceInvalid,
    SourceNotFound,
    SourceUnavailable,
    fetch_adapter,
    join_location,
    parse_roots,
)
from loramux.adapters.storage.store import FileStore, StoreUnavailableError
from loramux.services import adapter_resolver
from loramux.services.adapter_resolver import AdapterResolver, ResolverMiss, ResolverNameInvalid, check_resolver_url
from loramux.settings import Settings

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapter_dir(path: Path, weights: bytes = b"w" * 100, files=(CONFIG, WEIGHTS)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in files:
        (path / name).write_bytes(b"{}" if name == CONFIG else weights)
    return path


def s3_as_files(root: Path):
    """An `open_s3` whose s3://bucket/prefix is the directory root/bucket/prefix."""
    def open_s3(url: str) -> FileStore:
        return FileStore(root / url[len("s3://"):].strip("/"))
    return open_s3


def fetch(location: str, dest: Path, roots=(), open_s3=None, cap: int = 1000) -> dict[str, Path]:
    return fetch_adapter(location, dest, roots=list(roots), open_s3=open_s3 or s3_as_files(dest / "never"),
                         max_weights_bytes=cap)


def test_an_s3_prefix_is_fetched_and_judged_before_anything_is_downloaded(tmp_path):
    store_root, dest = tmp_path / "s3", tmp_path / "dest"
    dest.mkdir()
    adapter_dir(store_root / "bucket" / "ok")
    adapter_dir(store_root / "bucket" / "big", weights=b"w" * 2000)
    adapter_dir(store_root / "bucket" / "pickled", files=(CONFIG, "adapter_model.bin"))
    adapter_dir(store_root / "bucket" / "config-only", files=(CONFIG,))
    open_s3 = s3_as_files(store_root)

    files = fetch("s3://bucket/ok/", dest, open_s3=open_s3)
    assert sorted(files) == [CONFIG, WEIGHTS] and files[WEIGHTS].read_bytes() == b"w" * 100
    with pytest.raises(SourceNotFound, match="adapter_config.json is missing"):
        fetch("s3://bucket/absent/", dest, open_s3=open_s3)
    with pytest.raises(SourceInvalid, match="pickle weights"):
        fetch("s3://bucket/pickled", dest, open_s3=open_s3)
    with pytest.raises(SourceInvalid, match="no adapter_model.safetensors"):
        fetch("s3://bucket/config-only", dest, open_s3=open_s3)
    (dest / WEIGHTS).unlink()
    with pytest.raises(SourceInvalid, match="at most 1000"):
        fetch("s3://bucket/big", dest, open_s3=open_s3)
    assert not (dest / WEIGHTS).exists()  # the oversized download is not left behind
    with pytest.raises(SourceInvalid, match="'..'"):
        fetch("s3://bucket/ok/../big", dest, open_s3=open_s3)

    class Down:
        def list_keys(self, prefix=""):
            raise StoreUnavailableError("timed out")

    with pytest.raises(SourceUnavailable, match="retry later"):
        fetch("s3://bucket/ok", dest, open_s3=lambda url: Down())


def test_local_directories_must_be_under_a_root_and_stay_there(tmp_path):
    root, dest, outside = tmp_path / "root", tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    adapter_dir(root / "a")
    adapter_dir(outside)
    (root / "link-out").symlink_to(outside, target_is_directory=True)
    leaky = adapter_dir(root / "leaky", files=(CONFIG,))
    (leaky / WEIGHTS).symlink_to(outside / WEIGHTS)  # one file leading out of the root
    roots = parse_roots(f" {root} ,")

    assert sorted(fetch(str(root / "a"), dest, roots)) == [CONFIG, WEIGHTS]
    assert sorted(fetch((root / "a").as_uri(), dest, roots)) == [CONFIG, WEIGHTS]
    for location, words in ((str(outside), "not under an allowed root"),
                            (str(root / "link-out"), "not under an allowed root"),
                            (str(root / "leaky"), "leads outside the allowed roots"),
                            (f"{root}/../outside", "'..'"),
                            ("root/a", "absolute"),
                            ("file://host/dir", "local directories"),
                            ("ftp://x/y", "unsupported"),
                            ("", "empty"),
                            ("/a\nb", "control characters")):
        with pytest.raises(SourceInvalid, match=words):
            fetch(location, dest, roots)
    with pytest.raises(SourceNotFound):
        fetch(str(root / "missing"), dest, roots)
    with pytest.raises(SourceInvalid, match="LORAMUX_ADAPTER_IMPORT_ROOTS"):
        fetch(str(root / "a"), dest, roots=())
    with pytest.raises(ValueError, match="absolute"):
        parse_roots("relative/dir")


def test_locations_are_joined_from_plain_names_only():
    assert join_location("s3://b/p/", "acme", "bot") == "s3://b/p/acme/bot/"
    assert join_location("file:///srv/a", "acme", "bot") == "file:///srv/a/acme/bot/"
    for bad in ("..", ".", "", "a/b", "a\\b"):
        with pytest.raises(SourceInvalid):
            join_location("s3://b/p/", "acme", bad)
    for url in ("s3://bucket/prefix/", "file:///srv/adapters/"):
        assert check_resolver_url(url) == url
    for url in ("http://x/y", "s3://", "file://relative/dir", "s3://user@bucket/p"):
        with pytest.raises(ValueError, match="LORAMUX_ADAPTER_RESOLVER"):
            check_resolver_url(url)


def test_the_resolver_remembers_a_miss_until_it_expires(tmp_path, monkeypatch):
    now = [100.0]
    fetched: list[tuple[str, str]] = []

    def fake_fetch(services, tenant, name, location, roots):
        fetched.append((name, location))
        if name == "later":
            from loramux.adapters.storage.adapter_source import SourceNotFound as Missing
            if len(fetched) < 3:
                raise Missing("not yet")
        return SimpleNamespace(label=f"{name}@1", name=name)

    def not_registered(tenant_id, name):
        from loramux.adapters.storage.registry import AdapterNotFoundError
        raise AdapterNotFoundError(name)

    monkeypatch.setattr(adapter_resolver, "fetch_and_register", fake_fetch)
    registry = SimpleNamespace(resolve=not_registered, was_deleted=lambda tenant_id, name: name == "unloaded")
    services = SimpleNamespace(tenancy=SimpleNamespace(tenant=lambda ref: SimpleNamespace(id=ref)), registry=registry,
                               settings=Settings(s3_endpoint_url="http://127.0.0.1:9"))
    resolver = AdapterResolver(services, "s3://bucket/prefix/", miss_ttl_s=30, clock=lambda: now[0])
    with pytest.raises(ValueError):  # a bucket name S3 cannot have fails at the start, not on each request
        AdapterResolver(services, "s3://Bad_Bucket!/p/")

    async def scenario():
        with pytest.raises(ResolverMiss):
            await resolver.resolve("t1", "acme", "later")
        with pytest.raises(ResolverMiss):  # remembered: no second fetch
            await resolver.resolve("t1", "acme", "later")
        assert len(fetched) == 1 and fetched[0][1] == "s3://bucket/prefix/acme/later/"
        now[0] += 31
        with pytest.raises(ResolverMiss):  # expired: fetched again, missing again
            await resolver.resolve("t1", "acme", "later")
        now[0] += 31
        assert (await resolver.resolve("t1", "acme", "later")).label == "later@1"  # it appeared meanwhile
        results = await asyncio.gather(*(resolver.resolve("t1", "acme", "new") for _ in range(8)))
        assert {r.label for r in results} == {"new@1"}
        for hostile in ("../x", "a/./b", "x\\y", "-x"):
            with pytest.raises(ResolverNameInvalid):
                await resolver.resolve("t1", "acme", hostile)
        for reference in ("ad_123", "x@2", "other/name", "base"):
            with pytest.raises((ResolverMiss, ResolverNameInvalid)):
                await resolver.resolve("t1", "acme", reference)
        with pytest.raises(ResolverMiss, match="unloaded or deleted"):  # unloaded stays unloaded
            await resolver.resolve("t1", "acme", "unloaded")

    asyncio.run(scenario())
    assert [name for name, _ in fetched] == ["later", "later", "later", "new"]
    assert resolver.lookups == 4
