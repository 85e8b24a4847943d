"""Controllers (tokenbatch_env.control): replays under per-epoch parameters, index-scheduled, and
the evaluator's controller rows."""

import dataclasses

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from tokenbatch_env import evaluate as ev
from tokenbatch_env.control import ControlSpec, run_controlled, schedule_spec
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.envs import OBS_LAYOUT, TokenBatchVectorEnv
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.policies import IndexParams, IndexSchedule, engine_policy
from tokenbatch_env.traces.windows import window_at

SCHED = IndexSchedule.from_loads((1.0, 1.2, 1.5),
                                 (IndexParams(kappa=0.0, gamma=0.0, beta=0.0, w_prefix=0.0), IndexParams(),
                                  IndexParams(a_edf=5.0, kappa=3.0)),
                                 (None, 0.0, 0.5))


def _env_windows(n=4, seed=5, **kw):
    env = TokenBatchVectorEnv(n, rho=(0.8, 1.8), window=48, warmup=12, cooldown=12,
                              autoreset_mode=AutoresetMode.DISABLED, **kw)
    obs, info = env.reset(seed=seed)
    core, cfg, wl = env.core, env.config, env.core.workload
    wins, ests = [], []
    for c in range(n):
        u = int(info["trace_index"][c])
        w = window_at(wl.unit_at(u, float(info["rho"][c])), int(info["window_start"][c]), cfg.window,
                      cfg.warmup, cfg.cooldown)
        wins.append(w)
        ests.append(core.estimates[u][w.parent_start:w.parent_start + len(w.trace)])
    return env, obs, wins, ests


def test_constant_controller_is_the_static_policy():
    env, _, wins, ests = _env_windows()
    wl, profile = env.core.workload, env.core.profile
    p = IndexParams(kappa=2.0)

    def make(t_ref):
        th = p.theta_vector(t_ref)
        return lambda obs: (np.tile(th, (len(obs), 1)), np.full(len(obs), 0.25))

    spec = ControlSpec("const", "index", IndexParams(), None, 8, 100.0, make)
    traces = [w.trace for w in wins]
    a = run_controlled(traces, profile, env.core.engine_config, spec, estimates=ests,
                       residual_life=wl.residual_life, t_ref_ms=wl.t_ref_ms, lambda_sat=wl.lambda_sat)
    b = simulate(traces, profile, engine_policy("index", params=p, shed_margin=0.25, t_ref_ms=wl.t_ref_ms),
                 env.core.engine_config, estimates=ests, residual_life=wl.residual_life)
    for c in range(len(traces)):
        ra, rb = a.records(c), b.records(c)
        for k in ra:
            assert np.array_equal(ra[k], rb[k], equal_nan=True), k


def test_scheduled_replay_equals_the_env_driven_by_the_same_controller():
    """The evaluator's controlled replay and the env (index mode, parameters set per decision) give
    the same scored outcomes: one set of epoch rules."""
    env, obs, wins, ests = _env_windows(shed_margin=0.0)
    core, wl = env.core, env.core.workload
    spec = schedule_spec(SCHED)
    ctrl = spec.make(wl.t_ref_ms)
    n = env.num_envs
    ended = np.zeros(n, bool)
    buckets = set()
    for _ in range(20_000):
        live = ~ended
        theta, margin = ctrl(obs[live])
        buckets |= set(SCHED.bucket(obs[live, OBS_LAYOUT.index("arrival_rate_rho")]).tolist())
        _, term, trunc = core.step(live, theta, margin)
        assert not trunc.any()
        ended |= term
        if ended.all():
            break
        obs = core.obs
    assert ended.all() and len(buckets) >= 2   # the schedule really switched
    res = run_controlled([w.trace for w in wins], core.profile, core.engine_config, spec, estimates=ests,
                         residual_life=wl.residual_life, t_ref_ms=wl.t_ref_ms, lambda_sat=wl.lambda_sat)
    A = core.run.arrays
    for c, w in enumerate(wins):
        rec = res.records(c)
        s = w.scored
        assert np.array_equal(rec["first_token_ns"][s], A.first_token[c, :len(w.trace)][s])
        assert np.array_equal(rec["finish_ns"][s], A.finish[c, :len(w.trace)][s])
        assert np.array_equal(rec["end_state"][s], A.end_state[c, :len(w.trace)][s])


def test_benchmark_reports_index_scheduled_row():
    cfg = ev.BenchConfig(max_traces=3, loads=(1.0, 1.5), bootstrap_b=200, upper_bound=False,
                         policies=("fcfs",), schedule=SCHED)
    rep = ev.run_benchmark(cfg)
    rows = {r["label"]: r for r in rep.data["loads"][0]["rows"]}
    assert "index-scheduled" in rows
    g = rows["index-scheduled"]["goodput"]["mean"]
    assert 0.0 <= g <= 1.0
    other = dataclasses.replace(cfg, schedule=IndexSchedule.from_loads((1.0, 1.5), SCHED.params[:2],
                                                                       SCHED.margins[:2]))
    assert ev.evidence_id(ev.evidence_inputs(cfg, *_wl_profile(cfg), ev.build_rows(cfg))) != \
        ev.evidence_id(ev.evidence_inputs(other, *_wl_profile(other), ev.build_rows(other)))


def _wl_profile(cfg):
    from tokenbatch_env.engine.profiles import load_profile
    profile = cfg.engine.resolve(load_profile(cfg.profile))
    return ev.prepare_workload(cfg, profile), profile


def test_bad_controller_config():
    with pytest.raises(ConfigError, match="schedule"):
        ev.BenchConfig(schedule={"edges": []})
    with pytest.raises(ConfigError, match="controllers"):
        ev.BenchConfig(controllers=("x",))
    spec = schedule_spec(SCHED)
    with pytest.raises(ConfigError, match="labels"):
        ev.BenchConfig(controllers=(spec,), schedule=SCHED)
