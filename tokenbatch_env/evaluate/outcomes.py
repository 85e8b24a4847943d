"""Per-request outcomes and the metrics built on them (docs/design.md section 6): the outcome
columns of a unit's scored requests (``request_outcomes``), the per-unit numbers (``unit_metrics``:
goodput = met / arrived, counts, throughput) and the suite-level numbers that pool every unit's
requests at one load (``pooled_metrics``: latency percentiles, goodput by class and by prompt
quintile, ...). Percentiles are inverted-CDF (``metrics.pct``)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..metrics import pct


def request_outcomes(rec: dict, trace, scored: Optional[np.ndarray] = None) -> dict:
    """The scored requests' outcome columns used by every metric (times in ms; +inf where the
    event never happened: no first token for TTFT, not completed for TPOT and E2E). ``trace`` None:
    without the trace's columns (class, cache miss); then ``rec``'s columns may also be 2-D
    ([units, requests], ``scored`` None)."""
    from ..engine.kernel import E_COMPLETED, E_LENGTH_CAPPED, E_REJECTED, E_SHED, E_TIMED_OUT, E_UNFINISHED
    n = len(rec["arrival_ns"])
    m = np.ones(n, bool) if scored is None else np.asarray(scored, bool)
    es = np.asarray(rec["end_state"])[m]
    completed = es == E_COMPLETED
    ttft = np.asarray(rec["ttft_ns"])[m]
    has_tok = ttft >= 0
    fin = np.asarray(rec["finish_ns"])[m]
    arr = np.asarray(rec["arrival_ns"])[m]
    fs = np.asarray(rec["first_scheduled_ns"])[m]
    return {
        "met": np.asarray(rec["met"], bool)[m],
        "completed": completed,
        "shed": es == E_SHED, "timed_out": es == E_TIMED_OUT, "rejected": es == E_REJECTED,
        "unfinished": es == E_UNFINISHED, "length_capped": es == E_LENGTH_CAPPED,
        "ttft_ms": np.where(has_tok, ttft / 1e6, np.inf),
        "tpot_ms": np.where(completed, np.asarray(rec["tpot_ns"], np.float64)[m] / 1e6, np.inf),
        "e2e_ms": np.where(completed, (fin - arr) / 1e6, np.inf),
        "wait_ms": np.where(fs >= 0, (fs - arr) / 1e6, np.nan),
        "output_tokens": np.asarray(rec["output_tokens"])[m],
        "prompt_tokens": np.asarray(rec["prompt_tokens"])[m],
        "arrival_ns": arr, "finish_ns": fin,
        "preemptions": np.asarray(rec["preemptions"])[m],
        "recomputed_tokens": np.asarray(rec["recomputed_tokens"])[m],
        **({} if trace is None else {"class_id": np.asarray(trace.class_id)[m],
                                     "cache_miss": np.asarray(trace.prefix_lengths)[m] == 0,
                                     # completed with the first token in time and missed on TPOT alone
                                     # (where the iteration's size decides, docs/design.md section 11)
                                     "tpot_only_miss": completed & ~np.asarray(rec["met"], bool)[m]
                                     & (ttft <= np.asarray(trace.ttft_slo_ns)[m]) & bool(trace.has_slos)}),
    }


def unit_metrics(o: dict) -> dict:
    """Per-unit (trace or window) numbers: goodput = met / arrived, counts, throughput over the
    unit's span (first scored arrival to the last scored end; requests that never finished end
    at their arrival for this purpose)."""
    n = int(o["met"].size)
    end = np.where(o["finish_ns"] >= 0, o["finish_ns"], o["arrival_ns"])
    span_s = float(end.max() - o["arrival_ns"].min()) / 1e9 if n else 0.0
    met = int(o["met"].sum())
    return {
        "arrived": n, "met": met, "completed": int(o["completed"].sum()),
        "goodput": met / n if n else float("nan"),
        "shed": int(o["shed"].sum()), "timed_out": int(o["timed_out"].sum()),
        "rejected": int(o["rejected"].sum()), "unfinished": int(o["unfinished"].sum()),
        "length_capped": int(o["length_capped"].sum()),
        "preemptions": int(o["preemptions"].sum()),
        "recomputed_tokens": int(o["recomputed_tokens"].sum()),
        "throughput_tok_s": float(o["output_tokens"][o["completed"]].sum()) / span_s if span_s > 0 else 0.0,
        "met_req_s": met / span_s if span_s > 0 else 0.0,
        "span_s": span_s,
    }


def prompt_quintile_edges(prompts) -> list:
    """Edges (20/40/60/80th percentiles, inverted CDF) of the pooled scored prompt lengths."""
    p = np.asarray(prompts, np.float64)
    return [pct(p, q) for q in (20, 40, 60, 80)]


def pooled_metrics(outs: Sequence[dict], quintile_edges, class_names) -> dict:
    """Suite-level numbers that pool the scored requests of every unit at one load."""
    cat = {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}
    comp = cat["completed"]
    lat = {}
    for k in ("ttft", "tpot", "e2e"):
        v = cat[f"{k}_ms"]
        lat[f"{k}_ms"] = {"p50_all": pct(v, 50), "p99_all": pct(v, 99),
                          "p50_completed": pct(v[comp], 50), "p99_completed": pct(v[comp], 99)}
    by_class = {}
    for c in np.unique(cat["class_id"]):
        sel = cat["class_id"] == c
        name = class_names[c] if c < len(class_names) else f"class {c}"
        by_class[name] = {"goodput": float(cat["met"][sel].mean()), "arrived": int(sel.sum())}
    q = np.searchsorted(np.asarray(quintile_edges, np.float64), cat["prompt_tokens"], side="right")
    by_q = []
    for i in range(5):
        sel = q == i
        by_q.append({"goodput": float(cat["met"][sel].mean()) if sel.any() else float("nan"),
                     "arrived": int(sel.sum())})
    wait = cat["wait_ms"]
    sched = np.isfinite(wait)
    n_comp = int(comp.sum())
    return {
        **lat,
        "sla_respect": float(cat["met"].sum() / n_comp) if n_comp else float("nan"),
        "goodput_by_class": by_class,
        "goodput_by_prompt_quintile": by_q,
        "ttft_p99_cache_miss_ms": pct(cat["ttft_ms"][cat["cache_miss"]], 99),
        "cache_miss_requests": int(cat["cache_miss"].sum()),
        "max_wait_ms": float(wait[sched].max()) if sched.any() else float("nan"),
        "never_scheduled": int((~sched).sum()),
        "tpot_only_missed": int(cat["tpot_only_miss"].sum()),
    }
