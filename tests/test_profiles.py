"""Profiles, the NNLS fitting tool and ``tokenbatch profiles``."""

from __future__ import annotations

import itertools
import json
from importlib import resources

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import shared_path
from tokenbatch_env.cli import main
from tokenbatch_env.engine import fit
from tokenbatch_env.engine.cost_model import TERMS, CostModel
from tokenbatch_env.engine.profiles import (MAX_MAPE_PCT, PROVENANCES, Profile, list_profiles,
                                            load_profile)
from tokenbatch_env.errors import ProfileError

DATA = resources.files("tokenbatch_env") / "data" / "profiles"


def samples_csv():
    return shared_path("calibration", fit.SAMPLES_NAME)


# ------------------------------------------------------------------------------------------
# NNLS
# ------------------------------------------------------------------------------------------

def brute_force_nnls(A, b):
    """Minimum residual over every support set whose unconstrained LS solution is >= 0."""
    n = A.shape[1]
    best_x, best_r = np.zeros(n), float(np.linalg.norm(b))
    for k in range(1, n + 1):
        for S in itertools.combinations(range(n), k):
            xs = np.linalg.lstsq(A[:, S], b, rcond=None)[0]
            if (xs >= -1e-12).all():
                x = np.zeros(n)
                x[list(S)] = np.maximum(xs, 0)
                r = float(np.linalg.norm(A @ x - b))
                if r < best_r:
                    best_x, best_r = x, r
    return best_x, best_r


# entries are 0 or of magnitude 1e-6..10 (a solution must be representable in float64)
finite = st.floats(min_value=-10, max_value=10, allow_nan=False, allow_infinity=False,
                   width=64).map(lambda v: 0.0 if abs(v) < 1e-6 else v)


@st.composite
def problems(draw):
    n = draw(st.integers(1, 4))
    m = draw(st.integers(1, 8))
    A = draw(hnp.arrays(np.float64, (m, n), elements=finite))
    b = draw(hnp.arrays(np.float64, (m,), elements=finite))
    return A, b


@settings(max_examples=200, deadline=None)
@given(problems())
def test_nnls_matches_brute_force_and_is_nonnegative(prob):
    A, b = prob
    x = fit.nnls(A, b)
    assert x.shape == (A.shape[1],)
    assert (x >= 0).all()
    _, best_r = brute_force_nnls(A, b)
    r = float(np.linalg.norm(A @ x - b))
    assert r <= best_r + 1e-7 * (1 + float(np.linalg.norm(b)) + float(np.abs(A).sum()))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_nnls_kkt_conditions(seed):
    rng = np.random.default_rng(seed)
    m, n = rng.integers(6, 40), rng.integers(1, 7)
    A = rng.normal(size=(m, n)) * 10.0 ** rng.integers(-3, 4, size=n)  # badly scaled columns
    b = rng.normal(size=m)
    x = fit.nnls(A, b)
    w = A.T @ (b - A @ x)  # gradient of -0.5||Ax-b||^2
    scale = np.linalg.norm(A, axis=0) * (1 + np.linalg.norm(b))
    assert (x >= 0).all()
    assert (w <= 1e-8 * scale).all()                      # no improving direction
    assert (np.abs(w[x > 0]) <= 1e-8 * scale[x > 0]).all()  # stationary on the support


def test_nnls_recovers_exact_nonnegative_solution():
    rng = np.random.default_rng(3)
    A = rng.uniform(0, 1, size=(50, 6)) * np.array([1, 1e3, 1e6, 1e6, 1e2, 1e5])
    x_true = np.array([7.0, 0.06, 7e-6, 0.0, 0.09, 2.6e-4])
    x = fit.nnls(A, A @ x_true)
    np.testing.assert_allclose(x, x_true, rtol=1e-8, atol=1e-12)


def test_nnls_degenerate_cases():
    A = np.array([[1.0, 0.0, 1.0], [2.0, 0.0, 2.0], [3.0, 0.0, 3.0]])  # zero and duplicate column
    b = np.array([1.0, 2.0, 3.0])
    x = fit.nnls(A, b)
    assert x[1] == 0.0 and (x >= 0).all()
    np.testing.assert_allclose(A @ x, b, atol=1e-12)
    assert (fit.nnls(np.eye(3), -np.ones(3)) == 0).all()    # every unconstrained coef negative
    assert (fit.nnls(np.zeros((3, 2)), np.ones(3)) == 0).all()
    with pytest.raises(ValueError):
        fit.nnls(np.ones((3, 2)), np.ones(4))
    with pytest.raises(ValueError):
        fit.nnls(np.array([[np.nan]]), np.ones(1))


def test_nnls_agrees_with_scipy_when_available():
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(7)
    for _ in range(50):
        A = rng.normal(size=(20, 5))
        b = rng.normal(size=20)
        np.testing.assert_allclose(fit.nnls(A, b), optimize.nnls(A, b)[0], atol=1e-9)


# ------------------------------------------------------------------------------------------
# The fit
# ------------------------------------------------------------------------------------------

def test_fit_regenerates_shipped_profiles_byte_identically(tmp_path):
    csv = samples_csv()
    profiles = fit.build_profiles(csv)
    assert [p.name for p in profiles] == [fit.FITTED_NAME, fit.DERIVED_NAME, fit.LONG_NAME]
    for p in profiles:
        shipped = (DATA / f"{p.name}.json").read_text(encoding="utf-8")
        assert fit.profile_json(p) == shipped, f"{p.name}.json is stale: rerun {fit.FIT_COMMAND}"
    # and through the CLI, written atomically into a fresh directory
    assert main(["profiles", "fit", "--samples", str(csv), "--out", str(tmp_path)]) == 0
    for p in profiles:
        assert (tmp_path / f"{p.name}.json").read_bytes() == (DATA / f"{p.name}.json").read_bytes()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temp files left


def test_fit_quality_and_cross_check_with_prior_fit():
    csv = samples_csv()
    p = fit.fitted_profile(csv)
    assert set(p.mape_pct) == {"prefill", "decode", "mixed"}
    assert max(p.mape_pct.values()) <= MAX_MAPE_PCT
    # Unweighted NNLS with no active constraint is ordinary least squares: it must reproduce the
    # independent prior fit shipped with the calibration data.
    prior = json.loads(shared_path("calibration", "llama2_7b_a100_tp1_fit.json").read_text())
    ref = next(f for f in prior["fits"] if f["label"] == "all, +c^2 +kv*c")
    order = {"1": "c0", "prefill_tokens": "c_prefill", "decode_seqs": "c_decode",
             "kv_context_tokens": "c_kv", "sum_chunk^2": "c_c2", "sum kv*chunk": "c_attn"}
    for term, value in zip(ref["terms"], ref["coef_ms"]):
        assert getattr(p.cost, order[term]) == pytest.approx(value, rel=1e-5)
    # the shipped weighting is the one with the lowest worst-kind error of none / relative
    s = fit.load_samples(csv)
    worst = {w: max(fit.mape_by_kind(fit.fit_cost_model(s, weighting=w), s).values())
             for w in ("none", "relative")}
    assert min(worst, key=worst.get) == fit.SHIPPED_WEIGHTING


def synthetic_samples(tmp_path, nonlinear: str = ""):
    """Batches of all three kinds timed by a known model, optionally made strongly non-linear:
    "cliff" (short prefill batches take 200 ms more) or "steps" (long prefills take 4x)."""
    rng = np.random.default_rng(11)
    rows = []
    for i in range(600):
        kind = i % 3
        P = int(rng.integers(16, 2048)) if kind != 1 else 0
        D = int(rng.integers(1, 128)) if kind != 0 else 0
        K = D * int(rng.integers(100, 2000))
        ctx = int(rng.integers(0, 2000)) if kind == 2 else 0
        t = 5.0 + 0.05 * P + 1e-6 * P * P + 0.08 * D + 2.5e-4 * K + 1e-6 * P * ctx
        if nonlinear == "cliff" and kind == 0 and P < 256:
            t += 200.0
        if nonlinear == "steps" and P > 1024:
            t *= 4.0
        rows.append((kind, P, D, K, P * P, P * ctx, t))
    path = tmp_path / f"samples-{nonlinear or 'linear'}.csv"
    with open(path, "w") as f:
        f.write(",".join(fit.SAMPLES_COLUMNS) + "\n")
        for r in rows:
            f.write(",".join(str(v) for v in r[:6]) + f",{r[6]!r}\n")
    return path


def test_fit_recovers_synthetic_linear_model(tmp_path):
    p = fit.fitted_profile(synthetic_samples(tmp_path))
    assert p.cost.c0 == pytest.approx(5.0, rel=1e-4)
    assert p.cost.c_kv == pytest.approx(2.5e-4, rel=1e-4)
    assert max(p.mape_pct.values()) < 0.01


def test_error_gate_rejects_nonlinear_data(tmp_path):
    path = synthetic_samples(tmp_path, nonlinear="cliff")
    s = fit.load_samples(path)
    assert max(fit.mape_by_kind(fit.fit_cost_model(s), s).values()) > MAX_MAPE_PCT
    with pytest.raises(ProfileError, match="rejected"):
        fit.fitted_profile(path)
    assert main(["profiles", "fit", "--samples", str(path), "--out", str(tmp_path)]) == 2
    assert not (tmp_path / f"{fit.FITTED_NAME}.json").exists()


def test_fit_with_zero_fixed_cost_rejected(tmp_path):
    with pytest.raises(ProfileError, match="c0 came out 0"):
        fit.fitted_profile(synthetic_samples(tmp_path, nonlinear="steps"))


def test_profile_gate_rejects_bad_mape():
    with pytest.raises(ProfileError, match="rejected"):
        Profile(name="x", provenance="fitted", cost=CostModel(c0=1.0, c_prefill=0.1),
                mape_pct={"prefill": 1.0, "decode": 10.5, "mixed": 2.0})


@pytest.mark.parametrize("text,match", [
    ("a,b\n1,2\n", "expected columns"),
    (",".join(fit.SAMPLES_COLUMNS) + "\n", "no rows"),
    (",".join(fit.SAMPLES_COLUMNS) + "\n0,1.5,0,0,1,0,3.0\n", "integers"),
    (",".join(fit.SAMPLES_COLUMNS) + "\n3,1,0,0,1,0,3.0\n", "kind"),
    (",".join(fit.SAMPLES_COLUMNS) + "\n0,1,0,0,1,0,0\n", "t_ms"),
    (",".join(fit.SAMPLES_COLUMNS) + "\n0,1,0,0,1,0,nan\n", "non-finite"),
])
def test_bad_samples_rejected(tmp_path, text, match):
    path = tmp_path / "s.csv"
    path.write_text(text)
    with pytest.raises(ProfileError, match=match):
        fit.load_samples(path)


def test_profile_file_errors_name_the_file_and_every_limit_is_required(tmp_path):
    """A profile file's errors name the file (not only the profile name inside it), and it must state
    the engine's limits: without ``num_blocks`` it silently ran the dataclass's default 512 blocks."""
    from tokenbatch_env.engine.profiles import REQUIRED_FIELDS
    raw = json.loads((DATA / "stress-512.json").read_text(encoding="utf-8"))
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps({**raw, "num_blocks": -5}))
    with pytest.raises(ProfileError, match=f"^{bad}: profile 'stress-512': num_blocks must be a positive"):
        load_profile(str(bad))
    for f in REQUIRED_FIELDS:
        p = tmp_path / f"no-{f}.json"
        p.write_text(json.dumps({k: v for k, v in raw.items() if k != f}))
        with pytest.raises(ProfileError, match=rf"^{p}: missing field\(s\) \['{f}'\]"):
            load_profile(str(p))
    assert {"num_blocks", "block_size", "max_num_batched_tokens"} <= set(REQUIRED_FIELDS)
    for change, msg in (({"cost": {**raw["cost"], "c0": 0}}, "bad cost block: cost coefficient c0 must be > 0"),
                        ({"mape_pct": {}}, "mape_pct must be a non-empty object of finite numbers")):
        p = tmp_path / "changed.json"
        p.write_text(json.dumps({**raw, **change}))
        load_profile.cache_clear()
        with pytest.raises(ProfileError, match=f"^{p}: .*{msg}"):
            load_profile(str(p))


def test_missing_samples_file(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        fit.load_samples(tmp_path / "nope.csv")
    assert main(["profiles", "fit", "--samples", str(tmp_path / "nope.csv")]) == 2


def test_derivation_numbers_match_calibration_readme():
    nums = fit.derivation_numbers(shared_path("calibration"))
    (a_i, a_s), (h_i, h_s) = nums["lines"]["a100_llama2"], nums["lines"]["h100_llama2"]
    # README: A100 TP1 2.25 ms + 64.2 us/token; H100 TP1 3.15 ms + 20.1 us/token
    assert a_s * 1000 == pytest.approx(64.2, rel=0.01) and a_i == pytest.approx(2.25, abs=0.1)
    assert h_s * 1000 == pytest.approx(20.1, rel=0.01) and h_i == pytest.approx(3.15, abs=0.1)
    r = nums["ratios"]
    assert r["gpu_small"] == pytest.approx(r["hbm"], rel=0.02)  # weight streaming ~ HBM ratio
    assert r["kv_bytes"] == 0.25
    assert fit.h100_num_blocks() == 29000


# ------------------------------------------------------------------------------------------
# Shipped profiles
# ------------------------------------------------------------------------------------------

def test_expected_profiles_shipped():
    assert {"stress-512", "linear", "llama2-7b-a100", "llama3-8b-h100", "llama31-8b-h100"} <= set(list_profiles())


@pytest.mark.parametrize("name", list_profiles())
def test_every_shipped_profile_loads(name):
    p = load_profile(name)
    assert p.name == name
    assert p.provenance in PROVENANCES
    assert all(getattr(p.cost, t) >= 0 for t in TERMS) and p.cost.c0 > 0
    assert (p.cost.ps >= 0).all()
    assert 0 <= p.watermark_blocks < p.usable_blocks
    assert p.max_model_len <= p.max_model_len_limit
    if p.provenance == "fitted":
        assert set(p.mape_pct) == {"prefill", "decode", "mixed"}
        assert max(p.mape_pct.values()) <= MAX_MAPE_PCT
        assert len(p.source["samples_sha256"]) == 64 and "command" in p.source
    if p.provenance == "derived":
        assert p.description.startswith("DERIVED") and p.mape_pct is None
    raw = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    assert Profile.from_dict(raw) == p


def test_fitted_and_derived_profile_settings():
    a, h = load_profile("llama2-7b-a100"), load_profile("llama3-8b-h100")
    assert (a.provenance, h.provenance) == ("fitted", "derived")
    assert (a.num_blocks, a.block_size, a.watermark_blocks) == (7424, 16, 74)
    assert (a.max_num_batched_tokens, a.max_num_seqs, a.max_model_len_limit) == (2048, 256, 4096)
    assert (h.max_num_batched_tokens, h.max_num_seqs, h.max_model_len_limit) == (8192, 1024, 8192)
    assert a.async_scheduling and h.async_scheduling
    assert (a.kv_bytes_per_token, h.kv_bytes_per_token) == (524288, 131072)
    assert h.watermark_blocks == int(0.01 * h.num_blocks)
    # H100 is faster on every term
    assert all(getattr(h.cost, t) < getattr(a.cost, t) for t in TERMS)


def test_unknown_profile_lists_valid_ones():
    with pytest.raises(ProfileError, match="llama2-7b-a100"):
        load_profile("no-such-profile")


# ------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------

def test_cli_list(capsys):
    assert main(["profiles", "list"]) == 0
    out = capsys.readouterr().out
    for name in list_profiles():
        assert name in out
    assert "fitted" in out and "derived" in out and "8192/1024" in out
    assert main(["profiles"]) == 0  # no subcommand: list


@pytest.mark.parametrize("name", list_profiles())
def test_cli_show(capsys, name):
    assert main(["profiles", "show", name]) == 0
    out = capsys.readouterr().out
    assert name in out and "idle TTFT" in out and "prompt  2048" in out
    assert "decode iteration" in out
    assert main(["profiles", "show", name, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == name


def test_cli_show_path_and_errors(capsys, tmp_path):
    path = tmp_path / "mine.json"
    path.write_text((DATA / "linear.json").read_text())
    assert main(["profiles", "show", str(path)]) == 0
    capsys.readouterr()
    assert main(["profiles", "show", "no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile" in err and "llama3-8b-h100" in err and "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["profiles", "show", str(bad)]) == 2


def test_cli_fit_check(capsys, tmp_path):
    csv = str(samples_csv())
    assert main(["profiles", "fit", "--samples", csv, "--check"]) == 0
    assert "identical" in capsys.readouterr().out
    (tmp_path / f"{fit.FITTED_NAME}.json").write_text("{}")
    assert main(["profiles", "fit", "--samples", csv, "--check", "--out", str(tmp_path)]) == 1
    assert main(["profiles", "fit", "--samples", csv, "--compare-weighting"]) == 0
    out = capsys.readouterr().out
    assert "shipped" in out and "nothing written" in out
