"""Batched goodput of many parameter sets (docs/design.md section 7): k parameter sets x T traces
as k*T copies of ONE simulate call, each copy with its own theta row and shed margin. Tuning's
objective runs here (``evaluate_param_vectors``)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from ..errors import ConfigError

def evaluate_index_params(traces: Sequence, profile, params_list: Sequence, *, shed_margins=None,
                          estimates: Optional[Sequence[np.ndarray]] = None, residual_life=None,
                          t_ref_ms: float = 1000.0, config=None, scored=None) -> np.ndarray:
    """Goodput matrix [k, T] of k index parameter sets on T traces, run as k*T copies of ONE
    simulate call (copy ``j*T + i`` = parameter set j on trace i, with its own theta row and
    shed margin). ``shed_margins``: None (no shedding), one value for all, or k values (None/inf =
    off). ``estimates``: one array per trace (reused for every parameter set: common random
    numbers). ``scored``: optional bool mask per trace (windows). The index's case of
    ``evaluate_param_vectors``."""
    from ..policies import IndexParams

    if len(params_list) == 0 or len(traces) == 0:
        raise ConfigError("evaluate_index_params needs at least one parameter set and one trace")
    params = [p if isinstance(p, IndexParams) else IndexParams.from_dict(p) for p in params_list]
    return evaluate_param_vectors(traces, profile, "index", np.stack([p.theta_vector(t_ref_ms) for p in params]),
                                  shed_margins=shed_margins, estimates=estimates, residual_life=residual_life,
                                  t_ref_ms=t_ref_ms, config=config, scored=scored)


def evaluate_param_vectors(traces: Sequence, profile, policy: str, thetas=None, *, shed_margins=None,
                           estimates: Optional[Sequence[np.ndarray]] = None, residual_life=None,
                           t_ref_ms: float = 1000.0, config=None, scored=None, configs=None) -> np.ndarray:
    """Goodput matrix [k, T] of k parameter sets of the in-engine ``policy`` on T traces, as k*T
    copies of ONE simulate call (copy ``j*T + i`` = set j on trace i, with its own theta row and
    shed margin). ``thetas``: [k, N_THETA] engine parameter vectors (``IndexParams.theta_vector``,
    ``LinearWeights.theta_vector``), or None for a policy without parameters (then k = the number
    of ``shed_margins``). ``shed_margins``, ``estimates``, ``scored``: as in
    ``evaluate_index_params``. ``configs``: one ``EngineConfig`` per parameter set (each set's
    levers, docs/design.md section 11; the k*T copies of one batch), else ``config`` for all."""
    from ..policies import check_shed_margin, engine_policy

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
    if configs is not None:
        configs = list(configs)
        if len(configs) != k:
            raise ConfigError(f"configs: expected {k} engine configs (one per parameter set), got {len(configs)}")
    return goodput_matrix(traces, k, profile, pol, config=config, estimates=estimates,
                          residual_life=residual_life, scored=scored, configs=configs)


def goodput_matrix(traces: Sequence, k: int, profile, policy, *, config=None, estimates=None,
                   residual_life=None, scored=None, configs=None) -> np.ndarray:
    """Goodput [k, T] of ``policy`` (per-copy parameters for the k*T copies) on k repeats of T
    traces, in ONE simulate call: copy ``j*T + i`` is parameter set j on trace i. The estimates of
    trace i are reused for every j (common random numbers); ``scored``: bool mask per trace;
    ``configs``: set j's engine config (one batch of per-copy settings), else ``config`` for all."""
    from ..engine.simulate import simulate

    traces = list(traces)
    T = len(traces)
    est = None if estimates is None else [e for _ in range(k) for e in estimates]
    if configs is not None:
        config = [c for c in configs for _ in range(T)]
    res = simulate(traces * k, profile, policy, config, estimates=est, residual_life=residual_life)
    out = np.empty((k, T))
    for j in range(k):
        for i in range(T):
            met = res.records(j * T + i)["met"]
            if scored is not None:
                met = met[np.asarray(scored[i], bool)]
            out[j, i] = met.mean() if met.size else float("nan")
    return out
