"""The benchmark library (docs/design.md section 6): metric definitions, determinism, evidence id,
atomic reports, and k parameter sets x T traces in one batch."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from tokenbatch_env import evaluate as ev
from tokenbatch_env.engine.kernel import E_COMPLETED, E_SHED, E_TIMED_OUT
from tokenbatch_env.errors import ConfigError, PolicyError
from tokenbatch_env.policies import IndexParams, LinearWeights
from tokenbatch_env.report import report_json, round_sig
from tokenbatch_env.traces.trace import Trace

TINY = dict(max_traces=2, loads=(1.2,), policies=("fcfs", "edf"), bootstrap_b=200, progress=False)


# ------------------------------------------------------------------ metric definitions
def _hand_made():
    """4 requests: met, completed-but-late, shed (never scheduled), timed out after scheduling."""
    ms = 1_000_000
    trace = Trace.build(arrival_ns=[0, 10 * ms, 20 * ms, 30 * ms], prompt_tokens=[16, 100, 40, 400],
                        output_tokens=[3, 2, 5, 1], ttft_slo_ns=[50 * ms] * 4, tpot_slo_ns=[10 * ms] * 4,
                        class_id=[0, 1, 0, 1], prefix_offsets=[0, 0, 1, 1, 1], prefix_hashes=[7])
    rec = {
        "arrival_ns": trace.arrival_ns.copy(), "prompt_tokens": trace.prompt_tokens.copy(),
        "output_tokens": trace.output_tokens.copy(),
        "first_scheduled_ns": np.array([5, 20, -1, 100]) * ms,
        "first_token_ns": np.array([20, 110, -1, -1]) * ms,
        "finish_ns": np.array([40, 130, -1, -1]) * ms,
        "preemptions": np.array([0, 2, 0, 1]), "recomputed_tokens": np.array([0, 150, 0, 30]),
        "end_state": np.array([E_COMPLETED, E_COMPLETED, E_SHED, E_TIMED_OUT]),
    }
    rec["ttft_ns"] = np.where(rec["first_token_ns"] >= 0, rec["first_token_ns"] - rec["arrival_ns"], -1)
    rec["tpot_ns"] = np.array([10.0, 20.0, 0.0, 0.0]) * ms
    rec["met"] = np.array([True, False, False, False])
    return trace, rec


def test_metric_definitions_on_hand_made_records():
    trace, rec = _hand_made()
    o = ev.request_outcomes(rec, trace)
    u = ev.unit_metrics(o)
    assert u["goodput"] == 0.25 and u["met"] == 1 and u["completed"] == 2 and u["arrived"] == 4
    assert u["shed"] == 1 and u["timed_out"] == 1 and u["preemptions"] == 3 and u["recomputed_tokens"] == 180
    # span: first arrival 0 -> last end 130 ms (never-finished requests end at arrival)
    assert u["span_s"] == pytest.approx(0.13)
    assert u["throughput_tok_s"] == pytest.approx(5 / 0.13)
    assert u["met_req_s"] == pytest.approx(1 / 0.13)
    edges = ev.prompt_quintile_edges(trace.prompt_tokens)
    p = ev.pooled_metrics([o], edges, ["a", "b"])
    # TTFT over all arrived: [20, 100, inf, inf] ms -> p50 = 100 (inverted CDF), p99 = inf
    assert p["ttft_ms"]["p50_all"] == 100 and math.isinf(p["ttft_ms"]["p99_all"])
    assert p["ttft_ms"]["p50_completed"] == 20 and p["ttft_ms"]["p99_completed"] == 100
    assert p["tpot_ms"]["p99_completed"] == 20 and math.isinf(p["tpot_ms"]["p99_all"])
    assert p["e2e_ms"]["p99_completed"] == 120 and p["e2e_ms"]["p50_completed"] == 40
    assert p["sla_respect"] == 0.5
    assert p["goodput_by_class"] == {"a": {"goodput": 0.5, "arrived": 2}, "b": {"goodput": 0.0, "arrived": 2}}
    assert sum(q["arrived"] for q in p["goodput_by_prompt_quintile"]) == 4
    # cache-miss = empty prefix chain: requests 0, 2, 3 -> TTFT [20, inf, inf]
    assert p["cache_miss_requests"] == 3 and math.isinf(p["ttft_p99_cache_miss_ms"])
    # max wait over scheduled requests: max(5, 10, 70) ms; one never scheduled
    assert p["max_wait_ms"] == 70 and p["never_scheduled"] == 1



def test_request_metrics_is_the_outcome_formula_for_any_shape():
    """``request_metrics`` (compiled ``request_outcome``, shared with the env's episode metrics) is
    docs/design.md's formula, here restated in NumPy: ttft = first_token - arrival (-1 without a token), tpot =
    (finish - first_token)/(O-1) (0 if O = 1 or unfinished), met = completed, ttft <= T1, tpot <= T2;
    on 1-D and 2-D columns, ties at the SLOs, and without SLOs."""
    from types import SimpleNamespace

    from tokenbatch_env.engine.kernel import E_NONE
    from tokenbatch_env.engine.outcomes import request_metrics
    rng = np.random.default_rng(0)
    n = 4000
    arr = rng.integers(0, 10**9, n)
    has_tok = rng.random(n) < 0.8
    ft = np.where(has_tok, arr + rng.integers(0, 2 * 10**8, n), -1)
    o = rng.integers(1, 50, n)
    done = has_tok & (rng.random(n) < 0.7)
    t1 = rng.integers(1, 2 * 10**8, n)
    t2 = rng.integers(1, 10**7, n)
    fin = np.where(done, ft + (o - 1) * rng.integers(0, 2 * 10**7, n), -1)
    tie = done & (rng.random(n) < 0.2)   # exactly at both SLOs
    ft[tie] = arr[tie] + t1[tie]
    fin[tie] = ft[tie] + (o[tie] - 1) * t2[tie]
    es = np.where(done, np.where(rng.random(n) < 0.8, E_COMPLETED, E_TIMED_OUT),
                  rng.choice([E_NONE, E_SHED], n))
    rec = {"end_state": es, "first_token_ns": ft, "arrival_ns": arr, "finish_ns": fin, "output_tokens": o}
    ttft = np.where(ft >= 0, ft - arr, -1)
    tpot = np.where((fin >= 0) & (ft >= 0) & (o > 1), (fin - ft) / np.maximum(o - 1, 1), 0.0)
    met = (es == E_COMPLETED) & (ttft <= t1) & (tpot <= t2)
    assert met[tie].any() and (~met).any() and (tpot[tie & (o > 1)] == t2[tie & (o > 1)]).all()
    for shape in ((n,), (40, n // 40)):
        r = {k: v.reshape(shape) for k, v in rec.items()}
        out = request_metrics(r, SimpleNamespace(has_slos=True, ttft_slo_ns=t1.reshape(shape),
                                                 tpot_slo_ns=t2.reshape(shape)))
        assert out["ttft_ns"].dtype == np.int64 and out["tpot_ns"].dtype == np.float64 and out["met"].dtype == bool
        assert np.array_equal(out["ttft_ns"], ttft.reshape(shape))
        assert np.array_equal(out["tpot_ns"], tpot.reshape(shape))
        assert np.array_equal(out["met"], met.reshape(shape))
        none = request_metrics(r, SimpleNamespace(has_slos=False, ttft_slo_ns=None, tpot_slo_ns=None))
        assert none["met"].shape == shape and not none["met"].any()
        assert np.array_equal(none["tpot_ns"], tpot.reshape(shape))


def test_scored_mask_restricts_every_metric():
    trace, rec = _hand_made()
    o = ev.request_outcomes(rec, trace, scored=np.array([True, True, False, False]))
    assert ev.unit_metrics(o)["goodput"] == 0.5 and ev.unit_metrics(o)["shed"] == 0


def test_round_sig_and_nonfinite_json():
    assert round_sig(1.23456789) == 1.23457 and round_sig(123456789.0) == 123457000.0
    assert round_sig(float("inf")) == "inf" and round_sig(float("nan")) is None
    s = report_json({"a": [np.float64(0.1 + 0.2), float("-inf"), np.int64(3), True]})
    assert json.loads(s) == {"a": [0.3, "-inf", 3, True]}


def test_capacity_grid_rule():
    g = np.array([[0.95, 0.95, 0.5], [0.91, 0.85, 0.5], [0.95, 0.95, 0.5]])  # [L, U]
    # unit 0 meets at every load; unit 1 fails at load 1 (even though it meets again at load 2)
    from tokenbatch_env.evaluate.slo_capacity import capacity_grid
    assert capacity_grid(g, [1, 2, 3], 0.9).tolist() == [2, 0, -1]


def test_config_validation():
    with pytest.raises(PolicyError, match="valid"):
        ev.BenchConfig(policies=("fcfs", "nope"))
    with pytest.raises(ConfigError, match="rho"):
        ev.BenchConfig(loads=(0.0,))
    with pytest.raises(ConfigError):
        ev.BenchConfig(loads=(float("nan"),))
    with pytest.raises(ConfigError):
        ev.BenchConfig(gpu_price=1.0)
    with pytest.raises(PolicyError):
        ev.BenchConfig(shed_margins=(("edf", 3.0),))


def test_too_low_load_names_the_load():
    """A load so low that the traces' times, stretched to it, leave the int64 ns range is a
    ConfigError naming that load (not the internal scale factor)."""
    with pytest.raises(ConfigError, match="loads: a load of 1e-12 is too low for seed-200"):
        ev.run_benchmark(ev.BenchConfig(**{**TINY, "loads": (1e-12,)}))


def test_params_file(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"index": {"kappa": 2.0}, "shed_margin": 0.5, "edf": {"shed_margin": 0.25}}))
    params, margins = ev.load_params_file(str(p))
    assert params.kappa == 2.0 and dict(margins) == {"index": 0.5, "edf": 0.25}
    p.write_text('{"shed_margin": null, "edf": {"shed_margin": null}, "sjf": {"shed_margin": "inf"}}')
    assert dict(ev.load_params_file(str(p))[1]) == {"index": math.inf, "edf": math.inf, "sjf": math.inf}
    p.write_text('{"index": {"kappa": NaN}}')
    with pytest.raises(PolicyError):
        ev.load_params_file(str(p))
    p.write_text('{"index": {"kappa": 20}}')
    with pytest.raises(PolicyError, match="range"):
        ev.load_params_file(str(p))
    p.write_text('{"bogus": 1}')
    with pytest.raises(ConfigError, match="valid"):
        ev.load_params_file(str(p))
    p.write_text('{"weights": {"w": {"slack": -1.0}, "shed_margin": 0.75}}')
    params, margins = ev.load_params_file(str(p))
    assert dict(margins) == {"weights": 0.75} and ev.load_weights(str(p)).w[6] == -1.0
    p.write_text('{"edf": {"w": [1, 2]}}')
    with pytest.raises(ConfigError, match="edf"):
        ev.load_params_file(str(p))
    p.write_text('{"weights": {"w": [1, 2]}}')
    with pytest.raises(PolicyError, match="weights.w"):
        ev.load_weights(str(p))
    p.write_text('{"index": {}}')
    assert ev.load_weights(str(p)) is None


def test_rows_always_include_baselines_and_primary():
    rows = [r.label for r in ev.build_rows(ev.BenchConfig(policies=("sjf",)))]
    assert rows == ["fcfs", "sjf", "edf+shed", "index+shed"]
    rows = ev.build_rows(ev.BenchConfig(policies=("fcfs", "srpt-oracle"), shed=True, suite="mooncake-like"))
    assert [r.label for r in rows] == ["fcfs", "fcfs+shed", "srpt-oracle", "srpt-oracle+shed", "edf+shed"]
    assert [r.reference for r in rows] == [False, False, True, True, False]


# ------------------------------------------------------------------ end to end (library)
@pytest.fixture(scope="module")
def tiny_report():
    return ev.run_benchmark(ev.BenchConfig(**TINY))


def test_report_is_deterministic_and_complete(tiny_report, tmp_path):
    again = ev.run_benchmark(ev.BenchConfig(**TINY))
    assert again.to_json() == tiny_report.to_json()
    assert again.to_markdown() == tiny_report.to_markdown()
    d = tiny_report.data
    assert d["primary_endpoint"]["rho"] == 1.2 and "diff" in d["primary_endpoint"]
    labels = [r["label"] for r in d["loads"][0]["rows"]]
    assert labels == ["fcfs", "edf", "edf+shed", "index+shed"]
    row = d["loads"][0]["rows"][1]
    for k in ("goodput", "vs", "ttft_ms", "tpot_ms", "e2e_ms", "sla_respect", "throughput_tok_s", "met_req_s",
              "preemptions", "recomputed_tokens", "shed", "goodput_by_class", "goodput_by_prompt_quintile",
              "ttft_p99_cache_miss_ms", "max_wait_ms", "relative_goodput", "gap_closed"):
        assert k in row, k
    assert set(row["vs"]) == {"fcfs", "edf+shed"}
    assert "upper_bound" in d["loads"][0]
    ub = d["loads"][0]["upper_bound"]["mean"]
    assert all(r["goodput"]["mean"] <= ub + 1e-12 for r in d["loads"][0]["rows"])
    # files: byte-identical JSON on rewrite; meta only in the sidecar
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_report.write(a)
    again.write(b)
    assert (a / "report.json").read_bytes() == (b / "report.json").read_bytes()
    assert (a / "report.md").read_bytes() == (b / "report.md").read_bytes()
    assert "wall_time_s" in json.loads((a / "run_meta.json").read_text())
    assert "wall_time" not in (a / "report.json").read_text()
    assert sorted(p.name for p in a.iterdir()) == ["goodput_vs_load.png", "report.json", "report.md",
                                                    "run_meta.json", "ttft_cdf.png"]


def test_goodput_matches_direct_simulation(tiny_report):
    """The report's per-trace goodput equals a direct simulate of the same scaled traces."""
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.policies import engine_policy
    from tokenbatch_env.predictors import PredictorSpec, estimates
    from tokenbatch_env.traces.suites import load_suite
    from tokenbatch_env.traces.windows import scale_to_rate

    s = load_suite("seed-200")
    base = s.traces("test")[:2]
    lam = tiny_report.data["lambda_sat"]["rps"]
    est = [estimates(t, PredictorSpec.from_dict(s.predictor)) for t in base]
    traces = [scale_to_rate(t, 1.2 * lam, nominal_rps=s.nominal_rate_rps) for t in base]
    res = simulate(traces, "stress-512", engine_policy("edf", shed_margin=0.0), estimates=est)
    g = [res.records(c)["met"].mean() for c in range(2)]
    row = next(r for r in tiny_report.data["loads"][0]["rows"] if r["label"] == "edf+shed")
    assert row["goodput_per_unit"] == pytest.approx(g, rel=1e-5)


def test_manifest_lambda_sat_only_for_the_shipped_profile(tmp_path):
    """The suite manifest's lambda_sat is the shipped profile's: a profile under that name with other
    fields (a file reusing the name, or engine overrides) has its saturation rate measured."""
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.engine.state import EngineConfig
    from tokenbatch_env.workload import is_shipped
    cfg = ev.BenchConfig(**TINY)
    shipped = load_profile(cfg.profile)
    wl = ev.prepare_workload(cfg, shipped)
    assert wl.lambda_sat_source == f"suite manifest ({cfg.profile})"
    smaller = EngineConfig(num_blocks=128).resolve(shipped)
    f = tmp_path / "mine.json"
    f.write_text(json.dumps(smaller.to_dict()))
    mine = load_profile(str(f))
    assert mine.name == cfg.profile and not is_shipped(mine) and is_shipped(load_profile(cfg.profile))
    wl2 = ev.prepare_workload(cfg, mine)
    assert "measured" in wl2.lambda_sat_source and "differs from it" in wl2.lambda_sat_source
    assert wl2.lambda_sat < 0.6 * wl.lambda_sat   # a quarter of the KV blocks: a lower saturation rate


def _inputs(cfg):
    from tokenbatch_env.engine.profiles import load_profile
    prof = cfg.engine.resolve(load_profile(cfg.profile))
    wl = ev.prepare_workload(cfg, prof)
    return ev.evidence_id(ev.evidence_inputs(cfg, wl, prof, ev.build_rows(cfg)))


def test_evidence_id_changes_with_every_input():
    from tokenbatch_env.engine.state import EngineConfig
    base = ev.BenchConfig(**TINY)
    eid = _inputs(base)
    assert eid == _inputs(ev.BenchConfig(**TINY))
    variants = [
        dict(max_traces=1), dict(loads=(1.0,)), dict(bootstrap_seed=1), dict(bootstrap_b=300),
        dict(profile="linear"), dict(engine=EngineConfig(prefix_caching=False)),
        dict(index_params=IndexParams(kappa=2.0)), dict(shed_margins=(("edf", 0.5),)),
        dict(policies=("fcfs", "sjf")), dict(shed=True), dict(split="validation"), dict(capacity=True),
    ]
    with_w = dataclasses.replace(base, policies=("fcfs", "weights"))
    assert _inputs(with_w) != _inputs(dataclasses.replace(with_w, weights=LinearWeights({"z": -1.0})))
    seen = {eid}
    for v in variants:
        e = _inputs(dataclasses.replace(base, **v))
        assert e not in seen, v
        seen.add(e)


def test_exception_leaves_no_partial_output(tiny_report, tmp_path, monkeypatch):
    from tokenbatch_env import report as rp

    out = tmp_path / "fresh"

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(rp, "report_json", boom)   # fails after the PNGs and the MD are built
    with pytest.raises(KeyboardInterrupt):
        tiny_report.write(out)
    assert not out.exists()
    # an existing directory keeps its old report untouched
    old = tmp_path / "old"
    old.mkdir()
    (old / "report.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        tiny_report.write(old)
    assert sorted(p.name for p in old.iterdir()) == ["report.json"]
    assert (old / "report.json").read_text() == "old"


def test_a_directory_in_a_report_file_place_is_refused_before_any_file_moves(tiny_report, tmp_path):
    """No mixed set of old and new report files: the check comes before the first move."""
    from tokenbatch_env.errors import OutputError
    old = tmp_path / "old"
    old.mkdir()
    (old / "report.json").write_text("old")
    (old / "report.md").mkdir()
    with pytest.raises(OutputError, match="report file .*/report.md: cannot write: a directory is in the way"):
        tiny_report.write(old)
    assert sorted(p.name for p in old.iterdir()) == ["report.json", "report.md"]
    assert (old / "report.json").read_text() == "old"



def test_a_full_disk_is_an_output_error_and_leaves_nothing(tmp_path):
    """A write that fails for lack of space (or quota, or an I/O error) raises ``OutputError`` naming
    the target, not the OSError's traceback, and leaves neither the target nor a temporary file;
    other errors pass through as they are."""
    import errno
    import os

    from tokenbatch_env import _io
    from tokenbatch_env.errors import OutputError

    def full(tmp):
        tmp.write_text("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    target = tmp_path / "out.csv"
    with pytest.raises(OutputError, match=f"{target}: cannot write: No space left on device"):
        _io.write_with(target, full)
    assert list(tmp_path.iterdir()) == []

    def other(tmp):
        raise OSError(errno.EACCES, "denied")
    with pytest.raises(PermissionError):
        _io.write_with(target, other)
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_syncs_the_file_before_its_name_and_the_directory_after(tmp_path, monkeypatch):
    """``_io.atomic_path``: the temporary file's bytes are flushed to the disk before it is renamed over
    the target, and the directory's entry after (an OS crash then leaves the old file or the complete
    new one); a failed write removes its temporary file and syncs nothing."""
    import os

    from tokenbatch_env import _io
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.realpath(b)))
        real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "out" / "report.json"
    _io.write_text_atomic(target, "new\n")
    assert target.read_text() == "new\n"
    (kind0, tmp), rest = events[0], events[1:]
    assert kind0 == "fsync" and os.path.basename(tmp).startswith(".report.json.") and tmp.endswith(".tmp")
    assert rest == [("replace", str(target.resolve())), ("fsync", str(target.parent.resolve()))]
    events.clear()
    with pytest.raises(RuntimeError):
        with _io.atomic_path(target) as t:
            t.write_text("partial")
            raise RuntimeError
    assert events == [] and target.read_text() == "new\n" and sorted(os.listdir(target.parent)) == ["report.json"]


def test_one_unit_reports_warn_that_their_cis_have_zero_width():
    """The CIs resample the independent units: with one trace (or window) they have zero width, which
    the report and the console summary say rather than print [x, x] as a 95% CI."""
    r = ev.run_benchmark(ev.BenchConfig(**{**TINY, "max_traces": 1}))
    note = "only one trace or window: every 95% CI below has zero width"
    assert any(n.startswith(note) for n in r.data["workload"]["notes"])
    assert f"note: {note}" in r.summary_text() and f"- note: {note}" in r.to_markdown()
    r2 = ev.run_benchmark(ev.BenchConfig(**{**TINY, "max_traces": 2}))
    assert not any(n.startswith(note) for n in r2.data["workload"]["notes"])
    assert any(n.startswith("only 2 traces or windows: the 95% CIs") for n in r2.data["workload"]["notes"])
    r5 = ev.run_benchmark(ev.BenchConfig(**{**TINY, "max_traces": 5}))
    assert not any(n.startswith("only ") for n in r5.data["workload"]["notes"])


def test_unwritable_outputs_are_one_line_errors_naming_the_path(tmp_path):
    """An output path that cannot be written is an ``OutputError`` (a ``TokenBatchError``: one line,
    exit 2) naming it, from the atomic writer and, before any long work, from ``check_writable``,
    which creates nothing; no temporary file is left."""
    import os

    from tokenbatch_env import _io
    from tokenbatch_env.errors import OutputError, TokenBatchError
    a_file = tmp_path / "f"
    a_file.write_text("x")
    a_dir = tmp_path / "d"
    a_dir.mkdir()
    with pytest.raises(OutputError, match=r"/d: cannot write: Is a directory"):
        _io.write_text_atomic(a_dir, "new")
    with pytest.raises(OutputError, match=r"/f/r\.csv: cannot write: "):
        _io.write_text_atomic(a_file / "r.csv", "new")
    assert sorted(os.listdir(tmp_path)) == ["d", "f"] and os.listdir(a_dir) == []
    cases = [((a_dir, "--records"), {}, "--records .*/d: cannot write: a directory is in the way"),
             ((a_file, "--out"), {"directory": True}, "--out .*/f: cannot write: a file is in the way"),
             ((a_file / "x" / "r.csv", "OUT"), {}, f"OUT .*/f/x/r.csv: cannot write: {a_file} is not a directory")]
    for args, kw, msg in cases:
        with pytest.raises(OutputError, match=msg) as e:
            _io.check_writable(*args, **kw)
        assert isinstance(e.value, TokenBatchError)
    _io.check_writable(tmp_path / "new" / "deeper", "--out", directory=True)
    _io.check_writable(a_file, "--records")   # (an existing file is replaced)
    assert sorted(os.listdir(tmp_path)) == ["d", "f"]
    long_name = tmp_path / ("a" * 250)        # the writer's temporary name would be too long
    with pytest.raises(OutputError, match="cannot write: File name too long"):
        _io.check_writable(long_name, "--records")
    with pytest.raises(OutputError, match=f"cannot write: {a_file} is not a directory"):
        _io.write_text_atomic(a_file / "r.csv", "new")


def test_check_writable_turns_an_unenterable_parent_into_one_line(tmp_path, monkeypatch):
    """As a normal user, ``Path.exists`` under a directory one may not enter raises PermissionError
    (this machine runs as root, which bypasses permissions: simulated)."""
    from pathlib import Path

    from tokenbatch_env import _io
    from tokenbatch_env.errors import OutputError
    real = Path.exists

    def exists(self, *a, **k):
        if "locked" in self.parts:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "exists", exists)
    for kw in ({}, {"directory": True}):
        with pytest.raises(OutputError, match="--out .*/locked/sub/x: cannot write: Permission denied"):
            _io.check_writable(tmp_path / "locked" / "sub" / "x", "--out", **kw)


def test_cli_output_errors_come_before_the_work(tmp_path, capsys):
    """``tokenbatch simulate``/``bench``/``traces convert`` refuse an unwritable output at once, in one
    line with exit 2 (before: a traceback, after the whole run for ``bench``)."""
    from tokenbatch_env.cli import main
    from tokenbatch_env.traces.io import save_npz
    from tokenbatch_env.traces.suites import load_suite
    trace = tmp_path / "t.npz"
    save_npz(load_suite("seed-200").traces("test")[0], trace)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for argv, msg in ((["simulate", "--trace", str(trace), "--records", str(tmp_path)], "a directory is in the way"),
                      (["bench", "--trace", str(trace), "--windows", "16", "--loads", "1.2", "--out", str(a_file)],
                       "a file is in the way"),
                      (["traces", "convert", str(trace), str(a_file / "t.csv")], "is not a directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tokenbatch: error: ") and msg in err and err.count("\n") == 1, err


# ------------------------------------------------------------------ k parameter sets in one batch
def test_index_params_batch_equals_separate_runs():
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.policies import engine_policy
    from tokenbatch_env.predictors import PredictorSpec, estimates
    from tokenbatch_env.traces.suites import load_suite
    from tokenbatch_env.traces.windows import scale_to_rate

    s = load_suite("seed-200")
    base = s.traces("train")[:3]
    traces = [scale_to_rate(t, 3.0, nominal_rps=s.nominal_rate_rps) for t in base]
    est = [estimates(t, PredictorSpec()) for t in base]
    sets = [IndexParams(), IndexParams(kappa=0.0, gamma=100.0), IndexParams(a_edf=3.0, beta=10.0)]
    margins = [None, 0.0, 0.5]
    t_ref = s.t_ref_ns / 1e6
    G = ev.evaluate_index_params(traces, "stress-512", sets, shed_margins=margins, estimates=est, t_ref_ms=t_ref)
    assert G.shape == (3, 3)
    for j, (p, m) in enumerate(zip(sets, margins)):
        res = simulate(traces, "stress-512", engine_policy("index", params=p, shed_margin=m, t_ref_ms=t_ref),
                       estimates=est)
        assert G[j].tolist() == [res.records(c)["met"].mean() for c in range(3)]
    assert len({tuple(r) for r in G.tolist()}) > 1   # the parameter sets do differ


def test_pct_equals_numpy_inverted_cdf():
    """``pct``/``pcts`` select the element np.percentile(method="inverted_cdf") selects, to the bit."""
    rng = np.random.default_rng(0)
    for t in range(3000):
        n = int(rng.integers(1, 300))
        x = rng.normal(size=n)
        if t % 3 == 0:
            x[rng.random(n) < 0.2] = np.inf
        if t % 5 == 0:
            x = np.round(x, 1)
        if t % 11 == 0:
            x[rng.integers(n)] = np.nan
        if t % 13 == 0:
            x[rng.random(n) < 0.5] = 0.0
            x[rng.random(n) < 0.3] = -0.0
        qs = [0, 1, 25, 50, 75, 99, 100, float(rng.uniform(0, 100))]
        got = ev.pcts(x, qs)
        for q, g in zip(qs, got):
            want = float(np.percentile(x, q, method="inverted_cdf"))
            assert np.float64(g).tobytes() == np.float64(want).tobytes(), (n, q)
            assert np.float64(ev.pct(x, q)).tobytes() == np.float64(want).tobytes()
    assert math.isnan(ev.pct([], 50)) and ev.pct([3.0], np.float32(50)) == 3.0
    with pytest.raises(ValueError):
        ev.pct([1.0, 2.0], 101)
