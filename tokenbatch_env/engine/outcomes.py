"""Per-request outcomes (DESIGN.md section 3, "Outcomes"): TTFT, TPOT and met."""

from __future__ import annotations

import numpy as np

from .kernel import E_COMPLETED


def request_metrics(rec: dict, trace) -> dict:
    """ttft = first_token - arrival; tpot = (finish - first_token)/(O-1) (0 if O = 1);
    met = completed and ttft <= T1 and tpot <= T2. Times in ns (float for tpot)."""
    completed = rec["end_state"] == E_COMPLETED
    has_tok = rec["first_token_ns"] >= 0
    ttft = np.where(has_tok, rec["first_token_ns"] - rec["arrival_ns"], -1)
    o = rec["output_tokens"]
    done = rec["finish_ns"] >= 0
    tpot = np.where(done & has_tok & (o > 1), (rec["finish_ns"] - rec["first_token_ns"]) / np.maximum(o - 1, 1), 0.0)
    if trace.has_slos:
        met = completed & (ttft <= trace.ttft_slo_ns) & (tpot <= trace.tpot_slo_ns)
    else:
        met = np.zeros(len(o), bool)
    return {"ttft_ns": ttft, "tpot_ns": tpot, "met": met}
