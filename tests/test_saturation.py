"""lambda_sat: measured by the engine, recorded in every shipped suite manifest, reproducible."""

import pytest

from tokenbatch_env.engine.saturation import MANIFEST_PROFILES, measure_lambda_sat, suite_lambda_sat
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.traces.suites import list_suites, load_suite


def test_every_manifest_records_lambda_sat_per_profile():
    for name in list_suites():
        lam = load_suite(name).lambda_sat
        assert set(MANIFEST_PROFILES) <= set(lam), name
        assert all(v > 0 for v in lam.values())


@pytest.mark.parametrize("suite,profile", [("seed-200", "stress-512"), ("azure-code-like", "llama2-7b-a100")])
def test_recorded_lambda_sat_reproduces(suite, profile):
    assert suite_lambda_sat(suite, profile) == load_suite(suite).lambda_sat[profile]


def test_faster_engine_saturates_later():
    lam = load_suite("seed-200").lambda_sat
    assert lam["llama3-8b-h100"] > lam["llama2-7b-a100"] > lam["stress-512"]


def test_too_short_trace_is_rejected():
    t = load_suite("seed-200").trace("train", 0).subset(slice(0, 5))
    with pytest.raises(ConfigError, match="at least 10"):
        measure_lambda_sat(t, "stress-512")


def test_client_drops_do_not_change_lambda_sat():
    """The saturation rate is the engine's: client time-outs and admission control (ways requests
    leave unserved) are off while it is measured; the engine's own settings still count."""
    from tokenbatch_env.engine.state import EngineConfig
    t = load_suite("seed-200").traces("test")[0]
    base = measure_lambda_sat(t, "stress-512")
    for cfg in (EngineConfig(max_wait_ms=60_000.0), EngineConfig(max_wait_ms=2_000.0, timeout_running=True),
                EngineConfig(admission_control=True)):
        assert measure_lambda_sat(t, "stress-512", cfg) == base
    assert measure_lambda_sat(t, "stress-512", EngineConfig(prefix_caching=False)) != base
