"""Tuning on a trace file (docs/design.md section 10): time-ordered 60/20/20 windows, every row tuned
on train, its best kept on validation, judged once on test at the trace's native load; the
parameters file records what was fitted to the train part; readers of every format."""

from __future__ import annotations

import json

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from tokenbatch_env import tuning as T  # noqa: E402
from tokenbatch_env.errors import ConfigError  # noqa: E402
from tokenbatch_env.traces.io import save_npz  # noqa: E402
from tokenbatch_env.traces.suites import load_suite  # noqa: E402
from tokenbatch_env.traces.trace import Trace  # noqa: E402


def _trace(tmp_path, n=1500):
    """seed-200 train traces end to end: one long trace with SLOs (canonical NPZ)."""
    parts, t0 = [], 0
    for t in load_suite("seed-200").traces("train"):
        parts.append(t.arrival_ns + t0)
        t0 += int(t.arrival_ns[-1]) + 1
        if sum(len(p) for p in parts) >= n:
            break
    src = load_suite("seed-200").traces("train")[:len(parts)]
    cat = lambda k: np.concatenate([getattr(t, k) for t in src])[:n]  # noqa: E731
    tr = Trace.build(arrival_ns=np.concatenate(parts)[:n], prompt_tokens=cat("prompt_tokens"),
                     output_tokens=cat("output_tokens"), ttft_slo_ns=cat("ttft_slo_ns"),
                     tpot_slo_ns=cat("tpot_slo_ns"), priority=cat("priority"), name="mine")
    path = tmp_path / "mine.npz"
    save_npz(tr, path)
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune-trace")
    path = _trace(tmp)
    out = tmp / "out"
    cfg = T.TuneConfig(trace=str(path), windows=40, warmup=10, cooldown=10, trials=3, k=3, baselines=("edf",),
                       val_top=2, bootstrap_b=200, out=str(out), progress=False)
    T.run_tuning(cfg)
    return cfg, out


def test_rows_are_tuned_on_train_kept_on_validation_judged_on_test(tuned):
    cfg, out = tuned
    rep = json.loads((out / "report.json").read_text())
    doc = json.loads((out / "best_params.json").read_text())
    assert cfg.loads == ("native",) and not cfg.comparators
    for row in ("index+shed", "edf+shed"):
        s = rep["studies"][row]
        cands = s["validation"]["candidates"]
        # kept: the best warm start, unless a candidate beats it on validation with a CI above 0
        warm = max((c for c in cands if c["named_member"]), key=lambda c: c["validation_goodput"])
        better = [c for c in cands if c.get("vs_best_warm_start", {}).get("ci95", [0])[0] > 0]
        want = max(better, key=lambda c: c["validation_goodput"]) if better else warm
        assert s["best"]["number"] == want["number"]
        assert all("vs_best_warm_start" in c for c in cands if not c["named_member"])
        # the 2 best on train first, then the warm starts not among them (each row's 3 trials are 3 of
        # its warm starts: all replayed)
        top = [c["train_goodput"] for c in cands[:2]]
        assert top == sorted(top, reverse=True) and len(cands) == 3
    test = rep["test"]
    assert test["evidence_inputs"]["workload"]["trace_split"] == "test"
    # the native load: the train part's own rate (rho = its admitted rate / lambda_sat)
    fitted = doc["meta"]["fitted"]
    assert fitted["from"] == "train" and fitted["lambda_sat_rps"] == pytest.approx(test["lambda_sat"]["rps"], rel=1e-5)
    assert doc["meta"]["t_ref_mode"] == "fixed" and test["t_ref_ms"] == pytest.approx(doc["meta"]["t_ref_ms"], rel=1e-5)
    assert doc["tuned"]["trace"].endswith("mine.npz") and doc["tuned"]["selected_on"] == "validation"
    # index+shed against every tuned baseline's +shed row, keyed by label
    ix = next(r for r in test["loads"][0]["rows"] if r["label"] == "index+shed")
    assert {"edf+shed", "fcfs+shed", "sjf+shed", "llf+shed", *T.FLAGS_ROWS} <= set(ix["vs"])
    # each levered row beside itself at the profile's flags (docs/design.md section 11)
    assert ix["profile_flags_row"] == "index+shed (profile flags)"
    assert set(ix["levers"]) == set(doc["levers"]["index+shed"])
    labels = {r["label"] for r in test["loads"][0]["rows"]}
    assert {"index+shed (profile flags)", "edf+shed (profile flags)", "priority", *T.FLAGS_ROWS} <= labels
    assert {"diff", "ci95", "win_rate"} <= set(ix["vs"]["edf+shed"])


def test_native_load_keeps_the_trace_timestamps_exactly(tuned):
    cfg, _ = tuned
    obj = T.TrainObjective(cfg)
    (rho,) = obj.loads
    assert rho == obj.wl.native_rho
    unit = obj.wl.unit_at(0, rho)
    lo, hi, _, _ = obj.wl.windows[0]
    np.testing.assert_array_equal(unit.arrival_ns, obj.wl.parent.arrival_ns[lo:hi])
    fast = T.TuneConfig(trace=cfg.trace, windows=40, warmup=10, cooldown=10, rate_scale=2.0, out=cfg.out)
    u2 = T.TrainObjective(fast).wl.unit_at(0, T.TrainObjective(fast).loads[0])
    np.testing.assert_array_equal(u2.arrival_ns * 2, unit.arrival_ns)   # (times even: exact halves here)


@pytest.mark.parametrize("kw, needle", [
    ({"loads": ("native",)}, "native loads are a trace file's own timestamps"),
    ({"rate_scale": 2.0}, "rate_scale: only with --trace"),
    ({"trace": "nope.csv"}, "trace: file 'nope.csv' not found"),
])
def test_bad_trace_options(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        T.TuneConfig(**kw)


def test_too_few_windows_names_the_largest_w(tmp_path):
    path = _trace(tmp_path, n=600)
    with pytest.raises(ConfigError, match="use --windows"):
        T.TrainObjective(T.TuneConfig(trace=str(path), windows=40, warmup=10, cooldown=10, out=str(tmp_path)))


def test_the_script_takes_the_trace_options(tmp_path):
    """The command line: --trace, --format, --windows, --loads native,RHO, --rate-scale parse and
    round-trip (config_cli)."""
    from tokenbatch_env.config_cli import config_to_argv
    from tokenbatch_env.tune_cli import build_parser, config_from_args
    path = _trace(tmp_path, n=1500)
    args = build_parser().parse_args(["--trace", str(path), "--format", "npz", "--windows", "40", "--warmup", "10",
                                      "--cooldown", "10", "--loads", "native,1.5", "--rate-scale", "0.5"])
    cfg = config_from_args(args)
    assert cfg.loads == ("native", 1.5) and cfg.eval_loads == ("native", 1.5) and cfg.rate_scale == 0.5
    assert config_from_args(build_parser().parse_args(config_to_argv(cfg))) == cfg


@pytest.mark.parametrize("fmt", ["burstgpt", "azure"])
def test_tuning_reads_every_trace_format(tmp_path, fmt):
    """The trace formats tuning takes (docs/design.md section 10): a BurstGPT and an Azure CSV with
    no SLO or priority columns get default-3class's, and tune end to end."""
    rng = np.random.default_rng(3)
    n = 900
    t = np.cumsum(rng.exponential(0.25, n))
    p, o = rng.integers(50, 1500, n), rng.integers(1, 300, n)
    path = tmp_path / f"t.{fmt}.csv"
    if fmt == "burstgpt":
        rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
        rows += [f"{t[i]:.3f},ChatGPT,{p[i]},{o[i]},{p[i] + o[i]},Conversation log" for i in range(n)]
    else:
        import datetime
        t0 = datetime.datetime(2023, 11, 16, 18, 15, 46)
        rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
        rows += [f"{(t0 + datetime.timedelta(seconds=float(t[i]))).isoformat(sep=' ')},{p[i]},{o[i]}"
                 for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    cfg = T.TuneConfig(trace=str(path), trace_format=fmt, windows=30, warmup=10, cooldown=10, trials=2, k=2,
                       baselines=("edf",), val_top=1, bootstrap_b=200, out=str(tmp_path / "out"), progress=False)
    res = T.run_tuning(cfg)
    notes = res["data"]["test"]["workload"]["notes"]
    assert any("default-3class" in x and "the trace has none" in x for x in notes), notes
    assert res["data"]["test"]["workload"]["units"] >= 5


def test_validation_keeps_the_best_warm_start_unless_clearly_beaten():
    """A trial beats the best warm start on validation only with a paired CI above 0: a gain within
    the windows' noise keeps the named member; a gain on every window takes the trial."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import create_trial

    quarter = {"max_num_batched_tokens": 512, "max_num_seqs": 256, "long_prefill_token_threshold": 0}

    def study_of():
        st = optuna.create_study(direction="maximize")
        for i, (val, warm) in enumerate([(0.50, True), (0.49, True), (0.60, False), (0.55, False), (0.7, True)]):
            conf = {"x": i, **({"engine": quarter} if i == 4 else {})}   # 4: the quarter-budget warm start
            st.add_trial(create_trial(params={"x": float(i)}, distributions={"x": FloatDistribution(0, 10)},
                                      value=val, user_attrs={"config": conf, "warm_start": warm}))
        return st

    class FakeValidation:
        cfg = T.TuneConfig(bootstrap_b=500)
        wl = type("W", (), {"block": None, "units": [None] * 8})()

        def __init__(self, table):
            self.table = table

        def units_of(self, row):
            return [None] * self.table.shape[1], None

        def goodput_per_unit(self, row, configs):
            return np.stack([self.table[c["x"]] for c in configs])

    rng = np.random.default_rng(0)
    base = rng.uniform(0.3, 0.7, 8)
    # trial 4, a warm start with levers, is not a named member: its noisy gain does not protect it
    noisy = np.stack([base, base - 0.01, base + rng.normal(0, 0.05, 8) + 0.002, base - 0.02,
                      base + rng.normal(0, 0.05, 8) + 0.004])
    summary = {"row": "edf+shed", "best": None}
    kept = T.keep_best_on_validation(study_of(), summary, FakeValidation(noisy), top=3)
    assert kept["best"]["number"] == 0                     # the best warm start: the gain is noise
    clear = noisy.copy()
    clear[3] = base + 0.03                                 # better on every window
    kept = T.keep_best_on_validation(study_of(), summary, FakeValidation(clear), top=3)
    assert kept["best"]["number"] == 3
    c3 = next(c for c in kept["validation"]["candidates"] if c["number"] == 3)
    assert c3["vs_best_warm_start"]["ci95"][0] > 0 and not c3["warm_start"]
    c4 = next(c for c in kept["validation"]["candidates"] if c["number"] == 4)
    assert c4["warm_start"] and not c4["named_member"] and "vs_best_warm_start" in c4


def test_the_objective_scores_a_windows_requests_only(tuned):
    """On a trace, the tuning objective of a config is the benchmark's goodput of the same row on the
    same windows: the warm-up and cool-down requests around each window are simulated, not scored."""
    from tokenbatch_env import evaluate as ev
    cfg, _ = tuned
    obj = T.TrainObjective(cfg, "test")
    got = obj.goodput_per_unit("edf+shed", [{"shed_margin": 0.5}])[0]
    rep = ev.run_benchmark(ev.BenchConfig(**cfg.workload_kwargs("test"), profile=cfg.profile, policies=("edf",),
                                          shed=True, shed_margins=(("edf", 0.5),), loads=(), native_load=True,
                                          bootstrap_b=200, upper_bound=False))
    row = next(r for r in rep.data["loads"][0]["rows"] if r["label"] == "edf+shed")
    assert row["goodput_per_unit"] == pytest.approx(got.tolist(), rel=1e-12)
    unscored = [(~m).sum() for m in obj.scored]
    assert min(unscored) > 0   # (else the test could not tell)
