"""`tokenbatch evaluate-agent` (and agents/evaluate_agent.py, which calls ``main``): judge trained
agents on the TEST split with the evaluator that judges the baselines.

``EvaluateAgentConfig`` is the run (its fields are the command's options, ``config_cli``);
``evaluate_agents`` runs it. See ``EPILOG`` (the command's ``--help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from ..config_cli import option

DESCRIPTION = "Judge a trained agent on the TEST split with the evaluator that judges the baselines."

EPILOG = """\
    {cmd} --model runs/ppo/best
    {cmd} --model runs/ppo/best --params runs/tune/best_params.json --out runs/ppo/test
    {cmd} --model my_ppo.zip --env-config env.json [--vecnormalize my_vecnormalize.pkl]

The agent (mean action, saved observation normalisation) becomes a controller row of
``tokenbatch_env.evaluate.run_benchmark``: same traces, loads, predictor and random streams as
FCFS, SJF, EDF and the index (each with and without shedding); with ``--params`` (the tuning
script's best_params.json) the index, the shed margins, ``weights+shed`` (weights-static) and
``index-scheduled`` are the tuned ones. Writes the evaluator's report (report.json / report.md /
goodput_vs_load.png / ttft_cdf.png, evidence id inside) and agent_vs.md / agent_vs.json: the
agent's paired goodput differences (95% bootstrap CI, win rate) against the tuned index+shed,
index-scheduled, weights+shed, EDF+shed and (a file tuned with the tpot-guard rule, a TokenBatch-v1
agent's base) index+shed+tpot-guard at every load. Every row runs at the profile's flags, as the
agents do: tuned vLLM flags in the file are not applied (a line on stderr says so).

What --model needs: a training run's directory (tokenbatch train / train_ppo.py writes
<out>/best and <out>/final: model.zip, config.json with the env's settings and the files' digests,
vecnormalize.pkl), or a model.zip inside one. A model.zip saved otherwise (any SB3 PPO trained on
TokenBatch-v0 through tokenbatch_env.sb3) has no config.json: give the env it was trained on with
--env-config FILE.json (a JSON object of TokenBatchConfig fields, e.g. {{"window": 128, "k": 8,
"action_mode": "index"}}; unset fields are TokenBatchConfig's defaults) and, if it was trained under
VecNormalize, its statistics (VecNormalize.save) with --vecnormalize FILE.

With ``--pool`` and several ``--model`` (e.g. one recipe trained with different seeds), the rows
also hold their mean: per trace, the agents' mean goodput, paired against each comparator with the
report's bootstrap (a CI over traces for these agents as a group; it does not sample new seeds).

    {cmd} --pool --model runs/s0/best --model runs/s1/best --model runs/s2/best

A router agent (tokenbatch train-router; told by its config.json) is judged in cluster mode: every
router of --routers (default all) behind the replica row it was trained with (its policy, shed
margin, index parameters and vLLM flags, from its config.json; a P/D agent's split too), the agent
as the row '<algo>:<dir> x <row>' routing every arrival. --params (the cluster tuning file the row
came from) adds each router's own tuned parameters (prefix-affinity's alpha, beta) and the other
baselines' margins; the replica row stays the agents'. router_vs.md / router_vs.json hold the
agent's paired differences against the same row behind each router (with --pool, also the agents'
mean per unit).

    {cmd} --pool --model runs/router-s0/best --model runs/router-s1/best --params runs/tune/best_params.json
"""


def _parse_loads(text, flag: str) -> tuple:
    from ..util import parse_loads
    return parse_loads(text, flag[2:])


@dataclasses.dataclass(frozen=True)
class EvaluateAgentConfig:
    """One evaluation of trained agents (each field is a ``tokenbatch evaluate-agent`` /
    agents/evaluate_agent.py option, ``config_cli``)."""

    model: tuple[str, ...] = option(
        (), "a training run's agent directory (model.zip + config.json [+ vecnormalize.pkl], e.g. runs/ppo/best) "
        "or a model.zip in one; a model.zip without config.json needs --env-config; repeatable",
        append=True, required=True)
    env_config: Optional[str] = option(
        None, "for a model.zip without config.json: a JSON object of the TokenBatchConfig fields it was trained "
        "with (or a train config.json); replaces config.json for every --model", metavar="FILE.json")
    vecnormalize: Optional[str] = option(
        None, "with --env-config: the model's VecNormalize statistics (VecNormalize.save); default none "
        "(the model sees raw observations)", metavar="FILE")
    params: Optional[str] = option(None, "tuned parameters JSON (tokenbatch tune / tuning/optuna_search.py "
                                   "best_params.json)")
    suite: Optional[str] = option(None, "suite (default: the agent's training suite)")
    split: str = option("test", "split (default test: held out)")
    loads: tuple[float, ...] = option((1.0, 1.2, 1.5), "loads rho, comma-separated (default 1.0,1.2,1.5)",
                                      parse=_parse_loads)
    max_traces: Optional[int] = option(None, "first N traces of the split, or 'all' (default all)", min=1,
                                       none="all")
    bootstrap_b: int = option(10_000, "bootstrap resamples (default 10000)", min=100)
    seed: int = option(0, "bootstrap seed (default 0)", min=0)
    out: Optional[str] = option(None, "output directory (default <model dir>/test)")
    pool: bool = option(False, "with several --model: also their mean goodput per trace as one agent, paired "
                        "the same way", flags=("--pool",), sets=True)
    routers: Optional[tuple[str, ...]] = option(
        None, "router agents (tokenbatch train-router): the routers they are judged against, comma-separated "
        "(default: every router)", metavar="A,B,...")
    progress: bool = option(True, "no progress bar", flags=("--no-progress",), sets=False)

    def __post_init__(self):
        from ..errors import ConfigError
        object.__setattr__(self, "model", tuple(str(m) for m in self.model))
        if not self.model:
            raise ConfigError("--model: give at least one agent")
        if self.pool and len(self.model) < 2:
            raise ConfigError("--pool pools several --model agents: give at least two")
        if self.vecnormalize is not None and self.env_config is None:
            raise ConfigError("--vecnormalize goes with --env-config (an agent directory's statistics are its "
                              "vecnormalize.pkl)")


# ------------------------------------------------------------------------------ CLI
def configure(p: argparse.ArgumentParser, cmd: str = "tokenbatch evaluate-agent") -> None:
    from ..config_cli import configure_command
    configure_command(p, EvaluateAgentConfig, DESCRIPTION, EPILOG.format(cmd=cmd))


def build_parser(prog: str = "evaluate_agent.py", cmd: str = "python agents/evaluate_agent.py"):
    """The standalone parser (agents/evaluate_agent.py)."""
    p = argparse.ArgumentParser(prog=prog)
    configure(p, cmd)
    return p


def config_from_args(args) -> EvaluateAgentConfig:
    from ..config_cli import config_from_args as from_args
    return from_args(EvaluateAgentConfig, args)


def run(args, prog: str = "tokenbatch") -> int:
    cfg = config_from_args(args)
    from .load import is_router_agent
    routers = [is_router_agent(m) for m in cfg.model]
    if any(routers):
        if not all(routers):
            from ..errors import ConfigError
            raise ConfigError("--model: router agents (tokenbatch train-router) and scheduling agents are judged "
                              "apart: give one kind")
    elif cfg.routers is not None:
        from ..errors import ConfigError
        raise ConfigError("--routers: for router agents (tokenbatch train-router); --model is a scheduling agent")
    res = evaluate_routers(cfg, prog) if any(routers) else evaluate_agents(cfg, prog)
    vs = "router_vs" if any(routers) else "agent_vs"
    print(res["report"].summary_text())
    print(res["markdown"])
    print(f"wrote {res['out']}/ (report.json, report.md, run_meta.json, goodput_vs_load.png, ttft_cdf.png, {vs}.md, "
          f"{vs}.json)")
    return 0


def main(argv=None, prog: str = "evaluate_agent.py", cmd: str = "python agents/evaluate_agent.py") -> int:
    """The standalone entry (agents/evaluate_agent.py): errors are one line prefixed with ``prog``, exit 2."""
    from ..config_cli import standalone_main
    return standalone_main(build_parser(prog, cmd), run, argv, prog, prog)


# ------------------------------------------------------------------------------ evaluation
def evaluate_agents(cfg: EvaluateAgentConfig, prog: str = "tokenbatch") -> dict:
    """Run the evaluator with the agents as controller rows and write its report plus agent_vs.json /
    agent_vs.md into the output directory; warnings (an agent judged on its own training split, or
    with another suite or profile) go to stderr prefixed ``prog``. Returns {"report", "rows",
    "markdown", "out"}."""
    from .._io import atomic_path
    from ..evaluate import BenchConfig, run_benchmark
    from ..evaluate.config import guard_fields
    from ..params import load_levers, load_params_file, load_schedule, load_weights
    from .load import agent_labels, agent_spec, agent_warnings
    from ..report import check_report_out

    labels = agent_labels(cfg.model) if len(cfg.model) > 1 else [None]
    specs = [agent_spec(m, label=lab, env_config=cfg.env_config, vecnormalize=cfg.vecnormalize)
             for m, lab in zip(cfg.model, labels)]
    env0 = json.loads(dict(specs[0].evidence)["env"])
    kw = {}
    if cfg.params:
        params, margins = load_params_file(cfg.params)
        kw.update(index_params=params, shed_margins=margins, params_source=cfg.params,
                  weights=load_weights(cfg.params), schedule=load_schedule(cfg.params))
        from ..engine.levers import GUARD_LEVERS, LEVERS
        levers = load_levers(cfg.params)
        flagged = sorted(k for k, v in levers if any(f in LEVERS for f, _ in v))
        if flagged:
            print(f"{prog}: note: every row runs at the profile's flags, as the agents do; the tuned vLLM flags "
                  f"of {', '.join(flagged)} in {cfg.params} are not applied", file=sys.stderr)
        # tuned with the budget rule: its +tpot-guard rows, each with its own u and B_min (only those: every
        # row here runs at the profile's flags, as the agents do)
        guard = guard_fields(cfg.params)
        if guard:
            lv = tuple((k, tuple((f, x) for f, x in v if f in GUARD_LEVERS)) for k, v in levers)
            kw.update(guard, levers=tuple((k, v) for k, v in lv if v))
    pols = ("fcfs", "sjf", "edf", "index") + (("weights",) if kw.get("weights") is not None else ())
    m0 = Path(cfg.model[0])
    out = Path(cfg.out) if cfg.out else (m0 if m0.is_dir() else m0.parent) / "test"
    check_report_out(out, "--out")   # before the runs, not after them (as tokenbatch bench)
    bench = BenchConfig(suite=cfg.suite or env0["suite"], split=cfg.split, profile=env0["profile"], policies=pols,
                        shed=True, loads=cfg.loads, max_traces=cfg.max_traces, bootstrap_b=cfg.bootstrap_b,
                        bootstrap_seed=cfg.seed, upper_bound=False, progress=cfg.progress,
                        controllers=tuple(specs), **kw)
    for spec in specs:
        for w in agent_warnings(json.loads(dict(spec.evidence)["env"]), spec.label, bench.suite, bench.split,
                                bench.profile):
            print(f"{prog}: warning: {w}", file=sys.stderr)
    report = run_benchmark(bench)
    report.write(out)
    rows = agent_rows(report.data, [s.label for s in specs])
    if cfg.pool and len(specs) > 1:
        rows += pooled_rows(report.data, [s.label for s in specs])
    with atomic_path(out / "agent_vs.json") as tmp:
        Path(tmp).write_text(json.dumps({"evidence_id": report.evidence_id, "rows": rows}, indent=1) + "\n")
    md = agent_markdown(rows, report.evidence_id)
    with atomic_path(out / "agent_vs.md") as tmp:
        Path(tmp).write_text(md)
    return {"report": report, "rows": rows, "markdown": md, "out": out}


def agent_rows(data: dict, labels) -> list:
    """Per load and agent: paired differences vs the comparators present in the report."""
    from ..evaluate import CONTROL_COMPARATORS
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
    from ..evaluate import CONTROL_COMPARATORS
    from ..metrics import paired_difference, win_rate
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
    lines = ["# Agent vs comparators (paired, 95% bootstrap CI)\n", f"evidence id `{eid}`\n",
             "| rho | agent | vs | agent goodput | other | diff [95% CI] | win rate | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["ci"]
        verdict = "better" if lo > 0 else ("worse" if hi < 0 else "not resolved")
        lines.append(f"| {r['rho']:g} | {r['agent']} | {r['vs']} | {r['agent_goodput']:.4f} | "
                     f"{r['other_goodput']:.4f} | {r['diff']:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                     f"{r['win_rate']:.2f} | {verdict} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ routers
def evaluate_routers(cfg: EvaluateAgentConfig, prog: str = "tokenbatch") -> dict:
    """Judge router agents (``tokenbatch train-router``) with the benchmark in cluster mode: every
    router of ``cfg.routers`` (default all) behind the replica policy the agents were trained with
    (their env's policy, shed margin, index parameters, levers and T_ref, on every row), each router
    with its tuned parameters when ``cfg.params`` (a cluster tuning file) has them for that row; the
    agents as rows of their own (``control.run_routed``). Writes the report and router_vs.json / .md:
    each agent (and with ``pool`` their mean per unit) against the same replica row behind every
    router, paired. Returns {"report", "rows", "markdown", "out"}."""
    from .._io import atomic_path
    from ..engine.cluster import ROUTER_NAMES
    from ..errors import ConfigError
    from ..evaluate import BenchConfig, run_benchmark
    from ..evaluate.rows import pd_label, router_agent_plain
    from ..params import RoutedRow, load_params_file, load_routed
    from ..report import check_report_out
    from .load import agent_labels, router_agent

    agents = [router_agent(m) for m in cfg.model]
    labels = agent_labels(cfg.model, [f"{dict(a.evidence)['algo']}:" for a in agents])
    agents = [dataclasses.replace(a, label=lab) for a, lab in zip(agents, labels)]
    env = agents[0].env
    same = ("replicas", "profile", "policy", "shed_margin", "index", "levers", "t_ref_ms", "pd", "decode_router",
            "kv_link", "first_token_at")
    for a in agents[1:]:
        diff = [f for f in same if getattr(a.env, f) != getattr(env, f)]
        if diff:
            raise ConfigError(f"--model: {a.label} was trained with another {', '.join(diff)} than {agents[0].label}; "
                              "router agents judged together share their replicas and replica policy")
    routers = tuple(cfg.routers) if cfg.routers is not None else \
        (("round-robin",) + tuple(r for r in ROUTER_NAMES if r != "round-robin"))
    from ..config_cli import check_names
    check_names(routers, ROUTER_NAMES, "--routers", "router")
    plain, index = router_agent_plain(env, split=False), env.index_params
    routed, kw = (), {}
    if cfg.params:   # each router's own tuned parameters for this row; the replica values are the agents'
        found = load_routed(cfg.params)
        if found is None:
            raise ConfigError(f"--params {cfg.params}: not a cluster tuning file (no 'cluster' rows; tokenbatch tune "
                              "--replicas R writes one)")
        if found["replicas"] != env.replicas:
            raise ConfigError(f"--params {cfg.params}: tuned on clusters of {found['replicas']} replicas, the agents "
                              f"were trained on {env.replicas}")
        tuned = dict(found["routed"])
        routed = tuple((f"{r} x {plain}", RoutedRow(index, env.shed_margin, env.levers,
                                                    tuned[f"{r} x {plain}"].router_params))
                       for r in routers if f"{r} x {plain}" in tuned and tuned[f"{r} x {plain}"].router_params)
        kw.update(shed_margins=load_params_file(cfg.params)[1], params_source=cfg.params)
    m0 = Path(cfg.model[0])
    out = Path(cfg.out) if cfg.out else (m0 if m0.is_dir() else m0.parent) / "test"
    check_report_out(out, "--out")
    if env.shed_margin is not None:   # (the agents' replica row, on every router's row)
        kw["shed_margins"] = tuple((p, m) for p, m in kw.get("shed_margins", ()) if p != env.policy) + (
            (env.policy, float(env.shed_margin)),)
    if env.levers:
        kw["levers"] = ((plain, env.levers),)
    if index is not None:
        kw["index_params"] = index
    if env.pd:   # (the agents' split: every row again on it, the router in front of the prefill replicas)
        kw.update(pd=env.pd, decode_router=env.decode_router, kv_link=env.kv_link)
    bench = BenchConfig(suite=cfg.suite or env.suite, split=cfg.split, profile=env.profile, policies=(env.policy,),
                        shed=env.shed_margin is not None, loads=cfg.loads, max_traces=cfg.max_traces,
                        bootstrap_b=cfg.bootstrap_b, bootstrap_seed=cfg.seed, upper_bound=False,
                        progress=cfg.progress, replicas=env.replicas, routers=routers, routed=routed,
                        router_agents=tuple(agents), t_ref_ms=env.t_ref_ms, **kw)
    if env.suite == bench.suite and env.split == bench.split:
        print(f"{prog}: warning: the agents were trained on {env.suite}/{env.split}, the split they are judged on: "
              "not held out", file=sys.stderr)
    report = run_benchmark(bench)
    report.write(out)
    agent_rows_ = [f"{a.label} x {router_agent_plain(env)}" for a in agents]
    comparators = [f"{r} x {plain}" if len(routers) > 1 else plain for r in routers]
    if env.pd:
        comparators = [pd_label(env.pd, c, env.first_token_at) for c in comparators]
    rows = versus_rows(report.data, agent_rows_, comparators)
    if cfg.pool and len(agents) > 1:
        rows += versus_rows(report.data, agent_rows_, comparators, pooled=True)
    with atomic_path(out / "router_vs.json") as tmp:
        Path(tmp).write_text(json.dumps({"evidence_id": report.evidence_id, "rows": rows}, indent=1) + "\n")
    md = agent_markdown(rows, report.evidence_id).replace("# Agent vs comparators", "# Router agents vs routers")
    with atomic_path(out / "router_vs.md") as tmp:
        Path(tmp).write_text(md)
    return {"report": report, "rows": rows, "markdown": md, "out": out}


def versus_rows(data: dict, labels, comparators, pooled: bool = False) -> list:
    """Per load: each agent row of ``labels`` (with ``pooled``, their mean goodput per unit as one
    agent, ``POOLED``) against each row of ``comparators``, paired with the report's bootstrap."""
    from ..metrics import paired_difference, win_rate
    bs = data["evidence_inputs"]["bootstrap"]
    out = []
    for load in data["loads"]:
        rows = {r["label"]: r for r in load["rows"]}
        mine = [(f"{POOLED} ({len(labels)})", np.mean([rows[lab]["goodput_per_unit"] for lab in labels], axis=0))] \
            if pooled else [(lab, np.asarray(rows[lab]["goodput_per_unit"], np.float64)) for lab in labels]
        for name, g in mine:
            for b in comparators:
                other = np.asarray(rows[b]["goodput_per_unit"], np.float64)
                m, lo, hi = paired_difference(g, other, B=bs["B"], seed=bs["seed"], block=bs["block"])
                out.append({"rho": load["rho"], "agent": name, "vs": b, "agent_goodput": float(g.mean()),
                            "other_goodput": float(other.mean()), "diff": m, "ci": [lo, hi],
                            "win_rate": win_rate(g, other),
                            "verdict": "better" if lo > 0 else ("worse" if hi < 0 else "not resolved")})
    return out
