"""Engine rule 13 (docs/design.md section 13): a request that arrives with its prompt's KV cache and
its first token (a decode replica's side of a prefill/decode handoff)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.simulate import EngineRun, simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError

from engine_helpers import tiny_trace
from test_engine_properties import _pool_consistent, _policy, assert_tokens_conserved, configs, policies, traces


def _sim(trace, with_kv, **cfg):
    cfg.setdefault("record_iterations", 10_000)
    return simulate(trace, "linear", "fcfs", EngineConfig(**cfg), with_kv=[np.asarray(with_kv, bool)])


@pytest.mark.parametrize("prompt, output", [(100, 20), (16, 2), (300, 40), (17, 33)])
def test_a_request_with_its_kv_runs_the_decode_of_the_same_request_without(prompt, output):
    """Alone on the engine, a request that arrives with its KV runs exactly the iterations the same
    request runs after its first token: one decode token each, at the same contexts and costs."""
    tr = tiny_trace([0.0], [prompt], [output])
    plain = _sim(tr, [False], async_scheduling=False, jumps=False)
    kv = _sim(tr, [True], async_scheduling=False, jumps=False)
    p, k = plain.records(0), kv.records(0)
    assert k["end_state"][0] == K.E_COMPLETED and k["first_token_ns"][0] == 0 and k["first_token_iteration"][0] == 0
    assert kv.arrays.kv_first[0, 0] == kv.iterations(0)["end_ns"][0]   # (the end of its first iteration here)
    assert k["finish_ns"][0] == p["finish_ns"][0] - p["first_token_ns"][0]
    assert k["finish_iteration"][0] == output - 2   # (iterations 0 .. O - 2: tokens 2 .. O)
    ip, ik = plain.iterations(0), kv.iterations(0)
    assert ik["prefill_tokens"].sum() == 0 and ik["decodes"].sum() == output - 1
    assert np.array_equal(ik["end_ns"] - ik["start_ns"], (ip["end_ns"] - ip["start_ns"])[1:])
    assert np.array_equal(ik["blocks_used"], ip["blocks_used"][1:])


def test_it_is_admitted_before_waiting_requests_through_the_gate():
    """The remote queue is served before the waiting queue (FIFO), through rule 6's gate for
    ceil((N + 1)/bs) blocks plus the watermark; it claims ceil(N/bs) blocks at once."""
    # three requests at t=0: a plain one (A), then two with KV (B, C) that arrive later
    tr = tiny_trace([0.0, 0.0, 0.0], [64, 64, 64], [4, 4, 4])
    r = _sim(tr, [False, True, True], max_num_seqs=2, async_scheduling=False, jumps=False).records(0)
    # max_num_seqs = 2: the two with KV take the slots (their decode tokens), the plain one waits
    assert (r["first_scheduled_ns"][1:] == 0).all() and r["first_scheduled_ns"][0] > 0
    # the gate: a pool of ceil((N + 1)/bs) blocks + watermark admits it (4 blocks claimed at once, a
    # fifth for its token 65); one block fewer never does, though its 4 blocks of KV would fit
    from tokenbatch_env.engine.profiles import load_profile
    tr = tiny_trace([0.0], [64], [3])
    for extra, fits in [(5, True), (4, False)]:
        wm = load_profile("linear").watermark_blocks
        cfg = EngineConfig(num_blocks=1 + extra + wm, block_size=16, async_scheduling=False, jumps=False)
        run = EngineRun([tr], "linear", "fcfs", cfg, with_kv=[np.array([True])])
        run.advance(until_ns=run.arrays.now + 1)
        A = run.arrays
        if fits:
            assert A.status[0, 0] == K.RUNNING and A.held[0, 0] == 5 and A.gen[0, 0] == 2
        else:
            assert A.end_state[0, 0] == K.E_REJECTED and A.recomputed[0, 0] == 0


def test_a_request_with_its_kv_and_one_token_ends_on_arrival():
    tr = tiny_trace([0.0, 5.0], [40, 40], [1, 5])
    r = _sim(tr, [True, True]).records(0)
    assert r["end_state"][0] == K.E_COMPLETED and r["finish_ns"][0] == 0 and r["first_token_ns"][0] == 0
    assert r["end_state"][1] == K.E_COMPLETED and r["first_token_ns"][1] == 5_000_000


def test_kv_that_can_never_fit_is_rejected_not_recomputed():
    tr = tiny_trace([0.0], [200], [5])
    r = _sim(tr, [True], num_blocks=10, block_size=16).records(0)   # 13 blocks needed, 9 usable
    assert r["end_state"][0] == K.E_REJECTED and r["recomputed_tokens"][0] == 0


def test_a_preempted_request_with_kv_recomputes_and_the_work_is_counted():
    """A preemption on the decode side recomputes there (docs/design.md section 13, 5.)."""
    n = 6
    tr = tiny_trace([0.0] * n, [60] * n, [40] * n)
    r = _sim(tr, [True] * n, num_blocks=24, block_size=16, async_scheduling=False, prefix_caching=False)
    rec, it = r.records(0), r.iterations(0)
    assert (rec["end_state"] == K.E_COMPLETED).all()
    assert rec["preemptions"].sum() > 0 and rec["recomputed_tokens"].sum() > 0
    assert it["prefill_tokens"].sum() + it["decodes"].sum() == n * 39 + rec["recomputed_tokens"].sum()


@pytest.mark.parametrize("with_kv, msg", [
    ([np.array([True])], "with_kv for trace 0: expected a bool array of shape (2,)"),
    ([np.array([1, 0])], "with_kv for trace 0: expected a bool array"),
    ([np.array([True, False])] * 2, "got 2 with_kv arrays for 1 traces"),
])
def test_bad_with_kv_is_one_line(with_kv, msg):
    tr = tiny_trace([0.0, 1.0], [10, 10], [3, 3])
    with pytest.raises(ConfigError) as e:
        simulate(tr, "linear", "fcfs", with_kv=with_kv)
    assert msg in str(e.value)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), policies, configs, st.data())
def test_invariants_with_requests_arriving_with_kv(trace, policy, cfg, data):
    """Every request ends once; the pool and slots stay consistent after every iteration; every
    token is computed once (a request with its KV: its O - 1 decode tokens), plus what preemption
    threw away."""
    n = len(trace)
    kv = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    run = EngineRun([trace], "linear", _policy(policy),
                    EngineConfig(max_iterations=200_000, record_iterations=100_000, **cfg),
                    estimates=[trace.output_tokens * 1.3], with_kv=[kv])
    while not run.done.all():
        run.advance(until_ns=run.arrays.now + 1)
        _pool_consistent(run)
        assert (run.arrays.held[0] >= 0).all() and run.arrays.n_free[0] >= 0
    res = run.result()
    rec, it = res.records(0), res.iterations(0)
    assert (rec["end_state"] != K.E_NONE).all() and (rec["end_state"] != K.E_UNFINISHED).all()
    done = (rec["end_state"] == K.E_COMPLETED) | (rec["end_state"] == K.E_LENGTH_CAPPED)
    assert (rec["first_token_ns"][kv] == rec["arrival_ns"][kv]).all()
    assert (rec["finish_ns"][done] >= rec["first_token_ns"][done]).all()
    assert_tokens_conserved(rec, it, cfg, done, kv)


def test_without_with_kv_nothing_changes():
    tr = tiny_trace([0.0, 1.0, 2.0], [50, 70, 20], [10, 3, 8])
    a = _sim(tr, [False, False, False]).records(0)
    b = simulate(tr, "linear", "fcfs", EngineConfig(record_iterations=10_000)).records(0)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


# ------------------------------------------------------------------ the KV transfer (section 13, 3.)
def test_a_free_link_is_no_link():
    tr = tiny_trace([0.0, 0.0, 3.0, 4.0], [100, 40, 70, 20], [10, 6, 9, 4])
    kv = [np.array([True, False, True, True])]
    a = simulate(tr, "linear", "fcfs", EngineConfig(), with_kv=kv).records(0)
    b = simulate(tr, "linear", "fcfs", EngineConfig(), with_kv=kv, kv_link="none").records(0)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("link", ["nvlink", "rdma"])
def test_a_lone_transfer_delays_the_decode_by_its_duration(link):
    from tokenbatch_env.engine.kv_link import KV_LINKS
    from tokenbatch_env.engine.profiles import load_profile
    tr = tiny_trace([0.0], [1000], [12])
    cfg = EngineConfig(async_scheduling=False, jumps=False, record_iterations=1000)
    free = simulate(tr, "linear", "fcfs", cfg, with_kv=[np.array([True])]).records(0)
    run = EngineRun([tr], "linear", "fcfs", cfg, with_kv=[np.array([True])], kv_link=link)
    run.advance(until_ns=np.full(1, 1 << 60))
    rec = run.result().records(0)
    dur = KV_LINKS[link].transfer_ns(1000, load_profile("linear").kv_bytes_per_token)
    assert dur > 0 and run.arrays.kv_ready[0, 0] == dur
    assert rec["finish_ns"][0] == free["finish_ns"][0] + dur
    assert rec["first_scheduled_ns"][0] == dur and rec["first_token_ns"][0] == 0


def test_transfers_are_fifo_per_link():
    from tokenbatch_env.engine.kv_link import KV_LINKS
    from tokenbatch_env.engine.profiles import load_profile
    kvb = load_profile("linear").kv_bytes_per_token
    d = lambda n: KV_LINKS["rdma"].transfer_ns(n, kvb)  # noqa: E731
    tr = tiny_trace([0.0, 0.0, 0.0], [300, 500, 200], [5, 5, 5])
    run = EngineRun([tr], "linear", "fcfs", EngineConfig(), with_kv=[np.array([True, True, True])],
                    kv_src=[np.array([0, 0, 1])], kv_link="rdma")
    run.advance(until_ns=np.full(1, 1 << 60))
    ready = run.arrays.kv_ready[0, :3].tolist()
    # requests 0 and 1 share link 0 (1 starts when 0 ends); 2 has link 1 to itself
    assert ready == [d(300), d(300) + d(500), d(200)]
    assert run.arrays.link_free[0].tolist() == [d(300) + d(500), d(200)]


def test_a_transfer_takes_a_seat():
    """An admitted request in transfer holds its blocks and counts against max_num_seqs (a departure
    from vLLM, whose receiving requests do not: docs/design.md section 13)."""
    tr = tiny_trace([0.0, 0.0], [300, 300], [5, 5])
    run = EngineRun([tr], "linear", "fcfs", EngineConfig(max_num_seqs=1), with_kv=[np.array([True, True])],
                    kv_link="rdma")
    run.advance(until_ns=np.full(1, 1 << 60))
    rec = run.result().records(0)
    assert run.arrays.kv_ready[0, 1] > rec["finish_ns"][0]   # (admitted after the first ended)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), policies, configs, st.data())
def test_invariants_with_kv_transfers(trace, policy, cfg, data):
    """With transfers over random links: every request ends once; the pool and slots stay consistent
    after every iteration; running plus transferring requests never exceed max_num_seqs; tokens are
    conserved; a link's transfers never overlap."""
    from tokenbatch_env.engine.kv_link import KVLink
    n = len(trace)
    kv = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    src = np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), np.int64)
    link = KVLink("t", data.draw(st.sampled_from([0.05, 0.5, 5.0])), data.draw(st.sampled_from([0.0, 300.0])))
    run = EngineRun([trace], "linear", _policy(policy),
                    EngineConfig(max_iterations=200_000, record_iterations=100_000, **cfg),
                    estimates=[trace.output_tokens * 1.3], with_kv=[kv], kv_src=[src], kv_link=link)
    while not run.done.all():
        run.advance(until_ns=run.arrays.now + 1)
        _pool_consistent(run)
        A = run.arrays
        assert A.n_run[0] - A.n_pend[0] + A.n_xfer[0] <= cfg["max_num_seqs"]
    res = run.result()
    rec, it = res.records(0), res.iterations(0)
    assert (rec["end_state"] != K.E_NONE).all() and (rec["end_state"] != K.E_UNFINISHED).all()
    done = (rec["end_state"] == K.E_COMPLETED) | (rec["end_state"] == K.E_LENGTH_CAPPED)
    assert_tokens_conserved(rec, it, cfg, done, kv)
    ready = run.arrays.kv_ready[0, :n]
    moved = kv & (ready >= 0)
    assert (ready[moved] >= rec["arrival_ns"][moved]).all()
    kvb = res.profiles[0].kv_bytes_per_token
    for lk in range(3):
        ids = np.flatnonzero(moved & (src == lk))
        ids = ids[np.argsort(ready[ids], kind="stable")]
        starts = ready[ids] - np.array([link.transfer_ns(int(trace.prompt_tokens[i]), kvb) for i in ids], np.int64)
        assert (starts[1:] >= ready[ids][:-1]).all()
    # a transferred request runs no earlier than its transfer's end
    ran = moved & (rec["first_scheduled_ns"] >= 0)
    assert (rec["first_scheduled_ns"][ran] >= ready[ran]).all()
