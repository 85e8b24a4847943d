"""Policies: names, parameters and their ranges, and the scalar drop-in (DESIGN.md section 4).

The formulas themselves live in ``tokenbatch_env.engine.scoring`` (the engine evaluates them for
every request each iteration); this module validates parameters and offers the same formulas to
other schedulers through ``score_request_priority``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from .engine import scoring as _s
from .errors import PolicyError

#: name -> (in-engine id, needs parameters)
BASELINES = ("fcfs", "priority", "sjf", "srpt-oracle", "edf", "llf", "index")

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


def score_request_priority(prompt_len, est_decode_len, wait_time_ms, sla_target_ms, free_kv_blocks,
                           active_batch_tokens, prefix_shared_ratio, *, params: DropInParams) -> float:
    """The brief's signature: higher = schedule first. ``prompt_len`` is the prefill still to
    compute; ``sla_target_ms`` the TTFT SLO; ``active_batch_tokens`` is accepted and ignored (the
    index prices KV pressure through ``free_kv_blocks`` instead). Equals the engine's index."""
    del active_batch_tokens
    p = int(prompt_len)
    prefill_ms = _s.idle_prefill_ns(p, 0, params.budget, np.asarray(params.cost_ps, np.int64)) / 1e6
    s_ms = _s.service_ms(float(p), float(est_decode_len), params.u_p_ms, params.u_d_ms)
    to_deadline = float(sla_target_ms) - float(wait_time_ms)
    slack = to_deadline - prefill_ms
    blocks = -(-p // params.block_size)
    theta = params.index.theta_vector(params.t_ref_ms)
    score = _s.policy_score(_s.P_INDEX, theta, float(prefix_shared_ratio), s_ms, float(est_decode_len),
                            slack, float(sla_target_ms), False, free_kv_blocks / params.usable_blocks,
                            float(blocks), float(params.usable_blocks), to_deadline, 0.0,
                            float(params.block_size))
    if math.isnan(score):
        raise PolicyError("index score is NaN for this request (check the inputs)")
    return float(score)


# --------------------------------------------------------------------------- engine policies
#: policy name -> (engine mode, in-engine policy id)
def _engine_ids(name: str) -> tuple[int, int]:
    from .engine import kernel as K
    table = {"fcfs": (K.MODE_FCFS, _s.P_EXTERNAL), "priority": (K.MODE_PRIORITY, _s.P_EXTERNAL),
             "sjf": (K.MODE_SCORE, _s.P_SJF), "srpt-oracle": (K.MODE_SCORE, _s.P_SJF),
             "edf": (K.MODE_SCORE, _s.P_EDF), "llf": (K.MODE_SCORE, _s.P_LLF),
             "index": (K.MODE_SCORE, _s.P_INDEX)}
    return table[check_policy_name(name)]


def engine_policy(name: str, *, params: Optional[IndexParams] = None, shed_margin=None,
                  t_ref_ms: float = 1000.0):
    """The engine's form of a named policy. ``srpt-oracle`` is ``sjf`` fed true lengths (the
    caller must pass the oracle predictor's estimates); ``index`` uses ``params`` (defaults if
    None) scaled by the suite-wide ``t_ref_ms``. ``shed_margin``: None/inf = no shedding."""
    from .engine.simulate import EnginePolicy

    mode, pid = _engine_ids(name)
    theta = (params or IndexParams()).theta_vector(t_ref_ms) if name == "index" else None
    margin = check_shed_margin(shed_margin)
    label = name if margin is None else f"{name}+shed({margin:g})"
    return EnginePolicy(label, mode, pid, theta, margin)
