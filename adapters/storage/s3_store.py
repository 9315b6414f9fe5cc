"""The S3 backend of the object store (`s3://bucket/prefix`, or an S3-compatible service at `endpoint_url`).

Same guarantees and error types as every store (see `loramux.adapters.storage.store`, which re-exports `S3Store`):
S3 error codes and botocore failures become `BlobNotFoundError`, `StoreUnavailableError` (throttled,
timed out, unreachable, 5xx) or `StoreError`. boto3 is imported only when a store first talks to S3.
"""
from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from loramux.adapters.storage.store_common import CHUNK, Counted, Secret, as_source, check_key, check_prefix
from loramux.adapters.storage.store_errors import BlobNotFoundError, StoreError, StoreUnavailableError
from loramux.durable_files import atomic_file

__all__ = ["S3Store"]

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")

# S3 error codes that mean "retry later" (throttling, timeouts, server trouble).
_UNAVAILABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "ProvisionedThroughputExceededException", "RequestTimeout", "RequestTimeoutException",
    "ServiceUnavailable", "InternalError", "PriorRequestNotComplete",
})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_PART_CHECKSUMS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")


class S3Store(Counted):
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
            check_key(prefix)
        if (access_key_id is None) != (secret_access_key is None):
            raise ValueError("S3 credentials need both access_key_id and secret_access_key (or neither)")
        if timeout_s <= 0 or max_attempts < 1:
            raise ValueError("S3Store needs timeout_s > 0 and max_attempts >= 1")
        self.bucket, self.prefix = bucket, prefix
        self.endpoint_url, self.region = endpoint_url, region
        self.timeout_s, self.max_attempts = float(timeout_s), int(max_attempts)
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._access_key_id, self._secret_access_key = Secret(access_key_id), Secret(secret_access_key)
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
        from boto3.session import Session
        from botocore.config import Config

        config = Config(
            connect_timeout=self.timeout_s, read_timeout=self.timeout_s,
            # botocore's "max_attempts" counts retries after the first try; "total_max_attempts" counts
            # every try, which is what max_attempts means here (1 = no retry).
            retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        try:
            session = Session(aws_access_key_id=self._access_key_id.value,
                                            aws_secret_access_key=self._secret_access_key.value,
                                            region_name=self.region)
            return session.client("s3", endpoint_url=self.endpoint_url, config=config)
        except Exception as exc:  # bad endpoint URL, bad region, broken AWS config files
            raise StoreError(f"cannot create an S3 client for {self.url}: {type(exc).__name__}") from exc

    def _full_key(self, key: str) -> str:
        key = check_key(key)
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
        full, source = self._full_key(key), as_source(data)
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
            except Exception:  # noqa: BLE001 - best effort; a lifecycle rule cleans up what is left
                pass
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
                with atomic_file(dest) as out:
                    for chunk in body.iter_chunks(CHUNK):
                        out.write(chunk)
                    return out.tell()
            finally:
                body.close()

    def exists(self, key: str) -> bool:
        return self._on_object("exists", key, "head_object")

    def size(self, key: str) -> int:
        """The object's size in bytes, from a HEAD request (BlobNotFoundError when there is none)."""
        self._count("size")
        full = self._full_key(key)
        with self._translated("size", key):
            return int(self._client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])

    def delete(self, key: str) -> None:
        # A missing key is not an error (S3 itself does not complain; some compatible services do).
        self._on_object("delete", key, "delete_object")

    def _on_object(self, op: str, key: str, method: str) -> bool:
        """Call the client's `method` on `key` for `op`; False where the object does not exist."""
        self._count(op)
        full = self._full_key(key)
        try:
            with self._translated(op, key):
                getattr(self._client, method)(Bucket=self.bucket, Key=full)
        except BlobNotFoundError:
            return False
        return True

    def list_keys(self, prefix: str = "") -> list[str]:
        self._count("list_keys")
        prefix = check_prefix(prefix)
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

