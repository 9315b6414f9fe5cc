"""Local files that survive a crash: a directory entry made durable, and a file replaced atomically (readers
see the old content or the new, never a partial write). Used by the object stores (their local files) and
the ledger's write-ahead log."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


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
def atomic_file(dest: Path, tmp_prefix: str | None = None) -> Iterator[IO[bytes]]:
    """Yield a temp file next to `dest` (named `tmp_prefix`..., else .<name>....part); on success fsync it
    and rename it over `dest` (readers see the old file or the new one, never a partial one), else remove it."""
    if tmp_prefix is None:
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    else:
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=tmp_prefix)
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
