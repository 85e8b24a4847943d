"""Run summaries and evaluation metrics (DESIGN.md section 6)."""

from __future__ import annotations

import numpy as np

from .engine.kernel import E_COMPLETED, END_STATE_NAMES
from .engine.outcomes import request_metrics  # noqa: F401  (re-exported)


def _pct(x: np.ndarray, q: float) -> float:
    # no interpolation, so +inf entries (requests without a first token) stay meaningful
    return float(np.percentile(x, q, method="inverted_cdf")) if x.size else float("nan")


def summarize(rec: dict, trace) -> dict:
    """Headline numbers of one replay. Latency percentiles over all arrived requests count requests
    without a first token (shed, timed out, rejected, unfinished) as +inf."""
    n = len(rec["arrival_ns"])
    es = rec["end_state"]
    ttft_all = np.where(rec["ttft_ns"] >= 0, rec["ttft_ns"] / 1e6, np.inf)
    completed = es == E_COMPLETED
    span_ns = (rec["finish_ns"].max() - rec["arrival_ns"].min()) if n else 0
    out = {
        "requests": n,
        "goodput": float(rec["met"].mean()) if (n and trace.has_slos) else float("nan"),
        "completed": int(completed.sum()),
        "end_states": {name: int((es == i).sum()) for i, name in enumerate(END_STATE_NAMES) if (es == i).any()},
        "ttft_p50_ms": _pct(ttft_all, 50), "ttft_p99_ms": _pct(ttft_all, 99),
        "ttft_p50_completed_ms": _pct(ttft_all[completed], 50),
        "ttft_p99_completed_ms": _pct(ttft_all[completed], 99),
        "tpot_p50_ms": _pct(rec["tpot_ns"][completed] / 1e6, 50),
        "tpot_p99_ms": _pct(rec["tpot_ns"][completed] / 1e6, 99),
        "throughput_tok_s": float(rec["output_tokens"][completed].sum() / (span_ns / 1e9)) if span_ns > 0 else 0.0,
        "throughput_req_s": float(completed.sum() / (span_ns / 1e9)) if span_ns > 0 else 0.0,
        "preemptions": int(rec["preemptions"].sum()),
        "recomputed_tokens": int(rec["recomputed_tokens"].sum()),
        "makespan_s": span_ns / 1e9,
    }
    return out
