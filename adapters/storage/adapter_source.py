"""An adapter directory somewhere else, fetched for import: an `s3://bucket/prefix/` URL or a local directory
under an allowed root (never an arbitrary path).

vLLM's `POST /v1/load_lora_adapter` takes a `lora_path`, and its resolver plugins look an unknown model up
in a filesystem or S3 prefix. Here both end in the ordinary upload path (validation, digest, versions):
this module only brings the two files of a PEFT adapter (`adapter_config.json`, `adapter_model.safetensors`)
into a temporary directory, within a byte cap, and says precisely why it cannot:

- `SourceInvalid`: the location itself is refused (a scheme other than s3:// or file://, a path outside every
  allowed root, a symlink leading out of it, pickle weights instead of safetensors, a file over the cap): 400;
  `SourceUnreadable`, one of them, when the store or file system refused to read it (access denied, no such
  bucket, an unreadable file): the operator's to fix;
- `SourceNotFound`: no adapter there (no `adapter_config.json`): 404;
- `SourceUnavailable`: the store could not be reached (timeout, 5xx, throttled): retry later, 503.

Messages name the location as the caller gave it (an operator's own URL), never credentials; each error's
`reason` says the same without the location, for callers who must not show it (the resolver answers tenants).
Sizes are checked before a byte is copied (S3: a HEAD request), and copies stop at the cap.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loramux.adapters.formats.validation_common import ALLOWED_FILENAMES
from loramux.adapters.storage.store import ObjectStore
from loramux.adapters.storage.store_errors import BlobNotFoundError, StoreError, StoreUnavailableError

__all__ = ["SourceError", "SourceInvalid", "SourceUnreadable", "SourceNotFound", "SourceUnavailable", "fetch_adapter",
           "parse_roots", "join_location"]

CONFIG_FILE, WEIGHTS_FILE = ALLOWED_FILENAMES[0], ALLOWED_FILENAMES[1]
_PICKLE_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_CHUNK = 1 << 20


class SourceError(ValueError):
    """An adapter location that could not be fetched; the message says what to fix, `reason` the same without
    naming the location."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason if reason is not None else message


class SourceInvalid(SourceError):
    """The location is not allowed or does not hold a servable adapter's files (HTTP 400)."""


class SourceUnreadable(SourceInvalid):
    """The store or file system refused to read the location (access denied, no such bucket, unreadable)."""


class SourceNotFound(SourceError):
    """There is no adapter at the location (HTTP 404)."""


class SourceUnavailable(SourceError):
    """The store holding the location could not be reached; retrying later may work (HTTP 503)."""


def parse_roots(text: str) -> list[Path]:
    """LORAMUX_ADAPTER_IMPORT_ROOTS: comma-separated absolute directories, each resolved (symlinks followed)."""
    roots = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        path = Path(part).expanduser()
        if not path.is_absolute():
            raise ValueError(f"LORAMUX_ADAPTER_IMPORT_ROOTS entry {part!r} must be an absolute directory")
        roots.append(path.resolve())
    return roots


def join_location(base: str, *segments: str) -> str:
    """`base` (an s3:// or file:// URL, or a directory) with `segments` appended as path components; each
    segment must be a plain name (the caller has checked it), so nothing here can climb out of `base`."""
    for segment in segments:
        if not segment or segment in (".", "..") or "/" in segment or "\\" in segment:
            raise SourceInvalid(f"{segment!r} cannot be a path segment of an adapter location")
    return base.rstrip("/") + "/" + "/".join(segments) + "/"


def fetch_adapter(location: str, dest: Path, *, roots: Sequence[Path], open_s3: Callable[[str], ObjectStore],
                  max_weights_bytes: int, max_config_bytes: int = 1024 * 1024) -> dict[str, Path]:
    """The adapter at `location` copied into the directory `dest`: {file name: path} of its config and weights,
    ready for `AdapterRegistry.register`. `location`: `s3://bucket/prefix` (opened with `open_s3(url)`, which
    carries the server's S3 endpoint and credentials) or a local directory (`file://` URL or absolute path)
    under one of `roots`. Raises SourceInvalid, SourceNotFound or SourceUnavailable."""
    if not isinstance(location, str) or not location.strip():
        raise SourceInvalid("lora_path is empty: give an s3://bucket/prefix/ URL or a directory under "
                            "LORAMUX_ADAPTER_IMPORT_ROOTS")
    if "\x00" in location or any(ord(c) < 0x20 for c in location):
        raise SourceInvalid("lora_path holds control characters")
    caps = {CONFIG_FILE: max_config_bytes, WEIGHTS_FILE: max_weights_bytes}
    scheme = location.split("://", 1)[0].lower() if "://" in location else ""
    if scheme == "s3":
        return _fetch_s3(location, dest, open_s3, caps)
    if scheme == "file":
        parts = urlsplit(location)
        if parts.netloc not in ("", "localhost"):
            raise SourceInvalid(f"file:// locations are local directories (file:///abs/dir), not {location!r}")
        return _fetch_local(Path(unquote(parts.path)), location, dest, roots, caps)
    if scheme:
        raise SourceInvalid(f"unsupported adapter location scheme {scheme!r}: use s3://bucket/prefix/ or a "
                            "directory under LORAMUX_ADAPTER_IMPORT_ROOTS")
    return _fetch_local(Path(location), location, dest, roots, caps)


def _fetch_s3(url: str, dest: Path, open_s3: Callable[[str], ObjectStore], caps: dict[str, int]) -> dict[str, Path]:
    parts = urlsplit(url)
    segments = unquote(parts.path).split("/")
    if any(s in (".", "..") for s in segments) or "\\" in parts.path:
        raise SourceInvalid(f"adapter location {url!r} has '.' or '..' segments")
    try:
        store = open_s3(url)
    except ValueError as exc:
        raise SourceInvalid(f"adapter location {url!r} is not a valid S3 URL: {exc}") from None
    with _store_errors(url):
        listed = set(store.list_keys(""))
    _check_listing(listed, url)
    files = {}
    for name, cap in caps.items():
        with _store_errors(url, name):
            size = store.size(name)
        _check_size(name, size, cap, url)
        target = dest / name
        with _store_errors(url, name):
            size = store.get_to_file(name, target)
        if size > cap:  # replaced by a larger object between the HEAD and the GET
            target.unlink(missing_ok=True)
            _check_size(name, size, cap, url)
        files[name] = target
    return files


@contextmanager
def _store_errors(url: str, name: str | None = None) -> Iterator[None]:
    """The store's errors as SourceErrors: a missing object is SourceNotFound, an unreachable store
    SourceUnavailable, any other refusal (access denied, no such bucket) SourceUnreadable."""
    what = f"{name} at {url!r}" if name else repr(url)
    try:
        yield
    except BlobNotFoundError:
        raise SourceNotFound(f"no {what}", f"no {name or 'adapter'} there") from None
    except StoreUnavailableError as exc:
        raise SourceUnavailable(f"the store holding {url!r} could not be reached; retry later ({exc})",
                                "the adapter store could not be reached; retry later") from None
    except (StoreError, ValueError) as exc:
        raise SourceUnreadable(f"cannot read {what}: {exc}", "the adapter store refused to read it") from None


def _check_size(name: str, size: int, cap: int, where: str) -> None:
    if size > cap:
        raise SourceInvalid(f"{name} at {where!r} is {size} bytes; this server accepts at most {cap} "
                            "(LORAMUX_MAX_UPLOAD_BYTES)",
                            f"{name} is {size} bytes; this server accepts at most {cap}")


def _check_listing(names: set[str], where: str) -> None:
    """What is at the location, judged before anything is downloaded: 404 without a config, 400 for pickle
    weights or missing safetensors weights."""
    if CONFIG_FILE not in names:
        raise SourceNotFound(f"no adapter at {where!r}: {CONFIG_FILE} is missing", f"{CONFIG_FILE} is missing")
    if WEIGHTS_FILE not in names:
        pickled = sorted(names & set(_PICKLE_WEIGHTS))
        if pickled:
            advice = (f"pickle weights ({pickled[0]}) are refused: save the adapter as safetensors ({WEIGHTS_FILE}, "
                      "save_pretrained(..., safe_serialization=True))")
            raise SourceInvalid(f"{where!r} holds {advice}", advice)
        raise SourceInvalid(f"{where!r} has {CONFIG_FILE} but no {WEIGHTS_FILE}",
                            f"{CONFIG_FILE} without {WEIGHTS_FILE}")


def _fetch_local(path: Path, shown: str, dest: Path, roots: Sequence[Path], caps: dict[str, int]) -> dict[str, Path]:
    if not roots:
        raise SourceInvalid("local adapter directories are not allowed on this server: set "
                            "LORAMUX_ADAPTER_IMPORT_ROOTS, or give an s3:// URL")
    text = str(path)
    if "\x00" in text or any(ord(c) < 0x20 for c in text):  # also what a file:// URL's %-escapes decoded to
        raise SourceInvalid("lora_path holds control characters")
    if not path.is_absolute():
        raise SourceInvalid(f"adapter location {shown!r} must be an absolute directory or an s3:// URL")
    if any(part == ".." for part in path.parts):
        raise SourceInvalid(f"adapter location {shown!r} has '..' segments")
    try:
        return _copy_local(path, shown, dest, roots, caps)
    except SourceError:
        raise
    except (OSError, ValueError, RuntimeError) as exc:  # too long, a symlink loop, unreadable, ...
        raise SourceUnreadable(f"cannot read {shown!r}: {type(exc).__name__}",
                               f"the adapter directory could not be read ({type(exc).__name__})") from None


def _copy_local(path: Path, shown: str, dest: Path, roots: Sequence[Path], caps: dict[str, int]) -> dict[str, Path]:
    real = path.resolve()
    if not _under_any(real, roots):
        raise SourceInvalid(f"adapter location {shown!r} is not under an allowed root (LORAMUX_ADAPTER_IMPORT_ROOTS)",
                            "it leads outside the adapter store")
    if not real.is_dir():
        raise SourceNotFound(f"no adapter directory at {shown!r}", "no adapter directory there")
    listed = {entry.name for entry in os.scandir(real) if entry.is_file()}
    _check_listing(listed, shown)
    files = {}
    for name, cap in caps.items():
        source = (real / name).resolve()
        if not _under_any(source, roots):  # a symlink inside the directory leading out of every root
            raise SourceInvalid(f"{name} in {shown!r} leads outside the allowed roots",
                                f"{name} leads outside the adapter store")
        _check_size(name, source.stat().st_size, cap, shown)
        target = dest / name
        # O_NOFOLLOW: the resolved path must still be a plain file when it is opened, not a link swapped in since.
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as src, open(target, "wb") as out:
            while chunk := src.read(min(_CHUNK, cap + 1 - out.tell())):
                out.write(chunk)
                if out.tell() > cap:  # grew while it was copied: stop at the cap
                    _check_size(name, out.tell(), cap, shown)
        files[name] = target
    return files


def _under_any(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)
