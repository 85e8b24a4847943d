"""Robust defaults: the index's parameters used when none are given, tuned once over a mixture of
deployments (docs/design.md section 10, "Robust defaults").

    python tuning/robust_defaults.py                 # about an hour on 2 cores; writes runs/robust/
    python tuning/robust_defaults.py --install       # ... and the shipped file (ROBUST_FILE)

The mixture: every real-like suite x {stress-512, llama2-7b-a100, llama3-8b-h100}, plus
``mooncake-like-long`` on ``llama31-8b-h100``, x SLO rules {default-3class, mlperf-llama3_1-8b} x
loads {1.2, 2.0}: one *cell* each. Everything is tuned and fitted on train splits only:

1. per cell, each baseline's +shed row (its margin and vLLM's three flags, ``baseline_trials``
   trials, as ``tokenbatch tune`` tunes it); the best is the cell's *best tuned baseline*;
2. one study over the index's parameters, its shed margin, the tpot-guard rule's u and B_min and the
   three flags as fractions of the profile's (so one setting fits every profile), objective

       mean_c d_c - penalty x mean_c max(0, -d_c),    d_c = goodput_c - best tuned baseline_c;

3. the best trial and every cell's best baseline replayed on the validation splits: min and mean of
   d_c there are reported, never used to choose.

T_ref is the evaluated workload's (``t_ref_mode: trace``): the median T1 of its train part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .config_cli import config_to_argv, option
from .engine.levers import GUARD_LEVERS, GUARD_SUFFIX
from .errors import ConfigError
from .params import ROBUST_FILE, ROBUST_FORMAT, levers_for, load_robust_defaults
from .util import canonical_json

#: the row the defaults are tuned as: the index with shedding and the tpot-guard rule
ROBUST_ROW = "index+shed" + GUARD_SUFFIX
#: the flags as fractions of the profile's: (name, lower end, upper end); a threshold fraction >= 1
#: is off (the profile's setting), as a tuned threshold >= the budget is
FRACTIONS = (("budget_frac", 1 / 16, 1.0), ("seqs_frac", 1 / 16, 1.0), ("threshold_frac", 1 / 16, 2.0))
#: the defaults themselves, in a robust-defaults file (the rest is where they come from)
DEFAULT_KEYS = ("index", "shed_margin", "tpot_guard", "flag_fractions")


@dataclasses.dataclass(frozen=True)
class RobustConfig:
    """The robust-defaults run. Each field's ``help`` is its tuning/robust_defaults.py option's."""

    suites: tuple[str, ...] = option(("azure-code-like", "azure-conv-like", "mooncake-like"),
                                     "real-like suites, crossed with --profiles")
    profiles: tuple[str, ...] = option(("stress-512", "llama2-7b-a100", "llama3-8b-h100"),
                                       "profiles, crossed with --suites")
    extra: tuple[str, ...] = option(("mooncake-like-long:llama31-8b-h100",), "further suite:profile pairs",
                                    allow_empty=True)
    slo_rules: tuple[str, ...] = option(("default-3class", "mlperf-llama3_1-8b"), "SLO rules (presets or files)")
    loads: tuple[float, ...] = option((1.2, 2.0), "loads rho")
    trials: int = option(320, "trials of the defaults' study", min=1)
    baseline_trials: int = option(24, "trials of each baseline's study per cell", min=1)
    baselines: tuple[str, ...] = option(("sjf", "edf", "llf"), "baselines tuned per cell (their +shed rows, "
                                        "with vLLM's flags)")
    k: int = option(8, "trials evaluated per engine run", min=1)
    max_train_traces: int = option(12, "first N train traces of each suite", min=1)
    max_validation_traces: int = option(12, "first N validation traces of each suite (12: all)", min=1)
    penalty: float = option(4.0, "weight of the mean shortfall in the objective", what="a number >= 0")
    seed: int = option(0, "sampler seed", min=0)
    out: str = option("runs/robust", "output directory")
    install: bool = option(False, "also write the shipped file tokenbatch_env/data/params/robust-defaults.json",
                           flags=("--install",), sets=True)
    progress: bool = option(True, "no progress bar", flags=("--quiet",), sets=False)
    judge: Optional[str] = option(
        None, "instead of tuning, judge a robust-defaults file (or 'shipped') on the held-out cells: real traces' "
        "test parts, SLO rules and loads outside the mixture (needs --traces-dir); writes <out>/goal.json, goal.md",
        metavar="FILE")
    traces_dir: str = option(str(Path(__file__).resolve().parents[2] / "shared" / "traces"),
                             "with --judge: the real traces' directory (default ../shared/traces)")

    def __post_init__(self):
        if not self.suites and not self.extra:
            raise ConfigError("suites: need at least one suite")
        for s in self.extra:
            if ":" not in s:
                raise ConfigError(f"extra: expected suite:profile, got {s!r}")
        if not self.loads or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
                                 or x <= 0 for x in self.loads):
            raise ConfigError(f"loads: need rho values > 0, got {self.loads!r}")
        if not (isinstance(self.penalty, (int, float)) and math.isfinite(self.penalty) and self.penalty >= 0):
            raise ConfigError(f"penalty: a number >= 0, got {self.penalty!r}")
        from .policies import BASELINES
        from .traces.slo_rules import load_slo_rule
        for r in self.slo_rules:
            load_slo_rule(r)
        for b in self.baselines:
            if b not in BASELINES or b in ("index", "weights", "fcfs", "priority"):
                raise ConfigError(f"baselines: {b!r} is not a baseline with a tuned margin (sjf, edf, llf, ...)")

    def groups(self) -> list:
        """(suite, profile, rule): the cells' groups (one engine workload each; the loads are its units)."""
        pairs = [(s, p) for s in self.suites for p in self.profiles]
        pairs += [tuple(x.split(":", 1)) for x in self.extra]
        return [(s, p, r) for s, p in pairs for r in self.slo_rules]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("out", "install", "progress", "judge", "traces_dir"):
            d.pop(k)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def cell_name(group: tuple, rho: float) -> str:
    s, p, r = group
    return f"{s}/{p}/{r}/rho{rho:g}"


# ------------------------------------------------------------------------------------ the defaults
def suggest_robust(trial) -> dict:
    """A trial of the defaults' study: the index's space (``tuning.suggest_index``), u and B_min in
    their ranges, and the flags' fractions (log-uniform)."""
    from .tuning import suggest_index
    c = suggest_index(trial)
    c["guard"] = {k: trial.suggest_float(k, lo, hi) for k, (lo, hi) in GUARD_LEVERS.items()}
    c["fractions"] = {k: trial.suggest_float(k, lo, hi, log=True) for k, lo, hi in FRACTIONS}
    return c


def robust_warm_starts() -> list:
    """The study's first trials: the index's SJF member at the profile's flags without the rule
    (B_min 1), the same with a quarter of the budget, with the rule at its defaults, the formula's
    defaults (``IndexParams()``) with the rule, then the rule's neighbourhood and the EDF member."""
    from .tuning import INDEX_ROW, warm_starts
    sjf, _, edf, defaults = warm_starts(INDEX_ROW)
    flags = {"budget_frac": 1.0, "seqs_frac": 1.0, "threshold_frac": 2.0}
    off = {"budget_u": 0.0, "budget_bmin": 1.0}
    on = {"budget_u": 0.0, "budget_bmin": 0.0}
    return [{**sjf, **off, **flags}, {**sjf, **off, **flags, "budget_frac": 0.25}, {**sjf, **on, **flags},
            {**defaults, **on, **flags},
            # the rule's neighbourhood: earlier / later budget cuts, a smaller budget or a threshold with it
            {**sjf, **on, **flags, "budget_u": -0.25}, {**sjf, **on, **flags, "budget_u": 0.5},
            {**sjf, **on, **flags, "budget_frac": 0.5}, {**sjf, **on, **flags, "threshold_frac": 0.25},
            {**edf, **on, **flags}]


class _Group:
    """One (suite, profile, rule): its train (or validation) units at every load, as the tuning
    objective builds them (``tuning.TrainObjective``)."""

    def __init__(self, cfg: RobustConfig, group: tuple, split: str):
        from .tuning import TuneConfig, TrainObjective
        s, p, r = group
        n = cfg.max_train_traces if split == "train" else cfg.max_validation_traces
        self.tune = TuneConfig(suite=s, profile=p, slo_rule=r, loads=cfg.loads, max_train_traces=n,
                               baselines=cfg.baselines, comparators=False, progress=False, seed=cfg.seed,
                               trials=cfg.baseline_trials, k=cfg.k)
        self.obj = TrainObjective(self.tune, split=split)
        self.group = group
        self.per_load = len(self.obj.units) // len(cfg.loads)

    def cell_means(self, row: str, configs: list) -> np.ndarray:
        """Goodput [k, loads]: each config's mean over each load's units."""
        g = self.obj.goodput_per_unit(row, configs)
        return g.reshape(len(configs), -1, self.per_load).mean(axis=2)

    def load_means(self, row: str, configs: list, li: int) -> np.ndarray:
        """Goodput [k]: each config's mean over load ``li``'s units alone."""
        idx = np.arange(li * self.per_load, (li + 1) * self.per_load)
        return self.obj.goodput_per_unit(row, configs, idx).mean(axis=1)

    def robust_configs(self, trials: list) -> list:
        return [robust_config(self.obj.profile, t) for t in trials]


def robust_config(profile, trial: dict) -> dict:
    """The tuning objective's config (``TrainObjective``, row ``ROBUST_ROW``) of a trial of the
    defaults' study (``suggest_robust``) on ``profile``: the flags' fractions made absolute."""
    return {"index": trial["index"], "shed_margin": trial["shed_margin"],
            "engine": levers_for(profile, trial["fractions"], trial["guard"])}


def objective_value(d: np.ndarray, penalty: float) -> float:
    """mean_c d_c - penalty x mean_c max(0, -d_c)."""
    d = np.asarray(d, float)
    return float(d.mean() - penalty * np.maximum(0.0, -d).mean())


# ------------------------------------------------------------------------------------ baselines
def tune_baselines(cfg: RobustConfig, groups: dict, bar=None) -> dict:
    """Per cell: each baseline's +shed row tuned on its train units (margin and vLLM's flags, the
    row's own warm starts, ``baseline_trials`` trials, seeded TPE), the best kept. -> {cell: {"row",
    "config", "train"}}."""
    import optuna
    from .tuning import make_sampler, suggest_config, warm_starts
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    best = {}
    for g, grp in groups.items():
        for li, rho in enumerate(cfg.loads):
            cell = cell_name(g, rho)
            tc = dataclasses.replace(grp.tune, loads=(rho,))
            cands = []
            for i, b in enumerate(cfg.baselines):
                row = f"{b}+shed"
                space = tc.lever_space(row)
                st = optuna.create_study(direction="maximize", sampler=make_sampler(tc, i))
                for ws in warm_starts(row, space)[:cfg.baseline_trials]:
                    st.enqueue_trial(ws)
                left = cfg.baseline_trials
                while left > 0:
                    ts = [st.ask() for _ in range(min(cfg.k, left))]
                    cs = [suggest_config(row, t, space) for t in ts]
                    vals = grp.load_means(row, cs, li)
                    for t, c, v in zip(ts, cs, vals):
                        t.set_user_attr("config", c)
                        st.tell(t, float(v))
                    left -= len(ts)
                    if bar is not None:
                        bar.update(len(ts))
                bt = st.best_trial
                cands.append((bt.value, row, bt.user_attrs["config"]))
            v, row, c = max(cands, key=lambda x: (x[0], x[1]))
            best[cell] = {"row": row, "config": c, "train": float(v),
                          "rows": {r: float(x) for x, r, _ in cands}}
    return best


# ------------------------------------------------------------------------------------ the run
def run_robust(cfg: RobustConfig) -> dict:
    """Tune the baselines per cell, then the defaults over the mixture, then replay both on the
    validation splits. Writes ``<out>/robust_defaults.json`` (a parameters file, ``install``: also
    the shipped one) and ``<out>/report.json`` / ``report.md``."""
    import optuna
    from tqdm.auto import tqdm

    from . import __version__
    from ._io import check_writable, write_text_atomic as atomic_write_text
    from .tuning import TuneConfig, make_sampler
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out = Path(cfg.out)
    check_writable(out, "--out", directory=True)
    if cfg.install:
        check_writable(ROBUST_FILE, "--install")
    t0 = time.time()
    groups = {g: _Group(cfg, g, "train") for g in cfg.groups()}   # (bad suites, profiles, rules: before --out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [cell_name(g, rho) for g in groups for rho in cfg.loads]
    n_base = len(cells) * len(cfg.baselines) * cfg.baseline_trials
    bar = tqdm(total=n_base + cfg.trials, desc="robust defaults", unit="trial", disable=not cfg.progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        bar.set_postfix_str("baselines per cell")
        # (the code that tunes them too: a cache from other code is never reused)
        code = {f: hashlib.sha256(Path(__file__).with_name(f).read_bytes()).hexdigest()
                for f in ("robust.py", "tuning.py")}
        key = hashlib.sha256(canonical_json({
            "config": {k: v for k, v in cfg.to_dict().items() if k not in ("trials", "penalty")},
            "groups": {"/".join(g): grp.obj.evidence_inputs for g, grp in groups.items()},
            "code": code, "optuna": optuna.__version__}).encode()).hexdigest()
        cache = out / "baselines.json"
        base = None
        if cache.is_file():   # the same baselines, tuned by an earlier run with this out directory
            old = json.loads(cache.read_text())
            base = old["cells"] if old.get("key") == key else None
        if base is None:
            base = tune_baselines(cfg, groups, bar)
            atomic_write_text(cache, json.dumps({"key": key, "cells": base}, indent=1, sort_keys=True) + "\n")
        else:
            bar.update(n_base)
        best_base = np.array([base[c]["train"] for c in cells])
        bar.set_postfix_str("defaults")
        st = optuna.create_study(direction="maximize",
                                 sampler=make_sampler(TuneConfig(seed=cfg.seed, progress=False), 0))
        for ws in robust_warm_starts()[:cfg.trials]:
            st.enqueue_trial(ws)
        left, history = cfg.trials, []
        while left > 0:
            ts = [st.ask() for _ in range(min(cfg.k, left))]
            cs = [suggest_robust(t) for t in ts]
            g = np.concatenate([grp.cell_means(ROBUST_ROW, grp.robust_configs(cs)) for grp in groups.values()],
                               axis=1)                                   # [k, cells]
            d = g - best_base[None, :]
            for t, c, dj in zip(ts, cs, d):
                v = objective_value(dj, cfg.penalty)
                t.set_user_attr("config", c)
                t.set_user_attr("d", [float(x) for x in dj])
                st.tell(t, v)
                history.append(v)
            left -= len(ts)
            bar.update(len(ts))
            bar.set_postfix_str(f"best {st.best_value:+.4f}")
        bt = st.best_trial
        best_cfg, d_train = bt.user_attrs["config"], np.array(bt.user_attrs["d"])
        # validation: the defaults and each cell's best baseline, replayed (reported, never chosen on)
        bar.set_postfix_str("validation")
        d_val, g_val, b_val = [], [], []
        for gkey in groups:
            vg = _Group(cfg, gkey, "validation")
            gv = vg.cell_means(ROBUST_ROW, vg.robust_configs([best_cfg]))[0]
            for li, rho in enumerate(cfg.loads):
                b = base[cell_name(gkey, rho)]
                bv = float(vg.load_means(b["row"], [b["config"]], li)[0])
                g_val.append(float(gv[li]))
                b_val.append(bv)
                d_val.append(float(gv[li]) - bv)
    finally:
        bar.close()
    d_val = np.array(d_val)
    inputs = {"purpose": "robust defaults (docs/design.md section 10)", "config": cfg.to_dict(),
              "groups": {"/".join(g): grp.obj.evidence_inputs for g, grp in groups.items()},
              "package_version": __version__}
    evidence = hashlib.sha256(canonical_json(inputs).encode()).hexdigest()
    params = defaults_document(best_cfg, evidence, cfg, d_train, d_val)
    report = {
        "format": ROBUST_FORMAT + "-report", "evidence_id": evidence, "config": cfg.to_dict(),
        "objective": {"definition": f"mean_c d_c - {cfg.penalty:g} mean_c max(0, -d_c), d_c = goodput minus the "
                                    "best tuned baseline on cell c (train)", "train": float(bt.value),
                      "history": [float(x) for x in history]},
        "defaults": params,
        "cells": [{"cell": c, "best_baseline": base[c]["row"], "best_baseline_config": base[c]["config"],
                   "baseline_rows_train": base[c]["rows"],
                   "baseline_train": base[c]["train"], "defaults_train": float(base[c]["train"] + d_train[i]),
                   "d_train": float(d_train[i]), "baseline_validation": b_val[i], "defaults_validation": g_val[i],
                   "d_validation": float(d_val[i])} for i, c in enumerate(cells)],
        "validation": {"min_d": float(d_val.min()), "mean_d": float(d_val.mean()),
                       "objective": objective_value(d_val, cfg.penalty)},
    }
    text = json.dumps(report, indent=1, sort_keys=True) + "\n"
    atomic_write_text(out / "report.json", text)
    atomic_write_text(out / "report.md", robust_markdown(report))
    ptxt = json.dumps(params, indent=1, sort_keys=True) + "\n"
    atomic_write_text(out / "robust_defaults.json", ptxt)
    if cfg.install:
        ROBUST_FILE.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(ROBUST_FILE, ptxt)
    (out / "run_meta.json").write_text(json.dumps({"wall_s": time.time() - t0}) + "\n")
    return report


def defaults_document(c: dict, evidence: str, cfg: RobustConfig, d_train, d_val) -> dict:
    """The shipped file: the index's parameters, its margin, u and B_min, the flags' fractions,
    and where they come from (``meta``: ``t_ref_mode`` trace, no profile)."""
    return {
        "format": ROBUST_FORMAT, "version": 1,
        "index": c["index"], "shed_margin": float(c["shed_margin"]),
        "tpot_guard": {k: float(v) for k, v in c["guard"].items()},
        "flag_fractions": {k: float(v) for k, v in c["fractions"].items()},
        "meta": {"t_ref_mode": "trace", "profile": None, "evidence_id": evidence,
                 "command": " ".join(["python tuning/robust_defaults.py", *config_to_argv(cfg, exclude=(
                     "out", "progress", "judge", "traces_dir"))]),
                 "mixture": cfg.to_dict(),
                 "train": {"min_d": float(np.min(d_train)), "mean_d": float(np.mean(d_train))},
                 "validation": {"min_d": float(np.min(d_val)), "mean_d": float(np.mean(d_val))}},
    }


def robust_markdown(rep: dict) -> str:
    lines = [f"# Robust defaults\n\nEvidence id `{rep['evidence_id']}`. Objective: {rep['objective']['definition']}; "
             f"best train value {rep['objective']['train']:+.4f}. Validation: min d_c "
             f"{rep['validation']['min_d']:+.4f}, mean {rep['validation']['mean_d']:+.4f}.\n",
             "| cell | best tuned baseline | baseline (train) | d_c train | baseline (validation) | d_c validation |",
             "|---|---|---|---|---|---|"]
    for c in rep["cells"]:
        lines.append(f"| {c['cell']} | {c['best_baseline']} | {c['baseline_train']:.3f} | {c['d_train']:+.4f} | "
                     f"{c['baseline_validation']:.3f} | {c['d_validation']:+.4f} |")
    d = rep["defaults"]
    lines += ["", "Defaults: " + json.dumps({k: d[k] for k in DEFAULT_KEYS}, sort_keys=True)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ command line
def build_parser(prog: str = "robust_defaults.py"):
    from .config_cli import configure_command, one_line_errors
    p = one_line_errors()(prog=prog)
    configure_command(p, RobustConfig, "Tune the index's robust defaults over a mixture of deployments "
                      "(train splits only) and report them on the validation splits.", __doc__)
    return p


def _run(args, prog: str) -> int:
    from .config_cli import config_from_args
    from .engine import compile_notice
    cfg = config_from_args(RobustConfig, args)
    compile_notice()
    if cfg.judge is not None:
        if not Path(cfg.traces_dir).is_dir():
            raise ConfigError(f"--traces-dir: directory {cfg.traces_dir!r} not found")
        rep = judge_held_out(load_robust_defaults(None if cfg.judge == "shipped" else cfg.judge, "--judge"),
                             cfg.traces_dir,
                             out=cfg.out, progress=cfg.progress)
        if cfg.progress:
            print(goal_markdown(rep))
            print(f"wrote {cfg.out}/goal.json, goal.md")
        return 0 if rep["met"] else 1
    rep = run_robust(cfg)
    if cfg.progress:
        v = rep["validation"]
        print(robust_markdown(rep))
        print(f"validation: min d_c {v['min_d']:+.4f}, mean d_c {v['mean_d']:+.4f}; wrote {cfg.out}/report.json, "
              f"report.md, robust_defaults.json" + (f" and {ROBUST_FILE}" if cfg.install else ""))
    return 0


def main(argv=None, prog: str = "robust_defaults.py") -> int:
    from .config_cli import standalone_main
    return standalone_main(build_parser(prog), _run, argv, prog, prog)


# ------------------------------------------------------------------------------------ the goal
#: held-out deployment cells (docs/design.md section 10, robust defaults' goal): real traces' test
#: parts (their last 20%, never tuned on), SLO rules and loads outside the mixture
HELD_OUT_TRACES = {"azure-code": ("azure_llm_2023/AzureLLMInferenceTrace_code.csv", "llama2-7b-a100"),
                   "azure-conv": ("azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "llama2-7b-a100"),
                   "mooncake": ("mooncake_fast25/conversation_trace.jsonl", "llama31-8b-h100")}
HELD_OUT_RULES = ("mlperf-llama3_1-8b-interactive", "mlperf-llama2-70b")
HELD_OUT_LOADS = (1.5, 3.0)
#: every baseline at its shipped defaults (the profile's flags, shed margin 0 for a +shed row)
DEFAULT_ROWS = ("fcfs", "priority", "sjf", "edf", "llf", "fcfs+shed", "priority+shed", "sjf+shed", "edf+shed",
                "llf+shed")
NON_INFERIOR = -0.01


def _default_row_config(row: str) -> tuple:
    """(tuning row, config) of a baseline at its shipped defaults: +shed at margin 0, plain rows with
    shedding off."""
    if row.endswith("+shed"):
        return row, {"shed_margin": 0.0}
    return row + "+shed", {"shed_margin": "inf"}


def judge_held_out(defaults: dict, traces_dir, *, out=None, windows: int = 200, bootstrap_b: int = 10_000,
                   traces: Optional[dict] = None, rules: tuple = HELD_OUT_RULES, loads: tuple = HELD_OUT_LOADS,
                   rows: tuple = DEFAULT_ROWS, progress: bool = True) -> dict:
    """The robust defaults' goal: on every held-out cell, the defaults (index+shed with their u,
    B_min and flags) minus each baseline at its shipped defaults has a paired CI lower end >=
    -0.01, and pooled over the cells the difference is > 0 with its CI above 0."""
    from tqdm.auto import tqdm

    from .metrics import paired_difference, stratified_difference, win_rate
    from .tuning import TuneConfig, TrainObjective
    trial = {"index": defaults["index"], "shed_margin": defaults["shed_margin"], "guard": defaults["tpot_guard"],
             "fractions": defaults["flag_fractions"]}   # (the file's defaults as a trial of their study)
    traces = HELD_OUT_TRACES if traces is None else traces
    cells, per, inputs = [], {r: [] for r in rows}, {}
    jobs = [(name, rule) for name in traces for rule in rules]
    bar = tqdm(total=len(jobs), desc="held-out cells", unit="workload", disable=not progress, file=sys.stderr)
    try:
        for name, rule in jobs:
            file, prof = traces[name]
            tc = TuneConfig(trace=str(Path(traces_dir) / file), profile=prof, slo_rule=rule, loads=loads,
                            windows=windows, comparators=False, progress=False, max_train_traces=None)
            obj = TrainObjective(tc, split=tc.test_split)
            inputs[f"{name}/{rule}"] = obj.evidence_inputs
            n = len(obj.units) // len(loads)
            g_def = obj.goodput_per_unit(ROBUST_ROW, [robust_config(obj.profile, trial)])[0].reshape(len(loads), n)
            g_base = {}
            for row in rows:
                trow, c = _default_row_config(row)
                g_base[row] = obj.goodput_per_unit(trow, [c])[0].reshape(len(loads), n)
            block = obj.wl.block
            for li, rho in enumerate(loads):
                cell = {"cell": f"{name}/{prof}/{rule}/rho{rho:g}", "units": n, "defaults": float(g_def[li].mean()),
                        "vs": {}}
                for row in rows:
                    a, b = g_def[li], g_base[row][li]
                    m, lo, hi = paired_difference(a, b, B=bootstrap_b, seed=0, block=block)
                    cell["vs"][row] = {"goodput": float(b.mean()), "diff": m, "ci95": [lo, hi],
                                       "win_rate": win_rate(a, b), "pass": lo >= NON_INFERIOR}
                    per[row].append((a - b, block, name))
                cells.append(cell)
            bar.update(1)
    finally:
        bar.close()
    pooled = {}
    for row, items in per.items():
        # (a trace's cells share its windows: resampled together)
        m, lo, hi = stratified_difference([d for d, _, _ in items], [b for _, b, _ in items],
                                          groups=[g for _, _, g in items], B=bootstrap_b, seed=0)
        pooled[row] = {"diff": m, "ci95": [lo, hi], "pass": m > 0 and lo > 0}
    verdict = all(v["pass"] for c in cells for v in c["vs"].values()) and all(p["pass"] for p in pooled.values())
    from . import __version__
    evidence = hashlib.sha256(canonical_json({
        "purpose": "robust defaults on held-out cells", "defaults": {k: defaults[k] for k in DEFAULT_KEYS},
        "rows": list(rows), "loads": list(loads), "bootstrap_b": bootstrap_b, "workloads": inputs,
        "pooled_ci": "stratified by cell, a trace's windows resampled together",
        "package_version": __version__}).encode()).hexdigest()
    rep = {"format": ROBUST_FORMAT + "-goal", "evidence_id": evidence,
           "defaults_evidence_id": defaults["meta"].get("evidence_id"),
           "defaults": {k: defaults[k] for k in DEFAULT_KEYS},
           "goal": (f"every held-out cell: paired CI lower end >= {NON_INFERIOR:g} against every baseline at its "
                    "shipped defaults; pooled over cells (each weighted equally; a trace's windows resampled together "
                    "across its cells): difference > 0 with its CI above 0"),
           "held_out": {"traces": {k: list(v) for k, v in traces.items()}, "rules": list(rules),
                        "loads": list(loads), "split": "test (the last 20% of each trace, by time)",
                        "windows": windows, "bootstrap_b": bootstrap_b},
           "cells": cells, "pooled": pooled, "met": verdict}
    if out is not None:
        from ._io import write_text_atomic
        Path(out).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(out) / "goal.json", json.dumps(rep, indent=1, sort_keys=True) + "\n")
        write_text_atomic(Path(out) / "goal.md", goal_markdown(rep))
    return rep


def goal_markdown(rep: dict) -> str:
    rows = list(rep["pooled"])
    d = rep["defaults"]
    lines = [f"# Robust defaults on held-out cells\n\nEvidence id `{rep['evidence_id']}` (defaults "
             f"`{rep['defaults_evidence_id']}`). {rep['goal']}. Met: **{'yes' if rep['met'] else 'no'}**.\n",
             f"The defaults (index+shed with the tpot-guard rule): index {json.dumps(d['index'], sort_keys=True)}, "
             f"shed margin {d['shed_margin']:g}, u {d['tpot_guard']['budget_u']:g}, B_min "
             f"{d['tpot_guard']['budget_bmin']:g}, flags as fractions of the profile's "
             f"{json.dumps(d['flag_fractions'], sort_keys=True)} (threshold >= 1: off). A cell's entry is the "
             "paired difference [95% CI]; ✗ marks a CI lower end below -0.01 (a cell) or a pooled difference "
             "whose CI is not above 0.\n",
             "| cell | defaults | " + " | ".join(f"vs {r}" for r in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for c in rep["cells"]:
        lines.append(f"| {c['cell']} | {c['defaults']:.3f} | " + " | ".join(
            f"{v['diff']:+.3f} [{v['ci95'][0]:+.3f}, {v['ci95'][1]:+.3f}]{'' if v['pass'] else ' ✗'}"
            for v in (c["vs"][r] for r in rows)) + " |")
    lines.append("| pooled | | " + " | ".join(
        f"{p['diff']:+.3f} [{p['ci95'][0]:+.3f}, {p['ci95'][1]:+.3f}]{'' if p['pass'] else ' ✗'}"
        for p in (rep["pooled"][r] for r in rows)) + " |")
    return "\n".join(lines) + "\n"
