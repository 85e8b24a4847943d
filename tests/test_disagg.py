"""Prefill/decode disaggregation (docs/design.md section 13): the pools' exactness properties and
conservation."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.cluster import simulate_cluster
from tokenbatch_env.engine.disagg import simulate_pd
from tokenbatch_env.engine.kv_link import KVLink
from tokenbatch_env.engine.simulate import EngineRun
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.traces import Trace
from test_cluster import _trace_file

COMPARED = ("first_scheduled_ns", "first_token_ns", "finish_ns", "preemptions", "recomputed_tokens", "end_state")


def _trace(n=60, seed=0, gap_ms=8.0, prompt=(10, 700), output=(1, 60), shared=False):
    rng = np.random.default_rng(seed)
    kw = {}
    if shared:   # a few shared prefixes
        chains = [[1000 * int(g) + j for j in range(3)] for g in rng.integers(0, 3, n)]
        kw = dict(prefix_offsets=np.arange(0, 3 * n + 1, 3), prefix_hashes=np.array(sum(chains, []), np.int64))
    p = rng.integers(*prompt, n)
    if shared:
        p = np.maximum(p, 49)
    return Trace.build(arrival_ns=np.cumsum(rng.integers(0, int(gap_ms * 2e6), n)), prompt_tokens=p,
                       output_tokens=rng.integers(*output, n), ttft_slo_ns=np.full(n, 400_000_000),
                       tpot_slo_ns=np.full(n, 60_000_000), **kw)


def _one_token(t: Trace) -> Trace:
    return Trace.build(arrival_ns=t.arrival_ns, prompt_tokens=t.prompt_tokens, output_tokens=np.ones(len(t), np.int64),
                       ttft_slo_ns=t.ttft_slo_ns, tpot_slo_ns=t.tpot_slo_ns, prefix_offsets=t.prefix_offsets,
                       prefix_hashes=t.prefix_hashes)


@pytest.mark.parametrize("profile, prefix, nb", [("stress-512", False, 80), ("stress-512", True, 80),
                                                 ("llama2-7b-a100", False, 160)])
def test_the_prefill_pool_is_a_cluster_of_one_token_requests(profile, prefix, nb):
    """With a free link and a decode replica per request (each admits its request at once), a
    request's KV is released as its prefill ends: the prefill pool is then a cluster run of the
    same requests with O := 1, record for record (llama2-7b-a100 schedules asynchronously)."""
    t = _trace(shared=prefix, gap_ms=2.0)
    cfg = EngineConfig(prefix_caching=prefix, num_blocks=nb)   # (a tight pool: admissions wait for the frees)
    pd = simulate_pd(t, profile, "fcfs", cfg, prefill_replicas=3, decode_replicas=len(t), kv_link="none",
                     prefill_router="least-outstanding", decode_router="round-robin")
    cl = simulate_cluster(_one_token(t), profile, "fcfs", cfg, replicas=3, router="least-outstanding")
    assert np.array_equal(pd.route_p, cl.route)
    A, B = pd.arrays, cl.arrays
    for name, f in (("first_scheduled_ns", "first_sched"), ("first_token_ns", "first_token"),
                    ("preemptions", "n_preempt"), ("recomputed_tokens", "recomputed")):
        assert np.array_equal(getattr(A, f)[pd.route_p, pd.row_p], getattr(B, f)[cl.route, cl.row]), name
    handed = pd.handoff_ns >= 0
    assert np.array_equal(pd.handoff_ns[handed], B.finish[cl.route, cl.row][handed])
    assert (pd.records()["end_state"] == K.E_COMPLETED).all()


@pytest.mark.parametrize("link", ["none", "nvlink", "rdma", KVLink("slow", 0.5, 200.0)])
def test_each_decode_replica_is_a_single_engine_fed_requests_with_their_kv(link):
    """Each decode replica is the single engine replaying its rows (the handed-off requests, arriving
    with their KV at their handoff instants, over the link of their prefill replica), record for
    record, its transfers' ends included."""
    t = _trace(n=80, gap_ms=4.0)
    pd = simulate_pd(t, "stress-512", "fcfs", prefill_replicas=3, decode_replicas=2, kv_link=link)
    A, Rp = pd.arrays, 3
    for d in range(2):
        ids = np.flatnonzero(pd.route_d == d)
        ids = ids[np.argsort(pd.row_d[ids])]
        assert len(ids) > 5 and (np.diff(pd.handoff_ns[ids]) >= 0).all()
        rows = Trace.build(arrival_ns=pd.handoff_ns[ids], prompt_tokens=t.prompt_tokens[ids],
                           output_tokens=t.output_tokens[ids], ttft_slo_ns=t.ttft_slo_ns[ids],
                           tpot_slo_ns=t.tpot_slo_ns[ids])
        run = EngineRun([rows], "stress-512", "fcfs", EngineConfig(prefix_caching=False),
                        with_kv=[np.ones(len(ids), bool)], kv_src=[pd.route_p[ids]], kv_link=link)
        run.arrays = run.arrays._replace(link_free=np.zeros((1, Rp), np.int64))
        run.advance(until_ns=np.full(1, 1 << 60))
        one = run.result().records(0)
        c = Rp + d
        k = pd.row_d[ids]
        for name, f in (("first_scheduled_ns", "first_sched"), ("finish_ns", "finish"), ("preemptions", "n_preempt"),
                        ("end_state", "end_state")):
            assert np.array_equal(getattr(A, f)[c, k], one[name]), (d, name)
        assert np.array_equal(A.kv_ready[c, k], run.arrays.kv_ready[0, :len(ids)])
        assert np.array_equal(A.kv_first[c, k], run.arrays.kv_first[0, :len(ids)])


def _conserved(pd, t):
    """Every token computed once (each request's N prompt tokens on P, its O - 1 later ones on D),
    plus the recomputed ones; every block back in its pool, none held."""
    A = pd.arrays
    work = 0
    for c in range(len(pd.profiles)):
        it = pd.engine.iterations(c)
        work += int(it["prefill_tokens"].sum() + it["decodes"].sum())
    rec = pd.records()
    done = (rec["end_state"] == K.E_COMPLETED) | (rec["end_state"] == K.E_LENGTH_CAPPED)
    assert done.all()
    need = int((rec["prompt_tokens"] + rec["output_tokens"] - 1).sum())
    assert work == need + int(rec["recomputed_tokens"].sum())
    usable = np.array([p.usable_blocks for p in pd.profiles])
    assert (A.n_free == usable).all() and (A.ref == 0).all() and (A.n_hold == 0).all() and (A.n_xfer == 0).all()


def test_conservation_under_pressure():
    t = _trace(n=120, gap_ms=1.0, prompt=(200, 800), output=(100, 400))
    cfg = EngineConfig(prefix_caching=False, num_blocks=120, record_iterations=100_000)
    pd = simulate_pd(t, "stress-512", "fcfs", cfg, prefill_replicas=2, decode_replicas=2, kv_link="rdma")
    # D's pools are small: preemptions recompute there; P waits for its held blocks, rejecting none
    assert pd.arrays.n_preempt[2:].sum() > 0 and pd.records()["recomputed_tokens"].sum() > 0
    _conserved(pd, t)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 3), st.sampled_from([40, 120, 511]),
       st.booleans(), st.sampled_from(["round-robin", "least-kv", "jsq", "prefix-affinity"]),
       st.sampled_from(["none", "nvlink", "rdma"]), st.sampled_from(["fcfs", "priority"]))
def test_conservation_and_pools(seed, rp, rd, nb, async_on, router, link, policy):
    t = _trace(n=50, seed=seed, gap_ms=3.0, prompt=(5, 600), output=(1, 80), shared=seed % 2 == 0)
    cfg = EngineConfig(num_blocks=nb, async_scheduling=async_on, prefix_caching=seed % 3 == 0,
                       record_iterations=100_000, max_iterations=500_000)
    pd = simulate_pd(t, "stress-512", policy, cfg, prefill_replicas=rp, decode_replicas=rd, decode_router=router,
                     kv_link=link)
    rec = pd.records()
    assert (rec["end_state"] != K.E_UNFINISHED).all() and (rec["end_state"] != K.E_NONE).all()
    A = pd.arrays
    usable = np.array([p.usable_blocks for p in pd.profiles])
    assert (A.n_hold == 0).all() and (A.n_xfer == 0).all() and (A.ref >= 0).all()
    # every block back in its pool (async: but those of requests that ended last, freed at a next schedule)
    assert np.array_equal(usable - A.n_free, (A.ref > 0).sum(axis=1))
    if not async_on:
        assert (A.n_free == usable).all()
    d = pd.route_d >= 0
    moved = d & (rec["kv_ready_ns"] >= 0)   # (the others: a KV that never fits a decode replica's pool)
    assert (rec["end_state"][d & ~moved] == K.E_REJECTED).all()
    assert (pd.handoff_ns[d] >= t.arrival_ns[d]).all() and (rec["kv_ready_ns"][moved] >= pd.handoff_ns[moved]).all()
    assert (rec["finish_ns"][moved] > rec["kv_ready_ns"][moved]).all()
    assert ((t.output_tokens > 1) == (pd.handoff_ns >= 0))[rec["end_state"] == K.E_COMPLETED].all()


def test_first_token_at_moves_only_the_first_token():
    t = _trace()
    pd = simulate_pd(t, "stress-512", prefill_replicas=2, decode_replicas=2, kv_link="rdma")
    a, b = pd.records("prefill"), pd.records("decode")
    d = pd.route_d >= 0
    assert np.array_equal(a["finish_ns"], b["finish_ns"]) and np.array_equal(a["end_state"], b["end_state"])
    assert (b["first_token_ns"][d] > a["first_token_ns"][d]).all()
    assert np.array_equal(a["first_token_ns"][d], pd.handoff_ns[d])
    assert np.array_equal(a["first_token_ns"][~d], b["first_token_ns"][~d])


@pytest.mark.parametrize("kw, msg", [
    (dict(prefill_replicas=0), "prefill_replicas must be an integer >= 1"),
    (dict(decode_replicas=True), "decode_replicas must be an integer >= 1"),
    (dict(kv_link="infiniband"), "unknown KV link 'infiniband'; valid: nvlink, rdma, none"),
    (dict(decode_router="nope"), "nope"),
    (dict(first_token_at="later"), "first_token_at: one of prefill, decode"),
])
def test_bad_input_is_one_line(kw, msg):
    with pytest.raises(ConfigError) as e:
        simulate_pd(_trace(n=5), "stress-512", **kw)
    assert msg in str(e.value)


# ------------------------------------------------------------------ tokenbatch simulate --pd
@pytest.mark.parametrize("fta", ["prefill", "decode"])
def test_simulate_cli_pd_is_simulate_pd(fta, tmp_path, capsys):
    """`simulate --pd Rp:Rd`'s summary and records are ``simulate_pd``'s, with the convention said."""
    import csv
    import json

    from tokenbatch_env.cli import main
    from tokenbatch_env.traces import io as tio
    path, out = _trace_file(tmp_path), tmp_path / "rec.csv"
    argv = ["simulate", "--trace", str(path), "--profile", "linear", "--pd", "2:3", "--router", "jsq",
            "--kv-link", "rdma", "--first-token-at", fta, "--records", str(out)]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    trace, _ = tio.load_trace(str(path))
    res = simulate_pd(trace, "linear", "fcfs", prefill_replicas=2, decode_replicas=3, prefill_router="jsq",
                      kv_link="rdma")
    want = res.records(fta)
    assert d["goodput"] == pytest.approx(float(want["met"].mean()))
    assert d["cluster"]["pd"]["first_token_at"] == fta and d["cluster"]["pd"]["kv_link"]["name"] == "rdma"
    assert d["cluster"]["replicas"] == 5
    assert sum(d["cluster"]["requests"]) == len(trace) + d["cluster"]["pd"]["handed_off"]
    rows = list(csv.DictReader(open(out, newline="")))
    for col in ("first_token_ns", "finish_ns", "prefill_replica", "decode_replica", "kv_ready_ns"):
        assert [int(r[col]) for r in rows] == want[col].tolist(), col
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert ("P/D       2 prefill (replicas 0-1, router jsq) + 3 decode (replicas 2-4 overall, numbered 0-2 in "
            "decode_replica; router least-kv") in text
    assert f"first token at {fta}: token 1 at the end of the" in text


@pytest.mark.parametrize("argv, msg", [
    (["--pd", "2"], "--pd: expected Rp:Rd, integers >= 1 (e.g. 3:5), got '2'"),
    (["--pd", "0:2"], "--pd: expected Rp:Rd, integers >= 1"),
    (["--pd", "2:2", "--replicas", "3"], "--pd 2:2: --replicas 3 is not Rp + Rd = 4"),
    (["--kv-link", "rdma"], "--kv-link: a setting of a P/D run; add --pd Rp:Rd"),
    (["--first-token-at", "decode"], "--first-token-at: a setting of a P/D run; add --pd Rp:Rd"),
    (["--pd", "1:1", "--kv-link", "wifi"], "unknown KV link 'wifi'"),
    (["--pd", "1:1", "--metrics-staleness-ms", "2"], "--pd and --metrics-staleness-ms: staleness is not supported"),
    (["--pd", "1:1", "--iterations", "it.csv"], "--iterations: per-iteration records of a cluster"),
])
def test_simulate_cli_pd_bad_input_is_one_line(argv, msg, tmp_path, capsys, monkeypatch):
    from tokenbatch_env.cli import main
    path = _trace_file(tmp_path, 10)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rec.csv"
    assert main(["simulate", "--trace", str(path), "--profile", "linear", "--records", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenbatch: error: {msg}") and err.count("\n") == 1, err
    assert not out.exists() and not (tmp_path / "it.csv").exists()
