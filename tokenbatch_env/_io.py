"""Atomic file writes: a reader never sees a partial file, Ctrl-C leaves the old one intact, and the
new file's bytes reach the disk before its name does (an OS crash leaves the old file or the new one,
never an empty one)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        _fsync(tmp_path)
        os.replace(tmp_path, path)
        _fsync(path.parent, directory=True)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush a file's (or a directory's entries') data to the disk. A directory that cannot be opened
    or synced (some platforms and filesystems) is skipped: the rename is atomic all the same."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_with(path: str | os.PathLike, writer: Callable[[Path], None], suffix: str = "") -> None:
    """Call ``writer(tmp_path)`` and move the result into place atomically."""
    with atomic_path(path, suffix=suffix) as tmp:
        writer(tmp)


def sha256_file(path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
