"""Controllers: policies whose parameters change at decision epochs (docs/design.md sections 5 and 8).

A controller sees the env's observation (``envs.TokenBatchEnv``) at each decision epoch and
returns the engine's parameter vectors. ``run_controlled`` replays traces under a controller with
the env's epoch rules, so the evaluator judges an agent or ``index-scheduled`` on exactly the
traces, loads and random streams of the static baselines. One engine, one epoch driver
(``EngineRun.advance_to_decision``), one observation code path (``envs.observe``), one action map
(``envs.map_actions``). Trained agents become controllers in ``agents.load`` (``agent_spec``,
through ``policy_spec``), above the evaluator: this module and the evaluator never load a model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class ControlSpec:
    """A controller row of the leaderboard. ``make(t_ref_ms)`` builds the controller: a callable
    ``obs [m, D] -> (theta [m, N_THETA], shed margin [m], -1 = off)``. ``action_mode`` names the
    in-engine policy the parameters are for (``index`` or ``weights``); ``base`` is its parameters
    before the first decision (IndexParams or LinearWeights) and ``base_margin`` the shed margin
    (None = off). ``evidence``: what identifies the controller (enters the evidence id). ``guard``
    (a TokenBatch-v1 agent): the tpot-guard rule's base (u, B_min); the controller then returns
    (theta, margin, (u, B_min)) and sees v1's observation."""

    label: str
    action_mode: str
    base: Any
    base_margin: Optional[float]
    k: int
    decision_interval_ms: float
    make: Callable = dataclasses.field(compare=False, repr=False)
    evidence: tuple = ()
    guard: Optional[tuple] = None


def run_controlled(traces, profile, config, spec: ControlSpec, *, estimates=None, residual_life=None,
                   t_ref_ms: float, lambda_sat: float):
    """Replay ``traces`` (one engine copy each, stepped together) under ``spec``'s controller with the
    env's epoch rules: the controller decides at the start and then at every epoch boundary
    (``decision_interval_ms`` after the start, first iteration boundary at or after it) where a
    decision is needed (>= 2 waiting, or a sheddable request); parameters are held in between.
    Returns the ``SimResult`` of the whole replay."""
    from .engine.simulate import EngineRun
    from .envs import obs_dim, obs_scales, observe
    from .policies import engine_policy

    from .engine.levers import with_guard
    ctrl = spec.make(t_ref_ms)
    kw = {"params": spec.base} if spec.action_mode == "index" else {"weights": spec.base}
    pol = engine_policy(spec.action_mode, shed_margin=spec.base_margin, t_ref_ms=t_ref_ms, **kw)
    tpot = spec.guard is not None
    if tpot:   # (v1) the rule, at the base until the first decision
        config = with_guard(config, *spec.guard)
    run = EngineRun(traces, profile, pol, config, estimates=estimates, residual_life=residual_life)
    N = run.n_copies
    run.start_epochs(interval_ns=max(1, int(round(spec.decision_interval_ms * 1e6))),
                     shed_on=spec.base_margin is not None)
    ocfg = obs_scales(t_ref_ms, lambda_sat)
    obs = np.zeros((N, obs_dim(spec.k, tpot)), np.float32)
    theta, margin = run.theta.copy(), run.shed_margin.copy()
    ask = np.ones(N, bool)
    observe(run, ask, obs, spec.k, ocfg, tpot)
    while True:
        ask &= ~run.done
        if ask.any():
            out = ctrl(obs[ask].copy())
            theta[ask], margin[ask] = out[0], out[1]
            run.set_policy_params(theta, margin)
            if tpot:
                run.set_guard(ask, *out[2])
        ask = ~run.done
        if not ask.any():
            return run.result()
        run.advance_to_decision(ask)   # every request is scored: a copy stops at a decision or its end
        observe(run, ask, obs, spec.k, ocfg, tpot)


# ------------------------------------------------------------------------------ index-scheduled
def schedule_spec(schedule, *, k: int = 8, decision_interval_ms: float = 100.0) -> ControlSpec:
    """``index-scheduled``: at each decision, the bucket of the observed arrival rate (the
    observation's ``arrival_rate`` entry, arrivals in the last 10 s / lambda_sat) picks its tuned
    index and shed margin (``policies.IndexSchedule``)."""
    from .envs import OBS_LAYOUT

    col = OBS_LAYOUT.index("arrival_rate_rho")

    def make(t_ref_ms):
        thetas = np.stack([p.theta_vector(t_ref_ms) for p in schedule.params])
        margins = np.array([-1.0 if m is None else m for m in schedule.margins])

        def ctrl(obs):
            b = schedule.bucket(obs[:, col])
            return thetas[b], margins[b]
        return ctrl

    mid = len(schedule.params) // 2
    return ControlSpec("index-scheduled", "index", schedule.params[mid], schedule.margins[mid], k,
                       decision_interval_ms, make,
                       (("index-scheduled", json.dumps(schedule.to_dict(), sort_keys=True)),))


# ------------------------------------------------------------------------------ action policies
def policy_spec(label: str, mode: str, base, base_margin, k: int, decision_interval_ms: float,
                load_predict: Callable, evidence: tuple = (), shed_action: bool = True,
                guard: Optional[tuple] = None) -> ControlSpec:
    """A controller from an action policy: ``load_predict()`` gives ``predict(obs) -> actions`` in
    the env's action space (``mode``; with ``guard``, v1's, around the rule's base (u, B_min); without
    the shed-margin column unless ``shed_action``), mapped around ``base`` like the env does
    (``envs.map_actions``, ``map_guard_actions``)."""
    def make(t_ref_ms):
        from .envs import map_actions
        from .envs.actions import map_guard_actions
        ts = base.theta_vector(t_ref_ms)
        predict = load_predict()

        def ctrl(obs):
            a = np.clip(predict(obs), -1.0, 1.0)
            theta, margin = map_actions(a, mode, ts, base_margin, shed_action)
            return (theta, margin) if guard is None else (theta, margin, map_guard_actions(a, mode, guard))
        return ctrl

    return ControlSpec(label, mode, base, base_margin, k, decision_interval_ms, make, evidence, guard)


# ------------------------------------------------------------------------------ routers
@dataclasses.dataclass(frozen=True)
class RouterAgent:
    """A trained router (TokenBatchCluster-v0) as a row of the benchmark in cluster mode
    (docs/design.md section 12, "Routing env"). ``env``: the ``envs.ClusterEnvConfig`` it was trained
    on; its replicas, base router and replica policy (policy, shed margin, index, levers, T_ref) are
    the row's. ``make()`` builds ``predict(obs [E, D], masks [E, R]) -> replicas [E]`` (a masked
    choice: the base router's, counted). ``evidence``: what identifies the agent (the evidence id)."""

    label: str
    env: Any
    make: Callable = dataclasses.field(compare=False, repr=False)
    evidence: tuple = ()


class RoutedRuns:
    """``run_routed``'s replays: ``records(i)`` and ``replica_stats(i)`` of copy i as a
    ``ClusterResult``'s (or a P/D run's ``PDResult``'s), the stats with ``replaced`` (the agent's
    masked choices) and ``decisions`` (its decisions)."""

    def __init__(self, results: list, replaced, decisions):
        self.results, self.replaced, self.decisions = results, replaced, decisions

    def records(self, copy: int = 0) -> dict:
        return self.results[copy].records()

    def replica_stats(self, copy: int = 0) -> dict:
        return {**self.results[copy].replica_stats(), "replaced": int(self.replaced[copy]),
                "decisions": int(self.decisions[copy])}


def run_routed(traces, profile, policy, config, agent: RouterAgent, *, estimates=None,
               residual_life=None) -> RoutedRuns:
    """Replay ``traces`` (one cluster each, stepped together) with ``agent`` routing every arrival
    (``engine.routing.RoutingRun``, the env's dynamics; the observation ``envs.cluster_env.observe_cluster``,
    the env's): each replica runs ``policy`` at ``config``; a P/D agent's (``env.pd``) on
    ``engine.routing.PDRoutingRun``, its records with the first token where ``env.first_token_at`` says."""
    from .engine.routing import PDRoutingRun, RoutingRun
    from .envs.cluster_env import observe_cluster
    env = agent.env
    if env.pd:   # (a P/D cluster: the agent routes to the prefill replicas)
        run = PDRoutingRun(list(traces), profile, policy, config, prefill_replicas=env.pd[0],
                           decode_replicas=env.pd[1], base_router=env.base_router, decode_router=env.decode_router,
                           kv_link=env.kv_link, first_token_at=env.first_token_at, estimates=estimates,
                           residual_life=residual_life)
    else:
        run = RoutingRun(list(traces), profile, policy, config, replicas=env.replicas, base_router=env.base_router,
                         estimates=estimates, residual_life=residual_life)
    predict = agent.make()
    decisions = np.zeros(len(traces), np.int64)
    while not run.done.all():
        acting = ~run.done
        obs = observe_cluster(run)
        a = np.asarray(predict(obs, run.mask.copy()), np.int64).reshape(-1)
        run.step(np.where(acting, a, -1), acting)
        decisions += acting
    return RoutedRuns(run.results(), run.replaced.copy(), decisions)
