"""Per-request outcomes (docs/design.md section 3, "Outcomes"): TTFT, TPOT and met.

``request_outcome`` is the one definition, compiled, so that the evaluator's records
(``request_metrics``) and the environment's episode metrics (computed in the engine threads) share it.
"""

from __future__ import annotations

import numpy as np

from ._jit import guard_stale_cache, helper, njit
from .kernel import E_COMPLETED


@helper
def request_outcome(end_state, first_token, arrival, finish, out_len, ttft_slo, tpot_slo, has_slos):
    """(ttft, tpot, met) of one request: ttft = first_token - arrival (-1 without a first token);
    tpot = (finish - first_token)/(O-1) (0 if O = 1 or unfinished; float); met = completed and
    ttft <= T1 and tpot <= T2 (False without SLOs). Times in ns."""
    has_tok = first_token >= 0
    ttft = first_token - arrival if has_tok else -1
    tpot = 0.0
    if finish >= 0 and has_tok and out_len > 1:
        tpot = (finish - first_token) / (out_len - 1)
    met = has_slos and end_state == E_COMPLETED and ttft <= ttft_slo and tpot <= tpot_slo
    return ttft, tpot, met


@njit
def _request_metrics_flat(end_state, first_token, arrival, finish, out_len, ttft_slo, tpot_slo, has_slos,
                          ttft, tpot, met):
    for i in range(end_state.shape[0]):
        ttft[i], tpot[i], met[i] = request_outcome(end_state[i], first_token[i], arrival[i], finish[i], out_len[i],
                                                   ttft_slo[i], tpot_slo[i], has_slos)


def request_metrics(rec: dict, trace) -> dict:
    """``request_outcome`` of every request of the record columns ``rec`` (any shape), with the SLOs
    of ``trace`` (anything with ``has_slos``, ``ttft_slo_ns`` and ``tpot_slo_ns`` of that shape):
    {"ttft_ns", "tpot_ns", "met"}."""
    cols = [np.asarray(rec[k], np.int64) for k in ("end_state", "first_token_ns", "arrival_ns", "finish_ns",
                                                    "output_tokens")]
    shape = cols[0].shape
    if trace.has_slos:
        slos = [np.broadcast_to(np.asarray(s, np.int64), shape) for s in (trace.ttft_slo_ns, trace.tpot_slo_ns)]
    else:
        slos = [np.zeros(shape, np.int64)] * 2
    # (C-contiguous and writable: a read-only view would compile a second variant)
    flat = [np.require(c, np.int64, ['C', 'W']).reshape(-1) for c in cols + slos]
    n = flat[0].shape[0]
    ttft, tpot, met = np.empty(n, np.int64), np.empty(n, np.float64), np.empty(n, bool)
    _request_metrics_flat(*flat, bool(trace.has_slos), ttft, tpot, met)
    return {"ttft_ns": ttft.reshape(shape), "tpot_ns": tpot.reshape(shape), "met": met.reshape(shape)}


# (defined after the kernel's guard ran): flushed when any engine source changes, as the kernel is
guard_stale_cache([_request_metrics_flat], tag="outcomes")
