"""The workload an evaluation or an env episode runs on (docs/design.md sections 5 and 6): the units
(suite traces, or windows cut from one real trace) at their stored rate, and how to put them at a
load rho: ``lambda_sat`` (FCFS saturation throughput; the suite manifest's, else measured), the
residual-life table of the ``prior`` predictor, T_ref, the suite's predictor and its estimates.

The evaluator (``evaluate.run_benchmark``), the env (``envs``), tuning and the agents' validation
all prepare their workload here, so agents and baselines see the same traces scaled the same way.
``prepare_workload`` takes a ``WorkloadSpec`` (or any config with its fields, such as
``evaluate.BenchConfig``).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Optional

import numpy as np

from .errors import ConfigError

__all__ = ["ADMISSION_WARN", "LAMBDA_SAT_TRACES", "Workload", "WorkloadSpec", "admitted_share", "is_shipped",
           "prepare_workload"]

LAMBDA_SAT_TRACES = 8
#: rejected + capped share of the arrivals past which a report warns (docs/design.md section 10)
ADMISSION_WARN = 0.05


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What a workload is made of: a suite split (``suite``/``split``, at most ``max_traces``
    traces), or windows cut from one real trace (``trace_file`` in ``trace_format``, ``windows``
    scored requests each with ``warmup``/``cooldown`` requests around them), run by the engine
    ``engine`` (an ``EngineConfig``; None = the defaults) when lambda_sat is measured. The
    evaluator's ``BenchConfig`` has these fields (validated there)."""

    suite: str = "seed-200"
    split: str = "test"
    max_traces: Optional[int] = None
    trace_file: Optional[str] = None
    trace_format: Optional[str] = None
    windows: Optional[int] = None
    warmup: int = 0
    cooldown: int = 0
    engine: object = None
    trace_split: Optional[str] = None   # a trace file's time-ordered split (None: every window)
    rate_scale: float = 1.0             # the native load: the trace's own rate times this
    slo_rule: Optional[str] = None      # an SLO rule named by the user: it sets every request's SLOs
    slo_seed: int = 0                   # its class draw's seed (unit i of a suite split: seed + i)
    replicas: int = 1                   # a cluster's (docs/design.md section 12): lambda_sat x R replicas

    def __post_init__(self):
        if self.trace_split is not None and self.trace_split not in ("train", "validation", "test"):
            raise ConfigError(f"trace_split: train, validation or test, got {self.trace_split!r}")
        if self.engine is None:
            from .engine.state import EngineConfig
            object.__setattr__(self, "engine", EngineConfig())
        if self.trace_file is not None and self.windows is None:
            raise ConfigError(f"windows: a real trace needs --windows W >= 1, got {self.windows!r}")

    @classmethod
    def of(cls, config) -> "WorkloadSpec":
        """``config`` itself if a WorkloadSpec, else the spec of its fields of these names (e.g.
        an ``evaluate.BenchConfig``)."""
        if isinstance(config, cls):
            return config
        return cls(**{f.name: getattr(config, f.name, f.default) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Workload:
    """The units (traces or windows) at their stored rate, and how to put them at a load."""

    name: str
    kind: str                       # "suite" or "trace"
    units: list                     # unscaled Trace per unit
    scored: list                    # bool mask per unit
    windows: Optional[list]         # [(lo, hi, scored_start, scored_stop)] in the parent (trace kind)
    parent: object                  # parent Trace (trace kind) or None
    nominal_rps: Optional[float]    # suite: the stored nominal rate; a trace's split: its train part's rate
    lambda_sat: float
    lambda_sat_source: str
    residual_life: np.ndarray
    t_ref_ms: float
    predictor: object               # PredictorSpec
    class_names: list
    digests: list                   # unscaled unit digests (trace kind: the parent's once)
    notes: list = dataclasses.field(default_factory=list)
    # share of the train part's arrivals the engine admits (prompt < max_model_len): loads are
    # admitted loads (docs/design.md section 10), so all arrivals come at rho x lambda_sat / share
    admitted_share: float = 1.0
    # a trace's own timestamps, their rate multiplied by ``rate_scale``, as a load: ``native_rho``
    # (exactly that scale: ``scale_factor``)
    rate_scale: float = 1.0
    native_rho: Optional[float] = None

    def rate(self, rho: float) -> float:
        """All arrivals' rate (req/s) at load ``rho``: the admitted requests' is rho x lambda_sat."""
        r = rho * self.lambda_sat
        return r if self.admitted_share == 1.0 else r / self.admitted_share

    def admission(self, max_model_len: int) -> dict:
        """The evaluated units' scored requests the engine rejects at arrival (prompt >=
        max_model_len) or caps (prompt + output > max_model_len), as shares of the arrivals, and the
        ceiling of any policy's goodput, ``1 - rejected - capped`` (docs/design.md section 10)."""
        s = admission_summary(np.concatenate([u.prompt_tokens[m] for u, m in zip(self.units, self.scored)]),
                              np.concatenate([u.output_tokens[m] for u, m in zip(self.units, self.scored)]),
                              max_model_len)
        return {"max_model_len": int(max_model_len), "rejected_share": s["rejected_share"],
                "capped_share": s["capped_share"], "ceiling": s["ceiling"],
                "admitted_share_train": self.admitted_share, "warning": s["warning"]}

    @property
    def block(self) -> Optional[int]:
        from .metrics import default_block
        return default_block(len(self.units)) if self.kind == "trace" else None

    def unit_at(self, i: int, rho: float):
        from .traces.windows import scale_to_rate, time_scale
        if self.kind == "suite":
            return scale_to_rate(self.units[i], self.rate(rho), nominal_rps=self.nominal_rps)
        # a trace's windows: its parent scaled by ``scale_factor`` (``scale_to_rate``'s own factor,
        # exactly 1 / rate_scale at the native load)
        lo, hi, _, _ = self.windows[i]
        return time_scale(self.parent, self.scale_factor(rho)).subset(slice(lo, hi))

    def scale_factor(self, rho: float):
        """The exact factor (a Fraction) by which ``unit_at(i, rho)`` scales every unit's times (at
        ``native_rho``: exactly 1 / ``rate_scale``)."""
        if self.native_rho is not None and rho == self.native_rho:
            from .traces.windows import as_fraction
            return 1 / as_fraction(self.rate_scale, "rate_scale")
        nominal = self.__dict__.get("_nominal")
        if nominal is None:   # the units' stored rate: a constant of the workload
            from .traces.windows import as_fraction, empirical_rate_rps
            nominal = as_fraction(self.nominal_rps if self.nominal_rps is not None else
                                  empirical_rate_rps(self.parent), "nominal_rps")
            self.__dict__["_nominal"] = nominal
        rate = self.rate(rho)
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
        from .traces.windows import time_scale
        scaled = time_scale(self.parent, self.scale_factor(rho))
        return [scaled.subset(slice(lo, hi)) for lo, hi, _, _ in self.windows]

    def estimates(self, oracle: bool = False) -> list:
        from .predictors import PredictorSpec, estimates
        spec = PredictorSpec("oracle") if oracle else self.predictor
        if self.kind == "suite":
            return [estimates(t, spec) for t in self.units]
        e = estimates(self.parent, spec)
        return [e[lo:hi].copy() for lo, hi, _, _ in self.windows]


def _cluster_lambda(lam: float, src: str, replicas: int) -> tuple:
    """A cluster's lambda_sat: the sum over its R replicas of one's (docs/design.md section 12)."""
    return (lam, src) if replicas == 1 else (lam * replicas, f"{src} x {replicas} replicas")


def _measure_lambda(traces, profile, engine) -> float:
    from .engine.saturation import measure_lambda_sat
    return float(measure_lambda_sat(list(traces)[:LAMBDA_SAT_TRACES], profile, engine))


def _class_names(spec_sla, n_hint: int) -> list:
    try:
        return [c.name for c in spec_sla.classes]
    except AttributeError:
        return [f"class {i}" for i in range(n_hint)]


def is_shipped(profile) -> bool:
    """Whether ``profile`` is the shipped profile of its name, field for field (a suite manifest's
    ``lambda_sat`` is keyed by name: a file reusing a shipped name, or a profile with engine
    overrides applied, has its own saturation rate)."""
    from .engine.profiles import is_profile_file, list_profiles, load_profile
    if is_profile_file(profile.name) or profile.name not in list_profiles():
        return False
    return load_profile(profile.name).to_dict() == profile.to_dict()


def prepare_workload(spec, profile) -> Workload:
    """The workload of ``spec`` (a ``WorkloadSpec``, or a config with its fields such as
    ``evaluate.BenchConfig``) for ``profile`` (resolved: ``EngineConfig.resolve``), see the module
    docstring."""
    from .predictors import PredictorSpec, ResidualLife

    cfg = WorkloadSpec.of(spec)

    if cfg.trace_file is None:
        from .traces.suites import load_suite
        suite = load_suite(cfg.suite)
        traces = suite.traces(cfg.split)
        if cfg.max_traces is not None:
            traces = traces[:cfg.max_traces]
        if not traces:
            raise ConfigError(f"suite {cfg.suite!r} split {cfg.split!r} has no traces")
        train_split = "train" if "train" in suite.splits else suite.splits[0]
        train = suite.traces(train_split)
        notes = []
        if cfg.slo_rule is not None:   # the user's rule replaces the suite's SLOs (docs/design.md section 10)
            from .traces.slo_rules import apply_slo_rule, load_slo_rule
            rule = load_slo_rule(cfg.slo_rule)
            traces = [apply_slo_rule(t, rule, seed=cfg.slo_seed + i, profile=profile, explicit=True)[0]
                      for i, t in enumerate(traces)]
            train = [apply_slo_rule(t, rule, seed=cfg.slo_seed + i, profile=profile, explicit=True)[0]
                     for i, t in enumerate(train)]
            notes.append(f"SLOs and priorities from rule {rule.name} (given"
                         + (f"; unit i drawn with seed {cfg.slo_seed} + i" if rule.by_shares else "")
                         + "), the suite's own replaced")
        if not all(t.has_slos for t in traces):
            raise ConfigError(f"suite {cfg.suite!r}: traces without SLOs cannot be scored")
        lam = suite.lambda_sat.get(profile.name)
        shipped = lam is None or is_shipped(profile)
        if lam is not None and shipped:
            lam, src = float(lam), f"suite manifest ({profile.name})"
        else:
            lam = _measure_lambda(train, profile, cfg.engine)
            src = (f"measured (measure_lambda_sat, FCFS backlogged) on {min(len(train), LAMBDA_SAT_TRACES)} "
                   f"{train_split} traces: " + (f"the manifest has no entry for {profile.name}" if shipped else
                                                 f"the manifest's entry for {profile.name} is the shipped profile's, "
                                                 f"and this one differs from it"))
        lam, src = _cluster_lambda(lam, src, cfg.replicas)
        rl = ResidualLife.from_lengths(np.concatenate([t.output_tokens for t in train])).table
        share = admitted_share(train, profile)
        t_ref = suite.t_ref_ns if cfg.slo_rule is None else float(np.median(np.concatenate(
            [t.ttft_slo_ns for t in train])))
        if t_ref is None:
            t_ref = float(np.median(np.concatenate([t.ttft_slo_ns for t in traces])))
            notes.append("T_ref = median T1 of the evaluated traces (the manifest records none)")
        sla = getattr(suite.spec.generator, "sla", None) if cfg.slo_rule is None else rule
        ncls = int(max(int(t.class_id.max()) for t in traces)) + 1
        notes += _unit_notes(len(traces))
        return Workload(suite.name, "suite", traces, [np.ones(len(t), bool) for t in traces], None, None,
                        float(suite.nominal_rate_rps), lam, src, rl, float(t_ref) / 1e6,
                        PredictorSpec.from_dict(suite.predictor), _class_names(sla, ncls),
                        [t.digest for t in traces], notes, share)
    # a real trace family: windows cut from one trace
    from .traces.io import load_trace
    from .traces.slo_rules import DEFAULT_RULE, apply_slo_rule, load_slo_rule
    trace, _ = load_trace(cfg.trace_file, cfg.trace_format)
    # the trace's own SLOs and priority are kept unless the user names a rule (docs/design.md section
    # 10); SLOs relative to a profile at the deployment's (resolved) configuration
    rule = load_slo_rule(cfg.slo_rule if cfg.slo_rule is not None else DEFAULT_RULE)
    trace, note = apply_slo_rule(trace, rule, seed=cfg.slo_seed, profile=profile, explicit=cfg.slo_rule is not None)
    notes = [note]
    parts = trace_parts(trace, cfg)
    train_wins = parts["train"][1]
    part, wins = parts[cfg.trace_split or "all"]
    # the load's reference rate from the train part's first windows, however many are evaluated (so
    # that rho means the same with any --max-traces and on every split)
    lam_units = [w.trace for w in train_wins if len(w.trace) >= 10][:LAMBDA_SAT_TRACES]
    if cfg.max_traces is not None:
        wins = wins[:cfg.max_traces]
    if not wins:
        R = cfg.replicas   # (a cluster's window: W x R requests)
        raise ConfigError(f"trace {cfg.trace_file!r}: no window of {cfg.windows} scored requests fits "
                          f"(warmup {cfg.warmup}, cooldown {cfg.cooldown}, {len(trace)} requests"
                          + (f"; --windows {cfg.windows // R} x {R} replicas" if R > 1 else "") + ")")
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
    src = f"measured (measure_lambda_sat, FCFS backlogged) on the {'train part' if cfg.trace_split else 'trace'}'s " \
          f"first {len(lam_units)} windows"
    lam, src = _cluster_lambda(lam, src, cfg.replicas)
    # everything fitted comes from the train part (docs/design.md section 10, "No leakage")
    train = parts["train"][0]
    rl = ResidualLife.from_lengths(train.output_tokens).table
    notes.append("residual-life table (prior predictor) and T_ref from the trace's "
                 + ("train part (its first 60% of requests)" if cfg.trace_split else "own output lengths and SLOs"))
    notes += _unit_notes(len(units))
    ncls = int(trace.class_id.max()) + 1
    nominal = None
    if cfg.trace_split is not None:   # one time factor for every part: the train part's rate
        from .traces.windows import empirical_rate_rps
        nominal = empirical_rate_rps(train)
    share = admitted_share(lam_units, profile)
    wl = Workload(trace.name, "trace", units, scored, spans, part, nominal, lam, src, rl,
                  float(np.median(train.ttft_slo_ns)) / 1e6, default_predictor(),
                  _class_names(rule, ncls), [trace.digest], notes, share)
    if cfg.trace_split is not None:
        # the train part's own admitted rate, times rate_scale, relative to lambda_sat
        wl.rate_scale = float(cfg.rate_scale)
        wl.native_rho = float(cfg.rate_scale) * nominal * share / lam
    return wl


#: the time-ordered split of a trace file's requests (docs/design.md section 10): train, validation, test
TRACE_SPLITS = (("train", 3, 5), ("validation", 4, 5), ("test", 5, 5))
MIN_SPLIT_WINDOWS = 5


def trace_parts(trace, spec) -> dict:
    """{"all" | split name: (part Trace, its windows)}: the whole trace ("all", also "train"), or (with
    ``spec.trace_split``) its requests split by time into the first 60% (train), the next 20% (validation) and the last
    20% (test), each cut into windows on its own (warm-up and cool-down stay inside their part). A
    split with fewer than 5 windows is an error giving the counts and the largest W that yields 5.
    Without a split, "train" is the whole trace (bench on a trace file: everything is fitted to it)."""
    from .traces.windows import cut_windows
    if spec.trace_split is None:
        whole = (trace, cut_windows(trace, spec.windows, spec.warmup, spec.cooldown))
        return {"all": whole, "train": whole}
    n, lo, out = len(trace), 0, {}
    for name, num, den in TRACE_SPLITS:
        hi = n * num // den
        part = trace.subset(slice(lo, hi))
        out[name] = (part, cut_windows(part, spec.windows, spec.warmup, spec.cooldown, drop_partial=True)
                     if len(part) > spec.warmup + spec.cooldown else [])
        lo = hi
    counts = {name: len(out[name][1]) for name, _, _ in TRACE_SPLITS}
    if min(counts.values()) < MIN_SPLIT_WINDOWS:
        smallest = min(len(out[name][0]) for name, _, _ in TRACE_SPLITS)
        R = spec.replicas   # (a cluster's windows are W x R requests: the hint in the user's W)
        w_max = (smallest - spec.warmup - spec.cooldown) // MIN_SPLIT_WINDOWS // R
        raise ConfigError(f"trace {trace.name!r}: windows per split {counts} with --windows {spec.windows // R} "
                          + (f"x {R} replicas " if R > 1 else "")
                          + f"(warm-up {spec.warmup // R}, cool-down {spec.cooldown // R}); every split needs at least "
                          f"{MIN_SPLIT_WINDOWS}: " + (f"use --windows {w_max} or less" if w_max >= 1 else
                                                      "the trace is too short for these warm-up and cool-down"))
    return out


def admission_summary(prompt, output, max_model_len) -> dict:
    """The shares of these requests the engine rejects or length-caps (``engine.state.length_denied``),
    the ceiling ``1 - rejected - capped`` of any policy's goodput, and whether a report warns."""
    from .engine.state import length_denied
    rejected, capped = length_denied(prompt, output, max_model_len)
    n = max(1, rejected.size)
    r, c = float(rejected.sum()) / n, float(capped.sum()) / n
    return {"rejected_share": r, "capped_share": c, "ceiling": 1.0 - r - c, "warning": bool(r + c > ADMISSION_WARN)}


def admitted_share(traces, profile) -> float:
    """Share of the requests of ``traces`` (a train part) that ``profile`` (resolved) admits: prompt
    < max_model_len (the engine rejects the others at arrival, docs/design.md section 3, rule 8).
    Exactly 1.0 when every request is admitted."""
    from .engine.state import length_denied
    rejected, _ = length_denied(np.concatenate([t.prompt_tokens for t in traces]),
                                np.concatenate([t.output_tokens for t in traces]), profile.max_model_len)
    admitted = int((~rejected).sum())
    if admitted == 0:
        raise ConfigError(f"every request of the workload's train part is rejected: prompts >= the profile's "
                          f"max_model_len {profile.max_model_len} (give --max-model-len or another profile)")
    return 1.0 if admitted == rejected.size else admitted / rejected.size


def _unit_notes(n_units: int) -> list:
    """A warning for the report when its 95% CIs cannot mean anything: they resample the independent
    units (traces or windows), so one unit gives intervals of zero width."""
    if n_units >= 5:
        return []
    if n_units >= 2:
        return [f"only {n_units} traces or windows: the 95% CIs below resample so few units that they mean "
                f"little (they may have zero width; use 20 or more)"]
    return ["only one trace or window: every 95% CI below has zero width (the bootstrap resamples the "
            "independent units; use at least two, preferably 20 or more)"]


def default_predictor():
    """The predictor of a real trace's workload (no suite to name one): noisy, sigma 0.5, seed 0."""
    from .predictors import PredictorSpec
    return PredictorSpec("noisy", 0.5, 0)
