"""Clusters (docs/design.md section 12): the exactness properties, the router's view and the order of
events at one instant, the routers' rules."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine_helpers import tiny_trace
from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.cluster import ROUTER_NAMES, Router, simulate_cluster
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from test_engine_properties import _policy, traces

SETTINGS = dict(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
replica_configs = st.fixed_dictionaries({
    "num_blocks": st.integers(22, 80),
    "max_num_batched_tokens": st.sampled_from([16, 64, 512]),
    "max_num_seqs": st.sampled_from([2, 4, 64]),
    "long_prefill_token_threshold": st.sampled_from([None, 8, 200]),
    "prefix_caching": st.booleans(),
    "async_scheduling": st.booleans(),
    "swap": st.booleans(),
    "max_wait_ms": st.sampled_from([None, 150.0]),
})
policies = st.sampled_from(["fcfs", "priority", "edf", "index", "sjf+shed"])


def _cfg(c, **kw):
    return EngineConfig(record_iterations=50_000, max_iterations=100_000, **c, **kw)


def _same_records(a: dict, b: dict, what: str, skip=("request", "replica")):
    for k in b:
        if k in skip:
            continue
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")


@settings(**SETTINGS)
@given(traces(max_n=30), policies, replica_configs, st.lists(replica_configs, min_size=1, max_size=2),
       st.lists(st.sampled_from(["linear", "stress-512"]), min_size=3, max_size=3))
def test_everything_to_replica_0_equals_the_single_engine(trace, policy, cfg0, others, profs):
    """A router sending every request to replica 0 (``first``) leaves the others idle and replica 0
    runs exactly as the single engine does: records and per-iteration records identical."""
    cfgs = [_cfg(cfg0)] + [_cfg(c) for c in others]
    est = trace.output_tokens * 1.3
    res = simulate_cluster(trace, profs[:len(cfgs)], _policy(policy), cfgs, router=Router("first"), estimates=est)
    single = simulate(trace, profs[0], _policy(policy), cfgs[0], estimates=[est])
    assert (res.route[res.route >= 0] == 0).all()
    _same_records(res.records(), single.records(0), "records")
    it_c, it_s = res.iterations(0), single.iterations(0)
    for k in it_s:
        np.testing.assert_array_equal(it_c[k], it_s[k], err_msg=f"iterations: {k}")
    assert all(res.iterations(c)["iteration"].size == 0 for c in range(1, len(cfgs)))


@settings(**SETTINGS)
@given(traces(max_n=30), policies, replica_configs, st.integers(2, 4))
def test_round_robin_equals_single_engines_on_the_split_traces(trace, policy, cfg, R):
    """Round-robin sends request i to replica i mod R; each replica runs as a single engine on that
    split of the trace."""
    res = simulate_cluster(trace, "linear", _policy(policy), _cfg(cfg), replicas=R, router="round-robin",
                           estimates=trace.output_tokens * 1.3)
    rec = res.records()
    idx = np.arange(len(trace))
    np.testing.assert_array_equal(res.route, idx % R)
    for r in range(R):
        part = idx[idx % R == r]
        sub = trace.subset(part)
        alone = simulate(sub, "linear", _policy(policy), _cfg(cfg), estimates=[sub.output_tokens * 1.3]).records(0)
        _same_records({k: v[part] for k, v in rec.items()}, alone, f"replica {r}")


@settings(**SETTINGS)
@given(traces(max_n=30), policies, replica_configs, st.sampled_from(ROUTER_NAMES), st.sampled_from([0.0, 5.0]))
def test_one_replica_makes_every_router_the_identity(trace, policy, cfg, router, stale):
    res = simulate_cluster(trace, "linear", _policy(policy), _cfg(cfg, max_model_len=250), replicas=1, router=router,
                           staleness_ms=stale, estimates=trace.output_tokens * 1.3)
    single = simulate(trace, "linear", _policy(policy), _cfg(cfg, max_model_len=250),
                      estimates=[trace.output_tokens * 1.3])
    _same_records(res.records(), single.records(0), router)
    rej = res.route < 0
    np.testing.assert_array_equal(rej, trace.prompt_tokens >= 250)   # rejected at the router, as the engine would


# ------------------------------------------------------------------------- the router's view of time
def _two(arrival_ms, prompt, output, router="least-outstanding", **kw):
    tr = tiny_trace(arrival_ms, prompt, output)
    return simulate_cluster(tr, "linear", "fcfs", EngineConfig(async_scheduling=False, record_iterations=1000),
                            replicas=2, router=router, **kw)


def test_an_end_is_seen_at_its_boundary_not_before():
    """Request 0 runs one iteration [0, e) on replica 0. An arrival at e sees its end (iterations
    ending at t complete before the arrivals at t are routed): least-outstanding ties, lowest index.
    An arrival 1 ns before e sees it in flight: replica 1."""
    e = _two([0.0], [100], [1]).records()["finish_ns"][0]
    at_end = _two([0.0, e / 1e6], [100, 10], [1, 1])
    assert at_end.records()["finish_ns"][0] == e and at_end.route.tolist() == [0, 0]
    before = _two([0.0, (e - 1) / 1e6], [100, 10], [1, 1])
    assert before.route.tolist() == [0, 1]


def test_arrivals_at_one_instant_see_the_earlier_ones():
    """Three arrivals at the same instant: each sees the router's counters updated by the earlier
    ones (least-outstanding spreads them; jsq counts the routed-but-not-yet-visible ones)."""
    for router in ("least-outstanding", "jsq"):
        res = _two([0.0, 0.0, 0.0], [50, 50, 50], [5, 5, 5], router=router)
        assert res.route.tolist() == [0, 1, 0], router


def test_staleness_reads_the_state_of_long_ago():
    """Request 0 holds blocks on replica 0 until f. Request 1 arrives at f + 10 ms: least-kv sees
    equal pools (ties: fewer outstanding, lowest index: replica 0). With a staleness of 20 ms it
    reads the pools at f - 10 ms, while request 0 still held its blocks: replica 1. The router's
    own counters stay at t (request 0's end is seen either way)."""
    f = _two([0.0], [300], [40]).records()["finish_ns"][0] / 1e6
    arr, prompt, out = [0.0, f + 10.0], [300, 10], [40, 1]
    assert _two(arr, prompt, out, router="least-kv").route.tolist() == [0, 0]
    assert _two(arr, prompt, out, router="least-kv", staleness_ms=20.0).route.tolist() == [0, 1]
    assert _two(arr, prompt, out, router="least-kv", staleness_ms=5.0).route.tolist() == [0, 0]
    # least-outstanding reads only the counters: staleness changes nothing
    assert _two(arr, prompt, out, staleness_ms=20.0).route.tolist() == [0, 0]


# ------------------------------------------------------------------------- routers
def test_random_streams_are_shared_by_rows_and_seeded():
    rng = np.random.default_rng(1)
    n = 300
    tr = tiny_trace(np.cumsum(rng.exponential(5, n)), rng.integers(10, 200, n), rng.integers(1, 30, n))
    a = simulate_cluster(tr, "linear", "fcfs", replicas=4, router="random").route
    b = simulate_cluster(tr, "linear", "edf" if False else "priority", replicas=4, router="random").route
    c = simulate_cluster(tr, "linear", "fcfs", replicas=4, router=Router("random", seed=1)).route
    np.testing.assert_array_equal(a, b)        # the stream does not depend on the row
    assert (a != c).any()
    assert np.bincount(a, minlength=4).min() > 50   # roughly uniform


def test_prefix_affinity_follows_the_cache_until_imbalanced():
    """Eight prefix groups on four replicas whose pools hold a few groups each: prefix-affinity keeps
    a group where it is cached (hit rate far above round-robin's); with alpha = beta = 0 it falls
    back to least-outstanding whenever the cached replica is busier, and loses part of that."""
    n = 300
    rng = np.random.default_rng(2)
    g = rng.integers(0, 8, n)
    chains = [[7000 + 100 * g[i] + j for j in range(6)] for i in range(n)]
    tr = tiny_trace(np.cumsum(rng.exponential(30, n)), np.full(n, 120), np.full(n, 4), chains=chains)
    cfg = EngineConfig(prefix_caching=True, num_blocks=40)
    hit = {}
    for r in ("round-robin", "prefix-affinity", Router("prefix-affinity", alpha=0, beta=0)):
        res = simulate_cluster(tr, "linear", "fcfs", cfg, replicas=4, router=r)
        hit[str(r)] = res.replica_stats()["prefix_hit_rate"]
    rr, pa, tight = hit.values()
    assert pa > rr + 0.2
    assert rr < tight < pa


def test_mixed_profiles_and_rejection_at_the_router():
    """Only replicas whose max_model_len exceeds the prompt are candidates; a prompt none can serve
    is rejected at the router (finish = arrival, no replica)."""
    tr = tiny_trace([0.0, 1.0, 2.0], [50, 300, 900], [3, 3, 3])
    res = simulate_cluster(tr, ["linear", "linear"], "fcfs",
                           [EngineConfig(max_model_len=128), EngineConfig(max_model_len=512)], router="jsq")
    rec = res.records()
    assert res.route.tolist() == [0, 1, -1]
    assert rec["end_state"][2] == K.E_REJECTED and rec["finish_ns"][2] == rec["arrival_ns"][2]
    assert rec["replica"].tolist() == [0, 1, -1]


@pytest.mark.parametrize("bad, msg", [
    (dict(router="nope"), "unknown router"),
    (dict(replicas=0), "replicas must be >= 1"),
    (dict(profile=["linear", "linear"], replicas=3), "got 2 for 3 replicas"),
    (dict(config=[EngineConfig(), EngineConfig(block_size=32)]), "one block size"),
    (dict(staleness_ms=-1.0), "staleness"),
])
def test_bad_cluster_settings(bad, msg):
    tr = tiny_trace([0.0, 1.0], [10, 10], [2, 2])
    kw = dict(profile="linear", replicas=2, config=None)
    kw.update(bad)
    with pytest.raises(ConfigError, match=msg):
        simulate_cluster(tr, kw.pop("profile"), "fcfs", kw.pop("config"), **kw)


# ------------------------------------------------------------------------- tokenbatch simulate --replicas
def _trace_file(tmp_path, n=120):
    from tokenbatch_env.traces import io as tio
    rng = np.random.default_rng(5)
    t = tiny_trace(np.cumsum(rng.exponential(8, n)), rng.integers(10, 400, n), rng.integers(1, 40, n), t1_ms=500,
                   t2_ms=50)
    path = tmp_path / "t.csv"
    tio.save_csv(t, path)
    return path


def test_simulate_cli_cluster_records_name_the_replica(tmp_path, capsys):
    import csv
    import json

    from tokenbatch_env.cli import main
    from tokenbatch_env.traces import io as tio
    path = _trace_file(tmp_path)
    out = tmp_path / "rec.csv"
    assert main(["simulate", "--trace", str(path), "--profile", "linear", "--replicas", "3", "--router", "jsq",
                 "--records", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["cluster"]["replicas"] == 3 and d["cluster"]["router"] == "jsq" and sum(d["cluster"]["requests"]) == 120
    rows = list(csv.DictReader(open(out, newline="")))
    trace, _ = tio.load_trace(str(path))
    want = simulate_cluster(trace, "linear", "fcfs", replicas=3, router="jsq").records()
    assert [int(r["replica"]) for r in rows] == want["replica"].tolist()
    assert [int(r["finish_ns"]) for r in rows] == want["finish_ns"].tolist()
    assert main(["simulate", "--trace", str(path), "--profile", "linear", "--replicas", "2"]) == 0
    text = capsys.readouterr().out
    assert "cluster   2 replicas (2 x linear)  router round-robin" in text and "imbalance" in text


@pytest.mark.parametrize("argv, msg", [
    (["--replicas", "0"], "--replicas must be in [1, 4096], got 0"),
    (["--replicas", "1.5"], "--replicas: must be an integer, got '1.5'"),
    (["--router", "jsq"], "--router and --metrics-staleness-ms: a cluster's settings, with --replicas R > 1"),
    (["--replicas", "1", "--metrics-staleness-ms", "5"], "--router and --metrics-staleness-ms: a cluster's"),
    (["--metrics-staleness-ms", "abc"], "--metrics-staleness-ms: must be a number, got 'abc'"),
    (["--replicas", "3", "--replica-profiles", "linear,linear"], "--replica-profiles: 2 profiles for --replicas 3"),
    (["--replica-profiles", "linear,"], "--replica-profiles 'linear,': an empty profile name"),
    (["--replicas", "2", "--block-size", "32", "--replica-profiles", "linear,stress-512"], None),
    (["--replica-profiles", "linear,bs32.json"], "--profile and --replica-profiles: give one"),
    (["--metrics-staleness-ms", "-1"], "--metrics-staleness-ms must be a number of ms >= 0, got -1.0"),
    (["--replicas", "2", "--rho", "0"], "--rho must be a positive number, got 0.0"),
    (["--replicas", "2", "--iterations", "it.csv"], "--iterations: per-iteration records of a cluster"),
])
def test_simulate_cli_bad_cluster_input_is_one_line(argv, msg, tmp_path, capsys, monkeypatch):
    from tokenbatch_env.cli import main
    import json
    from tokenbatch_env.engine.profiles import load_profile
    path = _trace_file(tmp_path, 10)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bs32.json").write_text(json.dumps(dict(load_profile("linear").to_dict(), name="bs32",
                                                        block_size=32)))
    out = tmp_path / "rec.csv"
    base = [] if "--replica-profiles" in argv and "bs32.json" not in ",".join(argv) else ["--profile", "linear"]
    rc = main(["simulate", "--trace", str(path), *base, "--records", str(out), *argv])
    if msg is None:   # (the same block size after the flag: accepted)
        assert rc == 0
        return
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenbatch: error: {msg}") and err.count("\n") == 1, err
    assert not out.exists() and not (tmp_path / "it.csv").exists()


def test_simulate_cli_cluster_flags(tmp_path, capsys):
    """One replica alone is the single engine (per-iteration records allowed); mixed replica profiles
    print in their order; a block-size mismatch between replica profiles is one line."""
    import json

    from tokenbatch_env.cli import main
    from tokenbatch_env.engine.profiles import load_profile
    path = _trace_file(tmp_path, 30)
    assert main(["simulate", "--trace", str(path), "--profile", "linear", "--replicas", "1", "--iterations",
                 str(tmp_path / "it.csv")]) == 0
    assert "cluster" not in capsys.readouterr().out and (tmp_path / "it.csv").exists()
    assert main(["simulate", "--trace", str(path), "--replica-profiles", "stress-512,linear,linear"]) == 0
    out = capsys.readouterr().out
    assert "cluster   3 replicas (1 x stress-512, 2 x linear)" in out and "replica 0's" in out
    (tmp_path / "bs32.json").write_text(json.dumps(dict(load_profile("linear").to_dict(), name="bs32",
                                                        block_size=32)))
    assert main(["simulate", "--trace", str(path), "--replica-profiles", f"linear,{tmp_path / 'bs32.json'}"]) == 2
    assert capsys.readouterr().err.startswith(
        "tokenbatch: error: --replica-profiles: one block size per cluster, got [16, 32]")


def test_simulate_cli_unknown_router(tmp_path, capsys):
    from tokenbatch_env.cli import main
    path = _trace_file(tmp_path, 10)
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", str(path), "--replicas", "2", "--router", "nope"])
    assert e.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_replica_given_more_than_its_share_gets_room(monkeypatch):
    """Each replica's rows and id spaces start at twice its even share; a router that sends a replica
    more (here everything) runs again with more room, and the result is the same."""
    from tokenbatch_env.engine import cluster
    rng = np.random.default_rng(4)
    n = 90
    chains = [[500 + (i % 4) * 10 + j for j in range(3)] for i in range(n)]
    tr = tiny_trace(np.cumsum(rng.exponential(4, n)), rng.integers(60, 200, n), rng.integers(1, 30, n),
                    chains=chains)
    cfg = EngineConfig(prefix_caching=True, num_blocks=60)
    want = simulate(tr, "linear", "fcfs", cfg).records(0)
    monkeypatch.setattr(cluster, "ROW_SLACK", 0)
    got = simulate_cluster(tr, "linear", "fcfs", cfg, replicas=4, router=Router("first"))
    _same_records(got.records(), want, "retried")
    assert got.arrays.arrival.shape[1] == n
    rr = simulate_cluster(tr, "linear", "fcfs", cfg, replicas=4, router="round-robin")
    assert rr.arrays.arrival.shape[1] < n    # (an even share: no retry, smaller rows)


# ------------------------------------------------------------------------- found by review: each a fixed bug
@pytest.mark.parametrize("async_", [False, True])
def test_arrivals_at_one_instant_reach_an_idle_replica_together(async_):
    """An idle replica given an arrival at t starts its iteration at t only after every arrival at t
    is routed: the single engine schedules requests 1 and 2 (both at 100 ms) together, and so does
    the cluster; round-robin on same-instant arrivals equals the split traces."""
    cfg = EngineConfig(async_scheduling=async_, record_iterations=1000)
    tr = tiny_trace([0.0, 100.0, 100.0], [50, 60, 70], [3, 4, 5])
    _same_records(simulate_cluster(tr, "linear", "fcfs", cfg, replicas=2, router=Router("first")).records(),
                  simulate(tr, "linear", "fcfs", cfg).records(0), "first")
    tr = tiny_trace([0.0, 100.0, 100.0, 100.0], [50, 60, 70, 80], [3, 4, 5, 6])
    rec = simulate_cluster(tr, "linear", "fcfs", cfg, replicas=2, router="round-robin").records()
    for r in range(2):
        part = np.arange(4)[np.arange(4) % 2 == r]
        _same_records({k: v[part] for k, v in rec.items()}, simulate(tr.subset(part), "linear", "fcfs", cfg).records(0),
                      f"replica {r}")


def test_a_stale_read_before_the_first_arrival_sees_empty_replicas():
    """Read before anything ran, every replica is empty (not "in flight" with no free blocks):
    least-kv picks the larger pool whatever the staleness."""
    tr = tiny_trace([0.0, 1.0, 2.0], [20, 20, 20], [5, 5, 5])
    cfgs = [EngineConfig(num_blocks=40), EngineConfig(num_blocks=400)]
    for S in (0.0, 0.5, 10.0):
        res = simulate_cluster(tr, ["linear", "linear"], "fcfs", cfgs, router="least-kv", staleness_ms=S)
        assert res.route.tolist() == [1, 1, 1], S


def test_an_idle_async_replica_s_finished_requests_free_their_blocks():
    """Replica 0's request finished long ago; under async scheduling its blocks free at the next
    schedule, which an idle replica had at its last end: least-kv sees them free, as with sync."""
    tr = tiny_trace([0.0, 1.0, 1000.0], [900, 20, 20], [2, 3000, 5])
    for async_ in (False, True):
        res = simulate_cluster(tr, "linear", "fcfs", EngineConfig(async_scheduling=async_, num_blocks=200),
                               replicas=2, router="least-kv")
        assert res.route.tolist() == [0, 1, 0], async_


def test_staleness_changes_nothing_for_routers_that_read_only_their_counters():
    rng = np.random.default_rng(8)
    n = 150
    tr = tiny_trace(np.cumsum(rng.exponential(3, n)), rng.integers(20, 300, n), rng.integers(1, 40, n))
    for router in ("round-robin", "random", "least-outstanding", "po2"):
        a = simulate_cluster(tr, "linear", "fcfs", replicas=3, router=router).route
        b = simulate_cluster(tr, "linear", "fcfs", replicas=3, router=router, staleness_ms=50.0).route
        np.testing.assert_array_equal(a, b)
    a = simulate_cluster(tr, "linear", "fcfs", replicas=3, router="jsq").route
    b = simulate_cluster(tr, "linear", "fcfs", replicas=3, router="jsq", staleness_ms=50.0).route
    assert (a != b).any()
