"""The object store behind one small interface: a local directory (``file://``) or S3 (``s3://``).

Adapter blobs live under server-made keys (`blob_key`), never under names taken from user input.
Both backends give the same guarantees: a `put` is atomic (readers see the old or the new object,
never a partial one), `get_to_file` writes its destination through a temporary file and a rename,
`delete` of a missing key is not an error, and every failure is one of three exception types:

- `BlobNotFoundError`: the key does not exist;
- `StoreUnavailableError`: unreachable, timed out, 5xx, throttled: the caller may retry later;
- `StoreError`: anything else (access denied, missing bucket, bad configuration, local disk error).

Errors on the caller's own local files (the source of a `put`, the destination of `get_to_file`) are
plain OSErrors. Messages name the operation, the key and the store URL, never credentials. boto3 is imported only
when an `S3Store` first talks to S3, so importing this module stays cheap.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

__all__ = [
    "StoreError", "StoreUnavailableError", "BlobNotFoundError", "ObjectStore", "FileStore", "S3Store",
    "blob_key", "open_store", "SUPPORTED_SCHEMES",
]

SUPPORTED_SCHEMES = ("file://", "s3://")
_CHUNK = 1 << 20
_TMP_MARK = ".loramux-tmp-"  # FileStore temp files; key segments may not start with it
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


class StoreError(RuntimeError):
    """Base of every object-store failure. Messages never contain credentials."""


class StoreUnavailableError(StoreError):
    """The store is unreachable, timed out, answered 5xx or throttled: retry later."""


class BlobNotFoundError(StoreError):
    """The key does not exist in the store."""


@runtime_checkable
class ObjectStore(Protocol):
    url: str  # e.g. "file:///data/blobs" or "s3://bucket/prefix" (never secrets)
    counters: collections.Counter

    def put(self, key: str, data: bytes | Path) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_to_file(self, key: str, dest: Path) -> int: ...

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def list_keys(self, prefix: str = "") -> list[str]: ...

    def check(self) -> None: ...


def blob_key(digest: str) -> str:
    """The server-made key of a blob from its sha256 hex digest: ``blobs/sha256/ab/abcdef...``."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise ValueError("blob digest must be 64 lowercase hex characters (a sha256 hexdigest)")
    return f"blobs/sha256/{digest[:2]}/{digest}"


def _check_key(key: str) -> str:
    """A key is a relative posix path: no empty, '.' or '..' segments, no backslash, no control chars."""
    if not isinstance(key, str) or not key:
        raise ValueError("object key must be a non-empty string")
    if len(key.encode("utf-8")) > 1024:
        raise ValueError("object key is longer than 1024 bytes")
    if key.startswith("/") or "\\" in key or any(ord(c) < 0x20 or c == "\x7f" for c in key):
        raise ValueError(f"invalid object key {key!r}: must be a relative posix path")
    for part in key.split("/"):
        if part in ("", ".", "..") or part.startswith(_TMP_MARK):
            raise ValueError(f"invalid object key {key!r}: empty, '.', '..' or reserved path segment")
    return key


def _check_prefix(prefix: str) -> str:
    """A listing prefix is "" or the start of a key (its last segment may be partial)."""
    if not isinstance(prefix, str):
        raise ValueError("list prefix must be a string")
    if not prefix:
        return prefix
    if prefix.startswith("/"):
        raise ValueError(f"invalid list prefix {prefix!r}: must be relative")
    head, _, last = prefix.rpartition("/")
    _check_key(f"{head}/x" if head else "x")  # every complete segment must be valid
    if last in (".", "..") or "\\" in last or any(ord(c) < 0x20 for c in last):
        raise ValueError(f"invalid list prefix {prefix!r}")
    return prefix


def _as_source(data: bytes | Path) -> bytes | Path:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, os.PathLike):
        return Path(data)
    raise TypeError(f"put() takes bytes or a Path, not {type(data).__name__}")


def fsync_dir(path: Path) -> None:
    """Make a rename or create in `path` durable (best effort: some filesystems cannot fsync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory
    finally:
        os.close(fd)


@contextmanager
def _atomic_file(dest: Path) -> Iterator[IO[bytes]]:
    """Yield a temp file next to `dest`; on success fsync it and rename it over `dest`, else remove it."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(dest.parent)


class _Secret:
    """Holds a credential; its repr never shows it (so neither do repr(store) nor vars(store))."""

    __slots__ = ("value",)

    def __init__(self, value: str | None):
        self.value = value

    def __repr__(self) -> str:
        return "<redacted>" if self.value is not None else "None"


class _Counted:
    """Per-store operation counters (for tests and metrics), incremented under a lock."""

    def __init__(self) -> None:
        self.counters: collections.Counter = collections.Counter()
        self._counter_lock = threading.Lock()

    def _count(self, op: str) -> None:
        with self._counter_lock:
            self.counters[op] += 1


class FileStore(_Counted):
    """Objects as files under one root directory (created if missing). Keys stay under the root."""

    def __init__(self, root: Path | str):
        super().__init__()
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store directory of {self.root.as_uri()}: "
                             f"{type(exc).__name__}") from exc
        self.url = self.root.as_uri()

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"

    def _path(self, key: str) -> Path:
        path = self.root / _check_key(key)
        resolved = path.resolve()  # a symlink inside the root must not lead out of it
        if resolved != self.root and self.root not in resolved.parents:
            raise ValueError(f"invalid object key {key!r}: resolves outside the store root")
        return path

    def _error(self, op: str, key: str, exc: OSError) -> StoreError:
        if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            return BlobNotFoundError(f"{op} {key!r}: no such object in {self.url}")
        return StoreError(f"{op} {key!r} on {self.url} failed: {type(exc).__name__} ({exc.strerror})")

    def put(self, key: str, data: bytes | Path) -> None:
        self._count("put")
        path, source = self._path(key), _as_source(data)
        src = open(source, "rb") if isinstance(source, Path) else None  # a bad source path: OSError as is
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_MARK)
            try:
                with os.fdopen(fd, "wb") as f:
                    if src is None:
                        f.write(source)
                    else:
                        shutil.copyfileobj(src, f, _CHUNK)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)  # readers see the old file or the new one, never a partial one
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
        except OSError as exc:
            raise StoreError(f"put {key!r} on {self.url} failed: {type(exc).__name__} ({exc.strerror})") from exc
        finally:
            if src is not None:
                src.close()
        fsync_dir(path.parent)

    def get(self, key: str) -> bytes:
        self._count("get")
        path = self._path(key)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise self._error("get", key, exc) from exc

    def get_to_file(self, key: str, dest: Path) -> int:
        self._count("get_to_file")
        path, dest = self._path(key), Path(dest)
        try:
            src = open(path, "rb")
        except OSError as exc:
            raise self._error("get_to_file", key, exc) from exc
        with src:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with _atomic_file(dest) as out:
                shutil.copyfileobj(src, out, _CHUNK)
                return out.tell()

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._count("delete")
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except (NotADirectoryError, IsADirectoryError):
            return  # no object under this key
        except OSError as exc:
            raise self._error("delete", key, exc) from exc

    def list_keys(self, prefix: str = "") -> list[str]:
        self._count("list_keys")
        prefix = _check_prefix(prefix)
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_MARK)]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(_TMP_MARK):
                    continue  # a put in progress (or one killed mid-write)
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def check(self) -> None:
        self._count("check")
        if not self.root.is_dir():
            raise StoreUnavailableError(f"store directory of {self.url} is missing")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailableError(f"store directory of {self.url} is not writable")


# S3 error codes that mean "retry later" (throttling, timeouts, server trouble).
_UNAVAILABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException", "RequestTimeout", "RequestTimeoutException",
    "ServiceUnavailable", "InternalError", "PriorRequestNotComplete",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_PART_CHECKSUMS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")


class S3Store(_Counted):
    """Objects in an S3 bucket (or an S3-compatible service at `endpoint_url`), under an optional prefix.

    The boto3 client is created on first use, once, under a lock (boto3 sessions are not thread-safe;
    a created client is). Uploads from a file larger than `multipart_threshold` go up as a multipart
    upload of `part_size` parts, which S3 makes visible only once complete (so still atomic).
    """

    multipart_threshold = 64 << 20
    part_size = 16 << 20
    _MAX_PARTS = 10_000

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, access_key_id: str | None = None,
                 secret_access_key: str | None = None, timeout_s: float = 10.0, max_attempts: int = 3):
        super().__init__()
        if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            _check_key(prefix)
        if (access_key_id is None) != (secret_access_key is None):
            raise ValueError("S3 credentials need both access_key_id and secret_access_key (or neither)")
        if timeout_s <= 0 or max_attempts < 1:
            raise ValueError("S3Store needs timeout_s > 0 and max_attempts >= 1")
        self.bucket, self.prefix = bucket, prefix
        self.endpoint_url, self.region = endpoint_url, region
        self.timeout_s, self.max_attempts = float(timeout_s), int(max_attempts)
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._access_key_id, self._secret_access_key = _Secret(access_key_id), _Secret(secret_access_key)
        self._client_lock = threading.Lock()
        self._client_obj = None

    def __repr__(self) -> str:
        where = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Store({self.url!r}{where})"

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def _client(self):
        client = self._client_obj
        if client is None:
            with self._client_lock:
                if self._client_obj is None:
                    self._client_obj = self._make_client()
                client = self._client_obj
        return client

    def _make_client(self):
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=self.timeout_s, read_timeout=self.timeout_s,
            # botocore's "max_attempts" counts retries after the first try; "total_max_attempts" counts
            # every try, which is what max_attempts means here (1 = no retry).
            retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        try:
            session = boto3.session.Session(aws_access_key_id=self._access_key_id.value,
                                            aws_secret_access_key=self._secret_access_key.value,
                                            region_name=self.region)
            return session.client("s3", endpoint_url=self.endpoint_url, config=config)
        except Exception as exc:  # bad endpoint URL, bad region, broken AWS config files
            raise StoreError(f"cannot create an S3 client for {self.url}: {type(exc).__name__}") from exc

    def _full_key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _map_error(self, exc: BaseException, op: str, key: str | None) -> StoreError | None:
        from botocore import exceptions as bce

        what = f"{op} {key!r} on {self.url}" if key is not None else f"{op} on {self.url}"
        if isinstance(exc, bce.ClientError):
            error = exc.response.get("Error", {}) or {}
            code = str(error.get("Code", "") or "")
            status = (exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
            detail = f"{code or 'error'} (HTTP {status})" if status else (code or "error")
            if code == "NoSuchBucket":
                return StoreError(f"{what}: bucket {self.bucket!r} does not exist")
            if code in _NOT_FOUND_CODES or status == 404:
                return BlobNotFoundError(f"{what}: no such object")
            if code in _UNAVAILABLE_CODES or status == 429 or (isinstance(status, int) and status >= 500):
                return StoreUnavailableError(f"{what}: S3 unavailable: {detail}")
            return StoreError(f"{what} failed: {detail}")
        if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError)):
            return StoreUnavailableError(f"{what}: S3 unreachable: {type(exc).__name__}")
        if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError, bce.CredentialRetrievalError)):
            return StoreError(f"{what}: no usable S3 credentials ({type(exc).__name__})")
        if isinstance(exc, bce.BotoCoreError):
            return StoreError(f"{what} failed: {type(exc).__name__}")
        return None

    @contextmanager
    def _translated(self, op: str, key: str | None = None) -> Iterator[None]:
        try:
            yield
        except StoreError:
            raise
        except Exception as exc:
            mapped = self._map_error(exc, op, key)
            if mapped is None:
                raise
            raise mapped from exc

    # -- the interface -------------------------------------------------------------------------

    def put(self, key: str, data: bytes | Path) -> None:
        self._count("put")
        full, source = self._full_key(key), _as_source(data)
        if isinstance(source, bytes):
            with self._translated("put", key):
                self._client.put_object(Bucket=self.bucket, Key=full, Body=source)
            return
        with open(source, "rb") as f:  # a bad source path: OSError as is
            size = os.fstat(f.fileno()).st_size
            with self._translated("put", key):
                if size <= self.multipart_threshold:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=f)
                else:
                    self._put_multipart(full, f, size)

    def _put_multipart(self, full: str, f: IO[bytes], size: int) -> None:
        client = self._client
        part_size = max(self.part_size, -(-size // self._MAX_PARTS))
        upload_id = client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
        try:
            parts = []
            while chunk := f.read(part_size):
                number = len(parts) + 1
                resp = client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                          PartNumber=number, Body=chunk)
                part = {"ETag": resp["ETag"], "PartNumber": number}
                # botocore may add a default checksum to each part; completion must then repeat it
                part.update({k: v for k, v in resp.items() if k in _PART_CHECKSUMS})
                parts.append(part)
            client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                             MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception:
                pass  # best effort; a lifecycle rule cleans up what is left
            raise

    def get(self, key: str) -> bytes:
        self._count("get")
        full = self._full_key(key)
        with self._translated("get", key):
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                return body.read()
            finally:
                body.close()

    def get_to_file(self, key: str, dest: Path) -> int:
        self._count("get_to_file")
        full, dest = self._full_key(key), Path(dest)
        with self._translated("get_to_file", key):
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                with _atomic_file(dest) as out:
                    for chunk in body.iter_chunks(_CHUNK):
                        out.write(chunk)
                    return out.tell()
            finally:
                body.close()

    def exists(self, key: str) -> bool:
        self._count("exists")
        full = self._full_key(key)
        try:
            with self._translated("exists", key):
                self._client.head_object(Bucket=self.bucket, Key=full)
        except BlobNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        self._count("delete")
        full = self._full_key(key)
        try:
            with self._translated("delete", key):
                self._client.delete_object(Bucket=self.bucket, Key=full)
        except BlobNotFoundError:
            return  # S3 itself does not complain; some compatible services do

    def list_keys(self, prefix: str = "") -> list[str]:
        self._count("list_keys")
        prefix = _check_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""
        keys = []
        with self._translated("list_keys"):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=root + prefix):
                keys.extend(obj["Key"][len(root):] for obj in page.get("Contents", ()))
        return sorted(keys)

    def check(self) -> None:
        """Cheap reachability probe (HEAD bucket); any failure, a missing bucket included, reads as
        StoreUnavailableError so /ready reports not ready."""
        self._count("check")
        try:
            with self._translated("check"):
                self._client.head_bucket(Bucket=self.bucket)
        except StoreUnavailableError:
            raise
        except StoreError as exc:
            raise StoreUnavailableError(str(exc)) from exc


def open_store(url: str, *, endpoint_url: str | None = None, region: str | None = None,
               access_key_id: str | None = None, secret_access_key: str | None = None,
               timeout_s: float = 10.0, max_attempts: int = 3) -> ObjectStore:
    """A store from a URL: ``file:///abs/dir`` or ``file://relative/dir`` (a FileStore; the directory
    is created) or ``s3://bucket/optional/prefix`` (an S3Store). Error messages never echo the URL,
    which might carry credentials by mistake."""
    supported = ", ".join(f"{s}..." for s in SUPPORTED_SCHEMES)
    if not isinstance(url, str):
        raise ValueError(f"object store URL must be a string; supported schemes: {supported}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "file":
        rest = unquote(url[len("file://"):])
        if not rest or "?" in rest or "#" in rest:
            raise ValueError(f"a file:// store URL needs a directory (file:///abs/dir or file://rel/dir); "
                             f"supported schemes: {supported}")
        return FileStore(Path(rest))
    if scheme == "s3":
        parts = urlsplit(url)
        if "@" in parts.netloc or parts.query or parts.fragment or ":" in parts.netloc:
            raise ValueError("an s3:// store URL is s3://bucket/optional/prefix: credentials, ports, query "
                             "and fragment go elsewhere (settings or the environment)")
        if not parts.hostname:
            raise ValueError(f"an s3:// store URL needs a bucket: s3://bucket/optional/prefix; "
                             f"supported schemes: {supported}")
        return S3Store(parts.netloc, unquote(parts.path).strip("/"), endpoint_url=endpoint_url, region=region,
                       access_key_id=access_key_id, secret_access_key=secret_access_key, timeout_s=timeout_s,
                       max_attempts=max_attempts)
    shown = f"scheme {scheme!r}" if scheme else "a URL without a scheme"
    raise ValueError(f"unsupported object store URL ({shown}); supported schemes: {supported}")
