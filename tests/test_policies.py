"""Policies (docs/design.md section 4): the empirical-Gittins index, the scalar drop-in against the
in-engine index, and a contract every named policy passes (with and without shedding)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine import scoring as S
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.simulate import EnginePolicy, EngineRun, simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import PolicyError
from tokenbatch_env.policies import (BASELINES, DropInParams, IndexParams, LinearWeights, engine_policy,
                                     request_tier, score_request_priority)
from tokenbatch_env.predictors import ResidualLife
from tokenbatch_env.traces import Trace

PROFILE = "stress-512"
POLICIES = ("fcfs", "priority", "sjf", "srpt-oracle", "edf", "llf", "empirical-gittins", "index", "weights")
SCORE_POLICIES = POLICIES[2:]
T_REF = 300.0


def _trace(arrival_ms, prompt, output, t1_ms=300.0, t2_ms=60.0, chains=None, prio=None):
    n = len(prompt)
    kw = {}
    if chains is not None:
        kw["prefix_offsets"] = np.concatenate([[0], np.cumsum([len(c) for c in chains])])
        kw["prefix_hashes"] = np.array([h for c in chains for h in c], np.int64)
    return Trace.build(arrival_ns=np.round(np.asarray(arrival_ms, float) * 1e6).astype(np.int64),
                       prompt_tokens=prompt, output_tokens=output, priority=prio,
                       ttft_slo_ns=np.round(np.broadcast_to(np.asarray(t1_ms, float), (n,)) * 1e6).astype(np.int64),
                       tpot_slo_ns=np.full(n, int(t2_ms * 1e6), np.int64), **kw)


def _random_trace(seed, n=40, t1_ms=300.0):
    rng = np.random.default_rng(seed)
    return _trace(np.cumsum(rng.integers(0, 25, n)), rng.integers(20, 400, n), rng.integers(1, 60, n),
                  t1_ms=t1_ms, prio=rng.integers(0, 3, n),
                  chains=[[7, 8, 9][: int(k)] for k in rng.integers(0, 4, n)])


def _policy(name, shed):
    return engine_policy(name, shed_margin=0.5 if shed else None, t_ref_ms=T_REF)


def _estimates(name, trace):
    """srpt-oracle gets the true lengths; every other policy a noisy estimate (deployable)."""
    o = trace.output_tokens.astype(float)
    if name == "srpt-oracle":
        return [o]
    return [o * np.exp(0.5 * np.sin(np.arange(len(o))))]


RL = ResidualLife.from_lengths(np.random.default_rng(3).integers(1, 60, 400)).table
CFG = dict(num_blocks=48, max_num_batched_tokens=256, max_num_seqs=16)


# ------------------------------------------------------------------------ empirical Gittins
def _gittins_brute(lengths, g, a, u_d):
    """sup over Delta of P(X <= Delta) / E[min(X, Delta)], X = a + (L - g) u_d, L > g; the sup is
    attained at an atom of X, so scanning the atoms is exact."""
    L = np.asarray(lengths)
    R = (L[L > g] - g).astype(float)
    X = a + R * u_d
    return max(np.mean(X <= d) / np.mean(np.minimum(X, d)) for d in np.unique(X))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=150), st.integers(0, 130),
       st.one_of(st.just(0.0), st.floats(0.0, 500.0)), st.floats(1e-3, 5.0))
def test_gittins_table_equals_definition(lengths, g, a, u_d):
    mrl = ResidualLife.from_lengths(lengths).table
    tab = S.gittins_table(mrl)
    got = S.gittins_score(tab, mrl, g, a, u_d)
    if g < max(lengths):
        want = _gittins_brute(lengths, g, a, u_d)
    else:  # no L > g in the sample: the residual-life fallback (1 token left)
        want = 1.0 / (a + u_d * mrl[min(g, mrl.size - 1)])
    assert got == pytest.approx(want, rel=1e-9)


def test_gittins_known_cases():
    # deterministic length: G = 1 / remaining service
    mrl = ResidualLife.from_lengths([10] * 5).table
    tab = S.gittins_table(mrl)
    assert S.gittins_score(tab, mrl, 3, 2.0, 0.5) == pytest.approx(1.0 / (2.0 + 7 * 0.5))
    # default table (no information): 1 token left
    one = np.ones(1)
    assert S.gittins_score(S.gittins_table(one), one, 0, 4.0, 1.0) == pytest.approx(0.2)
    assert S.gittins_score(S.gittins_table(one), one, 50, 4.0, 1.0) == pytest.approx(0.2)
    # a bimodal family: a request past the short mode is worth less than a fresh one (a = 0)
    mrl = ResidualLife.from_lengths([2] * 90 + [200] * 10).table
    tab = S.gittins_table(mrl)
    assert S.gittins_score(tab, mrl, 0, 0.0, 1.0) > S.gittins_score(tab, mrl, 5, 0.0, 1.0)
    # known prefill cost lowers the index
    assert S.gittins_score(tab, mrl, 0, 0.0, 1.0) > S.gittins_score(tab, mrl, 0, 50.0, 1.0)
    with pytest.raises(ValueError):
        S.gittins_table(np.array([0.5]))


def test_gittins_in_engine_scores_are_the_table_and_blind_to_true_lengths():
    rng = np.random.default_rng(11)
    n = 30
    arr, prompt, out = np.cumsum(rng.integers(0, 25, n)), rng.integers(20, 400, n), rng.integers(1, 60, n)
    chains = [[7, 8, 9][: int(k)] for k in rng.integers(0, 4, n)]
    tr = _trace(arr, prompt, out, chains=chains)
    prof = EngineConfig(**CFG).resolve(load_profile(PROFILE))
    u_p, u_d = prof.cost.per_token_ms(prof.max_num_batched_tokens)
    pol = _policy("empirical-gittins", False)
    # same trace with other true output lengths: the scores at a fixed early time must not change
    other = _trace(arr, prompt, out[::-1] + 1, chains=chains)
    runs = [EngineRun([t], PROFILE, pol, EngineConfig(**CFG), residual_life=RL) for t in (tr, other)]
    for run in runs:
        run.advance(until_ns=int(60e6))
    A = runs[0].arrays
    tab = S.gittins_table(RL)
    checked = 0
    for k in range(int(A.n_wait[0])):
        r = int(A.wait_ids[0, k])
        if A.gen[0, r] == 0 and A.computed[0, r] == 0:
            assert runs[0].score[0, r] == runs[1].score[0, r]
        checked += 1
    assert checked > 0
    # and a run's waiting scores equal the table's index of their features (prefix caching off)
    run = EngineRun([tr], PROFILE, pol, EngineConfig(prefix_caching=False, **CFG), residual_life=RL)
    run.advance(until_ns=int(60e6))
    A = run.arrays
    snap = [int(A.wait_ids[0, k]) for k in range(int(A.n_wait[0]))]
    assert snap
    now = int(A.now[0])
    g = A.gen[0].copy()
    p_left = A.prompt[0] + A.gen[0]
    run.advance(until_ns=now + 1)  # one iteration: scores from the state at `now`
    for r in snap:
        want = S.gittins_score(tab, RL, int(g[r]), float(p_left[r]) * u_p, u_d)
        assert run.score[0, r] == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------ the scalar drop-in
def _dropin_params(**kw):
    return DropInParams.from_profile(load_profile(PROFILE), IndexParams(**kw), T_REF)


def _kernel_path(params, prompt_total, hits, est, wait_ms, t1_ms, free):
    """The features kernel.py computes for a waiting request without a first token (gen = 0),
    then the same ``policy_score`` call."""
    bs = params.block_size
    p_left = prompt_total - hits * bs
    done = hits * bs
    d_left = est if est > 1.0 else 1.0
    s_ms = S.service_ms(float(p_left), d_left, params.u_p_ms, params.u_d_ms)
    to_deadline = t1_ms - wait_ms
    slack = to_deadline - S.prefill_time_ns(p_left, done, params.budget,
                                             np.asarray(params.cost_ps[:4], np.int64)) / 1e6
    blocks_needed = (prompt_total + bs - 1) // bs - hits
    theta = params.index.theta_vector(params.t_ref_ms)
    # (queue_pos given: the kernel's argument types, so no second compiled variant)
    score = S.policy_score(S.P_INDEX, theta, hits * bs / prompt_total, s_ms, d_left, slack, t1_ms, False,
                           free / params.usable_blocks, float(blocks_needed), float(params.usable_blocks),
                           to_deadline, 0.0, float(bs), 0.0)
    return score, (-1 if slack < 0.0 else 0)


index_params = st.builds(IndexParams, kappa=st.floats(0, 10), slope=st.floats(1e-2, 1e2),
                         gamma=st.floats(0, 1e3), theta=st.floats(0, 1), beta=st.floats(0, 1e3),
                         w_prefix=st.floats(0, 5), a_edf=st.floats(0, 10))
request = st.tuples(st.integers(1, 4000), st.floats(0, 1), st.floats(0, 3000), st.floats(0, 5000),
                    st.floats(1, 5000), st.integers(0, 511))


@settings(max_examples=200, deadline=None)
@given(index_params, st.lists(request, min_size=1, max_size=12))
def test_drop_in_equals_engine_index_and_order(ip, reqs):
    params = DropInParams.from_profile(load_profile(PROFILE), ip, T_REF)
    bs = params.block_size
    eng, drop, eng_tier, drop_tier = [], [], [], []
    for prompt, hit_frac, est, wait, t1, free in reqs:
        hits = int(hit_frac * ((prompt - 1) // bs))      # capped at tokens - 1, like the engine
        p_left = prompt - hits * bs
        ratio = hits * bs / prompt
        s_eng, t_eng = _kernel_path(params, prompt, hits, est, wait, t1, free)
        s_drop = score_request_priority(p_left, est, wait, t1, free, 12345, ratio, params=params)
        assert s_drop == pytest.approx(s_eng, rel=1e-12, abs=0)
        eng.append(s_eng)
        drop.append(s_drop)
        eng_tier.append(t_eng)
        drop_tier.append(request_tier(p_left, wait, t1, ratio, params=params))
    assert drop_tier == eng_tier
    ids = np.arange(len(reqs))
    order = lambda tier, sc: np.lexsort((ids, -np.asarray(sc), -np.asarray(tier)))  # noqa: E731
    assert order(eng_tier, eng).tolist() == order(drop_tier, drop).tolist()


def test_drop_in_reproduces_scores_captured_from_a_simulate_run():
    rng = np.random.default_rng(7)
    n = 80
    chains = [[1, 2, 3, 4][: int(k)] + [100 + i] * int(rng.integers(0, 2)) for i, k in
              enumerate(rng.integers(0, 5, n))]
    tr = _trace(np.cumsum(rng.integers(0, 6, n)), rng.integers(70, 500, n), rng.integers(1, 80, n),
                t1_ms=rng.uniform(50, 600, n), chains=chains)
    ip = IndexParams(kappa=0.7, slope=2.0, gamma=30.0, theta=0.9, beta=50.0, w_prefix=2.0, a_edf=1.5)
    est = tr.output_tokens * np.exp(0.5 * rng.standard_normal(n))
    cfg = EngineConfig(num_blocks=96, max_num_batched_tokens=512, max_num_seqs=8)
    run = EngineRun([tr], PROFILE, engine_policy("index", params=ip, t_ref_ms=T_REF), cfg, estimates=[est])
    params = DropInParams.from_profile(run.profile, ip, T_REF)
    A = run.arrays
    compared, with_hits, lost = 0, 0, 0
    for stop_ms in (40, 80, 120, 160, 200, 260):
        run.advance(until_ns=int(stop_ms * 1e6))
        now = int(A.now[0])
        snap = []
        for k in range(int(A.n_wait[0])):
            r = int(A.wait_ids[0, k])
            if A.gen[0, r] != 0:
                continue  # preempted after its first token: not the drop-in's case
            hits = int(K.prefix_hits(A.hash_head, A.chain_off, A.chain_val, A.uniq_base, 0, r,
                                      int(A.prompt[0, r]), params.block_size))
            snap.append((r, hits, int(A.n_free[0])))
        if not snap:
            continue
        it = int(A.it[0])
        run.advance(until_ns=now + 1)  # exactly one iteration, scored from the state at `now`
        assert int(A.it[0]) == it + 1
        for r, hits, free in snap:
            prompt = int(A.prompt[0, r])
            p_left = prompt - hits * params.block_size
            wait_ms = (now - int(A.arrival[0, r])) / 1e6
            t1_ms = int(A.t1[0, r]) / 1e6
            s = score_request_priority(p_left, float(est[r]), wait_ms, t1_ms, free, 0,
                                       hits * params.block_size / prompt, params=params)
            assert s == pytest.approx(run.score[0, r], rel=1e-12, abs=1e-12), (r, stop_ms)
            assert request_tier(p_left, wait_ms, t1_ms, hits * params.block_size / prompt,
                                params=params) == run.tier[0, r]
            compared += 1
            with_hits += hits > 0
            lost += run.tier[0, r] < 0
    assert compared >= 20 and with_hits > 0 and lost > 0


# ------------------------------------------------------------------------ the policy contract
@pytest.mark.parametrize("shed", [False, True])
@pytest.mark.parametrize("name", POLICIES)
def test_contract_shapes_finite_scores_determinism(name, shed):
    traces = [_random_trace(s) for s in (1, 2)]
    est = [_estimates(name, t)[0] for t in traces]
    pol = _policy(name, shed)
    cfg = EngineConfig(**CFG)
    run = EngineRun(traces, PROFILE, pol, cfg, estimates=est, residual_life=RL)
    A = run.arrays
    t = 0
    while not run.done.all():
        t += int(20e6)
        run.advance(until_ns=t)
        if pol.mode == K.MODE_SCORE:
            live = (A.status == K.WAITING) | (A.status == K.RUNNING)
            assert np.isfinite(run.score[live]).all()
            assert set(np.unique(run.tier[live]).tolist()) <= {-1, 0}
    res = run.result()
    again = simulate(traces, PROFILE, pol, cfg, estimates=est, residual_life=RL)
    for c, tr in enumerate(traces):
        rec = res.records(c)
        n = len(tr)
        assert all(np.asarray(v).shape[0] == n for v in rec.values())
        states = rec["end_state"]
        assert (states != K.E_NONE).all() and (states != K.E_UNFINISHED).all()
        if not shed:
            assert (states != K.E_SHED).all()
        other = again.records(c)
        assert rec.keys() == other.keys()
        for k in rec:
            assert np.array_equal(rec[k], other[k], equal_nan=True), (name, k)


@pytest.mark.parametrize("shed", [False, True])
@pytest.mark.parametrize("name", POLICIES)
def test_contract_ties_by_arrival_then_id(name, shed):
    # one sequence slot: request 0 holds it; 1 and 2 are identical and arrive together (lower id
    # first); 3 and 4 are identical and arrive 1 ms apart (earlier first)
    tr = _trace([0, 1, 1, 2, 3], [100, 64, 64, 64, 64], [30, 5, 5, 5, 5], t1_ms=1e5)
    cfg = EngineConfig(max_num_seqs=1, **{k: v for k, v in CFG.items() if k != "max_num_seqs"})
    est = [np.full(len(tr), 5.0)]  # identical requests get identical estimates
    res = simulate(tr, PROFILE, _policy(name, shed), cfg, estimates=est, residual_life=RL)
    rec = res.records(0)
    assert (rec["end_state"] == K.E_COMPLETED).all()
    fs = rec["first_scheduled_ns"]
    assert fs[1] < fs[2] and fs[3] < fs[4], (name, fs)


@pytest.mark.parametrize("shed", [False, True])
@pytest.mark.parametrize("name", SCORE_POLICIES)
def test_contract_lost_ttft_is_tier_minus_one_and_served_after_live(name, shed):
    # request 0 holds the only slot for a while; 1 is short with a TTFT target it cannot make (every
    # score prefers it: shorter, earlier deadline, less slack); 2 is live
    tr = _trace([0, 1, 2], [100, 40, 300], [40, 3, 3], t1_ms=[1e5, 5.0, 1e5])
    cfg = EngineConfig(max_num_seqs=1, **{k: v for k, v in CFG.items() if k != "max_num_seqs"})
    run = EngineRun([tr], PROFILE, _policy(name, shed), cfg, estimates=_estimates(name, tr),
                    residual_life=RL)
    A = run.arrays
    seen_tier = False
    while not run.done.all():
        start = int(A.now[0])
        run.advance(until_ns=start + 1)
        if A.status[0, 1] == K.WAITING and start > tr.arrival_ns[1] + 5e6:
            assert run.tier[0, 1] == -1 and run.tier[0, 2] == 0
            seen_tier = True
    rec = run.result().records(0)
    if shed:
        assert rec["end_state"][1] == K.E_SHED
    else:
        assert seen_tier
        assert rec["first_scheduled_ns"][2] < rec["first_scheduled_ns"][1]
    # and the same requests without the lost target: request 1 goes first
    tr2 = _trace([0, 1, 2], [100, 40, 300], [40, 3, 3], t1_ms=[1e5, 1e5, 2e5])
    rec2 = simulate(tr2, PROFILE, _policy(name, shed), cfg, estimates=_estimates(name, tr2),
                    residual_life=RL).records(0)
    assert rec2["first_scheduled_ns"][1] < rec2["first_scheduled_ns"][2]


@pytest.mark.parametrize("name", POLICIES)
def test_contract_nan_parameters_name_the_policy(name):
    with pytest.raises(PolicyError, match=f"policy '{name}'"):
        engine_policy(name, shed_margin=float("nan"))
    if name == "index":
        with pytest.raises(PolicyError, match="policy 'index'"):
            engine_policy(name, t_ref_ms=float("nan"))
        with pytest.raises(PolicyError, match="index parameter kappa"):
            engine_policy(name, params=IndexParams(kappa=float("nan")))


def test_kernel_nan_score_names_policy_copy_and_request():
    tr = _random_trace(4, n=10)
    theta = IndexParams().theta_vector(T_REF)
    theta[S.I_KAPPA] = np.nan
    pol = EnginePolicy("index", K.MODE_SCORE, S.P_INDEX, np.stack([IndexParams().theta_vector(T_REF), theta]))
    with pytest.raises(PolicyError, match=r"policy 'index'.*copy 1, request \d+"):
        simulate([tr, tr], PROFILE, pol, EngineConfig(**CFG))
    with pytest.raises(PolicyError, match="empirical-gittins"):
        simulate(tr, PROFILE, _policy("empirical-gittins", False), EngineConfig(**CFG),
                 residual_life=np.array([2.0, 0.5]))


def test_every_baseline_is_covered_and_evaluate_accepts_gittins():
    from tokenbatch_env.evaluate import BenchConfig
    assert set(BASELINES) == set(POLICIES)
    assert BenchConfig(policies=("fcfs", "empirical-gittins")).policies[-1] == "empirical-gittins"


def test_empty_inputs_give_empty_outputs():
    tr = Trace.build(arrival_ns=np.zeros(0, np.int64), prompt_tokens=np.zeros(0, np.int64),
                     output_tokens=np.zeros(0, np.int64))
    for name in POLICIES:
        res = simulate(tr, PROFILE, _policy(name, False), residual_life=RL)
        assert all(np.asarray(v).shape == (0,) for v in res.records(0).values())


# ------------------------------------------------------------------------ the weights (linear) policy
@pytest.mark.parametrize("shed", [False, True])
@pytest.mark.parametrize("name,feature", [("sjf", "log_s"), ("edf", "to_deadline"), ("llf", "slack")])
def test_weights_family_contains_sjf_edf_llf_exactly(name, feature, shed):
    """w = -e_feature (any positive scale) induces the named baseline's order: identical records."""
    traces = [_random_trace(s) for s in (1, 2, 6, 9)]
    est = [_estimates(name, t)[0] for t in traces]
    w = LinearWeights({feature: -0.3})
    lin = engine_policy("weights", weights=w, shed_margin=0.5 if shed else None, t_ref_ms=T_REF)
    a = simulate(traces, PROFILE, lin, EngineConfig(**CFG), estimates=est, residual_life=RL)
    b = simulate(traces, PROFILE, _policy(name, shed), EngineConfig(**CFG), estimates=est, residual_life=RL)
    shed_n = 0
    for c in range(len(traces)):
        ra, rb = a.records(c), b.records(c)
        for k in ra:
            assert np.array_equal(ra[k], rb[k], equal_nan=True), (name, k)
        shed_n += int((ra["end_state"] == K.E_SHED).sum())
    assert shed_n > 0 if shed else True
    fifo = simulate(traces, PROFILE, "fcfs", EngineConfig(**CFG))
    assert any(not np.array_equal(fifo.records(c)["first_scheduled_ns"], a.records(c)["first_scheduled_ns"])
               for c in range(len(traces)))  # a real reordering, not FCFS by accident


def test_weights_queue_pos_orders_by_arrival_and_reversed_weights_reverse_it():
    # one sequence slot held by request 0; 1..4 wait (identical but for arrival): w = -e2 serves them
    # in queue order, +e2 in reverse
    tr = _trace([0, 1, 2, 3, 4], [100, 64, 64, 64, 64], [30, 5, 5, 5, 5], t1_ms=1e5)
    cfg = EngineConfig(max_num_seqs=1, **{k: v for k, v in CFG.items() if k != "max_num_seqs"})
    est = [np.full(len(tr), 5.0)]
    fs = {}
    for sign in (-1.0, 1.0):
        pol = engine_policy("weights", weights=LinearWeights({"queue_pos": sign}), t_ref_ms=T_REF)
        fs[sign] = simulate(tr, PROFILE, pol, cfg, estimates=est, residual_life=RL).records(0)["first_scheduled_ns"]
    assert (np.diff(fs[-1.0][1:]) > 0).all()
    assert (np.diff(fs[1.0][1:]) < 0).all()


def test_linear_score_is_the_normalised_dot_product():
    theta = LinearWeights((0.5, -1.0, 2.0, 0.25, -3.0, 1.5, -0.5, 0.75)).theta_vector(T_REF)
    f = np.array([np.log(40.0 / T_REF), -0.7 / 10, 0.3, 0.2, 10 / 480, 120.0 / T_REF, 90.0 / T_REF, 1.0])
    w = theta[:8]
    got = S.policy_score(S.P_LINEAR, theta, 0.2, 40.0, 3.0, 90.0, 900.0 / 7, True, 0.5, 10.0, 480.0, 120.0,
                         0.0, 16.0, 0.3)
    z = 90.0 / (900.0 / 7)
    f[1] = z / 10
    assert got == pytest.approx(w @ f / np.linalg.norm(w), rel=1e-12)
    assert S.policy_score(S.P_LINEAR, np.r_[np.zeros(8), T_REF], 0.2, 40.0, 3.0, 90.0, 100.0, True, 0.5,
                          10.0, 480.0, 120.0, 0.0, 16.0, 0.3) == 0.0


@pytest.mark.parametrize("bad", [(1.0,) * 7, ("a",) + (0.0,) * 7, (float("nan"),) + (0.0,) * 7,
                                 {"nope": 1.0}])
def test_weights_bad_input_names_the_problem(bad):
    with pytest.raises(PolicyError, match="weight"):
        LinearWeights(bad)
