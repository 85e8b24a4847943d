"""The policy registry (docs/design.md section 4): every registered policy passes one contract, and
every place that lists policies (the command line, the evaluator, tuning, the env, the vLLM plug-in)
reads the registry."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.errors import PolicyError
from tokenbatch_env.policies import (BASELINES, KERNEL_IDS, POLICIES, TUNED_KINDS, engine_ids, engine_policy,
                                     policy_names, policy_spec)

SCALES = ("linear", "log", "log1p")


def small_trace(n=60, seed=3):
    """A burst of requests with SLOs, priorities and shared prefixes: enough to reorder, preempt and shed."""
    from tokenbatch_env.traces import Trace
    rng = np.random.default_rng(seed)
    arrival = np.sort(rng.integers(0, 2_000_000_000, n)).astype(np.int64)
    prompt = rng.integers(16, 900, n)
    output = rng.integers(1, 200, n)
    t1 = rng.integers(50, 3000, n).astype(np.int64) * 1_000_000
    t2 = rng.integers(20, 200, n).astype(np.int64) * 1_000_000
    return Trace.build(arrival_ns=arrival, prompt_tokens=prompt, output_tokens=output,
                       priority=rng.integers(0, 3, n), ttft_slo_ns=t1, tpot_slo_ns=t2)


def test_registry_lists_every_policy_once():
    assert BASELINES == tuple(POLICIES) and len(set(BASELINES)) == len(BASELINES)
    with pytest.raises(PolicyError, match="unknown policy 'nope'; valid: fcfs, priority"):
        policy_spec("nope")


@pytest.mark.parametrize("name", BASELINES)
def test_contract(name):
    """Each entry is well formed, builds an engine policy of its mode and score function, runs a
    trace to the end with and without shedding, deterministically, and its defaults are in range."""
    spec = POLICIES[name]
    assert spec.summary and spec.kernel_id in KERNEL_IDS and spec.tuned in TUNED_KINDS
    mode, pid = engine_ids(name)
    pol = engine_policy(name)
    assert (pol.mode, pol.pid) == (mode, pid)
    assert (mode == K.MODE_SCORE) == (spec.engine_mode == "score")
    for p, (lo, hi, scale) in spec.ranges:
        assert lo < hi and scale in SCALES and (scale != "log" or lo > 0), p
    if spec.params is not None:
        default = spec.params()
        assert spec.tuned in ("index", "weights")
        if spec.params.__name__ == "IndexParams":
            for p, (lo, hi, _) in spec.ranges:
                assert lo <= getattr(default, p) <= hi
    else:
        assert spec.tuned in ("margin", "") and not spec.ranges
    trace = small_trace()
    runs = [simulate(trace, "stress-512", engine_policy(name, shed_margin=m)).records(0)
            for m in ((None, 0.5) if spec.shed_row else (None,))]
    for rec in runs:
        assert len(rec["end_state"]) == len(trace) and rec["finish_ns"].min() > 0   # every request ended
    again = simulate(trace, "stress-512", engine_policy(name)).records(0)
    assert all(np.array_equal(again[k], runs[0][k]) for k in again)
    if spec.shed_row:
        assert engine_policy(name, shed_margin=0.5).shed_margin == 0.5


def test_consumers_read_the_registry():
    """The evaluator, tuning, the env, the plug-in and the two vLLM-mode commands list exactly the
    registry's policies of their kind."""
    from tokenbatch_env import tuning
    from tokenbatch_env.envs import ACTION_MODES
    from tokenbatch_env.evaluate import BenchConfig
    from tokenbatch_env.integrations.vllm import PLUGIN_POLICIES

    for name in BASELINES:
        BenchConfig(policies=(name,))               # accepted by the evaluator
    assert tuning.TUNABLE_BASELINES == policy_names(tuned="margin")
    assert set(ACTION_MODES) == set(policy_names(parametric=True))
    assert set(PLUGIN_POLICIES) == set(policy_names(in_plugin=True))
    assert set(policy_names(engine_mode="fcfs") + policy_names(engine_mode="priority")) == {"fcfs", "priority"}


def test_index_search_space_is_the_registry_ranges():
    """Tuning samples each index parameter over exactly its registered range and scale."""
    pytest.importorskip("optuna")
    import optuna

    from tokenbatch_env import tuning
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    tuning.suggest_index(trial)
    dist = trial.distributions
    for p, (lo, hi, scale) in POLICIES["index"].ranges:
        d = dist[f"log1p_{p}" if scale == "log1p" else p]
        if scale == "log1p":
            assert math.isclose(d.low, math.log1p(lo)) and math.isclose(d.high, math.log1p(hi)), p
        elif scale == "log":
            assert d.log and math.isclose(d.low, lo) and math.isclose(d.high, hi), p
        elif scale == "linear":
            assert not getattr(d, "log", False) and math.isclose(d.low, lo) and math.isclose(d.high, hi), p
