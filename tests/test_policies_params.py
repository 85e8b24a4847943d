import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.errors import PolicyError
from tokenbatch_env.policies import (DropInParams, IndexParams, check_policy_name, check_shed_margin,
                                     score_request_priority)


def test_ranges_enforced_with_clear_errors():
    with pytest.raises(PolicyError, match="kappa=11"):
        IndexParams(kappa=11)
    with pytest.raises(PolicyError, match="slope"):
        IndexParams(slope=0.0)
    with pytest.raises(PolicyError, match="gamma"):
        IndexParams(gamma=float("nan"))
    with pytest.raises(PolicyError, match="unknown index parameter"):
        IndexParams.from_dict({"kapa": 1})
    for v in ("x", None, True, [1]):   # named, not "could not convert string to float: 'x'"
        with pytest.raises(PolicyError, match=re.escape(f"index parameter kappa: expected a number, got {v!r}")):
            IndexParams.from_dict({"kappa": v})
    with pytest.raises(PolicyError, match="valid: fcfs"):
        check_policy_name("random")
    assert check_shed_margin(float("inf")) is None and check_shed_margin(0.5) == 0.5
    with pytest.raises(PolicyError):
        check_shed_margin(3.0)


def _params(**kw):
    return DropInParams.from_profile(load_profile("stress-512"), IndexParams(**kw), 250.0)


def test_drop_in_orders_like_srpt_when_only_service_matters():
    p = _params(kappa=0, gamma=0, beta=0, w_prefix=0, a_edf=0)
    short = score_request_priority(100, 10, 0, 1000, 400, 0, 0.0, params=p)
    long_ = score_request_priority(2000, 300, 0, 1000, 400, 0, 0.0, params=p)
    assert short > long_


def test_drop_in_a_edf_alone_is_edf_order():
    p = _params(kappa=0, gamma=0, beta=0, w_prefix=0, a_edf=10)
    # same request shape, earlier deadline (waited longer) scores higher
    early = score_request_priority(500, 50, 200, 1000, 400, 0, 0.0, params=p)
    late = score_request_priority(500, 50, 0, 1000, 400, 0, 0.0, params=p)
    assert early > late


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4000), st.floats(1, 2000), st.floats(0, 5000), st.floats(1, 5000),
       st.integers(0, 511), st.floats(0, 1))
def test_drop_in_finite(prompt, d, wait, t1, free, ratio):
    s = score_request_priority(prompt, d, wait, t1, free, 0, ratio, params=_params(a_edf=1.0))
    assert math.isfinite(s)
