"""The tpot-guard budget rule (docs/design.md section 11): p_t against brute force, B_t by hand, the
rule's effect on a decoding request's TPOT, liveness at its most aggressive setting, jumped ==
stepped with the rule on, and its configuration errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.traces import Trace

MS = 1_000_000


@settings(max_examples=300, deadline=None)
@given(st.integers(-10, 10**13), st.integers(0, 10**8), st.integers(0, 10**4), st.integers(0, 9000))
def test_guard_chunk_is_the_largest_fitting_chunk(slack, b, c2, cap):
    p = int(K.guard_chunk(np.int64(slack), np.int64(b), np.int64(c2), np.int64(cap)))
    f = lambda q: b * q + c2 * q * q  # noqa: E731
    assert 0 <= p <= cap
    if slack <= 0:
        assert p == 0
        return
    assert f(p) <= slack
    assert p == cap or f(p + 1) > slack
    # brute force on small cases
    if cap <= 2000:
        best = max([q for q in range(cap + 1) if f(q) <= slack], default=0)
        assert p == best


def _trace(arrival_ms, prompt, output, t1_ms, t2_ms):
    n = len(prompt)
    return Trace.build(arrival_ns=(np.asarray(arrival_ms, float) * MS).astype(np.int64), prompt_tokens=prompt,
                       output_tokens=output, ttft_slo_ns=(np.broadcast_to(t1_ms, n) * MS).astype(np.int64),
                       tpot_slo_ns=(np.broadcast_to(t2_ms, n) * MS).astype(np.int64))


def test_budget_by_hand_on_the_linear_profile():
    """``linear``: an iteration takes 5 ms + 0.05 ms per scheduled token (decode or prefill). One
    request decodes with TPOT SLO 8 ms; a 2,000-token prompt arrives. tau_dec = 5.05 ms; the credit
    T2 (g + 1) - e: the prefill chunk gets the time left at 0.05 ms a token (at least a block), so the
    decoding request keeps its TPOT; without the rule one 2,000-token chunk costs it 100 ms."""
    tr = _trace([0, 30], [16, 2000], [20, 2], 10_000.0, [8.0, 10_000.0])
    on = simulate(tr, "linear", "fcfs", EngineConfig(record_iterations=10_000, budget_rule="tpot-guard"))
    off = simulate(tr, "linear", "fcfs", EngineConfig(record_iterations=10_000))
    assert off.records(0)["tpot_ns"][0] > 8 * MS and on.records(0)["tpot_ns"][0] <= 8 * MS
    its, rec = on.iterations(0), on.records(0)
    t_first, t_fin = rec["first_token_ns"][0], rec["finish_ns"][0]
    left = 2000
    checked = 0
    for k in range(len(its["start_ns"])):
        start, pre = its["start_ns"][k], its["prefill_tokens"][k]
        if start < 30 * MS:
            continue
        if start < t_fin and pre > 0:   # request 0 decodes beside request 1's prefill: B_t by hand
            g = int(((its["end_ns"] > t_first) & (its["end_ns"] <= start)).sum()) + 1   # tokens out so far
            credit_ps = (8 * MS * g - (start - t_first)) * 1000
            tau_dec = 5 * 10**9 + 50_000_000   # c0 + c_decode x 1 (linear has no c_kv)
            p = int(K.guard_chunk(np.int64(credit_ps - tau_dec), np.int64(50_000_000), np.int64(0), np.int64(2048)))
            assert pre == min(max(p, 16), 2047, left), k
            checked += 1
        left -= pre
    assert checked >= 3


@st.composite
def tight_traces(draw):
    n = draw(st.integers(1, 14))
    gaps = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 600), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    t2 = draw(st.lists(st.sampled_from([0.5, 3.0, 6.0, 20.0, 100.0]), min_size=n, max_size=n))
    return _trace(np.cumsum(gaps), prompt, output, 10_000.0, t2)


guard_cfgs = st.fixed_dictionaries({
    "budget_u": st.sampled_from([-0.5, 0.0, 1.0, 2.0]),
    "budget_bmin": st.sampled_from([0.0, 0.3, 1.0]),
    "max_num_batched_tokens": st.sampled_from([64, 512]),
    "long_prefill_token_threshold": st.sampled_from([None, 40]),
    "async_scheduling": st.booleans(),
    "num_blocks": st.integers(30, 120),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_traces(), guard_cfgs, st.sampled_from(["fcfs", "priority"]))
def test_liveness_and_jumped_equals_stepped(tr, cfg, policy):
    """Every request ends at every setting of the rule, its most aggressive one included (u = -0.5,
    B_min = 0, TPOT SLOs below the decodes' own time); runs with and without jumps are identical."""
    runs = [simulate(tr, "linear", policy, EngineConfig(budget_rule="tpot-guard", jumps=j, max_iterations=200_000,
                                                        record_iterations=200_000, **cfg)) for j in (True, False)]
    for r in runs:
        assert r.arrays.n_ended[0] == len(tr)
        assert (r.records(0)["end_state"] != K.E_UNFINISHED).all()
    a, b = runs
    for k in a.records(0):
        np.testing.assert_array_equal(a.records(0)[k], b.records(0)[k], err_msg=k)
    for k in ("start_ns", "end_ns", "prefill_tokens", "decodes"):
        np.testing.assert_array_equal(a.iterations(0)[k], b.iterations(0)[k], err_msg=k)


def test_rule_off_is_the_profile_budget_and_bmin_one_is_off():
    """B_min = 1 never lowers the budget: the same run as without the rule."""
    tr = _trace([0, 0, 5, 9], [300, 900, 40, 1200], [30, 20, 50, 10], 10_000.0, [6.0, 6.0, 6.0, 6.0])
    off = simulate(tr, "linear", "fcfs", EngineConfig())
    one = simulate(tr, "linear", "fcfs", EngineConfig(budget_rule="tpot-guard", budget_bmin=1.0))
    on = simulate(tr, "linear", "fcfs", EngineConfig(budget_rule="tpot-guard"))
    np.testing.assert_array_equal(off.records(0)["finish_ns"], one.records(0)["finish_ns"])
    assert not np.array_equal(off.records(0)["finish_ns"], on.records(0)["finish_ns"])


def test_config_errors_and_evidence():
    with pytest.raises(ConfigError, match="budget_rule: unknown 'fast'"):
        EngineConfig(budget_rule="fast")
    with pytest.raises(ConfigError, match=r"budget_u must be a number in \[-0.5, 2\]"):
        EngineConfig(budget_rule="tpot-guard", budget_u=3.0)
    with pytest.raises(ConfigError, match="budget_bmin: a parameter of budget_rule tpot-guard"):
        EngineConfig(budget_bmin=0.5)
    assert "budget_rule" not in EngineConfig().to_dict()       # earlier evidence ids unchanged
    assert EngineConfig(budget_rule="tpot-guard").to_dict()["budget_rule"] == "tpot-guard"


def test_bench_adds_a_tpot_guard_row_beside_every_row(tmp_path):
    """``bench --budget-rule tpot-guard``: ``<policy>[+shed]+tpot-guard`` rows beside the policy
    rows, each with its paired difference against the row without the rule in ``vs``; the row is
    the policy simulated with the rule; the rule enters the evidence id; bad values are one line."""
    from tokenbatch_env import cli
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark

    base = dict(policies=("fcfs", "sjf"), shed=True, loads=(1.2,), max_traces=2, bootstrap_b=200, upper_bound=False)
    rep = run_benchmark(BenchConfig(**base, tpot_guard=(0.5, 0.1))).data
    plain = run_benchmark(BenchConfig(**base)).data
    rows = {d["label"]: d for d in rep["loads"][0]["rows"]}
    assert {"fcfs+tpot-guard", "sjf+shed+tpot-guard", "edf+shed+tpot-guard", "index+shed+tpot-guard"} <= set(rows)
    g = rows["sjf+shed+tpot-guard"]
    assert g["tpot_guard"] == {"u": 0.5, "bmin": 0.1} and "sjf+shed" in g["vs"]
    assert {"sjf+shed+tpot-guard", "edf+shed+tpot-guard"} <= set(rows["index+shed+tpot-guard"]["vs"])
    prow = {d["label"]: d for d in plain["loads"][0]["rows"]}
    assert rows["sjf+shed"]["goodput_per_unit"] == prow["sjf+shed"]["goodput_per_unit"]
    assert rep["evidence_id"] != plain["evidence_id"]
    for argv, msg in [(["--budget-u", "0.5"], "--budget-u: requires --budget-rule tpot-guard"),
                      (["--budget-rule", "tpot-guard", "--budget-bmin", "2"], "--budget-bmin: must be a number in"),
                      (["--budget-rule", "tpot-guard", "--budget-u", "x"], "--budget-u: must be a number")]:
        import contextlib
        import io
        e = io.StringIO()
        with contextlib.redirect_stderr(e):
            try:
                rc = cli.main(["bench", "--out", str(tmp_path / "o"), *argv])
            except SystemExit as ex:
                rc = ex.code
        assert rc == 2 and msg in e.getvalue() and e.getvalue().count("\n") == 1, e.getvalue()


def test_simulate_takes_the_rule(tmp_path):
    """``tokenbatch simulate --budget-rule tpot-guard``: the rule runs (the TPOT of the decoding
    request of the by-hand case is kept)."""
    import subprocess
    import sys
    from tokenbatch_env.traces.io import save_npz
    tr = _trace([0, 30], [16, 2000], [20, 2], 10_000.0, [8.0, 10_000.0])
    save_npz(tr, tmp_path / "t.npz")
    out = {}
    for rule in ("none", "tpot-guard"):
        rec = tmp_path / f"{rule}.csv"
        r = subprocess.run([sys.executable, "-m", "tokenbatch_env.cli", "simulate", "--trace", str(tmp_path / "t.npz"),
                            "--profile", "linear", "--budget-rule", rule, "--records", str(rec)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        import csv
        out[rule] = [float(row["tpot_ns"]) for row in csv.DictReader(rec.open())][0]
    assert out["none"] > 8 * MS >= out["tpot-guard"]


def test_report_prints_the_rule_table():
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark
    rep = run_benchmark(BenchConfig(policies=("fcfs",), loads=(1.2,), max_traces=2, bootstrap_b=200,
                                    upper_bound=False, tpot_guard=(0.0, 0.0)))
    assert "tpot-guard at rho 1.2" in rep.summary_text() and "fcfs+tpot-guard" in rep.summary_text()
    assert "## The tpot-guard budget rule at rho 1.2" in rep.to_markdown()


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_bmin_one_equals_no_rule_on_a_real_workload(policy):
    """With B_min = 1 the rule never lowers the budget, but it still runs every step (the guarded set,
    the waiting head and its cache hits): the run equals one without the rule, request by request, on
    seed-200 traces with shared prefixes at rho 1.5 (stress-512 prices attention, so the head is read)."""
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.policies import engine_policy
    from tokenbatch_env.traces.suites import load_suite
    from tokenbatch_env.traces.windows import scale_to_rate
    assert load_profile("stress-512").cost.ps[3] > 0
    trs = [scale_to_rate(t, 3.8) for t in load_suite("seed-200").traces("test")[:3]]
    assert sum(t.prefix_hashes.size for t in trs) > 0
    pol = policy if policy != "sjf" else engine_policy("sjf", shed_margin=0.3, t_ref_ms=250.0)
    off = simulate(trs, "stress-512", pol, EngineConfig())
    one = simulate(trs, "stress-512", pol, EngineConfig(budget_rule="tpot-guard", budget_bmin=1.0, budget_u=2.0))
    for c in range(3):
        for k in ("end_state", "first_token_ns", "finish_ns", "preemptions"):
            np.testing.assert_array_equal(off.records(c)[k], one.records(c)[k], err_msg=f"{policy} {c} {k}")
