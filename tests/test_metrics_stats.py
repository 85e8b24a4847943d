import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tokenbatch_env.metrics import bootstrap_ci, default_block, paired_difference, win_rate


def test_bootstrap_ci_covers_mean_and_is_seeded():
    v = np.random.default_rng(1).normal(0.4, 0.1, 40)
    m, lo, hi = bootstrap_ci(v, seed=7)
    assert lo < m < hi and m == pytest.approx(v.mean())
    assert bootstrap_ci(v, seed=7) == (m, lo, hi)
    assert bootstrap_ci(v, seed=8) != (m, lo, hi)
    # width close to the normal theory 2 * 1.96 * sd / sqrt(n)
    assert hi - lo == pytest.approx(2 * 1.96 * v.std() / np.sqrt(40), rel=0.15)


def test_block_bootstrap_is_wider_on_autocorrelated_series():
    rng = np.random.default_rng(0)
    x = np.repeat(rng.normal(size=20), 10)  # strongly autocorrelated
    _, lo1, hi1 = bootstrap_ci(x, seed=0)
    _, lo2, hi2 = bootstrap_ci(x, seed=0, block=10)
    assert hi2 - lo2 > hi1 - lo1
    assert default_block(1000) == 10


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=2, max_size=30))
def test_paired_difference_of_identical_is_zero(xs):
    m, lo, hi = paired_difference(xs, xs, B=200)
    assert m == lo == hi == 0.0


def test_win_rate_ties_count_half():
    assert win_rate([1, 2, 3], [0, 2, 4]) == pytest.approx(0.5)
    assert win_rate([1, 1], [0, 0]) == 1.0


def test_bad_input():
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([0.1, float("nan")])
    with pytest.raises(ValueError):
        paired_difference([1, 2], [1])
