"""Policies: names, parameters and their ranges, and the scalar drop-in (docs/design.md section 4).

The formulas themselves live in ``tokenbatch_env.engine.scoring`` (the engine evaluates them for
every request each iteration); this module validates parameters and offers the same formulas to
other schedulers through ``score_request_priority``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import numpy as np

from .engine import scoring as _s
from .engine._jit import guard_stale_cache
from .errors import PolicyError

#: docs/design.md section 4 ranges: name -> (low, high, scale)
INDEX_RANGES = {
    "kappa": (0.0, 10.0, "linear"),
    "slope": (1e-2, 1e2, "log"),
    "gamma": (0.0, 1e3, "log1p"),
    "theta": (0.0, 1.0, "linear"),
    "beta": (0.0, 1e3, "linear"),
    "w_prefix": (0.0, 5.0, "linear"),
    "a_edf": (0.0, 10.0, "linear"),
}
SHED_RANGE = (0.0, 2.0)


@dataclasses.dataclass(frozen=True)
class IndexParams:
    """Gittins-barrier index coefficients (defaults: a plain SRPT-like index with a mild boost)."""

    kappa: float = 1.0
    slope: float = 1.0
    gamma: float = 10.0
    theta: float = 0.2
    beta: float = 1.0
    w_prefix: float = 1.0
    a_edf: float = 0.0

    def __post_init__(self):
        for name, (lo, hi, _) in INDEX_RANGES.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise PolicyError(f"index parameter {name} must be a number, got {v!r}")
            if not math.isfinite(float(v)) or not lo <= float(v) <= hi:
                raise PolicyError(f"index parameter {name}={v!r} outside its range [{lo}, {hi}]")

    @classmethod
    def from_dict(cls, d: dict) -> "IndexParams":
        unknown = set(d) - set(INDEX_RANGES)
        if unknown:
            raise PolicyError(f"unknown index parameter(s) {sorted(unknown)}; valid: {sorted(INDEX_RANGES)}")
        kw = {}
        for k, v in d.items():
            try:
                if isinstance(v, bool):
                    raise TypeError
                kw[k] = float(v)
            except (TypeError, ValueError):
                raise PolicyError(f"index parameter {k}: expected a number, got {v!r}") from None
        return cls(**kw)

    def theta_vector(self, t_ref_ms: float) -> np.ndarray:
        """The engine's parameter vector (layout of ``engine.scoring``)."""
        if not (math.isfinite(t_ref_ms) and t_ref_ms > 0):
            raise PolicyError(f"T_ref must be a positive number of ms, got {t_ref_ms!r}")
        v = np.zeros(_s.N_THETA)
        v[_s.I_KAPPA], v[_s.I_SLOPE], v[_s.I_GAMMA] = self.kappa, self.slope, self.gamma
        v[_s.I_THETA], v[_s.I_BETA], v[_s.I_W_PREFIX] = self.theta, self.beta, self.w_prefix
        v[_s.I_A_EDF], v[_s.I_T_REF_MS] = self.a_edf, t_ref_ms
        return v


#: the weight range of the ``weights`` policy (per feature; only the direction w/|w| matters)
WEIGHT_RANGE = (-1.0, 1.0)


@dataclasses.dataclass(frozen=True)
class LinearWeights:
    """The ``weights`` policy: score = (w/|w|) . f over ``engine.scoring.LINEAR_FEATURES``.
    Default: -e0, i.e. shortest estimated service first (SJF's order)."""

    w: tuple = (-1.0,) + (0.0,) * (_s.N_WEIGHTS - 1)

    def __post_init__(self):
        w = self.w
        if isinstance(w, dict):
            unknown = set(w) - set(_s.LINEAR_FEATURES)
            if unknown:
                raise PolicyError(f"unknown weight(s) {sorted(unknown)}; valid: {list(_s.LINEAR_FEATURES)}")
            w = [w.get(n, 0.0) for n in _s.LINEAR_FEATURES]
        if isinstance(w, (str, bytes)) or not hasattr(w, "__len__") or len(w) != _s.N_WEIGHTS:
            raise PolicyError(f"weights: need {_s.N_WEIGHTS} numbers ({', '.join(_s.LINEAR_FEATURES)}), "
                              f"got {self.w!r}")
        out = []
        for name, v in zip(_s.LINEAR_FEATURES, w):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
                    or not math.isfinite(float(v)):
                raise PolicyError(f"weight {name} must be a finite number, got {v!r}")
            out.append(float(v))
        object.__setattr__(self, "w", tuple(out))

    @classmethod
    def from_dict(cls, d) -> "LinearWeights":
        """``{"w": [8 numbers] or {feature: weight}}`` or ``{feature: weight}``."""
        if isinstance(d, dict) and set(d) == {"w"}:
            d = d["w"]
        return cls(d)

    def to_dict(self) -> dict:
        return {"w": dict(zip(_s.LINEAR_FEATURES, self.w))}

    def theta_vector(self, t_ref_ms: float) -> np.ndarray:
        if not (math.isfinite(t_ref_ms) and t_ref_ms > 0):
            raise PolicyError(f"T_ref must be a positive number of ms, got {t_ref_ms!r}")
        v = np.zeros(_s.N_THETA)
        v[:_s.N_WEIGHTS] = self.w
        v[_s.I_LIN_T_REF_MS] = t_ref_ms
        return v


@dataclasses.dataclass(frozen=True)
class IndexSchedule:
    """``index-scheduled`` (docs/design.md section 8): one tuned index (and shed margin) per load bucket,
    chosen at each decision epoch from the observed arrival rate (arrivals in the last 10 s over
    lambda_sat, i.e. an estimate of rho; ``envs`` observation entry ``arrival_rate``). Bucket i
    covers [edges[i-1], edges[i]) with edges[-1] = 0 and edges[B-1] = inf. ``loads``: the rho each
    bucket was tuned at (for the report)."""

    edges: tuple            # B - 1 increasing rho boundaries
    params: tuple           # B IndexParams
    margins: tuple          # B shed margins (None = no shedding)
    loads: tuple = ()       # B tuning loads (informational)

    def __post_init__(self):
        B = len(self.params)
        if B < 1 or len(self.edges) != B - 1 or len(self.margins) != B:
            raise PolicyError(f"index-scheduled: need B parameter sets, B margins and B - 1 edges, got "
                              f"{B}, {len(self.margins)}, {len(self.edges)}")
        e = [float(x) for x in self.edges]
        if any(not math.isfinite(x) or x <= 0 for x in e) or any(b <= a for a, b in zip(e, e[1:])):
            raise PolicyError(f"index-scheduled: edges must be finite, > 0 and increasing, got {self.edges!r}")
        for p in self.params:
            if not isinstance(p, IndexParams):
                raise PolicyError("index-scheduled: params must be IndexParams")
        object.__setattr__(self, "edges", tuple(e))
        object.__setattr__(self, "margins", tuple(check_shed_margin(m) for m in self.margins))

    @classmethod
    def from_loads(cls, loads, params, margins) -> "IndexSchedule":
        """Buckets around tuning loads: edges at the geometric midpoints of consecutive loads."""
        loads = [float(x) for x in loads]
        edges = tuple(math.sqrt(a * b) for a, b in zip(loads, loads[1:]))
        return cls(edges, tuple(params), tuple(margins), tuple(loads))

    def bucket(self, rate_rho) -> np.ndarray:
        """Bucket index of each observed rate (array)."""
        return np.searchsorted(np.asarray(self.edges), np.asarray(rate_rho, float), side="right")

    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "loads": list(self.loads),
                "index": [dataclasses.asdict(p) for p in self.params],
                "shed_margin": ["inf" if m is None else m for m in self.margins]}

    @classmethod
    def from_dict(cls, d: dict) -> "IndexSchedule":
        if not isinstance(d, dict) or not {"edges", "index", "shed_margin"} <= set(d):
            raise PolicyError("index-scheduled: need an object with edges, index (list) and shed_margin (list)")
        margins = [None if m in ("inf", None) else float(m) for m in d["shed_margin"]]
        return cls(tuple(d["edges"]), tuple(IndexParams.from_dict(p) for p in d["index"]), tuple(margins),
                   tuple(d.get("loads", ())))


# --------------------------------------------------------------------------- the registry
#: engine modes of ``engine.kernel`` (MODE_FCFS, MODE_PRIORITY, MODE_SCORE) by name
ENGINE_MODES = ("fcfs", "priority", "score")
#: in-engine score functions of ``engine.scoring.policy_score`` (P_*) by name
KERNEL_IDS = {"external": _s.P_EXTERNAL, "sjf": _s.P_SJF, "edf": _s.P_EDF, "llf": _s.P_LLF,
              "index": _s.P_INDEX, "gittins": _s.P_GITTINS, "linear": _s.P_LINEAR}
#: what tuning searches for a policy: its shed margin, the index's parameters (and margin), the
#: weights (and margin), or nothing (reference rows)
TUNED_KINDS = ("margin", "index", "weights", "")


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """One registered policy: all that the command-line help, the evaluator, tuning, the env and the
    vLLM plug-in know about it (docs/design.md section 4). Adding a policy is one entry in
    ``POLICIES`` plus its score function in ``engine.scoring.policy_score``.

    Attributes:
        name: the policy's name on the command line and in reports.
        engine_mode: "fcfs" or "priority" (vLLM's own queues, no scores) or "score" (ranked by the
            in-engine score ``kernel_id``).
        kernel_id: a key of ``KERNEL_IDS``: the score function ("external" for the two vLLM modes).
        params: the parameter class (``IndexParams``, ``LinearWeights``) or None.
        ranges: parameter name -> (low, high, scale) of its tunable parameters.
        shed_row: whether the evaluator adds a ``<name>+shed`` row (the common shed rule).
        deployable: False for reference rows that read true output lengths (oracles).
        tuned: what tuning searches (``TUNED_KINDS``).
        in_plugin: whether the vLLM plug-in runs it (score policies vLLM cannot express itself).
        levers: the engine levers tuned with it (iteration size; none yet).
        summary: one line for help texts.
    """

    name: str
    engine_mode: str
    kernel_id: str
    params: Optional[type] = None
    ranges: tuple = ()
    shed_row: bool = True
    deployable: bool = True
    tuned: str = "margin"
    in_plugin: bool = True
    levers: tuple = ()
    summary: str = ""

    def __post_init__(self):
        if self.engine_mode not in ENGINE_MODES or self.kernel_id not in KERNEL_IDS or self.tuned not in TUNED_KINDS:
            raise PolicyError(f"policy {self.name!r}: bad registry entry")
        object.__setattr__(self, "ranges", tuple(dict(self.ranges).items()))

    @property
    def range_map(self) -> dict:
        return dict(self.ranges)


POLICIES = {s.name: s for s in (
    PolicySpec("fcfs", "fcfs", "external", in_plugin=False, summary="vLLM's FCFS queue"),
    PolicySpec("priority", "priority", "external", in_plugin=False,
               summary="vLLM's priority queue (the trace's priority column, then arrival)"),
    PolicySpec("sjf", "score", "sjf", summary="shortest estimated service first"),
    PolicySpec("srpt-oracle", "score", "sjf", deployable=False, tuned="",
               summary="sjf fed true output lengths (reference only)"),
    PolicySpec("edf", "score", "edf", summary="earliest TTFT deadline first"),
    PolicySpec("llf", "score", "llf", summary="least slack first"),
    PolicySpec("empirical-gittins", "score", "gittins", tuned="", in_plugin=False,
               summary="Gittins rank of the remaining service under the family's output distribution"),
    PolicySpec("index", "score", "index", IndexParams, INDEX_RANGES, tuned="index",
               summary="the Gittins-barrier index"),
    PolicySpec("weights", "score", "linear", LinearWeights,
               tuple((f, WEIGHT_RANGE + ("linear",)) for f in _s.LINEAR_FEATURES), tuned="weights",
               in_plugin=False, summary="a linear score over the request features (w/|w|)"),
)}
#: every registered policy's name, in registry order
BASELINES = tuple(POLICIES)


def policy_spec(name: str) -> PolicySpec:
    """The registry entry of ``name``; an unknown name raises ``PolicyError`` listing the valid ones."""
    return POLICIES[check_policy_name(name)]


def policy_names(*, engine_mode: Optional[str] = None, tuned: Optional[str] = None,
                 in_plugin: Optional[bool] = None, parametric: Optional[bool] = None) -> tuple:
    """Registered names (registry order) whose entries match every given attribute."""
    return tuple(s.name for s in POLICIES.values()
                 if (engine_mode is None or s.engine_mode == engine_mode)
                 and (tuned is None or s.tuned == tuned)
                 and (in_plugin is None or s.in_plugin == in_plugin)
                 and (parametric is None or (s.params is not None) == parametric))


def vllm_modes() -> tuple:
    """The policies vLLM's own scheduler runs (its two queue orders, no score)."""
    return tuple(s.name for s in POLICIES.values() if s.engine_mode != "score")


def check_shed_margin(m: Optional[float]) -> Optional[float]:
    """None or inf = no shedding; else a number in [0, 2]."""
    if m is None or (isinstance(m, float) and math.isinf(m) and m > 0):
        return None
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) \
            or not SHED_RANGE[0] <= m <= SHED_RANGE[1]:
        raise PolicyError(f"shed_margin must be in [{SHED_RANGE[0]}, {SHED_RANGE[1]}] or inf, got {m!r}")
    return float(m)


def check_policy_name(name: str) -> str:
    if name not in BASELINES:
        raise PolicyError(f"unknown policy {name!r}; valid: {', '.join(BASELINES)}")
    return name


# --------------------------------------------------------------------------- the scalar drop-in
@dataclasses.dataclass(frozen=True)
class DropInParams:
    """Everything ``score_request_priority`` needs besides the request: the index coefficients and
    the engine constants they are scaled by (take them from a profile with ``from_profile``)."""

    index: IndexParams
    u_p_ms: float               # ms per prefill token at a full batch: c0/B + c_prefill
    u_d_ms: float               # ms per decode token at a full batch: c0/B + c_decode
    budget: int                 # B, max_num_batched_tokens
    usable_blocks: int
    block_size: int
    t_ref_ms: float             # suite-wide median T1
    cost_ps: tuple = ()         # the profile's integer-ps cost coefficients (prefill time)

    @classmethod
    def from_profile(cls, profile, index: IndexParams, t_ref_ms: float) -> "DropInParams":
        u_p, u_d = profile.cost.per_token_ms(profile.max_num_batched_tokens)
        return cls(index, u_p, u_d, profile.max_num_batched_tokens, profile.usable_blocks,
                   profile.block_size, float(t_ref_ms), tuple(int(x) for x in profile.cost.ps))

    @functools.cached_property
    def _arrays(self) -> tuple:
        """(theta vector, integer-ps cost coefficients), built once per params object."""
        ps = np.zeros(4, np.int64)
        ps[:len(self.cost_ps[:4])] = self.cost_ps[:4]
        return self.index.theta_vector(self.t_ref_ms), ps


@_s.njit
def _drop_in(p, d, wait_ms, t1_ms, free_blocks, ratio, theta, ps, u_p, u_d, budget, usable, bs):
    """The features the kernel computes for a waiting request without a first token, then its
    ``policy_score`` (kernel.py, "In-engine scores")."""
    done = 0
    if ratio > 0.0 and ratio < 1.0:  # cached tokens ahead of the remaining prefill (hits * bs in the engine)
        done = int(round(ratio * p / (1.0 - ratio)))
    d_left = d if d > 1.0 else 1.0
    s_ms = _s.service_ms(float(p), d_left, u_p, u_d)
    to_deadline = t1_ms - wait_ms
    slack = to_deadline - _s.prefill_time_ns(p, done, budget, ps) / 1e6
    blocks = (p + bs - 1) // bs
    # (np.bool_ and queue_pos given: the kernel's argument types, so one compiled variant)
    return _s.policy_score(_s.P_INDEX, theta, ratio, s_ms, d_left, slack, t1_ms, np.bool_(False),
                           free_blocks / usable, float(blocks), float(usable), to_deadline, 0.0,
                           float(bs), 0.0)


# ``_drop_in`` links the engine's score formula (scoring.py): flush its cached machine code when any
# engine source changes, as the engine's own functions are
guard_stale_cache([_drop_in], tag="policies")


def score_request_priority(prompt_len, est_decode_len, wait_time_ms, sla_target_ms, free_kv_blocks,
                           active_batch_tokens, prefix_shared_ratio, *, params: DropInParams) -> float:
    """The brief's signature, for any engine's scheduling loop: higher = schedule first.

    Equals the engine's in-engine ``index`` score (``engine.scoring.policy_score``, the same
    compiled function the kernel calls) of a waiting request that has no first token yet, to rtol
    1e-12 (bitwise when the inputs are the engine's own), so sorting by (score desc, arrival asc,
    id asc) reproduces the engine's order; ``tests/test_policies.py`` checks both on random
    features and against scores captured from a real ``simulate`` run.

    Inputs (the engine's features, docs/design.md section 4):

    - ``prompt_len``: prefill tokens still to compute (prompt minus cached prefix hits), an int.
    - ``est_decode_len``: estimated output tokens (the engine floors the remaining decode at 1).
    - ``wait_time_ms``: now - arrival; ``sla_target_ms``: the request's TTFT SLO T1.
    - ``free_kv_blocks``: free KV blocks (cached blocks in the free queue count as free).
    - ``active_batch_tokens``: accepted and ignored (the index prices KV pressure through
      ``free_kv_blocks`` instead).
    - ``prefix_shared_ratio``: cached prefix tokens / prompt tokens. The cached tokens ahead of
      the remaining prefill are recovered as ``ratio * prompt_len / (1 - ratio)`` (they enter the
      idle-prefill time through the attention term, exactly as in the engine).

    ``params`` (``DropInParams.from_profile(profile, IndexParams(...), t_ref_ms)``) carries the
    coefficients and the profile constants; build it once and reuse it (the theta vector is cached
    on it). Slack = T1 - wait - idle_prefill(prompt_len); the TTFT tier (slack < 0 -> served after
    live requests) is the caller's: see ``request_tier``.

    Cost: about 2 us per call from Python on the reference machine (one compiled call, mostly
    numba's argument dispatch; the score itself is ~130-180 ns), measured by
    ``benchmarks/bench_dropin.py``. Raises ``PolicyError`` on a NaN score."""
    del active_batch_tokens
    theta, ps = params._arrays
    score = _drop_in(int(prompt_len), float(est_decode_len), float(wait_time_ms), float(sla_target_ms),
                     float(free_kv_blocks), float(prefix_shared_ratio), theta, ps, params.u_p_ms,
                     params.u_d_ms, int(params.budget), int(params.usable_blocks), int(params.block_size))
    if score != score:
        raise PolicyError("index score is NaN for this request (check the inputs)")
    return score


def request_tier(prompt_len, wait_time_ms, sla_target_ms, prefix_shared_ratio=0.0, *,
                 params: DropInParams) -> int:
    """The engine's tier of a waiting request without a first token: -1 if its TTFT is already lost
    (slack < 0; served only when no live request can use the slot), else 0. Sort by (tier desc,
    score desc, arrival asc, id asc)."""
    p, ratio = int(prompt_len), float(prefix_shared_ratio)
    done = int(round(ratio * p / (1.0 - ratio))) if 0.0 < ratio < 1.0 else 0
    slack = float(sla_target_ms) - float(wait_time_ms) - \
        _s.prefill_time_ns(p, done, int(params.budget), params._arrays[1]) / 1e6
    return -1 if slack < 0.0 else 0


# --------------------------------------------------------------------------- engine policies
def engine_ids(name: str) -> tuple[int, int]:
    """(engine mode, in-engine policy id) of a registered policy."""
    from .engine import kernel as K
    spec = policy_spec(name)
    mode = {"fcfs": K.MODE_FCFS, "priority": K.MODE_PRIORITY, "score": K.MODE_SCORE}[spec.engine_mode]
    return mode, KERNEL_IDS[spec.kernel_id]


def engine_policy(name: str, *, params: Optional[IndexParams] = None, shed_margin=None,
                  t_ref_ms: float = 1000.0, weights: Optional[LinearWeights] = None):
    """The engine's form of a named policy. ``srpt-oracle`` is ``sjf`` fed true lengths (the
    caller must pass the oracle predictor's estimates); ``empirical-gittins`` reads the family's
    output-length distribution from the run's residual-life table (``simulate(...,
    residual_life=)``; deployable: no per-request lengths); ``index`` uses ``params`` (defaults if
    None) scaled by the suite-wide ``t_ref_ms``; ``weights`` uses ``weights`` (``LinearWeights``,
    default SJF's direction). ``shed_margin``: None/inf = no shedding. Bad
    parameters raise ``PolicyError`` naming the policy."""
    from .engine.simulate import EnginePolicy

    mode, pid = engine_ids(name)
    try:
        theta = None
        if name == "index":
            theta = (params or IndexParams()).theta_vector(t_ref_ms)
        elif name == "weights":
            theta = (weights or LinearWeights()).theta_vector(t_ref_ms)
        margin = check_shed_margin(shed_margin)
    except PolicyError as e:
        raise PolicyError(f"policy {name!r}: {e}") from None
    label = name if margin is None else f"{name}+shed({margin:g})"
    return EnginePolicy(label, mode, pid, theta, margin)
