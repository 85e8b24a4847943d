#!/usr/bin/env python
"""Judge a trained agent on the TEST split with the evaluator that judges the baselines.

    python agents/evaluate_agent.py --model runs/ppo/best
    python agents/evaluate_agent.py --model runs/ppo/best --params runs/tune/best_params.json --out runs/ppo/test

The agent (mean action, saved observation normalisation) becomes a controller row of
``tokenbatch_env.evaluate.run_benchmark``: same traces, loads, predictor and random streams as
FCFS, SJF, EDF and the index (each with and without shedding); with ``--params`` (the tuning
script's best_params.json) the index, the shed margins, ``weights+shed`` (weights-static) and
``index-scheduled`` are the tuned ones. Writes the evaluator's report (report.json / report.md /
goodput_vs_load.png / ttft_cdf.png, evidence id inside) and agent_vs.md / agent_vs.json: the
agent's paired goodput differences (95% bootstrap CI, win rate) against the tuned index+shed,
index-scheduled, weights+shed and EDF+shed at every load.

With ``--pool`` and several ``--model`` (e.g. one recipe trained with different seeds), the rows
also hold their mean: per trace, the agents' mean goodput, paired against each comparator with the
report's bootstrap (a CI over traces for these agents as a group; it does not sample new seeds).

    python agents/evaluate_agent.py --pool --model runs/s0/best --model runs/s1/best --model runs/s2/best
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evaluate_agent.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--model", required=True, action="append",
                   help="agent directory (model.zip + config.json [+ vecnormalize.pkl]) or model.zip; repeatable")
    p.add_argument("--params", default=None, help="tuned parameters JSON (tuning/optuna_search.py best_params.json)")
    p.add_argument("--suite", default=None, help="suite (default: the agent's training suite)")
    p.add_argument("--split", default="test", help="split (default test: held out)")
    p.add_argument("--loads", default="1.0,1.2,1.5", help="loads rho, comma-separated (default 1.0,1.2,1.5)")
    p.add_argument("--max-traces", default=None, help="first N traces of the split (default all)")
    p.add_argument("--bootstrap-b", default="10000", help="bootstrap resamples (default 10000)")
    p.add_argument("--seed", default="0", help="bootstrap seed (default 0)")
    p.add_argument("--out", default=None, help="output directory (default <model dir>/test)")
    p.add_argument("--pool", action="store_true",
                   help="with several --model: also their mean goodput per trace as one agent, paired the same way")
    p.add_argument("--no-progress", action="store_true")
    return p


def agent_rows(data: dict, labels) -> list:
    """Per load and agent: paired differences vs the comparators present in the report."""
    from tokenbatch_env.evaluate import CONTROL_COMPARATORS
    out = []
    for load in data["loads"]:
        rows = {r["label"]: r for r in load["rows"]}
        for lab in labels:
            r = rows[lab]
            for b in ("edf+shed",) + CONTROL_COMPARATORS:
                if b in r["vs"]:
                    v = r["vs"][b]
                    out.append({"rho": load["rho"], "agent": lab, "vs": b, "agent_goodput": r["goodput"]["mean"],
                                "other_goodput": rows[b]["goodput"]["mean"], "diff": v["diff"],
                                "ci": list(v["ci95"]), "win_rate": v["win_rate"]})
    return out


POOLED = "mean of agents"


def pooled_rows(data: dict, labels) -> list:
    """Per load: the agents' mean goodput per unit as one agent (``POOLED``), paired against the
    comparators of ``agent_rows`` with the report's bootstrap (B, seed, block)."""
    from tokenbatch_env.evaluate import CONTROL_COMPARATORS
    from tokenbatch_env.metrics import paired_difference, win_rate
    bs = data["evidence_inputs"]["bootstrap"]
    out = []
    for load in data["loads"]:
        rows = {r["label"]: r for r in load["rows"]}
        mean = np.mean([rows[lab]["goodput_per_unit"] for lab in labels], axis=0)
        for b in ("edf+shed",) + CONTROL_COMPARATORS:
            if b in rows[labels[0]]["vs"]:
                other = np.asarray(rows[b]["goodput_per_unit"], np.float64)
                m, lo, hi = paired_difference(mean, other, B=bs["B"], seed=bs["seed"], block=bs["block"])
                out.append({"rho": load["rho"], "agent": f"{POOLED} ({len(labels)})", "vs": b,
                            "agent_goodput": float(mean.mean()), "other_goodput": rows[b]["goodput"]["mean"],
                            "diff": m, "ci": [lo, hi], "win_rate": win_rate(mean, other)})
    return out


def agent_markdown(rows: list, eid: str) -> str:
    lines = [f"# Agent vs comparators (paired, 95% bootstrap CI)\n", f"evidence id `{eid}`\n",
             "| rho | agent | vs | agent goodput | other | diff [95% CI] | win rate | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci"]
        verdict = "better" if lo > 0 else ("worse" if hi < 0 else "not resolved")
        lines.append(f"| {r['rho']:g} | {r['agent']} | {r['vs']} | {r['agent_goodput']:.4f} | "
                     f"{r['other_goodput']:.4f} | {r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                     f"{r['win_rate']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from tokenbatch_env._io import atomic_path
    from tokenbatch_env.control import agent_labels, agent_spec, agent_warnings
    from tokenbatch_env.errors import TokenBatchError
    from tokenbatch_env.evaluate import BenchConfig, load_params_file, load_schedule, load_weights, run_benchmark
    from tokenbatch_env.report import check_report_out

    args = build_parser().parse_args(argv)
    try:
        if args.pool and len(args.model) < 2:
            raise TokenBatchError("--pool pools several --model agents: give at least two")
        labels = agent_labels(args.model) if len(args.model) > 1 else [None]
        specs = [agent_spec(m, label=lab) for m, lab in zip(args.model, labels)]
        train = json.loads((Path(args.model[0]) / "config.json").read_text()) if Path(args.model[0]).is_dir() \
            else json.loads((Path(args.model[0]).parent / "config.json").read_text())
        kw = {}
        if args.params:
            params, margins = load_params_file(args.params)
            kw.update(index_params=params, shed_margins=margins, params_source=args.params,
                      weights=load_weights(args.params), schedule=load_schedule(args.params))
        pols = ("fcfs", "sjf", "edf", "index") + (("weights",) if kw.get("weights") is not None else ())
        try:
            loads = tuple(float(x) for x in args.loads.split(","))
            max_traces = None if args.max_traces in (None, "all") else int(args.max_traces)
            b, seed = int(args.bootstrap_b), int(args.seed)
        except ValueError as e:
            raise TokenBatchError(f"bad numeric option: {e}") from None
        m0 = Path(args.model[0])
        out = Path(args.out) if args.out else (m0 if m0.is_dir() else m0.parent) / "test"
        check_report_out(out, "--out")   # before the runs, not after them (as tokenbatch bench)
        cfg = BenchConfig(suite=args.suite or train["env"]["suite"], split=args.split,
                          profile=train["env"]["profile"], policies=pols, shed=True, loads=loads,
                          max_traces=max_traces, bootstrap_b=b, bootstrap_seed=seed, upper_bound=False,
                          progress=not args.no_progress, controllers=tuple(specs), **kw)
        for spec in specs:
            for w in agent_warnings(json.loads(dict(spec.evidence)["env"]), spec.label, cfg.suite, cfg.split,
                                    cfg.profile):
                print(f"evaluate_agent.py: warning: {w}", file=sys.stderr)
        report = run_benchmark(cfg)
        report.write(out)
        rows = agent_rows(report.data, [s.label for s in specs])
        if args.pool and len(specs) > 1:
            rows += pooled_rows(report.data, [s.label for s in specs])
        with atomic_path(out / "agent_vs.json") as tmp:
            Path(tmp).write_text(json.dumps({"evidence_id": report.evidence_id, "rows": rows}, indent=1) + "\n")
        md = agent_markdown(rows, report.evidence_id)
        with atomic_path(out / "agent_vs.md") as tmp:
            Path(tmp).write_text(md)
    except TokenBatchError as e:
        print(f"evaluate_agent.py: error: {e}", file=sys.stderr)
        return 2
    print(report.summary_text())
    print(md)
    print(f"wrote {out}/ (report.json, report.md, goodput_vs_load.png, ttft_cdf.png, agent_vs.md, agent_vs.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
