"""Benchmark report writers: JSON (deterministic), Markdown leaderboard, PNG plots, sidecar meta.

``write_report(report, out_dir)`` builds every file in a temporary directory inside ``out_dir``
and moves them into place only when all of them are complete (the JSON report last), with SIGINT
held off during the moves: an exception or Ctrl-C leaves no partial report.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np

from .engine.levers import without_guard

JSON_NAME, MD_NAME, META_NAME = "report.json", "report.md", "run_meta.json"
PNG_GOODPUT, PNG_TTFT = "goodput_vs_load.png", "ttft_cdf.png"
#: a report's files, in the order they move into place (the JSON last)
REPORT_FILES = (PNG_GOODPUT, PNG_TTFT, MD_NAME, META_NAME, JSON_NAME)


# ------------------------------------------------------------------------------------ JSON
def round_sig(x: float, sig: int = 6):
    """``x`` rounded to ``sig`` significant digits; +-inf -> "inf"/"-inf", NaN -> None."""
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    r = float(f"{x:.{sig}g}")
    return 0.0 if r == 0 else r


def rounded(obj, sig: int = 6):
    """A JSON-ready copy of ``obj`` with every float rounded (ints and strings untouched)."""
    if isinstance(obj, dict):
        return {str(k): rounded(v, sig) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, sig) for v in obj]
    if isinstance(obj, np.ndarray):
        return [rounded(v, sig) for v in obj.tolist()]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return round_sig(obj, sig)
    return obj


def report_json(data: dict) -> str:
    return json.dumps(rounded(data), indent=1, allow_nan=False) + "\n"


# ------------------------------------------------------------------------------------ text
def _f(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.{nd}f}"


def _ms(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def _ci(d, nd=3) -> str:
    return f"{_f(d['mean'], nd)} [{_f(d['ci95'][0], nd)}, {_f(d['ci95'][1], nd)}]"


def _diff(d, nd=3) -> str:
    if d is None:
        return "-"
    return f"{d['diff']:+.{nd}f} [{d['ci95'][0]:+.{nd}f}, {d['ci95'][1]:+.{nd}f}]"


def _load_entry(data, rho):
    for e in data["loads"]:
        if e["rho"] == rho:
            return e
    raise KeyError(rho)


def primary_lines(data: dict) -> list:
    p = data.get("primary_endpoint")
    if not p:
        return []
    if "diff" not in p:
        return [f"PRIMARY ENDPOINT: {p['definition']}"]
    lines = [f"PRIMARY ENDPOINT (index+shed minus edf+shed, {data['workload']['name']}/{p['split']}, "
             f"rho {p['rho']:g}, {p['units']} traces): {p['diff']:+.4f}  95% CI [{p['ci95'][0]:+.4f}, "
             f"{p['ci95'][1]:+.4f}]  win rate {p['win_rate']:.3f}  "
             f"(index+shed {p['index_plus_shed']:.4f}, edf+shed {p['edf_plus_shed']:.4f})"]
    if "cluster" in p:
        lines.append(f"  (a cluster of {p['cluster']['replicas']} replicas behind {p['cluster']['router']}: not the "
                     f"pre-registered single-engine test)")
    elif not p["is_primary_split"]:
        lines.append("  (not the pre-registered test set: other split or --max-traces)")
    lines.append(f"  parameters: {p['parameters']['note']}")
    return lines


def _own(d: dict, label: str) -> str:
    """The label of row ``label`` behind the same router as the row ``d`` (a cluster benchmark with
    several routers labels its rows ``<router> x <label>``)."""
    prefix = f"{d['router']} x " if "router" in d else ""
    return prefix + label if prefix and d["label"].startswith(prefix) else label


def leaderboard_rows(entry: dict, gap_printed: bool) -> list:
    """Rows of the main leaderboard at one load (strings); "vs" a baseline behind the row's own router."""
    out = []
    for d in sorted(entry["rows"], key=lambda d: -d["goodput"]["mean"]):
        name = d["label"] + (" (reference)" if d["reference"] else "")
        fcfs, edf = d["vs"].get(_own(d, "fcfs")), d["vs"].get(_own(d, "edf+shed"))
        out.append([name, _ci(d["goodput"]), _diff(fcfs), _diff(edf), _f(edf["win_rate"], 2) if edf else "-",
                    "-" if d["relative_goodput"] is None else f"{d['relative_goodput']:+.1%}",
                    _ms(d["ttft_ms"]["p99_all"]), _ms(d["ttft_ms"]["p99_completed"]),
                    _f(d["sla_respect"]), str(d["shed"]), str(d["preemptions"]),
                    _f(d.get("gap_closed"), 2) if gap_printed else "-"])
    return out


LB_HEADER = ["policy", "goodput [95% CI]", "vs fcfs", "vs edf+shed", "win vs edf+shed", "rel. goodput",
             "TTFT p99 all (ms)", "TTFT p99 done (ms)", "SLA respect", "shed", "preempt", "gap closed"]


def _table(header, rows) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _text_table(header, rows) -> list:
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda r: "  ".join(str(x).ljust(n) for x, n in zip(r, w)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * n for n in w])] + [fmt(r) for r in rows]


def bound_rows(entry: dict) -> list:
    """The yardsticks printed beside the leaderboard at one load: the upper bound (when computed),
    the best single deployable row (what "gap closed" is measured against) and the per-window best
    of those rows (an oracle selector, labelled as one: no single policy achieves it)."""
    out = [["upper bound", _ci(entry["upper_bound"])]] if "upper_bound" in entry else []
    return out + [[f"best achieved ({entry['best_achieved']['label']})", _ci(entry["best_achieved"]["goodput"])],
                  ["oracle selector (per-window best of rows)", _ci(entry["oracle_selector"])]]


BOUND_HEADER = ["beside the leaderboard", "goodput [95% CI]"]


def gap_line(entry: dict) -> str:
    """One line: what "gap closed" is measured against, or why it is not shown."""
    b = entry["best_achieved"]
    s = (f"gap closed = (row - FCFS) / (best achieved - FCFS): best achieved {b['label']} "
         f"{b['goodput']['mean']:.3f}  FCFS {entry['fcfs_goodput']:.3f}")
    if "fcfs_row" in entry:   # (a cluster: one reference for every router; "vs fcfs" is the row's own router's)
        s += (f"  (FCFS here, and in rel. goodput: {entry['fcfs_row']}; vs fcfs: the fcfs row behind the "
              "same router)")
    if "best_achieved_reference" in entry:
        r = entry["best_achieved_reference"]
        s += f"  (reference {r['label']} {r['goodput']['mean']:.3f})"
    if not entry["gap_closed_printed"]:
        s += "  (gap closed not shown: best achieved - FCFS < 0.02)"
    return s


def _header_lines(data) -> list:
    w = data["workload"]
    where = f"{w['name']}/{w['split']}" if w["split"] else w["name"]
    lam = data["lambda_sat"]
    return [f"workload   {where}: {w['units']} {'traces' if w['kind'] == 'suite' else 'windows'}, "
            f"{w['requests_scored']} scored requests; bootstrap {w['bootstrap']}",
            f"profile    {data['profile']['name']} [{data['profile']['provenance']}]; lambda_sat "
            f"{lam['rps']:.4g} req/s ({lam['source']})",
            *_cluster_header(data),
            f"predictor  {data['predictor']}; T_ref {data['t_ref_ms']:.1f} ms",
            f"parameters {data['parameters']['note']}",
            *_engine_lines(data),
            *_admission_lines(data),
            *[f"WARNING    {w}" for w in data.get("warnings", [])],
            f"evidence   {data['evidence_id']}"]


def _cluster_header(data) -> list:
    """A cluster benchmark's replicas and routers (docs/design.md section 12)."""
    c = data.get("cluster")
    if c is None:
        return []
    return [f"cluster    {c['replicas']} replicas behind {', '.join(c['routers'])}"
            + (f"; metrics staleness {c['metrics_staleness_ms']:g} ms" if c["metrics_staleness_ms"] else "")]


def cluster_rows(entry: dict) -> list:
    """Each row's replicas at one load (cluster mode): utilisation per replica, imbalance, prefix hit rate."""
    return [[d["label"], " ".join(f"{u:.2f}" for u in d["cluster"]["utilisation"]),
             f"{d['cluster']['imbalance']:.3f}", f"{d['cluster']['prefix_hit_rate']:.1%}"]
            for d in entry["rows"] if "cluster" in d]


CLUSTER_HEADER = ["row", "replica utilisation", "imbalance (max / mean busy)", "prefix hit rate"]


def router_gain_rows(entry: dict, data: dict) -> list:
    """The router's gain at one load (cluster mode, several routers): each row behind another router
    against the same row behind the first, paired."""
    c = data.get("cluster")
    if c is None or len(c["routers"]) < 2:
        return []
    first = c["routers"][0]
    out = []
    for d in entry["rows"]:
        r = d.get("router")
        if r is None or r == first:
            continue
        ref = f"{first} x {d['label'][len(r) + 3:]}"
        gain = d["vs"].get(ref)
        if gain is not None:
            out.append([d["label"], ref, _diff(gain), _f(gain["win_rate"], 2)])
    return out


ROUTER_HEADER = ["row", "against", "router gain [95% CI]", "win rate"]


def _engine_lines(data) -> list:
    """The engine settings that differ from the defaults (the evidence's ``engine_config``)."""
    from .engine.state import EngineConfig
    given = (data.get("evidence_inputs") or {}).get("engine_config")
    if not given:
        return []
    default = EngineConfig().to_dict()
    diff = [f"{k} {v}" for k, v in given.items() if k not in ("record_iterations",) and default.get(k, None) != v]
    return [f"engine     {', '.join(diff)} (the profile's otherwise)"] if diff else []


def _admission_lines(data) -> list:
    """The engine's length limit on this workload (docs/design.md section 10): what no policy can
    serve, and a warning when it is more than 5% of the arrivals."""
    a = data.get("admission")
    if a is None:
        return []
    out = [f"admission  max_model_len {a['max_model_len']}: rejected {a['rejected_share']:.1%}, length-capped "
           f"{a['capped_share']:.1%} of the arrivals; ceiling {a['ceiling']:.3f}; loads are admitted loads"]
    if a["warning"]:
        out.append(f"WARNING    {a['rejected_share'] + a['capped_share']:.1%} of the arrivals can never be met "
                   f"(rejected or length-capped): goodput over all arrivals is at most {a['ceiling']:.3f}; "
                   f"each row's goodput_admitted_uncapped leaves them out")
    return out


def mlperf_lines(entry: dict) -> list:
    """MLPerf's own verdict at one load (an MLPerf SLO preset): p99 TTFT and p99 TPOT over the run
    within its limits, per row."""
    rows = [d for d in entry["rows"] if "mlperf" in d]
    if not rows:
        return []
    lim = rows[0]["mlperf"]["limits"]
    ok = [d["label"] for d in rows if d["mlperf"]["valid"]]
    return [f"MLPerf verdict (p99 TTFT <= {lim['ttft_ms']:g} ms and p99 TPOT <= {lim['tpot_ms']:g} ms over the "
            f"run): valid: {', '.join(ok) if ok else 'none'}; the per-request goodput above applies the limits to "
            f"each request"]


def lever_lines(entry: dict) -> list:
    """The tuned levers' gain at one load (docs/design.md section 11): each levered row against the
    same row at the profile's flags, paired."""
    out = []
    for d in entry["rows"]:
        if "profile_flags_row" not in d:
            continue
        flags = ", ".join(f"--{k.replace('_', '-')} {'off' if v == 0 else v}" for k, v in sorted(d["levers"].items()))
        gain = d["vs"].get(d["profile_flags_row"])
        out.append([d["label"], flags, _diff(gain), _f(gain["win_rate"], 2) if gain else "-"])
    return out


LEVER_HEADER = ["row", "tuned levers", "gain vs untuned flags [95% CI]", "win rate"]


def guard_lines(entry: dict) -> list:
    """The tpot-guard rule's gain at one load (docs/design.md section 11): each ``+tpot-guard`` row
    against the same row without the rule, paired."""
    out = []
    for d in entry["rows"]:
        if "tpot_guard" not in d:
            continue
        base = without_guard(d["label"])
        gain = d["vs"].get(base)
        before = next((x.get("tpot_only_missed", "-") for x in entry["rows"] if x["label"] == base), "-")
        lv = d.get("levers", {})
        tuned = " (own" + (f", B {lv['max_num_batched_tokens']}" if "max_num_batched_tokens" in lv else "") + ")"
        out.append([d["label"], f"u {d['tpot_guard']['u']:.2f}, B_min {d['tpot_guard']['bmin']:.2f}"
                    + (tuned if "budget_u" in lv or "budget_bmin" in lv else ""), _diff(gain),
                    _f(gain["win_rate"], 2) if gain else "-", f"{before} -> {d.get('tpot_only_missed', '-')}"])
    return out


GUARD_HEADER = ["row", "tpot-guard", "gain vs the row without it [95% CI]", "win rate",
                "TPOT-only misses (without -> with)"]


def console_summary(data: dict) -> str:
    lines = primary_lines(data)
    if lines:
        lines.append("")
    lines += _header_lines(data)
    lines += [f"note: {n}" for n in data["workload"]["notes"]]
    rho = data["primary_load"]
    e = _load_entry(data, rho)
    lines += ["", f"leaderboard at rho {rho:g} ({e['rate_rps']:.4g} req/s):"]
    lines += _text_table(LB_HEADER, leaderboard_rows(e, e["gap_closed_printed"]))
    lines += [""] + _text_table(BOUND_HEADER, bound_rows(e))[2:] + [gap_line(e)]
    lines += mlperf_lines(e)
    cl = cluster_rows(e)
    if cl:
        lines += ["", f"replicas at rho {rho:g} (utilisation: mean over units; prefix hit rate: pooled):"]
        lines += _text_table(CLUSTER_HEADER, cl)
    rg = router_gain_rows(e, data)
    if rg:
        lines += ["", f"routers at rho {rho:g} (each row against the same row behind the first router, paired):"]
        lines += _text_table(ROUTER_HEADER, rg)
    lev = lever_lines(e)
    if lev:
        lines += ["", f"tuned levers at rho {rho:g} (each row against itself at the untuned flags: the profile's, "
                      "with any engine flags given):"]
        lines += _text_table(LEVER_HEADER, lev)
    gl = guard_lines(e)
    if gl:
        lines += ["", f"tpot-guard at rho {rho:g} (each row against itself without the rule; a row with its own u, "
                      "B_min (tuned, or the robust defaults') also has its own flags and parameters, so its gain is "
                      "the rule's and theirs):"]
        lines += _text_table(GUARD_HEADER, gl)
    lines += ["", "goodput by load:"]
    labels = [d["label"] for d in data["loads"][0]["rows"]]
    hdr = ["rho"] + labels + (["UB"] if "upper_bound" in data["loads"][0] else [])
    rows = []
    for e in data["loads"]:
        r = [f"{e['rho']:g}"] + [f"{d['goodput']['mean']:.3f}" for d in e["rows"]]
        if "upper_bound" in e:
            r.append(f"{e['upper_bound']['mean']:.3f}")
        rows.append(r)
    lines += _text_table(hdr, rows)
    cap = data.get("capacity")
    if cap:
        lines += ["", f"capacity at SLO (goodput >= {cap['target']:g}), ratio to FCFS:"]
        for lab, c in cap["rows"].items():
            r = c["ratio_to_fcfs"]
            s = r if isinstance(r, str) else f"{r['geomean']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
            extra = f"  savings ${c['savings_usd_per_year']:,.0f}/yr" if "savings_usd_per_year" in c else ""
            lines.append(f"  {lab:<18} {s}  (not reached {c['not_reached']}, >= max load "
                         f"{c['censored_at_max_load']}){extra}")
    return "\n".join(lines) + "\n"


def report_markdown(data: dict) -> str:
    L = [f"# TokenBatch benchmark: {data['workload']['name']}", ""]
    pl = primary_lines(data)
    if pl:
        L += ["## Primary endpoint", "", *[f"    {x}" for x in pl], ""]
    L += ["## Setup", "", *[f"- {x}" for x in _header_lines(data)]]
    for n in data["workload"]["notes"]:
        L.append(f"- note: {n}")
    rho = data["primary_load"]
    e = _load_entry(data, rho)
    L += ["", f"## Leaderboard at rho {rho:g}", ""]
    L += _table(LB_HEADER, leaderboard_rows(e, e["gap_closed_printed"]))
    L += ["", *_table(BOUND_HEADER, bound_rows(e)), "", gap_line(e)]
    cl = cluster_rows(e)
    if cl:
        L += ["", f"## Replicas at rho {rho:g}", "",
              "Utilisation (busy / span) per replica and imbalance: means over units; prefix hit rate: hit / "
              "queried tokens, pooled.", ""]
        L += _table(CLUSTER_HEADER, cl)
    rg = router_gain_rows(e, data)
    if rg:
        L += ["", f"## Routers at rho {rho:g}", "", "Each row behind another router against the same row behind "
              "the first (paired).", ""]
        L += _table(ROUTER_HEADER, rg)
    lev = lever_lines(e)
    if lev:
        L += ["", f"## Tuned levers at rho {rho:g}", "",
              "Each row with its tuned vLLM flags against the same row at the untuned flags (the profile's, with "
              "any engine flags given on the command line; paired).", ""]
        L += _table(LEVER_HEADER, lev)
    gl = guard_lines(e)
    if gl:
        L += ["", f"## The tpot-guard budget rule at rho {rho:g}", "",
              "Each +tpot-guard row against the same row without the rule (paired). A row with its own u and "
              "B_min (from a parameters file tuned with the rule, or the robust defaults') also has its own "
              "margin, index parameters and flags: its gain is the rule's and theirs.", ""]
        L += _table(GUARD_HEADER, gl)
    L += ["", "## Goodput by load (mean [95% CI])", ""]
    labels = [d["label"] for d in data["loads"][0]["rows"]]
    hdr = ["rho"] + labels + (["upper bound"] if "upper_bound" in data["loads"][0] else [])
    rows = []
    for ent in data["loads"]:
        r = [f"{ent['rho']:g}"] + [_ci(d["goodput"]) for d in ent["rows"]]
        if "upper_bound" in ent:
            r.append(_f(ent["upper_bound"]["mean"]))
        rows.append(r)
    L += _table(hdr, rows)
    for ent in data["loads"]:
        L += ["", f"## Secondary metrics at rho {ent['rho']:g}", ""]
        hdr = ["policy", "TTFT p50/p99 all", "TTFT p50/p99 done", "TPOT p50/p99 all", "TPOT p50/p99 done",
               "E2E p50/p99 all", "E2E p50/p99 done", "tok/s", "met req/s", "recomputed", "timed out",
               "rejected", "TTFT p99 cache-miss", "max wait (ms)"]
        rows = []
        for d in ent["rows"]:
            lat = lambda k, s, d=d: f"{_ms(d[k]['p50_' + s])} / {_ms(d[k]['p99_' + s])}"  # noqa: E731
            rows.append([d["label"], lat("ttft_ms", "all"), lat("ttft_ms", "completed"), lat("tpot_ms", "all"),
                         lat("tpot_ms", "completed"), lat("e2e_ms", "all"), lat("e2e_ms", "completed"),
                         _f(d["throughput_tok_s"], 1), _f(d["met_req_s"], 3), str(d["recomputed_tokens"]),
                         str(d["timed_out"]), str(d["rejected"]), _ms(d["ttft_p99_cache_miss_ms"]),
                         _ms(d["max_wait_ms"])])
        L += _table(hdr, rows)
        classes = list(ent["rows"][0]["goodput_by_class"])
        hdr = ["policy"] + [f"class {c}" for c in classes] + [f"prompt Q{i + 1}" for i in range(5)]
        rows = [[d["label"]] + [_f(d["goodput_by_class"][c]["goodput"]) for c in classes]
                + [_f(q["goodput"]) for q in d["goodput_by_prompt_quintile"]] for d in ent["rows"]]
        L += ["", "Goodput per SLA class and per prompt-length quintile (edges "
              + ", ".join(f"{x:g}" for x in data["prompt_quintile_edges"]) + " tokens):", ""]
        L += _table(hdr, rows)
    cap = data.get("capacity")
    if cap:
        L += ["", f"## Capacity at SLO (goodput >= {cap['target']:g})", "",
              f"Grid {cap['grid']}, {cap['bisection_steps']} bisection steps.", ""]
        hdr = ["policy", "ratio to FCFS (geomean [95% CI])", "mean rho reached", "not reached", ">= max load",
               "savings $/yr"]
        rows = []
        for lab, c in cap["rows"].items():
            r = c["ratio_to_fcfs"]
            ratio = r if isinstance(r, str) else f"{r['geomean']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
            rows.append([lab, ratio,
                         _f(c["reached_mean_rho"]), str(c["not_reached"]), str(c["censored_at_max_load"]),
                         f"{c['savings_usd_per_year']:,.0f}" if "savings_usd_per_year" in c else "-"])
        L += _table(hdr, rows)
        if "savings_formula" in cap:
            L += ["", f"Savings = {cap['savings_formula']}."]
    L += ["", "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in data["definitions"].items()]
    L += ["", f"Evidence id `{data['evidence_id']}` (SHA-256 of the canonical JSON `evidence_inputs` in "
          f"report.json). Wall time, host and date are in run_meta.json.", ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------ plots
def plot_goodput(curves: dict, path, replicas: int = 1) -> None:
    """Goodput vs load per row with its CI band (and the upper bound); ``replicas`` > 1: a cluster's
    load, against R x lambda_sat."""
    xlabel = "load rho (x lambda_sat)" if replicas == 1 else f"load rho (x {replicas} x lambda_sat: the cluster's)"
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    x = curves["loads"]
    for label, pts in curves["goodput"].items():
        m = [p["mean"] for p in pts]
        lo = [p["ci95"][0] for p in pts]
        hi = [p["ci95"][1] for p in pts]
        (line,) = ax.plot(x, m, marker="o", ms=3, label=label)
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    if curves.get("upper_bound"):
        ax.plot(x, curves["upper_bound"], "k--", lw=1, label="upper bound")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("goodput (met / arrived)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def plot_ttft_cdf(curves: dict, rho: float, path) -> None:
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for label, v in curves["ttft_cdf"].items():
        v = np.asarray(v)
        n = v.size
        fin = v[np.isfinite(v)]
        if n == 0 or fin.size == 0:
            continue
        ax.step(np.maximum(fin, 1e-3), np.arange(1, fin.size + 1) / n, where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms), all arrived requests (no first token = never reaches the curve)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.set_title(f"TTFT CDF at rho {rho:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


# ------------------------------------------------------------------------------------ writing
@contextlib.contextmanager
def _sigint_held():
    """Defer SIGINT (main thread only) while files move into place."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except (AttributeError, ValueError, OSError):  # pragma: no cover (non-POSIX)
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _check_file_places(out: Path, what: str = "report file") -> None:
    """A directory in a report file's place would fail its move halfway, leaving a mixed set of old
    and new files: refused before any move."""
    for name in REPORT_FILES:
        if (out / name).is_dir():
            from .errors import OutputError
            raise OutputError(f"{what} {out / name}: cannot write: a directory is in the way (nothing of "
                              f"the report was written)")


def check_report_out(out_dir, what: str) -> None:
    """Before long work: ``out_dir`` can take a report (``_io.check_writable``, and no directory in a
    report file's place)."""
    from ._io import check_writable
    check_writable(out_dir, what, directory=True)
    _check_file_places(Path(out_dir), what)


def write_report(report, out_dir) -> list:
    """Write report.json, report.md, the PNGs and run_meta.json into ``out_dir``; returns paths."""
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    data = report.data
    tmp = Path(tempfile.mkdtemp(prefix=".bench-tmp-", dir=out))
    done = False
    from ._io import write_errors
    try:
        with write_errors(out):   # (a full disk: an OutputError, not a traceback)
            curves = dict(report.curves)
            if data["loads"] and "upper_bound" in data["loads"][0]:
                curves["upper_bound"] = [e["upper_bound"]["mean"] for e in data["loads"]]
            plot_goodput(curves, tmp / PNG_GOODPUT, (data.get("cluster") or {}).get("replicas", 1))
            plot_ttft_cdf(curves, data["primary_load"], tmp / PNG_TTFT)
            (tmp / MD_NAME).write_text(report_markdown(data), encoding="utf-8")
            (tmp / META_NAME).write_text(json.dumps(report.meta, indent=1, default=str) + "\n", encoding="utf-8")
            (tmp / JSON_NAME).write_text(report_json(data), encoding="utf-8")
        _check_file_places(out)
        with _sigint_held():
            for name in REPORT_FILES:   # (the JSON last)
                os.replace(tmp / name, out / name)
        done = True
        return [out / n for n in REPORT_FILES]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not done:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if still empty
