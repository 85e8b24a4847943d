#!/usr/bin/env python
"""Fit the synthetic trace families to the real traces' statistics.

    python tools/fit_families.py                      # print the fits (JSON) and a fidelity check
    python tools/fit_families.py --write              # also update the family suite specs

Reads the real traces from ``../shared/traces`` (or ``--shared DIR`` / ``$TOKENBATCH_SHARED``); they
are never copied into the repository. Only the fitted numbers below are shipped, in
``tokenbatch_env/data/suites/<family>.json`` (``generator`` section and ``provenance.fit``).

Methods (all on the whole file unless said otherwise; the suites' traces hold ``TRACE_LEN`` = 400
requests, so time-varying statistics are measured on windows of that many consecutive requests):

* **Lengths**: log-normal maximum likelihood, ``mu = mean(ln x)``, ``sigma = std(ln x)`` (ddof 0),
  for prompt and output tokens, and ``corr`` = Pearson correlation of ``(ln P, ln O)``. Caps in the
  data (Azure conv outputs at 1000, code prompts near 7.4k, Mooncake outputs at 2000) are ignored.
* **Arrivals, azure-conv**: Gamma-renewal; ``cv`` = median over 400-request windows of the
  coefficient of variation of inter-arrival gaps (the window median removes the hour-scale trend
  of the rate); ``rate_rps`` = requests / span of the whole file.
* **Arrivals, azure-code**: on/off traffic (minutes with 0 and with 600 requests), so a 2-state
  Markov-modulated Poisson process fitted by EM (Baum-Welch) of a Poisson hidden Markov model on
  1 s bin counts; per-bin transition probabilities ``a_kk`` become mean dwell ``1 s / (1 - a_kk)``.
  ``rate_mult`` = the state's rate in req/s (the generator renormalises to ``rate_rps``).
* **Arrivals, mooncake (conversation_trace)**: timestamps lie on a ~3 s grid, so gaps are not
  observable below 3 s. Gamma-renewal whose ``cv`` is chosen (by bisection on simulated traces)
  so that the index of dispersion (variance / mean) of per-grid-bucket counts equals the real one.
* **Prefix sharing, mooncake** (within 400-request windows, as a 400-request trace would see it):
  every request starts with hash id 0 (one shared 512-token block: ``common_prefix_tokens = 512``).
  A request is *grouped* if it shares more than that block with another request of its window; its
  prefix is the longest shared run of hash ids times 512 tokens (at most its prompt), its ratio
  that over its prompt. Groups are the connected sets of requests sharing their second hash id.
  ``ratio`` = Beta fitted by moments to the grouped requests' ratios; ``share_fraction`` and
  ``num_groups`` (zipf 0) solve, by grid search, for the expected fraction of requests in groups
  of >= 2 and the expected number of such groups equal to the windows' means, then are corrected
  by simulation (fixed-point iteration on generated traces truncated to ``MAX_MODEL_LEN``) so the
  generated traces *realise* those two numbers. Most multi-turn conversations have only one or two
  turns inside 400 requests, so the fit has many groups and most members are alone in theirs: the
  two parameters are a device to reproduce the realised sharing, not a count of conversations.

The fitted log-normals are the untruncated distributions; the suites truncate them to
``MAX_MODEL_LEN`` (4096, stress-512) by resampling, which for Mooncake keeps only ~32% of the mass
(its median prompt is ~6.9k tokens): mooncake-like is Mooncake's traffic as seen by a 4k-context
engine. ``generated_check`` in the output compares generated traces with the observations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACE_LEN = 400
SPEC_DIR = ROOT / "tokenbatch_env" / "data" / "suites"
MAX_MODEL_LEN = 4096  # stress-512's max_model_len: the families' truncation (lengths.max_model_len)
FAMILIES = ("azure-conv-like", "azure-code-like", "mooncake-like")


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


# ---------------------------------------------------------------------------------------- readers
def read_azure(path: Path):
    """(arrival_ns, prompt, output) from an Azure LLM inference CSV (own minimal parser)."""
    ts, p, o = [], [], []
    with open(path) as f:
        next(f)
        for line in f:
            a, b, c = line.strip().split(",")
            _, clock = a.split(" ")
            hh, mm, ss = clock.split(":")
            sec, frac = ss.split(".")
            ts.append(((int(hh) * 60 + int(mm)) * 60 + int(sec)) * 10**9 + int(frac.ljust(9, "0")[:9]))
            p.append(int(b))
            o.append(int(c))
    return np.array(ts, np.int64), np.array(p, np.int64), np.array(o, np.int64)


def read_mooncake(path: Path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ts = np.array([r["timestamp"] for r in rows], np.int64) * 10**6
    p = np.array([r["input_length"] for r in rows], np.int64)
    o = np.array([r["output_length"] for r in rows], np.int64)
    return ts, p, o, [r["hash_ids"] for r in rows]


# ---------------------------------------------------------------------------------------- fits
def fit_lengths(p, o) -> dict:
    lp, lo = np.log(p), np.log(o)
    return {"prompt": {"mu": _sig(lp.mean()), "sigma": _sig(lp.std())},
            "output": {"mu": _sig(lo.mean()), "sigma": _sig(lo.std())},
            "corr": _sig(float(np.corrcoef(lp, lo)[0, 1]), 3)}


def length_stats(p, o) -> dict:
    return {"requests": int(p.size), "prompt_mean": _sig(p.mean()), "prompt_median": float(np.median(p)),
            "output_mean": _sig(o.mean()), "output_median": float(np.median(o))}


def window_gap_cv(ts) -> float:
    g = np.diff(ts).astype(float)
    cvs = [w.std() / w.mean() for w in (g[s:s + TRACE_LEN - 1] for s in range(0, g.size - TRACE_LEN + 2, TRACE_LEN))
           if w.size == TRACE_LEN - 1 and w.mean() > 0]
    return float(np.median(cvs))


def poisson_hmm(counts: np.ndarray, k: int, iters: int = 300, seed: int = 0):
    """Baum-Welch for a Poisson HMM; returns (lambdas per bin, transition matrix, log-likelihood)."""
    from math import lgamma

    c = counts.astype(float)
    T = c.size
    qs = np.quantile(c, np.linspace(0.1, 0.95, k))
    lam = np.maximum(qs, 0.05) + np.arange(k) * 1e-3
    A = np.full((k, k), 0.05 / max(k - 1, 1))
    np.fill_diagonal(A, 0.95)
    pi = np.full(k, 1.0 / k)
    lg = np.array([lgamma(x + 1) for x in c])
    ll_old = -np.inf
    for _ in range(iters):
        logb = c[:, None] * np.log(lam)[None, :] - lam[None, :] - lg[:, None]
        m = logb.max(axis=1, keepdims=True)
        b = np.exp(logb - m)
        alpha = np.zeros((T, k))
        scale = np.zeros(T)
        a = pi * b[0]
        scale[0] = a.sum()
        alpha[0] = a / scale[0]
        for t in range(1, T):
            a = (alpha[t - 1] @ A) * b[t]
            scale[t] = a.sum()
            alpha[t] = a / scale[t]
        beta = np.ones((T, k))
        for t in range(T - 2, -1, -1):
            beta[t] = (A @ (b[t + 1] * beta[t + 1])) / scale[t + 1]
        gamma = alpha * beta
        gamma /= gamma.sum(axis=1, keepdims=True)
        xi = np.zeros((k, k))
        for t in range(T - 1):
            x = alpha[t][:, None] * A * (b[t + 1] * beta[t + 1])[None, :]
            xi += x / x.sum()
        A = xi / xi.sum(axis=1, keepdims=True)
        pi = gamma[0]
        lam = np.maximum((gamma * c[:, None]).sum(0) / gamma.sum(0), 1e-6)
        ll = float(np.log(scale).sum() + m.sum())
        if ll - ll_old < 1e-7 * abs(ll):
            break
        ll_old = ll
    order = np.argsort(-lam)
    return lam[order], A[np.ix_(order, order)], ll


def fit_mmpp(ts, bin_s: float = 1.0, k: int = 2) -> dict:
    rel = ts - ts[0]
    counts = np.bincount((rel // int(bin_s * 1e9)).astype(np.int64))
    lam, A, _ = poisson_hmm(counts, k)
    states = []
    for i in range(k):
        states.append({"rate_mult": _sig(lam[i] / bin_s), "mean_dwell_s": _sig(bin_s / (1 - A[i, i]))})
    out = {"process": "mmpp", "rate_rps": _sig(len(ts) * 1e9 / (ts[-1] - ts[0])), "states": states}
    if k > 2:
        jump = A.copy()
        np.fill_diagonal(jump, 0)
        jump /= jump.sum(axis=1, keepdims=True)
        out["transitions"] = [[_sig(x) for x in r] for r in jump]
        for r in out["transitions"]:  # make rows sum to exactly 1 after rounding
            i = int(np.argmax(r))
            r[i] = 0.0
            r[i] = _sig(1.0 - sum(r), 10)
    return out


def bucket_idc(ts) -> tuple[float, float]:
    """(index of dispersion, mean) of counts per distinct timestamp bucket."""
    _, counts = np.unique(ts, return_counts=True)
    return float(counts.var() / counts.mean()), float(counts.mean())


def _sim_idc(cv: float, rate: float, bucket_s: float, n: int, seeds=range(8)) -> float:
    from tokenbatch_env.traces.generators import gamma_arrivals, rng_stream

    vals = []
    for s in seeds:
        a = gamma_arrivals(rng_stream(10_000 + s, 1), n, rate, cv)
        c = np.bincount(a // int(bucket_s * 1e9))
        vals.append(c.var() / c.mean())
    return float(np.mean(vals))


def fit_gamma_cv_by_idc(ts, bucket_s: float) -> tuple[float, dict]:
    idc, mean = bucket_idc(ts)
    rate = mean / bucket_s
    lo, hi = 0.2, 20.0
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if _sim_idc(mid, rate, bucket_s, 20_000) < idc:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi), {"bucket_s": bucket_s, "bucket_idc": _sig(idc), "bucket_mean": _sig(mean)}


def solve_groups(frac_target: float, groups_target: float) -> tuple[float, int]:
    """(share_fraction, num_groups) whose expected fraction of requests in groups of >= 2 and
    expected number of such groups (uniform groups, TRACE_LEN requests) best match the targets."""
    best = None
    m = np.linspace(0.0, 1.0, 1001) * TRACE_LEN  # joiners per trace for each candidate f
    for G in range(2, 20 * TRACE_LEN + 1):
        q = 1.0 - 1.0 / G
        singles = m * q ** np.maximum(m - 1, 0)
        groups2 = G * (1 - q**m) - m * q ** np.maximum(m - 1, 0)
        frac2 = (m - singles) / TRACE_LEN
        err = ((frac2 - frac_target) / frac_target) ** 2 + ((groups2 - groups_target) / groups_target) ** 2
        i = int(np.argmin(err))
        if best is None or err[i] < best[0]:
            best = (float(err[i]), float(m[i] / TRACE_LEN), G)
    return best[1], best[2]


def realized_groups(spec: dict, common_tokens: int, seeds=range(40)) -> tuple[float, float]:
    """(fraction of requests sharing a block past the common prefix with another request, number of
    such groups) per generated trace, averaged over ``seeds``."""
    from tokenbatch_env.traces.generators import TraceSpec, generate_trace

    cb = common_tokens // 16
    frac, groups = [], []
    for s in seeds:
        t = generate_trace(TraceSpec.from_dict(spec), s)
        lens = t.prefix_lengths
        keys = np.array([t.prefix_chain(i)[cb] if lens[i] > cb else -1 for i in range(len(t))])
        _, c = np.unique(keys[keys >= 0], return_counts=True)
        frac.append(c[c >= 2].sum() / len(t))
        groups.append(int((c >= 2).sum()))
    return float(np.mean(frac)), float(np.mean(groups))


def calibrate_prefix(fit: dict, max_model_len: int) -> dict:
    """Correct (share_fraction, num_groups) by simulation so that generated traces (truncated to
    ``max_model_len``) realise the observed grouped fraction and group count: a request whose
    drawn prefix ends inside the common block is not realised as grouped, which the closed form
    ignores. Fixed-point iteration on the closed-form targets."""
    obs = fit["observed"]
    f_real, g_real = obs["grouped_fraction"], obs["groups_of_2plus_per_window"]
    ft, gt = f_real, g_real
    spec = {"num_requests": TRACE_LEN, "arrivals": fit["arrivals"], "prefix": dict(fit["prefix"]),
            "lengths": {"dist": "lognormal", **fit["lengths"], "max_model_len": max_model_len}}
    for _ in range(6):
        f, g = realized_groups(spec, fit["prefix"]["common_prefix_tokens"])
        ft, gt = ft * f_real / f, gt * g_real / g
        sf, ng = solve_groups(min(ft, 0.999), gt)
        spec["prefix"].update(share_fraction=_sig(sf, 3), num_groups=int(ng))
    fit["prefix"] = spec["prefix"]
    return fit


def mooncake_prefix(hash_ids, prompts, block_tokens: int = 512) -> dict:
    n = len(hash_ids)
    common = all(h and h[0] == hash_ids[0][0] for h in hash_ids)
    fracs, ngroups, ratios = [], [], []
    for s in range(0, n - TRACE_LEN + 1, TRACE_LEN):
        win = hash_ids[s:s + TRACE_LEN]
        pr = prompts[s:s + TRACE_LEN]
        # longest common run of leading ids with any other request of the window (trie depth)
        counts: dict = {}
        for h in win:
            for d in range(1, len(h) + 1):
                key = tuple(h[:d])
                counts[key] = counts.get(key, 0) + 1
        grouped = 0
        groups: dict = {}
        for h, p in zip(win, pr):
            depth = 0
            for d in range(1, len(h) + 1):
                if counts[tuple(h[:d])] >= 2:
                    depth = d
                else:
                    break
            if depth >= 2:
                grouped += 1
                groups[h[1]] = groups.get(h[1], 0) + 1
                ratios.append(min(depth * block_tokens, int(p)) / int(p))
        fracs.append(grouped / TRACE_LEN)
        ngroups.append(len(groups))
    r = np.array(ratios)
    mean, var = r.mean(), r.var()
    common_ab = mean * (1 - mean) / var - 1
    f_real, g_real = float(np.mean(fracs)), float(np.mean(ngroups))
    # share_fraction f and num_groups G (uniform) so that the expected fraction of requests in
    # groups of >= 2 and the expected number of such groups match the windows' means
    f_fit, g_fit = solve_groups(f_real, g_real)
    return {"spec": {"share_fraction": _sig(f_fit, 3), "num_groups": int(g_fit), "zipf": 0.0,
                     "ratio": {"dist": "beta", "a": _sig(mean * common_ab, 3),
                               "b": _sig((1 - mean) * common_ab, 3)},
                     "common_prefix_tokens": block_tokens if common else 0},
            "observed": {"windows": len(fracs), "grouped_fraction": _sig(f_real),
                         "groups_of_2plus_per_window": _sig(g_real), "ratio_mean": _sig(mean),
                         "ratio_std": _sig(math.sqrt(var)), "all_share_first_block": bool(common)}}


# ---------------------------------------------------------------------------------------- main
def fit_all(shared: Path) -> dict:
    az = shared / "traces" / "azure_llm_2023"
    mc = shared / "traces" / "mooncake_fast25"
    out = {}
    ts, p, o = read_azure(az / "AzureLLMInferenceTrace_conv.csv")
    cv = window_gap_cv(ts)
    out["azure-conv-like"] = {
        "source": "../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv (Azure LLM inference "
                  "trace 2023, conv; Patel et al., Splitwise, ISCA 2024; CC BY 4.0)",
        "arrivals": {"process": "gamma", "rate_rps": _sig(len(ts) * 1e9 / (ts[-1] - ts[0])), "cv": _sig(cv, 3)},
        "lengths": fit_lengths(p, o), "prefix": None,
        "observed": {**length_stats(p, o), "window_gap_cv_median": _sig(cv),
                     "whole_file_gap_cv": _sig(np.diff(ts).std() / np.diff(ts).mean())}}
    ts, p, o = read_azure(az / "AzureLLMInferenceTrace_code.csv")
    out["azure-code-like"] = {
        "source": "../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv (Azure LLM inference "
                  "trace 2023, code; Patel et al., Splitwise, ISCA 2024; CC BY 4.0)",
        "arrivals": fit_mmpp(ts, 1.0, 2), "lengths": fit_lengths(p, o), "prefix": None,
        "observed": {**length_stats(p, o), "window_gap_cv_median": _sig(window_gap_cv(ts)),
                     "whole_file_gap_cv": _sig(np.diff(ts).std() / np.diff(ts).mean())}}
    ts, p, o, hashes = read_mooncake(mc / "conversation_trace.jsonl")
    cv, idc = fit_gamma_cv_by_idc(ts, 3.0)
    pre = mooncake_prefix(hashes, p)
    out["mooncake-like"] = {
        "source": "../shared/traces/mooncake_fast25/conversation_trace.jsonl (Mooncake FAST'25, Kimi; "
                  "Qin et al., FAST 2025; Apache-2.0 repository)",
        "arrivals": {"process": "gamma", "rate_rps": _sig(len(ts) * 1e9 / (ts[-1] - ts[0])), "cv": _sig(cv, 3)},
        "lengths": fit_lengths(p, o), "prefix": pre["spec"],
        "observed": {**length_stats(p, o), **idc, **pre["observed"]}}
    calibrate_prefix(out["mooncake-like"], MAX_MODEL_LEN)
    return out


def fidelity(fits: dict, max_model_len: int = MAX_MODEL_LEN) -> dict:
    """Statistics of generated traces under each fit (before/after truncation) for comparison."""
    from tokenbatch_env.traces.generators import TraceSpec, generate_trace

    rep = {}
    for fam, f in fits.items():
        spec = {"num_requests": TRACE_LEN, "arrivals": f["arrivals"],
                "lengths": {"dist": "lognormal", **f["lengths"], "max_model_len": None}, "prefix": f["prefix"]}
        cvs, pm, om, fit_frac = [], [], [], []
        for s in range(40):
            t = generate_trace(TraceSpec.from_dict(spec), s)
            g = np.diff(t.arrival_ns).astype(float)
            cvs.append(g.std() / g.mean())
            pm.append(t.prompt_tokens.mean())
            om.append(t.output_tokens.mean())
            fit_frac.append(float(np.mean(t.prompt_tokens + t.output_tokens <= max_model_len)))
        prefix_check = {}
        if f["prefix"] is not None:
            fr, gr = realized_groups({**spec, "lengths": {**spec["lengths"], "max_model_len": max_model_len}},
                                     f["prefix"]["common_prefix_tokens"], seeds=range(100, 140))
            prefix_check = {"grouped_fraction": _sig(fr), "groups_of_2plus_per_trace": _sig(gr)}
        rep[fam] = {**prefix_check, "window_gap_cv_median": _sig(float(np.median(cvs))),
                    "prompt_mean": _sig(np.mean(pm)), "output_mean": _sig(np.mean(om)),
                    f"fraction_fitting_{max_model_len}": _sig(np.mean(fit_frac))}
    return rep


def write_specs(fits: dict, check: dict) -> None:
    for fam, f in fits.items():
        path = SPEC_DIR / f"{fam}.json"
        spec = json.loads(path.read_text())
        gen = spec["generator"]
        gen["arrivals"] = f["arrivals"]
        gen["lengths"].update(f["lengths"])
        gen["prefix"] = f["prefix"]
        spec["provenance"]["fit"] = {"tool": "python tools/fit_families.py --write", "source": f["source"],
                                     "observed": f["observed"],
                                     "generated_check": {"note": "the same statistics on 40 traces "
                                                         "generated from the fit (lengths before "
                                                         "truncation, prefix stats after)", **check[fam]}}
        from tokenbatch_env._io import write_text_atomic
        write_text_atomic(path, json.dumps(spec, indent=1) + "\n")   # a shipped file: never left partial
        print(f"updated {path.relative_to(ROOT)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shared", default=os.environ.get("TOKENBATCH_SHARED", str(ROOT.parent / "shared")))
    ap.add_argument("--write", action="store_true", help="update the family suite specs")
    args = ap.parse_args(argv)
    fits = fit_all(Path(args.shared))
    check = fidelity(fits)
    print(json.dumps({"fits": fits, "generated_check": check}, indent=1))
    if args.write:
        write_specs(fits, check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
