"""Atomic file writes: a reader never sees a partial file, Ctrl-C leaves the old one intact, and the
new file's bytes reach the disk before its name does (an OS crash leaves the old file or the new one,
never an empty one)."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from .errors import OutputError


#: errors of writing the data itself (the disk or quota full, a file too large, an I/O error)
_WRITE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EIO") if hasattr(errno, n))


def _cannot_write(path, e: OSError, what: str = "") -> OutputError:
    return OutputError(f"{what + ' ' if what else ''}{path}: cannot write: {e.strerror or e}")


@contextlib.contextmanager
def write_errors(path) -> Iterator[None]:
    """Turn an error of writing the data itself (``_WRITE_ERRNOS``: a full disk, ...) raised inside
    into ``OutputError`` naming ``path``, not a traceback; other errors pass through."""
    try:
        yield
    except OSError as e:
        if e.errno in _WRITE_ERRNOS:
            raise _cannot_write(path, e) from None
        raise


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the root always does); OSError if one may not
    be looked at (``Path.exists`` raises on EACCES)."""
    while not path.exists():
        path = path.parent
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only on success. A path that
    cannot be written (its directory cannot be made or written, or a directory is in the way)
    raises ``OutputError`` naming it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    except OSError as e:
        try:
            blocker = _nearest_existing(path.parent)
        except OSError:
            blocker = None
        if blocker is not None and not blocker.is_dir():
            raise OutputError(f"{path}: cannot write: {blocker} is not a directory") from None
        raise _cannot_write(path, e) from None
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
    tmp_path = Path(tmp)
    try:
        with write_errors(path):
            yield tmp_path
            _fsync(tmp_path)
        try:
            os.replace(tmp_path, path)
        except OSError as e:
            raise _cannot_write(path, e) from None
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


def check_writable(path: str | os.PathLike, what: str, *, directory: bool = False) -> None:
    """Fail early, before long work, if the output ``path`` (a file, or with ``directory`` a directory
    of outputs) could not be written: ``OutputError`` naming ``what`` (e.g. the option) and the path.
    Creates nothing: it writes and removes a probe file, named as the writer's temporary file would
    be, in the nearest directory that exists."""
    path = Path(path)
    try:
        if path.exists() and (path.is_dir() != directory):
            kind = "a directory" if path.is_dir() else "a file"
            raise OutputError(f"{what} {path}: cannot write: {kind} is in the way")
        base = _nearest_existing(path if directory else path.parent)
        if not base.is_dir():
            raise OutputError(f"{what} {path}: cannot write: {base} is not a directory")
    except OSError as e:   # (a parent it may not enter: Path.exists raises on EACCES)
        if isinstance(e, OutputError):
            raise
        raise _cannot_write(path, e, what) from None
    name = "tokenbatch-probe" if directory else path.name   # (a name too long fails here, as it would there)
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _cannot_write(path, e, what) from None


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
