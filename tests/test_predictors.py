import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tokenbatch_env.errors import ConfigError
from tokenbatch_env.predictors import (PredictorSpec, ResidualLife, counter_normals, estimates,
                                       remaining_from_estimate)
from tokenbatch_env.traces import Trace


def _trace(n, seed=0):
    rng = np.random.default_rng(seed)
    return Trace.build(arrival_ns=np.sort(rng.integers(0, 10**9, n)), prompt_tokens=rng.integers(1, 100, n),
                       output_tokens=rng.integers(1, 500, n))


def test_counter_normals_are_standard_and_keyed_by_index():
    z = counter_normals("abc", 0, 200_000)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    # a prefix of the stream is the same whatever n: one draw per request index
    assert np.array_equal(counter_normals("abc", 0, 10), z[:10])
    assert not np.array_equal(counter_normals("abc", 1, 10), z[:10])
    assert not np.array_equal(counter_normals("abd", 0, 10), z[:10])


def test_noisy_estimate_independent_of_other_requests():
    t = _trace(50)
    spec = PredictorSpec("noisy", 0.5, 3)
    e = estimates(t, spec)
    assert np.array_equal(e, estimates(t, spec))
    assert (e > 0).all()
    assert np.allclose(np.log(e / t.output_tokens).std(), 0.5, atol=0.2)


def test_oracle_and_sigma_zero_equal_truth():
    t = _trace(20)
    assert np.array_equal(estimates(t, PredictorSpec("oracle")), t.output_tokens)
    assert np.allclose(estimates(t, PredictorSpec("noisy", 0.0)), t.output_tokens)
    assert list(remaining_from_estimate(np.array([10.0, 3.0]), np.array([4, 5]))) == [6.0, 1.0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=40), st.integers(0, 70))
def test_residual_life_matches_definition(lengths, g):
    L = np.array(lengths)
    got = ResidualLife.from_lengths(L).remaining([g])[0]
    alive = L[L > g]
    want = (alive - g).mean() if alive.size else 1.0
    assert got == pytest.approx(max(want, 1.0), rel=1e-12)


def test_bad_specs():
    with pytest.raises(ConfigError, match="unknown predictor"):
        PredictorSpec("psychic")
    with pytest.raises(ConfigError, match="sigma"):
        PredictorSpec("noisy", float("nan"))
    with pytest.raises(ConfigError, match="unknown field"):
        PredictorSpec.from_dict({"kind": "noisy", "sd": 1})
