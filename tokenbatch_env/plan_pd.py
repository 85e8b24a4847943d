"""Planning a disaggregated deployment (docs/design.md section 13, "Comparisons"): ``tokenbatch plan --pd``.

For each GPU count G the prefill:decode splits Rp:Rd (Rp + Rd = G) are swept, and the best split is
set beside the best colocated cluster of G replicas whose iteration-size levers (section 11) are
tuned on the same trial budget: as many lever settings as splits were tried, the first the
profile's own flags, the rest drawn at random (seeded) from the row's lever space. Both sides run the
plan's best colocated row's router (the split's prefill router) and replica policy; the split's
decode router and KV link are ``PlanConfig.decode_router`` and ``kv_link``. Both first-token
conventions (``first_token_at`` prefill and decode) are rows: one replay scores both.

The GPU counts are searched as section 12's R (doubling from 2, bisection, G + 1 confirmed) for each
convention, plus ``PlanConfig.pd_gpus``. A gain is the best split's goodput minus the tuned colocated
cluster's at the same G, with a paired moving-block bootstrap CI over the same units of admitted
uncapped requests.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from .engine.disagg import FIRST_TOKEN_AT, FIRST_TOKEN_MEANING
from .engine.levers import lever_space, suggest_levers
from .plan import (HOURS_PER_YEAR, REFERENCE, PlanRow, best_of, local_map, non_monotone, plan_capacity, row_policy,
                   save_goodput_plot, search_min)

class RandomTrial:
    """An optuna-like trial drawing from a seeded ``numpy`` generator (``suggest_levers``' draws
    without optuna, a ``tune`` extra): ``suggest_int`` log-uniform or uniform, ``suggest_float`` uniform."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def suggest_int(self, name, lo, hi, log=False):
        if log:
            return int(min(hi, max(lo, round(float(np.exp(self.rng.uniform(np.log(lo), np.log(hi + 1)) - 0.5))))))
        return int(self.rng.integers(lo, hi + 1))

    def suggest_float(self, name, lo, hi, log=False):
        return float(self.rng.uniform(lo, hi))


def splits_of(G: int, trials: int) -> list:
    """The prefill replicas Rp tried at G GPUs: every 1 .. G - 1 when they are at most ``trials``,
    else ``trials`` of them evenly spaced (both ends included)."""
    if G - 1 <= trials:
        return list(range(1, G))
    return sorted({int(round(x)) for x in np.linspace(1, G - 1, trials)})


def lever_trials(profile, n: int, seed: int, G: int) -> list:
    """``n`` lever settings for a colocated cluster of G replicas: the profile's own flags ({}),
    then ``n - 1`` drawn from the lever space (seeded by ``seed`` and G)."""
    space = lever_space(profile)
    rng = np.random.default_rng([seed, G])
    out = [{}]
    while len(out) < n:
        out.append(suggest_levers(RandomTrial(rng), space))
    return out


def unit_means(met: np.ndarray, units: int) -> np.ndarray:
    """Per-unit goodput: ``met`` (admitted uncapped requests in arrival order) cut into ``units``
    consecutive groups."""
    groups = [g for g in np.array_split(met, min(units, max(1, met.size))) if g.size]
    return np.array([g.mean() for g in groups]) if groups else np.zeros(1)


def _ci(per_unit, cfg) -> list:
    from .metrics import bootstrap_ci, default_block
    _, lo, hi = bootstrap_ci(per_unit, B=cfg.bootstrap_b, seed=cfg.bootstrap_seed, block=default_block(per_unit.size))
    return [float(lo), float(hi)]


def misses(rec: dict, trace, ok: np.ndarray) -> dict:
    """Why the admitted uncapped requests ``ok`` missed: the share without a first token within its
    TTFT SLO (not served, or late), and the share with it but over the TPOT SLO."""
    ttft_in = (rec["ttft_ns"] >= 0) & (rec["ttft_ns"] <= trace.ttft_slo_ns) & (rec["first_token_ns"] >= 0)
    ttft_in, met = ttft_in[ok], rec["met"][ok]
    n = max(1, int(ok.sum()))
    return {"missed_ttft": float((~ttft_in).sum() / n), "missed_tpot_only": float((ttft_in & ~met).sum() / n)}


def _met_pd(task):
    """One split's replay: met over the admitted uncapped requests and why they missed, per
    first_token_at; the median wait from handoff to the KV's arrival on D (its admission there, then
    the transfer)."""
    cfg, profile, row, G, Rp, est, rl, ok = task
    from .engine.cluster import Router
    from .engine.disagg import simulate_pd
    res = simulate_pd(cfg.trace, profile, row_policy(cfg.trace, row), cfg.engine, prefill_replicas=Rp,
                      decode_replicas=G - Rp, prefill_router=Router(row.router), decode_router=cfg.decode_router,
                      kv_link=cfg.kv_link, estimates=est, residual_life=rl)
    recs = {f: res.records(f) for f in FIRST_TOKEN_AT}
    r = recs[FIRST_TOKEN_AT[0]]
    moved = ok & (r["kv_ready_ns"] >= 0)
    wait = (r["kv_ready_ns"] - r["handoff_ns"])[moved]
    return ({f: rec["met"][ok].astype(np.float64) for f, rec in recs.items()},
            {"misses": {f: misses(rec, cfg.trace, ok) for f, rec in recs.items()},
             "handoff_to_kv_ms_p50": float(np.median(wait)) / 1e6 if wait.size else None})


def _met_colocated(task):
    """One lever setting's replay on G colocated replicas: met over the admitted uncapped requests,
    and why they missed."""
    cfg, profile, row, G, levers, est, rl, ok = task
    from .engine.cluster import Router, simulate_cluster
    from .engine.levers import with_levers
    res = simulate_cluster(cfg.trace, profile, row_policy(cfg.trace, row), with_levers(cfg.engine, levers),
                           replicas=G, router=Router(row.router), estimates=est, residual_life=rl)
    rec = res.records()
    return rec["met"][ok].astype(np.float64), misses(rec, cfg.trace, ok)


def plan_with_pd(cfg, progress: bool = False) -> dict:
    """``plan.plan_capacity(cfg)`` and, with ``cfg.pd``, its P/D part under ``"pd"`` (``plan_pd``) for
    the plan's best colocated row (the reference when no row reaches the target)."""
    plan = plan_capacity(cfg, progress)
    if not cfg.pd:
        return plan
    import contextlib

    from .engine.state import admitted_uncapped
    from .predictors import ResidualLife, estimates
    from .workload import default_predictor
    profile = cfg.engine.resolve(cfg.profile)
    best = best_of(plan["rows"]) or next(r for r in plan["rows"] if (r["router"], r["policy"], r["shed"]) == REFERENCE)
    row = PlanRow(best["router"], best["policy"], best["shed"])
    est = estimates(cfg.trace, default_predictor())
    rl = ResidualLife.from_lengths(cfg.trace.output_tokens).table
    ok = admitted_uncapped(cfg.trace.prompt_tokens, cfg.trace.output_tokens, profile.max_model_len)
    with contextlib.ExitStack() as stack:
        plan["pd"] = plan_pd(cfg, profile, row, est, rl, ok, local_map(stack, cfg.workers), progress)
    return plan


def plan_pd(cfg, profile, row, est, rl, ok, mapper, progress: bool = False) -> dict:
    """The P/D part of a plan (module docstring) for the colocated row ``row`` (a ``PlanRow``):
    per GPU count the splits, the tuned colocated cluster and the gains; per convention the fewest
    GPUs meeting the target. ``mapper(fn, tasks)``: the plan's (local processes or not)."""
    from .engine.kv_link import resolve_kv_link
    from .metrics import default_block, paired_difference
    seen: dict = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(desc="plan --pd GPU counts", unit="G", leave=False, file=sys.stderr)

    def at(G: int) -> dict:
        if G in seen:
            return seen[G]
        rps = splits_of(G, cfg.pd_trials)
        levers = lever_trials(profile, len(rps), cfg.bootstrap_seed, G)
        pd, pd_why = zip(*mapper(_met_pd, [(cfg, profile, row, G, rp, est, rl, ok) for rp in rps]))
        co, co_why = zip(*mapper(_met_colocated, [(cfg, profile, row, G, lv, est, rl, ok) for lv in levers]))
        co_units = [unit_means(m, cfg.units) for m in co]
        k = int(np.argmax([m.mean() if m.size else 0.0 for m in co]))
        colocated = {"levers": levers[k], "goodput": float(co[k].mean()) if co[k].size else 0.0,
                     "ci95": _ci(co_units[k], cfg), **co_why[k], "trials": [
                         {"levers": lv, "goodput": float(m.mean()) if m.size else 0.0} for lv, m in zip(levers, co)]}
        entry = {"gpus": G, "trials": len(rps), "colocated": colocated, "splits": [], "best": {}}
        for rp, mets, why in zip(rps, pd, pd_why):
            entry["splits"].append({"prefill_replicas": rp, "decode_replicas": G - rp,
                                    "goodput": {f: float(m.mean()) if m.size else 0.0 for f, m in mets.items()},
                                    **why})
        for f in FIRST_TOKEN_AT:
            j = int(np.argmax([s["goodput"][f] for s in entry["splits"]]))
            units = unit_means(pd[j][f], cfg.units)
            d, lo, hi = paired_difference(units, co_units[k], B=cfg.bootstrap_b, seed=cfg.bootstrap_seed,
                                          block=default_block(units.size))
            entry["best"][f] = {"prefill_replicas": rps[j], "decode_replicas": G - rps[j],
                                "goodput": entry["splits"][j]["goodput"][f], "ci95": _ci(units, cfg),
                                **entry["splits"][j]["misses"][f],
                                "handoff_to_kv_ms_p50": entry["splits"][j]["handoff_to_kv_ms_p50"],
                                "gain": {"mean": float(d), "ci95": [float(lo), float(hi)]}}
        seen[G] = entry
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"G {G}")
        return entry

    fewest = {}
    for f in FIRST_TOKEN_AT:
        G = search_min(lambda G, f=f: at(G)["best"][f]["goodput"] >= cfg.target, int(cfg.max_replicas), start=2)
        fewest[f] = {"gpus": G,
                     "split": None if G is None else [seen[G]["best"][f]["prefill_replicas"],
                                                      seen[G]["best"][f]["decode_replicas"]]}
    for G in cfg.pd_gpus:
        at(int(G))
    if bar is not None:
        bar.close()
    for f in FIRST_TOKEN_AT:
        fewest[f]["non_monotone"] = non_monotone([seen[g]["best"][f]["goodput"] >= cfg.target for g in sorted(seen)])
    link = resolve_kv_link(cfg.kv_link)
    return {"router": row.router, "policy": row.policy, "shed": row.shed, "row": row.label,
            "decode_router": cfg.decode_router, "kv_link": dataclasses.asdict(link), "kv_link_text": link.describe(),
            "trials": cfg.pd_trials,
            "first_token_at": dict(FIRST_TOKEN_MEANING), "fewest": fewest,
            "by_gpus": [seen[g] for g in sorted(seen)]}


def json_rows(plan: dict) -> list:
    """``--json``'s rows: the plan's (``plan.json_rows``, kind ``colocated``), then with a P/D part
    (``pd_rows``) its rows."""
    from .plan import json_rows as colocated_rows
    return colocated_rows(plan) + (pd_rows(plan) if "pd" in plan else [])


def pd_rows(plan: dict) -> list:
    """``--json``'s P/D rows: per convention the fewest GPUs (``replicas`` = Rp + Rd; null, and the
    split null, if not reached), then per GPU count its best split per convention and the tuned
    colocated cluster (``prefill_replicas``/``decode_replicas`` null)."""
    pd = plan["pd"]
    base = {"router": pd["router"], "policy": pd["policy"], "shed": pd["shed"]}
    by = {e["gpus"]: e for e in pd["by_gpus"]}
    out = []
    for f, fw in pd["fewest"].items():
        G = fw["gpus"]
        out.append({**base, "kind": "pd", "first_token_at": f, "replicas": G,
                    "prefill_replicas": None if G is None else fw["split"][0],
                    "decode_replicas": None if G is None else fw["split"][1],
                    "goodput": None if G is None else by[G]["best"][f]["goodput"],
                    "usd_per_year": None if G is None else (G * plan["gpus_per_replica"] * HOURS_PER_YEAR
                                                            * plan["gpu_price_usd_per_hour"]),
                    "levers": None, "decode_router": pd["decode_router"], "kv_link": pd["kv_link"]["name"]})
    for e in pd["by_gpus"]:
        G = e["gpus"]
        for f, b in e["best"].items():
            out.append({**base, "kind": "pd@gpus", "first_token_at": f, "replicas": G,
                        "prefill_replicas": b["prefill_replicas"], "decode_replicas": b["decode_replicas"],
                        "goodput": b["goodput"], "gain_vs_colocated": b["gain"]["mean"],
                        "gain_ci95": b["gain"]["ci95"], "usd_per_year": None, "levers": None,
                        "decode_router": pd["decode_router"], "kv_link": pd["kv_link"]["name"]})
        out.append({**base, "kind": "colocated@gpus", "first_token_at": None, "replicas": G,
                    "prefill_replicas": None, "decode_replicas": None, "goodput": e["colocated"]["goodput"],
                    "usd_per_year": None, "levers": e["colocated"]["levers"] or None})
    return out


def format_pd(plan: dict) -> str:
    """The console table of the P/D part."""
    pd = plan["pd"]
    lines = ["", f"P/D       {pd['row']} (the prefill router and replica policy), decode router {pd['decode_router']}, "
                 f"KV over {pd['kv_link_text']}; at each GPU count the splits (at most {pd['trials']}, evenly "
                 f"spaced: --pd-trials) beside the colocated cluster with its flags tuned on as many trials (the "
                 f"first: the profile's flags)"]
    for f, m in pd["first_token_at"].items():
        lines.append(f"          first token at {f}: {m}")
    lines += ["", f"{'GPUs':>4}  {'first token':<11} {'split':<6} {'goodput [95% CI]':<22} {'missed':<10}  "
                  f"{'colocated, tuned [CI]':<22} {'missed':<10}  {'gain [95% CI]':<25} splits (Rp:goodput)"]
    for e in pd["by_gpus"]:
        c = e["colocated"]
        for f, b in e["best"].items():
            g = b["gain"]
            sp = " ".join(f"{s['prefill_replicas']}:{s['goodput'][f]:.3f}" for s in e["splits"])
            split = f"{b['prefill_replicas']}:{b['decode_replicas']}"
            lines.append(f"{e['gpus']:>4}  {f:<11} {split:<6} "
                         f"{b['goodput']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]  "
                         f"{b['missed_ttft']:.2f} / {b['missed_tpot_only']:.2f}  "
                         f"{c['goodput']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]  "
                         f"{c['missed_ttft']:.2f} / {c['missed_tpot_only']:.2f}  "
                         f"{g['mean']:+.3f} [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]  {sp}")
    lines.append("(missed: the share of requests past their TTFT SLO / within it but past their TPOT SLO; gain: best "
                 "split - tuned colocated at the same GPU count, paired 95% moving-block bootstrap CI; the levers "
                 "chosen and each split's median wait from handoff to its KV on D: plan.json)")
    for f, fw in pd["fewest"].items():
        if fw["gpus"] is None:
            lines.append(f"fewest GPUs, first token at {f}: not reached up to --max-replicas (at most "
                         f"{pd['trials']} splits tried per GPU count: --pd-trials)")
        else:
            lines.append(f"fewest GPUs, first token at {f}: {fw['gpus']} ({fw['split'][0]} prefill : {fw['split'][1]} "
                         f"decode)" + ("  NON-MONOTONE" if fw["non_monotone"] else ""))
    return "\n".join(lines)


def plot_pd(plan: dict, path) -> None:
    """Goodput vs split: one line per GPU count and convention (x: the prefill share Rp / G), the
    tuned colocated cluster of that count dotted, the target dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pd = plan["pd"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for e in pd["by_gpus"]:
        G = e["gpus"]
        x = [s["prefill_replicas"] / G for s in e["splits"]]
        line, = ax.plot(x, [s["goodput"]["prefill"] for s in e["splits"]], marker="o", ms=3,
                        label=f"{G} GPUs, first token at prefill")
        ax.plot(x, [s["goodput"]["decode"] for s in e["splits"]], marker="x", ms=4, ls="-.", color=line.get_color(),
                label=f"{G} GPUs, at decode")
        ax.axhline(e["colocated"]["goodput"], ls=":", color=line.get_color(), lw=1.2,
                   label=f"{G} GPUs colocated, tuned levers")
    ax.set_xlabel("prefill share of the GPUs (Rp / G)")
    save_goodput_plot(fig, ax, plan, "goodput vs prefill:decode split", path)
