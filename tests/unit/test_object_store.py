"""The object store interface: the same behaviour on a directory (file://) and on S3 (a moto server),
plus S3 faults: an unreachable endpoint, a server that never answers, and recovery after a restart."""
from __future__ import annotations

import hashlib
import os
import socketserver
import threading
import time
import uuid
from pathlib import Path

import pytest

from loramux.adapters.storage.store import (
    BlobNotFoundError,
    FileStore,
    ObjectStore,
    S3Store,
    StoreError,
    StoreUnavailableError,
    blob_key,
    open_store,
)
from loramux.testing import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    free_port,
    moto_create_bucket,
    start_moto_server,
    stop_moto_server,
)

DIGEST = hashlib.sha256(b"adapter").hexdigest()
FAST = {"timeout_s": 0.5, "max_attempts": 1}
SLACK_S = 2.5  # allowance on top of timeout_s * max_attempts for client creation and a loaded machine


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> ObjectStore:
    if request.param == "file":
        return FileStore(tmp_path / "blobs")
    return request.getfixturevalue("s3_store")


def no_temp_files(folder: Path) -> bool:
    return not [p.name for p in folder.iterdir() if p.name.startswith(".")]


# --- the shared behaviour -------------------------------------------------------------------------

def test_round_trip(store, tmp_path):
    key = blob_key(DIGEST)
    assert isinstance(store, ObjectStore)
    assert not store.exists(key)
    store.put(key, b"weights")
    store.put("meta/a.json", b"{}")
    store.put("meta/b.json", bytearray(b"[]"))
    assert store.exists(key)
    assert store.get(key) == b"weights"

    dest = tmp_path / "cache" / "sub" / "blob.bin"
    assert store.get_to_file(key, dest) == len(b"weights")
    assert dest.read_bytes() == b"weights"
    assert no_temp_files(dest.parent)

    assert store.list_keys() == sorted([key, "meta/a.json", "meta/b.json"])
    assert store.list_keys("meta/") == ["meta/a.json", "meta/b.json"]
    assert store.list_keys("meta/a") == ["meta/a.json"]
    assert store.list_keys("blobs/sha256/") == [key]
    assert store.list_keys("nothing/here") == []

    store.delete(key)
    assert not store.exists(key)
    store.delete(key)  # a missing key is not an error
    assert store.list_keys() == ["meta/a.json", "meta/b.json"]
    assert store.counters["put"] == 3 and store.counters["delete"] == 2 and store.counters["get"] == 1
    assert "secret" not in store.url and store.url.startswith(("file://", "s3://"))


def test_put_from_path_overwrites_atomically(store, tmp_path):
    """Readers racing a series of overwrites from files only ever see one whole version."""
    size = 256 << 10
    versions = {bytes([65 + i]) * size for i in range(4)}
    sources = []
    for i, payload in enumerate(sorted(versions)):
        sources.append(tmp_path / f"v{i}.bin")
        sources[-1].write_bytes(payload)
    key = "adapters/overwritten.bin"
    store.put(key, sources[0])

    seen, bad, done = [], [], threading.Event()

    def reader():
        while not done.is_set() or not (seen or bad):
            data = store.get(key)
            (seen if data in versions else bad).append(len(data))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(3):
            for source in sources[1:] + sources[:1]:
                store.put(key, source)
    finally:
        done.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert seen and not bad
    assert store.get(key) == sources[0].read_bytes()
    if isinstance(store, FileStore):
        assert store.list_keys() == [key]  # no temp files left or listed
        assert no_temp_files(store.root / "adapters")


def test_failed_put_keeps_the_old_object(store, tmp_path):
    store.put("k", b"old")
    with pytest.raises(FileNotFoundError):
        store.put("k", tmp_path / "no-such-source.bin")
    with pytest.raises(TypeError):
        store.put("k", "a str is neither bytes nor a Path")
    assert store.get("k") == b"old"


def test_missing_key(store, tmp_path):
    with pytest.raises(BlobNotFoundError):
        store.get("absent/key")
    dest = tmp_path / "out" / "x.bin"
    with pytest.raises(BlobNotFoundError):
        store.get_to_file("absent/key", dest)
    assert not dest.exists()
    if dest.parent.exists():
        assert list(dest.parent.iterdir()) == []
    assert not store.exists("absent/key")
    store.delete("absent/key")
    assert issubclass(BlobNotFoundError, StoreError) and issubclass(StoreError, RuntimeError)


def test_check(store):
    store.check()
    assert store.counters["check"] == 1


@pytest.mark.parametrize("bad", ["../x", "a/../../x", "a/..", "/etc/passwd", "a\\b", "", "a//b", "./a", "a/",
                                 "a/./b", "nul\x00byte", "line\nbreak", ".loramux-tmp-x"])
def test_keys_that_escape_or_are_malformed_are_rejected(store, bad, tmp_path):
    for call in (lambda: store.put(bad, b"x"), lambda: store.get(bad), lambda: store.exists(bad),
                 lambda: store.delete(bad), lambda: store.get_to_file(bad, tmp_path / "o")):
        with pytest.raises(ValueError):
            call()


@pytest.mark.parametrize("bad", ["../", "a/../b", "/abs", "a\\b", ".."])
def test_list_prefix_that_escapes_is_rejected(store, bad):
    with pytest.raises(ValueError):
        store.list_keys(bad)


def test_file_store_rejects_a_symlink_out_of_the_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    store = FileStore(tmp_path / "root")
    (store.root / "link").symlink_to(outside)
    with pytest.raises(ValueError):
        store.get("link/secret")
    with pytest.raises(ValueError):
        store.put("link/new", b"x")
    assert not (outside / "new").exists()


def test_file_store_check_fails_when_the_root_is_gone(tmp_path):
    store = FileStore(tmp_path / "root")
    store.check()
    store.root.rmdir()
    with pytest.raises(StoreUnavailableError):
        store.check()


# --- blob keys and URLs ---------------------------------------------------------------------------

def test_blob_key():
    assert blob_key(DIGEST) == f"blobs/sha256/{DIGEST[:2]}/{DIGEST}"


@pytest.mark.parametrize("bad", [DIGEST.upper(), DIGEST[:-1], DIGEST + "0", "g" * 64, DIGEST[:-1] + "\n",
                                 f"../{DIGEST[3:]}", "", None, 123, DIGEST.encode()])
def test_blob_key_rejects_anything_but_a_sha256_hexdigest(bad):
    with pytest.raises(ValueError):
        blob_key(bad)


def test_open_store_file_urls(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path}/abs/dir")
    assert isinstance(store, FileStore) and store.root == (tmp_path / "abs" / "dir").resolve()
    assert store.root.is_dir() and store.url == store.root.as_uri()
    monkeypatch.chdir(tmp_path)
    store = open_store("file://relative/dir")
    assert isinstance(store, FileStore) and store.root == tmp_path.resolve() / "relative" / "dir"
    assert store.root.is_dir()


def test_open_store_s3_urls():
    store = open_store("s3://my-bucket/some/prefix/", endpoint_url="http://127.0.0.1:9", region="eu-west-1",
                       access_key_id="AKIDEXAMPLE", secret_access_key="very-secret-value", timeout_s=3.0)
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == ("my-bucket", "some/prefix", "s3://my-bucket/some/prefix")
    assert store.timeout_s == 3.0 and store.region == "eu-west-1"
    assert "very-secret-value" not in repr(store) and "very-secret-value" not in str(vars(store))
    store = open_store("s3://my-bucket")
    assert (store.prefix, store.url) == ("", "s3://my-bucket")


@pytest.mark.parametrize("url", ["http://example.com/x", "gs://bucket", "/just/a/path", "relative", "file:/x",
                                 "", "s3s://bucket", "ftp://h/p"])
def test_open_store_rejects_unknown_schemes_and_lists_the_supported_ones(url):
    with pytest.raises(ValueError) as info:
        open_store(url)
    assert "file://" in str(info.value) and "s3://" in str(info.value)


@pytest.mark.parametrize("url", ["file://", "s3://", "s3:///prefix", "s3://AKID:hunter2secret@bucket/p",
                                 "s3://bucket:hunter2secret/p", "s3://bucket/p?token=hunter2secret",
                                 "s3://Bad_Bucket/p", "s3://b/p/../q"])
def test_open_store_rejects_malformed_urls_without_echoing_secrets(url):
    with pytest.raises(ValueError) as info:
        open_store(url)
    assert "hunter2secret" not in str(info.value)


# --- S3 specifics ---------------------------------------------------------------------------------

def test_s3_prefix_isolates_keys(moto_server, s3_store):
    scoped = S3Store(s3_store.bucket, "tenant-a/", endpoint_url=moto_server, region=MOTO_REGION, **MOTO_CREDENTIALS)
    assert scoped.url == f"s3://{s3_store.bucket}/tenant-a"
    scoped.put("x/1", b"one")
    s3_store.put("x/2", b"two")
    assert scoped.list_keys() == ["x/1"] and scoped.list_keys("x/") == ["x/1"]
    assert s3_store.list_keys() == ["tenant-a/x/1", "x/2"]
    assert s3_store.get("tenant-a/x/1") == b"one"
    assert not scoped.exists("x/2")


def test_s3_multipart_upload_from_a_file(s3_store, tmp_path):
    s3_store.multipart_threshold = s3_store.part_size = 5 << 20  # S3's smallest part
    source = tmp_path / "big.bin"
    payload = os.urandom(11 << 20)  # three parts
    source.write_bytes(payload)
    s3_store.put("big", source)
    assert s3_store.get("big") == payload
    assert s3_store.get_to_file("big", tmp_path / "copy.bin") == len(payload)
    assert (tmp_path / "copy.bin").read_bytes() == payload


def test_s3_missing_bucket_fails_check_and_is_not_a_missing_blob(moto_server):
    store = S3Store(f"loramux-absent-{uuid.uuid4().hex[:12]}", endpoint_url=moto_server, region=MOTO_REGION,
                    **MOTO_CREDENTIALS)
    with pytest.raises(StoreUnavailableError):
        store.check()
    with pytest.raises(StoreError) as info:
        store.get("k")
    assert not isinstance(info.value, BlobNotFoundError)


def test_s3_client_is_created_once_under_concurrency(moto_server, s3_store):
    store = S3Store(s3_store.bucket, endpoint_url=moto_server, region=MOTO_REGION, **MOTO_CREDENTIALS)
    made, make = [], store._make_client

    def counting_make():
        made.append(1)
        return make()

    store._make_client = counting_make
    barrier, results = threading.Barrier(8), []

    def probe():
        barrier.wait()
        results.append(store.exists("nothing"))

    threads = [threading.Thread(target=probe) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [False] * 8 and len(made) == 1
    assert store.counters["exists"] == 8


# --- S3 faults ------------------------------------------------------------------------------------

class _Silent(socketserver.BaseRequestHandler):
    def handle(self):
        self.server.release.wait(30)  # accept, read nothing, answer nothing


class _SilentServer(socketserver.ThreadingTCPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Silent)
        self.release, self.connections = threading.Event(), 0

    def verify_request(self, request, client_address):  # runs in the accept loop, before the handler
        self.connections += 1
        return True


@pytest.fixture
def silent_server():
    server = _SilentServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


SECRET = "do-not-leak-this-secret-1234"


@pytest.mark.parametrize("op", ["get", "put", "check"])
def test_s3_unreachable_endpoint_is_unavailable_quickly(op):
    # free_port(): a port nothing listens on
    store = S3Store("bucket", endpoint_url=f"http://127.0.0.1:{free_port()}", region=MOTO_REGION,
                    access_key_id="AKIDEXAMPLE", secret_access_key=SECRET, **FAST)
    call = {"get": lambda: store.get("k"), "put": lambda: store.put("k", b"x"), "check": store.check}[op]
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        call()
    assert time.monotonic() - start < FAST["timeout_s"] * FAST["max_attempts"] + SLACK_S
    assert SECRET not in str(info.value) and SECRET not in repr(store)


@pytest.mark.parametrize("attempts", [1, 2])
def test_s3_server_slower_than_the_read_timeout_is_unavailable(silent_server, tmp_path, attempts):
    endpoint = f"http://127.0.0.1:{silent_server.server_address[1]}"
    timeout_s = FAST["timeout_s"]
    store = S3Store("bucket", endpoint_url=endpoint, region=MOTO_REGION, **MOTO_CREDENTIALS, timeout_s=timeout_s,
                    max_attempts=attempts)
    calls = (lambda: store.get("k"), lambda: store.get_to_file("k", tmp_path / "o"), store.check)
    for n, call in enumerate(calls, start=1):
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="ReadTimeout"):
            call()
        elapsed = time.monotonic() - start
        assert timeout_s * attempts * 0.8 <= elapsed < timeout_s * attempts + SLACK_S
        assert silent_server.connections == n * attempts  # max_attempts counts every try, the first included
    assert not (tmp_path / "o").exists()


def test_s3_store_recovers_after_the_server_restarts():
    server = start_moto_server()
    port = server.get_host_and_port()[1]
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"loramux-restart-{uuid.uuid4().hex[:12]}"
    try:
        moto_create_bucket(endpoint, bucket)
        store = S3Store(bucket, endpoint_url=endpoint, region=MOTO_REGION, **MOTO_CREDENTIALS, **FAST)
        store.put("k", b"v1")
        assert store.get("k") == b"v1"
    finally:
        stop_moto_server(server)

    with pytest.raises(StoreUnavailableError):
        store.get("k")
    with pytest.raises(StoreUnavailableError):
        store.check()

    server = start_moto_server(port)
    try:
        moto_create_bucket(endpoint, bucket)  # in-process moto keeps its state; creating again is harmless
        store.check()
        store.put("k", b"v2")
        assert store.get("k") == b"v2"
    finally:
        stop_moto_server(server)
