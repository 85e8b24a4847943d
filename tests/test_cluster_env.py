"""TokenBatchCluster-v0 (docs/design.md section 12, "Routing env"): Gymnasium's checks, the native vector
env, rewards that are the cluster replay's scored requests met, lockstep and determinism, bad input."""

import gymnasium as gym
import numpy as np
import pytest

import tokenbatch_env  # noqa: F401  (registers the envs)
from tokenbatch_env.engine.cluster import simulate_cluster
from tokenbatch_env.envs.cluster_env import (REPLICA_FEATURES, REQUEST_FEATURES, ClusterEnvConfig,
                                             TokenBatchClusterEnv, TokenBatchClusterVectorEnv)
from tokenbatch_env.errors import ConfigError

SMALL = dict(replicas=3, window=16, warmup=4, cooldown=4, max_traces=3)


def test_gym_make_with_no_arguments_passes_check_env():
    from gymnasium.utils.env_checker import check_env
    env = gym.make("TokenBatchCluster-v0")
    check_env(env.unwrapped, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (4 * len(REPLICA_FEATURES) + len(REQUEST_FEATURES),) and env.action_space.n == 4
    assert env.unwrapped.action_masks().shape == (4,)


@pytest.mark.parametrize("policy, margin", [("fcfs", None), ("sjf", 0.0)])
def test_round_robin_by_hand_earns_the_cluster_replay_s_scored_met(policy, margin):
    """Actions t mod R (round-robin, every replica allowed): the episode's rewards sum to the scored
    requests met in simulate_cluster of its window behind round-robin (the same replica policy, its
    estimates and T_ref), and the last step ends it."""
    from tokenbatch_env.policies import engine_policy
    env = TokenBatchClusterEnv(**SMALL, rho=1.3, policy=policy, shed_margin=margin)
    env.reset(seed=3)
    run = env._vec.run
    trace, s0, s1 = run.traces[0], int(run.s0[0]), int(run.s1[0])
    total, t, done = 0.0, 0, False
    while not done:
        assert env.action_masks().all()
        _, r, done, trunc, info = env.step(t % 3)
        assert not trunc and info["replaced"] == 0
        total += r
        t += 1
    assert t == len(trace)
    prof = env._vec.run.run.profiles[0]
    pol = engine_policy(policy, shed_margin=margin, t_ref_ms=env._vec.workload.t_ref_ms)
    met = simulate_cluster(trace, prof, pol, replicas=3, router="round-robin",
                           estimates=run.g[7][0, :len(trace)], residual_life=env._vec.workload.residual_life
                           ).records()["met"]
    assert total == met[s0:s1].sum() > 0
    assert info["episode_goodput"] == pytest.approx(total / (s1 - s0))
    with pytest.raises(ConfigError, match="call reset"):
        env.step(0)


def test_vector_env_lockstep_with_single_envs_and_determinism():
    E = 3
    vec = gym.make_vec("TokenBatchCluster-v0", num_envs=E, vectorization_mode="vector_entry_point", **SMALL)
    singles = [TokenBatchClusterEnv(**SMALL) for _ in range(E)]
    obs_v, _ = vec.reset(seed=20)
    obs_s = [s.reset(seed=20 + i)[0] for i, s in enumerate(singles)]
    assert np.array_equal(obs_v, np.stack(obs_s))
    rng = np.random.default_rng(0)
    live = np.ones(E, bool)
    for _ in range(60):
        a = rng.integers(0, 3, E)
        ov, rv, tv, _, _ = vec.step(a)
        for i, s in enumerate(singles):
            if live[i]:
                o, r, term, _, _ = s.step(int(a[i]))
                assert np.array_equal(ov[i], o) and rv[i] == r and tv[i] == term
                live[i] = not term
    vec2 = TokenBatchClusterVectorEnv(E, ClusterEnvConfig(**SMALL))
    assert np.array_equal(vec2.reset(seed=20)[0], np.stack(obs_s))   # (the same seeds, the same episodes)
    o1 = [vec2.reset(seed=5)[0]] + [vec2.step(np.arange(E) % 3)[0] for _ in range(30)]
    o2 = [vec2.reset(seed=5)[0]] + [vec2.step(np.arange(E) % 3)[0] for _ in range(30)]
    assert all(np.array_equal(a, b) for a, b in zip(o1, o2))


def test_autoreset_next_step_starts_a_new_episode():
    vec = TokenBatchClusterVectorEnv(2, ClusterEnvConfig(**SMALL))
    vec.reset(seed=1)
    ended = False
    for _ in range(400):
        obs, r, term, _, info = vec.step(np.zeros(2, np.int64))
        if term.any():
            e = int(np.flatnonzero(term)[0])
            assert np.isfinite(info["episode_goodput"][e])
            obs, r, term2, _, _ = vec.step(np.zeros(2, np.int64))
            assert r[e] == 0 and not term2[e] and obs[e].any()   # the next episode's first arrival
            ended = True
            break
    assert ended


@pytest.mark.parametrize("kw, msg", [
    (dict(replicas=0), "replicas: must be an integer in [1, 4096]"),
    (dict(rho=0), "rho: must be a positive number"),
    (dict(base_router="nope"), "base_router: unknown router 'nope'"),
    (dict(policy="srpt-oracle"), "policy: a deployable policy"),
    (dict(shed_margin=5.0), "shed_margin: shed_margin must be in"),
    (dict(window=500, replicas=8), "no trace of seed-200/train holds an episode"),
])
def test_bad_config(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        TokenBatchClusterEnv(**{**SMALL, **kw})
