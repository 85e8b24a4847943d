"""Clusters routed from outside (docs/design.md section 12, "Routing env"; ``engine.routing.RoutingRun``):
routed as a router routes, each cluster is ``simulate_cluster`` of its trace record for record; routed
by any fixed choices, it is the replay of those choices; masks and replaced actions."""

import numpy as np
import pytest

from engine_helpers import tiny_trace
from tokenbatch_env.engine import cluster_kernel as CK
from tokenbatch_env.engine.cluster import ROUTER_NAMES, simulate_cluster
from tokenbatch_env.engine.routing import RoutingRun
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError

COLS = ("arrival_ns", "first_token_ns", "finish_ns", "end_state", "preemptions", "output_tokens", "replica", "met")


def _traces(k=3, n=80, seed=0, prefix=True):
    out = []
    for j in range(k):
        rng = np.random.default_rng(seed + j)
        t = tiny_trace(np.cumsum(rng.exponential(3.0, n - 5 * j)), rng.integers(10, 300, n - 5 * j),
                       rng.integers(1, 40, n - 5 * j), t1_ms=300, t2_ms=50)
        if prefix:   # shared prefixes, so that prefix-affinity and least-predicted-ttft read hits
            from tokenbatch_env.traces import Trace
            m = len(t)
            groups = rng.integers(0, 4, m)
            hashes = [[int(g) * 10 + b for b in range(int(p) // 16 // 2)] for g, p in zip(groups, t.prompt_tokens)]
            offs = np.concatenate([[0], np.cumsum([len(h) for h in hashes])])
            t = Trace.build(arrival_ns=t.arrival_ns, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
                            ttft_slo_ns=t.ttft_slo_ns, tpot_slo_ns=t.tpot_slo_ns, prefix_offsets=offs,
                            prefix_hashes=np.array([x for h in hashes for x in h], np.int64))
        out.append(t)
    return out


def _drive(run, actions_of):
    steps = 0
    while not run.done.all():
        run.step(actions_of(run))
        steps += 1
        assert steps < 10_000
    return steps


@pytest.mark.parametrize("router", ROUTER_NAMES)
def test_routed_as_the_router_routes_is_simulate_cluster(router):
    """Every action -1 (the base router's choice): each cluster equals its own simulate_cluster."""
    traces = _traces()
    run = RoutingRun(traces, "stress-512", "fcfs", EngineConfig(), replicas=3, base_router=router)
    steps = _drive(run, lambda r: np.full(len(traces), -1))
    assert steps == max(len(t) for t in traces)   # (no arrival rejected: one decision each)
    for e, t in enumerate(traces):
        want = simulate_cluster(t, "stress-512", "fcfs", EngineConfig(), replicas=3, router=router).records()
        got = run.result(e).records()
        for col in COLS:
            assert np.array_equal(got[col], want[col]), (router, e, col)
    assert (run.replaced == run.n_of).all()


def test_fixed_choices_replay_exactly():
    """Actions chosen by hand (a cyclic pattern) give a replay whose replicas each equal the single
    engine fed their rows; the routed replica is the action whenever it was allowed."""
    from tokenbatch_env.engine.simulate import simulate
    traces = _traces(2, prefix=False)
    run = RoutingRun(traces, "stress-512", "fcfs", EngineConfig(), replicas=2, base_router="round-robin")
    taken = [[] for _ in traces]

    def act(r):
        a = (r.pending * 7 // 3) % 2
        for e in range(len(traces)):
            if not r.done[e]:
                taken[e].append((int(r.pending[e]), int(a[e]), bool(r.mask[e, a[e]])))
        return a
    _drive(run, act)
    for e, t in enumerate(traces):
        res = run.result(e)
        for i, a, ok in taken[e]:
            if ok:
                assert res.route[i] == a
        rec = res.records()
        for c in range(2):
            mine = np.flatnonzero(res.route == c)
            alone = simulate(t.subset(mine), "stress-512", "fcfs", EngineConfig()).records()
            assert np.array_equal(alone["finish_ns"], rec["finish_ns"][mine])
            assert np.array_equal(alone["first_token_ns"], rec["first_token_ns"][mine])


def test_views_and_masks_at_each_decision():
    """At each decision the mask is the replicas that serve the prompt; the view's outstanding count is
    the requests routed less those ended; a masked action is replaced and counted."""
    t = tiny_trace(np.arange(6) * 1.0, [10, 5000, 10, 10, 10, 10], [3] * 6, t1_ms=300, t2_ms=50)
    cfgs = EngineConfig()
    run = RoutingRun([t], ["stress-512"][0], "fcfs", cfgs, replicas=2)
    assert run.mask[0].all() and run.pending[0] == 0
    run.step(np.array([1]))
    # request 1 (5,000 tokens) exceeds stress-512's context on both: rejected at the router, skipped
    assert run.pending[0] == 2 and run.route[0, 1] == -1
    assert run.view[0, 1, CK.V_OUT] == 1 and run.view[0, 0, CK.V_OUT] == 0
    before = int(run.replaced[0])
    run.step(np.array([5]))   # (out of range: replaced)
    assert run.replaced[0] == before + 1


def test_bad_input():
    with pytest.raises(ConfigError, match="non-empty list of Traces"):
        RoutingRun([], replicas=2)
    with pytest.raises(ConfigError, match="replicas must be an integer >= 1"):
        RoutingRun(_traces(1, prefix=False), replicas=0)
    run = RoutingRun(_traces(2, prefix=False), replicas=2)
    with pytest.raises(ConfigError, match=r"actions: expected shape \(2,\)"):
        run.step(np.array([0]))


def test_credit_counts_each_scored_request_met_once_and_load_starts_anew():
    """Credited per step, a cluster's rewards sum to its scored requests met (simulate_cluster's
    records); ``load`` puts a new trace on a used cluster, which then replays it as new."""
    from tokenbatch_env.engine.routing import routing_capacity
    from tokenbatch_env.engine.simulate import resolve_copies
    traces = _traces(3, n=70)
    _, resolved = resolve_copies(["stress-512"] * 3, EngineConfig(), 3)
    cap = routing_capacity(traces, resolved)
    run = RoutingRun(traces[:2], "stress-512", "fcfs", EngineConfig(), replicas=3, base_router="jsq", capacity=cap,
                     scored=[(10, 50), (0, 65)])
    got = np.zeros(2, np.int64)
    while not run.done.all():
        run.step(np.full(2, -1))
        got += run.credit()
    got += run.credit()
    for e, (s0, s1) in enumerate([(10, 50), (0, 65)]):
        met = simulate_cluster(traces[e], "stress-512", "fcfs", replicas=3, router="jsq").records()["met"]
        assert got[e] == met[s0:s1].sum() > 0
    assert (run.credit() == 0).all()   # (nothing twice)
    run.load(0, traces[2])             # a used cluster, a new trace
    while not run.done[0]:
        run.step(np.array([-1, 0]), acting=np.array([True, False]))
    want = simulate_cluster(traces[2], "stress-512", "fcfs", replicas=3, router="jsq").records()
    got_rec = run.result(0).records()
    for col in COLS:
        assert np.array_equal(got_rec[col], want[col]), col
    with pytest.raises(ConfigError, match="beyond the run's capacity"):
        run.load(1, _traces(1, n=200, seed=9)[0])
