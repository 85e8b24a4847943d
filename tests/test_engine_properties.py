"""Engine invariants over random traces and configurations (hypothesis)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.traces import Trace


@st.composite
def traces(draw, max_n=25, max_gap_ns=40_000_000):
    n = draw(st.integers(0, max_n))
    gaps = draw(st.lists(st.integers(0, max_gap_ns), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    groups = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    share = draw(st.booleans())
    chains = []
    for p, g in zip(prompt, groups):
        k = min(p // 16, 3) if share else 0
        chains.append([1000 * g + j for j in range(k)])
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chains])]).astype(np.int64)
    hashes = np.array([h for c in chains for h in c], np.int64)
    return Trace.build(arrival_ns=np.cumsum(gaps, dtype=np.int64), prompt_tokens=prompt,
                       output_tokens=output, ttft_slo_ns=np.full(n, 200_000_000),
                       tpot_slo_ns=np.full(n, 30_000_000), priority=[g for g in groups],
                       prefix_offsets=offsets, prefix_hashes=hashes)


configs = st.fixed_dictionaries({
    "num_blocks": st.integers(22, 60),
    "max_num_batched_tokens": st.sampled_from([16, 64, 512]),
    "max_num_seqs": st.sampled_from([2, 4, 64]),
    "prefix_caching": st.booleans(),
    "async_scheduling": st.booleans(),
    "skip_hol": st.booleans(),
    "waiting_preempts": st.booleans(),
    "admission_control": st.booleans(),
    "swap": st.booleans(),
    "swap_space_gib": st.sampled_from([0.0, 0.01, 4.0]),
    "max_wait_ms": st.sampled_from([None, None, 150.0, 400.0]),
    "timeout_running": st.booleans(),
    "resume_first": st.booleans(),
})
policies = st.sampled_from(["fcfs", "priority", "edf", "llf", "sjf", "index", "edf+shed", "fcfs+shed"])


def _policy(name):
    from tokenbatch_env.policies import engine_policy
    if name in ("fcfs", "priority"):
        return name
    base, _, shed = name.partition("+")
    return engine_policy(base, shed_margin=0.5 if shed else None, t_ref_ms=200.0)
SETTINGS = dict(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(trace, policy, cfg, **extra):
    trs = trace if isinstance(trace, list) else [trace]
    est = [t.output_tokens * 1.3 for t in trs]
    # a small iteration cap turns any livelock into a visible failure (unfinished requests)
    return simulate(trace, "linear", _policy(policy),
                    EngineConfig(record_iterations=100_000, max_iterations=200_000, **cfg, **extra),
                    estimates=est)


@settings(**SETTINGS)
@given(traces(), policies, configs)
def test_invariants(trace, policy, cfg):
    r = _run(trace, policy, cfg)
    rec, it = r.records(0), r.iterations(0)
    A = r.arrays
    n = len(trace)
    usable = cfg["num_blocks"] - 1
    # each request ends exactly once, with one end state
    assert A.n_ended[0] == n
    assert (rec["end_state"] != K.E_NONE).all() and (rec["end_state"] != K.E_UNFINISHED).all()
    assert ((rec["end_state"] == K.E_SHED).sum() == 0) or "shed" in policy
    # blocks never negative nor above usable; all returned at the end (sync) or pending (async)
    assert (it["blocks_used"] >= 0).all() and (it["blocks_used"] <= usable).all()
    assert (A.ref[0] >= 0).all()
    if not cfg["async_scheduling"]:
        assert A.n_free[0] == usable and (A.ref[0] == 0).all()
    # clocks monotone
    assert (it["end_ns"] > it["start_ns"]).all()
    assert (it["start_ns"][1:] >= it["end_ns"][:-1]).all()
    assert (np.diff(it["iteration"]) == 1).all()
    done = (rec["end_state"] == K.E_COMPLETED) | (rec["end_state"] == K.E_LENGTH_CAPPED)
    assert (rec["first_scheduled_ns"][done] >= rec["arrival_ns"][done]).all()
    assert (rec["first_token_ns"][done] > rec["first_scheduled_ns"][done]).all()
    assert (rec["finish_ns"][done] >= rec["first_token_ns"][done]).all()
    assert (rec["finish_iteration"][done] - rec["first_token_iteration"][done]
            >= rec["output_tokens"][done] - 1).all()
    # token conservation: every token computed once, plus what preemption threw away
    assert_tokens_conserved(rec, it, cfg, done)
    # goodput in [0, 1]
    assert 0.0 <= rec["met"].mean() <= 1.0 if n else True


def assert_tokens_conserved(rec, it, cfg, done, with_kv=None):
    """The iterations computed every token of the ended requests once (a request that arrived with
    its KV, engine rule 13: its O - 1 later tokens), plus what preemption threw away; with prefix
    caching at most that (hits are not computed)."""
    work = int(it["prefill_tokens"].sum() + it["decodes"].sum())
    kv = np.zeros(len(done), bool) if with_kv is None else with_kv
    need = int((rec["prompt_tokens"][done & ~kv] + rec["output_tokens"][done & ~kv] - 1).sum()
               + (rec["output_tokens"][done & kv] - 1).sum())
    if cfg["prefix_caching"]:
        assert work <= need + rec["recomputed_tokens"].sum() + (
            int(rec["prompt_tokens"].sum()) if cfg["timeout_running"] else 0)
    elif cfg["timeout_running"] and cfg["max_wait_ms"] is not None:
        # a running request timed out mid-prefill: its computed tokens are thrown away uncounted
        assert need + rec["recomputed_tokens"].sum() <= work
    else:
        assert work == need + rec["recomputed_tokens"].sum()


def _pool_consistent(run):
    """Copy 0's block pool and table slots agree: the free queue holds n_free distinct blocks, none
    referenced; every block's reference count is the number of tables holding it (requests with a
    slot: running, or finished and not yet released under async scheduling); slots are distinct and
    none of them is listed free."""
    A = run.arrays
    nb = A.bhash.shape[1]
    queue, b = [], A.fq_next[0, nb]            # nb, nb + 1: the queue's front and back sentinels
    while b != nb + 1 and len(queue) <= nb:
        queue.append(int(b))
        b = A.fq_next[0, b]
    assert len(queue) == A.n_free[0] and len(set(queue)) == len(queue)
    assert (A.ref[0, queue] == 0).all()
    holders = np.flatnonzero(A.slot_of[0] >= 0)
    slots = A.slot_of[0, holders].tolist()
    assert len(set(slots)) == len(slots)
    assert not set(slots) & set(A.slot_free[0, :A.n_slot_free[0]].tolist())
    refs = np.zeros(nb, np.int64)
    for r in holders:
        np.add.at(refs, A.table[0, A.slot_of[0, r], :A.held[0, r]], 1)
    assert np.array_equal(refs, A.ref[0])


def test_swapped_requests_leave_no_table_slot_to_share():
    """Swapped-out requests kept their table slots, which are sized for max_num_seqs running ones:
    an admission with none free took another request's slot (a negative index), both tables then
    claimed the same blocks, and the free queue broke (found by hypothesis: a segfault)."""
    from tokenbatch_env.engine.simulate import EngineRun
    n = 16
    trace = Trace.build(arrival_ns=np.array([0] + [250] * 4 + [355] * 11, np.int64),
                        prompt_tokens=[257, 1, 1, 1, 43, 105, 1, 125, 1, 259, 1, 256, 128, 100, 294, 143],
                        output_tokens=[43, 42, 46, 44, 57, 45, 1, 1, 32, 1, 1, 3, 44, 35, 17, 60],
                        ttft_slo_ns=np.full(n, 200_000_000), tpot_slo_ns=np.full(n, 30_000_000),
                        priority=[1, 0, 0, 2, 1, 1, 1, 0, 2, 2, 2, 1, 0, 2, 2, 0])
    cfg = dict(num_blocks=34, max_num_batched_tokens=64, max_num_seqs=4, prefix_caching=False, swap=True,
               swap_space_gib=4.0, skip_hol=True, waiting_preempts=True, async_scheduling=False,
               admission_control=False, resume_first=False, timeout_running=False, max_wait_ms=None)
    run = EngineRun([trace], "linear", "priority", EngineConfig(max_iterations=10_000, jumps=False, **cfg),
                    estimates=[trace.output_tokens * 1.3])
    swapped = 0
    while not run.done.all():
        assert run.advance(until_ns=run.arrays.now + 1) > 0   # one iteration
        _pool_consistent(run)
        swapped = max(swapped, int(run.arrays.n_swap[0]))
    assert swapped > 0 and run.arrays.n_ended[0] == n
    assert run.arrays.n_free[0] == 33 and run.arrays.n_slot_free[0] == 4


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), policies, configs)
def test_pool_and_slots_consistent_after_every_iteration(trace, policy, cfg):
    _run_checking_the_pool(trace, policy, cfg)


def _run_checking_the_pool(trace, policy, cfg):
    from tokenbatch_env.engine.simulate import EngineRun
    run = EngineRun([trace], "linear", _policy(policy), EngineConfig(max_iterations=200_000, **cfg),
                    estimates=[trace.output_tokens * 1.3])
    while not run.done.all():
        run.advance(until_ns=run.arrays.now + 1)   # one iteration (or the idle engine's jump)
        _pool_consistent(run)


#: swap-heavy configurations: few table slots, tight pools, waiting requests preempting running ones
swap_configs = st.fixed_dictionaries({
    "num_blocks": st.integers(22, 40), "max_num_batched_tokens": st.sampled_from([16, 64]),
    "max_num_seqs": st.sampled_from([2, 3, 4]), "prefix_caching": st.booleans(),
    "async_scheduling": st.booleans(), "skip_hol": st.booleans(), "waiting_preempts": st.just(True),
    "swap": st.just(True), "swap_space_gib": st.sampled_from([0.01, 4.0]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(max_gap_ns=2_000_000), st.sampled_from(["priority", "edf", "index"]), swap_configs)   # bursts
def test_pool_and_slots_consistent_under_swap_pressure(trace, policy, cfg):
    """Reaches the swap-slot corner of ``test_swapped_requests_leave_no_table_slot_to_share``: with the
    fix of 7957fa2 reverted (swapped-out requests keep their table slots), this test failed under
    each of eight hypothesis seeds tried (bounds checks on, 40 examples)."""
    _run_checking_the_pool(trace, policy, cfg)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(traces(max_n=15), min_size=2, max_size=4), policies, configs)
def test_copies_stepped_together_equal_each_alone(trs, policy, cfg):
    together = _run(trs, policy, cfg)
    for c, t in enumerate(trs):
        alone = _run(t, policy, cfg).records(0)
        both = together.records(c)
        for k in alone:
            assert np.array_equal(alone[k], both[k]), k


@settings(max_examples=15, deadline=None)
@given(traces(), policies, configs)
def test_deterministic(trace, policy, cfg):
    a, b = _run(trace, policy, cfg).records(0), _run(trace, policy, cfg).records(0)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@settings(**SETTINGS)
@given(traces(), policies, configs)
def test_jumps_equal_single_steps(trace, policy, cfg):
    jumped = _run(trace, policy, cfg, jumps=True)
    stepped = _run(trace, policy, cfg, jumps=False)
    a, b = jumped.records(0), stepped.records(0)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    ia, ib = jumped.iterations(0), stepped.iterations(0)
    for k in ia:
        assert np.array_equal(ia[k], ib[k]), k
    for f in ("now", "it", "n_free", "ref", "bhash", "fq_next", "hash_head", "table"):
        assert np.array_equal(getattr(jumped.arrays, f), getattr(stepped.arrays, f)), f


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(max_n=70, max_gap_ns=4_000_000), st.sampled_from(["fcfs", "priority"]), st.integers(22, 45),
       st.booleans(), st.booleans())
def test_jumps_past_long_blocked_queues_equal_single_steps(trace, policy, num_blocks, prefix, async_on):
    """vLLM's orders with no shed rule and no time-out look at the queue's head alone during a jump
    (kernel: ``scan_only``): long queues blocked on a small pool, with shared prefixes, give the same
    records, iterations and block state with and without jumps."""
    cfg = {"num_blocks": num_blocks, "prefix_caching": prefix, "async_scheduling": async_on, "max_num_seqs": 64}
    jumped, stepped = (_run(trace, policy, cfg, jumps=j) for j in (True, False))
    for k, v in jumped.records(0).items():
        assert np.array_equal(v, stepped.records(0)[k]), k
    for k, v in jumped.iterations(0).items():
        assert np.array_equal(v, stepped.iterations(0)[k]), k
    for f in ("now", "it", "n_free", "ref", "bhash", "fq_next", "hash_head"):
        assert np.array_equal(getattr(jumped.arrays, f), getattr(stepped.arrays, f)), f


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), policies, configs, st.sampled_from([5.0, 30.0, 100.0]), st.booleans())
def test_jumps_equal_single_steps_at_decision_epochs(trace, policy, cfg, interval_ms, shed_on):
    """Run to decision epochs (docs/design.md section 5) with and without jumps: the same stops, at the
    same clocks, with the same state at each."""
    from tokenbatch_env.engine.simulate import EngineRun
    est = [trace.output_tokens * 1.3]
    runs = [EngineRun([trace], "linear", _policy(policy),
                      EngineConfig(max_iterations=200_000, jumps=j, **cfg), estimates=est) for j in (True, False)]
    if len(trace) == 0:
        return
    for run in runs:
        run.start_epochs(interval_ns=int(interval_ms * 1e6), scored=(0, len(trace)), shed_on=shed_on)
    for _ in range(10_000):
        stops = [int(run.advance_to_decision()[0]) for run in runs]
        assert stops[0] == stops[1]
        A, B = runs[0].arrays, runs[1].arrays
        for f in ("now", "it", "n_wait", "n_run", "n_free", "end_state", "computed", "gen", "n_preempt",
                  "first_token", "finish", "held", "ref"):
            assert np.array_equal(getattr(A, f), getattr(B, f)), f
        assert set(A.wait_ids[0, :A.n_wait[0]].tolist()) == set(B.wait_ids[0, :B.n_wait[0]].tolist())
        if stops[0] != K.STOP_DECIDE:
            break


# ------------------------------------------------------------- jumps past a blocked waiting queue
def _build(arr, prompt, out, chains, t1_ms):
    order = np.argsort(arr, kind="stable")
    chains = [chains[i] for i in order]
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chains])]).astype(np.int64)
    n = len(arr)
    return Trace.build(arrival_ns=np.asarray(arr, np.int64)[order], prompt_tokens=np.asarray(prompt)[order],
                       output_tokens=np.asarray(out)[order], ttft_slo_ns=np.full(n, int(t1_ms * 1e6)),
                       tpot_slo_ns=np.full(n, 30_000_000),
                       prefix_offsets=offsets, prefix_hashes=np.array([h for c in chains for h in c], np.int64))


def _blocked_trace(t1_ms=100.0, extra_waiting=False):
    """Request 0 decodes for ~750 ms holding most of a 21-block pool (num_blocks 22); request 1
    (250-token prompt) arrives at 1 ms and cannot fit until 0 ends. ``extra_waiting``: a second
    blocked request."""
    arr, prompt, out = [0, 1_000_000], [160, 250], [150, 3]
    if extra_waiting:
        arr.append(2_000_000), prompt.append(240), out.append(2)
    return _build(arr, prompt, out, [[]] * len(arr), t1_ms)


def _head_of_line_trace():
    """As ``_blocked_trace``, plus a 20-token request at 2 ms that fits the pool but waits behind
    request 1 (FCFS and EDF put 1 first; head-of-line blocking, rule 6) until request 0 ends."""
    return _build([0, 1_000_000, 2_000_000], [160, 250, 20], [150, 3, 2], [[]] * 3, 400.0)


def _evicted_hits_trace():
    """num_blocks 64: six decoders claim a block every ~2.7 iterations; a donor (320 tokens, chain
    of 20 blocks) ends at once, leaving its cached blocks at the free queue's tail; request 7
    (900 tokens, same chain: 20 hits) waits, blocked, while the decoders' claims evict its hits one
    by one, each raising its prefill time, so its shed instant moves earlier."""
    arr = [0] * 7 + [30_000_000]
    prompt = [64] * 6 + [320, 900]
    out = [200] * 6 + [1, 3]
    chain = list(range(1, 21))
    return _build(arr, prompt, out, [[]] * 6 + [chain, chain], 290.0)


def _counted(trace, policy, cfg, jumps, decide=None):
    """Records, stops and the number of kernel passes (chunk_steps=1: one pass per call; a jump is
    one pass) of a run with or without jumps."""
    from tokenbatch_env.engine.simulate import EngineRun
    run = EngineRun([trace], "linear", _policy(policy),
                    EngineConfig(max_iterations=100_000, jumps=jumps, **cfg),
                    estimates=[trace.output_tokens * 1.0])
    calls, stops = [0], []
    real = K.run_copies

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)
    K.run_copies = counting
    try:
        if decide is None:
            run.advance(chunk_steps=1)
        else:
            run.start_epochs(interval_ns=int(decide * 1e6), shed_on=True)
            while not run.done.all():
                st = int(run.advance_to_decision(chunk_steps=1)[0])
                stops.append((st, int(run.arrays.now[0]), int(run.arrays.n_wait[0])))
                if st != K.STOP_DECIDE:
                    break
    finally:
        K.run_copies = real
    return run.result().records(0), stops, calls[0]


@pytest.mark.parametrize("case", ["decide-one-waiting", "decide-two-waiting", "shed", "time-out",
                                  "evicted-hits", "head-of-line-fcfs", "head-of-line-edf", "head-of-line-index"])
def test_jumps_past_a_blocked_waiting_queue_equal_single_steps(case):
    policy, cfg, decide, trace = "index", {"num_blocks": 22}, None, _blocked_trace()
    if case.startswith("head-of-line"):
        # only the head fails the admission gate; in score order the waiting requests are rescored
        # at each jumped iteration (the index's order moves with the clock and the free blocks)
        policy, trace = case.rsplit("-", 1)[1], _head_of_line_trace()
    elif case == "decide-one-waiting":
        decide = 20.0
    elif case == "decide-two-waiting":
        decide, trace = 20.0, _blocked_trace(extra_waiting=True)
    elif case == "shed":
        policy = "edf+shed"
    elif case == "time-out":
        policy, cfg = "fcfs", {"num_blocks": 22, "max_wait_ms": 300.0}
    else:
        policy, cfg, trace = "edf+shed", {"num_blocks": 64}, _evicted_hits_trace()
    (ra, sa, na), (rb, sb, nb) = (_counted(trace, policy, cfg, j, decide) for j in (True, False))
    for k in ra:
        assert np.array_equal(ra[k], rb[k]), (case, k)
    assert sa == sb
    assert na * 2 < nb, (case, na, nb)  # the jumps did happen despite the waiting request
    w = int(np.argmax(trace.prompt_tokens))
    if case == "head-of-line-fcfs":   # the small request waits behind the head until 0 ends
        assert ra["first_scheduled_ns"][2] >= ra["first_scheduled_ns"][1] > 700_000_000
    elif case == "head-of-line-edf":   # ... until the head's slack < 0 ranks it last (tier -1)
        assert ra["first_scheduled_ns"][2] > 300_000_000 and ra["first_scheduled_ns"][1] > 700_000_000
    elif case == "head-of-line-index":   # ... until the index ranks the short job first
        assert ra["first_scheduled_ns"][2] > 10_000_000
    elif case == "decide-one-waiting":   # the decision comes at the first epoch after its slack < 0
        assert any(s == K.STOP_DECIDE and n == 1 for s, _, n in sa)
    elif case == "decide-two-waiting":
        assert sum(s == K.STOP_DECIDE for s, _, _ in sa) > 20
    elif case in ("shed", "evicted-hits"):
        assert ra["end_state"][w] == K.E_SHED
    else:
        assert ra["end_state"][w] == K.E_TIMED_OUT


@settings(max_examples=300, deadline=None)
@given(st.integers(-10**15, 10**15), st.floats(0.0, 1e7), st.floats(-1e7, 0.0))
def test_first_slack_below_is_the_first_instant(base, idle_ms, thr):
    """The kernel's shed/decision instant: the first t at which its own float expression is below thr."""
    t = int(K._first_slack_below(base, idle_ms, thr))
    below = lambda x: (base - x) / 1e6 - idle_ms < thr  # noqa: E731
    assert below(t) and not below(t - 1)


def test_first_slack_below_beyond_the_clock_range():
    # a trace without SLOs (T1 = NEVER // 4) and a large shed margin: the instant is past any clock
    t1 = np.iinfo(np.int64).max // 8
    assert K._first_slack_below(t1, 5.0, -20.0 * (t1 / 1e6)) == K._FOREVER


@pytest.mark.parametrize("jumps", [True, False])
def test_a_nan_score_stops_the_kernel_with_a_clear_error(jumps):
    """A policy whose score is NaN (here: NaN index coefficients) stops the kernel with an error
    naming the policy, the copy and the request, with or without jumps."""
    from tokenbatch_env.engine.simulate import EngineRun
    from tokenbatch_env.errors import PolicyError
    trace = _head_of_line_trace()
    run = EngineRun([trace], "linear", _policy("index"), EngineConfig(max_iterations=100_000, jumps=jumps),
                    estimates=[trace.output_tokens * 1.0])
    run.theta[:] = np.nan
    with pytest.raises(PolicyError, match=r"'index' .*NaN score for copy 0, request"):
        run.advance()
