"""Tune on real traces, one deployment cell at a time, and judge the tuned index against the best
tuned baseline (docs/design.md section 10, "Tuning on a trace"; the table in docs/results.md).

A cell is (trace, profile, SLO rule, load). Each runs ``tuning/optuna_search.py --trace`` with the
default budget into ``<out>/<cell>/`` and is judged on its test windows:

* best baseline: the ``<baseline>+shed`` row with the best *validation* goodput (never the test's);
* headroom: the best deployable row's test goodput minus the best baseline's;
* verdict: where headroom >= 0.03, index+shed must close at least half of it; elsewhere it must be
  non-inferior (paired 95% CI lower end >= -0.01 against the best baseline);
* levers (docs/design.md section 11): TPOT binds in a cell where at least 5% of the test requests
  complete with their first token in time and miss on TPOT alone under the best baseline at the
  profile's flags; there every tuned row is reported with and without its tuned levers, and the
  levers' paired gain for the best baseline;
* with ``--budget-rule tpot-guard`` (docs/design.md section 11) every +shed row is also tuned with the
  rule (its u and B_min with the rest, the same budget), and two more verdicts: *lever*: the best
  baseline (validation, among the ``<baseline>+shed`` rows) with the rule minus itself with its tuned
  static levers >= +0.03 with the CI above 0; *ordering*: index+shed+tpot-guard minus the best
  ``<baseline>+shed+tpot-guard`` (validation) has a paired CI lower end >= -0.005.

    python tools/tune_trace_cells.py                       # every cell below (needs ../shared/traces)
    python tools/tune_trace_cells.py --cells code-a100-1.2 --out runs/cells
    python tools/tune_trace_cells.py --tables runs/trace-cells/cells.json   # the tables again
    python tools/tune_trace_cells.py --budget-rule tpot-guard --cells ... --out runs/trace-cells-guard
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"

#: name -> (trace file under ../shared/traces, profile)
WORKLOADS = {
    "code-a100": ("azure_llm_2023/AzureLLMInferenceTrace_code.csv", "llama2-7b-a100"),
    "conv-a100": ("azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "llama2-7b-a100"),
    "mooncake-h100": ("mooncake_fast25/conversation_trace.jsonl", "llama31-8b-h100"),
}
RULES = {"3class": None, "mlperf": "mlperf-llama3_1-8b"}
LOADS = ("native", "1.2", "2.0")
HEADROOM = 0.03
NON_INFERIOR = -0.01
TPOT_BINDS = 0.05
GUARD = "+tpot-guard"
LEVER_GAIN = 0.03          # the rule's lever verdict: gain >= 0.03, CI above 0
ORDER_NON_INFERIOR = -0.005   # the ordering verdict with the rule


def cells() -> dict:
    return {f"{w}-{r}-{x}": (w, r, x) for w in WORKLOADS for r in RULES for x in LOADS}


def run_cell(name: str, out: Path, budget_rule: str = "none") -> dict:
    from tokenbatch_env.tuning import TuneConfig, run_tuning
    w, r, load = cells()[name]
    trace, profile = WORKLOADS[w]
    cfg = TuneConfig(trace=str(TRACES / trace), profile=profile, slo_rule=RULES[r],
                     loads=("native",) if load == "native" else (float(load),), out=str(out / name),
                     progress=False, budget_rule=budget_rule)
    t0 = time.time()
    res = run_tuning(cfg)
    return judge(name, res["data"], time.time() - t0)


def judge(name: str, rep: dict, wall_s: float) -> dict:
    test = rep["test"]
    entry = test["loads"][0]
    rows = {d["label"]: d for d in entry["rows"]}
    base = {row: s["best"]["validation_goodput"] for row, s in rep["studies"].items()
            if row != "index+shed" and not row.endswith(GUARD) and s["best"] is not None}
    best_base = max(base, key=lambda k: (base[k], k))
    g = {lab: d["goodput"]["mean"] for lab, d in rows.items() if not d["reference"]}
    headroom = max(g.values()) - g[best_base]
    vs = rows["index+shed"]["vs"][best_base]
    diff = vs["diff"]
    if headroom >= HEADROOM:
        ok, rule = diff >= headroom / 2, "closes >= half"
    else:
        ok, rule = vs["ci95"][0] >= NON_INFERIOR, "non-inferior"
    # the levers: the best baseline against itself at the profile's flags, and every levered row's gain
    twin = rows[best_base].get("profile_flags_row")
    ref = rows[twin] if twin else rows[best_base]
    levers = {lab: {"levers": d["levers"], "with": d["goodput"]["mean"],
                    "without": rows[d["profile_flags_row"]]["goodput"]["mean"], "gain": d["vs"][d["profile_flags_row"]]}
              for lab, d in rows.items() if "profile_flags_row" in d}
    return {"cell": name, "rho": entry["rho"], "windows": test["workload"]["units"],
            "tpot_only_share": ref["tpot_only_missed"] / ref["arrived"],
            "tpot_binds": ref["tpot_only_missed"] / ref["arrived"] >= TPOT_BINDS,
            "best_baseline_levers": levers.get(best_base), "levers": levers,
            "rejected_capped": test["admission"]["rejected_share"] + test["admission"]["capped_share"],
            "best_baseline": best_base, "index_shed": g["index+shed"], "baseline": g[best_base],
            "best_row": max(g, key=g.get), "headroom": headroom, "diff": diff, "ci95": vs["ci95"],
            "criterion": rule, "pass": bool(ok), "tuning_evidence_id": rep["evidence_id"],
            "test_evidence_id": rep["test_evidence_id"], "wall_s": round(wall_s, 1),
            **({"guard": judge_guard(rep, rows)} if "index+shed" + GUARD in rep["studies"] else {})}


def judge_guard(rep: dict, rows: dict) -> dict:
    """The rule's two verdicts (docs/design.md section 11): the lever (the best ``<baseline>+shed``
    by validation, with the rule against its tuned static levers) and the ordering (index+shed with
    the rule against the best ``<baseline>+shed`` with the rule, by validation)."""
    val = {row: s["best"]["validation_goodput"] for row, s in rep["studies"].items() if s["best"] is not None}
    plain = [r for r in val if r + GUARD in val and r != "index+shed"]   # (rows with a tuned twin)
    guarded = [r + GUARD for r in plain]
    if not plain or "index+shed" + GUARD not in val:
        return {"error": "no completed trial in the twin studies"}
    b = max(plain, key=lambda k: (val[k], k))
    bg = max(guarded, key=lambda k: (val[k], k))
    lever = rows[b + GUARD]["vs"][b]
    order = rows["index+shed" + GUARD]["vs"][bg]
    g = lambda lab: rows[lab]["goodput"]["mean"]  # noqa: E731
    return {"best_baseline": b, "with_rule": g(b + GUARD), "without": g(b), "lever": lever,
            "lever_levers": rows[b + GUARD].get("levers"),
            "lever_pass": bool(lever["diff"] >= LEVER_GAIN and lever["ci95"][0] > 0),
            "best_guarded_baseline": bg, "index_guard": g("index+shed" + GUARD), "baseline_guard": g(bg),
            "order": order, "index_levers": rows["index+shed" + GUARD].get("levers"),
            "order_pass": bool(order["ci95"][0] >= ORDER_NON_INFERIOR)}


def guard_table(results: list) -> str:
    """The rule's verdicts per cell, then the ordering's pooled mean difference."""
    out = ["| cell | best baseline | with the rule (u, B_min) | tuned static levers only | gain [95% CI] | lever "
           "pass | index+shed+tpot-guard | best baseline with the rule | diff [95% CI] | ordering pass |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    diffs = []
    for r in results:
        if "guard" not in r or "error" in r["guard"]:
            continue
        x = r["guard"]
        lv = x["lever_levers"] or {}
        ul = f"u {lv.get('budget_u', 0):.2f}, B_min {lv.get('budget_bmin', 0):.2f}"
        lg, og = x["lever"], x["order"]
        diffs.append(og["diff"])
        out.append(f"| {r['cell']} | {x['best_baseline']} | {x['with_rule']:.3f} ({ul}) | {x['without']:.3f} | "
                   f"{lg['diff']:+.4f} [{lg['ci95'][0]:+.4f}, {lg['ci95'][1]:+.4f}] | "
                   f"{'yes' if x['lever_pass'] else 'NO'} | {x['index_guard']:.3f} | {x['best_guarded_baseline']} "
                   f"{x['baseline_guard']:.3f} | {og['diff']:+.4f} [{og['ci95'][0]:+.4f}, {og['ci95'][1]:+.4f}] | "
                   f"{'yes' if x['order_pass'] else 'NO'} |")
    if diffs:
        out.append(f"\nordering: mean difference over the {len(diffs)} cells {sum(diffs) / len(diffs):+.4f}")
    return "\n".join(out)


def table(results: list) -> str:
    out = ["| cell | rho | windows | denied | best baseline (validation) | index+shed | baseline | headroom | "
           "index+shed - baseline [95% CI] | criterion | pass | test evidence id |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r['cell']} | {r['rho']:.3g} | {r['windows']} | {r['rejected_capped']:.1%} | "
                   f"{r['best_baseline']} | {r['index_shed']:.3f} | {r['baseline']:.3f} | {r['headroom']:+.3f} | "
                   f"{r['diff']:+.4f} [{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}] | {r['criterion']} | "
                   f"{'yes' if r['pass'] else 'NO'} | `{r['test_evidence_id'][:12]}` |")
    return "\n".join(out)


def lever_table(results: list) -> str:
    """Per cell: TPOT-only misses of the best baseline at the profile's flags, and its levers' gain."""
    out = ["| cell | TPOT-only misses (best baseline, profile flags) | TPOT binds | best baseline | its tuned levers | "
           "with | without | gain [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = r["best_baseline_levers"]
        if b is None:
            out.append(f"| {r['cell']} | {r['tpot_only_share']:.1%} | {'yes' if r['tpot_binds'] else 'no'} | "
                       f"{r['best_baseline']} | - | - | - | - |")
            continue
        g = b["gain"]
        out.append(f"| {r['cell']} | {r['tpot_only_share']:.1%} | {'yes' if r['tpot_binds'] else 'no'} | "
                   f"{r['best_baseline']} | {_flags(b['levers'])} | {b['with']:.3f} | {b['without']:.3f} | "
                   f"{g['diff']:+.4f} [{g['ci95'][0]:+.4f}, {g['ci95'][1]:+.4f}] |")
    return "\n".join(out)


def rows_table(results: list) -> str:
    """Every levered row with and without its levers, in the cells where TPOT binds."""
    out = ["| cell | row | tuned levers | with | without | gain [95% CI] |", "|---|---|---|---|---|---|"]
    for r in results:
        if not r["tpot_binds"]:
            continue
        for lab, d in r["levers"].items():
            g = d["gain"]
            out.append(f"| {r['cell']} | {lab} | {_flags(d['levers'])} | {d['with']:.3f} | {d['without']:.3f} | "
                       f"{g['diff']:+.4f} [{g['ci95'][0]:+.4f}, {g['ci95'][1]:+.4f}] |")
    return "\n".join(out)


def _flags(lv: dict) -> str:
    short = {"max_num_batched_tokens": "B", "max_num_seqs": "seqs", "long_prefill_token_threshold": "thr"}
    return ", ".join(f"{short[k]} {'off' if v == 0 else v}" for k, v in sorted(lv.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    ap.add_argument("--out", default="runs/trace-cells", help="output directory (default runs/trace-cells)")
    ap.add_argument("--budget-rule", default="none", choices=("none", "tpot-guard"),
                    help="tpot-guard: also tune every +shed row with the rule and judge its two verdicts")
    ap.add_argument("--tables", default=None, metavar="CELLS_JSON",
                    help="print the tables of an earlier run's cells.json and stop")
    args = ap.parse_args(argv)
    if args.tables is not None:
        results = json.loads(Path(args.tables).read_text())
        print("\n\n".join((table(results), lever_table(results), rows_table(results), guard_table(results))))
        return 0
    if not TRACES.is_dir():
        print(f"tune_trace_cells.py: error: {TRACES} not found (the shared traces)", file=sys.stderr)
        return 2
    names = list(cells()) if args.cells is None else [c.strip() for c in args.cells.split(",") if c.strip()]
    bad = [c for c in names if c not in cells()]
    if bad:
        print(f"tune_trace_cells.py: error: unknown cell(s) {bad}; valid: {', '.join(cells())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    results = []
    from tokenbatch_env.errors import TokenBatchError
    for name in names:
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            results.append(run_cell(name, out, args.budget_rule))
        except TokenBatchError as e:
            print(f"tune_trace_cells.py: error: {name}: {e}", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "cells.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n\n".join((table(results), lever_table(results), rows_table(results), guard_table(results))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
