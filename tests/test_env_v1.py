"""TokenBatch-v1 (docs/design.md section 11): v0 with the tpot-guard budget rule. Its u and B_min
are action dimensions (a = 0 is the base exactly, and the episodes are the evaluator's with the
base's rule), the observation gains the TPOT state (checked against a direct computation), and
with an untuned base (B_min 1: the rule never lowers the budget) v1 at a = 0 is v0."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import gymnasium as gym
import numpy as np
import pytest

import tokenbatch_env  # noqa: F401  (registers the envs)
from tokenbatch_env.engine import kernel as K
from tokenbatch_env.envs import TokenBatchEnv, TokenBatchVectorEnv, obs_layout
from tokenbatch_env.envs.actions import GUARD_ACTION_NAMES, map_guard_actions
from tokenbatch_env.envs.observation import N_TPOT, TPOT_FEATURES, obs_dim

SMALL = dict(window=24, warmup=8, cooldown=8)


def test_v1_registration_spaces_and_check_env():
    from gymnasium.utils.env_checker import check_env
    env = gym.make("TokenBatch-v1", **SMALL)
    assert env.unwrapped.config.tpot_guard
    assert env.observation_space.shape == (obs_dim(8, True),) == (obs_dim(8) + N_TPOT,)
    assert env.unwrapped.obs_names[-N_TPOT:] == list(TPOT_FEATURES)
    assert env.unwrapped.core.action_names == ("kappa", "slope", "gamma", "theta", "beta", "w_prefix", "a_edf",
                                               "budget_u", "budget_bmin", "shed_margin")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    venv = gym.make_vec("TokenBatch-v1", num_envs=3, vectorization_mode="vector_entry_point", k=4,
                        action_mode="weights", shed_action=False, **SMALL)
    assert isinstance(venv, TokenBatchVectorEnv) and venv.config.tpot_guard
    assert venv.single_action_space.shape == (10,)   # 8 weights, u, B_min
    assert venv.single_observation_space.shape == (len(obs_layout(4, True)),)
    assert gym.make("TokenBatch-v0", **SMALL).unwrapped.core.action_dim == 8


def test_guard_action_map():
    """a = 0 gives the base exactly; x* + a (hi - lo) clipped to u in [-0.5, 2], B_min in [0, 1]."""
    base = (0.3, 0.25)
    a = np.zeros((5, 10))
    a[:, 7] = [0.0, 1.0, -1.0, 0.1, -0.2]
    a[:, 8] = [0.0, 1.0, -1.0, 0.5, -0.1]
    u, b = map_guard_actions(a, "index", base)
    np.testing.assert_allclose(u, [0.3, 2.0, -0.5, 0.3 + 0.25, 0.3 - 0.5])
    np.testing.assert_allclose(b, [0.25, 1.0, 0.0, 0.75, 0.15])
    assert u[0] == 0.3 and b[0] == 0.25
    w = np.zeros((1, 11))
    w[0, 8:10] = [0.2, -0.2]
    assert map_guard_actions(w, "weights", (0.0, 1.0)) == (pytest.approx(0.5), pytest.approx(0.8))
    assert GUARD_ACTION_NAMES == ("budget_u", "budget_bmin")


def _base_file(tmp_path, guard: bool):
    doc = {"index": {}, "shed_margin": 0.0, "weights": {"w": {"log_s": -1.0, "slack": -0.5}}}
    if guard:
        doc["tpot-guard"] = {"index": {"kappa": 2.0, "a_edf": 0.5}, "shed_margin": 0.25}
        doc["levers"] = {"index+shed+tpot-guard": {"budget_u": 0.3, "budget_bmin": 0.1},
                         "weights+shed+tpot-guard": {"budget_u": -0.2, "budget_bmin": 0.0}}
    p = tmp_path / "base.json"
    p.write_text(json.dumps(doc))
    return str(p)


def _episodes(env, N, n_episodes, action):
    _, info = env.reset(seed=3)
    window = {c: (int(info["trace_index"][c]), float(info["rho"][c]), int(info["window_start"][c]))
              for c in range(N)}
    out, done = [], np.zeros(N, np.int64)
    for _ in range(20000):
        _, _, te, tr, inf = env.step(np.tile(action, (N, 1)))
        for c in np.flatnonzero(inf.get("_rho", np.zeros(N, bool))):
            window[c] = (int(inf["trace_index"][c]), float(inf["rho"][c]), int(inf["window_start"][c]))
        for c in np.flatnonzero(te | tr):
            assert te[c]
            if done[c] < n_episodes:
                out.append((window[c], env.episode_records(int(c)), float(inf["episode_goodput"][c])))
            done[c] += 1
        if (done >= n_episodes).all():
            return out
    raise AssertionError("episodes did not end")


@pytest.mark.parametrize("mode", ["index", "weights"])
@pytest.mark.parametrize("guard_action", [0.0, -0.6], ids=["a0", "lower-u"])
def test_actions_replay_the_evaluators_policy_with_the_rule(mode, guard_action, tmp_path):
    """A constant action (zero on the policy dimensions, ``guard_action`` on u) replays the evaluator's
    policy with the base's parameters (the file's "tpot-guard" part for the index) and the rule at
    the mapped u and the base's B_min, request by request, in first and later episodes: the budget
    dimensions drive the engine, a = 0 is the base exactly."""
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.policies import IndexParams, LinearWeights, engine_policy
    from tokenbatch_env.traces.windows import window_at

    N = 3
    env = TokenBatchVectorEnv(N, rho=(1.0, 1.8), window=48, warmup=16, cooldown=16, action_mode=mode,
                              base_params=_base_file(tmp_path, True), tpot_guard=True)
    core = env.core
    base_u, base_b = core.base_guard
    assert (base_u, base_b) == ((0.3, 0.1) if mode == "index" else (-0.2, 0.0))
    a = np.zeros(core.action_dim)
    a[core.action_names.index("budget_u")] = guard_action
    u = float(map_guard_actions(a[None], mode, core.base_guard)[0][0])
    eps = _episodes(env, N, 2, a)
    wl, cfg = core.workload, env.config
    if mode == "index":
        pol = engine_policy("index", params=IndexParams(kappa=2.0, a_edf=0.5), shed_margin=0.25, t_ref_ms=wl.t_ref_ms)
    else:
        pol = engine_policy("weights", weights=LinearWeights({"log_s": -1.0, "slack": -0.5}), shed_margin=0.0,
                            t_ref_ms=wl.t_ref_ms)
    traces, ests, wins = [], [], []
    for (unit, rho, start), _, _ in eps:
        w = window_at(wl.unit_at(unit, rho), start, cfg.window, cfg.warmup, cfg.cooldown)
        wins.append(w)
        traces.append(w.trace)
        ests.append(core.estimates[unit][w.parent_start:w.parent_start + len(w.trace)])
    engine = dataclasses.replace(core.engine_config, budget_rule="tpot-guard", budget_u=u, budget_bmin=base_b)
    res = simulate(traces, cfg.profile, pol, engine, estimates=ests, residual_life=wl.residual_life)
    plain = simulate(traces, cfg.profile, pol, core.engine_config, estimates=ests, residual_life=wl.residual_life)
    differs = False
    for i, (_, rec_env, goodput) in enumerate(eps):
        rec = res.records(i)
        s = wins[i].scored
        assert np.array_equal(rec["first_token_ns"][s], rec_env["first_token_ns"]), i
        assert np.array_equal(rec["finish_ns"][s], rec_env["finish_ns"]), i
        assert goodput == rec["met"][s].mean()
        differs |= not np.array_equal(plain.records(i)["finish_ns"][s], rec_env["finish_ns"])
    assert differs   # the rule changed these episodes: the test can tell a run without it


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("mode", ["index", "weights"])
def test_v1_base_is_the_evaluators_tuned_row(mode, partial, tmp_path):
    """The base v1's a = 0 runs is the evaluator's ``<mode>+shed+tpot-guard`` row of ``bench --params``
    with the same file: its index parameters, margin, u and B_min, also when the file's "tpot-guard"
    part leaves the index out (both then use the row's without the rule)."""
    import argparse

    from tokenbatch_env.bench_cli import config_from_args, configure
    from tokenbatch_env.evaluate import build_rows
    from tokenbatch_env.evaluate.rows import row_guard, row_index_params
    path = _base_file(tmp_path, True)
    if partial:
        doc = json.loads(open(path).read())
        del doc["tpot-guard"]["index"]
        open(path, "w").write(json.dumps(doc))
    env = TokenBatchVectorEnv(1, action_mode=mode, base_params=path, tpot_guard=True, **SMALL)
    p = argparse.ArgumentParser()
    configure(p)
    cfg = config_from_args(p.parse_args(["--policies", f"fcfs,{mode}", "--shed", "--params", path]))
    row = {r.label: r for r in build_rows(cfg)}[f"{mode}+shed+tpot-guard"]
    core = env.core
    assert core.base_guard == row_guard(row, cfg)
    assert core.base_margin == row.shed_margin
    if mode == "index":
        assert core.base_params == row_index_params(row, cfg)
    else:
        assert core.base_weights == cfg.weights


def test_untuned_base_at_zero_action_is_v0(tmp_path):
    """With no tuned rule in the base (u* 0, B_min* 1: the budget never lowered), v1 at a = 0 runs v0's
    episodes: the same rewards and episode metrics, and v0's observation followed by the TPOT state."""
    kw = dict(rho=(1.0, 1.8), **SMALL, base_params=_base_file(tmp_path, False))
    v0, v1 = TokenBatchVectorEnv(2, **kw), TokenBatchVectorEnv(2, **kw, tpot_guard=True)
    assert v1.core.base_guard == (0.0, 1.0)
    o0, _ = v0.reset(seed=4)
    o1, _ = v1.reset(seed=4)
    d0 = o0.shape[1]
    assert np.array_equal(o0, o1[:, :d0])
    ends = 0
    for _ in range(400):
        o0, r0, t0, tr0, i0 = v0.step(np.zeros((2, v0.core.action_dim)))
        o1, r1, t1, tr1, i1 = v1.step(np.zeros((2, v1.core.action_dim)))
        assert np.array_equal(o0, o1[:, :d0]) and np.array_equal(r0, r1)
        assert np.array_equal(t0, t1) and np.array_equal(tr0, tr1)
        assert set(i0) == set(i1) and all(np.array_equal(i0[k], i1[k]) for k in i0)
        ends += int((t0 | tr0).sum())
    assert ends >= 2


def _tpot_state(core, c):
    """The TPOT state of copy c computed directly from the engine's arrays (section 11's definitions)."""
    A, cfg = core.run.arrays, core.run.cfg[c]
    t = int(A.now[c])
    run = [int(r) for r in A.run_ids[c, :A.n_run[c]] if A.status[c, r] != K.ENDED]
    dec = [r for r in run if A.gen[c, r] > 0 and A.computed[c, r] == A.prompt[c, r] + A.gen[c, r] - 1]
    tau = int(cfg[K.C_PS0]) + int(cfg[K.C_PS_DECODE]) * len(dec) + int(cfg[K.C_PS_KV]) * sum(
        int(A.computed[c, r]) for r in dec)
    slo = [r for r in run if A.gen[c, r] > 0 and A.t2[c, r] < K.NO_TPOT_SLO_NS]
    credit = {r: float(A.t2[c, r]) * float(A.gen[c, r]) - float(t - A.first_token[c, r]) for r in slo}
    guarded = sorted(credit[r] / A.t2[c, r] for r in slo if r in dec and A.t2[c, r] * 1000 > tau)
    out = [len(dec) / cfg[K.C_MAX_SEQS], tau / 1000 / min(A.t2[c, r] for r in slo) if slo else 0.0]
    if guarded:
        n = len(guarded)
        qs = [guarded[int(q * (n - 1) + 0.5)] for q in (0.0, 0.25, 0.5, 0.75, 1.0)]
        out += [math.copysign(math.log1p(abs(x)), x) / math.log1p(100.0) for x in qs] + [0.0]
    else:
        out += [0.0] * 5 + [1.0]
    out.append(sum(credit[r] < 0 for r in slo) / len(run) if run else 0.0)
    return np.clip(np.array(out), -10, 10).astype(np.float32)


def test_tpot_observation_is_the_rules_state():
    """At every decision epoch of several episodes, the TPOT state equals a direct computation from the
    engine's arrays; it is non-trivial (guarded requests seen, some behind their TPOT SLO)."""
    env = TokenBatchVectorEnv(4, rho=(1.2, 2.5), window=48, warmup=16, cooldown=16, tpot_guard=True)
    obs, _ = env.reset(seed=1)
    rng = np.random.default_rng(0)
    seen_guarded = seen_lost = 0
    for _ in range(300):
        for c in range(4):
            if not env._done[c] and not env._needs_reset[c]:
                want = _tpot_state(env.core, c)
                np.testing.assert_allclose(obs[c, -N_TPOT:], want, rtol=1e-6, atol=1e-6)
                seen_guarded += want[-2] == 0.0
                seen_lost += want[-1] > 0.0
        obs, *_ = env.step(rng.uniform(-1, 1, (4, env.core.action_dim)))
    assert seen_guarded > 20 and seen_lost > 0


def test_single_env_v1_lockstep_with_vector():
    single = TokenBatchEnv(tpot_guard=True, rho=(0.8, 1.8), **SMALL)
    vec = TokenBatchVectorEnv(1, tpot_guard=True, rho=(0.8, 1.8), **SMALL)
    o1, _ = single.reset(seed=2)
    o2, _ = vec.reset(seed=2)
    assert np.array_equal(o1, o2[0])
    rng = np.random.default_rng(3)
    for _ in range(100):
        a = rng.uniform(-1, 1, single.core.action_dim).astype(np.float32)
        o1, r1, te, tr, _ = single.step(a)
        o2, r2, *_ = vec.step(a[None])
        assert np.array_equal(o1, o2[0]) and r1 == r2[0]
        if te or tr:
            break


def test_controlled_replay_applies_the_controllers_budget():
    """The evaluator's controlled replay of a v1 controller (``ControlSpec.guard``) runs the rule with
    the (u, B_min) the controller returns: a constant one replays the static rule request by request."""
    from tokenbatch_env.control import ControlSpec, run_controlled
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.engine.state import EngineConfig
    from tokenbatch_env.policies import IndexParams, engine_policy
    from tokenbatch_env.traces.suites import load_suite
    from tokenbatch_env.workload import WorkloadSpec, prepare_workload

    prof = load_profile("stress-512")
    wl = prepare_workload(WorkloadSpec(suite="seed-200", split="test"), prof)
    traces = wl.at(1.5)[:3]
    assert load_suite("seed-200")   # (the suite the workload read)
    theta = IndexParams().theta_vector(wl.t_ref_ms)

    def make(t_ref_ms):
        def ctrl(obs):
            assert obs.shape[1] == obs_dim(8, True)
            n = obs.shape[0]
            return np.tile(theta, (n, 1)), np.zeros(n), (np.full(n, -0.3), np.full(n, 0.05))
        return ctrl
    spec = ControlSpec("v1", "index", IndexParams(), 0.0, 8, 100.0, make, (), guard=(0.0, 1.0))
    got = run_controlled(traces, prof, EngineConfig(), spec, estimates=wl.estimates()[:3],
                         residual_life=wl.residual_life, t_ref_ms=wl.t_ref_ms, lambda_sat=wl.lambda_sat)
    pol = engine_policy("index", params=IndexParams(), shed_margin=0.0, t_ref_ms=wl.t_ref_ms)
    want = simulate(traces, prof, pol, EngineConfig(budget_rule="tpot-guard", budget_u=-0.3, budget_bmin=0.05),
                    estimates=wl.estimates()[:3], residual_life=wl.residual_life)
    plain = simulate(traces, prof, pol, EngineConfig(), estimates=wl.estimates()[:3], residual_life=wl.residual_life)
    for i in range(3):
        assert np.array_equal(got.records(i)["finish_ns"], want.records(i)["finish_ns"])
    assert any(not np.array_equal(got.records(i)["finish_ns"], plain.records(i)["finish_ns"]) for i in range(3))
