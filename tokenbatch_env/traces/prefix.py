"""Dense prefix ids of trace windows, compiled (docs/design.md section 2): the traces' own
``Trace.subset`` and the env's batch of episodes (``envs``) derive a window's ids from its parent's
with the one function here. It sits in the traces layer, below the engine, and is compiled with the
engine's numba decorators (``engine._jit``, docs/design.md section 1); ``engine._jit.engine_digest``
covers this file, so an edit here flushes the cached code that links it."""

from __future__ import annotations

import numpy as np

from ..engine._jit import guard_stale_cache, njit

__all__ = ["window_prefix_ids"]


@njit
def window_prefix_ids(units, start, count, n_ids, ids, out, n_uniq):
    """``traces.trace.subset_prefix_ids`` of many windows at once (the env lays out a batch of
    episodes): window e's chain entries ``ids[units[e], start[e]:start[e] + count[e]]`` (unit u's
    dense prefix ids, ``n_ids[u]`` of them) re-ranked by first appearance into ``out[e]``, their number
    of distinct ids into ``n_uniq[e]``."""
    m_max = 0
    for e in range(units.shape[0]):
        m_max = max(m_max, n_ids[units[e]])
    rank = np.zeros(m_max, np.int64)   # 1 + an id's rank in this window, 0 if not seen yet
    for e in range(units.shape[0]):
        u, a, k = units[e], start[e], count[e]
        s = 0
        for j in range(k):
            i = ids[u, a + j]
            if rank[i] == 0:
                s += 1
                rank[i] = s
            out[e, j] = rank[i] - 1
        n_uniq[e] = s
        for j in range(k):
            rank[ids[u, a + j]] = 0


guard_stale_cache([window_prefix_ids], tag="prefix")
