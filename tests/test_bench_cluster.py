"""`tokenbatch bench --replicas R --routers ...` (docs/design.md section 12): every row on a cluster of R
replicas behind each router. A single engine's benchmark is unchanged (report and evidence id); a
cluster row's goodput is the cluster replay's; labels, the reference row and the cluster block;
bad input is one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tokenbatch_env import cli
from tokenbatch_env import evaluate as ev
from tokenbatch_env.errors import ConfigError

TINY = dict(max_traces=2, loads=(1.2,), policies=("fcfs", "edf"), bootstrap_b=200, progress=False)
CLUSTER = dict(TINY, replicas=2, upper_bound=False)


# ------------------------------------------------------------------ (a) a single engine is unchanged
def test_one_replica_is_the_single_engine_exactly():
    plain = ev.run_benchmark(ev.BenchConfig(**TINY))
    one = ev.run_benchmark(ev.BenchConfig(**TINY, replicas=1, routers=("round-robin",), metrics_staleness_ms=0.0))
    assert one.to_json() == plain.to_json() and one.data == plain.data
    assert one.evidence_id == plain.evidence_id
    assert one.to_markdown() == plain.to_markdown() and one.summary_text() == plain.summary_text()
    d = plain.data
    # nothing of clusters in a single engine's report or evidence
    assert set(d["evidence_inputs"]) == {"workload", "loads", "lambda_sat_rps", "engine_config", "profile",
                                         "policies", "predictor", "residual_life_sha256", "bootstrap", "capacity",
                                         "upper_bound", "package_version"}
    assert "cluster" not in d and not any("router" in p for p in d["evidence_inputs"]["policies"])
    assert not any({"router", "cluster"} & set(r) for e in d["loads"] for r in e["rows"])
    assert d["lambda_sat"]["source"] == "suite manifest (stress-512)"
    # the cluster's fields enter the evidence id in cluster mode, each of them
    base = ev.BenchConfig(**CLUSTER)
    seen = {plain.evidence_id, _eid(base)}
    assert len(seen) == 2
    for v in (dict(replicas=3), dict(routers=("jsq",)), dict(routers=("round-robin", "jsq")),
              dict(routers=("jsq", "round-robin")), dict(metrics_staleness_ms=5.0)):
        e = _eid(dataclasses.replace(base, **v))
        assert e not in seen, v
        seen.add(e)


def _eid(cfg):
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate.cluster import bench_workload
    prof = cfg.engine.resolve(load_profile(cfg.profile))
    return ev.evidence_id(ev.evidence_inputs(cfg, bench_workload(cfg, prof), prof, ev.build_rows(cfg)))


@pytest.mark.parametrize("kw, msg", [
    (dict(replicas=0), "replicas: must be an integer >= 1, got 0"),
    (dict(replicas=True), "replicas: must be an integer >= 1"),
    (dict(replicas=4097), "replicas: must be in [1, 4096], got 4097"),
    (dict(replicas=2, routers=()), "routers: need at least one; valid: round-robin"),
    (dict(replicas=2, routers=("nope",)), "routers: unknown router 'nope'; valid: round-robin"),
    (dict(replicas=2, routers=("jsq", "jsq")), "routers: duplicates in ['jsq', 'jsq']"),
    (dict(replicas=2, metrics_staleness_ms=-1.0), "metrics_staleness_ms: must be a finite number of ms >= 0"),
    (dict(replicas=2, metrics_staleness_ms=float("nan")), "metrics_staleness_ms: must be a finite number"),
    (dict(routers=("jsq",)), "a cluster's settings, with replicas R > 1"),
    (dict(metrics_staleness_ms=5.0), "a cluster's settings, with replicas R > 1"),
    (dict(replicas=2, capacity=True), "capacity (--capacity) is not supported in cluster mode"),
    (dict(replicas=2), "upper_bound: the upper bound is a single engine's; not supported in cluster mode"),
])
def test_cluster_config_errors_are_one_line(kw, msg):
    kw = {"upper_bound": False, **kw} if "upper_bound" not in msg else kw
    with pytest.raises(ConfigError) as e:
        ev.BenchConfig(**kw)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_controller_rows_are_refused_in_cluster_mode():
    from tokenbatch_env.policies import IndexParams, IndexSchedule
    sched = IndexSchedule(loads=(1.0,), edges=(), params=(IndexParams(),), margins=(0.0,))
    with pytest.raises(ConfigError, match=r"controller rows \(--schedule, agents\) are not supported in cluster"):
        ev.BenchConfig(**CLUSTER, schedule=sched)


# ------------------------------------------------------------------ (b) a row's goodput, by hand
@pytest.fixture(scope="module")
def jsq_report():
    """One router (plain labels), with +tpot-guard rows at a u and B_min of their own."""
    return ev.run_benchmark(ev.BenchConfig(**CLUSTER, routers=("jsq",), metrics_staleness_ms=2.0,
                                           tpot_guard=(0.5, 0.3)))


def _by_hand(policy: str, shed: bool, guard=None, router="jsq", staleness=2.0):
    """The report's copies replayed directly: seed-200's first two test traces at 1.2 x (2 x the
    manifest's lambda_sat), the suite's predictor, the train outputs' residual-life table; each on
    ``simulate_cluster``. Returns (per-unit goodput, per-unit replica stats)."""
    from tokenbatch_env.engine.cluster import simulate_cluster
    from tokenbatch_env.engine.state import EngineConfig
    from tokenbatch_env.policies import IndexParams, engine_policy
    from tokenbatch_env.predictors import PredictorSpec, ResidualLife, estimates
    from tokenbatch_env.traces.suites import load_suite
    from tokenbatch_env.traces.windows import scale_to_rate

    s = load_suite("seed-200")
    base = s.traces("test")[:2]
    lam = 2 * float(s.lambda_sat["stress-512"])
    rl = ResidualLife.from_lengths(np.concatenate([t.output_tokens for t in s.traces("train")])).table
    engine = EngineConfig() if guard is None else EngineConfig(budget_rule="tpot-guard", budget_u=guard[0],
                                                               budget_bmin=guard[1])
    # (the index reads the length estimates; T_ref: the manifest's)
    pol = engine_policy(policy, shed_margin=0.0 if shed else None,
                        **({"params": IndexParams(), "t_ref_ms": float(s.t_ref_ns) / 1e6} if policy == "index" else {}))
    good, stats = [], []
    for t in base:
        tr = scale_to_rate(t, 1.2 * lam, nominal_rps=s.nominal_rate_rps)
        # (the rule from the engine configuration alone: no ``guard=`` here)
        res = simulate_cluster(tr, "stress-512", pol, engine, replicas=2, router=router, staleness_ms=staleness,
                               estimates=estimates(t, PredictorSpec.from_dict(s.predictor)), residual_life=rl)
        good.append(ev.unit_metrics(ev.request_outcomes(res.records(), tr, np.ones(len(tr), bool)))["goodput"])
        stats.append(res.replica_stats())
    return good, stats


@pytest.mark.parametrize("label, policy, shed, guard", [
    ("edf+shed", "edf", True, None),
    ("fcfs", "fcfs", False, None),
    ("edf+shed+tpot-guard", "edf", True, (0.5, 0.3)),
    ("index+shed", "index", True, None),
])
def test_cluster_row_goodput_is_the_cluster_replay(jsq_report, label, policy, shed, guard):
    d = jsq_report.data
    assert d["lambda_sat"]["rps"] == pytest.approx(2 * 2.52679, rel=1e-9)
    assert d["lambda_sat"]["source"].endswith(" x 2 replicas")
    row = next(r for r in d["loads"][0]["rows"] if r["label"] == label)
    good, stats = _by_hand(policy, shed, guard)
    assert row["goodput_per_unit"] == pytest.approx(good, rel=1e-12)
    # (d) its cluster block: the replicas' numbers of the same replays
    c = row["cluster"]
    assert c["replicas"] == 2 and c["router"] == "jsq" and len(c["utilisation"]) == 2
    assert c["utilisation"] == pytest.approx(np.mean([s["utilisation"] for s in stats], axis=0).tolist(), rel=1e-12)
    assert c["imbalance"] == pytest.approx(np.mean([s["imbalance"] for s in stats]), rel=1e-12)
    q = sum(int(s["prefix_query_tokens"].sum()) for s in stats)
    h = sum(int(s["prefix_hit_tokens"].sum()) for s in stats)
    assert q > 0 and c["prefix_hit_rate"] == pytest.approx(h / q, rel=1e-12)


def test_the_guard_rows_run_with_their_rule(jsq_report):
    """A +tpot-guard row is not its row without the rule: the replay with the rule (checked above)
    differs from the one without it."""
    rows = {r["label"]: r for r in jsq_report.data["loads"][0]["rows"]}
    assert rows["edf+shed+tpot-guard"]["tpot_guard"] == {"u": 0.5, "bmin": 0.3}
    assert rows["edf+shed+tpot-guard"]["goodput_per_unit"] != rows["edf+shed"]["goodput_per_unit"]
    assert "edf+shed" in rows["edf+shed+tpot-guard"]["vs"]


# ------------------------------------------------------------------ (c) several routers
def test_two_routers_label_their_rows_and_the_first_fcfs_is_the_reference():
    rep = ev.run_benchmark(ev.BenchConfig(**{**CLUSTER, "policies": ("fcfs",)}, routers=("jsq", "round-robin")))
    d = rep.data
    e = d["loads"][0]
    base = ["fcfs", "edf+shed", "index+shed"]
    assert [r["label"] for r in e["rows"]] == [f"{x} x {b}" for x in ("jsq", "round-robin") for b in base]
    rows = {r["label"]: r for r in e["rows"]}
    assert all(r["router"] == r["label"].split(" x ")[0] == r["cluster"]["router"] for r in e["rows"])
    g = {k: float(np.mean(r["goodput_per_unit"])) for k, r in rows.items()}
    assert g["jsq x fcfs"] != g["round-robin x fcfs"]   # (else the reference would not tell them apart)
    # the reference: the first router's fcfs
    assert e["fcfs_goodput"] == pytest.approx(g["jsq x fcfs"], rel=1e-12)
    for k, r in rows.items():
        assert r["relative_goodput"] == pytest.approx(g[k] / g["jsq x fcfs"] - 1, rel=1e-9, abs=1e-12)
        if e["gap_closed_printed"]:
            best = e["best_achieved"]["goodput"]["mean"]
            assert r["gap_closed"] == pytest.approx((g[k] - g["jsq x fcfs"]) / (best - g["jsq x fcfs"]), rel=1e-9)
    # a row's comparators are behind its own router; a row behind another router is also paired with
    # the same row behind the first
    assert set(rows["jsq x index+shed"]["vs"]) == {"jsq x fcfs", "jsq x edf+shed"}
    assert set(rows["round-robin x index+shed"]["vs"]) == {"round-robin x fcfs", "round-robin x edf+shed",
                                                           "jsq x index+shed"}
    assert set(rows["round-robin x fcfs"]["vs"]) == {"round-robin x edf+shed", "jsq x fcfs"}
    # the primary endpoint: the first router's rows, and not the pre-registered (single-engine) test
    p = d["primary_endpoint"]
    assert p["index_plus_shed"] == pytest.approx(g["jsq x index+shed"], rel=1e-12)
    assert p["edf_plus_shed"] == pytest.approx(g["jsq x edf+shed"], rel=1e-12)
    assert p["cluster"] == {"replicas": 2, "router": "jsq"} and p["is_primary_split"] is False
    assert [x.get("router") for x in d["evidence_inputs"]["policies"]] == ["jsq"] * 3 + ["round-robin"] * 3
    # the leaderboard's "vs fcfs" column reads the row's own router's fcfs
    text = rep.summary_text()
    line = next(x for x in text.splitlines() if x.startswith("round-robin x index+shed "))
    assert f"{rows['round-robin x index+shed']['vs']['round-robin x fcfs']['diff']:+.3f}" in line
    # ... and the gap line says which fcfs is the reference
    assert e["fcfs_row"] == "jsq x fcfs"
    assert "(FCFS here, and in rel. goodput: jsq x fcfs; vs fcfs: the fcfs row behind the same router)" in text
    # the router's gain, printed: each row behind round-robin against the same row behind jsq (paired)
    md = rep.to_markdown()
    assert "## Routers at rho 1.2" in md and "routers at rho 1.2" in text
    for b in base:
        gain = rows[f"round-robin x {b}"]["vs"][f"jsq x {b}"]
        want = f"| round-robin x {b} | jsq x {b} | {gain['diff']:+.3f} [{gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}]"
        assert want in md, want
    section = md.split("## Routers at rho 1.2")[1].split("\n## ")[0]
    assert not any(x.startswith("| jsq x ") for x in section.splitlines())


# ------------------------------------------------------------------ (d) the cluster block in the reports
def test_the_cluster_block_is_in_every_report(jsq_report, tmp_path):
    d = jsq_report.data
    assert d["cluster"] == {"replicas": 2, "routers": ["jsq"], "metrics_staleness_ms": 2.0}
    assert d["evidence_inputs"]["cluster"] == d["cluster"]
    assert "upper_bound" not in d["loads"][0]
    assert any("cluster of 2 replicas behind jsq (metrics staleness 2 ms)" in n for n in d["workload"]["notes"])
    labels = [r["label"] for r in d["loads"][0]["rows"]]
    assert labels[:4] == ["fcfs", "edf", "edf+shed", "index+shed"]   # one router: the plain labels
    for r in d["loads"][0]["rows"]:
        assert r["router"] == "jsq"
        assert set(r["cluster"]) == {"replicas", "router", "utilisation", "imbalance", "prefix_hit_rate"}
        assert all(0 < u <= 1 for u in r["cluster"]["utilisation"]) and r["cluster"]["imbalance"] >= 1
    jsq_report.write(tmp_path)
    rj = json.loads((tmp_path / "report.json").read_text())
    assert rj["loads"][0]["rows"][0]["cluster"]["replicas"] == 2
    md = (tmp_path / "report.md").read_text()
    assert "## Replicas at rho 1.2" in md and "- cluster    2 replicas behind jsq; metrics staleness 2 ms" in md
    text = jsq_report.summary_text()
    assert "replicas at rho 1.2" in text and "cluster    2 replicas behind jsq" in text
    u = " ".join(f"{x:.2f}" for x in d["loads"][0]["rows"][0]["cluster"]["utilisation"])
    assert any(x.startswith("fcfs ") and u in x for x in text.splitlines())


def test_trace_windows_hold_w_x_r_requests(tmp_path):
    """A trace file's windows in cluster mode: W x R scored requests, warm-up and cool-down x R, and
    lambda_sat R times that of the same windows on one engine."""
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate.cluster import bench_workload
    from tokenbatch_env.traces.io import save_npz
    from tokenbatch_env.traces.suites import load_suite
    path = tmp_path / "t.npz"
    save_npz(load_suite("seed-200").traces("train")[0].subset(np.arange(320)), path)
    cfg = ev.BenchConfig(trace_file=str(path), windows=50, warmup=5, cooldown=5, loads=(1.0,), policies=("fcfs",),
                         bootstrap_b=200, progress=False, replicas=2, upper_bound=False)
    prof = load_profile("stress-512")
    wl = bench_workload(cfg, prof)
    one = ev.prepare_workload(dataclasses.replace(cfg, windows=100, warmup=10, cooldown=10, replicas=1,
                                                  upper_bound=True), prof)
    assert wl.windows == one.windows and [s - a for _, _, a, s in wl.windows] == [100, 100, 100]
    assert wl.windows[0][:2] == (0, 120)
    assert wl.lambda_sat == 2 * one.lambda_sat and wl.lambda_sat_source == one.lambda_sat_source + " x 2 replicas"
    assert any("windows of 50 x 2 = 100 scored requests (warm-up 10, cool-down 10)" in n for n in wl.notes)
    rep = ev.run_benchmark(cfg)
    assert rep.data["workload"]["requests_scored"] == 300
    assert rep.data["evidence_inputs"]["workload"]["windows"] == [list(w) for w in wl.windows]


def test_too_few_windows_in_a_cluster_names_the_users_w(tmp_path):
    """A split with too few windows of W x R requests: the error speaks in the user's --windows W (and
    warm-up, cool-down), and the W it suggests works."""
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate.cluster import bench_workload
    from tokenbatch_env.traces.io import save_npz
    from tokenbatch_env.traces.suites import load_suite
    path = tmp_path / "t.npz"
    save_npz(load_suite("seed-200").traces("train")[0], path)
    kw = dict(trace_file=str(path), warmup=5, cooldown=5, trace_split="test", loads=(1.0,), policies=("fcfs",),
              bootstrap_b=200, progress=False, replicas=4, upper_bound=False)
    prof = load_profile("stress-512")
    with pytest.raises(ConfigError, match=r"with --windows 30 x 4 replicas \(warm-up 5, cool-down 5\); every split "
                                          r"needs at least 5: use --windows (\d+) or less") as e:
        bench_workload(ev.BenchConfig(windows=30, **kw), prof)
    w = int(str(e.value).rsplit("--windows ", 1)[1].split()[0])
    assert w >= 1 and len(bench_workload(ev.BenchConfig(windows=w, **kw), prof).windows) >= 5


# ------------------------------------------------------------------ (e) the command line
@pytest.fixture()
def _bench_registered(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "bench", ("tokenbatch_env.bench_cli", "benchmark policies"))


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "0"], "--replicas: must be >= 1, got 0"),
    (["--replicas", "two"], "--replicas: must be an integer, got 'two'"),
    (["--replicas", "100000"], "--replicas: must be in [1, 4096], got 100000"),
    (["--replicas", "2", "--routers", "jsq,nope"], "--routers: unknown router 'nope'; valid: round-robin,"),
    (["--replicas", "2", "--routers", "jsq,jsq"], "--routers: duplicates in ['jsq', 'jsq']"),
    (["--replicas", "2", "--routers", ","], "--routers: need at least one"),
    (["--replicas", "2", "--metrics-staleness-ms", "-1"], "--metrics-staleness-ms: must be a number of ms >= 0"),
    (["--replicas", "2", "--metrics-staleness-ms", "inf"], "--metrics-staleness-ms: must be finite"),
    (["--routers", "jsq"], "--routers and --metrics-staleness-ms: a cluster's settings, with --replicas R > 1"),
    (["--replicas", "1", "--metrics-staleness-ms", "3"], "a cluster's settings, with --replicas R > 1"),
    (["--replicas", "2", "--capacity"], "capacity (--capacity) is not supported in cluster mode"),
])
def test_bad_cluster_input_exits_2_with_one_line(_bench_registered, tmp_path, capsys, argv, needle):
    rc = cli.main(["bench", *argv, "--out", str(tmp_path / "x"), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "x").exists()


def test_cli_cluster_bench(_bench_registered, tmp_path, capsys):
    """The flags reach the config: the upper bound is off in cluster mode (a single engine's), the
    report names the replicas and routers."""
    out = tmp_path / "c"
    rc = cli.main(["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "fcfs", "--replicas", "2",
                   "--routers", "round-robin,least-kv", "--metrics-staleness-ms", "1.5", "--bootstrap-b", "200",
                   "--defaults", "formula", "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    d = json.loads((out / "report.json").read_text())
    assert d["cluster"] == {"replicas": 2, "routers": ["round-robin", "least-kv"], "metrics_staleness_ms": 1.5}
    assert d["evidence_inputs"]["upper_bound"] is False and "upper_bound" not in d["loads"][0]
    assert [r["label"] for r in d["loads"][0]["rows"]][:2] == ["round-robin x fcfs", "round-robin x edf+shed"]
