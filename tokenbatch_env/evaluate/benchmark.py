"""The benchmark itself (docs/design.md section 6): ``run_benchmark(BenchConfig) -> BenchReport``,
every row on every (load, unit), then the report's numbers (bootstrap CIs, paired differences,
pooled metrics, the upper bound, capacity at SLO, the primary endpoint)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from ..engine.levers import FLAGS_SUFFIX, LEVERS, without_guard
from ..errors import ConfigError
from .cluster import bench_workload, cluster_block
from .config import BASELINE_ROWS, GUARD_SUFFIX, PRIMARY_LOAD, PRIMARY_SPLIT, SHED_SUFFIX, BenchConfig
from .definitions import DEFINITIONS
from .evidence import evidence_id, evidence_inputs, num_or_str
from .outcomes import pooled_metrics, prompt_quintile_edges, request_outcomes, unit_metrics
from .rows import (CONTROL_COMPARATORS, CONTROLLED, build_rows, is_primary_suite, plain_label, routed_label,
                   row_guard, run_row)
from .slo_capacity import capacity_summary, row_capacity


def _ci(values, cfg: BenchConfig, block) -> dict:
    from ..metrics import bootstrap_ci
    m, lo, hi = bootstrap_ci(values, B=cfg.bootstrap_b, seed=cfg.bootstrap_seed, block=block)
    return {"mean": m, "ci95": [lo, hi]}


def _copy_ci(d: dict) -> dict:
    return {"mean": d["mean"], "ci95": list(d["ci95"])}


def unit_upper_bound(trace, profile, engine, scored, kv: bool = True) -> float:
    """The upper bound's share of a unit's scored requests (``bounds.upper_bound`` on the unit's
    whole trace, warm-up and cool-down included; at most the scored requests that are attainable)."""
    from ..bounds import upper_bound
    b = upper_bound(trace, profile, config=engine, kv=kv)
    return min(b.ub, int(b.attainable[scored].sum())) / int(scored.sum())


def _paired(a, b, cfg: BenchConfig, block) -> dict:
    from ..metrics import paired_difference, win_rate
    m, lo, hi = paired_difference(a, b, B=cfg.bootstrap_b, seed=cfg.bootstrap_seed, block=block)
    return {"diff": m, "ci95": [lo, hi], "win_rate": win_rate(a, b)}


@dataclasses.dataclass
class BenchReport:
    """``data``: the JSON report (deterministic); ``meta``: wall time, host, date (sidecar)."""

    config: BenchConfig
    data: dict
    meta: dict
    curves: dict = dataclasses.field(default_factory=dict, repr=False)   # for the plots

    @property
    def evidence_id(self) -> str:
        return self.data["evidence_id"]

    def to_json(self) -> str:
        from ..report import report_json
        return report_json(self.data)

    def to_markdown(self) -> str:
        from ..report import report_markdown
        return report_markdown(self.data)

    def summary_text(self) -> str:
        from ..report import console_summary
        return console_summary(self.data)

    def write(self, out_dir) -> list:
        from ..report import write_report
        return write_report(self, out_dir)


def _primary_load(loads) -> float:
    if PRIMARY_LOAD in loads:
        return PRIMARY_LOAD
    return loads[len(loads) // 2]


def run_benchmark(config: BenchConfig) -> BenchReport:
    """Run the benchmark of ``config``: the library form of ``tokenbatch bench``, for scripts and
    notebooks. Nothing is written; ``BenchReport.write`` does that.

    Args:
        config: what to run (``BenchConfig``).

    Returns:
        ``BenchReport``: the deterministic JSON data (with its evidence id), the run's metadata and
        the curves for the plots.

    Raises:
        TokenBatchError: a bad input found while preparing it: ``ProfileError`` (profile),
            ``TraceError`` (trace file), ``ConfigError`` (e.g. a suite or split that does not exist).
    """
    import platform
    import time
    from datetime import datetime, timezone

    from tqdm.auto import tqdm

    from .. import __version__
    from ..engine.profiles import load_profile

    t_start = time.time()
    cfg = config
    profile = cfg.engine.resolve(load_profile(cfg.profile))
    wl = bench_workload(cfg, profile)   # (prepare_workload; in cluster mode scaled to R replicas)
    if cfg.native_load:   # the trace's own timestamps as a load: its rho, from the train part
        cfg = dataclasses.replace(cfg, loads=tuple(sorted({*cfg.loads, wl.native_rho})), native_load=False)
    from ..params import deployment_warnings
    warnings = deployment_warnings(cfg.params_deployment, profile, wl.predictor)
    if cfg.t_ref_ms is not None and cfg.t_ref_ms != wl.t_ref_ms:   # units travel with parameters
        wl.notes.append(f"T_ref {cfg.t_ref_ms:.1f} ms from the parameters (t_ref_mode fixed); the evaluated "
                        f"workload's own would be {wl.t_ref_ms:.1f} ms")
        wl.t_ref_ms = cfg.t_ref_ms
    rows = build_rows(cfg)
    for label, lv in [*cfg.levers, *((lab, rr.levers) for lab, rr in cfg.routed)]:   # (the bound holds up to B_max)
        lv = dict(lv)
        B = lv.get("max_num_batched_tokens", profile.max_num_batched_tokens)
        if B > profile.budget_max:
            raise ConfigError(f"levers[{label!r}]: max_num_batched_tokens {B} exceeds the profile's B_max "
                              f"{profile.budget_max} (profile {profile.name})")
        seqs = lv.get("max_num_seqs", profile.max_num_seqs)
        if seqs > profile.max_num_seqs:
            raise ConfigError(f"levers[{label!r}]: max_num_seqs {seqs} exceeds the profile's {profile.max_num_seqs}")
        if seqs > B:   # (vLLM refuses it)
            raise ConfigError(f"levers[{label!r}]: max_num_seqs {seqs} exceeds max_num_batched_tokens {B} (vLLM "
                              "requires max_num_batched_tokens >= max_num_seqs)")
        if lv.get("long_prefill_token_threshold", 0) > profile.max_model_len:
            raise ConfigError(f"levers[{label!r}]: long_prefill_token_threshold {lv['long_prefill_token_threshold']} "
                              f"exceeds max_model_len {profile.max_model_len} (vLLM refuses it)")
    unused = sorted(set(dict(cfg.levers)) - {plain_label(r, cfg) for r in rows})
    ctl = [r.label for r in rows if r.policy == CONTROLLED]
    if ctl and any(f in LEVERS for _, lv in cfg.levers for f, _ in lv):
        wl.notes.append(f"{', '.join(ctl)}: at the profile's flags (a controller switches parameters mid-run; vLLM's "
                        "flags are static), beside rows with tuned flags")
    if unused:
        hint = "--policies and --shed" + (", and +tpot-guard rows with --budget-rule tpot-guard"
                                          if any(u.endswith(GUARD_SUFFIX) for u in unused) else "")
        wl.notes.append(f"tuned levers for rows not on this leaderboard: {', '.join(unused)} (add them with {hint})")
    inputs = evidence_inputs(cfg, wl, profile, rows)
    eid = evidence_id(inputs)
    loads = list(cfg.loads)
    L, U = len(loads), len(wl.units)
    at = {rho: wl.at(rho) for rho in loads}
    copies = [t for rho in loads for t in at[rho]]
    est_pred, est_oracle = wl.estimates(False), (wl.estimates(True) if any(r.reference for r in rows) else None)
    total = len(rows) + (1 if cfg.upper_bound else 0) + (len(rows) * cfg.capacity_steps if cfg.capacity else 0)
    bar = tqdm(total=total, desc="bench runs", unit="run", disable=not cfg.progress, file=sys.stderr,
               leave=False)
    per_row, per_row_stats = {}, {}
    try:
        def one_row(row):
            est = est_oracle if row.reference else est_pred
            res = run_row(row, wl, copies, est * L, profile, cfg)
            if row.router is not None:   # (cluster mode: the replicas' numbers of each copy)
                per_row_stats[row.label] = [[res.replica_stats(li * U + u) for u in range(U)] for li in range(L)]
            return [[request_outcomes(res.records(li * U + u), copies[li * U + u], wl.scored[u])
                     for u in range(U)] for li in range(L)]

        if cfg.threads > 1:   # the compiled kernel releases the GIL; each row is independent
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(min(cfg.threads, len(rows))) as ex:
                futs = [(row, ex.submit(one_row, row)) for row in rows]
                for row, f in futs:
                    per_row[row.label] = f.result()
                    bar.set_postfix_str(row.label)
                    bar.update(1)
        else:
            for row in rows:
                bar.set_postfix_str(row.label)
                per_row[row.label] = one_row(row)
                bar.update(1)
        ub = None
        if cfg.upper_bound:
            bar.set_postfix_str("upper bound")
            ub = np.array([[unit_upper_bound(t, profile, cfg.engine, wl.scored[u]) for u, t in enumerate(at[rho])]
                           for rho in loads])
            bar.update(1)
        sens = sensitivity(cfg, wl, rows, at, est_pred, est_oracle, profile, _primary_load(loads))
        caps = None
        if cfg.capacity:
            caps = {}
            for row in rows:
                bar.set_postfix_str(f"capacity {row.label}")
                grid = np.array([[unit_metrics(o)["goodput"] for o in per_row[row.label][li]] for li in range(L)])
                caps[row.label] = row_capacity(row, wl, est_oracle if row.reference else est_pred, profile,
                                            cfg, grid, bar)
    finally:
        bar.close()

    # ---------------------------------------------------------------- aggregate
    qedges = prompt_quintile_edges(np.concatenate([u.prompt_tokens[m] for u, m in zip(wl.units, wl.scored)]))
    block = wl.block
    unit_good = {r.label: np.array([[unit_metrics(o)["goodput"] for o in per_row[r.label][li]]
                                    for li in range(L)]) for r in rows}
    # admitted, uncapped scored requests (docs/design.md section 10): the denominator of the
    # goodput no policy is denied by the engine's length limit
    adm = wl.admission(profile.max_model_len)
    from ..engine.state import admitted_uncapped
    ok_len = [admitted_uncapped(u.prompt_tokens[m], u.output_tokens[m], profile.max_model_len)
              for u, m in zip(wl.units, wl.scored)]
    n_ok = int(sum(int(k.sum()) for k in ok_len))
    limits = None
    if cfg.slo_rule is not None:
        from ..traces.slo_rules import load_slo_rule
        limits = load_slo_rule(cfg.slo_rule).p99_limits
    # a row's own comparators are the rows behind its own router (cluster mode; the single engine's
    # rows have none); the reference (FCFS's goodput, relative goodput, gap closed) is the first
    # router's fcfs row
    ref = routed_label(cfg, cfg.routers[0] if cfg.cluster else None, "fcfs")
    loads_out = []
    curves = {"loads": loads, "goodput": {}, "ttft_cdf": {}}
    for li, rho in enumerate(loads):
        res_rows = []
        g_fcfs = float(unit_good[ref][li].mean())
        for r in rows:
            outs = per_row[r.label][li]
            um = [unit_metrics(o) for o in outs]
            g = unit_good[r.label][li]
            base = plain_label(r, cfg)
            own = [x for x in rows if x.router == r.router]   # (every row for a single engine)
            d = {"label": r.label, **({"router": r.router} if r.router is not None else {}), "policy": r.policy,
                 "shed_margin": num_or_str(r.shed_margin), "reference": r.reference,
                 "goodput": _ci(g, cfg, block),
                 "relative_goodput": (float(g.mean()) / g_fcfs - 1) if g_fcfs > 0 else None}
            vs = tuple(routed_label(cfg, r.router, b) for b in BASELINE_ROWS) \
                + (CONTROL_COMPARATORS if r.policy == CONTROLLED else ())
            if base == "index" + SHED_SUFFIX:   # against every other tuned row (shed rows, vLLM's flags)
                vs += tuple(x.label for x in own if (x.label.endswith(SHED_SUFFIX) or x.label.endswith(FLAGS_SUFFIX))
                            and x.label not in vs)
            if r.guard:   # the rule's gain: against the same row without it
                u, bmin = row_guard(r, cfg)
                d["tpot_guard"] = {"u": u, "bmin": bmin}
                vs += (without_guard(r.label),)
            if base == "index" + SHED_SUFFIX + GUARD_SUFFIX:   # against every other shed row with the rule
                vs += tuple(x.label for x in own if x.label.endswith(SHED_SUFFIX + GUARD_SUFFIX)
                            and x.label not in vs)
            if r.router is not None and r.router != cfg.routers[0]:   # the router's gain: the same row behind the first
                vs += (routed_label(cfg, cfg.routers[0], base),)
            if r.router_agent is not None:   # a trained router: against the same row behind every router
                vs += tuple(routed_label(cfg, rt, base) for rt in cfg.routers[1:])
            if r.levers:
                d["levers"] = dict(r.levers)
            if r.levers and r.twin:   # the levers' gain: against the same row at the profile's flags
                d["profile_flags_row"] = r.twin
                vs += (r.twin,)
            d["vs"] = {b: _paired(g, unit_good[b][li], cfg, block) for b in vs if b != r.label and b in unit_good}
            d["gap_closed"] = None   # (against the best achieved row, known once every row is in)
            tot = lambda k, um=um: int(sum(m[k] for m in um))  # noqa: E731
            d.update({
                "arrived": tot("arrived"), "met": tot("met"), "completed": tot("completed"),
                "shed": tot("shed"), "timed_out": tot("timed_out"), "rejected": tot("rejected"),
                "unfinished": tot("unfinished"), "preemptions": tot("preemptions"),
                "recomputed_tokens": tot("recomputed_tokens"),
                "throughput_tok_s": float(np.mean([m["throughput_tok_s"] for m in um])),
                "met_req_s": float(np.mean([m["met_req_s"] for m in um])),
            })
            d["length_capped"] = tot("length_capped")
            d["goodput_admitted_uncapped"] = (sum(int(o["met"][k].sum()) for o, k in zip(outs, ok_len)) / n_ok
                                              if n_ok else None)
            d.update(pooled_metrics(outs, qedges, wl.class_names))
            if limits is not None:   # MLPerf's own verdict: p99 over the run within its limits
                p99 = {"ttft_ms": d["ttft_ms"]["p99_all"], "tpot_ms": d["tpot_ms"]["p99_all"]}
                d["mlperf"] = {"p99_ttft_ms": p99["ttft_ms"], "p99_tpot_ms": p99["tpot_ms"], "limits": limits,
                               "valid": bool(all(p99[k] <= limits[k] for k in limits))}
            d["goodput_per_unit"] = [float(x) for x in g]
            if r.label in per_row_stats:
                d["cluster"] = cluster_block(per_row_stats[r.label][li], cfg, r.router, r)
            res_rows.append(d)
            curves["goodput"].setdefault(r.label, []).append(d["goodput"])
            if rho == _primary_load(loads):
                curves["ttft_cdf"][r.label] = np.sort(np.concatenate([o["ttft_ms"] for o in outs]))
        # what a deployment achieves: the best single row (reference rows know the future), and the
        # per-unit best of those rows, which no single row reaches (docs/design.md section 6)
        deploy = [d for d in res_rows if not d["reference"]] or res_rows
        best = max(deploy, key=lambda d: d["goodput"]["mean"])
        best_all = max(res_rows, key=lambda d: d["goodput"]["mean"])
        sel = np.max([unit_good[d["label"]][li] for d in deploy], axis=0)
        printed = best["goodput"]["mean"] - g_fcfs >= 0.02   # (a smaller denominator says nothing)
        if printed:
            for d in res_rows:
                d["gap_closed"] = (d["goodput"]["mean"] - g_fcfs) / (best["goodput"]["mean"] - g_fcfs)
        ent = {"rho": rho, "rate_rps": wl.rate(rho), "rows": res_rows,
               "fcfs_goodput": g_fcfs, **({"fcfs_row": ref} if cfg.cluster else {}),
               "best_achieved": {"label": best["label"], "goodput": _copy_ci(best["goodput"])}}
        if best_all is not best:
            ent["best_achieved_reference"] = {"label": best_all["label"], "goodput": _copy_ci(best_all["goodput"])}
        ent["gap_closed_printed"] = printed
        ent["oracle_selector"] = {**_ci(sel, cfg, block), "per_unit": [float(x) for x in sel]}
        if ub is not None:
            ent["upper_bound"] = {**_ci(ub[li], cfg, block), "per_unit": [float(x) for x in ub[li]]}
        loads_out.append(ent)

    primary = None
    if is_primary_suite(cfg):
        if PRIMARY_LOAD in loads:
            li = loads.index(PRIMARY_LOAD)
            # (in cluster mode: the first router's rows, and not the pre-registered single-engine test)
            ix, ed = (routed_label(cfg, cfg.routers[0] if cfg.cluster else None, b) for b in ("index+shed", "edf+shed"))
            p = _paired(unit_good[ix][li], unit_good[ed][li], cfg, block)
            lv = dict(cfg.levers)
            primary = {
                "definition": ("paired difference in mean goodput, index with shedding minus EDF with "
                               "shedding, seed-200/test at rho = 1.2, 95% paired percentile bootstrap CI"),
                **({"levers": {k: dict(lv[k]) for k in ("index+shed", "edf+shed") if k in lv}} if lv else {}),
                "split": cfg.split, "rho": PRIMARY_LOAD, "units": U,
                "is_primary_split": cfg.split == PRIMARY_SPLIT and cfg.max_traces is None and not cfg.cluster,
                **({"cluster": {"replicas": cfg.replicas, "router": cfg.routers[0]}} if cfg.cluster else {}),
                "index_plus_shed": float(unit_good[ix][li].mean()),
                "edf_plus_shed": float(unit_good[ed][li].mean()), **p,
                "parameters": _params_note(cfg),
            }
        else:
            primary = {"definition": "not computed: rho = 1.2 is not among the loads"}

    data = {
        "format": "tokenbatch-bench-report", "version": 1,
        "evidence_id": eid,
        "tokenbatch_version": __version__,
        "primary_endpoint": primary,
        "workload": {"kind": wl.kind, "name": wl.name,
                     "split": cfg.split if wl.kind == "suite" else cfg.trace_split, "units": U,
                     "requests_scored": int(sum(int(m.sum()) for m in wl.scored)),
                     "bootstrap": ("moving-block, block %d" % block) if block else "percentile (independent traces)",
                     "notes": wl.notes},
        "profile": {"name": profile.name, "provenance": profile.provenance},
        **({"cluster": {"replicas": cfg.replicas, "routers": list(cfg.routers),
                        "metrics_staleness_ms": cfg.metrics_staleness_ms}} if cfg.cluster else {}),
        "lambda_sat": {"rps": wl.lambda_sat, "source": wl.lambda_sat_source},
        "admission": adm,
        **({"sensitivity": sens} if sens else {}),
        **({"warnings": warnings} if warnings else {}),
        "predictor": wl.predictor.to_dict(),
        "t_ref_ms": wl.t_ref_ms,
        "parameters": _params_note(cfg),
        "baselines": list(BASELINE_ROWS),
        "prompt_quintile_edges": qedges,
        "sla_classes": wl.class_names,
        "primary_load": _primary_load(loads),
        "loads": loads_out,
        "capacity": capacity_summary(caps, rows, wl, cfg) if caps is not None else None,
        "definitions": DEFINITIONS,
        "evidence_inputs": inputs,
    }
    meta = {"evidence_id": eid, "wall_time_s": round(time.time() - t_start, 3),
            "host": platform.node(), "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "numpy": np.__version__, "argv": list(sys.argv)}
    return BenchReport(cfg, data, meta, curves)


#: contexts (tokens) beyond which an extrapolated profile's attention and KV terms were never fitted
FITTED_CONTEXT = 4096


def sensitivity(cfg, wl, rows, at, est_pred, est_oracle, profile, rho) -> Optional[dict]:
    """Each row's goodput at load ``rho`` with the profile's extrapolated terms halved and doubled
    (``engine.profiles.sensitivity_profiles``; docs/design.md section 10, long-context profile): for
    a profile whose source asks for it, on a workload with contexts beyond ``FITTED_CONTEXT``. The
    arrivals stay those of the profile itself (rho is at the reference configuration)."""
    from ..engine.profiles import sensitivity_profiles
    if "sensitivity" not in (profile.source or {}):
        return None
    longest = max(int((u.prompt_tokens[m].astype(np.int64) + u.output_tokens[m]).max(initial=0))
                  for u, m in zip(wl.units, wl.scored))
    if longest <= FITTED_CONTEXT:
        return None
    U = len(wl.units)
    out = {"rho": rho, "longest_context": longest, "variants": {}}
    for label, variant in sensitivity_profiles(profile):
        good = {}
        for row in rows:
            est = est_oracle if row.reference else est_pred
            res = run_row(row, wl, at[rho], est, variant, cfg)
            good[row.label] = float(np.mean([unit_metrics(request_outcomes(res.records(u), at[rho][u],
                                                                              wl.scored[u]))["goodput"]
                                             for u in range(U)]))
        out["variants"][label] = good
    return out


def _tuned_info(src: Optional[str]) -> Optional[dict]:
    """The ``tuned`` block that tuning/optuna_search.py writes into its params file (else None)."""
    if src is None:
        return None
    try:
        t = json.loads(Path(src).read_text()).get("tuned")
    except (OSError, ValueError, AttributeError):
        return None
    return t if isinstance(t, dict) and t.get("by") == "tuning/optuna_search.py" else None


def _params_note(cfg: BenchConfig) -> dict:
    src = cfg.params_source
    t = _tuned_info(src)
    if t is not None:
        what = t.get("suite") or Path(str(t.get("trace"))).name
        note = (f"TUNED: from {Path(src).name} (tuning/optuna_search.py on {what}/{t.get('split')} "
                f"at rho {', '.join(str(x) for x in t.get('loads') or [])}, {t.get('trials_per_study')} trials per "
                f"study)")
    elif src is None:
        note = "UNTUNED: default IndexParams"
    elif src.startswith("robust defaults"):
        ip = cfg.index_params
        order = ("SJF's order (every index coefficient 0: index = SJF)"
                 if all(getattr(ip, f) == 0 for f in ("kappa", "gamma", "theta", "beta", "w_prefix", "a_edf"))
                 else "index " + ", ".join(f"{k} {v:g}" for k, v in dataclasses.asdict(ip).items()))
        lv = dict(dict(cfg.levers).get("index" + SHED_SUFFIX + GUARD_SUFFIX, ()))
        extra = ""
        if lv:
            thr = lv.get("long_prefill_token_threshold", 0)
            extra = (f"; index+shed+tpot-guard adds the rule (u {lv.get('budget_u', 0):g}, B_min "
                     f"{lv.get('budget_bmin', 0):g}) and vLLM's flags B {lv.get('max_num_batched_tokens')}, "
                     f"max_num_seqs {lv.get('max_num_seqs')}, threshold {thr or 'off'} (fractions of this "
                     "deployment's)")
        note = (f"ROBUST DEFAULTS ({src[len('robust defaults '):].strip('()')}; tuned over a mixture of deployments "
                f"by tuning/robust_defaults.py, not on this workload): {order}, shed margin "
                f"{cfg.shed_margin('index'):g}{extra}")
    else:
        note = f"from {Path(src).name}; not produced by this project's tuning (untuned)"
    return {"index": dataclasses.asdict(cfg.index_params),
            "shed_margins": {p: cfg.shed_margin(p) for p in sorted({*cfg.policies, "edf", "index"})},
            "source": Path(src).name if t is not None else (src or "defaults (IndexParams(), shed margin 0.0)"),
            "tuned": t is not None,
            "note": note}
