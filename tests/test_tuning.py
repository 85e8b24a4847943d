"""Tuning (docs/design.md section 7): tuning/optuna_search.py end to end, determinism, several workers on a
journal study, resuming a killed study, a PostgreSQL study, bad options, the docs/design.md section 8
comparators (weights+shed, index-scheduled: params file entries, warm starts, resume), and the library
pieces (search space, storage kinds, stale-trial recovery, failed trials never fatal)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from tokenbatch_env.errors import ConfigError  # noqa: E402
from tokenbatch_env import tuning as T  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tuning" / "optuna_search.py"
TINY = ["--trials", "4", "--k", "2", "--max-train-traces", "3", "--max-test-traces", "3",
        "--eval-loads", "1.2,1.5", "--bootstrap-b", "200", "--quiet"]
BASE_ROWS = ("index+shed", "edf+shed", "sjf+shed", "llf+shed", *T.FLAGS_ROWS)
BUCKETS = ("index@rho1.2", "index@rho1.5")            # TINY's index-scheduled studies (2 trials each)
ROWS = (*BASE_ROWS, "weights+shed", *BUCKETS)
ROWS_1_2 = (*BASE_ROWS, "weights+shed", "index@rho1.2")   # --eval-loads 1.2: one bucket, full budget


def run_script(*args, timeout=240, **kw):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env, **kw)


def studies(storage, name="seed-200-stress-512-rho1.2", rows=ROWS):
    st = T.make_storage(storage)
    return {r: optuna.load_study(study_name=f"{name}.{r}", storage=st) for r in rows}


def complete(study):
    return [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]


# ------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """The script twice with the same tiny budget and seed (one worker, fresh SQLite studies)."""
    outs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"tune{i}")
        r = run_script(*TINY, "--out", out)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(out)
    return outs


def test_end_to_end_writes_params_and_report(tiny_runs):
    from tokenbatch_env.evaluate import load_params_file
    from tokenbatch_env.policies import IndexParams

    out = tiny_runs[0]
    for name in ("best_params.json", "report.json", "report.md", "optimization_history.png", "run_meta.json",
                 "study.db", "test/report.json", "test/report.md", "test/goodput_vs_load.png"):
        assert (out / name).is_file(), name
    params, margins = load_params_file(str(out / "best_params.json"))
    assert isinstance(params, IndexParams)
    assert {p for p, _ in margins} == {"index", "edf", "sjf", "llf", "weights"}
    rep = json.loads((out / "report.json").read_text())
    assert rep["format"] == "tokenbatch-tuning-report"
    assert set(rep["studies"]) == set(ROWS)
    for row, s in rep["studies"].items():
        assert s["states"] == {"COMPLETE": 2 if row in BUCKETS else 4}, row   # buckets: ceil(4 / 2)
    pe = rep["test"]["primary_endpoint"]
    assert pe["split"] == "test" and pe["rho"] == 1.2 and "diff" in pe and len(pe["ci95"]) == 2
    assert pe["parameters"]["tuned"] is True
    # the test evaluation used exactly the tuned parameters
    doc = json.loads((out / "best_params.json").read_text())
    assert rep["test"]["parameters"]["index"] == pytest.approx(doc["index"], rel=1e-5)
    # the search never saw the test split; study attrs carry the config; trials their evidence
    sts = studies(str(out / "study.db"))
    for row, st in sts.items():
        assert st.user_attrs["config"]["test_split"] == "test"
        assert st.user_attrs["objective"]["train_split"] == "train"
        for t in st.trials:
            assert t.user_attrs["host"] == socket.gethostname() and isinstance(t.user_attrs["pid"], int)
            assert len(t.user_attrs["evidence_id"]) == 64
            assert ("shed_margin" in t.user_attrs["config"]) == (row not in T.FLAGS_ROWS)
            # every row but the index-scheduled buckets tunes the levers (docs/design.md section 11)
            assert ("engine" in t.user_attrs["config"]) == (row not in BUCKETS), row
    md = (out / "report.md").read_text()
    assert md.index("Held-out result") < md.index("## Search")
    assert "ceil(4 / 2) = 2 trials each" in md and "weights+shed" in md and "index@rho1.5" in md


def test_params_file_has_the_comparators(tiny_runs):
    """weights+shed and index-scheduled: valid entries, loadable by the evaluator's readers, equal to
    the best trials of their studies; the test report has their rows."""
    import dataclasses

    from tokenbatch_env.engine.scoring import LINEAR_FEATURES
    from tokenbatch_env.evaluate import BenchConfig, load_schedule, load_weights
    from tokenbatch_env.policies import IndexParams, IndexSchedule, LinearWeights

    out = tiny_runs[0]
    path = str(out / "best_params.json")
    doc = json.loads((out / "best_params.json").read_text())
    sts = studies(str(out / "study.db"))
    w = load_weights(path)
    assert isinstance(w, LinearWeights) and all(-1 <= x <= 1 for x in w.w)
    best = max(complete(sts["weights+shed"]), key=lambda t: (t.value, -t.number))
    assert doc["weights"]["w"] == {f: best.params[f"w_{f}"] for f in LINEAR_FEATURES}
    assert doc["weights"]["shed_margin"] == best.params["shed_margin"]
    sched = load_schedule(path)
    assert isinstance(sched, IndexSchedule) and sched.loads == (1.2, 1.5) and len(sched.edges) == 1
    for b, p, m in zip(BUCKETS, sched.params, sched.margins):
        bt = max(complete(sts[b]), key=lambda t: (t.value, -t.number))
        assert p == IndexParams.from_dict(bt.user_attrs["config"]["index"]) and m == bt.params["shed_margin"]
        assert sts[b].user_attrs["objective"]["loads"] == [float(b.split("rho")[1])]
    assert doc["tuned"]["comparators"]["index-scheduled"]["trials_per_bucket_study"] == 2
    rep = json.loads((out / "report.json").read_text())
    # the vLLM plug-in's settings from the file: the tuning's T_ref and profile (docs/vllm_plugin.md)
    assert set(doc["meta"]) == {"t_ref_mode", "t_ref_ms", "profile", "profile_sha256", "predictor", "fitted"}
    assert doc["meta"]["profile"] == "stress-512" and doc["meta"]["t_ref_mode"] == "fixed"
    assert doc["meta"]["fitted"]["from"] == "train" and doc["meta"]["predictor"] == rep["test"]["predictor"]
    assert abs(doc["meta"]["t_ref_ms"] / rep["t_ref_ms"] - 1) < 1e-5 and rep["t_ref_ms"] != 1000.0   # (6 digits)
    labels = {r["label"] for r in rep["test"]["loads"][0]["rows"]}
    assert {"weights", "weights+shed"} <= labels
    if "schedule" in {f.name for f in dataclasses.fields(BenchConfig)}:
        assert "index-scheduled" in labels and rep["index_scheduled_in_test"] is True


def test_warm_starts_are_the_first_trials(tiny_runs):
    sts = studies(str(tiny_runs[0] / "study.db"))
    for row, st in sts.items():
        cfg = T.TuneConfig(trials=4, eval_loads=(1.2, 1.5))
        ws = T.warm_starts(row, cfg.lever_space(row))[:cfg.trials_of(row)]
        trials = sorted(st.trials, key=lambda t: t.number)
        for w, t in zip(ws, trials):
            assert t.params == pytest.approx(w) and t.user_attrs["warm_start"] is True, row
        assert not any(t.user_attrs.get("warm_start") for t in trials[len(ws):]), row
    w0 = sorted(sts["weights+shed"].trials, key=lambda t: t.number)[0].user_attrs["config"]
    assert w0["weights"]["log_s"] == -1.0 and w0["shed_margin"] == 0.0      # SJF's direction, margin 0


def test_one_worker_fixed_seed_is_byte_identical(tiny_runs):
    a, b = tiny_runs
    assert (a / "best_params.json").read_bytes() == (b / "best_params.json").read_bytes()
    assert (a / "report.json").read_bytes() == (b / "report.json").read_bytes()
    assert (a / "test" / "report.json").read_bytes() == (b / "test" / "report.json").read_bytes()


def test_rerun_of_a_finished_study_resumes_without_new_trials(tiny_runs, tmp_path):
    out = tmp_path / "again"
    shutil.copytree(tiny_runs[0], out)
    r = run_script(*TINY, "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    for row, st in studies(str(out / "study.db")).items():
        assert len(st.trials) == (2 if row in BUCKETS else 4)
    assert (out / "best_params.json").read_bytes() == (tiny_runs[0] / "best_params.json").read_bytes()


def test_comparator_studies_added_and_grown_on_resume_match_a_fresh_run(tiny_runs, tmp_path):
    """Resume: a --no-comparators study gets the comparator studies on the next run (the finished
    ones get no new trial), and a study grown from --trials 2 to 4 keeps its trials and runs its
    remaining warm starts: the result is byte-identical to the fresh run with --trials 4."""
    fresh = tiny_runs[0]
    out = tmp_path / "grown"
    small = [*TINY]
    small[small.index("--trials") + 1] = "2"
    r = run_script(*small, "--no-comparators", "--out", out)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((out / "best_params.json").read_text())
    assert "weights" not in doc and "index-scheduled" not in doc
    st = T.make_storage(str(out / "study.db"))
    names = {s.study_name for s in optuna.get_all_study_summaries(st)}
    assert names == {f"seed-200-stress-512-rho1.2.{r}" for r in BASE_ROWS}
    r = run_script(*small, "--out", out)                 # + the comparator studies (2 and 1 trials)
    assert r.returncode == 0, r.stderr[-2000:]
    sts = studies(str(out / "study.db"))
    assert {row: len(s.trials) for row, s in sts.items()} == {r: 1 if r in BUCKETS else 2 for r in ROWS}
    before = {row: [(t.number, t.params, t.value) for t in s.trials] for row, s in sts.items()}
    r = run_script(*TINY, "--out", out)                  # grown to --trials 4
    assert r.returncode == 0, r.stderr[-2000:]
    sts = studies(str(out / "study.db"))
    for row, s in sts.items():
        assert [(t.number, t.params, t.value) for t in s.trials][:len(before[row])] == before[row]
        assert len(complete(s)) == len(s.trials) == (2 if row in BUCKETS else 4)
    for name in ("best_params.json", "report.json"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name


def test_tokenbatch_tune_writes_the_scripts_report_and_says_when_it_resumes(tmp_path):
    """`tokenbatch tune` (tokenbatch_env/tune_cli.py, options generated from TuneConfig) and
    tuning/optuna_search.py with the same flags write the same report.json bytes; a rerun on the
    finished study says in one line that it resumes its trials, and gives the same report."""
    flags = ["--trials", "2", "--k", "2", "--max-train-traces", "2", "--max-test-traces", "2", "--eval-loads", "1.2",
             "--bootstrap-b", "100", "--no-comparators"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = run_script(*flags, "--out", tmp_path / "script")
    assert r.returncode == 0, r.stderr[-2000:]
    cmd = [sys.executable, "-m", "tokenbatch_env.cli", "tune", *flags, "--out", str(tmp_path / "command")]
    c = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert c.returncode == 0, c.stderr[-2000:]
    assert "evaluate again: tokenbatch bench " in c.stdout and "resuming" not in r.stderr + c.stderr
    # the printed command reproduces the test report (same evidence id)
    line = next(ln for ln in c.stdout.splitlines() if ln.startswith("evaluate again: "))
    from tokenbatch_env import cli
    assert cli.main([*line.split()[3:], "--out", str(tmp_path / "again"), "--quiet"]) == 0
    assert (json.loads((tmp_path / "again" / "report.json").read_text())["evidence_id"]
            == json.loads((tmp_path / "command" / "test" / "report.json").read_text())["evidence_id"])
    for name in ("report.json", "best_params.json", "test/report.json"):
        assert (tmp_path / "script" / name).read_bytes() == (tmp_path / "command" / name).read_bytes(), name
    again = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = [ln for ln in again.stderr.splitlines() if "resuming" in ln]
    assert len(lines) == 1 and lines[0].startswith("resuming 12 trials of study seed-200-stress-512-rho1.2 in ")
    assert "may end with other numbers than an uninterrupted one" in lines[0]
    assert (tmp_path / "command" / "report.json").read_bytes() == (tmp_path / "script" / "report.json").read_bytes()


# ------------------------------------------------------------------------------------ scale-out
def _check_exact(sts, n):
    for row, st in sts.items():
        trials = st.get_trials(deepcopy=False)
        done = complete(st)
        assert len(done) == n, (row, [(t.number, t.state.name, t.user_attrs) for t in trials])
        nums = [t.number for t in trials]
        assert len(set(nums)) == len(nums)
        assert all(t.state.name in ("COMPLETE", "FAIL") for t in trials)
        # a FAIL here can only be a trial asked beyond the cap by a racing worker (never evaluated)
        assert all(t.user_attrs.get("fail_reason") == T.OVER_CAP for t in trials if t.state.name == "FAIL")
        keys = [json.dumps(t.params, sort_keys=True) for t in done]
        assert len(set(keys)) == len(keys)       # nothing evaluated twice


def test_two_workers_on_one_journal_study(tmp_path):
    journal = tmp_path / "s.journal"
    r = run_script("--trials", "6", "--k", "2", "--max-train-traces", "2", "--max-test-traces", "2",
                   "--eval-loads", "1.2", "--bootstrap-b", "200", "--quiet", "--workers", "2",
                   "--storage", journal, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr[-3000:]
    sts = studies(str(journal), rows=ROWS_1_2)
    _check_exact(sts, 6)
    pids = {t.user_attrs["pid"] for st in sts.values() for t in st.trials}
    assert len(pids) == 2                          # both workers did trials
    assert (tmp_path / "out" / "best_params.json").is_file()


def test_killed_run_resumes_keeping_completed_and_requeueing_stale(tmp_path):
    db = tmp_path / "study.db"
    args = ["--trials", "8", "--k", "2", "--max-train-traces", "16", "--max-test-traces", "2",
            "--eval-loads", "1.2", "--bootstrap-b", "200", "--quiet", "--storage", db,
            "--baselines", "edf", "--out", tmp_path / "out", "--threads", "1"]
    name = "seed-200-stress-512-rho1.2.index+shed"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    stale = []
    # create the storage's schema before the script starts: the poll below and the script creating
    # it at the same moment raced (sqlite IntegrityError on alembic_version: the run exited early)
    T.make_storage(str(db))
    first = [*args]
    first[first.index("--trials") + 1] = "40"       # long enough never to finish before the kill
    for attempt in range(3):
        errlog = tmp_path / f"first-{attempt}.err"
        with open(errlog, "w") as ef:
            p = subprocess.Popen([sys.executable, str(SCRIPT), *map(str, first)], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=ef)
        t0 = time.time()
        try:
            while time.time() - t0 < 120:
                time.sleep(0.2)
                if p.poll() is not None or not db.exists():
                    continue
                try:
                    st = optuna.load_study(study_name=name, storage=T.make_storage(str(db)))
                except Exception:  # noqa: BLE001 - the study (or its schema) is still being created
                    continue
                ts = st.get_trials(deepcopy=False)
                if sum(t.state.name == "COMPLETE" for t in ts) >= 2 and any(t.state.name == "RUNNING" for t in ts):
                    break
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        assert p.returncode == -signal.SIGKILL, ("the run ended before it could be killed: "
                                                 + errlog.read_text()[-2000:])
        st = optuna.load_study(study_name=name, storage=T.make_storage(str(db)))
        before = {t.number: (t.value, t.params) for t in complete(st)}
        stale = [t.number for t in st.get_trials(deepcopy=False) if t.state.name == "RUNNING"]
        if stale:
            break
    assert stale, "never caught a RUNNING trial at the kill"
    # the resumed run's cap leaves it work to do however many trials completed before the kill (a
    # fixed cap of 8 made this test depend on the engine's speed: polled every 0.2 s, fast trials
    # could pass 8 before a RUNNING one was caught)
    # (and counts the trials still WAITING at the kill, warm starts, which the resume takes first)
    waiting = sum(t.state.name == "WAITING" for t in st.get_trials(deepcopy=False))
    cap = len(before) + len(stale) + waiting + 1
    resume = [*args]
    resume[resume.index("--trials") + 1] = str(cap)
    # (an enqueued trial, a warm start, killed before its suggestions has only fixed parameters)
    stale_params = {n: {**st.trials[n].system_attrs.get("fixed_params", {}), **st.trials[n].params} for n in stale}

    r = run_script(*resume)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stale RUNNING trial" in r.stderr
    assert "may end with other numbers than an uninterrupted one" in r.stderr   # (the resume caveat)
    st = optuna.load_study(study_name=name, storage=T.make_storage(str(db)))
    trials = st.get_trials(deepcopy=False)
    for n, (v, params) in before.items():           # every completed trial kept as it was
        assert trials[n].state.name == "COMPLETE" and trials[n].value == v and trials[n].params == params
    for n in stale:                                 # stale -> FAIL, parameters re-enqueued and run
        assert trials[n].state.name == "FAIL" and trials[n].user_attrs["fail_reason"] == T.STALE
        again = [t for t in trials if t.user_attrs.get("requeued_from") == n]
        if not stale_params[n]:   # a new trial killed before its first suggestion: nothing to re-enqueue
            assert again == []
            continue
        assert len(again) == 1 and again[0].state.name == "COMPLETE"
        # killed while suggesting, a stale trial may hold only some parameters: those are kept
        assert stale_params[n].items() <= again[0].params.items()
    assert len(complete(st)) == cap
    assert not any(t.state.name == "RUNNING" for t in trials)
    # every study of the run (the comparators' too) resumed to its cap
    for row, s in studies(str(db), rows=("index+shed", "edf+shed", "weights+shed", "index@rho1.2")).items():
        assert len(complete(s)) == cap and not any(t.state.name == "RUNNING" for t in s.trials), row


# ------------------------------------------------------------------------------------ PostgreSQL
def _pg_bin(name):
    found = shutil.which(name)
    if found:
        return found
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).is_file():
            return str(d / name)
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_skip(msg):
    """Skip locally; fail in CI (.ci/run sets TOKENBATCH_REQUIRE_POSTGRES=1 after installing it)."""
    if os.environ.get("TOKENBATCH_REQUIRE_POSTGRES") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def postgres_url():
    """A throw-away PostgreSQL server on a loopback port (Debian's postgresql package)."""
    bins = {n: _pg_bin(n) for n in ("initdb", "pg_ctl", "createdb")}
    missing = [n for n, b in bins.items() if b is None]
    if missing:
        _pg_skip(f"PostgreSQL server binaries not found ({', '.join(missing)}): apt-get install postgresql")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        _pg_skip("psycopg2 not installed: pip install -e '.[tune]' (psycopg2-binary)")
    as_root = os.geteuid() == 0
    if as_root:                                     # initdb refuses to run as root: use the postgres user
        import pwd
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            _pg_skip("running as root and there is no 'postgres' user to run the server as")
        pre = [shutil.which("runuser") or "runuser", "-u", "postgres", "--"]
    else:
        pre = []
    base = Path(tempfile.mkdtemp(prefix="tb-pg-", dir="/tmp"))   # tmp_path's parents are 0700
    data = base / "data"
    if as_root:
        os.chown(base, pw.pw_uid, pw.pw_gid)
    port = _free_port()
    run = lambda *a: subprocess.run([*pre, *a], capture_output=True, text=True, timeout=120)  # noqa: E731
    try:
        r = run(bins["initdb"], "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        assert r.returncode == 0, r.stderr
        r = run(bins["pg_ctl"], "-D", str(data), "-l", str(base / "log"), "-w", "-t", "60",
                "-o", f"-h 127.0.0.1 -p {port} -k {base} -F", "start")
        assert r.returncode == 0, r.stderr + (base / "log").read_text()
        r = run(bins["createdb"], "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "optuna")
        assert r.returncode == 0, r.stderr
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/optuna"
    finally:
        run(bins["pg_ctl"], "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


def test_postgresql_study_with_two_workers(postgres_url, tmp_path):
    r = run_script("--trials", "4", "--k", "2", "--max-train-traces", "2", "--max-test-traces", "2",
                   "--eval-loads", "1.2", "--bootstrap-b", "200", "--quiet", "--workers", "2",
                   "--storage", postgres_url, "--study-name", "pg", "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr[-3000:]
    _check_exact(studies(postgres_url, "pg", rows=ROWS_1_2), 4)
    assert (tmp_path / "out" / "best_params.json").is_file()


# ------------------------------------------------------------------------------------ bad options
BAD = [
    ["--trials", "0"], ["--k", "x"], ["--sampler", "grid"], ["--pruner", "hyperband"],
    ["--storage", "study.txt"], ["--workers", "2", "--storage", "x.db"], ["--baselines", "aging"],
    ["--loads", "-1"], ["--eval-loads", "a,b"], ["--max-train-traces", "0"], ["--timeout", "soon"],
    ["--test-split", "train"], ["--profile", "no-such-profile"], ["--no-such-flag"], ["--seed", "-3"],
]


@pytest.mark.parametrize("argv", BAD, ids=lambda a: " ".join(a))
def test_bad_options_one_line_exit_2(argv, capsys, tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import optuna_search
    finally:
        sys.path.pop(0)
    try:
        rc = optuna_search.main([*argv, "--out", str(tmp_path / "o"), "--quiet"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err and "\n" not in err and "Traceback" not in err, err


def test_bad_suite_split_exits_2_in_a_subprocess(tmp_path):
    r = run_script("--suite", "seed-200", "--test-split", "nope", "--out", tmp_path, timeout=60)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr


# ------------------------------------------------------------------------------------ library
def test_storage_kinds():
    assert T.storage_kind("runs/a.db") == "sqlite" and T.storage_kind("sqlite:///x") == "sqlite"
    assert T.storage_kind("a.journal") == "journal" and T.storage_kind("journal:/tmp/j") == "journal"
    assert T.storage_kind("postgresql+psycopg2://u@h:5/d") == "rdb" and T.storage_kind("mysql://u@h/d") == "rdb"
    with pytest.raises(ConfigError):
        T.storage_kind("study.txt")


def test_search_space_stays_in_range_and_loads():
    from tokenbatch_env.policies import INDEX_RANGES, IndexParams
    st = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(50):
        c = T.suggest_index(st.ask())
        IndexParams.from_dict(c["index"])            # in range
        assert 0 <= c["shed_margin"] <= 2
    assert set(c["index"]) == set(INDEX_RANGES)
    # the extremes of the log1p scale map back inside the range
    st.enqueue_trial({"log1p_gamma": math.log1p(1e3)})
    assert T.suggest_index(st.ask())["index"]["gamma"] <= 1e3


class _FakeObjective:
    n_units = 4

    def __init__(self, values):
        self.values = list(values)

    def evidence_id(self, row, c):
        return "0" * 64

    def evaluate(self, row, configs, report=None):
        v = self.values.pop(0)
        if isinstance(v, Exception):
            raise v
        return np.full(len(configs), v)


def test_failed_and_nan_trials_are_marked_and_never_fatal(tmp_path):
    cfg = T.TuneConfig(trials=6, k=2, baselines=(), out=str(tmp_path), progress=False, comparators=False,
                       levers=False)
    fake = _FakeObjective([RuntimeError("boom"), float("nan"), 0.5])
    T.optimize(cfg, objective=fake)
    st = T.open_studies(cfg)["index+shed"]
    states = [(t.state.name, t.user_attrs.get("fail_reason")) for t in st.trials]
    assert states == [("FAIL", "exception")] * 2 + [("FAIL", "nan")] * 2 + [("COMPLETE", None)] * 2
    assert "boom" in st.trials[0].user_attrs["error"]
    assert st.best_value == 0.5


def test_stale_running_trial_of_a_dead_pid_is_failed_and_requeued(tmp_path):
    cfg = T.TuneConfig(trials=3, k=1, baselines=(), out=str(tmp_path), progress=False, warm_start=False)
    st = T.open_studies(cfg)["index+shed"]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t = st.ask()
    T.suggest_index(t)
    t.set_user_attr("host", socket.gethostname())
    t.set_user_attr("pid", dead.pid)
    alive = st.ask()                                 # our own pid: alive, left alone
    T.suggest_index(alive)
    for k, v in T._me().items():
        alive.set_user_attr(k, v)
    assert T.recover_stale_trials(st) == [t.number]
    trials = st.get_trials(deepcopy=False)
    assert trials[t.number].state.name == "FAIL" and trials[t.number].user_attrs["fail_reason"] == "stale"
    assert trials[alive.number].state.name == "RUNNING"
    waiting = [x for x in trials if x.state.name == "WAITING"]
    assert len(waiting) == 1 and waiting[0].user_attrs["requeued_from"] == t.number
    assert T.recover_stale_trials(st) == []          # idempotent
    assert T.counted_trials(st) == 1                 # the stale one no longer counts; the requeued one will


# A process killed the moment its trial turns RUNNING (before ``claim_trial`` returns): ask() then
# set_user_attr left such a trial without an owner, never recovered (a CI failure of the kill test).
_KILL_AT_RUNNING = """
import os, sys
import optuna
from tokenbatch_env import tuning as T
st = optuna.load_study(study_name=sys.argv[2], storage=T.make_storage(sys.argv[1]))
storage = st._storage
create, take = storage.create_new_trial, storage.set_trial_state_values
def create_then_die(*a, **k):
    create(*a, **k)
    os._exit(0)
def take_then_die(*a, **k):
    if take(*a, **k):
        os._exit(0)
    return False
storage.create_new_trial, storage.set_trial_state_values = create_then_die, take_then_die
T.claim_trial(st, T._me())
sys.exit("claim_trial returned")
"""


@pytest.mark.parametrize("enqueued", [False, True], ids=["new-trial", "enqueued-trial"])
def test_trial_of_a_process_killed_as_it_turns_running_is_recovered(tmp_path, enqueued):
    cfg = T.TuneConfig(trials=3, k=1, baselines=(), out=str(tmp_path), progress=False, warm_start=False)
    st = T.open_studies(cfg)["index+shed"]
    if enqueued:
        st.enqueue_trial({"c_tau": 0.5}, user_attrs={"requeued_from": 7})
    r = subprocess.run([sys.executable, "-c", _KILL_AT_RUNNING, str(tmp_path / "study.db"), st.study_name],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (t,) = st.get_trials(deepcopy=False)
    assert t.state.name == "RUNNING"
    if enqueued:   # killed between taking it and writing its owner record: its claim says who
        assert T.OWNER not in t.user_attrs and any(k.startswith(T.CLAIM_PREFIX) for k in t.user_attrs)
    else:          # created with its owner record
        assert t.user_attrs[T.OWNER]["pid"] != os.getpid()
    assert T.recover_stale_trials(st) == [t.number]
    trials = st.get_trials(deepcopy=False)
    assert trials[t.number].state.name == "FAIL" and trials[t.number].user_attrs["fail_reason"] == T.STALE
    again = [x for x in trials if x.user_attrs.get("requeued_from") == t.number]
    if enqueued:   # taken, never suggested: its fixed parameters are what re-enqueues
        assert len(again) == 1 and again[0].state.name == "WAITING"
        assert again[0].system_attrs["fixed_params"] == {"c_tau": 0.5}
    else:
        assert again == []


def _dead_process() -> dict:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return {**T._me(), "pid": dead.pid, "pid_start": None}


def test_trial_without_owner_record_is_judged_by_its_claims(tmp_path):
    """Killed between taking an enqueued trial and writing its owner record, an owner leaves only its
    claim, possibly beside the claims of losers killed before they could withdraw theirs: the trial is
    stale only once every claimant here is gone, and never while one is elsewhere. An owner record
    decides alone (the losers' claims no longer matter)."""
    from optuna.trial import TrialState
    cfg = T.TuneConfig(trials=3, k=1, baselines=(), out=str(tmp_path), progress=False, warm_start=False)
    st = T.open_studies(cfg)["index+shed"]
    S, me, ghost = st._storage, T._me(), _dead_process()

    def taken(*claimants, owner=None):
        st.enqueue_trial({"c_tau": 0.5})
        w = st.get_trials(deepcopy=False, states=(TrialState.WAITING,))[-1]
        for c in claimants:
            S.set_trial_user_attr(w._trial_id, T._claim_key(c), c)
        assert S.set_trial_state_values(w._trial_id, state=TrialState.RUNNING)
        if owner is not None:
            S.set_trial_user_attr(w._trial_id, T.OWNER, owner)
        return w
    live = taken(ghost, me)                                      # a live claimant: left alone
    elsewhere = taken(ghost, {**ghost, "host": ghost["host"] + "-elsewhere"})
    other_ns = taken({**ghost, "boot": "another-boot:1"})        # same hostname, other pids
    decided = taken(ghost, me, owner=ghost)                      # the owner record decides
    assert T.recover_stale_trials(st) == [decided.number]
    S.set_trial_user_attr(live._trial_id, T._claim_key(me), None)   # our claim withdrawn
    assert T.recover_stale_trials(st) == [live.number]
    states = {t.number: t.state.name for t in st.get_trials(deepcopy=False)}
    assert states[elsewhere.number] == states[other_ns.number] == "RUNNING"


def test_claimant_that_loses_the_race_withdraws_its_claim(tmp_path, monkeypatch):
    cfg = T.TuneConfig(trials=3, k=1, baselines=(), out=str(tmp_path), progress=False, warm_start=False)
    st = T.open_studies(cfg)["index+shed"]
    st.enqueue_trial({"c_tau": 0.5})
    (w,) = st.get_trials(deepcopy=False)
    monkeypatch.setattr(st._storage, "set_trial_state_values", lambda *a, **k: False)   # taken by another
    me = T._me()
    t = T.claim_trial(st, me)
    trials = st.get_trials(deepcopy=False)
    assert t.number != w.number and trials[w.number].state.name == "WAITING"
    assert trials[w.number].user_attrs[T._claim_key(me)] is None
    assert trials[t.number].user_attrs[T.OWNER] == me and trials[t.number].state.name == "RUNNING"


def test_resumed_study_with_another_objective_is_refused(tmp_path):
    T.open_studies(T.TuneConfig(out=str(tmp_path), baselines=()))
    with pytest.raises(ConfigError, match=r"another objective \(max_train_traces 40 there, 7 now\)"):
        T.open_studies(T.TuneConfig(out=str(tmp_path), baselines=(), max_train_traces=7))


def test_threads_do_not_change_results():
    a = T.TrainObjective(T.TuneConfig(max_train_traces=4, threads=1))
    b = T.TrainObjective(T.TuneConfig(max_train_traces=4, threads=2))
    confs = [{"index": {}, "shed_margin": 0.5}, {"index": {"a_edf": 3.0}, "shed_margin": 1.0}]
    assert np.array_equal(a.evaluate("index+shed", confs), b.evaluate("index+shed", confs))
    m = [{"shed_margin": 0.0}, {"shed_margin": 1.5}]
    assert np.array_equal(a.evaluate("edf+shed", m), b.evaluate("edf+shed", m))
    # pruning: the quarters add up to the same mean when nothing is pruned
    assert np.allclose(a.evaluate("edf+shed", m, report=lambda j, s, v: False), a.evaluate("edf+shed", m))


def test_import_tokenbatch_env_does_not_import_optuna():
    from conftest import heavy_modules_loaded
    assert heavy_modules_loaded("tokenbatch_env.tuning", ("optuna",)) == []


def test_benchmark_threads_give_the_same_report():
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark
    kw = dict(max_traces=2, loads=(1.2,), policies=("fcfs", "edf", "index"), shed=True, bootstrap_b=200,
              upper_bound=False)
    a = run_benchmark(BenchConfig(**kw))
    b = run_benchmark(BenchConfig(**kw, threads=2))
    assert a.to_json() == b.to_json()


# ------------------------------------------------------------------------------------ comparators
def test_comparator_rows_and_budget():
    cfg = T.TuneConfig()
    assert cfg.rows == (*BASE_ROWS, "weights+shed", "index@rho1", "index@rho1.2", "index@rho1.5")
    assert cfg.bucket_rows == {"index@rho1": 1.0, "index@rho1.2": 1.2, "index@rho1.5": 1.5}
    assert [cfg.trials_of(r) for r in cfg.rows] == [48] * 7 + [16] * 3          # same total budget
    assert T.TuneConfig(trials=50).bucket_trials == 17                           # ceil(50 / 3)
    assert cfg.objective_dict("index@rho1.5")["loads"] == [1.5] and cfg.objective_dict(T.INDEX_ROW)["loads"] == [1.2]
    assert cfg.study_name_of("index@rho1.2") == "seed-200-stress-512-rho1.2.index@rho1.2"
    assert T.TuneConfig(comparators=False).rows == BASE_ROWS
    with pytest.raises(ConfigError):
        T.TuneConfig(comparators="yes")


def test_weights_search_space_and_warm_starts():
    from tokenbatch_env.engine.scoring import LINEAR_FEATURES
    from tokenbatch_env.policies import WEIGHT_RANGE, LinearWeights
    st = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        c = T.suggest_config("weights+shed", st.ask())
        assert set(c["weights"]) == set(LINEAR_FEATURES)
        assert all(WEIGHT_RANGE[0] <= v <= WEIGHT_RANGE[1] for v in c["weights"].values())
        assert 0 <= c["shed_margin"] <= 2
        LinearWeights(c["weights"])
    ws = T.warm_starts("weights+shed")
    assert [[k for k, v in w.items() if v == -1.0] for w in ws] == [["w_log_s"], ["w_to_deadline"], ["w_slack"]]
    assert all(w["shed_margin"] == 0.0 and sum(map(abs, w.values())) == 1.0 for w in ws)
    assert T.warm_starts("index@rho1.5") == T.warm_starts(T.INDEX_ROW)
    assert T.row_kind("index@rho1.5") == "index" and T.row_kind("llf+shed") == "margin"


def test_weights_batch_equals_separate_runs_and_bucket_units():
    """k weight vectors in one engine run (per-copy theta) = k separate runs; a bucket study's units
    are the train traces at its load."""
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.policies import LinearWeights, engine_policy

    obj = T.TrainObjective(T.TuneConfig(max_train_traces=3, eval_loads=(1.2, 1.5)))
    confs = [{"weights": {"log_s": -1.0}, "shed_margin": 0.0},
             {"weights": {"to_deadline": -1.0, "z": 0.3}, "shed_margin": 0.5},
             {"weights": {"slack": -0.5, "prefix_ratio": 0.8, "blocks_needed": -0.2}, "shed_margin": 1.5}]
    G = obj._run("weights+shed", confs, np.arange(3))
    wl = obj.wl
    for j, c in enumerate(confs):
        pol = engine_policy("weights", weights=LinearWeights(c["weights"]), shed_margin=c["shed_margin"],
                            t_ref_ms=wl.t_ref_ms)
        res = simulate(obj.units, obj.profile, pol, obj.bench_config.engine, estimates=obj.est,
                       residual_life=wl.residual_life)
        assert G[j].tolist() == [res.records(i)["met"].mean() for i in range(3)]
    assert len({tuple(r) for r in G.tolist()}) > 1
    # SJF's direction with margin 0 is sjf+shed(0); a bucket study at 1.2 sees the index study's units
    assert np.array_equal(G[0], obj._run("sjf+shed", [{"shed_margin": 0.0}], np.arange(3))[0])
    ic = [{"index": {}, "shed_margin": 0.5}]
    assert np.array_equal(obj.evaluate("index@rho1.2", ic), obj.evaluate(T.INDEX_ROW, ic))
    units15, est15, _ = obj.units_of("index@rho1.5")
    assert len(units15) == 3 and all(a.arrival_ns[-1] > b.arrival_ns[-1] for a, b in zip(obj.units, units15))
    assert all(np.array_equal(a, b) for a, b in zip(est15, obj.est))        # same length estimates (CRN)
    assert not np.array_equal(obj.evaluate("index@rho1.5", ic), obj.evaluate(T.INDEX_ROW, ic))
    assert obj.evidence_id("index@rho1.5", ic[0]) != obj.evidence_id("index@rho1.2", ic[0])
