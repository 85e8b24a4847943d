"""The benchmark (docs/design.md section 6): policies x traces x loads, common random numbers, every metric.

``run_benchmark(BenchConfig(...)) -> BenchReport`` is the library form of ``tokenbatch bench``.

How a benchmark runs
--------------------
* **Workload.** A suite split (``suite.traces(split)``, at most ``max_traces``), or windows cut
  from one real trace (``trace_file`` + ``windows`` scored requests per window, ``warmup`` /
  ``cooldown`` simulated but not scored). A unit of analysis (bootstrap unit) is a trace or a
  window; suite traces are independent (percentile bootstrap), windows of one trace are not
  (moving-block bootstrap, block ``metrics.default_block(n)``).
* **Load.** rho relative to ``lambda_sat`` (FCFS saturation throughput): the suite manifest's
  value for the profile if recorded (the shipped profile's: a profile differing from it is
  measured), else measured with ``measure_lambda_sat`` on up to 8 train traces (real trace: its
  first 8 windows, unscaled, whatever ``max_traces`` keeps); the report says which. A suite trace is
  rescaled with ``scale_to_rate(trace, rho * lambda_sat, nominal_rps=suite nominal rate)`` (the
  suite's convention: every trace keeps its own burstiness). A real trace is rescaled as a whole
  (its empirical rate becomes ``rho * lambda_sat``) and then cut, so every load scores the same
  requests.
* **Common random numbers.** One simulate call per policy row, every (load, unit) a copy of that
  batch; every deployable row gets the same length estimates (the suite's predictor, drawn once
  from the *unscaled* trace, so they are also the same at every load); ``srpt-oracle`` gets the
  true lengths and is labelled reference. The mean-residual-life table for requests without an
  estimate (the ``prior`` predictor) comes from the suite's train outputs (real trace: its own).
* **Metrics** (per row and load): see ``request_outcomes`` / ``unit_metrics`` / ``pooled_metrics``.
  Latency percentiles pool every scored request of every unit at that load (inverted-CDF
  percentiles, so requests without a first token / without completion count as +inf in the
  "all arrived" columns). A *cache-miss* request is one with an empty prefix chain in the trace
  (nothing it could ever hit in the prefix cache). Maximum wait = max over scheduled requests of
  ``first_scheduled - arrival`` (never-scheduled requests are counted separately).
* **Capacity at SLO** (``capacity=True``): per unit, the largest grid rho whose goodput >= target
  at every grid rho' <= rho, refined by ``capacity_steps`` bisection steps inside the bracketing
  grid cell; "not reached" when even the smallest grid load misses the target; a unit meeting
  the target at the largest grid load is censored there (reported as ">="). Suite value: the
  geometric mean of per-unit ratios to FCFS over the units where both reached the target, with
  a paired bootstrap CI (on the mean log ratio).

Tuning uses ``evaluate_index_params``: k parameter sets x T traces as k*T copies of one
simulate call (one theta row and one shed margin per copy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from fractions import Fraction
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .errors import ConfigError, PolicyError

DEFAULT_LOADS = (0.6, 0.8, 1.0, 1.2, 1.5, 2.0)
DEFAULT_POLICIES = ("fcfs", "sjf", "edf", "llf", "index")
BASELINE_ROWS = ("fcfs", "edf+shed")
PRIMARY_SUITE, PRIMARY_SPLIT, PRIMARY_LOAD = "seed-200", "test", 1.2
LAMBDA_SAT_TRACES = 8
SHED_SUFFIX = "+shed"
#: informational keys tolerated in a --params file
PARAMS_INFO_KEYS = ("meta", "provenance", "source", "tuned", "comment")


# ------------------------------------------------------------------------------------ config
def _finite_pos(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(x)) or float(x) <= 0:
        raise ConfigError(f"{what}: must be a positive finite number, got {x!r}")
    return float(x)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything that determines a benchmark, so that one config gives one evidence id (every field
    enters it except ``progress``). Frozen; validated on construction.

    The fields mirror ``tokenbatch bench``'s options: the workload (``suite``/``split``/``max_traces``,
    or ``trace_file`` cut into ``windows`` with ``warmup``/``cooldown``), the ``profile`` and
    ``engine``, the rows (``policies``, ``shed``, ``index_params``, ``weights``, ``schedule``,
    ``controllers``), the ``loads`` (rho, relative to FCFS saturation), the statistics
    (``bootstrap_seed``, ``bootstrap_b``) and the optional ``capacity`` search and ``upper_bound``.
    The module docstring says how each is used.

    Raises:
        ConfigError: a field out of range or of the wrong type (the message names it).
        PolicyError: an unknown policy, or a bad shed margin.
    """

    suite: str = "seed-200"
    split: str = "test"
    profile: str = "stress-512"
    policies: tuple = DEFAULT_POLICIES
    shed: bool = False                          # add a +shed row for every policy
    loads: tuple = DEFAULT_LOADS
    index_params: object = None                 # IndexParams (None = defaults)
    weights: object = None                      # LinearWeights of the ``weights`` policy (None = defaults)
    shed_margins: tuple = ()                    # ((policy, margin), ...); default 0.0
    params_source: Optional[str] = None         # where the parameters came from (for the report)
    max_traces: Optional[int] = None
    bootstrap_seed: int = 0
    bootstrap_b: int = 10_000
    capacity: bool = False
    capacity_target: float = 0.9
    capacity_steps: int = 6
    gpu_price: Optional[float] = None           # $ per GPU-hour
    gpus: Optional[int] = None
    trace_file: Optional[str] = None            # a real trace instead of a suite
    trace_format: Optional[str] = None
    windows: Optional[int] = None               # scored requests per window (real trace)
    warmup: int = 0
    cooldown: int = 0
    engine: object = None                       # EngineConfig (None = defaults)
    upper_bound: bool = True
    progress: bool = False
    threads: int = 1                            # rows simulated concurrently (results identical)
    schedule: object = None                     # IndexSchedule: adds the "index-scheduled" row
    controllers: tuple = ()                     # control.ControlSpec rows (trained agents)

    def __post_init__(self):
        from .engine.state import EngineConfig
        from .policies import BASELINES, IndexParams

        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if self.index_params is None:
            set_("index_params", IndexParams())
        elif not isinstance(self.index_params, IndexParams):
            raise ConfigError("index_params must be an IndexParams")
        from .policies import LinearWeights
        if self.weights is None:
            set_("weights", LinearWeights())
        elif not isinstance(self.weights, LinearWeights):
            raise ConfigError("weights must be a LinearWeights")
        if self.engine is None:
            set_("engine", EngineConfig())
        elif not isinstance(self.engine, EngineConfig):
            raise ConfigError("engine must be an EngineConfig")
        pols = tuple(self.policies)
        if not pols:
            raise ConfigError(f"policies: need at least one; valid: {', '.join(BASELINES)}")
        bad = [p for p in pols if p not in BASELINES]
        if bad:
            raise PolicyError(f"unknown policy {bad[0]!r}; valid: {', '.join(BASELINES)}")
        if len(set(pols)) != len(pols):
            raise ConfigError(f"policies: duplicates in {list(pols)}")
        set_("policies", pols)
        loads = tuple(_finite_pos(x, "loads (rho)") for x in self.loads)
        if not loads:
            raise ConfigError("loads: need at least one rho > 0")
        set_("loads", tuple(sorted(set(loads))))
        from .policies import check_shed_margin
        sm = dict(self.shed_margins)
        for p, m in sm.items():
            if p not in BASELINES:
                raise PolicyError(f"shed margin for unknown policy {p!r}; valid: {', '.join(BASELINES)}")
            check_shed_margin(m)
        set_("shed_margins", tuple(sorted(sm.items())))
        from .control import ControlSpec
        from .policies import IndexSchedule
        if self.schedule is not None and not isinstance(self.schedule, IndexSchedule):
            raise ConfigError("schedule must be a policies.IndexSchedule")
        ctl = tuple(self.controllers)
        if any(not isinstance(c, ControlSpec) for c in ctl):
            raise ConfigError("controllers must be control.ControlSpec objects")
        labels = [c.label for c in ctl] + (["index-scheduled"] if self.schedule is not None else [])
        if len(set(labels)) != len(labels) or set(labels) & set(BASELINES) or \
                any(lab.endswith(SHED_SUFFIX) for lab in labels):
            raise ConfigError(f"controllers: labels must be unique and differ from the policy rows, got {labels}")
        set_("controllers", ctl)
        if self.max_traces is not None and (isinstance(self.max_traces, bool)
                                            or not isinstance(self.max_traces, int) or self.max_traces < 1):
            raise ConfigError(f"max_traces: must be an integer >= 1, got {self.max_traces!r}")
        for f, lo in (("bootstrap_seed", 0), ("bootstrap_b", 100), ("capacity_steps", 0),
                      ("warmup", 0), ("cooldown", 0), ("threads", 1)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ConfigError(f"{f}: must be an integer >= {lo}, got {v!r}")
        t = self.capacity_target
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < float(t) <= 1):
            raise ConfigError(f"capacity_target: must be in (0, 1], got {t!r}")
        if (self.gpu_price is None) != (self.gpus is None):
            raise ConfigError("give --gpu-price and --gpus together (or neither)")
        if self.gpu_price is not None:
            _finite_pos(self.gpu_price, "gpu_price")
            if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
                raise ConfigError(f"gpus: must be an integer >= 1, got {self.gpus!r}")
        if self.trace_file is not None:
            if self.windows is None or isinstance(self.windows, bool) or not isinstance(self.windows, int) \
                    or self.windows < 1:
                raise ConfigError(f"windows: a real trace needs --windows W >= 1, got {self.windows!r}")
        elif self.windows is not None:
            raise ConfigError("windows: only with a real trace (--trace FILE)")

    def shed_margin(self, policy: str) -> float:
        """The +shed row's margin for ``policy`` (default 0.0)."""
        return float(dict(self.shed_margins).get(policy, 0.0))


def load_params_file(path: str, what: str = "--params") -> tuple:
    """A ``--params`` file: ``{"index": {IndexParams fields}, "shed_margin": x, "<policy>":
    {"shed_margin": y}, ...}`` -> (IndexParams, ((policy, margin), ...)). ``shed_margin`` at top
    level is the index's; other policies' margins default to 0.0. ``what``: the option or field
    that gave the path, named in errors."""
    from .policies import BASELINES, IndexParams, check_shed_margin

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: {path!r} is a directory, not a parameters JSON" if p.is_dir()
                          else f"{what}: file {path!r} not found")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object")
    valid = ["index", "shed_margin", *[b for b in BASELINES if b != "index"], SCHEDULE_KEY, *PARAMS_INFO_KEYS]
    unknown = sorted(k for k in d if k not in valid and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"{what} {path}: unknown key(s) {unknown}; valid: {', '.join(valid)}")
    idx = d.get("index", {})
    if not isinstance(idx, dict):
        raise ConfigError(f"{what} {path}: 'index' must be an object of IndexParams fields")
    try:
        params = IndexParams.from_dict(idx)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{what} {path}: {e}") from None
    margins = {}

    def margin(v, who):
        if v is None or v == "inf":   # (null, like inf: no shedding)
            v = math.inf
        try:
            check_shed_margin(v)
        except PolicyError as e:
            raise PolicyError(f"{what} {path}: {who}: {e}") from None
        return float(v)

    if "shed_margin" in d:
        margins["index"] = margin(d["shed_margin"], "shed_margin")
    for b in BASELINES:
        if b == "index" or b not in d:
            continue
        v = d[b]
        allowed = {"shed_margin", "w"} if b == "weights" else {"shed_margin"}
        if not isinstance(v, dict) or set(v) - allowed:
            raise ConfigError(f"{what} {path}: {b!r} must be {{\"shed_margin\": x}}"
                              + (" with optional \"w\": {feature: weight}" if b == "weights" else ""))
        if "shed_margin" in v:
            margins[b] = margin(v["shed_margin"], f"{b}.shed_margin")
    return params, tuple(sorted(margins.items()))


#: the params-file key of the ``index-scheduled`` comparator (``policies.IndexSchedule.to_dict``)
SCHEDULE_KEY = "index-scheduled"


def load_schedule(path: str, what: str = "--params"):
    """The ``index-scheduled`` schedule in a ``--params`` file, or None when it has none."""
    from .policies import IndexSchedule
    load_params_file(path, what)
    d = json.loads(Path(path).read_text())
    if SCHEDULE_KEY not in d:
        return None
    try:
        return IndexSchedule.from_dict(d[SCHEDULE_KEY])
    except (PolicyError, TypeError, ValueError) as e:
        raise PolicyError(f"{what} {path}: {SCHEDULE_KEY}: {e}") from None


def load_weights(path: str, what: str = "--params"):
    """The ``weights`` policy's tuned weights in a ``--params`` file (``{"weights": {"w": ...}}``),
    or None when the file has none (validated by ``load_params_file`` first)."""
    from .policies import LinearWeights
    load_params_file(path, what)
    v = json.loads(Path(path).read_text()).get("weights", {})
    if "w" not in v:
        return None
    try:
        return LinearWeights.from_dict(v["w"])
    except PolicyError as e:
        raise PolicyError(f"{what} {path}: weights.w: {e}") from None


# ------------------------------------------------------------------------------------ rows
@dataclasses.dataclass(frozen=True)
class Row:
    """One leaderboard row: a policy, with or without the common shed rule."""

    label: str
    policy: str
    shed_margin: Optional[float]     # None = no shedding
    reference: bool = False          # uses oracle information (not deployable)
    added: bool = False              # added as a required baseline / primary-endpoint row


def build_rows(cfg: BenchConfig) -> list:
    rows, seen = [], set()

    def add(policy, shed, added=False):
        label = policy + (SHED_SUFFIX if shed else "")
        if label in seen:
            return
        seen.add(label)
        rows.append(Row(label, policy, cfg.shed_margin(policy) if shed else None,
                        policy == "srpt-oracle", added))

    if "fcfs" not in cfg.policies:
        add("fcfs", False, True)
    for p in cfg.policies:
        add(p, False)
        if cfg.shed:
            add(p, True)
    add("edf", True, True)
    if _is_primary_suite(cfg):
        add("index", True, True)
    for spec in control_specs(cfg):
        rows.append(Row(spec.label, CONTROLLED, None))
    return rows


#: ``Row.policy`` of a controller row (``index-scheduled``, trained agents)
CONTROLLED = "controlled"
#: what a controller row is also compared with, pairwise (docs/design.md section 8), when present
CONTROL_COMPARATORS = ("index+shed", "index-scheduled", "weights+shed")


def control_specs(cfg: BenchConfig) -> list:
    """The controller rows of ``cfg`` (index-scheduled first, then the agents)."""
    from .control import schedule_spec
    return ([schedule_spec(cfg.schedule)] if cfg.schedule is not None else []) + list(cfg.controllers)


def _is_primary_suite(cfg: BenchConfig) -> bool:
    return cfg.trace_file is None and cfg.suite == PRIMARY_SUITE


# ------------------------------------------------------------------------------------ workload
@dataclasses.dataclass
class Workload:
    """The units (traces or windows) at their stored rate, and how to put them at a load."""

    name: str
    kind: str                       # "suite" or "trace"
    units: list                     # unscaled Trace per unit
    scored: list                    # bool mask per unit
    windows: Optional[list]         # [(lo, hi, scored_start, scored_stop)] in the parent (trace kind)
    parent: object                  # parent Trace (trace kind) or None
    nominal_rps: Optional[float]    # suite: the stored nominal rate
    lambda_sat: float
    lambda_sat_source: str
    residual_life: np.ndarray
    t_ref_ms: float
    predictor: object               # PredictorSpec
    class_names: list
    digests: list                   # unscaled unit digests (trace kind: the parent's once)
    notes: list = dataclasses.field(default_factory=list)

    @property
    def block(self) -> Optional[int]:
        from .metrics import default_block
        return default_block(len(self.units)) if self.kind == "trace" else None

    def unit_at(self, i: int, rho: float):
        from .traces.windows import scale_to_rate
        rate = rho * self.lambda_sat
        if self.kind == "suite":
            return scale_to_rate(self.units[i], rate, nominal_rps=self.nominal_rps)
        lo, hi, _, _ = self.windows[i]
        return scale_to_rate(self.parent, rate).subset(slice(lo, hi))

    def scale_factor(self, rho: float):
        """The exact factor (a Fraction) by which ``unit_at(i, rho)`` scales every unit's times."""
        nominal = self.__dict__.get("_nominal")
        if nominal is None:   # the units' stored rate: a constant of the workload
            from .traces.windows import as_fraction, empirical_rate_rps
            nominal = as_fraction(self.nominal_rps if self.kind == "suite" else empirical_rate_rps(self.parent),
                                  "nominal_rps")
            self.__dict__["_nominal"] = nominal
        rate = rho * self.lambda_sat
        if type(rate) is float and 0.0 < rate < math.inf:   # (the env draws one per episode: kept cheap)
            a, b = rate.as_integer_ratio()   # the float's exact value, as as_fraction takes it
            return Fraction(nominal.numerator * b, nominal.denominator * a)   # = nominal / rate, normalised
        from .traces.windows import as_fraction
        return nominal / as_fraction(rate, "rate_rps")   # scale_to_rate's factor

    def scaled_in_range(self, i: int, factor) -> bool:
        """Whether unit i's last arrival stays in range at ``factor`` (else ``unit_at`` raises)."""
        from .traces.trace import MAX_ARRIVAL_NS
        last = self.__dict__.get("_last_arrival")
        if last is None:   # each unit's last arrival (the parent's for every window of a trace)
            arr = [(u if self.kind == "suite" else self.parent).arrival_ns for u in self.units]
            last = self.__dict__["_last_arrival"] = [int(a[-1]) if len(a) else None for a in arr]
        v = last[i]
        f = factor.numerator / factor.denominator if type(factor) is Fraction else float(factor)
        if v is None or v * f < MAX_ARRIVAL_NS / 2:
            return True
        from .traces.windows import scale_ints
        return not int(scale_ints(np.array([v], np.int64), factor)[0]) > MAX_ARRIVAL_NS

    def window_at(self, i: int, rho: float, start: int, size: int, warmup: int = 0, cooldown: int = 0):
        """``traces.windows.window_at(self.unit_at(i, rho), start, size, warmup, cooldown)``, the same
        Window, computed by cutting the window first and scaling only its rows (scaling about t = 0
        commutes exactly with ``Trace.subset``)."""
        from .traces.windows import Window, time_scale, window_at
        factor = self.scale_factor(rho)
        if not self.scaled_in_range(i, factor):
            return window_at(self.unit_at(i, rho), start, size, warmup, cooldown)   # raises, as unit_at does
        unit = self.units[i]
        unit.prefix_ids()   # cached on the unit: its windows derive theirs without sorting
        w = window_at(unit, start, size, warmup, cooldown)
        return Window(time_scale(w.trace, factor), w.scored_start, w.scored_stop, w.parent_start)

    def check_load(self, rho: float, what: str = "rho", units=None) -> None:
        """A ConfigError naming ``rho`` (as ``what``) if a unit's times (of ``units``, default all), put
        at that load, leave the engine's int64 ns range. The lowest load stretches them most, so
        checking the lowest of a range covers the whole range."""
        from .errors import TraceError
        units = tuple(range(len(self.units)) if units is None else units)
        known = self.__dict__.setdefault("_loads_fit", {})   # (every env of a process checks its rho)
        fits = known.get((rho, units))
        if fits is None:
            try:
                f = self.scale_factor(rho)
                fits = all(self.scaled_in_range(i, f) for i in units)
            except (ConfigError, TraceError, OverflowError):   # (a factor itself beyond int64, or a float)
                fits = False
            known[(rho, units)] = fits
        if not fits:
            raise ConfigError(f"{what}: a load of {rho!r} is too low for {self.name}: its arrival times, stretched "
                              f"to that load, pass the engine's int64 ns range")

    def at(self, rho: float) -> list:
        self.check_load(rho, "loads")
        if self.kind == "suite":
            return [self.unit_at(i, rho) for i in range(len(self.units))]
        from .traces.windows import scale_to_rate
        scaled = scale_to_rate(self.parent, rho * self.lambda_sat)
        return [scaled.subset(slice(lo, hi)) for lo, hi, _, _ in self.windows]

    def estimates(self, oracle: bool = False) -> list:
        from .predictors import PredictorSpec, estimates
        spec = PredictorSpec("oracle") if oracle else self.predictor
        if self.kind == "suite":
            return [estimates(t, spec) for t in self.units]
        e = estimates(self.parent, spec)
        return [e[lo:hi].copy() for lo, hi, _, _ in self.windows]


def _measure_lambda(traces, profile, engine) -> float:
    from .engine.saturation import measure_lambda_sat
    return float(measure_lambda_sat(list(traces)[:LAMBDA_SAT_TRACES], profile, engine))


def _class_names(spec_sla, n_hint: int) -> list:
    try:
        return [c.name for c in spec_sla.classes]
    except AttributeError:
        return [f"class {i}" for i in range(n_hint)]


def _is_shipped(profile) -> bool:
    """Whether ``profile`` is the shipped profile of its name, field for field (a suite manifest's
    ``lambda_sat`` is keyed by name: a file reusing a shipped name, or a profile with engine
    overrides applied, has its own saturation rate)."""
    from .engine.profiles import is_profile_file, list_profiles, load_profile
    if is_profile_file(profile.name) or profile.name not in list_profiles():
        return False
    return load_profile(profile.name).to_dict() == profile.to_dict()


def prepare_workload(cfg: BenchConfig, profile) -> Workload:
    from .predictors import PredictorSpec, ResidualLife

    if cfg.trace_file is None:
        from .traces.suites import load_suite
        suite = load_suite(cfg.suite)
        traces = suite.traces(cfg.split)
        if cfg.max_traces is not None:
            traces = traces[:cfg.max_traces]
        if not traces:
            raise ConfigError(f"suite {cfg.suite!r} split {cfg.split!r} has no traces")
        if not all(t.has_slos for t in traces):
            raise ConfigError(f"suite {cfg.suite!r}: traces without SLOs cannot be scored")
        train_split = "train" if "train" in suite.splits else suite.splits[0]
        train = suite.traces(train_split)
        notes = []
        lam = suite.lambda_sat.get(profile.name)
        shipped = lam is None or _is_shipped(profile)
        if lam is not None and shipped:
            lam, src = float(lam), f"suite manifest ({profile.name})"
        else:
            lam = _measure_lambda(train, profile, cfg.engine)
            src = (f"measured (measure_lambda_sat, FCFS backlogged) on {min(len(train), LAMBDA_SAT_TRACES)} "
                   f"{train_split} traces: " + (f"the manifest has no entry for {profile.name}" if shipped else
                                                 f"the manifest's entry for {profile.name} is the shipped profile's, "
                                                 f"and this one differs from it"))
        rl = ResidualLife.from_lengths(np.concatenate([t.output_tokens for t in train])).table
        t_ref = suite.t_ref_ns
        if t_ref is None:
            t_ref = float(np.median(np.concatenate([t.ttft_slo_ns for t in traces])))
            notes.append("T_ref = median T1 of the evaluated traces (the manifest records none)")
        sla = getattr(suite.spec.generator, "sla", None)
        ncls = int(max(int(t.class_id.max()) for t in traces)) + 1
        notes += _unit_notes(len(traces))
        return Workload(suite.name, "suite", traces, [np.ones(len(t), bool) for t in traces], None, None,
                        float(suite.nominal_rate_rps), lam, src, rl, float(t_ref) / 1e6,
                        PredictorSpec.from_dict(suite.predictor), _class_names(sla, ncls),
                        [t.digest for t in traces], notes)
    # a real trace family: windows cut from one trace
    from .traces.io import load_trace
    from .traces.sla import DEFAULT_SLA, assign_slas
    from .traces.windows import cut_windows
    trace, _ = load_trace(cfg.trace_file, cfg.trace_format)
    notes = []
    if not trace.has_slos:
        trace = assign_slas(trace, seed=0)
        notes.append("SLOs assigned by the default 3-class rule (seed 0): the trace has none")
    wins = cut_windows(trace, cfg.windows, cfg.warmup, cfg.cooldown)
    # the load's reference rate from the trace's first windows, however many are evaluated (so that
    # rho means the same with any --max-traces)
    lam_units = [w.trace for w in wins if len(w.trace) >= 10][:LAMBDA_SAT_TRACES]
    if cfg.max_traces is not None:
        wins = wins[:cfg.max_traces]
    if not wins:
        raise ConfigError(f"trace {cfg.trace_file!r}: no window of {cfg.windows} scored requests fits "
                          f"(warmup {cfg.warmup}, cooldown {cfg.cooldown}, {len(trace)} requests)")
    short = [w for w in wins if w.scored_stop - w.scored_start < cfg.windows]
    if short:   # (cut_windows tiles the whole scored region: the last window may hold fewer requests)
        notes.append(f"{len(short)} of {len(wins)} windows hold fewer than {cfg.windows} scored requests "
                     f"(the trace's last ones: {', '.join(str(w.scored_stop - w.scored_start) for w in short)})")
    spans = [(w.parent_start, w.parent_start + len(w.trace), w.scored_start, w.scored_stop) for w in wins]
    units = [w.trace for w in wins]
    scored = [w.scored_mask() for w in wins]
    if not lam_units:
        raise ConfigError("windows too small to measure lambda_sat (need >= 10 requests)")
    lam = _measure_lambda(lam_units, profile, cfg.engine)
    src = f"measured (measure_lambda_sat, FCFS backlogged) on the trace's first {len(lam_units)} windows"
    rl = ResidualLife.from_lengths(trace.output_tokens).table
    notes.append("residual-life table (prior predictor) from the trace's own output lengths")
    notes += _unit_notes(len(units))
    ncls = int(trace.class_id.max()) + 1
    return Workload(trace.name, "trace", units, scored, spans, trace, None, lam, src, rl,
                    float(np.median(trace.ttft_slo_ns)) / 1e6, _default_predictor(),
                    _class_names(DEFAULT_SLA, ncls), [trace.digest], notes)


def _unit_notes(n_units: int) -> list:
    """A warning for the report when its 95% CIs cannot mean anything: they resample the independent
    units (traces or windows), so one unit gives intervals of zero width."""
    if n_units >= 2:
        return []
    return ["only one trace or window: every 95% CI below has zero width (the bootstrap resamples the "
            "independent units; use at least two, preferably 20 or more)"]


def _default_predictor():
    from .predictors import PredictorSpec
    return PredictorSpec("noisy", 0.5, 0)


# ------------------------------------------------------------------------------------ metrics
def request_outcomes(rec: dict, trace, scored: Optional[np.ndarray] = None) -> dict:
    """The scored requests' outcome columns used by every metric (times in ms; +inf where the
    event never happened: no first token for TTFT, not completed for TPOT and E2E). ``trace`` None:
    without the trace's columns (class, cache miss); then ``rec``'s columns may also be 2-D
    ([units, requests], ``scored`` None)."""
    from .engine.kernel import E_COMPLETED, E_REJECTED, E_SHED, E_TIMED_OUT, E_UNFINISHED
    n = len(rec["arrival_ns"])
    m = np.ones(n, bool) if scored is None else np.asarray(scored, bool)
    es = np.asarray(rec["end_state"])[m]
    completed = es == E_COMPLETED
    ttft = np.asarray(rec["ttft_ns"])[m]
    has_tok = ttft >= 0
    fin = np.asarray(rec["finish_ns"])[m]
    arr = np.asarray(rec["arrival_ns"])[m]
    fs = np.asarray(rec["first_scheduled_ns"])[m]
    return {
        "met": np.asarray(rec["met"], bool)[m],
        "completed": completed,
        "shed": es == E_SHED, "timed_out": es == E_TIMED_OUT, "rejected": es == E_REJECTED,
        "unfinished": es == E_UNFINISHED,
        "ttft_ms": np.where(has_tok, ttft / 1e6, np.inf),
        "tpot_ms": np.where(completed, np.asarray(rec["tpot_ns"], np.float64)[m] / 1e6, np.inf),
        "e2e_ms": np.where(completed, (fin - arr) / 1e6, np.inf),
        "wait_ms": np.where(fs >= 0, (fs - arr) / 1e6, np.nan),
        "output_tokens": np.asarray(rec["output_tokens"])[m],
        "prompt_tokens": np.asarray(rec["prompt_tokens"])[m],
        "arrival_ns": arr, "finish_ns": fin,
        "preemptions": np.asarray(rec["preemptions"])[m],
        "recomputed_tokens": np.asarray(rec["recomputed_tokens"])[m],
        **({} if trace is None else {"class_id": np.asarray(trace.class_id)[m],
                                     "cache_miss": np.asarray(trace.prefix_lengths)[m] == 0}),
    }


def unit_metrics(o: dict) -> dict:
    """Per-unit (trace or window) numbers: goodput = met / arrived, counts, throughput over the
    unit's span (first scored arrival to the last scored end; requests that never finished end
    at their arrival for this purpose)."""
    n = int(o["met"].size)
    end = np.where(o["finish_ns"] >= 0, o["finish_ns"], o["arrival_ns"])
    span_s = float(end.max() - o["arrival_ns"].min()) / 1e9 if n else 0.0
    met = int(o["met"].sum())
    return {
        "arrived": n, "met": met, "completed": int(o["completed"].sum()),
        "goodput": met / n if n else float("nan"),
        "shed": int(o["shed"].sum()), "timed_out": int(o["timed_out"].sum()),
        "rejected": int(o["rejected"].sum()), "unfinished": int(o["unfinished"].sum()),
        "preemptions": int(o["preemptions"].sum()),
        "recomputed_tokens": int(o["recomputed_tokens"].sum()),
        "throughput_tok_s": float(o["output_tokens"][o["completed"]].sum()) / span_s if span_s > 0 else 0.0,
        "met_req_s": met / span_s if span_s > 0 else 0.0,
        "span_s": span_s,
    }


def pct(x, q: float) -> float:
    """Inverted-CDF percentile (no interpolation, so +inf entries stay meaningful); NaN if empty."""
    return pcts(x, (q,))[0]


def pcts(x, qs) -> list:
    """``[pct(x, q) for q in qs]`` with one sort: ``np.percentile(x, q, method="inverted_cdf")``
    exactly (its index rule: ``i = n * (q / 100) - 1`` in float64, rounded up unless integral,
    clipped at 0; NaN if any entry is NaN). Falls back to np.percentile for anything else (numpy
    scalar or out-of-range q, a chosen zero that could be -0.0)."""
    x = np.asarray(x, np.float64)
    if not x.size:
        return [float("nan")] * len(qs)
    if x.ndim != 1:
        return [float(np.percentile(x, q, method="inverted_cdf")) for q in qs]
    s = np.sort(x)   # NaN sorts last
    n = s.size
    out = []
    for q in qs:
        if type(q) not in (int, float) or not 0 <= q <= 100:
            out.append(float(np.percentile(x, q, method="inverted_cdf")))
            continue
        if s[-1] != s[-1]:
            out.append(float("nan"))
            continue
        v = float(s[_pct_index(n, q)])
        if v == 0.0 and np.signbit(x[x == 0.0]).any():   # +0.0 and -0.0: partition order decides
            v = float(np.percentile(x, q, method="inverted_cdf"))
        out.append(v)
    return out


def _pct_index(n: int, q) -> int:
    """np.percentile's inverted-CDF index rule: ``i = n * (q / 100) - 1`` in float64, rounded up
    unless integral, clipped at 0."""
    idx = n * (q / 100) - 1
    prev = math.floor(idx)
    return max(0, prev if idx - prev == 0 else prev + 1)


def prompt_quintile_edges(prompts) -> list:
    """Edges (20/40/60/80th percentiles, inverted CDF) of the pooled scored prompt lengths."""
    p = np.asarray(prompts, np.float64)
    return [pct(p, q) for q in (20, 40, 60, 80)]


def pooled_metrics(outs: Sequence[dict], quintile_edges, class_names) -> dict:
    """Suite-level numbers that pool the scored requests of every unit at one load."""
    cat = {k: np.concatenate([o[k] for o in outs]) for k in outs[0]}
    comp = cat["completed"]
    lat = {}
    for k in ("ttft", "tpot", "e2e"):
        v = cat[f"{k}_ms"]
        lat[f"{k}_ms"] = {"p50_all": pct(v, 50), "p99_all": pct(v, 99),
                          "p50_completed": pct(v[comp], 50), "p99_completed": pct(v[comp], 99)}
    by_class = {}
    for c in np.unique(cat["class_id"]):
        sel = cat["class_id"] == c
        name = class_names[c] if c < len(class_names) else f"class {c}"
        by_class[name] = {"goodput": float(cat["met"][sel].mean()), "arrived": int(sel.sum())}
    q = np.searchsorted(np.asarray(quintile_edges, np.float64), cat["prompt_tokens"], side="right")
    by_q = []
    for i in range(5):
        sel = q == i
        by_q.append({"goodput": float(cat["met"][sel].mean()) if sel.any() else float("nan"),
                     "arrived": int(sel.sum())})
    wait = cat["wait_ms"]
    sched = np.isfinite(wait)
    n_comp = int(comp.sum())
    return {
        **lat,
        "sla_respect": float(cat["met"].sum() / n_comp) if n_comp else float("nan"),
        "goodput_by_class": by_class,
        "goodput_by_prompt_quintile": by_q,
        "ttft_p99_cache_miss_ms": pct(cat["ttft_ms"][cat["cache_miss"]], 99),
        "cache_miss_requests": int(cat["cache_miss"].sum()),
        "max_wait_ms": float(wait[sched].max()) if sched.any() else float("nan"),
        "never_scheduled": int((~sched).sum()),
    }


def _ci(values, cfg: BenchConfig, block) -> dict:
    from .metrics import bootstrap_ci
    m, lo, hi = bootstrap_ci(values, B=cfg.bootstrap_b, seed=cfg.bootstrap_seed, block=block)
    return {"mean": m, "ci95": [lo, hi]}


def _paired(a, b, cfg: BenchConfig, block) -> dict:
    from .metrics import paired_difference, win_rate
    m, lo, hi = paired_difference(a, b, B=cfg.bootstrap_b, seed=cfg.bootstrap_seed, block=block)
    return {"diff": m, "ci95": [lo, hi], "win_rate": win_rate(a, b)}


# ------------------------------------------------------------------------------------ batch runs
def _run_row(row: Row, wl: Workload, traces: list, est: list, profile, cfg: BenchConfig):
    from .engine.simulate import simulate
    from .policies import engine_policy
    if row.policy == CONTROLLED:
        from .control import run_controlled
        spec = next(s for s in control_specs(cfg) if s.label == row.label)
        return run_controlled(traces, profile, cfg.engine, spec, estimates=est, residual_life=wl.residual_life,
                              t_ref_ms=wl.t_ref_ms, lambda_sat=wl.lambda_sat)
    pol = engine_policy(row.policy, params=cfg.index_params if row.policy == "index" else None,
                        weights=cfg.weights, shed_margin=row.shed_margin, t_ref_ms=wl.t_ref_ms)
    return simulate(traces, profile, pol, cfg.engine, estimates=est, residual_life=wl.residual_life)


def evaluate_index_params(traces: Sequence, profile, params_list: Sequence, *, shed_margins=None,
                          estimates: Optional[Sequence[np.ndarray]] = None, residual_life=None,
                          t_ref_ms: float = 1000.0, config=None, scored=None) -> np.ndarray:
    """Goodput matrix [k, T] of k index parameter sets on T traces, run as k*T copies of ONE
    simulate call (copy ``j*T + i`` = parameter set j on trace i, with its own theta row and
    shed margin). ``shed_margins``: None (no shedding), one value for all, or k values (None/inf =
    off). ``estimates``: one array per trace (reused for every parameter set: common random
    numbers). ``scored``: optional bool mask per trace (windows). The index's case of
    ``evaluate_param_vectors``."""
    from .policies import IndexParams

    if len(params_list) == 0 or len(traces) == 0:
        raise ConfigError("evaluate_index_params needs at least one parameter set and one trace")
    params = [p if isinstance(p, IndexParams) else IndexParams.from_dict(p) for p in params_list]
    return evaluate_param_vectors(traces, profile, "index", np.stack([p.theta_vector(t_ref_ms) for p in params]),
                                  shed_margins=shed_margins, estimates=estimates, residual_life=residual_life,
                                  t_ref_ms=t_ref_ms, config=config, scored=scored)


def evaluate_param_vectors(traces: Sequence, profile, policy: str, thetas=None, *, shed_margins=None,
                           estimates: Optional[Sequence[np.ndarray]] = None, residual_life=None,
                           t_ref_ms: float = 1000.0, config=None, scored=None) -> np.ndarray:
    """Goodput matrix [k, T] of k parameter sets of the in-engine ``policy`` on T traces, as k*T
    copies of ONE simulate call (copy ``j*T + i`` = set j on trace i, with its own theta row and
    shed margin). ``thetas``: [k, N_THETA] engine parameter vectors (``IndexParams.theta_vector``,
    ``LinearWeights.theta_vector``), or None for a policy without parameters (then k = the number
    of ``shed_margins``). ``shed_margins``, ``estimates``, ``scored``: as in
    ``evaluate_index_params``."""
    from .policies import check_shed_margin, engine_policy

    traces = list(traces)
    T = len(traces)
    if thetas is not None:
        thetas = np.asarray(thetas, np.float64)
        if thetas.ndim != 2:
            raise ConfigError(f"thetas: expected a [k, N_THETA] array, got shape {thetas.shape}")
        k = len(thetas)
    elif shed_margins is None or np.ndim(shed_margins) == 0:
        raise ConfigError(f"evaluate_param_vectors({policy!r}): give theta vectors or k shed margins")
    else:
        k = len(shed_margins)
    if k == 0 or T == 0:
        raise ConfigError("evaluate_param_vectors needs at least one parameter set and one trace")
    if shed_margins is None or np.ndim(shed_margins) == 0:
        margins = [shed_margins] * k
    else:
        margins = list(shed_margins)
        if len(margins) != k:
            raise ConfigError(f"shed_margins: expected {k} values, got {len(margins)}")
    margins = [check_shed_margin(None if m is None else float(m)) for m in margins]
    base = engine_policy(policy, t_ref_ms=t_ref_ms)
    theta = base.theta
    if thetas is not None:
        if base.theta is None or thetas.shape[1] != np.shape(base.theta)[-1]:
            raise ConfigError(f"policy {policy!r} takes no parameter vector of width {thetas.shape[1]}")
        theta = np.repeat(thetas, T, axis=0)
    shed = np.repeat(np.array([np.inf if m is None else m for m in margins], np.float64), T)
    pol = dataclasses.replace(base, name=f"{policy}[k]", theta=theta, shed_margin=shed)
    return goodput_matrix(traces, k, profile, pol, config=config, estimates=estimates,
                          residual_life=residual_life, scored=scored)


def goodput_matrix(traces: Sequence, k: int, profile, policy, *, config=None, estimates=None,
                   residual_life=None, scored=None) -> np.ndarray:
    """Goodput [k, T] of ``policy`` (per-copy parameters for the k*T copies) on k repeats of T
    traces, in ONE simulate call: copy ``j*T + i`` is parameter set j on trace i. The estimates of
    trace i are reused for every j (common random numbers); ``scored``: bool mask per trace."""
    from .engine.simulate import simulate

    traces = list(traces)
    T = len(traces)
    est = None if estimates is None else [e for _ in range(k) for e in estimates]
    res = simulate(traces * k, profile, policy, config, estimates=est, residual_life=residual_life)
    out = np.empty((k, T))
    for j in range(k):
        for i in range(T):
            met = res.records(j * T + i)["met"]
            if scored is not None:
                met = met[np.asarray(scored[i], bool)]
            out[j, i] = met.mean() if met.size else float("nan")
    return out


# ------------------------------------------------------------------------------------ evidence
def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_jsonable)


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def _num_or_str(x):
    if x is None:
        return None
    return float(x) if math.isfinite(float(x)) else "inf"


def evidence_inputs(cfg: BenchConfig, wl: Workload, profile, rows: list) -> dict:
    from . import __version__
    pol = []
    for r in rows:
        d = {"label": r.label, "policy": r.policy, "shed_margin": _num_or_str(r.shed_margin),
             "estimates": "oracle" if r.reference else "predictor"}
        if r.policy == "index":
            d["index_params"] = dataclasses.asdict(cfg.index_params)
            d["t_ref_ms"] = wl.t_ref_ms
        if r.policy == "weights":
            d["weights"] = cfg.weights.to_dict()["w"]
            d["t_ref_ms"] = wl.t_ref_ms
        if r.policy == CONTROLLED:
            spec = next(s for s in control_specs(cfg) if s.label == r.label)
            d["controller"] = {"action_mode": spec.action_mode, "k": spec.k,
                               "decision_interval_ms": spec.decision_interval_ms,
                               "base_margin": _num_or_str(spec.base_margin), **dict(spec.evidence)}
            d["t_ref_ms"] = wl.t_ref_ms
        pol.append(d)
    return {
        "workload": {"kind": wl.kind, "name": wl.name,
                     "split": cfg.split if wl.kind == "suite" else None,
                     "trace_digests": wl.digests,
                     "windows": None if wl.windows is None else [list(w) for w in wl.windows]},
        "loads": list(cfg.loads),
        "lambda_sat_rps": wl.lambda_sat,
        "engine_config": cfg.engine.to_dict(),
        "profile": {"name": profile.name, "profile": profile.to_dict()},
        "policies": pol,
        "predictor": wl.predictor.to_dict(),
        "residual_life_sha256": hashlib.sha256(np.ascontiguousarray(wl.residual_life).tobytes()).hexdigest(),
        "bootstrap": {"seed": cfg.bootstrap_seed, "B": cfg.bootstrap_b,
                      "block": wl.block},
        "capacity": ({"target": cfg.capacity_target, "steps": cfg.capacity_steps,
                      "gpu_price": cfg.gpu_price, "gpus": cfg.gpus} if cfg.capacity else None),
        "upper_bound": cfg.upper_bound,
        "package_version": __version__,
    }


def evidence_id(inputs: dict) -> str:
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()


# ------------------------------------------------------------------------------------ capacity
def _capacity_grid(goodput_grid: np.ndarray, loads, target: float):
    """Per unit: (index of the largest grid load meeting target at every load up to it, or -1)."""
    ok = goodput_grid >= target                         # [L, U]
    prefix_ok = np.cumprod(ok, axis=0).astype(bool)
    n_ok = prefix_ok.sum(axis=0)
    return n_ok - 1


def _capacity(row: Row, wl: Workload, est: list, profile, cfg: BenchConfig, grid: np.ndarray, bar) -> dict:
    """Capacity at SLO of one row: per-unit rho (None = not reached) and censoring flags."""
    loads = list(cfg.loads)
    L, U = grid.shape
    k = _capacity_grid(grid, loads, cfg.capacity_target)
    lo = np.array([loads[i] if i >= 0 else np.nan for i in k])
    hi = np.array([loads[i + 1] if 0 <= i < L - 1 else np.nan for i in k])
    refine = np.flatnonzero(np.isfinite(lo) & np.isfinite(hi))
    for _ in range(cfg.capacity_steps):
        if refine.size == 0:
            bar.update(1)
            continue
        mid = (lo[refine] + hi[refine]) / 2
        traces = [wl.unit_at(int(u), float(r)) for u, r in zip(refine, mid)]
        res = _run_row(row, wl, traces, [est[int(u)] for u in refine], profile, cfg)
        for j, u in enumerate(refine):
            g = res.records(j)["met"][wl.scored[u]].mean()
            if g >= cfg.capacity_target:
                lo[u] = mid[j]
            else:
                hi[u] = mid[j]
        bar.update(1)
    return {"rho": [None if not np.isfinite(x) else float(x) for x in lo],
            "censored": [bool(i == L - 1) for i in k]}


def _capacity_summary(caps: dict, rows: list, wl: Workload, cfg: BenchConfig) -> dict:
    from .metrics import bootstrap_ci
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


# ------------------------------------------------------------------------------------ the report
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
        from .report import report_json
        return report_json(self.data)

    def to_markdown(self) -> str:
        from .report import report_markdown
        return report_markdown(self.data)

    def summary_text(self) -> str:
        from .report import console_summary
        return console_summary(self.data)

    def write(self, out_dir) -> list:
        from .report import write_report
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

    from . import __version__
    from .engine.profiles import load_profile

    t_start = time.time()
    cfg = config
    profile = cfg.engine.resolve(load_profile(cfg.profile))
    wl = prepare_workload(cfg, profile)
    rows = build_rows(cfg)
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
    per_row = {}
    try:
        def one_row(row):
            est = est_oracle if row.reference else est_pred
            res = _run_row(row, wl, copies, est * L, profile, cfg)
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
            from .bounds import upper_bound
            bar.set_postfix_str("upper bound")
            ub = np.empty((L, U))
            for li, rho in enumerate(loads):
                for u, t in enumerate(at[rho]):
                    b = upper_bound(t, profile, config=cfg.engine)
                    m = wl.scored[u]
                    ub[li, u] = min(b.ub, int(b.attainable[m].sum())) / int(m.sum())
            bar.update(1)
        caps = None
        if cfg.capacity:
            caps = {}
            for row in rows:
                bar.set_postfix_str(f"capacity {row.label}")
                grid = np.array([[unit_metrics(o)["goodput"] for o in per_row[row.label][li]] for li in range(L)])
                caps[row.label] = _capacity(row, wl, est_oracle if row.reference else est_pred, profile,
                                            cfg, grid, bar)
    finally:
        bar.close()

    # ---------------------------------------------------------------- aggregate
    qedges = prompt_quintile_edges(np.concatenate([u.prompt_tokens[m] for u, m in zip(wl.units, wl.scored)]))
    block = wl.block
    unit_good = {r.label: np.array([[unit_metrics(o)["goodput"] for o in per_row[r.label][li]]
                                    for li in range(L)]) for r in rows}
    loads_out = []
    curves = {"loads": loads, "goodput": {}, "ttft_cdf": {}}
    for li, rho in enumerate(loads):
        res_rows = []
        g_fcfs = float(unit_good["fcfs"][li].mean())
        ub_mean = float(ub[li].mean()) if ub is not None else None
        for r in rows:
            outs = per_row[r.label][li]
            um = [unit_metrics(o) for o in outs]
            g = unit_good[r.label][li]
            d = {"label": r.label, "policy": r.policy,
                 "shed_margin": _num_or_str(r.shed_margin), "reference": r.reference,
                 "goodput": _ci(g, cfg, block),
                 "relative_goodput": (float(g.mean()) / g_fcfs - 1) if g_fcfs > 0 else None}
            vs = BASELINE_ROWS + (CONTROL_COMPARATORS if r.policy == CONTROLLED else ())
            d["vs"] = {b: _paired(g, unit_good[b][li], cfg, block) for b in vs if b != r.label and b in unit_good}
            if ub_mean is not None:
                d["gap_closed"] = ((float(g.mean()) - g_fcfs) / (ub_mean - g_fcfs)
                                   if ub_mean - g_fcfs >= 0.02 else None)
            tot = lambda k, um=um: int(sum(m[k] for m in um))  # noqa: E731
            d.update({
                "arrived": tot("arrived"), "met": tot("met"), "completed": tot("completed"),
                "shed": tot("shed"), "timed_out": tot("timed_out"), "rejected": tot("rejected"),
                "unfinished": tot("unfinished"), "preemptions": tot("preemptions"),
                "recomputed_tokens": tot("recomputed_tokens"),
                "throughput_tok_s": float(np.mean([m["throughput_tok_s"] for m in um])),
                "met_req_s": float(np.mean([m["met_req_s"] for m in um])),
            })
            d.update(pooled_metrics(outs, qedges, wl.class_names))
            d["goodput_per_unit"] = [float(x) for x in g]
            res_rows.append(d)
            curves["goodput"].setdefault(r.label, []).append(d["goodput"])
            if rho == _primary_load(loads):
                curves["ttft_cdf"][r.label] = np.sort(np.concatenate([o["ttft_ms"] for o in outs]))
        deploy = [d for d in res_rows if not d["reference"]]
        best = max(deploy or res_rows, key=lambda d: d["goodput"]["mean"])
        best_all = max(res_rows, key=lambda d: d["goodput"]["mean"])
        ent = {"rho": rho, "rate_rps": rho * wl.lambda_sat, "rows": res_rows,
               "fcfs_goodput": g_fcfs,
               "best_observed": {"label": best["label"], "goodput": best["goodput"]["mean"]}}
        if best_all is not best:
            ent["best_observed_reference"] = {"label": best_all["label"], "goodput": best_all["goodput"]["mean"]}
        if ub is not None:
            ent["upper_bound"] = {**_ci(ub[li], cfg, block), "per_unit": [float(x) for x in ub[li]],
                                  "gap_closed_printed": ub_mean - g_fcfs >= 0.02}
        loads_out.append(ent)

    primary = None
    if _is_primary_suite(cfg):
        if PRIMARY_LOAD in loads:
            li = loads.index(PRIMARY_LOAD)
            p = _paired(unit_good["index+shed"][li], unit_good["edf+shed"][li], cfg, block)
            primary = {
                "definition": ("paired difference in mean goodput, index with shedding minus EDF with "
                               "shedding, seed-200/test at rho = 1.2, 95% paired percentile bootstrap CI"),
                "split": cfg.split, "rho": PRIMARY_LOAD, "units": U,
                "is_primary_split": cfg.split == PRIMARY_SPLIT and cfg.max_traces is None,
                "index_plus_shed": float(unit_good["index+shed"][li].mean()),
                "edf_plus_shed": float(unit_good["edf+shed"][li].mean()), **p,
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
                     "split": cfg.split if wl.kind == "suite" else None, "units": U,
                     "requests_scored": int(sum(int(m.sum()) for m in wl.scored)),
                     "bootstrap": ("moving-block, block %d" % block) if block else "percentile (independent traces)",
                     "notes": wl.notes},
        "profile": {"name": profile.name, "provenance": profile.provenance},
        "lambda_sat": {"rps": wl.lambda_sat, "source": wl.lambda_sat_source},
        "predictor": wl.predictor.to_dict(),
        "t_ref_ms": wl.t_ref_ms,
        "parameters": _params_note(cfg),
        "baselines": list(BASELINE_ROWS),
        "prompt_quintile_edges": qedges,
        "sla_classes": wl.class_names,
        "primary_load": _primary_load(loads),
        "loads": loads_out,
        "capacity": _capacity_summary(caps, rows, wl, cfg) if caps is not None else None,
        "definitions": DEFINITIONS,
        "evidence_inputs": inputs,
    }
    meta = {"evidence_id": eid, "wall_time_s": round(time.time() - t_start, 3),
            "host": platform.node(), "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "numpy": np.__version__, "argv": list(sys.argv)}
    return BenchReport(cfg, data, meta, curves)


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
        note = (f"TUNED: from {Path(src).name} (tuning/optuna_search.py on {t.get('suite')}/{t.get('split')} "
                f"at rho {t.get('loads')}, {t.get('trials_per_study')} trials per study)")
    elif src is None:
        note = "UNTUNED: default IndexParams"
    else:
        note = f"from {Path(src).name}; not produced by this project's tuning (untuned)"
    return {"index": dataclasses.asdict(cfg.index_params),
            "shed_margins": {p: cfg.shed_margin(p) for p in sorted({*cfg.policies, "edf", "index"})},
            "source": Path(src).name if t is not None else (src or "defaults (IndexParams(), shed margin 0.0)"),
            "tuned": t is not None,
            "note": note}


DEFINITIONS = {
    "goodput": "met / arrived per unit (scored requests), macro mean over units; 95% percentile bootstrap CI",
    "paired": "mean of per-unit differences vs the baseline with its bootstrap CI; win rate counts ties 1/2",
    "latency_all": ("percentiles pool every scored request at the load; no first token (TTFT) or not completed "
                    "(TPOT, E2E) = +inf"),
    "latency_completed": "the same percentiles over completed requests only",
    "sla_respect": "met / completed (pooled)",
    "throughput": "per unit: completed output tokens and met requests per second over the unit's span; mean over units",
    "counts": "preemptions, recomputed tokens, shed, timed out, rejected, unfinished: totals over units",
    "cache_miss": "requests whose prefix chain is empty (nothing they could hit in the prefix cache)",
    "max_wait": "max over scheduled requests of first_scheduled - arrival; never-scheduled requests counted apart",
    "relative_goodput": "goodput / FCFS goodput - 1 at the same load (attainment ratio, not capacity)",
    "upper_bound": "bounds.upper_bound per unit (valid for any policy: a relaxation of the engine that ignores "
                   "its KV-cache limit, so loose on memory-bound profiles), mean over units",
    "gap_closed": "(policy - FCFS) / (UB - FCFS) on suite means, only where UB - FCFS >= 0.02",
    "capacity": "largest grid rho with goodput >= target at every grid rho' <= rho, bisected inside the cell; "
                "suite value = geometric mean of per-unit ratios to FCFS (paired CI)",
}
