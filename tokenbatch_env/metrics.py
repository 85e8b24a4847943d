"""Run summaries and evaluation metrics (docs/design.md section 6).

Importing this module imports numpy only (the evaluator's and the env's percentiles and bootstrap
need no engine): the engine's names are imported where used."""

from __future__ import annotations

import math

import numpy as np


def __getattr__(name):   # ``request_metrics``, re-exported from the engine without importing it here
    if name == "request_metrics":
        from .engine.outcomes import request_metrics
        return request_metrics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _pct(x: np.ndarray, q: float) -> float:
    # no interpolation, so +inf entries (requests without a first token) stay meaningful
    return float(np.percentile(x, q, method="inverted_cdf")) if x.size else float("nan")


def summarize(rec: dict, trace) -> dict:
    """Headline numbers of one replay. Latency percentiles over all arrived requests count requests
    without a first token (shed, timed out, rejected, unfinished) as +inf."""
    from .engine.kernel import E_COMPLETED, END_STATE_NAMES
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



# ------------------------------------------------------------------------- percentiles (section 6)
def pct(x, q: float) -> float:
    """Inverted-CDF percentile (no interpolation, so +inf entries stay meaningful); NaN if empty."""
    return pcts(x, (q,))[0]


def pcts(x, qs) -> list:
    """``[pct(x, q) for q in qs]`` with one sort: ``np.percentile(x, q, method="inverted_cdf")``
    exactly (its index rule: ``i = n * (q / 100) - 1`` in float64, rounded up unless integral,
    clipped at 0; NaN if any entry is NaN). Falls back to np.percentile for anything else (numpy
    scalar or out-of-range q, a chosen zero that could be -0.0)."""
    x = np.asarray(x, np.float64)
    if not x.size:
        return [float("nan")] * len(qs)
    if x.ndim != 1:
        return [float(np.percentile(x, q, method="inverted_cdf")) for q in qs]
    s = np.sort(x)   # NaN sorts last
    n = s.size
    out = []
    for q in qs:
        if type(q) not in (int, float) or not 0 <= q <= 100:
            out.append(float(np.percentile(x, q, method="inverted_cdf")))
            continue
        if s[-1] != s[-1]:
            out.append(float("nan"))
            continue
        v = float(s[pct_index(n, q)])
        if v == 0.0 and np.signbit(x[x == 0.0]).any():   # +0.0 and -0.0: partition order decides
            v = float(np.percentile(x, q, method="inverted_cdf"))
        out.append(v)
    return out


def pct_index(n: int, q) -> int:
    """np.percentile's inverted-CDF index rule: ``i = n * (q / 100) - 1`` in float64, rounded up
    unless integral, clipped at 0 (the env's compiled episode metrics take their p50/p99 here)."""
    idx = n * (q / 100) - 1
    prev = math.floor(idx)
    return max(0, prev if idx - prev == 0 else prev + 1)


# ------------------------------------------------------------------------- uncertainty (section 6)
BOOTSTRAP_B = 10_000


def _bootstrap_indices(n: int, B: int, rng: np.random.Generator, block: int | None) -> np.ndarray:
    if block is None or block <= 1:
        return rng.integers(0, n, size=(B, n))
    # moving-block bootstrap: concatenate random length-`block` runs of consecutive units
    n_blocks = -(-n // block)
    starts = rng.integers(0, n - block + 1, size=(B, n_blocks))
    idx = (starts[:, :, None] + np.arange(block)[None, None, :]).reshape(B, -1)
    return idx[:, :n]


def default_block(n: int) -> int:
    """Block length for the moving-block bootstrap: ceil(n^(1/3)) (a standard rate)."""
    return max(1, int(np.ceil(n ** (1 / 3))))


def bootstrap_ci(values, *, B: int = BOOTSTRAP_B, seed: int = 0, alpha: float = 0.05,
                 block: int | None = None) -> tuple[float, float, float]:
    """(mean, lo, hi): the 95% percentile bootstrap CI of the mean of per-unit values (units =
    traces or windows). ``block`` > 1 uses a moving-block bootstrap (windows cut from one trace)."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError("bootstrap_ci needs a non-empty 1-D array of per-unit values")
    if not np.isfinite(v).all():
        raise ValueError("bootstrap_ci: values must be finite")
    if v.size == 1:
        return float(v[0]), float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    means = v[_bootstrap_indices(v.size, B, rng, block)].mean(axis=1)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(v.mean()), float(lo), float(hi)


def paired_difference(a, b, **kw) -> tuple[float, float, float]:
    """Mean of ``a - b`` over paired units, with its bootstrap CI: the comparison of two policies
    that removes the units' own variation (both ran on the same traces, windows and loads).

    Args:
        a: per-unit values of the first policy (e.g. goodput per trace).
        b: the other policy's values on the same units, in the same order and shape.
        **kw: passed to ``bootstrap_ci`` (``B``, ``seed``, ``alpha``, ``block`` for a moving-block
            bootstrap when the units are windows of one trace).

    Returns:
        ``(mean, lo, hi)``: the mean difference and its percentile bootstrap interval.

    Raises:
        ValueError: the shapes differ, or the differences are empty, not 1-D or not finite.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: shapes differ {a.shape} vs {b.shape}")
    return bootstrap_ci(a - b, **kw)


def stratified_difference(diffs, blocks=None, *, groups=None, B: int = BOOTSTRAP_B, seed: int = 0,
                          alpha: float = 0.05) -> tuple[float, float, float]:
    """(mean, lo, hi) of the mean over strata (cells) of each stratum's mean paired difference, with
    a percentile bootstrap that resamples units within each stratum (moving blocks where ``blocks``
    gives a length > 1): the pooled comparison of two policies over several deployment cells, each
    cell weighted equally. Strata with the same ``groups`` id share their units (the same windows of
    one trace under other rules or loads): they are resampled with the same indices."""
    ds = [np.asarray(d, np.float64) for d in diffs]
    if not ds or any(d.ndim != 1 or d.size == 0 or not np.isfinite(d).all() for d in ds):
        raise ValueError("stratified_difference needs non-empty 1-D finite arrays, one per stratum")
    blocks = list(blocks) if blocks is not None else [None] * len(ds)
    groups = list(groups) if groups is not None else list(range(len(ds)))
    rng = np.random.default_rng(seed)
    means = np.zeros(B)
    drawn = {}
    for d, blk, g in zip(ds, blocks, groups):
        if d.size == 1:
            means += d[0]
            continue
        if g not in drawn:
            drawn[g] = _bootstrap_indices(d.size, B, rng, blk)
        idx = drawn[g]
        if idx.shape[1] != d.size:
            raise ValueError(f"stratified_difference: strata of group {g!r} differ in size")
        means += d[idx].mean(axis=1)
    means /= len(ds)
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(np.mean([d.mean() for d in ds])), float(lo), float(hi)


def win_rate(a, b) -> float:
    """Share of paired units where ``a`` beats ``b`` (higher is better), ties counting 1/2: how
    often one policy wins, which a mean difference can hide.

    Args:
        a: per-unit values of the first policy.
        b: the other policy's values on the same units, in the same order.

    Returns:
        The win rate in [0, 1]; NaN when there are no units.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return float("nan")
    return float(((a > b) + 0.5 * (a == b)).mean())
