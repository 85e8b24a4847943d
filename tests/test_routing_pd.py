"""P/D clusters routed from outside (docs/design.md sections 12-13): ``engine.routing.PDRoutingRun``
(``disagg_kernel.run_pd_kernel`` with external routing) equals ``simulate_pd`` record for record when
every action defers to the base router, and when a Python router on the observed view routes as
least-outstanding does; TokenBatchCluster-v0 with ``pd``; a P/D router agent in the benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbatch_env.engine import cluster_kernel as CK
from tokenbatch_env.engine.disagg import simulate_pd
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.routing import PDRoutingRun
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.policies import engine_policy
from tokenbatch_env.workload import WorkloadSpec, prepare_workload


@pytest.fixture(scope="module")
def workload():
    prof = EngineConfig().resolve(load_profile("stress-512"))
    wl = prepare_workload(WorkloadSpec(suite="seed-200", split="test", replicas=4, max_traces=3), prof)
    return prof, wl, engine_policy("sjf", shed_margin=0.5, t_ref_ms=wl.t_ref_ms)


def same_records(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in b:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k]), equal_nan=True), k


@pytest.mark.parametrize("router,split", [("round-robin", (2, 2)), ("jsq", (1, 3)), ("least-predicted-ttft", (3, 1))])
def test_deferring_every_action_is_simulate_pd(workload, router, split):
    prof, wl, pol = workload
    traces, est = wl.at(1.2), wl.estimates(False)
    run = PDRoutingRun(traces, prof, pol, None, prefill_replicas=split[0], decode_replicas=split[1],
                       base_router=router, decode_router="jsq", first_token_at="decode", estimates=est,
                       residual_life=wl.residual_life)
    steps = 0
    while not run.done.all():
        run.step(np.full(len(traces), -1), ~run.done)
        steps += 1
    assert steps > 100 and (run.replaced > 0).all()
    for e, t in enumerate(traces):
        want = simulate_pd(t, prof, pol, None, prefill_replicas=split[0], decode_replicas=split[1],
                           prefill_router=router, decode_router="jsq", first_token_at="decode", estimates=est[e],
                           residual_life=wl.residual_life)
        got = run.result(e)
        same_records(got.records(), want.records())
        assert np.array_equal(got.replica_stats()["utilisation"], want.replica_stats()["utilisation"])


def test_routing_on_the_observed_view_as_least_outstanding_is_that_router(workload):
    """Argmin of the observed outstanding (ties: the lowest index) over the mask, chosen in Python
    from ``view``, gives least-outstanding's replay: the view at each decision is the router's."""
    prof, wl, pol = workload
    traces, est = wl.at(1.5)[:2], wl.estimates(False)[:2]
    run = PDRoutingRun(traces, prof, pol, None, prefill_replicas=3, decode_replicas=1, estimates=est,
                       residual_life=wl.residual_life)
    while not run.done.all():
        out = np.where(run.mask, run.view[..., CK.V_OUT], np.iinfo(np.int64).max)
        run.step(np.argmin(out, axis=1), ~run.done)
    assert (run.replaced == 0).all()
    for e, t in enumerate(traces):
        want = simulate_pd(t, prof, pol, None, prefill_replicas=3, decode_replicas=1,
                           prefill_router="least-outstanding", estimates=est[e], residual_life=wl.residual_life)
        same_records(run.result(e).records(), want.records())


def test_cluster_env_with_pd():
    from gymnasium.utils.env_checker import check_env

    from tokenbatch_env.envs.cluster_env import TokenBatchClusterEnv, TokenBatchClusterVectorEnv
    small = dict(replicas=4, pd=(3, 1), window=8, warmup=2, cooldown=2, max_traces=3, policy="sjf", shed_margin=0.5)
    env = TokenBatchClusterEnv(**small)
    check_env(env, skip_render_check=True)
    assert env.action_space.n == 3 and env.observation_space.shape == (3 * 11 + 4,)
    env.reset(seed=3)
    rewards = []
    while True:
        _, r, term, _, _ = env.step(1)
        rewards.append(r)
        if term:
            break
    # every reward in the last step: the episode's scored requests met, as its replay records them
    run = env._vec.run
    met = run.result(0).records()["met"][run.s0[0]:run.s1[0]]
    assert sum(rewards[:-1]) == 0 and rewards[-1] == met.sum() > 0
    # the vector env: lockstep with the single env, cluster by cluster
    v = TokenBatchClusterVectorEnv(2, **small)
    o, _ = v.reset(seed=[3, 4])
    e1 = TokenBatchClusterEnv(**small)
    o1, _ = e1.reset(seed=3)
    assert np.array_equal(o[0], o1)
    for _ in range(20):
        o, *_ = v.step(np.array([2, 0]))
        o1, *_ = e1.step(2)
        assert np.array_equal(o[0], o1)
    with pytest.raises(Exception, match="pd: 2:3 must add up to the replicas R = 4"):
        TokenBatchClusterEnv(replicas=4, pd=(2, 3))
    with pytest.raises(Exception, match="settings of a P/D cluster"):
        TokenBatchClusterEnv(replicas=4, kv_link="rdma")


def test_a_pd_router_agent_deferring_to_its_base_router_is_that_routers_pd_row():
    from tokenbatch_env.control import RouterAgent
    from tokenbatch_env.envs.cluster_env import ClusterEnvConfig
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark
    from tokenbatch_env.errors import ConfigError
    env = ClusterEnvConfig(replicas=4, pd=(3, 1), policy="sjf", shed_margin=0.5, base_router="jsq",
                           first_token_at="decode")
    agent = RouterAgent("defer", env, lambda: lambda obs, masks: np.full(len(obs), -1, np.int64))
    kw = dict(policies=("sjf",), shed=True, loads=(1.2,), max_traces=2, upper_bound=False, replicas=4,
              routers=("round-robin", "jsq"), shed_margins=(("sjf", 0.5),), bootstrap_b=100, router_agents=(agent,))
    with pytest.raises(ConfigError, match="P/D split 3:1"):
        BenchConfig(**kw)
    rows = {r["label"]: r for r in run_benchmark(BenchConfig(pd=(3, 1), **kw)).data["loads"][0]["rows"]}
    label = "sjf+shed [P/D 3:1, first token at decode]"
    mine = rows[f"defer x {label}"]
    assert mine["goodput_per_unit"] == rows[f"jsq x {label}"]["goodput_per_unit"]
    assert {f"round-robin x {label}", f"jsq x {label}"} <= set(mine["vs"])
