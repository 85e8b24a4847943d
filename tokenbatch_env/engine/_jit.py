"""numba decorators used by the engine (one place, so the interpreted fallback is uniform), and the
guard against stale compiled code.

numba's on-disk cache of a function is keyed on its own source file only: a cached kernel that calls
a score formula keeps the old formula after ``scoring.py`` changes. ``guard_stale_cache`` flushes the
cached machine code of the given dispatchers whenever any engine source file changes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_REGISTRY: list = []

try:  # numba is a runtime dependency; without it the same functions run interpreted
    from numba import njit as _numba_njit

    def njit(fn):
        d = _numba_njit(cache=True, nogil=True)(fn)
        _REGISTRY.append(d)
        return d

    def helper(fn):
        """Small helpers are inlined at numba-IR level: passing the struct of arrays to a separate
        function costs a reference-count round trip per array per call."""
        d = _numba_njit(cache=True, nogil=True, inline="always")(fn)
        _REGISTRY.append(d)
        return d
except ImportError:  # pragma: no cover
    def njit(fn):
        fn.py_func = fn
        return fn

    helper = njit


def engine_digest(extra_sources=()) -> str:
    """SHA-256 of every engine source file (what compiled engine code depends on), plus ``extra_sources``."""
    h = hashlib.sha256()
    for f in [*sorted(Path(__file__).parent.glob("*.py")), *map(Path, extra_sources)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def guard_stale_cache(dispatchers=None, tag: str = "engine", extra_sources=()) -> None:
    """Flush the on-disk compiled code of ``dispatchers`` (default: every engine function) when the
    engine sources (or ``extra_sources``, other files they link) changed since it was written;
    numba then recompiles on first use."""
    disp = [d for d in (_REGISTRY if dispatchers is None else dispatchers) if hasattr(d, "_cache")]
    if not disp:
        return
    try:
        stamp = Path(disp[0]._cache.cache_path) / f"tokenbatch.{tag}.sha256"
        digest = engine_digest(extra_sources)
        if stamp.exists() and stamp.read_text() == digest:
            return
        for d in disp:
            d._cache.flush()
        stamp.write_text(digest)
    except (OSError, AttributeError):  # pragma: no cover - read-only cache dir: numba recompiles anyway
        pass
