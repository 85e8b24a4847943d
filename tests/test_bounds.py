"""The section-6 upper bound: >= the relaxation's brute-force optimum, >= every engine policy,
tight on hand-made cases, and exact unattainability detection."""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbatch_env.bounds import (best_case_hits, interval_bound, min_prefill_exceeds, min_prefill_ps2,
                                   min_prefill_ps2_one, request_parts, upper_bound)
from tokenbatch_env.engine.cost_model import CostModel
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.policies import engine_policy
from tokenbatch_env.traces import Trace

from engine_helpers import tiny_trace


# ------------------------------------------------------------------------------ brute force
def edf_feasible(r, d, w) -> bool:
    """Preemptive EDF on one unit-speed machine (optimal for feasibility), integer times."""
    n = len(r)
    rem = [int(x) for x in w]
    order = sorted(range(n), key=lambda i: int(r[i]))
    t, k, ready = 0, 0, []
    while k < n or ready:
        if not ready:
            t = max(t, int(r[order[k]]))
        while k < n and r[order[k]] <= t:
            ready.append(order[k])
            k += 1
        i = min(ready, key=lambda j: (int(d[j]), j))
        nxt = int(r[order[k]]) if k < n else None
        run = rem[i] if nxt is None else min(rem[i], nxt - t)
        t += run
        rem[i] -= run
        if rem[i] == 0:
            ready.remove(i)
            if t > d[i]:
                return False
    return True


def kv_feasible(r, d, kv, usable) -> bool:
    """The KV term's constraint (section 10 (c)): in every interval, the kv needs of the jobs whose
    windows lie inside it fit usable blocks x its length."""
    pts = sorted(set(int(x) for x in r) | set(int(x) for x in d))
    for x in pts:
        for y in pts:
            if y > x and sum(int(k) for a, b, k in zip(r, d, kv) if a >= x and b <= y) > usable * (y - x):
                return False
    return True


def brute_opt(r, d, w, kv=None, usable=None) -> int:
    """The relaxation's optimum: the most jobs feasible on one preemptive machine (and, with ``kv``,
    within the pool in every interval)."""
    n = len(r)
    for size in range(n, 0, -1):
        for s in itertools.combinations(range(n), size):
            s = list(s)
            if edf_feasible(r[s], d[s], w[s]) and (kv is None or kv_feasible(r[s], d[s], kv[s], usable)):
                return size
    return 0


def test_edf_checker_sanity():
    assert edf_feasible(np.array([0, 0]), np.array([5, 5]), np.array([2, 3]))
    assert not edf_feasible(np.array([0, 0]), np.array([5, 5]), np.array([3, 3]))
    assert edf_feasible(np.array([0, 2]), np.array([10, 4]), np.array([5, 2]))
    assert not edf_feasible(np.array([0, 2]), np.array([6, 4]), np.array([5, 2]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 25), st.integers(1, 12)),
                min_size=1, max_size=9))
def test_interval_dp_at_least_brute_force(jobs):
    r = np.array([j[0] for j in jobs], np.int64)
    d = r + np.array([j[1] for j in jobs], np.int64)
    w = np.array([j[2] for j in jobs], np.int64)
    opt = brute_opt(r, d, w)
    for span in (None, 1, 3):
        ub, exact, _ = interval_bound(r, d, w, max_span=span)
        assert ub >= opt, (ub, opt, span)
        assert ub <= len(jobs)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 25), st.integers(1, 12), st.integers(0, 120)),
                min_size=1, max_size=8), st.integers(1, 6))
def test_interval_dp_with_kv_at_least_brute_force(jobs, usable):
    """With the KV term the DP is still >= the relaxation's optimum (both constraints), never above
    the DP without it, and the KV term alone can bind."""
    r = np.array([j[0] for j in jobs], np.int64)
    d = r + np.array([j[1] for j in jobs], np.int64)
    w = np.array([j[2] for j in jobs], np.int64)
    kv = np.array([j[3] for j in jobs], np.int64)
    opt = brute_opt(r, d, w, kv, usable)
    for span in (None, 1, 3):
        ub, _, _ = interval_bound(r, d, w, kv=kv, usable_blocks=usable, max_span=span)
        assert opt <= ub <= interval_bound(r, d, w, max_span=span)[0], (ub, opt, span)
    if len(jobs) == 1:   # one job: exactly whether it fits both ways
        assert interval_bound(r, d, w, kv=kv, usable_blocks=usable)[0] == int(w[0] <= d[0] - r[0]
                                                                                and kv[0] <= usable * (d[0] - r[0]))


def test_kv_scale_keeps_a_relaxation():
    """Huge kv sums are scaled down (rounded down) and the capacity up: still >= the optimum."""
    r = np.zeros(3, np.int64)
    d = np.full(3, 10**12, np.int64)
    kv = np.full(3, 2**61, np.int64)
    w = np.ones(3, np.int64)
    ub, _, _ = interval_bound(r, d, w, kv=kv, usable_blocks=10**7)
    # 10^7 blocks x 10^12 ns = 10^19 block-ns: four of 2^61 (2.3e18) fit, so all three do
    assert ub == 3
    assert interval_bound(r, d, w, kv=kv, usable_blocks=4 * 10**6)[0] == 1   # 4e18 fits one


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_upper_bound_at_least_relaxation_optimum(seed):
    tr = random_trace(np.random.default_rng(seed), n=int(np.random.default_rng(seed).integers(1, 9)))
    for pc, nb in ((True, None), (False, None), (True, 40), (False, 40)):
        prof = EngineConfig(num_blocks=nb).resolve(load_profile("stress-512"))
        res = upper_bound(tr, prof, prefix_caching=pc)
        p = request_parts(tr, prof, pc)
        ok = p.attainable
        a = tr.arrival_ns[ok]
        assert res.kv_term
        assert res.ub_work_d2 >= brute_opt(a, p.d2[ok], p.w_ns[ok], p.kv[ok], p.usable)
        assert res.ub_work_d1 >= brute_opt(a, p.d1[ok], p.wp_ns[ok])
        assert res.ub == min(res.n_attainable, res.ub_work_d1, res.ub_work_d2)


# ------------------------------------------------------------------------------ random traces
def chained_trace(arrival, prompt, output, chains, t1, t2):
    """A trace with SLOs and one prefix chain (a list of block hashes) per request."""
    return Trace.build(arrival_ns=arrival, prompt_tokens=prompt, output_tokens=output,
                       ttft_slo_ns=t1, tpot_slo_ns=t2,
                       prefix_offsets=np.concatenate([[0], np.cumsum([len(c) for c in chains])]),
                       prefix_hashes=np.array([h for c in chains for h in c], np.int64))


def random_trace(rng, n, *, bs=16):
    """Clustered arrivals, shared prefixes, SLOs from loose to impossible."""
    arrival = np.sort(rng.integers(0, int(rng.choice([50e6, 400e6, 2e9])), n)).astype(np.int64)
    prompt = rng.integers(1, int(rng.choice([40, 300, 1500])), n)
    output = rng.integers(1, int(rng.choice([5, 60, 300])), n)
    groups = rng.integers(0, 3, n)
    chains = []
    for i in range(n):
        k = min(int(rng.integers(0, 6)), prompt[i] // bs)
        chains.append([1000 * (groups[i] + 1) + j for j in range(k)])
    t1 = (rng.uniform(0.005, 1.5, n) * 1e9).astype(np.int64)
    t2 = (rng.uniform(0.004, 0.06, n) * 1e9).astype(np.int64)
    return chained_trace(arrival, prompt, output, chains, t1, t2)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_bound_dominates_every_engine_policy(seed):
    rng = np.random.default_rng(seed)
    traces = [random_trace(rng, int(rng.integers(2, 25))) for _ in range(12)]
    for profile in ("linear", "stress-512"):
        for pc in (True, False):
            cfg = EngineConfig(prefix_caching=pc)
            ubs = [upper_bound(t, profile, config=cfg).ub for t in traces]
            for policy in ("fcfs", "priority"):
                res = simulate(traces, profile, policy, cfg)
                for c in range(len(traces)):
                    met = int(res.records(c)["met"].sum())
                    assert ubs[c] >= met, (profile, pc, policy, c, ubs[c], met)


KV_POLICIES = (("fcfs", None), ("priority", None), ("sjf", 0.0), ("edf", 0.0), ("llf", 0.5), ("index", 0.0),
               ("index", None), ("srpt-oracle", None), ("empirical-gittins", 0.0))


def kv_bound_trace(rng, n, *, bs=16):
    """Memory-bound: bursts of long prompts with shared system prompts, long outputs, TPOT SLOs near
    a decode's time (so a request holds its blocks for long at the engine's pace)."""
    arrival = np.sort(rng.integers(0, int(rng.choice([1e8, 1e9, 4e9])), n)).astype(np.int64)
    prompt = rng.integers(200, 900, n)
    output = rng.integers(20, 300, n)
    groups = rng.integers(0, 2, n)
    chains = [[7000 * (groups[i] + 1) + j for j in range(min(int(rng.integers(0, 12)), prompt[i] // bs))]
              for i in range(n)]
    t1 = (rng.uniform(0.3, 3.0, n) * 1e9).astype(np.int64)
    t2 = (rng.uniform(0.0075, 0.02, n) * 1e9).astype(np.int64)
    return chained_trace(arrival, prompt, output, chains, t1, t2)


@pytest.mark.parametrize("num_blocks", [64, 160])
def test_bound_dominates_under_kv_pressure(num_blocks):
    """A small pool (preemptions, recompute, self-hits on resume) must not beat the bound, with the
    KV term, for every policy (oracles and shedding included); and the KV term does bind here: the
    bound with it is below the bound without it on some traces (never above)."""
    rng = np.random.default_rng(7)
    traces = [random_trace(rng, 30) for _ in range(6)] + [kv_bound_trace(rng, 40) for _ in range(6)]
    lower = 0
    for pc in (True, False):
        cfg = EngineConfig(prefix_caching=pc, num_blocks=num_blocks)
        ubs = [upper_bound(t, "stress-512", config=cfg) for t in traces]
        no_kv = [upper_bound(t, "stress-512", config=cfg, kv=False).ub for t in traces]
        assert all(b.ub <= x for b, x in zip(ubs, no_kv))
        lower += sum(b.ub < x for b, x in zip(ubs, no_kv))
        for name, margin in KV_POLICIES:
            pol = engine_policy(name, shed_margin=margin, t_ref_ms=300.0)
            res = simulate(traces, "stress-512", pol, cfg)
            for c in range(len(traces)):
                assert ubs[c].ub >= int(res.records(c)["met"].sum()), (name, margin, pc, c)
    assert lower >= 2, lower


# ------------------------------------------------------------------------------ tight cases
def test_single_request_is_tight():
    tr = tiny_trace([0.0], [100], [10], t1_ms=500, t2_ms=50)
    res = upper_bound(tr, "linear")
    assert res.ub == 1 and res.n_unattainable == 0 and res.ub_fraction == 1.0
    assert int(simulate(tr, "linear", "fcfs").records(0)["met"].sum()) == 1


def test_disjoint_roomy_windows_are_tight():
    n = 6
    tr = tiny_trace(np.arange(n) * 5000.0, [200] * n, [20] * n, t1_ms=1000, t2_ms=100)
    res = upper_bound(tr, "stress-512")
    assert res.ub == n
    assert int(simulate(tr, "stress-512", "fcfs").records(0)["met"].sum()) == n


def test_work_bound_exact_on_a_burst():
    """k identical jobs released together; exactly floor(L / w) fit."""
    r = np.zeros(7, np.int64)
    d = np.full(7, 100, np.int64)
    w = np.full(7, 30, np.int64)
    assert interval_bound(r, d, w)[0] == 3
    # two bursts far apart: counts add
    r2 = np.concatenate([r, r + 1000])
    assert interval_bound(r2, np.concatenate([d, d + 1000]), np.concatenate([w, w]))[0] == 6


def test_work_bound_binds_in_overload():
    """Many simultaneous long prefills with a tight TTFT on the linear profile: the D1
    relaxation bounds the met count by (T1 window) / (P u_p)."""
    n = 20
    tr = tiny_trace([0.0] * n, [2048] * n, [1] * n, t1_ms=1000, t2_ms=100)
    prof = load_profile("linear")
    res = upper_bound(tr, prof)
    up, _ = prof.cost.per_token_ms(prof.max_num_batched_tokens)
    assert res.ub == int(1000 // (2048 * up))  # 9 (each needs 107.4 ms of busy time)
    met = int(simulate(tr, "linear", "fcfs").records(0)["met"].sum())
    assert met <= res.ub


# ------------------------------------------------------------------------------ unattainable
def test_impossible_ttft_is_unattainable():
    prof = load_profile("linear")
    ttft_ms = 5.0 + 0.05 * 100           # one iteration of 100 tokens
    tr = tiny_trace([0.0, 0.0], [100, 100], [1, 1], t1_ms=ttft_ms, t2_ms=100)
    assert upper_bound(tr, prof).ub == 1  # both are attainable alone; the work bound fits one
    tr_bad = tiny_trace([0.0], [100], [1], t1_ms=ttft_ms - 1e-6, t2_ms=100)
    res = upper_bound(tr_bad, prof)
    assert res.ub == 0 and res.n_unattainable == 1 and res.n_ttft_impossible == 1
    assert int(res.ttft_min_ns[0]) == int(round(ttft_ms * 1e6))


def test_impossible_tpot_and_length_limits():
    prof = load_profile("linear")  # max_model_len = min(4096, 511*16) = 4096
    tr = tiny_trace([0.0], [100], [10], t1_ms=1000, t2_ms=5.0)  # a decode takes 5.05 ms
    res = upper_bound(tr, prof)
    assert res.ub == 0 and res.n_tpot_impossible == 1
    tr = tiny_trace([0.0, 0.0], [4096, 4000], [1, 200], t1_ms=10_000, t2_ms=100)
    res = upper_bound(tr, prof)
    assert res.n_rejected_or_capped == 2 and res.ub == 0


def test_cached_prefix_lowers_ttft_bound():
    chain = list(range(10))  # 160 cached tokens of a 170-token prompt
    tr = tiny_trace([0.0], [170], [1], t1_ms=1000, t2_ms=100, chains=[chain])
    prof = load_profile("linear")
    assert best_case_hits(tr, 16, True)[0] == 160
    assert best_case_hits(tr, 16, False)[0] == 0
    on = upper_bound(tr, prof, prefix_caching=True).ttft_min_ns[0]
    off = upper_bound(tr, prof, prefix_caching=False).ttft_min_ns[0]
    assert on == int((5.0 + 0.05 * 10) * 1e6) and off == int((5.0 + 0.05 * 170) * 1e6)
    # hit cap: a fully chained 160-token prompt can hit at most 9 blocks
    tr = tiny_trace([0.0], [160], [1], t1_ms=1000, t2_ms=100, chains=[chain])
    assert best_case_hits(tr, 16, True)[0] == 144


# ------------------------------------------------------------------------------ prefill minimum
def _brute_prefill_ps2(N, h, ps, B):
    c0, cp, cc2, cat = ps[:4]
    best = {h: 0}
    for s in range(h, N):  # DP over the start of the next chunk
        if s not in best:
            continue
        for k in range(1, min(B, N - s) + 1):
            v = best[s] + 2 * (c0 + cp * k + cc2 * k * k + cat * k * s)
            if v < best.get(s + k, 1 << 62):
                best[s + k] = v
    return best[N]


@pytest.mark.parametrize("coef", [(5.0, 0.05, 0.0, 0.0), (7.176, 0.0611, 7.0e-6, 1.9e-6),
                                  (0.05, 0.01, 0.004, 0.001), (0.02, 0.01, 0.0001, 0.003)])
def test_min_prefill_matches_brute_force(coef):
    cm = CostModel(c0=coef[0], c_prefill=coef[1], c_c2=coef[2], c_attn=coef[3])
    ps = [int(x) for x in cm.ps]
    for B in (4, 16, 64):
        for N in (1, 2, 5, 17, 40, 90):
            for h in sorted({0, (N - 1) // 2, N - 1}):
                got = int(min_prefill_ps2(np.array([N]), np.array([h]), np.array(ps), B)[0])
                exact = _brute_prefill_ps2(N, h, ps, B)
                min_over_h = min(_brute_prefill_ps2(N, hh, ps, B) for hh in range(0, h + 1))
                assert got <= min_over_h  # a lower bound for every pass from h' <= h
                if 2 * ps[2] >= ps[3]:
                    assert got == exact   # and exact when alpha >= 0


@settings(max_examples=400, deadline=None)
@given(N=st.integers(1, 20_000), frac=st.floats(0.0, 1.0), B=st.sampled_from([16, 512, 2048, 8192]),
       c0=st.sampled_from([0, 1, 7_176_038_041]), cp=st.integers(0, 10**8), cc2=st.integers(0, 10**4),
       cat=st.integers(0, 10**4), delta=st.integers(-3, 3), scale=st.sampled_from([1, 10, 1000, 10**6]))
def test_min_prefill_exceeds_is_the_exact_comparison(N, frac, B, c0, cp, cc2, cat, delta, scale):
    """The env's TTFT-lost test: the bounds shortcut gives exactly the exact value's comparison, for
    limits just around the exact value (where only the exact value decides) and far from it."""
    h = int(frac * (N - 1))
    exact = (int(min_prefill_ps2_one(N, h, c0, cp, cc2, cat, B)) + 1999) // 2000
    for limit in (exact + delta, exact + delta * scale, -1, 0):
        assert bool(min_prefill_exceeds(N, h, c0, cp, cc2, cat, B, limit)) == (exact > limit), limit


def test_idle_prefill_at_B_is_not_a_lower_bound_on_stress():
    """Documents why the bound does not use CostModel.idle_prefill_ns: smaller chunks are faster."""
    prof = load_profile("stress-512")
    at_b = int(prof.cost.idle_prefill_ns(np.array([2048]), 2048)[0])
    best = int(-(-min_prefill_ps2(np.array([2048]), np.array([0]), prof.cost.ps, 2048)[0] // 2000))
    assert best < at_b


def test_config_overrides_and_fraction():
    tr = tiny_trace([0.0, 1.0], [100, 100], [2, 2], t1_ms=1000, t2_ms=100)
    res = upper_bound(tr, "linear", config=EngineConfig(prefix_caching=False, max_num_batched_tokens=64))
    assert res.n_requests == 2 and 0.0 <= res.ub_fraction <= 1.0
    d = res.to_dict()
    assert "attainable" not in d and d["ub"] == res.ub


def test_kv_term_first_token_of_a_one_token_prompt():
    """The iteration that completes a prefill may be a 1-token chunk, priced as prefill (c0 + c_p +
    c_c2), cheaper than a decode: a request met at exactly that TTFT with a 2-block pool is not
    ruled out by the KV term (a review's counterexample)."""
    prof = load_profile("stress-512")
    c0, cp, cc2 = (int(x) for x in prof.cost.ps[:3])
    t1_ns = -(-(c0 + cp + cc2) // 1000)
    tr = Trace.build(arrival_ns=np.array([0]), prompt_tokens=np.array([1]), output_tokens=np.array([1]),
                     ttft_slo_ns=np.array([t1_ns]), tpot_slo_ns=np.array([10**8]))
    cfg = EngineConfig(num_blocks=2)
    met = int(simulate(tr, "stress-512", "fcfs", cfg).records(0)["met"].sum())
    assert met == 1
    assert upper_bound(tr, "stress-512", config=cfg).ub >= met


def test_kv_term_charges_each_emission_at_least_its_cheapest_iteration():
    """kv_i = e_i x sum_k u_i(k), e_i the cheaper of a decode at context N and a 1-token prefill chunk."""
    prof = load_profile("stress-512")
    tr = tiny_trace([0.0], [40], [5], t1_ms=1000, t2_ms=100, chains=[[1]])
    p = request_parts(tr, prof, True)
    c0, cp, cc2, _, cd, ckv = (int(x) for x in prof.cost.ps)
    e = min(-(-(c0 + cd + ckv * 40) // 1000), -(-(c0 + cp + cc2) // 1000))
    # blocks of 40..44 tokens at 16 per block, minus the one shared chain block: 2, 2, 2, 2, 2
    assert int(p.kv[0]) == e * sum(max(0, -(-(40 + k - 1) // 16) - 1) for k in range(1, 6))
