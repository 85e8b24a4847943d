"""Tuning (docs/design.md section 7): the library behind ``tokenbatch tune`` (``tune_cli``; also
``python tuning/optuna_search.py``).

What it does
------------
* One **study per tuned row**, all in one storage: ``<name>.index+shed`` tunes the Gittins-barrier
  index (kappa, slope, gamma, theta, beta, w_prefix, a_edf and the shed margin in [0, 2]; see
  ``suggest_index`` for why "off" is not searched), and ``<name>.<policy>+shed`` tunes the shed
  margin in [0, 2] of each baseline with a parameter (default EDF, SJF, LLF). A new study first
  runs its warm starts (``warm_starts``: the index's SJF, EDF and default members; margins 0 and
  0.5 for a baseline), which count toward its budget. Every study gets the **same number of trials** and the same
  k, and the studies take turns batch by batch, so a ``--timeout`` also cuts them evenly. Aging is
  not implemented in the engine, so there is no aging baseline to tune.
* **Levers** (docs/design.md section 11, on by default, ``levers=False`` / ``--no-levers`` to skip):
  every row but the index-scheduled buckets also tunes vLLM's ``max_num_batched_tokens``,
  ``max_num_seqs`` and ``long_prefill_token_threshold`` (``suggest_levers``, ranges
  ``TuneConfig.lever_space``: up to the profile's B_max), the trial config's ``"engine"``; the rows
  ``FLAGS_ROWS`` (FCFS and priority) tune only them. Loads and SLOs stay at the profile's flags.
* **The tpot-guard budget rule** (docs/design.md section 11, ``budget_rule="tpot-guard"`` /
  ``--budget-rule tpot-guard``): the index's and each baseline's +shed row get a twin study
  ``<row>+tpot-guard`` that runs with the rule and tunes its u in [-0.5, 2] and B_min in [0, 1]
  with the rest (the levers' ``"engine"``), with the same trial budget; the parameters file keeps
  their policy parameters under ``"tpot-guard"`` and their levers (u and B_min included) under
  ``"levers"``, and the test report runs every row with and without the rule.
* **Comparators** (docs/design.md section 8, on by default, ``comparators=False`` /
  ``--no-comparators`` to skip): ``<name>.weights+shed`` tunes the ``weights`` policy (8 weights in
  ``policies.WEIGHT_RANGE`` over ``engine.scoring.LINEAR_FEATURES`` and the shed margin; warm
  starts SJF's, EDF's and LLF's directions at margin 0) with ``trials`` trials, and
  ``<name>.index@rho<x>`` tunes the index (+ margin) at each test evaluation load x (one load
  bucket of ``index-scheduled``) on the same train traces, with ceil(trials / B) trials each for B
  buckets: the same total budget as the index study. They run after the rows above in each turn.
* **Objective**: mean goodput (met / arrived, macro mean over units) on the TRAIN split (optionally
  its first ``max_train_traces`` traces) at each tuning load; a unit is (trace, load). The traces are
  scaled exactly as the evaluator scales them (``workload.prepare_workload``: the suite manifest's
  ``lambda_sat``, ``scale_to_rate`` with the suite's nominal rate), and every trial sees the same
  length estimates (the suite's predictor: common random numbers).
* **k trials per engine run**: ``claim_trial`` (``study.ask()`` with its owner recorded) k times,
  the units x k parameter sets as copies of one simulate call (``evaluate.evaluate_param_vectors``:
  one theta row, shed margin and engine configuration per copy), then ``study.tell``. The copies are split over
  ``threads`` threads (the compiled kernel releases the GIL; each copy's result does not depend on
  which batch it ran in, so results are identical for any thread count).
* **Pruning** (``pruner="median"``): the units are cut into 4 quarters; after each quarter every
  live trial reports its running mean and pruned trials leave the remaining quarters.
* **Failures are never fatal**: an exception or a NaN value marks the batch's trials FAIL (user attr
  ``fail_reason``) and the search goes on; they count toward the trial cap so a broken objective
  cannot loop forever.
* **Trial cap** (``trials``) is global across workers: a trial counts if it is COMPLETE, PRUNED,
  RUNNING or FAILED by the objective; a trial asked beyond the cap by a racing worker is marked FAIL
  with ``fail_reason = "over_cap"`` at once (never evaluated, never counted).
* **Stale-trial recovery**: every trial records its owner (``host``, boot and pid namespace,
  ``pid`` and the process start time) as user attributes, written so that no kill can leave a
  RUNNING trial whose owner cannot be told (``claim_trial``). On start, RUNNING trials of this host
  whose owner is gone (or a zombie, or a reused pid) are marked FAIL (``fail_reason = "stale"``)
  and their parameters re-enqueued. RUNNING trials of other hosts (or containers with their own
  pids) are left alone: their liveness cannot be checked from here.
* **Reproducibility**: an uninterrupted one-worker study with a fixed seed gives byte-identical
  results (report.json, best_params.json) on every rerun. A study resumed after a kill or a timeout
  may end with other numbers than an uninterrupted one (each run's samplers start from their seeds
  and the trials told so far, not from where the stopped run's were), and several workers race;
  ``run_search`` prints one line when it resumes a study with trials in it.
* **Storage**: ``None`` -> an embedded SQLite file ``<out>/study.db`` (one process, resumable), or
  ``<out>/study.journal`` with several workers; a path ending in ``.db``/``.sqlite``/``.sqlite3`` or
  a ``sqlite:///`` URL -> SQLite; a path ending in ``.journal``/``.log``/``.jsonl`` or
  ``journal:PATH`` -> ``JournalStorage(JournalFileBackend(PATH))`` (several processes, one machine);
  ``postgresql://...`` / ``mysql://...`` (any SQLAlchemy driver suffix) -> that database.

Optuna is imported lazily (inside functions) so ``import tokenbatch_env`` stays light.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .config_cli import option
from .engine.levers import FLAGS_SUFFIX, GUARD_LEVERS, GUARD_SUFFIX, lever_space, suggest_levers
from .errors import ConfigError, TokenBatchError
from .policies import policy_names
from .util import NATIVE, available_cores, canonical_json, parse_loads, split_native

#: baselines whose only parameter is the shed margin of their +shed row (aging: not implemented)
TUNABLE_BASELINES = policy_names(tuned="margin")   # the registry's rows whose shed margin is tuned
DEFAULT_BASELINES = ("edf", "sjf", "llf")
SAMPLERS = ("tpe", "cmaes", "random")
BUDGET_RULES = ("none", "tpot-guard")
PRUNERS = ("none", "median")
INDEX_ROW = "index+shed"
WEIGHTS_ROW = "weights+shed"         # comparator: tuned constant weights (weights-static)
BUCKET_PREFIX = "index@rho"          # comparator: index-scheduled, one index study per load bucket
#: FCFS and priority with tuned vLLM flags (docs/design.md section 11): the rows of what an engineer
#: can do today with vLLM's own flags
FLAGS_ROWS = tuple(p + FLAGS_SUFFIX for p in ("fcfs", "priority"))
QUARTERS = 4
#: a cluster row's label: ``"<router> x <row>"`` (the benchmark's, ``evaluate.rows.routed_label``)
ROUTED = " x "
#: the routers tuned when ``--replicas R > 1`` names none: the reference and every router with parameters
DEFAULT_ROUTERS = ("round-robin", "prefix-affinity")
OVER_CAP, STALE = "over_cap", "stale"


# ------------------------------------------------------------------------------------ config
def _int_field(v, name: str, lo: int, allow_none: bool = False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo:
        raise ConfigError(f"{name}: must be an integer >= {lo}, got {v!r}")
    return int(v)


def _parse_loads(text, flag: str) -> tuple:
    """--loads / --eval-loads: the evaluator's own parser of rho values (one-line errors); ``native``
    (with --trace) is the trace's own timestamps (times --rate-scale)."""
    native, rest = split_native(text)
    if native:
        return (NATIVE,) + (parse_loads(rest, flag[2:]) if rest else ())
    return parse_loads(text, flag[2:])


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """Everything that determines a tuning run. Defaults are the newcomer's run (about 2.5 minutes on
    2 cores with the comparators, measured in docs/benchmarks.md). Each field's ``help`` is its
    ``tokenbatch tune`` / tuning/optuna_search.py option's (``config_cli``)."""

    suite: str = option("seed-200", "suite name or spec .json (default seed-200)")
    train_split: str = option("train", "split the search sees (default train)")
    test_split: str = option("test", "held-out split evaluated once at the end (default test)")
    profile: str = option("stress-512", "engine profile (default stress-512)")
    loads: Optional[tuple[float, ...]] = option(
        None, "tuning load(s) rho, comma-separated: the objective is the mean goodput over traces x loads "
        "(default 1.2, the primary endpoint's load; with --trace: native, the trace's own timestamps)",
        parse=_parse_loads)
    eval_loads: Optional[tuple[float, ...]] = option(
        None, "test-split loads for the leaderboard and goodput vs load (default 1.0,1.2,1.5; with --trace: "
        "the tuning loads)", parse=_parse_loads)
    trials: int = option(
        48, "trials per study, a global cap across workers; the index, each baseline and weights+shed get "
        "this many, each index-scheduled bucket study ceil(trials / buckets) (default 48)",
        flags=("--trials", "--n-trials"), min=1)
    k: int = option(8, "trials evaluated per engine run (default 8)", min=1)
    max_train_traces: Optional[int] = option(
        40, "use the first N train traces, or 'all' (default 40 of 120)", min=1, none="all")
    max_test_traces: Optional[int] = option(
        None, "use the first N test traces, or 'all' (default all: the pre-registered test set)", min=1,
        none="all")
    timeout: Optional[float] = option(None, "stop starting new trials after this many seconds of search",
                                      what="a number of seconds")
    sampler: str = option("tpe", "tpe (seeded multivariate TPE, default), cmaes or random")
    pruner: str = option("none", "none (default) or median: report after each quarter of the copies")
    seed: int = option(0, "sampler seed (also the bootstrap seed of the test report; default 0)", min=0)
    baselines: tuple[str, ...] = option(
        DEFAULT_BASELINES, "baselines whose +shed margin is tuned with the same budget (default edf,sjf,llf; "
        "also fcfs, priority; aging is not implemented)", allow_empty=True)
    storage: Optional[str] = option(
        None, "SQLite file (*.db, one process, resumable), journal file (*.journal, several processes on one "
        "machine) or RDB URL (postgresql://..., mysql://...); default <out>/study.db (<out>/study.journal "
        "with --workers > 1)")
    study_name: Optional[str] = option(
        None, "study name prefix (default <suite>-<profile>-rho<loads>); one study per tuned row: "
        "<name>.index+shed, <name>.edf+shed, ..., <name>.weights+shed, <name>.index@rho1.2, ...")
    out: str = option("runs/tune", "output directory (default runs/tune)")
    workers: int = option(1, "local worker processes on one study (needs a journal or RDB storage; default 1)",
                          min=1)
    threads: Optional[int] = option(None, "engine threads per process (default: cores / workers)", min=1)
    bootstrap_b: int = option(10_000, "bootstrap resamples of the test report (default 10000)", min=100)
    warm_start: bool = option(
        True, "do not enqueue the index's SJF/EDF/default members (margins 0, 0.5 for the baselines; "
        "SJF/EDF/LLF directions for weights+shed) as the first trials of a new study",
        flags=("--no-warm-start",), sets=False)
    progress: bool = option(True, "no progress bars, no summary", flags=("--quiet",), sets=False)
    comparators: bool = option(
        True, "do not tune the docs/design.md section 8 comparators: weights+shed (study <name>.weights+shed, "
        "--trials trials) and index-scheduled (one index study per --eval-loads bucket, <name>.index@rho<x>, "
        "ceil(trials / buckets) trials each); on by default", flags=("--no-comparators",), sets=False)
    agents: tuple[str, ...] = option(
        (), "a trained agent (agents/train_ppo.py or tokenbatch train output directory, e.g. runs/ppo/best) "
        "judged in the test report beside the tuned rows; repeatable (needs the rl extra)",
        flags=("--agent",), append=True, metavar="PATH")
    trace: Optional[str] = option(
        None, "tune on a trace file instead of a suite (Azure CSV, Mooncake JSONL, BurstGPT, canonical): its "
        "requests split by time, first 60% train, next 20% validation, last 20% test; every tuned row is tuned "
        "on train, its best kept on validation, judged once on test")
    trace_format: Optional[str] = option(None, "the trace file's format (default: detected)", flags=("--format",))
    windows: int = option(200, "with --trace: scored requests per window", min=1)
    warmup: int = option(100, "with --trace: requests simulated before each window, not scored", min=0)
    cooldown: int = option(100, "with --trace: requests simulated after each window, not scored", min=0)
    rate_scale: float = option(1.0, "with --trace and --loads native: multiply the trace's arrival rate by this",
                               what="a positive number")
    val_top: int = option(5, "with --trace: the best trials (by train goodput) of each row replayed on the "
                             "validation windows; the best there is kept", min=1)
    slo_rule: Optional[str] = option(
        None, "SLO rule (a preset: tokenbatch_env/data/slo_rules, or a JSON file) setting every request's SLOs "
        "and priority (default: the suite's or the trace's own; default-3class for columns a trace lacks)",
        metavar="FILE|NAME")
    levers: bool = option(
        True, "do not tune vLLM's iteration-size flags (max_num_batched_tokens, max_num_seqs, "
        "long_prefill_token_threshold) with each row's parameters, and leave out the rows 'fcfs (tuned vLLM flags)' "
        "and 'priority (tuned vLLM flags)': every row runs at the profile's flags", flags=("--no-levers",), sets=False)
    budget_rule: str = option(
        "none", "none (default) or tpot-guard: also tune a <row>+tpot-guard twin of the index's and each baseline's "
        "+shed row, with the rule's u and B_min in its search space and the same trial budget (docs/design.md "
        "section 11)", metavar="RULE")
    replicas: int = option(
        1, "tune and judge every row on a cluster of R engine replicas behind each of --routers (docs/design.md "
        "section 12): rows '<router> x <row>', a study each with the same trial budget; a router's parameters "
        "(prefix-affinity's alpha, beta) join its rows' search space; rho is per replica (a suite's traces "
        "arrive R times as fast; --windows, --warmup and --cooldown count per replica); no comparators, no "
        "agents (default 1: one engine)", min=1, metavar="R")
    routers: Optional[tuple[str, ...]] = option(
        None, "with --replicas R > 1: the routers, comma-separated (default round-robin and every router with "
        "parameters: round-robin,prefix-affinity)", metavar="A,B,...")
    metrics_staleness_ms: float = option(
        0.0, "with --replicas R > 1: the routers read the replicas' state this many ms ago (default 0)",
        what="a number of ms", metavar="MS")

    def __post_init__(self):
        from .policies import BASELINES
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for f in ("suite", "train_split", "test_split", "profile", "out"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ConfigError(f"{f}: must be a non-empty string")
        if self.train_split == self.test_split:
            raise ConfigError(f"test_split must differ from train_split (both {self.train_split!r}): "
                              "the test split must never be seen by the search")
        if self.trace is not None:
            if not isinstance(self.trace, str) or not Path(self.trace).is_file():
                raise ConfigError(f"trace: file {self.trace!r} not found")
            set_("comparators", False)   # (the comparators are the suite protocol's, docs/design.md section 7)
            if self.agents:
                raise ConfigError("agents: judged on a suite's test split, not with --trace")
            for f, lo in (("windows", 1), ("warmup", 0), ("cooldown", 0), ("val_top", 1)):
                set_(f, _int_field(getattr(self, f), f, lo))
            r = self.rate_scale
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
                raise ConfigError(f"rate_scale: must be a positive finite number, got {r!r}")
            set_("rate_scale", float(r))
        elif self.rate_scale != 1.0:
            raise ConfigError("rate_scale: only with --trace (the native load of a trace file)")
        if self.slo_rule is not None:
            from .traces.slo_rules import load_slo_rule
            load_slo_rule(self.slo_rule)
        if self.loads is None:
            set_("loads", (NATIVE,) if self.trace is not None else (1.2,))
        if self.eval_loads is None:
            set_("eval_loads", self.loads if self.trace is not None else (1.0, 1.2, 1.5))
        if self.rate_scale != 1.0 and NATIVE not in tuple(self.loads) + tuple(self.eval_loads):
            raise ConfigError("rate_scale: scales the native load only: give --loads native")
        for f in ("loads", "eval_loads"):
            vals = tuple(getattr(self, f))
            if not vals:
                raise ConfigError(f"{f}: need at least one rho > 0")
            native = NATIVE in vals
            if native and self.trace is None:
                raise ConfigError(f"{f}: native loads are a trace file's own timestamps: give --trace FILE")
            for x in vals:
                if x == NATIVE:
                    continue
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                    raise ConfigError(f"{f}: rho must be a finite number > 0, got {x!r}")
            set_(f, ((NATIVE,) if native else ()) + tuple(sorted({float(x) for x in vals if x != NATIVE})))
        set_("trials", _int_field(self.trials, "trials", 1))
        set_("k", _int_field(self.k, "k", 1))
        set_("max_train_traces", _int_field(self.max_train_traces, "max_train_traces", 1, True))
        set_("max_test_traces", _int_field(self.max_test_traces, "max_test_traces", 1, True))
        set_("seed", _int_field(self.seed, "seed", 0))
        set_("workers", _int_field(self.workers, "workers", 1))
        set_("threads", _int_field(self.threads, "threads", 1, True))
        set_("bootstrap_b", _int_field(self.bootstrap_b, "bootstrap_b", 100))
        if self.timeout is not None:
            t = self.timeout
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ConfigError(f"timeout: must be a positive number of seconds, got {t!r}")
            set_("timeout", float(t))
        ag = tuple(str(a) for a in self.agents)
        if ag and self.replicas != 1:   # (before the agents' files are read: the flags conflict whatever they hold)
            raise ConfigError("--agent: agents are judged on a single engine, not with --replicas R > 1")
        if ag:
            from .agents.load import agent_files
        for a in ag:
            if not Path(a).exists():
                raise ConfigError(f"agents: {a!r} not found (an agents/train_ppo.py output directory)")
            agent_files(a, "agents:")   # its files, now rather than after the search
        if ag:
            from .agents.load import agent_labels
            agent_labels(ag)   # (distinct agents, distinct labels)
        set_("agents", ag)
        self._check_cluster(set_)
        if self.budget_rule not in BUDGET_RULES:
            raise ConfigError(f"budget_rule: unknown {self.budget_rule!r}; valid: {', '.join(BUDGET_RULES)}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"sampler: unknown {self.sampler!r}; valid: {', '.join(SAMPLERS)}")
        if self.pruner not in PRUNERS:
            raise ConfigError(f"pruner: unknown {self.pruner!r}; valid: {', '.join(PRUNERS)}")
        bl = tuple(self.baselines)
        for b in bl:
            if b not in TUNABLE_BASELINES:
                hint = " (aging is not implemented)" if "aging" in str(b) else ""
                raise ConfigError(f"baselines: {b!r} has no tunable parameter{hint}; valid: "
                                  f"{', '.join(TUNABLE_BASELINES)}")
            assert b in BASELINES
        if len(set(bl)) != len(bl):
            raise ConfigError(f"baselines: duplicates in {list(bl)}")
        set_("baselines", bl)
        if not isinstance(self.comparators, (bool, np.bool_)):
            raise ConfigError(f"comparators: must be True or False, got {self.comparators!r}")
        set_("comparators", bool(self.comparators))
        names = [f"{BUCKET_PREFIX}{x:g}" for x in self.eval_loads if x != NATIVE]
        if self.comparators and len(set(names)) != len(names):
            raise ConfigError(f"eval_loads: {list(self.eval_loads)} are too close to name one index study "
                              "per load bucket")
        if self.study_name is not None and (not isinstance(self.study_name, str) or not self.study_name.strip()):
            raise ConfigError("study_name: must be a non-empty string")
        if self.storage is not None:
            storage_kind(self.storage)       # validates
        if self.workers > 1 and self.storage is not None and storage_kind(self.storage) == "sqlite":
            raise ConfigError(f"--workers {self.workers} needs a journal file or an RDB URL as --storage "
                              "(SQLite is for one process); e.g. --storage runs/study.journal")

    def _check_cluster(self, set_) -> None:
        """1 <= replicas <= ``MAX_REPLICAS``; with R > 1 the routers (default ``DEFAULT_ROUTERS``) are
        known and distinct and the comparators are off (controllers do not run in a cluster benchmark);
        routers and staleness only with R > 1. Errors name the flags."""
        from .config_cli import check_names
        from .engine.cluster import ROUTER_NAMES
        from .engine.flags import MAX_REPLICAS
        R = _int_field(self.replicas, "--replicas", 1)
        if R > MAX_REPLICAS:
            raise ConfigError(f"--replicas: must be in [1, {MAX_REPLICAS}], got {R}")
        set_("replicas", R)
        routers = None if self.routers is None else \
            (self.routers,) if isinstance(self.routers, str) else tuple(self.routers)
        st = self.metrics_staleness_ms
        if isinstance(st, bool) or not isinstance(st, (int, float)) or not math.isfinite(st) or st < 0:
            raise ConfigError(f"--metrics-staleness-ms: must be a finite number of ms >= 0, got {st!r}")
        set_("metrics_staleness_ms", float(st))
        if R == 1:
            if routers is not None or self.metrics_staleness_ms:
                raise ConfigError("--routers and --metrics-staleness-ms: a cluster's settings, with --replicas R > 1")
            return
        set_("routers", check_names(DEFAULT_ROUTERS if routers is None else routers, ROUTER_NAMES,
                                    "--routers", "router"))
        set_("comparators", False)   # (index-scheduled is a controller: not in a cluster benchmark yet)

    # derived -------------------------------------------------------------------------------
    @property
    def cluster(self) -> bool:
        """Every row on ``replicas`` > 1 engine replicas behind each of ``routers``."""
        return self.replicas > 1

    @property
    def name(self) -> str:
        if self.study_name:
            return self.study_name
        what = self.suite if self.trace is None else "trace-" + Path(self.trace).stem
        return (f"{what}-{self.profile}-rho" + "-".join(x if x == NATIVE else f"{x:g}" for x in self.loads)
                + (f"-R{self.replicas}" if self.cluster else ""))

    @property
    def rows(self) -> tuple:
        """The tuned rows, in turn order: the index first, then each baseline's +shed row, FCFS and
        priority with tuned vLLM flags (``levers``), then (with ``comparators``) weights+shed and the
        index-scheduled bucket studies (low load first), and with ``budget_rule`` tpot-guard the
        +tpot-guard twins of the +shed rows (last, so that the other rows' samplers keep their seeds)."""
        shed = (INDEX_ROW, *[f"{b}+shed" for b in self.baselines])
        rows = shed + (FLAGS_ROWS if self.levers else ())
        if self.comparators:
            rows += (WEIGHTS_ROW, *self.bucket_rows)
        if self.budget_rule == "tpot-guard":   # (last: the other rows keep their samplers' seeds)
            rows += tuple(r + GUARD_SUFFIX for r in shed)
        if self.cluster:   # each row behind each router (docs/design.md section 12), router by router
            rows = tuple(f"{router}{ROUTED}{r}" for router in self.routers for r in rows)
        return rows

    @property
    def bucket_rows(self) -> dict:
        """index-scheduled's studies: row ("index@rho1.2") -> its load bucket's tuning load (the
        test evaluation loads); empty without ``comparators``."""
        if not self.comparators:
            return {}
        return {f"{BUCKET_PREFIX}{x:g}": x for x in self.eval_loads}

    @property
    def bucket_trials(self) -> int:
        """Trials per bucket study: ceil(trials / B), so index-scheduled's B studies together get
        (at least) the index study's budget."""
        return -(-self.trials // max(1, len(self.eval_loads)))

    def trials_of(self, row: str) -> int:
        return self.bucket_trials if row.startswith(BUCKET_PREFIX) else self.trials

    def loads_of(self, row: str) -> tuple:
        """The loads a row's objective averages over (a bucket study: its bucket's load)."""
        return (self.bucket_rows[row],) if row.startswith(BUCKET_PREFIX) else self.loads

    def study_name_of(self, row: str) -> str:
        return f"{self.name}.{row}"

    @property
    def storage_url(self) -> str:
        if self.storage is not None:
            return self.storage
        name = "study.journal" if self.workers > 1 else "study.db"
        return str(Path(self.out) / name)

    def engine_threads(self) -> int:
        if self.threads is not None:
            return self.threads
        return max(1, available_cores() // self.workers)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.budget_rule == "none":   # (absent, as before the rule existed: the same evidence ids)
            del d["budget_rule"]
        if not self.cluster:             # (absent for one engine, as before clusters: the same evidence ids)
            for k in ("replicas", "routers", "metrics_staleness_ms"):
                del d[k]
        else:
            d["routers"] = list(self.routers)
        d["loads"], d["eval_loads"], d["baselines"] = list(self.loads), list(self.eval_loads), list(self.baselines)
        return d

    def workload_kwargs(self, split: str) -> dict:
        """``BenchConfig`` fields of the workload ``split`` names: a suite split, or a trace file's
        time-ordered part (docs/design.md section 10), with the SLO rule."""
        if self.trace is None:
            return {"suite": self.suite, "split": split, "slo_rule": self.slo_rule}
        return {"trace_file": self.trace, "trace_format": self.trace_format, "windows": self.windows,
                "warmup": self.warmup, "cooldown": self.cooldown, "trace_split": split,
                "rate_scale": self.rate_scale, "slo_rule": self.slo_rule}

    def objective_dict(self, row: Optional[str] = None) -> dict:
        """What defines a study's objective (a resumed study must match it)."""
        loads = self.loads if row is None else self.loads_of(row)
        d = {"suite": self.suite, "train_split": self.train_split, "profile": self.profile,
             "loads": list(loads), "max_train_traces": self.max_train_traces}
        if self.trace is not None:
            d.update(trace=str(Path(self.trace).resolve()), windows=self.windows, warmup=self.warmup,
                     cooldown=self.cooldown, rate_scale=self.rate_scale,
                     scored="window")   # (each window's requests only, not its warm-up and cool-down)
        if self.slo_rule is not None:
            from .traces.slo_rules import load_slo_rule
            rule = load_slo_rule(self.slo_rule)
            d["slo_rule"] = {"name": rule.name, "digest": rule.digest}
        space = self.lever_space(row) if row is not None else None
        if space is not None:
            d["levers"] = space
        if self.cluster:
            d["cluster"] = {"replicas": self.replicas, "metrics_staleness_ms": self.metrics_staleness_ms}
        return d

    def bench_cluster(self) -> dict:
        """The ``BenchConfig`` cluster fields (none for one engine: its evidence ids unchanged)."""
        if not self.cluster:
            return {}
        return {"replicas": self.replicas, "routers": self.routers, "metrics_staleness_ms": self.metrics_staleness_ms,
                "upper_bound": False}

    def lever_space(self, row: str) -> Optional[dict]:
        """The row's lever ranges (docs/design.md section 11), None for a row without levers (the
        index-scheduled buckets: its controller switches parameters mid-run, the flags are static):
        ``{lever: [lo, hi, reference]}``: vLLM's flags (with ``levers``), bounded by the profile's
        B_max and max_num_seqs, the reference the profile's own setting (threshold: off); for a
        +tpot-guard row also u and B_min in their ranges, the reference the rule's defaults (0, 0)."""
        if row.startswith(BUCKET_PREFIX):
            return None
        from .engine.profiles import load_profile
        space = lever_space(load_profile(self.profile), flags=self.levers, guard=row.endswith(GUARD_SUFFIX))
        return space or None


# ------------------------------------------------------------------------------------ search space
def suggest_index(trial) -> dict:
    """The index's search space (docs/design.md section 4 ranges and scales) -> the trial's config:
    ``{"index": {IndexParams fields}, "shed_margin": float}``. log1p parameters are searched as
    ``x = ln(1 + value)`` (internal name ``log1p_<name>``). The margin is searched in [0, 2]; "off"
    (inf) is left out: the tuned row is index+shed (the primary endpoint's), the no-shed ``index``
    row is reported beside it, and an unshed trial at rho >= 1 costs ~4x the engine time (the
    queue grows without bound) for goodput far below every shed row."""
    from .policies import POLICIES, SHED_RANGE
    idx = {}
    for name, (lo, hi, scale) in POLICIES["index"].ranges:
        if scale == "log":
            idx[name] = trial.suggest_float(name, lo, hi, log=True)
        elif scale == "log1p":
            x = trial.suggest_float(f"log1p_{name}", math.log1p(lo), math.log1p(hi))
            idx[name] = min(hi, max(lo, math.expm1(x)))
        else:
            idx[name] = trial.suggest_float(name, lo, hi)
    return {"index": idx, "shed_margin": trial.suggest_float("shed_margin", *SHED_RANGE)}


def suggest_margin(trial) -> dict:
    from .policies import SHED_RANGE
    return {"shed_margin": trial.suggest_float("shed_margin", *SHED_RANGE)}


def suggest_weights(trial) -> dict:
    """The ``weights`` policy's search space: one weight per ``engine.scoring.LINEAR_FEATURES`` in
    ``policies.WEIGHT_RANGE`` (internal name ``w_<feature>``; only the direction w/|w| matters)
    and the shed margin in [0, 2] -> ``{"weights": {feature: w}, "shed_margin": float}``."""
    from .engine.scoring import LINEAR_FEATURES
    from .policies import SHED_RANGE, WEIGHT_RANGE
    w = {f: trial.suggest_float(f"w_{f}", *WEIGHT_RANGE) for f in LINEAR_FEATURES}
    return {"weights": w, "shed_margin": trial.suggest_float("shed_margin", *SHED_RANGE)}


def split_routed(row: str) -> tuple:
    """(router, the row without it) of a cluster row ``"<router> x <row>"``; (None, row) otherwise."""
    router, sep, plain = row.partition(ROUTED)
    return (router, plain) if sep else (None, row)


def suggest_router(trial, router: str) -> dict:
    """A router's parameters in their ranges (``engine.cluster.RouterSpec.ranges``; internal names
    ``router_<name>``, ``router_log1p_<name>`` for a log1p scale); {} for a router without any."""
    from .engine.cluster import ROUTERS
    out = {}
    for name, (lo, hi, scale) in ROUTERS[router].ranges.items():
        if scale == "log1p":
            x = trial.suggest_float(f"router_log1p_{name}", math.log1p(lo), math.log1p(hi))
            out[name] = float(f"{min(hi, max(lo, math.expm1(x))):.12g}")   # (8, not 8.000000000000002)
        else:
            out[name] = trial.suggest_float(f"router_{name}", lo, hi)
    return out


def router_warm_start(router: str) -> dict:
    """The optuna params of a router's default parameters (every warm start runs them)."""
    from .engine.cluster import ROUTERS
    spec = ROUTERS[router]
    return {(f"router_log1p_{k}" if scale == "log1p" else f"router_{k}"):
            (math.log1p(spec.params[k]) if scale == "log1p" else spec.params[k])
            for k, (_, _, scale) in spec.ranges.items()}


def row_kind(row: str) -> str:
    """'index' (index+shed, its +tpot-guard twin and the index-scheduled bucket studies), 'weights',
    'flags' (FCFS or priority with tuned vLLM flags only) or 'margin'; a cluster row's: its row's."""
    row = split_routed(row)[1].removesuffix(GUARD_SUFFIX)
    if row == INDEX_ROW or row.startswith(BUCKET_PREFIX):
        return "index"
    if row in FLAGS_ROWS:
        return "flags"
    return "weights" if row == WEIGHTS_ROW else "margin"


def suggest_config(row: str, trial, space: Optional[dict] = None) -> dict:
    """A trial's config for ``row``: its policy parameters (none for a flags row), and with a lever
    ``space`` its levers under ``"engine"``."""
    kind = row_kind(row)
    if kind == "index":
        c = suggest_index(trial)
    elif kind == "weights":
        c = suggest_weights(trial)
    else:
        c = {} if kind == "flags" else suggest_margin(trial)
    if space is not None:
        c["engine"] = suggest_levers(trial, space)
    router = split_routed(row)[0]
    if router is not None:
        rp = suggest_router(trial, router)
        if rp:
            c["router"] = rp
    return c


def reference_levers(space: dict) -> dict:
    """The optuna params of the profile's own flags (threshold off: drawn at the top of its range)
    and of the tpot-guard rule's defaults."""
    return {k: (ref if ref > 0 or k in GUARD_LEVERS else hi) for k, (lo, hi, ref) in space.items()}


def warm_starts(row: str, space: Optional[dict] = None) -> list:
    """Trials enqueued first in a new study (part of its budget): ``row_warm_starts``; a cluster
    row's at its router's default parameters."""
    router, plain = split_routed(row)
    base = row_warm_starts(plain, space)
    return base if router is None else [{**ws, **router_warm_start(router)} for ws in base]


def row_warm_starts(row: str, space: Optional[dict] = None) -> list:
    """Trials enqueued first in a new study (part of its budget). With a lever ``space``: each
    policy warm start at the profile's flags, then the first one with a quarter of the budget (where
    TPOT binds, the iteration's size decides most); a flags row: the profile's flags, a quarter of
    the budget, and the budget with a threshold of a quarter of it. A +tpot-guard row's warm starts
    run the rule at its defaults, and the last one has B_min 1 (the rule never lowers the budget:
    the first warm start of the row without it)."""
    base = _policy_warm_starts(row)
    if space is None:
        return base
    ref = reference_levers(space)
    if row.endswith(GUARD_SUFFIX):
        return row_warm_starts(row.removesuffix(GUARD_SUFFIX), space) + [{**base[0], **ref, "budget_bmin": 1.0}]
    if "max_num_batched_tokens" not in space:
        return [{**ws, **ref} for ws in base]
    lo_b, hi_b = space["max_num_batched_tokens"][:2]
    quarter = {**ref, "max_num_batched_tokens": max(lo_b, ref["max_num_batched_tokens"] // 4)}
    if row_kind(row) == "flags":
        thr = max(space["long_prefill_token_threshold"][0], ref["max_num_batched_tokens"] // 4)
        return [ref, quarter, {**ref, "long_prefill_token_threshold": thr}]
    return [{**ws, **ref} for ws in base] + [{**base[0], **quarter}]


def _policy_warm_starts(row: str) -> list:
    """The policy parameters' warm starts (``warm_starts``): for the index (and each
    index-scheduled bucket study) the members of its family that are the baselines (SJF: only
    ``-ln S``; EDF: ``a_edf`` large; the defaults), so the search starts from the best simple
    policy instead of having to find it; for weights+shed the directions of SJF (-1 on log_s),
    EDF (-1 on to_deadline) and LLF (-1 on slack) at margin 0; for a baseline, margins 0 and 0.5.
    ``open_studies`` enqueues at most the study's trial cap of them."""
    kind = row_kind(row)
    if kind == "weights":
        from .engine.scoring import LINEAR_FEATURES
        zero = {f"w_{f}": 0.0 for f in LINEAR_FEATURES}
        return [{**zero, f"w_{f}": -1.0, "shed_margin": 0.0} for f in ("log_s", "to_deadline", "slack")]
    if kind == "margin":
        return [{"shed_margin": 0.0}, {"shed_margin": 0.5}]
    zero = {"kappa": 0.0, "slope": 1.0, "log1p_gamma": 0.0, "theta": 0.0, "beta": 0.0, "w_prefix": 0.0,
            "a_edf": 0.0}
    return [
        {**zero, "shed_margin": 0.0},                       # SJF + shed
        {**zero, "shed_margin": 0.5},
        {**zero, "a_edf": 10.0, "shed_margin": 0.0},        # ~EDF + shed
        {"kappa": 1.0, "slope": 1.0, "log1p_gamma": math.log1p(10.0), "theta": 0.2, "beta": 1.0,
         "w_prefix": 1.0, "a_edf": 0.0, "shed_margin": 0.0},  # IndexParams() + shed
    ]


def config_to_enqueue(row: str, params: dict) -> dict:
    """A trial's optuna params as they can be re-enqueued (identity: they are the internal ones)."""
    return dict(params)


def _margin_value(m) -> float:
    return math.inf if m == "inf" else float(m)


# ------------------------------------------------------------------------------------ storage
def storage_kind(spec: str) -> str:
    """'sqlite', 'journal' or 'rdb' for a --storage value; ConfigError if not understood."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("--storage: must be a path or URL")
    s = spec.strip()
    low = s.lower()
    if low.startswith("sqlite:///") or low.endswith((".db", ".sqlite", ".sqlite3")):
        return "sqlite"
    if low.startswith("journal:") or low.endswith((".journal", ".log", ".jsonl")):
        return "journal"
    scheme = low.split("://", 1)[0] if "://" in low else ""
    if scheme.split("+")[0] in ("postgresql", "postgres", "mysql", "mariadb", "oracle", "mssql"):
        return "rdb"
    raise ConfigError(f"--storage: cannot tell what {spec!r} is; use a file ending in .db (SQLite), "
                      ".journal (JournalFileBackend, several processes) or an RDB URL "
                      "(postgresql://user@host:port/db, mysql://...)")


def make_storage(spec: str):
    """The optuna storage object for a --storage value (creates parent directories of files)."""
    import optuna
    kind = storage_kind(spec)
    s = spec.strip()
    if kind == "sqlite":
        path = s[len("sqlite:///"):] if s.lower().startswith("sqlite:///") else s
        Path(path).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        file = str(Path(path).expanduser().resolve())
        return optuna.storages.RDBStorage("sqlite:///" + file, engine_kwargs={"creator": lambda: _sqlite_connect(file)})
    if kind == "journal":
        from optuna.storages.journal import JournalFileBackend
        path = s[len("journal:"):] if s.lower().startswith("journal:") else s
        p = Path(path).expanduser().resolve()
        p.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(p)))
    if s.lower().startswith("postgres://"):
        s = "postgresql://" + s[len("postgres://"):]
    try:
        return optuna.storages.RDBStorage(s, heartbeat_interval=None)
    except ImportError as e:
        raise ConfigError(f"--storage {spec}: database driver missing ({e}); for PostgreSQL install "
                          "psycopg2-binary (pip install -e '.[tune]')") from None
    except Exception as e:  # noqa: BLE001 - unreachable server, bad credentials, ...
        raise ConfigError(f"--storage {spec}: cannot open: {str(e).splitlines()[0]}") from None


def _sqlite_connect(file: str):
    """A SQLite connection in WAL mode with synchronous=NORMAL: a killed process never corrupts the
    study or loses a committed trial (only an OS crash can lose the last commits), and a trial costs
    no fsync per attribute (several times faster than the default rollback journal)."""
    import sqlite3
    con = sqlite3.connect(file, timeout=60, check_same_thread=False)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    return con


# ------------------------------------------------------------------------------------ liveness
def process_start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (Linux /proc), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start_ticks: Optional[int] = None) -> bool:
    """True if ``pid`` runs on this host (not a zombie, and, when known, started at ``start_ticks``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat[stat.rindex(")") + 2:].split()[0]
        if state in ("Z", "X"):
            return False
    except (OSError, ValueError):
        return True
    if start_ticks is not None:
        now = process_start_ticks(pid)
        if now is not None and now != start_ticks:
            return False     # the pid was reused by another process
    return True


def _boot() -> Optional[str]:
    """This kernel's boot id and this pid namespace: machines, or containers, that share a hostname
    but not their pids differ here (None where /proc does not tell)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _me() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot": _boot(), "pid": pid, "pid_start": process_start_ticks(pid)}


CLAIM_PREFIX, OWNER = "claim:", "owner"


def _claim_key(me: dict) -> str:
    return f"{CLAIM_PREFIX}{me['host']}:{me['pid']}:{me['pid_start']}"


def claim_trial(study, me: dict):
    """``study.ask()`` with the owner ``me`` recorded so that a kill at any moment leaves no RUNNING
    trial that recovery cannot judge (``ask`` then ``set_user_attr`` did: such an orphan was never
    recovered).

    A new trial is created RUNNING with its owner record (user attribute ``owner``) in one storage
    write. An enqueued (WAITING) trial is first marked with a claim attribute named after the
    claimant, then taken (WAITING -> RUNNING, the storage's atomic test-and-set, as ``ask`` does),
    then given its owner record; a claimant that loses the race withdraws its claim. A trial taken
    by a process killed before writing its owner record is thus judged by its claims, which include
    its owner (``_owners``)."""
    import datetime

    import optuna
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import FrozenTrial, TrialState
    storage, key = study._storage, _claim_key(me)
    cache = getattr(study, "_thread_local", None)       # as ask(): the sampler sees the other
    if cache is not None:                               # workers' latest trials
        cache.cached_all_trials = None
    for w in storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,)):
        try:
            storage.set_trial_user_attr(w._trial_id, key, dict(me))
            if not storage.set_trial_state_values(w._trial_id, state=TrialState.RUNNING):
                storage.set_trial_user_attr(w._trial_id, key, None)   # another worker took it first
                continue
        except UpdateFinishedTrialError:
            continue
        storage.set_trial_user_attr(w._trial_id, OWNER, dict(me))
        for k, v in me.items():
            storage.set_trial_user_attr(w._trial_id, k, v)
        return optuna.Trial(study, w._trial_id)
    template = FrozenTrial(number=-1, state=TrialState.RUNNING, value=None,
                           datetime_start=datetime.datetime.now(), datetime_complete=None, params={},
                           distributions={}, user_attrs={**me, OWNER: dict(me)}, system_attrs={},
                           intermediate_values={}, trial_id=-1)
    return optuna.Trial(study, storage.create_new_trial(study._study_id, template_trial=template))


def _owners(user_attrs: dict) -> list:
    """Who may own a trial, as ``_me`` dicts: its owner record (written in one piece); without one
    (killed between taking an enqueued trial and writing it), every live claim, the owner's among
    them; for studies from before claims, the host and pid attributes."""
    if isinstance(user_attrs.get(OWNER), dict):
        return [user_attrs[OWNER]]
    claims = [v for k, v in user_attrs.items() if k.startswith(CLAIM_PREFIX) and isinstance(v, dict)]
    if claims:
        return claims
    if "pid" in user_attrs:
        return [{"host": user_attrs.get("host"), "pid": user_attrs["pid"], "pid_start": user_attrs.get("pid_start")}]
    return []


def recover_stale_trials(study) -> list:
    """Mark RUNNING trials of dead processes on this host FAIL and re-enqueue their parameters: a
    trial is stale when every process that may own it (``_owners``) ran here (same hostname, boot and
    pid namespace) and is gone. Returns the numbers of the recovered trials."""
    from optuna.trial import TrialState
    host, boot = socket.gethostname(), _boot()

    def here(o):   # (records from before ``boot`` was kept: judged by the hostname alone)
        return o.get("host") == host and o.get("boot", boot) == boot and isinstance(o.get("pid"), int)
    storage = study._storage
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owners = _owners(t.user_attrs)
        if not owners or not all(here(o) for o in owners):
            continue
        if any(process_alive(o["pid"], o.get("pid_start")) for o in owners):
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "fail_reason", STALE)
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=False)
        except Exception:  # noqa: BLE001 - another process recovered it first
            continue
        # an enqueued trial killed before its suggestions holds its parameters as fixed ones only
        params = {**t.system_attrs.get("fixed_params", {}), **t.params}
        if params:
            study.enqueue_trial(config_to_enqueue("", params),
                                user_attrs={"requeued_from": t.number}, skip_if_exists=False)
        out.append(t.number)
    return out


def _counts(t) -> bool:
    from optuna.trial import TrialState
    if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING):
        return True
    return t.state == TrialState.FAIL and t.user_attrs.get("fail_reason") not in (OVER_CAP, STALE, None)


def counted_trials(study) -> int:
    return sum(_counts(t) for t in study.get_trials(deepcopy=False))


# ------------------------------------------------------------------------------------ the objective
class TrainObjective:
    """The train units (traces x tuning loads, scaled as the evaluator scales them) and the batched
    evaluation of k configurations of one row. An index-scheduled bucket study's units are the same
    traces at its bucket's load (``units_of``)."""

    def __init__(self, cfg: TuneConfig, split: Optional[str] = None):
        from .engine.profiles import load_profile
        from .evaluate import BenchConfig
        from .evaluate.cluster import bench_workload

        self.cfg = cfg
        split = split or cfg.train_split
        bc = BenchConfig(**cfg.workload_kwargs(split), profile=cfg.profile,
                         loads=tuple(x for x in cfg.loads if x != NATIVE), native_load=NATIVE in cfg.loads,
                         max_traces=cfg.max_train_traces, **{"upper_bound": False, **cfg.bench_cluster()})
        self.bench_config = bc
        self.profile = bc.engine.resolve(load_profile(cfg.profile))
        self.wl = bench_workload(bc, self.profile)   # (in cluster mode: the load and windows of R replicas)
        #: the tuning loads as rho values (``native``: the trace's own rate, ``Workload.native_rho``)
        self.loads = tuple(self.wl.native_rho if x == NATIVE else x for x in cfg.loads)
        est = self.wl.estimates()
        self.units, self.est, self.scored = [], [], []
        for rho in self.loads:
            self.units += self.wl.at(rho)
            self.est += est
            self.scored += self.wl.scored   # (a trace window's warm-up and cool-down are not scored)
        self._by_load = {}
        self.threads = cfg.engine_threads()
        self.evidence_inputs = {
            "purpose": "tuning objective: mean goodput over (trace, load) units",
            "workload": {"name": self.wl.name, "split": split, "trace_digests": self.wl.digests,
                         **({} if cfg.trace is None else {"windows": [list(w) for w in self.wl.windows],
                                                          "rate_scale": cfg.rate_scale, "scored": "window"})},
            "loads": list(self.loads), "lambda_sat_rps": self.wl.lambda_sat,
            "engine_config": bc.engine.to_dict(), "profile": {"name": self.profile.name,
                                                              "profile": self.profile.to_dict()},
            "predictor": self.wl.predictor.to_dict(), "t_ref_ms": self.wl.t_ref_ms,
            "residual_life_sha256": hashlib.sha256(np.ascontiguousarray(self.wl.residual_life).tobytes()).hexdigest(),
            **({"cluster": {"replicas": cfg.replicas, "metrics_staleness_ms": cfg.metrics_staleness_ms}}
               if cfg.cluster else {}),
        }
        from . import __version__
        self.evidence_inputs["package_version"] = __version__

    @property
    def n_units(self) -> int:
        return len(self.units)

    def deployment(self) -> dict:
        """The ``meta`` of the parameters tuned here (``params.deployment_of``): T_ref fixed at the
        train workload's, the profile, the predictor and what was fitted to the train part."""
        from .params import deployment_of
        e = self.evidence_inputs
        return deployment_of(self.profile, self.wl.predictor, self.wl.t_ref_ms,
                             fitted={"from": e["workload"].get("split"), "lambda_sat_rps": self.wl.lambda_sat,
                                     "lambda_sat_source": self.wl.lambda_sat_source,
                                     "admitted_share": self.wl.admitted_share, "t_ref_ms": self.wl.t_ref_ms,
                                     "residual_life_sha256": e["residual_life_sha256"]})

    def units_of(self, row: str) -> tuple:
        """(units, estimates, scored masks) of a row's objective: the tuning units, or for a bucket
        study the train traces at its bucket's load (built once)."""
        if not row.startswith(BUCKET_PREFIX):
            return self.units, self.est, self.scored
        rho = self.cfg.bucket_rows[row]
        if rho not in self._by_load:
            self._by_load[rho] = (self.wl.at(rho), self.wl.estimates(), self.wl.scored)
        return self._by_load[rho]

    def evidence_id(self, row: str, config: dict) -> str:
        inputs = {**self.evidence_inputs, "row": row, "config": config}
        if row.startswith(BUCKET_PREFIX):
            inputs["loads"] = list(self.cfg.loads_of(row))
        return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()

    def _run(self, row: str, configs: list, idx: np.ndarray) -> np.ndarray:
        """Goodput [k, len(idx)] of the configs on units ``idx`` (threads split the units)."""
        parts = [p for p in np.array_split(idx, min(self.threads, len(idx))) if len(p)]
        if len(parts) == 1:
            return self._run_part(row, configs, parts[0])
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(parts)) as ex:
            res = list(ex.map(lambda p: self._run_part(row, configs, p), parts))
        return np.concatenate(res, axis=1)

    def _run_part(self, row: str, configs: list, idx) -> np.ndarray:
        units, est, scored = self.units_of(row)
        traces = [units[i] for i in idx]
        est = [est[i] for i in idx]
        scored = [scored[i] for i in idx]
        if self.cfg.cluster:
            return self._run_cluster(row, configs, traces, est, scored)
        wl, prof, eng = self.wl, self.profile, self.bench_config.engine
        kind = row_kind(row)
        row = row.removesuffix(GUARD_SUFFIX)   # (a +tpot-guard row: the rule is in its levers)
        # each config's levers (docs/design.md section 11): the k configs' copies in one batch
        engines = None
        if any("engine" in c for c in configs):
            from .engine.levers import with_levers
            engines = [with_levers(eng, c.get("engine")) for c in configs]
        from .evaluate import evaluate_param_vectors
        if kind in ("margin", "flags"):
            policy = row[:-len(FLAGS_SUFFIX)] if kind == "flags" else row[:-len("+shed")]
            margins = [None] * len(configs) if kind == "flags" else [_margin_value(c["shed_margin"]) for c in configs]
            return evaluate_param_vectors(traces, prof, policy, None, shed_margins=margins, estimates=est,
                                          residual_life=wl.residual_life, t_ref_ms=wl.t_ref_ms, config=eng,
                                          configs=engines, scored=scored)
        from .policies import IndexParams, LinearWeights
        if kind == "index":
            policy, thetas = "index", [IndexParams.from_dict(c["index"]).theta_vector(wl.t_ref_ms) for c in configs]
        else:
            policy, thetas = "weights", [LinearWeights(c["weights"]).theta_vector(wl.t_ref_ms) for c in configs]
        return evaluate_param_vectors(traces, prof, policy, np.stack(thetas),
                                      shed_margins=[_margin_value(c["shed_margin"]) for c in configs],
                                      estimates=est, residual_life=wl.residual_life, t_ref_ms=wl.t_ref_ms,
                                      config=eng, configs=engines, scored=scored)

    def _run_cluster(self, row: str, configs: list, traces: list, est: list, scored: list) -> np.ndarray:
        """Goodput [k, units] of a cluster row's configs: each (config, unit) one cluster replay
        (``engine.cluster.simulate_cluster``) of ``replicas`` replicas behind the row's router with
        the config's parameters, every replica at the config's levers (a +tpot-guard row: its u and
        B_min), as the benchmark runs the row (``evaluate.rows.run_cluster_row``)."""
        from .engine.cluster import Router, simulate_cluster
        from .engine.levers import with_levers
        from .policies import IndexParams, engine_policy
        router, plain = split_routed(row)
        kind, guard_row = row_kind(row), plain.endswith(GUARD_SUFFIX)
        plain = plain.removesuffix(GUARD_SUFFIX)
        wl, cfg = self.wl, self.cfg
        out = np.empty((len(configs), len(traces)))
        for j, c in enumerate(configs):
            if kind == "index":
                pol = engine_policy("index", params=IndexParams.from_dict(c["index"]),
                                    shed_margin=_margin_value(c["shed_margin"]), t_ref_ms=wl.t_ref_ms)
            elif kind == "flags":
                pol = engine_policy(plain[:-len(FLAGS_SUFFIX)], t_ref_ms=wl.t_ref_ms)
            else:
                pol = engine_policy(plain.removesuffix("+shed"), shed_margin=_margin_value(c["shed_margin"]),
                                    t_ref_ms=wl.t_ref_ms)
            lv = c.get("engine") or {}
            eng = with_levers(self.bench_config.engine, lv)
            guard = (lv.get("budget_u", 0.0), lv.get("budget_bmin", 0.0)) if guard_row else None
            rt = Router(router, **c.get("router", {}))
            for i, t in enumerate(traces):
                met = simulate_cluster(t, self.profile, pol, eng, replicas=cfg.replicas, router=rt,
                                       staleness_ms=cfg.metrics_staleness_ms, estimates=est[i],
                                       residual_life=wl.residual_life, guard=guard).records()["met"]
                met = met[np.asarray(scored[i], bool)]
                out[j, i] = met.mean() if met.size else float("nan")
        return out

    def goodput_per_unit(self, row: str, configs: list, idx=None) -> np.ndarray:
        """Goodput [k, units] of the configs on every unit of the row's objective (or on the units
        ``idx``)."""
        return self._run(row, configs, np.arange(len(self.units_of(row)[0])) if idx is None
                         else np.asarray(idx, np.int64))

    def evaluate(self, row: str, configs: list, report=None) -> np.ndarray:
        """Mean goodput per config. With ``report(j, step, value) -> bool`` (True = prune), the units
        run in 4 quarters and pruned configs leave the remaining ones (their value: NaN)."""
        k, U = len(configs), len(self.units_of(row)[0])
        if report is None:
            return self.goodput_per_unit(row, configs).mean(axis=1)
        sums, seen = np.zeros(k), 0
        live = list(range(k))
        out = np.full(k, np.nan)
        for step, q in enumerate(np.array_split(np.arange(U), min(QUARTERS, U))):
            g = self._run(row, [configs[j] for j in live], q)
            seen += len(q)
            keep = []
            for r, j in enumerate(live):
                sums[j] += g[r].sum()
                if step < QUARTERS - 1 and seen < U and report(j, step, sums[j] / seen):
                    continue
                keep.append(j)
            live = keep
            if not live:
                break
        for j in live:
            out[j] = sums[j] / U
        return out


# ------------------------------------------------------------------------------------ studies
def make_sampler(cfg: TuneConfig, row_index: int, worker: int = 0):
    import optuna
    # one stream per study and worker process (workers must not draw the same points)
    seed = cfg.seed + 1000 * row_index + 1_000_003 * worker
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if cfg.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401
        except ImportError:
            raise ConfigError("--sampler cmaes needs the cmaes package (pip install cmaes, or the "
                              "[tune] extra)") from None
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False,
                                            independent_sampler=optuna.samplers.RandomSampler(seed=seed))
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(cfg: TuneConfig):
    import optuna
    if cfg.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=max(5, cfg.k), n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def open_studies(cfg: TuneConfig, storage=None, *, write_attrs: bool = True, worker: int = 0) -> dict:
    """row -> optuna Study (created if absent). A study that exists with a different objective
    is refused (ConfigError): pick another --study-name."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage if storage is not None else make_storage(cfg.storage_url)
    out = {}
    for i, row in enumerate(cfg.rows):
        st = optuna.create_study(study_name=cfg.study_name_of(row), storage=storage, direction="maximize",
                                 sampler=make_sampler(cfg, i, worker), pruner=make_pruner(cfg), load_if_exists=True)
        old = st.user_attrs.get("objective")
        new = cfg.objective_dict(row)
        if old is not None and old != new:
            diff = ", ".join(f"{k} {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted({*old, *new})
                             if old.get(k) != new.get(k))
            hint = (" (one was made with --no-levers and one without: give the same)"
                    if ("levers" in old) != ("levers" in new) else "")
            raise ConfigError(f"study {st.study_name!r} in {cfg.storage_url} was created for another "
                              f"objective ({diff}){hint}; use another --study-name or --storage")
        if write_attrs:
            trials = st.get_trials(deepcopy=False)
            # a new study (or one holding only warm starts, resumed with a larger cap) gets the warm
            # starts that fit in its cap, so a small budget grown later runs them all, in order
            if cfg.warm_start and all(t.user_attrs.get("warm_start") for t in trials):
                for ws in warm_starts(row, cfg.lever_space(row))[len(trials):cfg.trials_of(row)]:
                    st.enqueue_trial(ws, user_attrs={"warm_start": True})
            st.set_user_attr("objective", cfg.objective_dict(row))
            st.set_user_attr("row", row)
            st.set_user_attr("config", cfg.to_dict())
        out[row] = st
    return out


@dataclasses.dataclass
class _Batch:
    trials: list
    configs: list


def _ask_batch(study, row: str, cfg: TuneConfig, me: dict, objective: TrainObjective) -> Optional[_Batch]:
    """Ask up to k trials within the global cap (exact under races: see module docstring)."""
    from optuna.trial import TrialState
    cap = cfg.trials_of(row)
    left = cap - counted_trials(study)
    if left <= 0:
        return None
    trials, configs = [], []
    for _ in range(min(cfg.k, left)):   # other workers may take some of ``left`` meanwhile: see below
        t = claim_trial(study, me)
        # rank of this trial among the counted ones (by number): beyond the cap -> never evaluated
        rank = sum(1 for ft in study.get_trials(deepcopy=False)
                   if _counts(ft) and ft.number <= t.number)
        if rank > cap:
            t.set_user_attr("fail_reason", OVER_CAP)
            study.tell(t, state=TrialState.FAIL)
            break
        c = suggest_config(row, t, cfg.lever_space(row))
        t.set_user_attr("config", c)
        t.set_user_attr("evidence_id", objective.evidence_id(row, c))
        trials.append(t)
        configs.append(c)
    return _Batch(trials, configs) if trials else None


def _run_batch(study, row: str, batch: _Batch, objective: TrainObjective, cfg: TuneConfig) -> None:
    from optuna.trial import TrialState
    pruned = set()

    def report(j, step, value):
        t = batch.trials[j]
        t.report(float(value), step)
        if t.should_prune():
            pruned.add(j)
            return True
        return False

    try:
        vals = objective.evaluate(row, batch.configs, report if cfg.pruner != "none" else None)
    except Exception as e:  # noqa: BLE001 - a failed trial is never fatal
        msg = f"{type(e).__name__}: {e}"[:500]
        for t in batch.trials:
            t.set_user_attr("fail_reason", "exception")
            t.set_user_attr("error", msg)
            study.tell(t, state=TrialState.FAIL)
        print(f"warning: {row}: trials {[t.number for t in batch.trials]} failed: {msg}", file=sys.stderr)
        return
    for j, t in enumerate(batch.trials):
        if j in pruned:
            study.tell(t, state=TrialState.PRUNED)
        elif not math.isfinite(vals[j]):
            t.set_user_attr("fail_reason", "nan")
            study.tell(t, state=TrialState.FAIL)
        else:
            study.tell(t, float(vals[j]))


def _postfix(studies: dict) -> str:
    """Best values so far, short enough for one terminal line (index@rho1.2 -> @1.2, no +shed, fcfs
    (tuned vLLM flags) -> fcfs/flags)."""
    def short(r):
        if r.startswith(BUCKET_PREFIX):
            return "@" + r[len(BUCKET_PREFIX):]
        return r.replace(FLAGS_SUFFIX, "/flags").replace("+shed", "")
    return " ".join(f"{short(r)}={_best(s):.4f}" for r, s in studies.items() if _best(s) is not None)


def _best(study) -> Optional[float]:
    try:
        return study.best_value
    except ValueError:
        return None


def optimize(cfg: TuneConfig, *, bar=None, deadline: Optional[float] = None, storage=None,
             objective: Optional["TrainObjective"] = None, worker: int = 0) -> None:
    """One process's search loop: the studies take turns, one batch of up to k trials each, until
    every study reached the cap (or the deadline passed)."""
    studies = open_studies(cfg, storage, write_attrs=False, worker=worker)
    objective = objective if objective is not None else TrainObjective(cfg)
    me = _me()
    done = {row: False for row in cfg.rows}
    while not all(done.values()):
        if deadline is not None and time.time() >= deadline:
            break
        for row, st in studies.items():
            if done[row]:
                continue
            b = _ask_batch(st, row, cfg, me, objective)
            if b is None:
                done[row] = True
                continue
            _run_batch(st, row, b, objective, cfg)
            if bar is not None:
                bar.update(len(b.trials))
                bar.set_postfix_str(_postfix(studies))


def _worker_main(cfg: TuneConfig, deadline: Optional[float], worker: int) -> None:  # a spawned process
    import warnings
    warnings.filterwarnings("ignore")
    optimize(dataclasses.replace(cfg, progress=False), deadline=deadline, worker=worker)


def resumed_trials(studies: dict) -> int:
    """Trials the studies held before this run (any state but WAITING: the warm starts a new study
    was just given are not a resumption)."""
    from optuna.trial import TrialState
    return sum(1 for st in studies.values() for t in st.get_trials(deepcopy=False) if t.state != TrialState.WAITING)


def run_search(cfg: TuneConfig, objective: Optional["TrainObjective"] = None) -> dict:
    """Recover stale trials, then search (in this process, or in ``workers`` processes). Returns
    {"recovered": {row: [numbers]}, "search_wall_s": ...}."""
    from tqdm.auto import tqdm

    t0 = time.time()
    storage = make_storage(cfg.storage_url)
    studies = open_studies(cfg, storage)
    resumed = resumed_trials(studies)
    if resumed:
        print(f"resuming {resumed} trials of study {cfg.name} in {cfg.storage_url}: a resumed study may end with "
              "other numbers than an uninterrupted one (byte-identical results hold for an uninterrupted "
              "one-worker study with a fixed seed)", file=sys.stderr)
    recovered = {row: recover_stale_trials(st) for row, st in studies.items()}
    for row, nums in recovered.items():
        if nums:
            print(f"{row}: {len(nums)} stale RUNNING trial(s) of dead processes marked FAIL and "
                  f"re-enqueued: {nums}", file=sys.stderr)
    deadline = None if cfg.timeout is None else t0 + cfg.timeout
    total = sum(cfg.trials_of(row) for row in cfg.rows)
    already = sum(min(cfg.trials_of(row), counted_trials(st)) for row, st in studies.items())
    bar = tqdm(total=total, initial=already, desc="tuning trials", unit="trial", disable=not cfg.progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        if cfg.workers == 1:
            optimize(cfg, bar=bar, deadline=deadline, storage=storage, objective=objective)
        else:
            import multiprocessing as mp
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_worker_main, args=(cfg, deadline, i + 1), name=f"tune-worker-{i}")
                     for i in range(cfg.workers)]
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):
                time.sleep(0.5)
                n = sum(min(cfg.trials_of(row), sum(1 for t in st.get_trials(deepcopy=False)
                                                    if t.state.is_finished() and _counts(t)))
                        for row, st in studies.items())
                bar.update(max(0, n - bar.n))
                bar.set_postfix_str(_postfix(studies))
            bad = [p.exitcode for p in procs if p.exitcode != 0]
            if bad:
                raise TokenBatchError(f"{len(bad)} of {cfg.workers} worker processes failed (exit codes {bad})")
    finally:
        bar.close()
    return {"recovered": recovered, "search_wall_s": time.time() - t0}


# ------------------------------------------------------------------------------------ results
def study_summary(study, row: str) -> dict:
    from optuna.trial import TrialState
    trials = study.get_trials(deepcopy=False)
    by_state = {}
    for t in trials:
        key = t.state.name
        if t.state == TrialState.FAIL and t.user_attrs.get("fail_reason"):
            key = f"FAIL ({t.user_attrs['fail_reason']})"
        by_state[key] = by_state.get(key, 0) + 1
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: (t.value, -t.number)) if complete else None
    hist = [{"number": t.number, "value": t.value, "config": t.user_attrs.get("config")} for t in complete]
    return {"row": row, "study": study.study_name, "trials": len(trials), "states": dict(sorted(by_state.items())),
            "best": None if best is None else {"number": best.number, "train_goodput": best.value,
                                                "config": best.user_attrs.get("config"),
                                                "evidence_id": best.user_attrs.get("evidence_id")},
            "history": sorted(hist, key=lambda h: h["number"])}


def keep_best_on_validation(study, summary: dict, validation: "TrainObjective", top: int) -> dict:
    """``summary`` with its best trial chosen on validation (docs/design.md section 10, tuning on a
    trace): the ``top`` trials with the best train goodput and the warm starts, replayed on the
    validation windows. The best warm start (the family's named members: SJF, EDF, the defaults, at
    the profile's flags) is kept unless another candidate beats it on validation with a paired 95%
    CI above 0 (moving-block bootstrap over the windows, the evaluator's); then the best of those is
    kept (ties: the better train goodput, then the earlier trial). A gain within the noise of a few
    windows does not displace a named member."""
    from optuna.trial import TrialState

    from .metrics import paired_difference
    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE
            and t.user_attrs.get("config") is not None]
    if not done:
        return summary
    cands = sorted(done, key=lambda t: (-t.value, t.number))[:top]
    cands += [t for t in sorted(done, key=lambda t: t.number) if t.user_attrs.get("warm_start") and t not in cands]
    per_unit = validation.goodput_per_unit(summary["row"], [t.user_attrs["config"] for t in cands])
    W = len(validation.wl.units)
    if per_unit.shape[1] > W and per_unit.shape[1] % W == 0:   # several loads: one value per window
        per_unit = per_unit.reshape(len(cands), -1, W).mean(axis=1)
    val = per_unit.mean(axis=1)
    order = lambda j: (val[j], cands[j].value, -cands[j].number)  # noqa: E731
    # the protected named members: the warm starts at the profile's flags (not the quarter-budget one)
    cfg = validation.cfg
    space = cfg.lever_space(summary["row"])
    ref = None if space is None else {k: v[2] for k, v in space.items()}
    warm = [j for j, t in enumerate(cands) if t.user_attrs.get("warm_start")
            and t.user_attrs["config"].get("engine", ref) == ref]
    gains = {}
    if warm:
        w = max(warm, key=order)
        for j in range(len(cands)):
            if j not in warm:
                gains[j] = paired_difference(per_unit[j], per_unit[w], B=cfg.bootstrap_b, seed=cfg.seed,
                                             block=validation.wl.block)
        better = [j for j, g in gains.items() if g[1] > 0]
        best = max(better, key=order) if better else w
    else:
        best = max(range(len(cands)), key=order)
    t = cands[best]
    return {**summary, "best": {"number": t.number, "train_goodput": t.value, "config": t.user_attrs["config"],
                                "evidence_id": t.user_attrs.get("evidence_id"),
                                "validation_goodput": float(val[best])},
            "validation": {"rule": "the best named member (a warm start at the profile's flags) unless a candidate "
                                   "beats it with a paired 95% CI above 0",
                           "candidates": [{"number": c.number, "train_goodput": c.value,
                                           "validation_goodput": float(v),
                                           "warm_start": bool(c.user_attrs.get("warm_start")),
                                           "named_member": bool(j in warm),
                                           **({"vs_best_warm_start": {"diff": gains[j][0],
                                                                      "ci95": [gains[j][1], gains[j][2]]}}
                                              if j in gains else {})}
                                          for j, (c, v) in enumerate(zip(cands, val))]}}


def params_document(cfg: TuneConfig, summaries: dict, objective_eid: str, t_ref_ms: float,
                    deployment: Optional[dict] = None) -> dict:
    """The best parameters in the ``--params`` format that ``params.load_params_file`` reads
    (with comparators also ``"weights": {"w": {feature: w}, "shed_margin": m}``, read by
    ``params.load_weights``, and ``"index-scheduled": IndexSchedule.to_dict()``, read by
    ``params.load_schedule``). ``deployment``: the ``meta`` of the deployment tuned on
    (``params.deployment_of``; T_ref fixed)."""
    if cfg.cluster:
        return _cluster_params_document(cfg, summaries, objective_eid, t_ref_ms, deployment)
    from .params import SCHEDULE_KEY
    from .policies import IndexParams, IndexSchedule, LinearWeights
    idx = summaries[INDEX_ROW]["best"]
    if idx is None:
        raise TokenBatchError(f"study {summaries[INDEX_ROW]['study']!r} has no completed trial: nothing to "
                              "write (see the FAIL reasons in the study's user attributes)")
    doc = {"index": dict(idx["config"]["index"]), "shed_margin": idx["config"]["shed_margin"]}
    notes = {}
    for b in cfg.baselines:
        best = summaries[f"{b}+shed"]["best"]
        if best is None:
            notes[b] = "no completed trial: shed margin left at the default 0.0"
            continue
        doc[b] = {"shed_margin": best["config"]["shed_margin"]}
    if cfg.budget_rule == "tpot-guard":   # the +tpot-guard rows' own parameters (their u and B_min: levers)
        from .params import GUARD_KEY
        guard = {}
        best = summaries[INDEX_ROW + GUARD_SUFFIX]["best"]
        if best is None:
            notes[INDEX_ROW + GUARD_SUFFIX] = "no completed trial: the rule's index rows use index+shed's parameters"
        else:
            guard.update(index=dict(best["config"]["index"]), shed_margin=best["config"]["shed_margin"])
        for b in cfg.baselines:
            best = summaries[f"{b}+shed{GUARD_SUFFIX}"]["best"]
            if best is not None:
                guard[b] = {"shed_margin": best["config"]["shed_margin"]}
        doc[GUARD_KEY] = guard
    if cfg.comparators:
        best = summaries[WEIGHTS_ROW]["best"]
        if best is None:
            notes["weights"] = "no completed trial: weights left at the default (SJF's direction), margin 0.0"
        else:
            doc["weights"] = {**LinearWeights(best["config"]["weights"]).to_dict(),
                              "shed_margin": best["config"]["shed_margin"]}
        params, margins = [], []
        for row in cfg.bucket_rows:
            best = summaries[row]["best"]
            if best is None:
                notes[row] = "no completed trial: this bucket uses the index+shed study's best"
                best = idx
            params.append(IndexParams.from_dict(best["config"]["index"]))
            margins.append(_margin_value(best["config"]["shed_margin"]))
        doc[SCHEDULE_KEY] = IndexSchedule.from_loads(list(cfg.bucket_rows.values()), params, margins).to_dict()
    from .params import LEVERS_KEY
    levers = {row: dict(s["best"]["config"]["engine"]) for row, s in summaries.items()
              if s["best"] is not None and "engine" in (s["best"]["config"] or {})}
    for row in cfg.rows:
        if row in FLAGS_ROWS and row not in levers:
            notes[row] = "no completed trial: not on the test leaderboard"
    if levers:
        doc[LEVERS_KEY] = levers
    doc["tuned"] = {
        "by": "tuning/optuna_search.py", "suite": cfg.suite if cfg.trace is None else None,
        **({} if cfg.trace is None else {"trace": str(Path(cfg.trace).resolve()), "windows": cfg.windows,
                                         "selected_on": "validation", "val_top": cfg.val_top,
                                         "rate_scale": cfg.rate_scale}),
        "split": cfg.train_split,
        "profile": cfg.profile, "loads": list(cfg.loads), "max_train_traces": cfg.max_train_traces,
        "trials_per_study": cfg.trials, "k": cfg.k, "sampler": cfg.sampler, "seed": cfg.seed,
        **({"comparators": {"weights+shed": {"trials": cfg.trials},
                            "index-scheduled": {"bucket_loads": list(cfg.bucket_rows.values()),
                                                "trials_per_bucket_study": cfg.bucket_trials}}}
           if cfg.comparators else {}),
        "study": cfg.name, "objective_evidence_id": objective_eid,
        "train_goodput": {row: (s["best"] or {}).get("train_goodput") for row, s in summaries.items()},
        "best_trial": {row: (s["best"] or {}).get("number") for row, s in summaries.items()},
        **({"notes": notes} if notes else {}),
    }
    # what the vLLM plug-in reads beside the parameters (docs/vllm_plugin.md): the index's T_ref and
    # the profile pricing the work, as tuned (without them it ran T_ref 1000 ms, llama2-7b-a100)
    from .engine.profiles import is_profile_file
    profile = cfg.profile   # a profile file by its absolute path: the plug-in runs from anywhere
    if is_profile_file(profile):
        profile = str(Path(profile).resolve())
    doc["meta"] = {**deployment, "profile": profile} if deployment else {"t_ref_ms": float(t_ref_ms),
                                                                          "profile": profile}
    return doc


def _cluster_params_document(cfg: TuneConfig, summaries: dict, objective_eid: str, t_ref_ms: float,
                             deployment: Optional[dict]) -> dict:
    """``params_document`` of a cluster tuning (``cfg.replicas`` > 1): the top level is the first
    router's rows' (a file every reader loads), and ``"cluster"`` (``params.CLUSTER_KEY``) holds every
    routed row's own best: index parameters, shed margin, levers and router parameters."""
    from .params import CLUSTER_KEY
    first = cfg.routers[0] + ROUTED
    one = dataclasses.replace(cfg, replicas=1, routers=None, metrics_staleness_ms=0.0)
    doc = params_document(one, {r[len(first):]: s for r, s in summaries.items() if r.startswith(first)},
                          objective_eid, t_ref_ms, deployment)
    rows, notes = {}, {}
    for row, s in summaries.items():
        best = s["best"]
        if best is None:
            notes[row] = "no completed trial: the row runs with the top level's parameters"
            continue
        c = best["config"]
        rows[row] = {**({"index": dict(c["index"])} if "index" in c else {}),
                     **({"shed_margin": c["shed_margin"]} if "shed_margin" in c else {}),
                     **({"levers": dict(c["engine"])} if c.get("engine") else {}),
                     **({"router": dict(c["router"])} if c.get("router") else {})}
    doc[CLUSTER_KEY] = {"replicas": cfg.replicas, "routers": list(cfg.routers),
                        "metrics_staleness_ms": cfg.metrics_staleness_ms, "rows": rows}
    tuned = doc["tuned"]
    tuned.update(study=cfg.name,
                 train_goodput={r: (s["best"] or {}).get("train_goodput") for r, s in summaries.items()},
                 best_trial={r: (s["best"] or {}).get("number") for r, s in summaries.items()},
                 top_level=f"the rows behind {cfg.routers[0]}")
    if notes:
        tuned["notes"] = {**tuned.get("notes", {}), **notes}
    return doc


def plot_history(summaries: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for row, s in summaries.items():
        h = s["history"]
        if not h:
            continue
        x = [e["number"] for e in h]
        y = [e["value"] for e in h]
        (ln,) = ax.plot(x, y, ".", ms=3, alpha=0.5)
        ax.plot(x, np.maximum.accumulate(y), "--" if row.startswith(BUCKET_PREFIX) else "-",
                color=ln.get_color(), label=f"{row} (best so far)")
    ax.set_xlabel("trial number")
    ax.set_ylabel("mean goodput on the train split (index@rho<x>: at load x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("optimisation history")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def tuning_markdown(data: dict, bench_md: str) -> str:
    cfg = data["config"]
    L = [f"# TokenBatch tuning: {cfg['suite']} / {cfg['profile']}", ""]
    L += ["## Held-out result", ""]
    from .report import primary_lines
    pl = primary_lines(data["test"])
    L += [f"    {x}" for x in pl] if pl else [
        "No primary endpoint on this workload (the pre-registered one is seed-200's): the held-out leaderboard "
        "is the test-split benchmark's, below."]
    L += [""]
    L += ["## Search", "",
          f"- objective: mean goodput on {cfg['suite']}/{cfg['train_split']} "
          f"({data['train_units']} units = traces x loads {cfg['loads']}); the {cfg['test_split']} "
          "split is never seen by the search",
          f"- budget: {cfg['trials']} trials per study, k = {cfg['k']} trials per engine run, sampler "
          f"{cfg['sampler']} (seed {cfg['seed']}), pruner {cfg['pruner']}",
          "- the baselines' shed margins get the same budget; aging is not implemented (no aging baseline)",
          *lever_lines(cfg), *guard_lines(cfg),
          *comparator_lines(cfg, data.get("index_scheduled_in_test", False)),
          f"- objective evidence id `{data['objective_evidence_id']}`", ""]
    L += ["| row | study | trials (by state) | best trial | train goodput | best config |", "|---|---|---|---|---|---|"]
    for row, s in data["studies"].items():
        b = s["best"] or {}
        st = ", ".join(f"{k} {v}" for k, v in s["states"].items())
        conf = json.dumps(b.get("config"), sort_keys=True) if b else "-"
        tg = f"{b['train_goodput']:.4f}" if b else "-"
        L.append(f"| {row} | {s['study']} | {st} | {b.get('number', '-')} | {tg} | `{conf}` |")
    L += ["", "![optimisation history](optimization_history.png)", "",
          "![goodput vs load on the test split](test/goodput_vs_load.png)", "",
          "## Test-split benchmark (the evaluator's report)", ""]
    body = bench_md.split("\n", 1)[1] if bench_md.startswith("# ") else bench_md
    L += [body.replace("\n## ", "\n### ")]
    L += ["", f"Tuning evidence id `{data['evidence_id']}`. Wall times, host and date are in run_meta.json.", ""]
    return "\n".join(L)


def lever_lines(cfg: dict) -> list:
    """The report's line on the iteration-size levers (docs/design.md section 11)."""
    if not cfg.get("levers", False):
        return ["- levers: not tuned (--no-levers): every row at the profile's flags"]
    return ["- levers: every row but the index-scheduled buckets also tunes vLLM's max_num_batched_tokens, "
            "max_num_seqs and long_prefill_token_threshold (log-uniform, up to the profile's B_max and "
            "max_num_seqs; load and SLOs stay at the profile's flags), with the same trial budget; "
            f"{' and '.join(FLAGS_ROWS)} tune only the flags. The test report runs each levered row beside "
            "itself at the profile's flags (a +tpot-guard row: beside the row without the rule)"]


def guard_lines(cfg: dict) -> list:
    """The report's line on the tpot-guard budget rule (docs/design.md section 11)."""
    if cfg.get("budget_rule", "none") == "none":
        return []
    return [f"- tpot-guard: the index's and each baseline's +shed row have a {GUARD_SUFFIX} twin tuned with the "
            "rule's u in [-0.5, 2] and B_min in [0, 1] beside their other parameters, with the same trial budget "
            "(warm starts: the row's at the rule's defaults u 0, B_min 0, and one with B_min 1, the rule off). The "
            f"test report runs every row also with the rule (rows without tuned values at u 0, B_min 0)"]


def comparator_lines(cfg: dict, in_test: bool) -> list:
    """The report's lines on the docs/design.md section 8 comparators (``cfg``: ``TuneConfig.to_dict()``;
    ``in_test``: the test report has the index-scheduled row)."""
    if not cfg.get("comparators"):
        why = "the suite protocol's: off when tuning on a trace" if cfg.get("trace") else "--no-comparators"
        return [f"- comparators (weights+shed, index-scheduled): not tuned ({why})"]
    loads, n = cfg["eval_loads"], cfg["trials"]
    per = -(-n // len(loads))
    return [f"- weights-static (row weights+shed): 8 weights in [-1, 1] and the shed margin, {n} trials "
            "(warm starts: the directions of SJF, EDF and LLF at margin 0)",
            f"- index-scheduled: one index+shed study per load bucket, tuned at the test loads "
            f"{', '.join(f'{x:g}' for x in loads)} on the same train traces, ceil({n} / {len(loads)}) = {per} "
            f"trials each ({per * len(loads)} in all: the index study's budget of {n}); "
            + ("its test row picks the bucket at each decision epoch from the observed arrival rate"
               if in_test else "written to best_params.json; this evaluator has no index-scheduled row yet")]


def test_policies(cfg: TuneConfig) -> tuple:
    """The policies of the test report (each with a +shed row; rows with tuned levers add their own)."""
    pols = ("fcfs", "sjf", "edf", "llf", "index")
    pols += tuple(b for b in cfg.baselines if b not in pols)
    return pols + (("weights",) if cfg.comparators else ())


def run_tuning(cfg: TuneConfig) -> dict:
    """Search, then evaluate the best parameters on the held-out test split and write everything
    into ``cfg.out``. Returns {"paths": [...], "data": report dict, "meta": {...}, "summary": text}."""
    import platform
    from datetime import datetime, timezone

    from . import __version__
    from ._io import check_writable, write_text_atomic, write_with
    from .evaluate import BenchConfig, run_benchmark
    from .evaluate.config import guard_fields
    from .params import load_levers, load_params_file, load_schedule, load_weights
    from .report import report_json

    t0 = time.time()
    out = Path(cfg.out)
    check_writable(out, "out:", directory=True)
    # the train/test splits exist and differ: checked before any work (and before ``out`` is made)
    if cfg.trace is None:
        from .traces.suites import load_suite
        suite = load_suite(cfg.suite)
        for s in (cfg.train_split, cfg.test_split):
            if s not in suite.splits:
                raise ConfigError(f"suite {cfg.suite!r} has no split {s!r}; splits: {', '.join(suite.splits)}")
    elif (cfg.train_split, cfg.test_split) != ("train", "test"):
        raise ConfigError("train_split / test_split: a trace file's splits are train, validation and test by time")
    objective = TrainObjective(cfg)   # also validates the profile and suite (or trace: its splits' windows)
    validation = TrainObjective(cfg, "validation") if cfg.trace is not None else None
    if cfg.agents:   # each agent's env and model load now, not after the search (ConfigError if not)
        from .agents.load import agent_labels, agent_spec, agent_warnings
        for a, label in zip(cfg.agents, agent_labels(cfg.agents)):
            spec = agent_spec(a, option="agents:")
            spec.make(objective.wl.t_ref_ms)
            for w in agent_warnings(json.loads(dict(spec.evidence)["env"]), label, cfg.suite, cfg.test_split,
                                    cfg.profile):
                print(f"warning: {w}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    obj_eid = hashlib.sha256(canonical_json(objective.evidence_inputs).encode()).hexdigest()
    search = run_search(cfg, objective)
    studies = open_studies(cfg, write_attrs=False)
    summaries = {row: study_summary(st, row) for row, st in studies.items()}
    if validation is not None:
        summaries = {row: keep_best_on_validation(st, summaries[row], validation, cfg.val_top)
                     for row, st in studies.items()}

    doc = params_document(cfg, summaries, obj_eid, objective.wl.t_ref_ms, objective.deployment())
    params_path = out / "best_params.json"
    write_text_atomic(params_path, json.dumps(doc, indent=1) + "\n")
    params, margins = load_params_file(str(params_path))   # the evaluator's reader: must load

    t1 = time.time()
    pols = test_policies(cfg)
    extra = {}
    if cfg.comparators:
        extra["weights"] = load_weights(str(params_path))
        extra["schedule"] = load_schedule(str(params_path))
    # tuned with the rule: every row also with it, the tuned ones with their own parameters
    extra.update(guard_fields(str(params_path)))
    if cfg.agents:
        from .agents.load import agent_labels, agent_spec
        extra["controllers"] = tuple(agent_spec(a, label=lab, option="agents:")
                                     for a, lab in zip(cfg.agents, agent_labels(cfg.agents)))
    if cfg.cluster:   # every routed row with its own tuned values (docs/design.md section 12)
        from .params import load_routed
        extra.update(cfg.bench_cluster(), routed=load_routed(str(params_path))["routed"])
    bench = run_benchmark(BenchConfig(
        **cfg.workload_kwargs(cfg.test_split), profile=cfg.profile, policies=pols, shed=True,
        loads=tuple(x for x in cfg.eval_loads if x != NATIVE), native_load=NATIVE in cfg.eval_loads,
        index_params=params, shed_margins=margins, params_source=str(params_path), levers=load_levers(str(params_path)),
        t_ref_ms=doc["meta"]["t_ref_ms"], params_deployment=doc["meta"],
        max_traces=cfg.max_test_traces, bootstrap_seed=cfg.seed, bootstrap_b=cfg.bootstrap_b,
        progress=cfg.progress, threads=cfg.engine_threads(), **extra))
    test_wall = time.time() - t1
    bench_paths = bench.write(out / "test")

    data = {
        "format": "tokenbatch-tuning-report", "version": 1,
        "tokenbatch_version": __version__,
        "config": {k: v for k, v in cfg.to_dict().items() if k not in ("progress", "out", "storage", "threads",
                                                                         "workers")},
        "objective_evidence_id": obj_eid,
        "train_units": objective.n_units,
        "lambda_sat": {"rps": objective.wl.lambda_sat, "source": objective.wl.lambda_sat_source},
        "t_ref_ms": objective.wl.t_ref_ms,
        "studies": summaries,
        "best_params": doc,
        "aging": "not implemented in the engine: no aging baseline to tune",
        "index_scheduled_in_test": extra.get("schedule") is not None,
        "test_evidence_id": bench.evidence_id,
        "test": bench.data,
    }
    data["evidence_id"] = hashlib.sha256(canonical_json(
        {"objective": obj_eid, "config": data["config"], "best_params": report_rounded(doc),
         "test": bench.evidence_id}).encode()).hexdigest()
    meta = {"evidence_id": data["evidence_id"], "wall_time_s": round(time.time() - t0, 3),
            "search_wall_s": round(search["search_wall_s"], 3), "test_eval_wall_s": round(test_wall, 3),
            "recovered_stale_trials": search["recovered"], "storage": cfg.storage_url,
            "workers": cfg.workers, "engine_threads": cfg.engine_threads(), "config": cfg.to_dict(),
            "host": platform.node(), "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "argv": list(sys.argv)}
    write_with(out / "optimization_history.png", lambda p: plot_history(summaries, p), suffix=".png")
    write_text_atomic(out / "report.md", tuning_markdown(data, bench.to_markdown()))
    write_text_atomic(out / "run_meta.json", json.dumps(meta, indent=1, default=str) + "\n")
    write_text_atomic(out / "report.json", report_json(data))   # the JSON last
    paths = [params_path, out / "report.json", out / "report.md", out / "optimization_history.png",
             out / "run_meta.json", *bench_paths]
    return {"paths": paths, "data": data, "meta": meta, "summary": console_text(data, bench)}


def report_rounded(obj):
    from .report import rounded
    return rounded(obj)


def console_text(data: dict, bench) -> str:
    lines = [bench.summary_text().rstrip(), "", "tuned (train split):"]
    width = max(14, *map(len, data["studies"]))
    for row, s in data["studies"].items():
        b = s["best"]
        lines.append(f"  {row:<{width}} best train goodput "
                     f"{'-' if b is None else format(b['train_goodput'], '.4f')}  "
                     f"(trial {'-' if b is None else b['number']}; {s['trials']} trials: "
                     + ", ".join(f"{k} {v}" for k, v in s["states"].items()) + ")")
    if data["config"].get("comparators"):
        c = data["config"]
        lines.append(f"  (index@rho<x>: index-scheduled's bucket studies, at load x, "
                     f"ceil({c['trials']}/{len(c['eval_loads'])}) trials each; weights+shed: {c['trials']} trials)")
    lines.append("  aging: not implemented (no aging baseline)")
    return "\n".join(lines) + "\n"
