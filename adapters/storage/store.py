"""The object store behind one small interface: a local directory (``file://``) or S3 (``s3://``).

Adapter blobs live under server-made keys (`blob_key`), never under names taken from user input.
Both backends give the same guarantees: a `put` is atomic (readers see the old or the new object,
never a partial one), `get_to_file` writes its destination through a temporary file and a rename,
`delete` of a missing key is not an error, `size` reads an object's length without its bytes, and every
failure is one of three exception types:

- `BlobNotFoundError`: the key does not exist;
- `StoreUnavailableError`: unreachable, timed out, 5xx, throttled: the caller may retry later;
- `StoreError`: anything else (access denied, missing bucket, bad configuration, local disk error).

Errors on the caller's own local files (the source of a `put`, the destination of `get_to_file`) are
plain OSErrors. Messages name the operation, the key and the store URL, never credentials. boto3 is imported only
when an `S3Store` first talks to S3, so importing this module stays cheap.

`FileStore` lives here, `S3Store` in `s3_store`, the error types in `store_errors`, what both backends share in
`store_common`; import the public names from here.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from loramux.adapters.storage.s3_store import S3Store
from loramux.adapters.storage.store_common import CHUNK, TMP_MARK, Counted, as_source, check_key, check_prefix
from loramux.adapters.storage.store_errors import BlobNotFoundError, StoreError, StoreUnavailableError
from loramux.durable_files import atomic_file

__all__ = [
    "StoreError", "StoreUnavailableError", "BlobNotFoundError", "ObjectStore", "FileStore", "S3Store",
    "blob_key", "open_store", "SUPPORTED_SCHEMES",
]

SUPPORTED_SCHEMES = ("file://", "s3://")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


@runtime_checkable
class ObjectStore(Protocol):
    url: str  # e.g. "file:///data/blobs" or "s3://bucket/prefix" (never secrets)
    counters: collections.Counter

    def put(self, key: str, data: bytes | Path) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_to_file(self, key: str, dest: Path) -> int: ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int: ...

    def delete(self, key: str) -> None: ...

    def list_keys(self, prefix: str = "") -> list[str]: ...

    def check(self) -> None: ...


def blob_key(digest: str) -> str:
    """The server-made key of a blob from its sha256 hex digest: ``blobs/sha256/ab/abcdef...``."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise ValueError("blob digest must be 64 lowercase hex characters (a sha256 hexdigest)")
    return f"blobs/sha256/{digest[:2]}/{digest}"


class FileStore(Counted):
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
        path = self.root / check_key(key)
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
        path, source = self._path(key), as_source(data)
        src = open(source, "rb") if isinstance(source, Path) else None  # a bad source path: OSError as is
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path, tmp_prefix=TMP_MARK) as f:  # a temp name that list_keys skips
                if src is None:
                    assert isinstance(source, bytes)  # a Path source is opened as src
                    f.write(source)
                else:
                    shutil.copyfileobj(src, f, CHUNK)
        except OSError as exc:
            raise StoreError(f"put {key!r} on {self.url} failed: {type(exc).__name__} ({exc.strerror})") from exc
        finally:
            if src is not None:
                src.close()

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
            with atomic_file(dest) as out:
                shutil.copyfileobj(src, out, CHUNK)
                return out.tell()

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        """The object's size in bytes (BlobNotFoundError when there is none)."""
        self._count("size")
        path = self._path(key)
        try:
            if not path.is_file():
                raise FileNotFoundError(key)
            return path.stat().st_size
        except OSError as exc:
            raise self._error("size", key, exc) from exc

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
        prefix = check_prefix(prefix)
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(TMP_MARK)]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(TMP_MARK):
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
