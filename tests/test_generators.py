"""Generators, SLA assignment, time scaling and windows (tokenbatch_env.traces.{generators,sla,windows})."""

from __future__ import annotations

import copy
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.errors import ConfigError, TraceError
from tokenbatch_env.traces import Trace, block_hash
from tokenbatch_env.traces.generators import (
    ARRIVAL_RESOLUTION_NS, NS_PREFIX_GROUP, ArrivalSpec, PrefixSpec, TraceSpec, gamma_arrivals,
    generate_trace, lognormal_lengths, mmpp_arrivals, poisson_arrivals, prefix_chains,
    resample_pairs, resample_trace, rng_stream)
from tokenbatch_env.traces.sla import DEFAULT_SLA, SlaClass, SlaSpec, assign_slas, slo_arrays, ttft_idle_ns
from tokenbatch_env.traces.windows import (
    Window, cut_windows, empirical_rate_rps, scale_ints, scale_to_rate, time_scale, window_at)

BASE = {
    "name": "t", "num_requests": 400, "block_size": 16,
    "arrivals": {"process": "gamma", "rate_rps": 1.0, "cv": 2.0},
    "lengths": {"dist": "lognormal", "prompt": {"mu": 6.6, "sigma": 1.0},
                "output": {"mu": 5.0, "sigma": 0.9}, "max_model_len": 4096},
    "prefix": {"share_fraction": 0.5, "num_groups": 16, "zipf": 1.0,
               "ratio": {"dist": "uniform", "low": 0.2, "high": 0.8}},
    "sla": DEFAULT_SLA.to_dict(),
}
MMPP = {"process": "mmpp", "rate_rps": 2.0,
        "states": [{"rate_mult": 10, "mean_dwell_s": 2.0}, {"rate_mult": 0.5, "mean_dwell_s": 6.0}]}


def spec(**changes) -> dict:
    d = copy.deepcopy(BASE)
    for path, v in changes.items():
        node = d
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        if v is ...:
            del node[keys[-1]]
        else:
            node[keys[-1]] = v
    return d


# ---------------------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("arrivals", [{"process": "poisson", "rate_rps": 3.0},
                                      {"process": "gamma", "rate_rps": 1.0, "cv": 2.0}, MMPP])
def test_same_spec_and_seed_same_digest_other_seed_other_digest(arrivals):
    s = spec(arrivals=arrivals)
    a, b = generate_trace(s, 7), generate_trace(TraceSpec.from_dict(s), 7)
    assert a.digest == b.digest
    assert generate_trace(s, 8).digest != a.digest
    assert TraceSpec.from_dict(TraceSpec.from_dict(s).to_dict()) == TraceSpec.from_dict(s)


def test_components_use_independent_streams():
    a = generate_trace(spec(), 3)
    b = generate_trace(spec(arrivals={"process": "poisson", "rate_rps": 5.0}), 3)
    assert not np.array_equal(a.arrival_ns, b.arrival_ns)
    for col in ("prompt_tokens", "output_tokens", "class_id", "ttft_slo_ns", "prefix_hashes"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col


def test_known_digests_are_stable():
    """Pins the generator's output on every machine: if this changes, bump GENERATOR_VERSION and
    rewrite the suite manifests (see tokenbatch_env/traces/suites.py)."""
    t = generate_trace(spec(num_requests=50), 123)
    assert t.arrival_ns[0] == 0 and len(t) == 50
    assert t.digest == "71547e9242a25c38eab2e5810931d43ded78cd81963fdba71f0f8ea3082d2e88"
    m = generate_trace(spec(num_requests=50, arrivals=MMPP), 123)
    assert m.digest == "a15aa3990c7667d9b4ae3ecb906bb439e12e308b6686399ffb31899c89da3b92"
    assert t.source.startswith("tokenbatch generator v")


def test_seed_must_be_non_negative_int():
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ConfigError, match="seed"):
            generate_trace(spec(), bad)


# ---------------------------------------------------------------------------------------- arrivals
def _gaps(a):
    return np.diff(a).astype(float) / 1e9


def test_poisson_rate_and_cv():
    a = poisson_arrivals(rng_stream(1, 1), 20_000, 4.0)
    g = _gaps(a)
    assert a[0] == 0 and a.dtype == np.int64 and (g >= 0).all()
    assert (a % ARRIVAL_RESOLUTION_NS == 0).all()
    assert 1 / g.mean() == pytest.approx(4.0, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.04)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_rate_and_cv(cv):
    g = _gaps(gamma_arrivals(rng_stream(2, 1), 40_000, 2.0, cv))
    assert 1 / g.mean() == pytest.approx(2.0, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.08)


def test_mmpp_long_run_rate_and_burstiness():
    sp = ArrivalSpec.from_dict(MMPP)
    rates, jump, pi = sp.mmpp_matrices()
    assert float(pi @ rates) == pytest.approx(2.0)
    a = mmpp_arrivals(rng_stream(3, 1), 40_000, sp)
    g = _gaps(a)
    assert (g >= 0).all() and a[0] == 0
    assert 1 / g.mean() == pytest.approx(2.0, rel=0.1)
    assert g.std() / g.mean() > 1.3  # over-dispersed compared with Poisson
    sp3 = ArrivalSpec.from_dict({"process": "mmpp", "rate_rps": 1.0, "states": [
        {"rate_mult": 1, "mean_dwell_s": 1}, {"rate_mult": 4, "mean_dwell_s": 2},
        {"rate_mult": 0, "mean_dwell_s": 3}], "transitions": [[0, 0.5, 0.5], [1, 0, 0], [0.25, 0.75, 0]]})
    g3 = _gaps(mmpp_arrivals(rng_stream(4, 1), 30_000, sp3))
    assert 1 / g3.mean() == pytest.approx(1.0, rel=0.1)


# ---------------------------------------------------------------------------------------- lengths
def test_lognormal_moments_and_correlation():
    p, o = lognormal_lengths(rng_stream(5, 2), 50_000, prompt_mu=6.6, prompt_sigma=1.0, output_mu=5.0,
                             output_sigma=0.9, corr=0.5)
    assert p.dtype == np.int64 and p.min() >= 1 and o.min() >= 1
    lp, lo = np.log(p), np.log(o)
    assert lp.mean() == pytest.approx(6.6, abs=0.02) and lp.std() == pytest.approx(1.0, abs=0.02)
    assert lo.mean() == pytest.approx(5.0, abs=0.02) and lo.std() == pytest.approx(0.9, abs=0.02)
    assert np.corrcoef(lp, lo)[0, 1] == pytest.approx(0.5, abs=0.02)


def test_truncation_resample_respects_max_model_len_without_atoms():
    L = load_profile("stress-512").max_model_len
    assert L == 4096
    p, o = lognormal_lengths(rng_stream(6, 2), 50_000, prompt_mu=6.6, prompt_sigma=1.0, output_mu=5.0,
                             output_sigma=0.9, max_model_len=L, truncation="resample")
    assert (p + o <= L).all() and (p < L).all()
    assert (p == L - 1).mean() < 0.001  # a conditioned distribution, not clipped onto the limit
    t = generate_trace(spec(), 0)
    assert (t.prompt_tokens + t.output_tokens <= L).all()


def test_truncation_clip():
    p, o = lognormal_lengths(rng_stream(6, 2), 20_000, prompt_mu=8.0, prompt_sigma=1.0, output_mu=5.0,
                             output_sigma=0.9, max_model_len=1000, truncation="clip")
    assert (p + o <= 1000).all() and (p <= 999).all() and o.min() >= 1
    assert (p == 999).mean() > 0.5


def test_truncation_with_hopeless_acceptance_is_a_config_error():
    with pytest.raises(ConfigError, match="max_model_len"):
        generate_trace(spec(lengths__prompt={"mu": 12.0, "sigma": 0.1}), 0)


def test_resample_pairs_draws_only_fitting_real_pairs():
    prompts = np.array([10, 3000, 50, 5000])
    outputs = np.array([5, 2000, 7, 1])
    p, o = resample_pairs(rng_stream(7, 2), 5000, prompts, outputs, max_model_len=4096)
    pairs = set(zip(p.tolist(), o.tolist()))
    assert pairs == {(10, 5), (50, 7)}
    p, o = resample_pairs(rng_stream(7, 2), 5000, prompts, outputs, max_model_len=4096, truncation="clip")
    assert (p + o <= 4096).all() and (p == 4095).any()
    with pytest.raises(ConfigError):
        resample_pairs(rng_stream(7, 2), 5, [5000], [10], max_model_len=4096)


def test_resample_trace_and_pairs_spec_from_a_file(tmp_path):
    from tokenbatch_env.traces.io import save_npz

    rng = np.random.default_rng(0)
    real = Trace.build(arrival_ns=np.arange(300) * 10**8, prompt_tokens=rng.integers(1, 3000, 300),
                       output_tokens=rng.integers(1, 900, 300))
    path = tmp_path / "real.npz"
    save_npz(real, path)
    s = spec(lengths={"dist": "pairs", "path": str(path), "max_model_len": 4096})
    a = generate_trace(s, 4)
    b = resample_trace(real, s, 4)
    assert a.digest == b.digest
    real_pairs = set(zip(real.prompt_tokens.tolist(), real.output_tokens.tolist()))
    assert set(zip(a.prompt_tokens.tolist(), a.output_tokens.tolist())) <= real_pairs
    assert len(a) == 400 and np.array_equal(a.arrival_ns, generate_trace(spec(), 4).arrival_ns)


# ---------------------------------------------------------------------------------------- prefixes
def test_prefix_chains_follow_the_group_rule():
    ps = PrefixSpec.from_dict({"share_fraction": 0.6, "num_groups": 5, "zipf": 0.5,
                               "ratio": {"dist": "beta", "a": 2, "b": 2}})
    prompt = rng_stream(8, 2).integers(1, 3000, 4000)
    offsets, hashes, group, k = prefix_chains(ps, prompt, 16, rng_stream(8, 3))
    lens = np.diff(offsets)
    assert (lens == np.where(group > 0, k // 16, 0)).all()
    assert (group > 0).mean() == pytest.approx(0.6, abs=0.03)
    assert set(np.unique(group[group > 0])) <= set(range(1, 6))
    for i in np.flatnonzero(lens)[:200]:
        want = block_hash(NS_PREFIX_GROUP, np.full(lens[i], group[i]), np.arange(lens[i]))
        assert np.array_equal(hashes[offsets[i]:offsets[i + 1]], want)
    assert NS_PREFIX_GROUP == 1


def test_common_prefix_is_shared_by_every_request():
    t = generate_trace(spec(prefix={"share_fraction": 0.3, "num_groups": 4, "ratio": 0.9,
                                    "common_prefix_tokens": 512}), 1)
    common = block_hash(NS_PREFIX_GROUP, np.zeros(32, np.int64), np.arange(32))
    for i in range(len(t)):
        c = t.prefix_chain(i)
        m = min(32, int(t.prompt_tokens[i]) // 16)
        assert np.array_equal(c[:m], common[:m])
        assert len(c) <= t.prompt_tokens[i] // 16


def test_no_prefix_section_gives_empty_chains():
    t = generate_trace(spec(prefix=None), 0)
    assert t.prefix_hashes.size == 0 and (t.prefix_offsets == 0).all()


# ---------------------------------------------------------------------------------------- SLA
def test_sla_rule_is_exact():
    prof = load_profile("stress-512")
    t = generate_trace(spec(), 11)
    idle = prof.cost.idle_prefill_ns(t.prompt_tokens, prof.max_num_batched_tokens)
    assert np.array_equal(idle, ttft_idle_ns(t.prompt_tokens, "stress-512"))
    scale = np.array([2, 5, 10])[t.class_id]
    assert np.array_equal(t.ttft_slo_ns, idle * scale)
    assert np.array_equal(t.tpot_slo_ns, np.array([50, 100, 200])[t.class_id] * 10**6)
    assert np.array_equal(t.priority, t.class_id)
    frac = np.bincount(t.class_id, minlength=3) / len(t)
    assert np.allclose(frac, 1 / 3, atol=0.08)


def test_sla_fractional_scale_rounds_half_up_exactly():
    sla = SlaSpec.from_dict({"classes": [{"weight": 1, "ttft_scale": 2.5, "tpot_ms": 0.1}]})
    t1, t2, prio = slo_arrays([1, 2048, 4000], [0, 0, 0], sla)
    idle = ttft_idle_ns([1, 2048, 4000], "stress-512")
    assert list(t1) == [(5 * int(x) + 1) // 2 for x in idle]
    assert list(t2) == [100_000] * 3 and list(prio) == [0] * 3


def test_assign_slas_to_a_trace_without_slos():
    t = generate_trace(spec(sla=None), 2)
    assert not t.has_slos
    a, b = assign_slas(t, seed=5), assign_slas(t, DEFAULT_SLA.to_dict(), seed=5)
    assert a.has_slos and a.digest == b.digest
    assert assign_slas(t, seed=6).digest != a.digest
    with pytest.raises(ConfigError, match="already has SLOs"):
        assign_slas(a)
    assert assign_slas(a, seed=6, overwrite=True).digest == assign_slas(t, seed=6).digest


def test_sla_rule_names_a_prompt_whose_slo_would_exceed_a_day():
    """A prompt no engine serves in a day (real Azure rows have 5M tokens) gets an error naming it,
    not a range error on the derived ttft_slo_ns column."""
    t = Trace.build(arrival_ns=np.arange(3, dtype=np.int64), prompt_tokens=[100, 5_000_000, 200],
                    output_tokens=[5, 5, 5], name="big")
    slow = SlaSpec("stress-512", (SlaClass("slow", 1.0, 10.0, 100.0),))   # 10 x 24,085 s
    with pytest.raises(TraceError, match=r"trace 'big': request 1 \(0-based\) has a 5,000,000-token prompt.*'slow'"):
        assign_slas(t, slow)
    assert assign_slas(t.subset([0, 2]), slow).has_slos


def test_generated_trace_whose_slo_would_exceed_a_day_is_named():
    huge = spec(lengths__prompt={"mu": 15.0, "sigma": 0.01}, lengths__max_model_len=10_000_000, num_requests=3,
                prefix=..., sla={"profile": "stress-512",
                                 "classes": [{"name": "slow", "weight": 1.0, "ttft_scale": 100.0, "tpot_ms": 100.0}]})
    with pytest.raises(TraceError, match=r"^trace 't-s3': request 0 \(0-based\) has a 3,275,779-token prompt"):
        generate_trace(huge, 3)
    with pytest.raises(TraceError, match=r"^trace 'mine': request 0"):
        generate_trace(huge, 3, name="mine")


# ---------------------------------------------------------------------------------------- scaling
def test_time_scale_exact_and_commutes_with_subset():
    t = generate_trace(spec(), 9)
    twice = time_scale(t, 2)
    assert np.array_equal(twice.arrival_ns, t.arrival_ns * 2)
    third = time_scale(t, Fraction(1, 3))
    assert np.array_equal(third.arrival_ns, (2 * t.arrival_ns + 3) // 6)
    idx = np.arange(50, 120)
    assert time_scale(t.subset(idx), 0.37).digest == time_scale(t, 0.37).subset(idx).digest
    assert np.array_equal(time_scale(t, 1).arrival_ns, t.arrival_ns)
    assert np.array_equal(scale_ints([1, 2, 3], "0.5"), [1, 1, 2])  # half up


def test_time_scale_about_the_first_arrival():
    t = Trace.build(arrival_ns=[10**12, 10**12 + 3, 10**12 + 8], prompt_tokens=[1, 1, 1],
                    output_tokens=[1, 1, 1])
    s = time_scale(t, 0.5, origin=None)
    assert list(s.arrival_ns) == [10**12, 10**12 + 2, 10**12 + 4]


def test_scale_to_rate():
    t = generate_trace(spec(), 4)
    r = empirical_rate_rps(t)
    assert empirical_rate_rps(scale_to_rate(t, 3.0)) == pytest.approx(3.0, rel=1e-6)
    s = scale_to_rate(t, 2.5, nominal_rps=1.0)  # suites: factor = nominal / target for every trace
    assert np.array_equal(s.arrival_ns, scale_ints(t.arrival_ns, Fraction(1) / Fraction(2.5)))
    assert empirical_rate_rps(s) == pytest.approx(2.5 * r, rel=1e-4)


def _scale_ints_exact(values, factor):
    """The definition: floor(v * f + 1/2) with Python integers."""
    f = Fraction(factor)
    return [(2 * v * f.numerator + f.denominator) // (2 * f.denominator) for v in values]


@settings(max_examples=300, deadline=None)
@given(vals=st.lists(st.integers(0, 2**45), min_size=1, max_size=40),
       factor=st.one_of(st.floats(1e-6, 1e6), st.fractions(Fraction(1, 10**9), Fraction(10**9)).filter(bool)))
def test_scale_ints_equals_the_integer_definition(vals, factor):
    """The vectorised path (float estimate + exact residual modulo 2**64) is exact, ties included."""
    want = _scale_ints_exact(vals, factor)
    if max(want) >= 2**63:
        return
    got = scale_ints(np.array(vals, np.int64), factor)
    assert got.dtype == np.int64 and got.tolist() == want


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 2**45), st.floats(1e-3, 1e3)), min_size=1, max_size=8),
       width=st.integers(0, 30), big=st.booleans())
def test_scale_rows_is_scale_ints_per_row(rows, width, big):
    """``scale_rows`` (one factor per row, the wrapped method vectorised over rows) is ``scale_ints``
    row by row, also for rows beyond the wrapped method's bounds (Python integers)."""
    from tokenbatch_env.traces.windows import scale_rows
    v = np.array([[base + 7 * j for j in range(width)] for base, _ in rows], np.int64).reshape(len(rows), width)
    fs = [Fraction(f) for _, f in rows]
    if big and width:
        v[0] = 2**52 + np.arange(width)
        fs[0] = Fraction(1, 3)
    got = scale_rows(v, fs)
    assert got.shape == v.shape and got.dtype == np.int64
    for i in range(len(rows)):
        assert got[i].tolist() == scale_ints(v[i], fs[i]).tolist()


def test_scale_ints_half_up_ties_and_large_denominators():
    v = np.arange(0, 20_000, dtype=np.int64)
    for f in [Fraction(1, 2), Fraction(3, 2), Fraction(5, 6), Fraction(7, 10), Fraction(1) / Fraction(2.52679 * 1.1),
              Fraction(0.1), Fraction(2**60 - 1, 2**60), Fraction(10**30 + 1, 10**30)]:
        assert scale_ints(v, f).tolist() == _scale_ints_exact(v.tolist(), f), f
    big = np.array([2**50, 2**55, 2**61], np.int64)   # beyond the float bound: Python integers
    assert scale_ints(big, Fraction(1, 3)).tolist() == _scale_ints_exact(big.tolist(), Fraction(1, 3))
    with pytest.raises(ConfigError, match="beyond int64"):
        scale_ints(np.array([2**62]), 4)


def test_workload_window_equals_window_of_the_scaled_unit():
    """``Workload.window_at`` (cut, then scale the window) is ``window_at(unit_at(...))``, digests and
    cached prefix ids included."""
    from tokenbatch_env.evaluate import Workload
    t = generate_trace(spec(), 6)
    wl = Workload("x", "suite", [t, t.subset(slice(0, 300))], [None, None], None, None, 1.7, 2.3, "",
                  np.ones(1), 1.0, None, [], [])
    for i, rho, start in [(0, 0.8, 40), (0, 1.37, 10), (1, 2.9, 250), (1, 0.31, 0)]:
        a = wl.window_at(i, rho, start, 64, 16, 16)
        b = window_at(wl.unit_at(i, rho), start, 64, 16, 16)
        assert a.trace.digest == b.trace.digest and a.trace.name == b.trace.name
        assert (a.scored_start, a.scored_stop, a.parent_start) == (b.scored_start, b.scored_stop, b.parent_start)
        n, ids = a.trace.prefix_ids()
        assert (n, ids.tolist()) == _first_appearance(b.trace.prefix_hashes)


def test_workload_scale_factor_and_range_are_their_definitions():
    """``Workload.scale_factor`` is scale_to_rate's factor ``nominal / as_fraction(rho * lambda_sat)``
    exactly (normalised), for floats and other numbers; ``scaled_in_range`` says whether the unit's last
    arrival, scaled, stays within MAX_ARRIVAL_NS (``unit_at`` raises exactly when it does not)."""
    from tokenbatch_env.evaluate import Workload
    from tokenbatch_env.traces.trace import MAX_ARRIVAL_NS
    from tokenbatch_env.traces.windows import as_fraction
    t = generate_trace(spec(), 6)
    wl = Workload("x", "suite", [t, t.subset(slice(0, 300))], [None, None], None, None, 1.7, 2.3, "",
                  np.ones(1), 1.0, None, [], [])
    rng = np.random.default_rng(3)
    for rho in [*rng.uniform(0.01, 50, 200), 1, Fraction(7, 3), np.float64(1.25), 1e-300]:
        f = wl.scale_factor(rho)
        ref = as_fraction(1.7, "nominal_rps") / as_fraction(rho * 2.3, "rate_rps")   # (nominal 1.7, lambda_sat 2.3)
        assert type(f) is Fraction and (f.numerator, f.denominator) == (ref.numerator, ref.denominator)
    last = int(t.arrival_ns[-1])
    edge = Fraction(MAX_ARRIVAL_NS, last)   # last * edge == MAX_ARRIVAL_NS exactly
    for f, ok in [(Fraction(1), True), (edge, True), (edge + Fraction(1, 10 * last), True),
                  (edge + Fraction(1, last), False), (edge * 2, False), (float(edge) * 0.999, True)]:
        assert wl.scaled_in_range(0, f) is ok, f
    with pytest.raises(TraceError, match="out of range"):   # (far enough out that the float rho keeps it out)
        wl.unit_at(0, float(as_fraction(1.7) / (edge * 2) / Fraction(2.3)))
    assert wl.unit_at(0, float(as_fraction(1.7) / (edge / 2) / Fraction(2.3))) is not None


def _first_appearance(values) -> tuple:
    """The engine's dense prefix ids, by their definition: numbered in order of first appearance."""
    seen: dict = {}
    ids = [seen.setdefault(int(v), len(seen)) for v in values]
    return len(seen), ids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40), st.data())
def test_prefix_ids_by_first_appearance(values, data):
    """Dense prefix ids number the hashes in order of first appearance (so a chain's ids are
    neighbours in the engine's hash map), and a subset derives its own from its parent's exactly."""
    from tokenbatch_env.traces.trace import first_appearance_ids, subset_prefix_ids
    h = np.array(values, np.int64) * 7919 - 3   # any hash values, not in their order of appearance
    n, ids = first_appearance_ids(h)
    assert (n, ids.tolist()) == _first_appearance(h)
    a = data.draw(st.integers(0, len(values)))
    b = data.draw(st.integers(a, len(values)))
    m, sub = subset_prefix_ids(n, ids, a, b)
    assert (m, sub.tolist()) == _first_appearance(h[a:b])


def test_subset_rows_share_validation_and_prefix_ids():
    t = generate_trace(spec(), 3)
    t.prefix_ids()
    for sl in [slice(10, 200), slice(None, 5), slice(390, None), slice(7, 7), slice(-50, -10), slice(0, 400, 3)]:
        a = t.subset(sl)
        b = Trace.build(**{f: (getattr(t, f)[sl] if f in ("arrival_ns", "prompt_tokens", "output_tokens",
                                                           "ttft_slo_ns", "tpot_slo_ns", "priority", "class_id")
                               else getattr(t, f)) for f in ("arrival_ns", "prompt_tokens", "output_tokens",
                                                             "ttft_slo_ns", "tpot_slo_ns", "priority", "class_id",
                                                             "block_size", "name", "source")},
                        prefix_offsets=np.concatenate([[0], np.cumsum(t.prefix_lengths[sl])]),
                        prefix_hashes=np.concatenate([t.prefix_chain(i) for i in np.arange(len(t))[sl]] or [[]]))
        assert a.digest == b.digest and not a.arrival_ns.flags.writeable
        n, ids = a.prefix_ids()
        assert (n, ids.tolist()) == _first_appearance(a.prefix_hashes)
    with pytest.raises(Exception, match="decrease"):   # time scaling still validates its result
        t.subset(slice(0, 5))._with_arrivals(np.array([5, 4, 3, 2, 1]))


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "x", True])
def test_bad_scale_factor(bad):
    t = generate_trace(spec(num_requests=5), 0)
    with pytest.raises(ConfigError):
        time_scale(t, bad)


# ---------------------------------------------------------------------------------------- windows
def _covered(ws: list[Window]) -> list[int]:
    return [j for w in ws for j in w.parent_scored]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 120), size=st.integers(1, 50), warm=st.integers(0, 20), cool=st.integers(0, 20),
       edges=st.sampled_from(["full", "clip"]))
def test_windows_cover_each_scored_request_exactly_once(n, size, warm, cool, edges):
    t = generate_trace(spec(num_requests=120), 1).subset(slice(0, n))
    ws = cut_windows(t, size, warm, cool, edges=edges)
    lo, hi = (warm, n - cool) if edges == "full" else (0, n)
    assert _covered(ws) == list(range(lo, max(lo, hi)))
    for w in ws:
        assert 1 <= w.num_scored <= size
        rows = np.arange(w.parent_start, w.parent_start + len(w.trace))
        assert np.array_equal(w.trace.arrival_ns, t.arrival_ns[rows])
        assert np.array_equal(w.trace.prefix_hashes, t.subset(rows).prefix_hashes)
        assert w.warmup == min(warm, w.parent_start + w.scored_start)
        if edges == "full":
            assert w.warmup == warm and w.cooldown == cool
        assert w.scored_mask().sum() == w.num_scored


def test_drop_partial_and_window_at():
    t = generate_trace(spec(), 2)
    ws = cut_windows(t, 64, 10, 10, drop_partial=True)
    assert all(w.num_scored == 64 for w in ws) and len(ws) == (400 - 20) // 64
    w = window_at(t, 0, 50, warmup=20, cooldown=30)
    assert (w.warmup, w.num_scored, w.cooldown, w.parent_start) == (0, 50, 30, 0)
    w = window_at(t, 390, 50, warmup=20, cooldown=30)
    assert (w.warmup, w.num_scored, w.cooldown) == (20, 10, 0)
    for bad in [dict(start=400, size=5), dict(start=0, size=0), dict(start=-1, size=3)]:
        with pytest.raises(ConfigError):
            window_at(t, **bad)
    with pytest.raises(ConfigError, match="edges"):
        cut_windows(t, 10, edges="nope")


# ---------------------------------------------------------------------------------------- bad specs
@pytest.mark.parametrize("changes, field", [
    (dict(num_requests=0), "generator.num_requests"),
    (dict(num_requests=2.5), "generator.num_requests"),
    (dict(arrivals__process="weibull"), "generator.arrivals.process"),
    (dict(arrivals__rate_rps=0), "generator.arrivals.rate_rps"),
    (dict(arrivals__cv=...), "generator.arrivals.cv"),
    (dict(arrivals__cv=-2), "generator.arrivals.cv"),
    (dict(arrivals={"process": "poisson", "rate_rps": 1, "cv": 2}), "generator.arrivals.cv"),
    (dict(arrivals={"process": "mmpp", "rate_rps": 1, "states": [{"rate_mult": 1, "mean_dwell_s": 1}]}),
     "generator.arrivals.states"),
    (dict(arrivals={**MMPP, "transitions": [[0.5, 0.5], [1, 0]]}), "generator.arrivals.transitions[0][0]"),
    (dict(arrivals={**MMPP, "transitions": [[0, 0.5], [1, 0]]}), "generator.arrivals.transitions[0]"),
    (dict(lengths__prompt__sigma=-1), "generator.lengths.prompt.sigma"),
    (dict(lengths__prompt=...), "generator.lengths.prompt"),
    (dict(lengths__truncation="cut"), "generator.lengths.truncation"),
    (dict(lengths__max_model_len=1), "generator.lengths.max_model_len"),
    (dict(lengths__corr=1.0), "generator.lengths.corr"),
    (dict(lengths={"dist": "pairs"}), "generator.lengths.path"),
    (dict(prefix__share_fraction=1.5), "generator.prefix.share_fraction"),
    (dict(prefix__ratio={"dist": "uniform", "low": 0.8, "high": 0.2}), "generator.prefix.ratio.high"),
    (dict(prefix__ratio={"dist": "beta", "a": 0, "b": 1}), "generator.prefix.ratio.a"),
    (dict(prefix__num_groups=0), "generator.prefix.num_groups"),
    (dict(sla__profile="nope"), "generator.sla.profile"),
    (dict(sla__classes=[]), "generator.sla.classes"),
    (dict(sla__classes=[{"weight": 1, "ttft_scale": 0, "tpot_ms": 50}]), "generator.sla.classes[0].ttft_scale"),
    (dict(sla__classes=[{"weight": 1, "ttft_scale": 2, "tpot_ms": 50, "colour": 1}]), "generator.sla.classes[0]"),
    (dict(bogus=1), "generator"),
])
def test_bad_specs_name_the_field(changes, field):
    with pytest.raises(ConfigError) as e:
        TraceSpec.from_dict(spec(**changes))
    assert field in str(e.value)
