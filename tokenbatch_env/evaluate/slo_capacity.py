"""Capacity at SLO (docs/design.md section 6, ``--capacity``): per unit, the largest grid rho whose
goodput meets the target at every grid rho' <= rho, refined by bisection inside the bracketing
cell; suite value = geometric mean of per-unit ratios to FCFS with a paired CI."""

from __future__ import annotations

import math

import numpy as np

from .config import BenchConfig
from .rows import Row, run_row


def capacity_grid(goodput_grid: np.ndarray, loads, target: float):
    """Per unit: (index of the largest grid load meeting target at every load up to it, or -1)."""
    ok = goodput_grid >= target                         # [L, U]
    prefix_ok = np.cumprod(ok, axis=0).astype(bool)
    n_ok = prefix_ok.sum(axis=0)
    return n_ok - 1


def row_capacity(row: Row, wl, est: list, profile, cfg: BenchConfig, grid: np.ndarray, bar) -> dict:
    """Capacity at SLO of one row: per-unit rho (None = not reached) and censoring flags."""
    loads = list(cfg.loads)
    L, U = grid.shape
    k = capacity_grid(grid, loads, cfg.capacity_target)
    lo = np.array([loads[i] if i >= 0 else np.nan for i in k])
    hi = np.array([loads[i + 1] if 0 <= i < L - 1 else np.nan for i in k])
    refine = np.flatnonzero(np.isfinite(lo) & np.isfinite(hi))
    for _ in range(cfg.capacity_steps):
        if refine.size == 0:
            bar.update(1)
            continue
        mid = (lo[refine] + hi[refine]) / 2
        traces = [wl.unit_at(int(u), float(r)) for u, r in zip(refine, mid)]
        res = run_row(row, wl, traces, [est[int(u)] for u in refine], profile, cfg)
        for j, u in enumerate(refine):
            g = res.records(j)["met"][wl.scored[u]].mean()
            if g >= cfg.capacity_target:
                lo[u] = mid[j]
            else:
                hi[u] = mid[j]
        bar.update(1)
    return {"rho": [None if not np.isfinite(x) else float(x) for x in lo],
            "censored": [bool(i == L - 1) for i in k]}


def capacity_summary(caps: dict, rows: list, wl, cfg: BenchConfig) -> dict:
    """report.json's ``capacity``: per row, the per-unit capacities (``row_capacity``) and their
    geometric-mean ratio to FCFS with a paired bootstrap CI (and the savings, with a GPU price)."""
    from ..metrics import bootstrap_ci
    out = {"target": cfg.capacity_target, "grid": list(cfg.loads), "bisection_steps": cfg.capacity_steps,
           "rows": {}}
    f = caps["fcfs"]["rho"]
    for r in rows:
        c = caps[r.label]
        rho = c["rho"]
        both = [i for i in range(len(rho)) if rho[i] is not None and f[i] is not None]
        d = {"per_unit_rho": rho, "censored_at_max_load": sum(c["censored"]),
             "not_reached": sum(x is None for x in rho),
             "reached_mean_rho": (float(np.mean([x for x in rho if x is not None]))
                                  if any(x is not None for x in rho) else None),
             "units_paired_with_fcfs": len(both)}
        if both:
            logs = np.log(np.array([rho[i] / f[i] for i in both]))
            m, lo, hi = bootstrap_ci(logs, B=cfg.bootstrap_b, seed=cfg.bootstrap_seed, block=wl.block)
            d["ratio_to_fcfs"] = {"geomean": math.exp(m), "ci95": [math.exp(lo), math.exp(hi)]}
            if cfg.gpu_price is not None:
                rr = math.exp(m)
                d["savings_usd_per_year"] = cfg.gpus * (1 - 1 / rr) * cfg.gpu_price * 8760
        else:
            d["ratio_to_fcfs"] = "not reached"
        out["rows"][r.label] = d
    if cfg.gpu_price is not None:
        out["savings_formula"] = (f"N_gpus * (1 - 1/r) * price * 8760 h with N_gpus = {cfg.gpus}, "
                                  f"price = {cfg.gpu_price} $/GPU-h")
    return out
