"""The deployment leaderboard (docs/design.md section 10; the table in docs/results.md): every real-like
suite x profile x SLO rule, at loads 1.2 and 2.0, on each suite's test split.

Per (suite, profile, rule) two runs, each an ordinary command's:

* defaults: ``tokenbatch bench --suite S --split test --profile P --slo-rule R --loads 1.2,2.0
  --policies fcfs,priority,sjf,edf,llf,index --shed`` (every row at its shipped defaults; the index
  rows at the robust defaults, with their index+shed+tpot-guard row);
* tuned: ``python tuning/optuna_search.py --suite S --profile P --slo-rule R --loads 1.2,2.0
  --eval-loads 1.2,2.0 --no-comparators --max-train-traces 12`` (every row tuned on train with vLLM's
  flags, 48 trials per study, judged on test).

Per cell the table gives the upper bound, the best achieved row and the oracle selector over both
runs' deployable rows (the same test windows), the index at its robust defaults, the best baseline
at its defaults, the tuned index and the best tuned baseline, with both runs' evidence ids.

    python tools/deployment_leaderboard.py                          # every cell (about an hour)
    python tools/deployment_leaderboard.py --groups azure-code-like/llama2-7b-a100/mlperf-llama3_1-8b
    python tools/deployment_leaderboard.py --tables runs/leaderboard/leaderboard.json   # tables and plot again
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITES = ("azure-code-like", "azure-conv-like", "mooncake-like")
PROFILES = ("stress-512", "llama2-7b-a100", "llama3-8b-h100")
EXTRA = (("mooncake-like-long", "llama31-8b-h100"),)
RULES = ("default-3class", "mlperf-llama3_1-8b")
LOADS = (1.2, 2.0)
POLICIES = ("fcfs", "priority", "sjf", "edf", "llf", "index")
ROBUST_ROW = "index+shed+tpot-guard"


def groups() -> list:
    pairs = [(s, p) for s in SUITES for p in PROFILES] + list(EXTRA)
    return [f"{s}/{p}/{r}" for s, p in pairs for r in RULES]


def run_group(name: str, out: Path, max_train_traces: int = 12) -> dict:
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark
    from tokenbatch_env.evaluate.config import robust_fields
    from tokenbatch_env.tuning import TuneConfig, run_tuning
    suite, profile, rule = name.split("/")
    d = out / name.replace("/", "__")
    t0 = time.time()
    bc = BenchConfig(suite=suite, split="test", profile=profile, slo_rule=rule, loads=LOADS, policies=POLICIES,
                     shed=True, progress=False, **robust_fields(load_profile(profile)))
    defaults = run_benchmark(bc)
    defaults.write(d / "defaults")
    tuned = run_tuning(TuneConfig(suite=suite, profile=profile, slo_rule=rule, loads=LOADS, eval_loads=LOADS,
                                  comparators=False, max_train_traces=max_train_traces, out=str(d / "tuned"),
                                  progress=False))
    return summarize(name, defaults.data, tuned["data"]["test"], time.time() - t0)


def summarize(name: str, dflt: dict, tuned: dict, wall_s: float) -> dict:
    """The cell rows of one group: per load, the bound, the best achieved row and the oracle selector
    over both reports' deployable rows, and the rows the table shows."""
    import numpy as np
    cells = []
    for ld, lt in zip(dflt["loads"], tuned["loads"]):
        assert ld["rho"] == lt["rho"]
        rows = [("defaults", r) for r in ld["rows"]] + [("tuned", r) for r in lt["rows"]]
        dep = [(src, r) for src, r in rows if not r["reference"]]
        best = max(dep, key=lambda x: x[1]["goodput"]["mean"])
        units = np.array([r["goodput_per_unit"] for _, r in dep])
        base_d = [r for r in ld["rows"] if not r["label"].startswith("index") and not r["reference"]]
        base_t = [r for r in lt["rows"] if not r["label"].startswith("index") and "(profile flags)" not in r["label"]
                  and not r["reference"] and ("levers" in r or "(tuned vLLM flags)" in r["label"])]
        by = lambda rs, lab: next(r for r in rs if r["label"] == lab)  # noqa: E731
        bd = max(base_d, key=lambda r: r["goodput"]["mean"])
        bt = max(base_t, key=lambda r: r["goodput"]["mean"]) if base_t else None
        g = lambda r: r["goodput"]["mean"]  # noqa: E731
        cells.append({
            "cell": f"{name}/rho{ld['rho']:g}", "rho": ld["rho"],
            "upper_bound": ld["upper_bound"]["mean"],
            "best_achieved": {"label": f"{best[1]['label']} ({best[0]})", "goodput": g(best[1])},
            "oracle_selector": float(units.max(axis=0).mean()),
            "index_defaults": g(by(ld["rows"], ROBUST_ROW)),
            "index_defaults_vs": {k: v["diff"] for k, v in by(ld["rows"], ROBUST_ROW)["vs"].items()},
            "best_baseline_defaults": {"label": bd["label"], "goodput": g(bd)},
            "index_tuned": g(by(lt["rows"], "index+shed")),
            "best_baseline_tuned": None if bt is None else {"label": bt["label"], "goodput": g(bt)},
            "fcfs": g(by(ld["rows"], "fcfs")),
        })
    return {"group": name, "evidence_ids": {"defaults": dflt["evidence_id"], "tuned": tuned["evidence_id"]},
            "wall_s": wall_s, "cells": cells}


def table(results: list) -> str:
    out = ["| cell | upper bound | best achieved | oracle selector | index (robust defaults) | best baseline "
           "(defaults) | index+shed (tuned) | best baseline (tuned) | FCFS |",
           "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for c in res["cells"]:
            bt = c["best_baseline_tuned"]
            out.append(f"| {c['cell']} | {c['upper_bound']:.3f} | {c['best_achieved']['goodput']:.3f} "
                       f"{c['best_achieved']['label']} | {c['oracle_selector']:.3f} | {c['index_defaults']:.3f} | "
                       f"{c['best_baseline_defaults']['goodput']:.3f} {c['best_baseline_defaults']['label']} | "
                       f"{c['index_tuned']:.3f} | "
                       + (f"{bt['goodput']:.3f} {bt['label']}" if bt else "-") + f" | {c['fcfs']:.3f} |")
    out += ["", "| group | defaults evidence id | tuned (test report) evidence id |", "|---|---|---|"]
    out += [f"| {r['group']} | `{r['evidence_ids']['defaults']}` | `{r['evidence_ids']['tuned']}` |" for r in results]
    return "\n".join(out) + "\n"


def plot(results: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for r in results for c in r["cells"]]
    y = range(len(cells))
    fig, ax = plt.subplots(figsize=(9.5, 0.22 * len(cells) + 1.2))
    for key, lab, m in (("upper_bound", "upper bound", "|"), ("oracle_selector", "oracle selector", "x"),
                        ("index_defaults", "index (robust defaults)", "o"), ("index_tuned", "index+shed (tuned)", "s"),
                        ("fcfs", "FCFS", ".")):
        ax.scatter([c[key] for c in cells], y, marker=m, label=lab, s=18)
    ax.scatter([c["best_baseline_defaults"]["goodput"] for c in cells], y, marker="v", s=18,
               label="best baseline (defaults)")
    ax.scatter([c["best_baseline_tuned"]["goodput"] if c["best_baseline_tuned"] else float("nan") for c in cells], y,
               marker="^", s=18, label="best baseline (tuned)")
    ax.set_yticks(list(y), [c["cell"] for c in cells], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("goodput (test split)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default=None, help="comma-separated suite/profile/rule groups (default: all)")
    p.add_argument("--out", default="runs/leaderboard", help="output directory (default runs/leaderboard)")
    p.add_argument("--max-train-traces", type=int, default=12, help="train traces the tuning sees (default 12)")
    p.add_argument("--tables", default=None, metavar="JSON",
                   help="print the tables of an earlier run's leaderboard.json and draw its plot again")
    a = p.parse_args(argv)
    if a.tables:
        try:
            res = json.loads(Path(a.tables).read_text())["groups"]
            print(table(res))
            plot(res, Path(a.tables).with_name("leaderboard.png"))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"deployment_leaderboard.py: error: --tables {a.tables}: not a leaderboard.json this tool wrote "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        return 0
    if a.max_train_traces < 1:
        print(f"deployment_leaderboard.py: error: --max-train-traces: must be >= 1, got {a.max_train_traces}",
              file=sys.stderr)
        return 2
    names = groups() if a.groups is None else [g.strip() for g in a.groups.split(",") if g.strip()]
    if not names:
        print("deployment_leaderboard.py: error: --groups: need at least one group", file=sys.stderr)
        return 2
    bad = [g for g in names if g not in groups()]
    if bad:
        print(f"deployment_leaderboard.py: error: unknown group {bad[0]!r}; valid: {', '.join(groups())}",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, name in enumerate(names):
        print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
        results.append(run_group(name, out, a.max_train_traces))
        doc = {"groups": results, "loads": list(LOADS)}
        tmp = out / "leaderboard.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        tmp.replace(out / "leaderboard.json")
    (out / "leaderboard.md").write_text(table(results))
    plot(results, out / "leaderboard.png")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
