"""Per-copy engine configuration (docs/design.md section 11): one batch holds copies with their own
budget, threshold, max_num_seqs, KV pool, async setting, context length and GPU costs, and each
copy's outcomes equal those of the same copy run alone."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.simulate import EngineRun, simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from test_engine_properties import _policy, traces

copy_configs = st.fixed_dictionaries({
    "num_blocks": st.integers(22, 80),
    "max_num_batched_tokens": st.sampled_from([16, 64, 512]),
    "max_num_seqs": st.sampled_from([2, 4, 64]),
    "long_prefill_token_threshold": st.sampled_from([None, 8, 48, 200]),
    "max_model_len": st.sampled_from([None, 256, 330]),
    "prefix_caching": st.booleans(),
    "async_scheduling": st.booleans(),
    "swap": st.booleans(),
    "max_wait_ms": st.sampled_from([None, 150.0]),
})
profiles = st.sampled_from(["linear", "stress-512", "llama2-7b-a100"])
policies = st.sampled_from(["fcfs", "priority", "edf", "index", "sjf+shed"])


def _columns(res, c):
    rec = res.records(c)
    its = res.iterations(c)
    return rec, its


def _same(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: {k}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(traces(max_n=20), profiles, copy_configs), min_size=2, max_size=4), policies,
       st.booleans())
def test_mixed_batch_equals_each_copy_alone(copies, policy, jumps):
    """Every copy of a batch of different engine settings (and GPU profiles) runs exactly as it runs
    alone: records and per-iteration records identical."""
    trs = [t for t, _, _ in copies]
    profs = [p for _, p, _ in copies]
    cfgs = [EngineConfig(record_iterations=50_000, max_iterations=100_000, jumps=jumps, **c) for _, _, c in copies]
    est = [t.output_tokens * 1.3 for t in trs]
    mixed = simulate(trs, profs, _policy(policy), cfgs, estimates=est)
    for c, (t, p, cfg) in enumerate(zip(trs, profs, cfgs)):
        alone = simulate([t], p, _policy(policy), cfg, estimates=[est[c]])
        rec_m, it_m = _columns(mixed, c)
        rec_a, it_a = _columns(alone, 0)
        _same(rec_m, rec_a, f"copy {c} records")
        _same(it_m, it_a, f"copy {c} iterations")
        assert mixed.profiles[c] == alone.profile and mixed.configs[c] == alone.config


def test_mixed_batch_on_threads_and_decision_epochs():
    """A mixed batch advanced on two engine threads, or to decision epochs, equals the same batch
    run at once (copies are independent rows whatever their settings)."""
    from tokenbatch_env.traces.suites import load_suite
    trs = [t.subset(np.arange(150)) for t in load_suite("seed-200").traces("train")[:6]]
    cfgs = [EngineConfig(max_num_batched_tokens=b, long_prefill_token_threshold=th, max_num_seqs=m)
            for b, th, m in [(2048, None, 256), (512, 128, 64), (256, None, 16), (1024, 64, 32), (2048, 256, 8),
                             (128, None, 256)]]
    ref = simulate(trs, "stress-512", "fcfs", cfgs)
    run = EngineRun(trs, "stress-512", "fcfs", cfgs, threads=2)
    run.advance()
    got = run.result()
    dec = EngineRun(trs, "stress-512", "fcfs", cfgs)
    dec.start_epochs(interval_ns=50_000_000, shed_on=False)
    while (dec.advance_to_decision() != 2).any():   # STOP_ENDED for every copy
        pass
    for c in range(len(trs)):
        _same(got.records(c), ref.records(c), f"threads copy {c}")
        _same(dec.result().records(c), ref.records(c), f"epochs copy {c}")
    # the settings matter: the copies' outcomes differ from one another on the same trace
    same = simulate([trs[0]] * 2, "stress-512", "fcfs", [cfgs[0], cfgs[5]])
    assert not np.array_equal(same.records(0)["finish_ns"], same.records(1)["finish_ns"])


def test_shared_settings_and_one_block_size():
    """``profile``/``config`` are the batch's when shared and refused when not (the per-copy lists
    hold them); two block sizes in one batch are refused, naming them."""
    from engine_helpers import tiny_trace
    t = tiny_trace([0, 1], [50, 60], [3, 4])
    run = EngineRun([t, t], "linear", "fcfs", [EngineConfig(max_num_seqs=4), EngineConfig(max_num_seqs=8)])
    assert [p.max_num_seqs for p in run.profiles] == [4, 8]
    with pytest.raises(ConfigError, match="different engine configs"):
        _ = run.config
    with pytest.raises(ConfigError, match="different profiles"):
        _ = run.profile
    uniform = EngineRun([t, t], "linear", "fcfs", [EngineConfig(), EngineConfig()])
    assert uniform.config == EngineConfig() and uniform.profile.name == "linear"
    with pytest.raises(ConfigError, match=r"one block size per engine batch.*\[16, 32\]"):
        EngineRun([t, t], "linear", "fcfs", [EngineConfig(), EngineConfig(block_size=32)])
    with pytest.raises(ConfigError, match="one per copy \\(2\\), got 3 values"):
        EngineRun([t, t], "linear", "fcfs", [EngineConfig()] * 3)
    with pytest.raises(ConfigError, match="one record_iterations"):
        EngineRun([t, t], "linear", "fcfs", [EngineConfig(record_iterations=5), EngineConfig()])
    big = dataclasses.replace(load_profile("linear"), name="linear-big", num_blocks=2000)
    run = EngineRun([t, t], ["linear", big], "fcfs")
    assert run.arrays.ref.shape[1] == 1999 and run.arrays.n_free.tolist() == [511, 1999]
