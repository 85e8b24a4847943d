"""Policies: names, parameters and their ranges, and the scalar drop-in (DESIGN.md section 4).

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
from .errors import PolicyError

#: name -> (in-engine id, needs parameters)
BASELINES = ("fcfs", "priority", "sjf", "srpt-oracle", "edf", "llf", "empirical-gittins", "index")

#: DESIGN.md section 4 ranges: name -> (low, high, scale)
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
        return cls(**{k: float(v) for k, v in d.items()})

    def theta_vector(self, t_ref_ms: float) -> np.ndarray:
        """The engine's parameter vector (layout of ``engine.scoring``)."""
        if not (math.isfinite(t_ref_ms) and t_ref_ms > 0):
            raise PolicyError(f"T_ref must be a positive number of ms, got {t_ref_ms!r}")
        v = np.zeros(_s.N_INDEX_PARAMS)
        v[_s.I_KAPPA], v[_s.I_SLOPE], v[_s.I_GAMMA] = self.kappa, self.slope, self.gamma
        v[_s.I_THETA], v[_s.I_BETA], v[_s.I_W_PREFIX] = self.theta, self.beta, self.w_prefix
        v[_s.I_A_EDF], v[_s.I_T_REF_MS] = self.a_edf, t_ref_ms
        return v


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
    slack = to_deadline - _s.idle_prefill_ns(p, done, budget, ps) / 1e6
    blocks = (p + bs - 1) // bs
    return _s.policy_score(_s.P_INDEX, theta, ratio, s_ms, d_left, slack, t1_ms, False,
                           free_blocks / usable, float(blocks), float(usable), to_deadline, 0.0,
                           float(bs))


def score_request_priority(prompt_len, est_decode_len, wait_time_ms, sla_target_ms, free_kv_blocks,
                           active_batch_tokens, prefix_shared_ratio, *, params: DropInParams) -> float:
    """The brief's signature, for any engine's scheduling loop: higher = schedule first.

    Equals the engine's in-engine ``index`` score (``engine.scoring.policy_score``, the same
    compiled function the kernel calls) of a waiting request that has no first token yet, to rtol
    1e-12 (bitwise when the inputs are the engine's own), so sorting by (score desc, arrival asc,
    id asc) reproduces the engine's order; ``tests/test_policies.py`` checks both on random
    features and against scores captured from a real ``simulate`` run.

    Inputs (the engine's features, DESIGN.md section 4):

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
        _s.idle_prefill_ns(p, done, int(params.budget), params._arrays[1]) / 1e6
    return -1 if slack < 0.0 else 0


# --------------------------------------------------------------------------- engine policies
#: policy name -> (engine mode, in-engine policy id)
def _engine_ids(name: str) -> tuple[int, int]:
    from .engine import kernel as K
    table = {"fcfs": (K.MODE_FCFS, _s.P_EXTERNAL), "priority": (K.MODE_PRIORITY, _s.P_EXTERNAL),
             "sjf": (K.MODE_SCORE, _s.P_SJF), "srpt-oracle": (K.MODE_SCORE, _s.P_SJF),
             "edf": (K.MODE_SCORE, _s.P_EDF), "llf": (K.MODE_SCORE, _s.P_LLF),
             "empirical-gittins": (K.MODE_SCORE, _s.P_GITTINS),
             "index": (K.MODE_SCORE, _s.P_INDEX)}
    return table[check_policy_name(name)]


def engine_policy(name: str, *, params: Optional[IndexParams] = None, shed_margin=None,
                  t_ref_ms: float = 1000.0):
    """The engine's form of a named policy. ``srpt-oracle`` is ``sjf`` fed true lengths (the
    caller must pass the oracle predictor's estimates); ``empirical-gittins`` reads the family's
    output-length distribution from the run's residual-life table (``simulate(...,
    residual_life=)``; deployable: no per-request lengths); ``index`` uses ``params`` (defaults if
    None) scaled by the suite-wide ``t_ref_ms``. ``shed_margin``: None/inf = no shedding. Bad
    parameters raise ``PolicyError`` naming the policy."""
    from .engine.simulate import EnginePolicy

    mode, pid = _engine_ids(name)
    try:
        theta = (params or IndexParams()).theta_vector(t_ref_ms) if name == "index" else None
        margin = check_shed_margin(shed_margin)
    except PolicyError as e:
        raise PolicyError(f"policy {name!r}: {e}") from None
    label = name if margin is None else f"{name}+shed({margin:g})"
    return EnginePolicy(label, mode, pid, theta, margin)
