"""The actions of TokenBatch-v0 and -v1 (docs/design.md section 5; ``TokenBatchEnv``'s "Action
Space"): the action modes and their dimensions, and ``map_actions``, which maps [n, A] actions in
[-1, 1] to the engine's parameters (theta rows and shed margins) around the base vector theta*,
``a = 0`` giving theta* exactly; v1's budget dimensions (the tpot-guard rule's u and B_min, section
11) map in ``map_guard_actions``. The controlled replay (``control.policy_spec``) maps an agent's
actions here too."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np

from ..engine import scoring as S
from ..errors import TokenBatchError
from ..policies import policy_names


class ActionError(TokenBatchError, ValueError):
    """An action is malformed, NaN/inf, or outside [-1, 1] (without ``clip_actions``)."""


ACTION_MODES = policy_names(parametric=True)   # the registry's policies with parameters
#: index-mode action dimensions, in order: the seven index coefficients, then the shed margin
ACTION_NAMES = ("kappa", "slope", "gamma", "theta", "beta", "w_prefix", "a_edf", "shed_margin")
#: action dimensions of the ``weights`` mode: one weight per linear-score feature, then the shed margin
WEIGHT_ACTION_NAMES = tuple(f"w_{f}" for f in S.LINEAR_FEATURES) + ("shed_margin",)
#: TokenBatch-v1's budget dimensions (the tpot-guard rule's u and B_min), before the shed margin
GUARD_ACTION_NAMES = ("budget_u", "budget_bmin")


def action_names(mode: str, guard: bool = False, shed_action: bool = True) -> tuple:
    """A mode's action dimensions, in order: its parameters, with ``guard`` (v1) u and B_min, then
    (with ``shed_action``) the shed margin."""
    names = ACTION_NAMES if mode == "index" else WEIGHT_ACTION_NAMES
    return names[:-1] + (GUARD_ACTION_NAMES if guard else ()) + (names[-1:] if shed_action else ())
_THETA_COL = {"kappa": S.I_KAPPA, "slope": S.I_SLOPE, "gamma": S.I_GAMMA, "theta": S.I_THETA,
              "beta": S.I_BETA, "w_prefix": S.I_W_PREFIX, "a_edf": S.I_A_EDF}


class _IndexPlan(NamedTuple):
    """The ``index`` mode's mapping by parameter (in action order): theta columns, bounds; the
    linear ones with their spans, the log and log1p ones with their log factors. Read-only."""

    cols: np.ndarray
    lin: np.ndarray
    span: np.ndarray
    logs: tuple
    log1ps: tuple
    lo: np.ndarray
    hi: np.ndarray


@functools.lru_cache(maxsize=None)
def _index_plan() -> _IndexPlan:
    from ..policies import INDEX_RANGES
    names = ACTION_NAMES[:-1]
    ranges = [INDEX_RANGES[n] for n in names]
    unknown = [n for n, (_, _, sc) in zip(names, ranges) if sc not in ("linear", "log", "log1p")]
    if unknown:
        raise ValueError(f"index ranges of unknown scale: {unknown}")
    lin = [j for j, (_, _, sc) in enumerate(ranges) if sc == "linear"]
    plan = _IndexPlan(
        cols=np.array([_THETA_COL[n] for n in names]), lin=np.array(lin),
        span=np.array([ranges[j][1] - ranges[j][0] for j in lin]),
        logs=tuple((j, math.log(hi / lo)) for j, (lo, hi, sc) in enumerate(ranges) if sc == "log"),
        log1ps=tuple((j, math.log1p(hi)) for j, (lo, hi, sc) in enumerate(ranges) if sc == "log1p"),
        lo=np.array([r[0] for r in ranges]), hi=np.array([r[1] for r in ranges]))
    for v in plan:
        if isinstance(v, np.ndarray):
            v.setflags(write=False)
    return plan


def map_actions(a: np.ndarray, mode: str, theta_star: np.ndarray, base_margin: Optional[float],
                shed_action: bool = True):
    """[n, A] actions in [-1, 1] -> (theta [n, N_THETA], shed margin [n]); a = 0 gives theta*.
    ``index``: per-parameter residuals (see ``TokenBatchEnv``); ``weights``: w = w* + a (only the
    direction w/|w| matters to the score). Margin -1 = shedding off. Without ``shed_action`` the
    actions have no last (margin) column and the margin is the base one. The parameters are
    mapped together, in a few numpy calls: at one copy (the single env) numpy's per-call cost is
    nearly the whole cost (docs/benchmarks.md)."""
    from ..policies import SHED_RANGE
    a = np.asarray(a, np.float64)
    theta_star = np.asarray(theta_star)
    theta = np.tile(theta_star, (a.shape[0], 1))
    if mode == "weights":
        theta[:, :S.N_WEIGHTS] += a[:, :S.N_WEIGHTS]
    else:
        plan = _index_plan()
        cols, lin = plan.cols, plan.lin
        base = theta_star[cols]
        # Each entry as its parameter's own formula gives it, to the bit: one row per parameter
        # (the log and log1p ones pass exp/expm1 a fresh contiguous array, as column by column
        # did), the rest exact arithmetic in the same order. np.minimum/np.maximum equal np.clip
        # here but for a -0.0 inside the bounds, which needs a zero action (taken from ``base``
        # below) or a span under 1 (none is).
        xt = np.ascontiguousarray(a[:, :cols.size].T)
        v = np.empty(xt.shape)
        v[lin] = base[lin, None] + xt[lin] * plan.span[:, None]
        for j, f in plan.logs:
            v[j] = base[j] * np.exp(xt[j] * f)
        for j, f in plan.log1ps:
            v[j] = np.expm1(np.log1p(base[j]) + xt[j] * f)
        clipped = np.minimum(np.maximum(v, plan.lo[:, None]), plan.hi[:, None])
        theta[:, cols] = np.where(xt == 0.0, base[:, None], clipped).T
    x = a[:, -1] if shed_action else np.zeros(a.shape[0])
    if base_margin is None:
        return theta, np.full(x.shape[0], -1.0)
    lo, hi = SHED_RANGE
    return theta, np.where(x == 0.0, base_margin, np.minimum(np.maximum(base_margin + x * (hi - lo), lo), hi))


def map_guard_actions(a: np.ndarray, mode: str, base: tuple):
    """v1's budget dimensions of [n, A] actions -> (u [n], B_min [n]) around ``base`` = (u*, B_min*):
    ``x* + a (hi - lo)`` clipped to the range (u in [-0.5, 2], B_min in [0, 1]); a = 0 gives the base
    exactly. The columns follow the mode's parameters (``action_names``)."""
    from ..engine.levers import GUARD_LEVERS
    a = np.asarray(a, np.float64)
    j = len(ACTION_NAMES if mode == "index" else WEIGHT_ACTION_NAMES) - 1
    out = []
    for k, (name, star) in enumerate(zip(GUARD_ACTION_NAMES, base)):
        lo, hi = GUARD_LEVERS[name]
        x = a[:, j + k]
        out.append(np.where(x == 0.0, star, np.minimum(np.maximum(star + x * (hi - lo), lo), hi)))
    return out[0], out[1]


def as_numbers(actions) -> np.ndarray:
    """``actions`` as a new float64 array, or ``ActionError`` if they are not real numbers (strings,
    complex numbers and objects are refused, not parsed or truncated)."""
    try:
        arr = np.asarray(actions)
    except (TypeError, ValueError):   # (ragged sequences)
        raise ActionError(f"actions must be numbers, got {type(actions).__name__}") from None
    if arr.dtype.kind not in "biuf":
        raise ActionError(f"actions must be real numbers, got {type(actions).__name__} of dtype {arr.dtype}")
    return np.array(arr, dtype=np.float64)
