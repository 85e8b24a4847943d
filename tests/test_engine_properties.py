"""Engine invariants over random traces and configurations (hypothesis)."""

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.traces import Trace


@st.composite
def traces(draw, max_n=25):
    n = draw(st.integers(0, max_n))
    gaps = draw(st.lists(st.integers(0, 40_000_000), min_size=n, max_size=n))
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
    work = int(it["prefill_tokens"].sum() + it["decodes"].sum())
    need = int((rec["prompt_tokens"][done] + rec["output_tokens"][done] - 1).sum())
    if cfg["prefix_caching"]:
        assert work <= need + rec["recomputed_tokens"].sum()
    else:
        assert work == need + rec["recomputed_tokens"].sum()
    # goodput in [0, 1]
    assert 0.0 <= rec["met"].mean() <= 1.0 if n else True


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
