"""The robust defaults (docs/design.md section 10): the objective, the flags' fractions, a small run
end to end (deterministic, d_c against the tuned baselines), and the held-out judge, which must
find no difference between SJF+shed and the defaults that are SJF+shed."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optuna")

from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.metrics import paired_difference, stratified_difference
from tokenbatch_env.params import load_robust_defaults as load_robust
from tokenbatch_env.robust import (ROBUST_FILE, RobustConfig, judge_held_out, levers_for,
                                   objective_value, run_robust)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"


def test_objective_penalises_the_shortfall():
    assert objective_value([0.02, 0.0, -0.01], 4.0) == pytest.approx(0.01 / 3 - 4 * 0.01 / 3)
    assert objective_value([0.01, 0.03], 4.0) == pytest.approx(0.02)


def test_levers_for_profiles():
    p = load_profile("llama2-7b-a100")
    lv = levers_for(p, {"budget_frac": 0.25, "seqs_frac": 1.0, "threshold_frac": 2.0}, {"budget_u": 0.5,
                                                                                        "budget_bmin": 0.2})
    # a threshold fraction >= 1 leaves the deployment's own threshold (no key)
    assert lv == {"max_num_batched_tokens": 512, "max_num_seqs": 256, "budget_u": 0.5, "budget_bmin": 0.2}
    lv = levers_for(p, {"budget_frac": 1 / 16, "seqs_frac": 1.0, "threshold_frac": 1 / 16})
    # max_num_seqs <= the budget (vLLM refuses otherwise); a threshold >= the budget is off
    assert lv == {"max_num_batched_tokens": 128, "max_num_seqs": 128, "long_prefill_token_threshold": 0}
    lv = levers_for(p, {"budget_frac": 0.5, "seqs_frac": 0.5, "threshold_frac": 0.125})
    assert lv == {"max_num_batched_tokens": 1024, "max_num_seqs": 128, "long_prefill_token_threshold": 256}


def test_stratified_difference_is_the_paired_one_for_one_cell():
    rng = np.random.default_rng(1)
    d = rng.normal(0.01, 0.02, 30)
    assert stratified_difference([d], [3], B=2000, seed=5) == paired_difference(d, np.zeros(30), B=2000, seed=5,
                                                                                  block=3)
    m, lo, hi = stratified_difference([d, d + 1.0], B=500)
    assert m == pytest.approx(d.mean() + 0.5) and lo < m < hi
    # two cells of one trace's windows (perfectly correlated): resampled together, the pooled CI is the
    # single cell's, shifted; resampled apart it is narrower (the correlation ignored)
    together = stratified_difference([d, d + 1.0], groups=["t", "t"], B=2000, seed=3)
    apart = stratified_difference([d, d + 1.0], groups=["t", "u"], B=2000, seed=3)
    one = stratified_difference([d], B=2000, seed=3)
    assert together[1] == pytest.approx(one[1] + 0.5) and together[2] == pytest.approx(one[2] + 0.5)
    assert together[2] - together[1] > apart[2] - apart[1]
    with pytest.raises(ValueError, match="differ in size"):
        stratified_difference([d, d[:10]], groups=["t", "t"])


def test_bad_config_is_one_line():
    with pytest.raises(ConfigError, match="extra"):
        RobustConfig(extra=("mooncake-like-long",))
    with pytest.raises(ConfigError, match="baselines"):
        RobustConfig(baselines=("index",))
    with pytest.raises(ConfigError, match="loads"):
        RobustConfig(loads=(0.0,))


def _small(tmp_path, name):
    return RobustConfig(suites=("azure-code-like",), profiles=("llama2-7b-a100",), extra=(),
                        slo_rules=("mlperf-llama3_1-8b",), loads=(1.2,), trials=6, baseline_trials=4, k=4,
                        max_train_traces=2, max_validation_traces=2, out=str(tmp_path / name), progress=False)


def test_small_run_end_to_end_and_deterministic(tmp_path):
    a = run_robust(_small(tmp_path, "a"))
    b = run_robust(_small(tmp_path, "b"))
    assert (tmp_path / "a" / "report.json").read_text() == (tmp_path / "b" / "report.json").read_text()
    assert a["evidence_id"] == b["evidence_id"]
    (cell,) = a["cells"]
    assert cell["best_baseline"] in ("sjf+shed", "edf+shed", "llf+shed")
    assert cell["baseline_train"] == max(cell["baseline_rows_train"].values())
    assert cell["defaults_train"] - cell["baseline_train"] == pytest.approx(cell["d_train"])
    assert cell["defaults_validation"] - cell["baseline_validation"] == pytest.approx(cell["d_validation"])
    assert a["objective"]["train"] == pytest.approx(objective_value([cell["d_train"]], 4.0))
    d = load_robust(tmp_path / "a" / "robust_defaults.json")
    assert d["meta"]["t_ref_mode"] == "trace" and d["meta"]["profile"] is None
    assert d["meta"]["evidence_id"] == a["evidence_id"]
    # the command that makes this file, as run (not the default run's)
    assert d["meta"]["command"].startswith("python tuning/robust_defaults.py --suites azure-code-like")
    assert "--trials 6" in d["meta"]["command"] and "--install" not in d["meta"]["command"]
    assert set(d["flag_fractions"]) == {"budget_frac", "seqs_frac", "threshold_frac"}
    assert not list((tmp_path / "a").glob("*.tmp*"))


def test_load_robust_refuses_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"index": {}}))
    with pytest.raises(ConfigError, match="not a tokenbatch-robust-defaults file"):
        load_robust(p)
    with pytest.raises(ConfigError, match="not found"):
        load_robust(tmp_path / "missing.json")


def test_shipped_file_is_valid():
    if not ROBUST_FILE.is_file():
        pytest.skip("no shipped robust defaults yet")
    d = load_robust()
    assert len(d["meta"]["evidence_id"]) == 64 and d["meta"]["t_ref_mode"] == "trace"


def _need_shared():
    if not SHARED.is_dir():
        if os.environ.get("TOKENBATCH_REQUIRE_SHARED"):
            pytest.fail("../shared/traces is required (TOKENBATCH_REQUIRE_SHARED=1)")
        pytest.skip("needs ../shared/traces")


def test_judge_finds_no_difference_between_sjf_shed_and_itself():
    """Defaults that are SJF+shed at the profile's flags with the rule off (B_min 1) run exactly
    SJF+shed's schedule: every paired difference is 0, and the goal (pooled > 0) is not met."""
    _need_shared()
    sjf = {"index": {"kappa": 0.0, "slope": 1.0, "gamma": 0.0, "theta": 0.0, "beta": 0.0, "w_prefix": 0.0,
                     "a_edf": 0.0}, "shed_margin": 0.0, "tpot_guard": {"budget_u": 0.0, "budget_bmin": 1.0},
           "flag_fractions": {"budget_frac": 1.0, "seqs_frac": 1.0, "threshold_frac": 2.0}, "meta": {}}
    rep = judge_held_out(sjf, SHARED, traces={"azure-conv": ("azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
                                                             "llama2-7b-a100")},
                         rules=("mlperf-llama2-70b",), loads=(1.5,), rows=("sjf+shed", "fcfs"), bootstrap_b=200,
                         progress=False)
    (cell,) = rep["cells"]
    assert cell["vs"]["sjf+shed"]["diff"] == 0.0 and cell["vs"]["sjf+shed"]["ci95"] == [0.0, 0.0]
    assert cell["vs"]["fcfs"]["diff"] > 0
    assert rep["pooled"]["sjf+shed"]["pass"] is False and rep["met"] is False


def test_command_line_errors_are_one_line(capsys, tmp_path):
    from tokenbatch_env.robust import main
    assert main(["--judge", "shipped", "--traces-dir", str(tmp_path / "none"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--traces-dir" in err[0]
    out = tmp_path / "o"
    assert main(["--suites", "nope", "--extra", "", "--out", str(out), "--quiet"]) == 2
    assert "nope" in capsys.readouterr().err and not out.exists()   # (no empty output directory)
    assert main(["--trials", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trials" in err[0]
