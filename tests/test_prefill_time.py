"""prefill_time_i (docs/design.md section 4): the shortest idle prefill over every chunking with chunks
<= min(B, threshold), checked against brute force, never above chunking at B, and what the shed
rule's slack and u_p use (section 11)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from tokenbatch_env.engine import scoring as S
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.state import EngineConfig, make_fcfg
from tokenbatch_env.policies import DropInParams, IndexParams, request_tier


def brute_force_ps(P, h, cap, ps):
    """The least total ps over all sequences of chunks (each <= cap) covering P tokens after h."""
    c0, cp, cc2, cat = (int(x) for x in ps[:4])

    @functools.lru_cache(maxsize=None)
    def best(done):
        if done == h + P:
            return 0
        return min(c0 + cp * k + cc2 * k * k + cat * k * done + best(done + k)
                   for k in range(1, min(cap, h + P - done) + 1))
    return best(h)


@pytest.mark.parametrize("profile", ["llama2-7b-a100", "llama3-8b-h100", "stress-512"])
@pytest.mark.parametrize("P, h, cap", [(1, 0, 4), (37, 0, 8), (60, 16, 7), (90, 0, 90), (120, 32, 25)])
def test_equals_brute_force_and_never_exceeds_chunking_at_the_cap(profile, P, h, cap):
    ps = np.asarray(load_profile(profile).cost.ps, np.int64)
    exact = -(-brute_force_ps(P, h, cap, ps) // 1000)   # ns, rounded up
    assert S.prefill_time_ns(P, h, cap, ps) == exact
    assert S.prefill_time_ns(P, h, cap, ps) <= S.idle_prefill_ns(P, h, cap, ps)


def test_chunking_at_b_is_not_the_fastest_on_a_real_profile():
    """The correction matters: on llama2-7b-a100 (c_c2 > c_attn / 2) a long prompt prefills faster
    in more chunks than B allows at least, so the old chunk-at-B time overstated the minimum."""
    p = load_profile("llama2-7b-a100")
    ps = np.asarray(p.cost.ps, np.int64)
    fast, at_b = S.prefill_time_ns(4000, 0, 2048, ps), S.idle_prefill_ns(4000, 0, 2048, ps)
    assert fast < at_b * 0.99


def test_a_request_that_can_still_make_its_ttft_is_not_sheddable():
    """Tier -1 (TTFT lost: first to shed) only when even the fastest chunking misses T1."""
    prof = load_profile("llama2-7b-a100")
    params = DropInParams.from_profile(prof, IndexParams(), 300.0)
    ps = np.asarray(prof.cost.ps, np.int64)
    fast_ms = S.prefill_time_ns(4000, 0, prof.max_num_batched_tokens, ps) / 1e6
    at_b_ms = S.idle_prefill_ns(4000, 0, prof.max_num_batched_tokens, ps) / 1e6
    between = (fast_ms + at_b_ms) / 2
    assert request_tier(4000, 0.0, between, params=params) == 0
    assert request_tier(4000, 0.0, fast_ms * 0.99, params=params) == -1


def test_u_p_and_prefill_time_chunk_at_the_threshold():
    prof = load_profile("llama2-7b-a100")
    off, on = make_fcfg(prof), make_fcfg(prof, 256)
    assert on[0] == prof.cost.per_token_ms(256)[0] > off[0] == prof.cost.per_token_ms(2048)[0]
    assert on[1] == off[1]   # decodes still share the full budget
    assert (make_fcfg(prof, 4096) == off).all()   # a threshold above B changes nothing
    assert EngineConfig(long_prefill_token_threshold=0).threshold == 0
    with pytest.raises(Exception, match="long_prefill_token_threshold"):
        EngineConfig(long_prefill_token_threshold=-1)
    big = dataclasses.replace(prof, max_model_len_limit=1000)
    from tokenbatch_env.engine.state import make_cfg
    with pytest.raises(Exception, match="exceeds max_model_len"):
        make_cfg(big, EngineConfig(long_prefill_token_threshold=2000), 0)
