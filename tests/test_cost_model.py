"""CostModel: exact integer-ps arithmetic, monotonicity, closed-form idle prefill."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch_env.engine.cost_model import TERMS, CostModel, _ps
from tokenbatch_env.engine.profiles import list_profiles, load_profile
from tokenbatch_env.errors import ProfileError

ARGS = ("prefill_tokens", "sum_chunk_sq", "sum_chunk_ctx", "decodes", "sum_decode_ctx")

coef = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, allow_infinity=False)
small_coef = st.floats(min_value=0.0, max_value=1e-3, allow_nan=False, allow_infinity=False)
models = st.builds(
    CostModel,
    c0=st.floats(min_value=1e-6, max_value=50.0),
    c_prefill=coef, c_c2=small_coef, c_attn=small_coef, c_decode=coef, c_kv=small_coef)
counts = st.integers(min_value=0, max_value=10_000_000)


def shipped_models():
    return [load_profile(n).cost for n in list_profiles()]


def reference_ns(cost: CostModel, args, swap_ns=0) -> int:
    """ceil(sum of integer-ps terms / 1000) in Python's unbounded integers."""
    ps = [_ps(getattr(cost, n)) for n in TERMS]
    total = ps[0] + sum(c * int(a) for c, a in zip(ps[1:], args))
    return -(-total // 1000) + swap_ns


def test_ps_conversion_is_exact_rounding():
    assert _ps(1.0) == 10**9
    assert _ps(0.0611325) == 61_132_500
    assert _ps(7.00399e-06) == 7_004
    c = CostModel(c0=7.17604, c_prefill=0.0611325, c_c2=7.00399e-06, c_attn=1.89586e-06,
                  c_decode=0.0929828, c_kv=0.000265252)
    assert c.ps.dtype == np.int64
    assert c.ps.tolist() == [7_176_040_000, 61_132_500, 7_004, 1_896, 92_982_800, 265_252]


@settings(max_examples=200, deadline=None)
@given(models, st.lists(counts, min_size=5, max_size=5), st.integers(0, 10**9))
def test_iteration_ns_is_exact_ceil_of_ps_sum(cost, args, swap):
    assert int(cost.iteration_ns(*args, swap_ns=swap)) == reference_ns(cost, args, swap)


@settings(max_examples=200, deadline=None)
@given(models, st.lists(counts, min_size=5, max_size=5), st.integers(0, 4), st.integers(1, 10**6))
def test_iteration_ns_monotone_in_each_argument(cost, args, which, bump):
    base = int(cost.iteration_ns(*args))
    more = list(args)
    more[which] += bump
    assert int(cost.iteration_ns(*more)) >= base
    assert base >= int(math.ceil(_ps(cost.c0) / 1000))  # never below the fixed cost


@pytest.mark.parametrize("cost", shipped_models(), ids=list_profiles())
def test_shipped_models_vectorised_equals_scalar_and_monotone(cost):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 5000, size=(5, 200))
    a[1] = a[0] ** 2  # a plausible single-chunk sum of squares
    vec = cost.iteration_ns(*a)
    assert vec.dtype == np.int64
    assert [int(v) for v in vec] == [reference_ns(cost, a[:, i]) for i in range(a.shape[1])]
    for k in range(5):
        b = a.copy()
        b[k] += 1
        assert (cost.iteration_ns(*b) >= vec).all()


def idle_reference(cost: CostModel, p: int, budget: int) -> int:
    total, done = 0, 0
    while done < p:
        c = min(p - done, budget)
        total += int(cost.iteration_ns(c, c * c, c * done, 0, 0))
        done += c
    return total


@settings(max_examples=100, deadline=None)
@given(models, st.integers(1, 9000), st.data())
def test_idle_prefill_equals_sum_of_chunk_iterations(cost, budget, data):
    prompts = data.draw(st.lists(st.integers(0, 40 * budget), min_size=1, max_size=8))
    got = cost.idle_prefill_ns(np.array(prompts), budget)
    assert [int(g) for g in got] == [idle_reference(cost, p, budget) for p in prompts]


@pytest.mark.parametrize("name", list_profiles())
def test_idle_prefill_shipped_profiles(name):
    p = load_profile(name)
    prompts = np.array([1, 16, 128, 512, 2047, 2048, 2049, 4095, 8192, 20000])
    got = p.cost.idle_prefill_ns(prompts, p.max_num_batched_tokens)
    assert [int(g) for g in got] == [idle_reference(p.cost, int(x), p.max_num_batched_tokens)
                                     for x in prompts]
    assert (np.diff(got) > 0).all()  # longer prompt, longer idle TTFT
    assert int(p.cost.idle_prefill_ns(np.array([0]), 16)[0]) == 0
    assert p.cost.idle_prefill_ns(np.array([], dtype=np.int64), 16).shape == (0,)


def test_idle_prefill_rejects_bad_budget():
    with pytest.raises(ProfileError):
        CostModel(c0=1.0, c_prefill=0.1).idle_prefill_ns([10], 0)


def test_sums_of_times_are_exact():
    """Integer ns: any grouping of a sum of iteration times gives the same total."""
    cost = load_profile("stress-512").cost
    rng = np.random.default_rng(1)
    t = cost.iteration_ns(rng.integers(0, 2048, 1000), 0, 0, rng.integers(0, 256, 1000),
                          rng.integers(0, 100_000, 1000))
    assert int(t.sum()) == sum(int(x) for x in t) == int(t[::-1].cumsum()[-1])
    frac = sum(Fraction(int(x)) for x in t)
    assert frac.denominator == 1 and int(frac) == int(t.sum())


@pytest.mark.parametrize("bad", [
    {"c0": 0.0, "c_prefill": 0.1},
    {"c0": -1.0, "c_prefill": 0.1},
    {"c0": 1.0, "c_prefill": -1e-9},
    {"c0": 1.0, "c_prefill": float("nan")},
    {"c0": 1.0, "c_prefill": 0.1, "c_kv": float("inf")},
    {"c0": "1", "c_prefill": 0.1},
])
def test_bad_coefficients_rejected(bad):
    with pytest.raises(ProfileError):
        CostModel(**bad)


def test_per_token_and_to_dict():
    c = CostModel(c0=5.0, c_prefill=0.05, c_decode=0.05)
    assert c.per_token_ms(2048) == (5.0 / 2048 + 0.05, 5.0 / 2048 + 0.05)
    assert list(c.to_dict()) == list(TERMS)
    assert CostModel(**c.to_dict()) == c
