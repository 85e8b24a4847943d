"""numba decorators used by the engine (one place, so the interpreted fallback is uniform)."""

from __future__ import annotations

try:  # numba is a runtime dependency; without it the same functions run interpreted
    from numba import njit as _numba_njit

    def njit(fn):
        return _numba_njit(cache=True, nogil=True)(fn)

    def helper(fn):
        """Small helpers are inlined at numba-IR level: passing the struct of arrays to a separate
        function costs a reference-count round trip per array per call."""
        return _numba_njit(cache=True, nogil=True, inline="always")(fn)
except ImportError:  # pragma: no cover
    def njit(fn):
        fn.py_func = fn
        return fn

    helper = njit
