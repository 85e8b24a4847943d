"""`tokenbatch bench` end to end on a tiny budget, and bad input (one line, exit 2)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokenbatch_env import cli


@pytest.fixture(autouse=True)
def _bench_registered(monkeypatch):
    # until cli.COMMANDS carries "bench" itself
    monkeypatch.setitem(cli.COMMANDS, "bench", ("tokenbatch_env.bench_cli", "benchmark policies"))


def _run(capsys, *argv):
    rc = cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_end_to_end_tiny(tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, _ = _run(capsys, "--max-traces", "3", "--loads", "1.2", "--policies", "fcfs,edf", "--shed",
                         "--out", str(out), "--bootstrap-b", "500", "--quiet")
    assert rc == 0 and stdout == ""
    names = sorted(p.name for p in out.iterdir())
    assert names == ["goodput_vs_load.png", "report.json", "report.md", "run_meta.json", "ttft_cdf.png"]
    d = json.loads((out / "report.json").read_text())
    assert len(d["evidence_id"]) == 64
    assert d["primary_endpoint"]["rho"] == 1.2 and "diff" in d["primary_endpoint"]
    assert [r["label"] for r in d["loads"][0]["rows"]] == ["fcfs", "fcfs+shed", "edf", "edf+shed", "index+shed",
                                                           "index+shed+tpot-guard"]
    md = (out / "report.md").read_text()
    assert "## Primary endpoint" in md and "## Leaderboard at rho 1.2" in md
    assert (out / "goodput_vs_load.png").read_bytes()[:4] == b"\x89PNG"
    first = (out / "report.json").read_bytes()
    # rerun into the same directory: byte-identical report, primary endpoint printed first
    rc, stdout, _ = _run(capsys, "--max-traces", "3", "--loads", "1.2", "--policies", "fcfs,edf", "--shed",
                         "--out", str(out), "--bootstrap-b", "500")
    assert rc == 0 and stdout.startswith("PRIMARY ENDPOINT")
    assert (out / "report.json").read_bytes() == first
    assert not any(p.name.startswith(".bench-tmp") for p in out.iterdir())


def test_robust_defaults_when_no_params(tmp_path, capsys):
    """Without --params the index rows run the shipped robust defaults (docs/design.md section 10):
    their coefficients and margin on index+shed, their flags and rule on index+shed+tpot-guard (its
    gain against index+shed in its vs); --defaults formula gives IndexParams() and no extra row."""
    from tokenbatch_env.evaluate.config import robust_fields
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.params import load_robust_defaults
    d = load_robust_defaults()
    out = tmp_path / "r"
    rc, _, err = _run(capsys, "--suite", "azure-code-like", "--profile", "llama2-7b-a100", "--max-traces", "2",
                      "--loads", "1.2", "--policies", "sjf,index", "--shed", "--out", str(out), "--bootstrap-b", "200",
                      "--no-upper-bound", "--quiet")
    assert rc == 0, err
    rep = json.loads((out / "report.json").read_text())
    rows = {r["label"]: r for r in rep["loads"][0]["rows"]}
    g = rows["index+shed+tpot-guard"]
    lv = robust_fields(load_profile("llama2-7b-a100"))["levers"][0][1]
    assert g["levers"] == lv and g["tpot_guard"] == {"u": d["tpot_guard"]["budget_u"],
                                                     "bmin": d["tpot_guard"]["budget_bmin"]}
    assert "index+shed" in g["vs"] and "levers" not in rows["index+shed"]
    assert rep["parameters"]["index"] == {**rep["parameters"]["index"], **d["index"]}
    assert rep["parameters"]["note"].startswith("ROBUST DEFAULTS")
    out2 = tmp_path / "f"
    rc, _, err = _run(capsys, "--suite", "azure-code-like", "--profile", "llama2-7b-a100", "--max-traces", "2",
                      "--loads", "1.2", "--policies", "sjf,index", "--shed", "--out", str(out2), "--bootstrap-b", "200",
                      "--no-upper-bound", "--quiet", "--defaults", "formula")
    assert rc == 0, err
    rep2 = json.loads((out2 / "report.json").read_text())
    assert "index+shed+tpot-guard" not in [r["label"] for r in rep2["loads"][0]["rows"]]
    assert rep2["parameters"]["note"].startswith("UNTUNED")
    assert rep2["evidence_id"] != rep["evidence_id"]
    out4 = tmp_path / "n"   # an explicit --budget-rule none: no +tpot-guard row, not even the defaults'
    rc, _, err = _run(capsys, "--suite", "azure-code-like", "--profile", "llama2-7b-a100", "--max-traces", "2",
                      "--loads", "1.2", "--policies", "index", "--shed", "--out", str(out4), "--bootstrap-b", "200",
                      "--no-upper-bound", "--quiet", "--budget-rule", "none")
    assert rc == 0, err
    assert not any(r["label"].endswith("+tpot-guard")
                   for r in json.loads((out4 / "report.json").read_text())["loads"][0]["rows"])
    rc, _, err = _run(capsys, "--defaults", "tuned", "--quiet", "--out", str(tmp_path / "x"))
    assert rc == 2 and "--defaults" in err and len(err.strip().splitlines()) == 1
    # a robust-defaults file of one's own (tuning/robust_defaults.py writes one): --defaults FILE, not --params
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**d, "tpot_guard": {"budget_u": 0.5, "budget_bmin": 0.25}}))
    out3 = tmp_path / "m"
    rc, _, err = _run(capsys, "--suite", "azure-code-like", "--profile", "llama2-7b-a100", "--max-traces", "2",
                      "--loads", "1.2", "--policies", "index", "--shed", "--out", str(out3), "--bootstrap-b", "200",
                      "--no-upper-bound", "--quiet", "--defaults", str(mine))
    assert rc == 0, err
    rows3 = {r["label"]: r for r in json.loads((out3 / "report.json").read_text())["loads"][0]["rows"]}
    assert rows3["index+shed+tpot-guard"]["tpot_guard"] == {"u": 0.5, "bmin": 0.25}
    rc, _, err = _run(capsys, "--params", str(mine), "--quiet", "--out", str(tmp_path / "y"))
    assert rc == 2 and "--defaults FILE" in err
    rc, _, err = _run(capsys, "--params", str(mine), "--defaults", "formula", "--quiet", "--out", str(tmp_path / "z"))
    assert rc == 2 and "--defaults" in err and len(err.strip().splitlines()) == 1


def test_params_file_and_capacity(tmp_path, capsys):
    params = tmp_path / "p.json"
    params.write_text(json.dumps({"index": {"kappa": 0.5, "a_edf": 1.0}, "shed_margin": 0.1,
                                  "edf": {"shed_margin": 0.2}}))
    out = tmp_path / "o"
    rc, stdout, _ = _run(capsys, "--max-traces", "2", "--loads", "0.6,1.2", "--policies", "fcfs",
                         "--params", str(params), "--out", str(out), "--bootstrap-b", "200", "--capacity",
                         "--gpu-price", "2.5", "--gpus", "4", "--no-upper-bound", "--quiet")
    assert rc == 0
    d = json.loads((out / "report.json").read_text())
    assert d["parameters"]["index"]["kappa"] == 0.5 and d["parameters"]["shed_margins"]["edf"] == 0.2
    assert "untuned" in d["parameters"]["note"]
    cap = d["capacity"]
    assert set(cap["rows"]) == {"fcfs", "edf+shed", "index+shed"}
    for c in cap["rows"].values():
        assert len(c["per_unit_rho"]) == 2
        assert c["ratio_to_fcfs"] == "not reached" or c["ratio_to_fcfs"]["geomean"] > 0
    assert "upper_bound" not in d["loads"][0]


def test_real_trace_windows(tmp_path, capsys, shared):
    path = shared("traces")
    files = sorted(p for p in path.rglob("*") if p.suffix in (".csv", ".jsonl") and p.stat().st_size < 5_000_000)
    if not files:
        pytest.skip("no small real trace in ../shared/traces")
    out = tmp_path / "w"
    rc, _, err = _run(capsys, "--trace", str(files[0]), "--windows", "100", "--warmup", "20", "--cooldown", "20",
                      "--max-traces", "4", "--loads", "1.0", "--policies", "fcfs", "--out", str(out),
                      "--bootstrap-b", "200", "--quiet")
    assert rc == 0, err
    d = json.loads((out / "report.json").read_text())
    assert d["workload"]["kind"] == "trace" and d["workload"]["bootstrap"].startswith("moving-block")
    assert d["primary_endpoint"] is None
    assert d["workload"]["requests_scored"] <= 400


def test_short_last_window_is_noted(tmp_path):
    """A trace file's windows tile its scored requests: a last window shorter than --windows is
    said in the report's notes, not scored as if it were whole."""
    import numpy as np

    from tokenbatch_env import evaluate as ev
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.traces.io import save_npz
    from tokenbatch_env.traces.suites import load_suite
    path = tmp_path / "t.npz"
    save_npz(load_suite("seed-200").traces("train")[0].subset(np.arange(150)), path)
    cfg = ev.BenchConfig(trace_file=str(path), windows=100, warmup=0, cooldown=0, loads=(1.0,),
                         policies=("fcfs",), bootstrap_b=200, progress=False)
    wl = ev.prepare_workload(cfg, load_profile("stress-512"))
    assert "1 of 2 windows hold fewer than 100 scored requests (the trace's last ones: 50)" in wl.notes
    whole = ev.prepare_workload(dataclasses.replace(cfg, windows=75), load_profile("stress-512"))
    assert not [n for n in whole.notes if "fewer than" in n]


def test_trace_lambda_sat_does_not_depend_on_max_traces(tmp_path):
    """A trace file's load reference comes from its first windows, however many are evaluated: rho
    means the same with any --max-traces."""
    import numpy as np

    from tokenbatch_env import evaluate as ev
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.traces.io import save_npz
    from tokenbatch_env.traces.suites import load_suite
    path = tmp_path / "t.npz"
    save_npz(load_suite("seed-200").traces("train")[0].subset(np.arange(300)), path)
    cfg = ev.BenchConfig(trace_file=str(path), windows=50, warmup=0, cooldown=0, loads=(1.0,),
                         policies=("fcfs",), bootstrap_b=200, progress=False)
    prof = load_profile("stress-512")
    every = ev.prepare_workload(cfg, prof)
    one = ev.prepare_workload(dataclasses.replace(cfg, max_traces=1), prof)
    assert len(every.units) == 6 and len(one.units) == 1
    assert one.lambda_sat == every.lambda_sat
    assert every.lambda_sat_source.endswith("on the trace's first 6 windows")


@pytest.mark.parametrize("argv, needle", [
    (["--policies", "fcfs,bogus"], "unknown policy 'bogus'; valid: fcfs"),
    (["--loads", "0"], "rho must be"),
    (["--loads", "-1.2"], "rho must be"),
    (["--loads", "nan"], "rho must be"),
    (["--loads", "abc"], "not a number"),
    (["--profile", "nope"], "unknown profile 'nope'; valid:"),
    (["--suite", "nope"], "unknown suite 'nope'; valid:"),
    (["--split", "nope"], "unknown split 'nope'"),
    (["--max-traces", "0"], "--max-traces"),
    (["--gpu-price", "2"], "--gpu-price and --gpus"),
    (["--windows", "10"], "--windows needs --trace"),
    (["--trace", "t.csv", "--windows", "10", "--suite", "azure-conv-like"], "--suite goes without --trace"),
    (["--trace", "t.csv", "--windows", "10", "--split", "dev"], "--split with --trace: train, validation or test"),
    (["--bootstrap-b", "50"], "bootstrap"),
    (["--target", "2", "--capacity"], "--target: the capacity goodput target must be in (0, 1], got '2'"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    rc, out, err = _run(capsys, *argv, "--out", str(tmp_path / "x"), "--quiet")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "x").exists()


def test_a_directory_in_a_report_file_place_fails_before_the_runs(tmp_path, capsys, monkeypatch):
    from tokenbatch_env import evaluate
    monkeypatch.setattr(evaluate, "run_benchmark", lambda cfg: pytest.fail("ran before the check"))
    (tmp_path / "x" / "report.md").mkdir(parents=True)
    rc, out, err = _run(capsys, "--out", str(tmp_path / "x"), "--quiet")
    assert rc == 2 and err.count("\n") == 1
    assert "--out " in err and "/x/report.md: cannot write: a directory is in the way" in err


@pytest.mark.parametrize("content, needle", [
    ('{"index": {"kappa": NaN}}', "kappa"),
    ('{"index": {"slope": 1000}}', "outside its range"),
    ('{"shed_margin": 5}', "shed_margin"),
    ('{"index": {"kapa": 1}}', "unknown index parameter"),
    ('{"index": {"kappa": "x"}}', "index parameter kappa: expected a number, got 'x'"),
    ("not json", "invalid JSON"),
])
def test_bad_params_file(tmp_path, capsys, content, needle):
    p = tmp_path / "p.json"
    p.write_text(content)
    rc, _, err = _run(capsys, "--params", str(p), "--out", str(tmp_path / "x"), "--quiet")
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


def test_empty_suite_split(tmp_path, capsys):
    from tokenbatch_env.traces.suites import load_suite_spec
    spec = load_suite_spec("seed-200").to_dict()
    spec["splits"] = [{"name": "train", "count": 1}]
    spec["name"] = "tiny"
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(spec))
    rc, _, err = _run(capsys, "--suite", str(f), "--split", "test", "--out", str(tmp_path / "x"), "--quiet")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "split" in err


def test_closed_stdout_ends_quietly(tmp_path):
    """``tokenbatch ... | head``: the reader closing stdout ends the command without a traceback."""
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-m", "tokenbatch_env.cli", "profiles", "show", "stress-512"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
