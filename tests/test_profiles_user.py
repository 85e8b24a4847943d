"""Profiles for a user's deployment: ``b_max``, the long-context ``llama31-8b-h100``, its sensitivity
variants, and ``tokenbatch profiles fit --samples FILE.csv --name N`` (docs/design.md section 3,
"A profile for your deployment")."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import pytest

from conftest import shared_path
from tokenbatch_env.cli import main
from tokenbatch_env.engine import fit
from tokenbatch_env.engine.cost_model import TERMS, CostModel
from tokenbatch_env.engine.profiles import (MAX_MAPE_PCT, PROVENANCES, SENSITIVITY_FACTORS, SENSITIVITY_TERMS,
                                            Profile, list_profiles, load_profile, sensitivity_profiles)
from tokenbatch_env.errors import ProfileError

DATA = resources.files("tokenbatch_env") / "data" / "profiles"
HEADER = ",".join(fit.SAMPLES_COLUMNS)
TRUE = CostModel(c0=6.0, c_prefill=0.04, c_c2=2e-6, c_attn=1e-6, c_decode=0.07, c_kv=2e-4)


# ------------------------------------------------------------------------------------------ b_max
@pytest.mark.parametrize("name", list_profiles())
def test_shipped_profile_dicts_unchanged_and_without_b_max(name):
    """A profile's dict enters evidence ids: a shipped one's must be its file's content, keys in
    the dataclass's order as before b_max existed, with no b_max key (None is left out)."""
    p = load_profile(name)
    raw = json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))
    assert "b_max" not in raw and "b_max" not in p.to_dict()
    assert p.b_max is None and p.budget_max == p.max_num_batched_tokens
    assert p.to_dict() == raw
    assert list(p.to_dict()) == [f.name for f in dataclasses.fields(Profile) if f.name != "b_max"]


def test_b_max_round_trips_beside_the_budget(tmp_path):
    base = load_profile("linear")
    p = dataclasses.replace(base, name="wide", b_max=8192)
    assert p.budget_max == 8192 and p.max_num_batched_tokens == 2048
    d = p.to_dict()
    keys = list(d)
    assert keys[keys.index("max_num_batched_tokens") + 1] == "b_max" and d["b_max"] == 8192
    assert Profile.from_dict(d) == p
    path = tmp_path / "wide.json"
    path.write_text(fit.profile_json(p), encoding="utf-8")
    assert load_profile(str(path)) == p
    assert {k: v for k, v in d.items() if k != "b_max"} == dataclasses.replace(base, name="wide").to_dict()
    assert dataclasses.replace(base, b_max=2048).budget_max == 2048   # equal to B is allowed


@pytest.mark.parametrize("bad", [1024, 2047, 4096.0, "4096", True])
def test_b_max_below_the_budget_or_not_an_integer_is_one_clear_error(bad, tmp_path):
    with pytest.raises(ProfileError, match=r"^profile 'linear': b_max must be an integer >= "
                                           r"max_num_batched_tokens \(2048\), got") as ei:
        dataclasses.replace(load_profile("linear"), b_max=bad)
    assert "\n" not in str(ei.value)
    raw = json.loads((DATA / "linear.json").read_text(encoding="utf-8"))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**raw, "b_max": bad}))
    with pytest.raises(ProfileError, match=f"^{path}: profile 'linear': b_max must be"):
        load_profile(str(path))


# ----------------------------------------------------------------------------- llama31-8b-h100
def test_long_context_profile_is_llama3_with_a_131k_context():
    long, base = load_profile(fit.LONG_NAME), load_profile(fit.DERIVED_NAME)
    assert fit.LONG_NAME in list_profiles()
    assert long.cost == base.cost and long.provenance == "derived" and long.mape_pct is None
    assert long.max_model_len_limit == 131072 == fit.LLAMA31_CONTEXT
    same = {f.name for f in dataclasses.fields(Profile)} - {"name", "description", "source",
                                                             "max_model_len_limit"}
    assert all(getattr(long, f) == getattr(base, f) for f in same)
    # the pool does not bind: max_model_len is the model's own limit
    assert long.num_blocks == fit.h100_num_blocks() == 29000
    assert long.usable_blocks * long.block_size == 463984 and long.max_model_len == 131072
    d = long.description
    assert d.startswith("DERIVED") and "fitted on contexts <= 4k" in d and "extrapolated ~32x" in d
    assert "max_model_len = min(131,072, 463,984) = 131,072" in d and "8,192 blocks" in d
    full = long.source["full_context"]
    assert full["max_model_len"] == 131072 and full["blocks_per_request"] == 8192
    ttft = int(long.cost.idle_prefill_ns([131071], long.max_num_batched_tokens)[0])
    assert full["idle_ttft_ms_prompt_131071"] == round(ttft / 1e6, 3)
    assert f"{ttft / 1e9:.2f} s" in d


def test_long_context_profile_cites_its_fitting_contexts():
    samples = fit.load_samples(shared_path("calibration", fit.SAMPLES_NAME))
    fc = fit.fit_contexts(samples)
    assert load_profile(fit.LONG_NAME).source["fit_contexts"] == fc
    assert fc["prefill_mean_computed_before_max"] <= fit.FIT_CONTEXT      # the "<= 4k" of the text
    assert fc["decode_batches_mean_context_above_4096"] < 0.01 * fc["decode_batches"]


def test_cli_list_and_show_long_context_profile(capsys):
    assert main(["profiles", "list"]) == 0
    assert fit.LONG_NAME in capsys.readouterr().out
    assert main(["profiles", "show", fit.LONG_NAME]) == 0
    out = capsys.readouterr().out
    assert "max_model_len: 131072" in out and "b_max: 8192" in out and "extrapolated ~32x" in out


def test_sensitivity_profiles():
    base = load_profile(fit.LONG_NAME)
    got = sensitivity_profiles(base)
    assert [label for label, _ in got] == ["c_attn x0.5", "c_attn x2", "c_kv x0.5", "c_kv x2"]
    assert len(got) == len(SENSITIVITY_TERMS) * len(SENSITIVITY_FACTORS)
    for (label, p), (term, factor) in zip(got, [(t, f) for t in SENSITIVITY_TERMS for f in SENSITIVITY_FACTORS]):
        assert p.name == f"{fit.LONG_NAME} {label}"
        assert getattr(p.cost, term) == getattr(base.cost, term) * factor
        assert all(getattr(p.cost, t) == getattr(base.cost, t) for t in TERMS if t != term)
        assert (p.provenance, p.mape_pct, p.source["base_profile"]) == ("derived", None, base.name)
        assert p.max_model_len == base.max_model_len and p.num_blocks == base.num_blocks
    # a fitted base: the variants no longer carry its fit error
    fitted = sensitivity_profiles(load_profile("llama2-7b-a100"))
    assert all(p.mape_pct is None and p.provenance == "derived" for _, p in fitted)
    # and they change what the engine prices: a long prompt's idle TTFT moves with c_attn
    ttft = {label: int(p.cost.idle_prefill_ns([100_000], 8192)[0]) for label, p in got}
    t0 = int(base.cost.idle_prefill_ns([100_000], 8192)[0])
    assert ttft["c_attn x0.5"] < t0 < ttft["c_attn x2"]


# ------------------------------------------------------------------------------ user samples
def write_samples(path, n=120, *, seed=3, cost=TRUE, noise=0.0, drop=(), extra_col=False):
    """``n`` iterations of all three kinds timed by ``cost`` (times multiplied by 1 + noise x U(-1, 1))."""
    rng = np.random.default_rng(seed)
    lines = [HEADER + (",note" if extra_col else "")]
    for i in range(n):
        kind = i % 3
        chunks = [int(c) for c in rng.integers(16, 900, size=rng.integers(1, 3))] if kind != 1 else []
        before = [int(b) for b in rng.integers(0, 3000, size=len(chunks))]
        ctx = [int(c) for c in rng.integers(50, 4000, size=rng.integers(1, 40))] if kind != 0 else []
        P, D, K = sum(chunks), len(ctx), sum(ctx)
        c2, kv = sum(c * c for c in chunks), sum(c * b for c, b in zip(chunks, before))
        t = int(cost.iteration_ns(P, c2, kv, D, K)) / 1e6 * (1 + noise * rng.uniform(-1, 1))
        row = {"kind": kind, "P": P, "D": D, "K": K, "sum_c2": c2, "sum_kv_c": kv, "t_ms": t}
        for c in drop:
            row[c] = 0
        lines.append(",".join(str(row[c]) for c in fit.SAMPLES_COLUMNS) + (",x" if extra_col else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


USER_ARGS = ["--num-blocks", "4000", "--max-model-len", "8192"]


def test_user_fit_recovers_the_model_and_writes_a_loadable_profile(tmp_path, capsys):
    samples = write_samples(tmp_path / "steps.csv")
    out = tmp_path / "profiles"
    assert main(["profiles", "fit", "--samples", str(samples), "--name", "my-gpu", *USER_ARGS,
                 "--max-num-batched-tokens", "4096", "--b-max", "16384", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "my-gpu (fitted (user))" in printed and "prefill" in printed and "decode" in printed
    assert "mixed" in printed and f"wrote {out / 'my-gpu.json'}" in printed
    p = load_profile(str(out / "my-gpu.json"))
    assert p.provenance == "fitted (user)" in PROVENANCES
    assert set(p.mape_pct) == {"prefill", "decode", "mixed"} and max(p.mape_pct.values()) < 0.01
    for t in TERMS:
        assert getattr(p.cost, t) == pytest.approx(getattr(TRUE, t), rel=1e-4)
    assert (p.num_blocks, p.max_model_len_limit, p.max_num_batched_tokens, p.b_max) == (4000, 8192, 4096, 16384)
    assert (p.block_size, p.max_num_seqs) == (fit.USER_DEFAULTS["block_size"], fit.USER_DEFAULTS["max_num_seqs"])
    assert p.watermark_blocks == 40 and p.async_scheduling
    assert p.source["samples"] == "steps.csv" and len(p.source["samples_sha256"]) == 64
    assert p.source["rows"] == 120 and "--num-blocks 4000" in p.source["command"]
    assert not [f for f in out.iterdir() if f.name.startswith(".")]   # written atomically: no temp file
    assert main(["profiles", "show", str(out / "my-gpu.json")]) == 0
    assert "fitted (user)" in capsys.readouterr().out


def test_user_fit_out_file_default_path_and_flags(tmp_path, monkeypatch, capsys):
    samples = write_samples(tmp_path / "steps.csv", extra_col=True)   # an extra column is ignored
    target = tmp_path / "sub" / "exact.json"
    assert main(["profiles", "fit", "--samples", str(samples), "--name", "a", *USER_ARGS, "--block-size", "32",
                 "--max-num-seqs", "64", "--watermark-blocks", "7", "--no-async-scheduling",
                 "--description", "my box", "--out", str(target)]) == 0
    p = load_profile(str(target))
    assert (p.name, p.block_size, p.max_num_seqs, p.watermark_blocks, p.async_scheduling, p.description) == \
        ("a", 32, 64, 7, False, "my box")
    assert p.b_max is None and "b_max" not in json.loads(target.read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["profiles", "fit", "--samples", str(samples), "--name", "here", *USER_ARGS]) == 0
    assert load_profile(str(tmp_path / "here.json")).name == "here"
    capsys.readouterr()


def test_user_fit_of_the_calibration_samples_is_the_shipped_fit():
    """The user's format is the calibration file's: fitting it as a user gives llama2-7b-a100's costs."""
    csv = shared_path("calibration", fit.SAMPLES_NAME)
    p = fit.user_profile(csv, "my-a100", num_blocks=7424, max_model_len=4096)
    shipped = load_profile(fit.FITTED_NAME)
    assert p.cost == shipped.cost and p.mape_pct == shipped.mape_pct
    s = fit.read_samples(csv)
    ref = fit.load_samples(csv)
    assert all((s[c] == ref[c]).all() for c in fit.SAMPLES_COLUMNS)


def test_user_fit_notes_terms_without_data(tmp_path, capsys):
    samples = write_samples(tmp_path / "s.csv", cost=dataclasses.replace(TRUE, c_attn=0.0), drop=("sum_kv_c",))
    assert main(["profiles", "fit", "--samples", str(samples), "--name", "n", *USER_ARGS,
                 "--out", str(tmp_path)]) == 0
    assert "note: no row exercises c_attn" in capsys.readouterr().out
    p = load_profile(str(tmp_path / "n.json"))
    assert p.cost.c_attn == 0.0 and p.source["terms_without_data"] == ["c_attn"]


def _bad(tmp_path, text):
    path = tmp_path / "bad.csv"
    good = write_samples(tmp_path / "good.csv").read_text().splitlines()
    path.write_text(text(good) if callable(text) else text)
    return path


@pytest.mark.parametrize("text,where", [
    ("", "empty file"),
    ("kind,P,D,K,sum_c2,t_ms\n" + "0,1,0,0,1,3.0\n" * 30, "row 1: missing column(s) sum_kv_c"),
    (lambda g: "\n".join(g[:5] + ["0,abc,0,0,1,0,3.0"] + g[5:]), "row 6, column 'P': not a number: 'abc'"),
    (lambda g: "\n".join(g[:9] + ["0,10,0,0,100,0,nan"] + g[9:]), "row 10, column 't_ms': not a finite number"),
    (lambda g: "\n".join(g[:3] + ["0,10,0,0,100,0,0"] + g[3:]), "row 4, column 't_ms': must be > 0"),
    (lambda g: "\n".join(g[:3] + ["0,10,0,-5,100,0,2"] + g[3:]), "row 4, column 'K': must be a non-negative integer"),
    (lambda g: "\n".join(g[:3] + ["0,10.5,0,0,100,0,2"] + g[3:]), "row 4, column 'P': must be a non-negative"),
    (lambda g: "\n".join(g[:3] + ["7,10,0,0,100,0,2"] + g[3:]), "row 4, column 'kind': must be 0 (prefill)"),
    (lambda g: "\n".join(g[:3] + ["0,0,0,0,0,0,2"] + g[3:]), "row 4, columns 'P' and 'D': both 0"),
    (lambda g: "\n".join(g[:3] + ["0,10,0,0,100,2"] + g[3:]), "row 4: 6 fields, header has 7"),
    (lambda g: "\n".join(g[:11]), "10 data row(s); a fit needs at least 24"),
    (lambda g: "\n".join([g[0]] + [r for r in g[1:] if r.startswith("1,")]), "column 'P': 0 in every row"),
])
def test_bad_samples_are_one_line_naming_file_row_column(tmp_path, capsys, text, where):
    path = _bad(tmp_path, text)
    out = tmp_path / "out"
    assert main(["profiles", "fit", "--samples", str(path), "--name", "x", *USER_ARGS, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"tokenbatch: error: {path}: " in err and where in err
    assert not out.exists()


def test_decode_only_samples_rejected_prefill_only_too(tmp_path):
    good = write_samples(tmp_path / "g.csv").read_text().splitlines()
    path = tmp_path / "prefill-only.csv"
    path.write_text("\n".join([good[0]] + [r for r in good[1:] if r.startswith("0,")]))
    with pytest.raises(ProfileError, match=r"prefill-only\.csv: column 'D': 0 in every row, so c_decode"):
        fit.user_profile(path, "x", num_blocks=100, max_model_len=1024)


def test_user_fit_above_the_error_gate_is_rejected(tmp_path, capsys):
    samples = write_samples(tmp_path / "noisy.csv", noise=0.6)
    s = fit.read_samples(samples)
    assert max(fit.mape_by_kind(fit.fit_cost_model(s), s).values()) > MAX_MAPE_PCT
    assert main(["profiles", "fit", "--samples", str(samples), "--name", "x", *USER_ARGS,
                 "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"fit of {samples} rejected" in err and "exceeds 10%" in err
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("argv,msg", [
    (["--name", "x", *USER_ARGS], "--name needs --samples"),
    (["--samples", "{s}", "--name", "x", "--max-model-len", "8192"], "--num-blocks is required"),
    (["--samples", "{s}", "--name", "x", "--num-blocks", "100"], "--max-model-len is required"),
    (["--samples", "{s}", "--num-blocks", "100"], "--num-blocks is for a fit of your own samples"),
    (["--samples", "{s}", "--name", "llama3-8b-h100", *USER_ARGS], "is a shipped profile's name"),
    (["--samples", "{s}", "--name", "../x", *USER_ARGS], "use letters, digits"),
    (["--samples", "{s}", "--name", "x", *USER_ARGS, "--check"], "--check is for the shipped"),
    (["--samples", "{s}", "--name", "x", "--num-blocks", "100", "--max-model-len", "8192",
      "--b-max", "100"], "b_max must be an integer >= max_num_batched_tokens"),
    (["--samples", "{s}", "--name", "x", "--num-blocks", "1", "--max-model-len", "8192"], "num_blocks must be"),
    (["--samples", "{s}", "--name", "x", "--num-blocks", "10", "--max-model-len", "8192"],
     "--max-model-len 8192 exceeds the KV pool: 9 usable blocks x 16 tokens = 144"),
])
def test_user_fit_flag_errors(tmp_path, capsys, argv, msg):
    s = str(write_samples(tmp_path / "s.csv"))
    assert main(["profiles", "fit", *[a.replace("{s}", s) for a in argv], "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err
    assert not (tmp_path / "o").exists()
