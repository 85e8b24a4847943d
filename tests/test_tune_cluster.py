"""Tuning a cluster (docs/design.md section 12: a row is router x policy x levers, routers with
parameters tuned like baselines, the same budget): ``tokenbatch tune --replicas R --routers ...``. Every
row is a study per router; prefix-affinity's alpha and beta join its rows' search space; the tuning
objective is the benchmark's cluster goodput of the same row with the same values; the parameters file
carries every routed row's values and ``tokenbatch bench --params FILE --replicas R`` reproduces the
test report."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from tokenbatch_env import cli  # noqa: E402
from tokenbatch_env import evaluate as ev  # noqa: E402
from tokenbatch_env import tuning as T  # noqa: E402
from tokenbatch_env.engine.cluster import ROUTER_NAMES, ROUTERS, TUNED_ROUTERS  # noqa: E402
from tokenbatch_env.errors import ConfigError  # noqa: E402
from tokenbatch_env.params import RoutedRow, load_routed  # noqa: E402
from tokenbatch_env.policies import IndexParams  # noqa: E402

SMALL = dict(max_train_traces=2, loads=(1.2,), eval_loads=(1.2,), bootstrap_b=200, progress=False)


# ------------------------------------------------------------------ the config and the search space
def test_cluster_rows_are_each_row_behind_each_router():
    one = T.TuneConfig(**SMALL)
    cfg = T.TuneConfig(**SMALL, replicas=4)
    assert cfg.routers == T.DEFAULT_ROUTERS == ("round-robin", *TUNED_ROUTERS)
    assert not cfg.comparators   # (index-scheduled is a controller: not in a cluster benchmark)
    plain = T.TuneConfig(**SMALL, comparators=False).rows
    assert cfg.rows == tuple(f"{r} x {row}" for r in cfg.routers for row in plain)
    assert all(cfg.trials_of(r) == cfg.trials for r in cfg.rows)   # the same budget for every row
    assert cfg.name == one.name + "-R4" and "cluster" in cfg.objective_dict(cfg.rows[0])
    # one engine's config (and so its evidence ids) has nothing of clusters
    assert not {"replicas", "routers", "metrics_staleness_ms"} & set(one.to_dict())
    assert cfg.to_dict()["replicas"] == 4 and cfg.to_dict()["routers"] == list(cfg.routers)


@pytest.mark.parametrize("kw, msg", [
    (dict(replicas=0), "--replicas: must be an integer >= 1, got 0"),
    (dict(replicas=4097), "--replicas: must be in [1, 4096], got 4097"),
    (dict(routers=("jsq",)), "--routers and --metrics-staleness-ms: a cluster's settings, with --replicas R > 1"),
    (dict(routers=()), "a cluster's settings"),
    (dict(replicas=2, routers=()), "--routers: need at least one; valid: round-robin"),
    (dict(replicas=2, agents=("no/such/agent",)), "--agent: agents are judged on a single engine"),
    (dict(metrics_staleness_ms=5.0), "a cluster's settings"),
    (dict(replicas=2, routers=("nope",)), "routers: unknown router 'nope'; valid: round-robin"),
    (dict(replicas=2, routers=("jsq", "jsq")), "routers: duplicates"),
    (dict(replicas=2, metrics_staleness_ms=-1.0), "--metrics-staleness-ms: must be a finite number of ms >= 0"),
])
def test_bad_cluster_options_are_one_line(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        T.TuneConfig(**SMALL, **kw)


def test_the_cli_refuses_bad_cluster_options_in_one_line(capsys, tmp_path):
    for argv, msg in [(["--replicas", "0"], "--replicas"), (["--routers", "jsq"], "with --replicas R > 1"),
                      (["--replicas", "2", "--routers", "nope"], "unknown router 'nope'"),
                      (["--replicas", "2", "--routers", ""], "--routers: need at least one value"),
                      (["--replicas", "100000"], "--replicas: must be in [1, 4096], got 100000"),
                      (["--replicas", "2", "--agent", str(tmp_path / "none")], "--agent: agents are judged")]:
        assert T_main(argv + ["--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and msg in err, err
        assert not (tmp_path / "o").exists()


def T_main(argv):
    from tokenbatch_env.tune_cli import main
    return main(argv)


def test_router_parameters_join_the_rows_search_space():
    """prefix-affinity's alpha and beta (engine.cluster.RouterSpec.ranges) are suggested for its rows,
    in their ranges; a router without parameters adds none; every warm start runs the defaults."""
    cfg = T.TuneConfig(**SMALL, replicas=2, routers=("round-robin", "prefix-affinity"))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    (lo_a, hi_a, _), (lo_b, hi_b, _) = ROUTERS["prefix-affinity"].ranges.values()
    seen = set()
    for _ in range(20):
        c = T.suggest_config("prefix-affinity x sjf+shed", study.ask(), cfg.lever_space("prefix-affinity x sjf+shed"))
        a, b = c["router"]["alpha"], c["router"]["beta"]
        assert lo_a <= a <= hi_a and lo_b <= b <= hi_b and "shed_margin" in c and "engine" in c
        seen.add((round(a, 6), round(b, 6)))
    assert len(seen) == 20
    assert "router" not in T.suggest_config("round-robin x sjf+shed", study.ask())
    ws = T.warm_starts("prefix-affinity x index+shed", cfg.lever_space("prefix-affinity x index+shed"))
    assert ws and all(w["router_alpha"] == 0.5 and math.expm1(w["router_log1p_beta"]) == pytest.approx(8.0)
                      for w in ws)
    plain = T.warm_starts("index+shed", cfg.lever_space("index+shed"))
    assert [{k: v for k, v in w.items() if not k.startswith("router_")} for w in ws] == plain
    assert T.warm_starts("round-robin x index+shed", cfg.lever_space("index+shed")) == plain


# ------------------------------------------------------------------ the objective is the benchmark's
CONFIGS = [
    ("prefix-affinity x sjf+shed", {"shed_margin": 0.3, "router": {"alpha": 0.0, "beta": 0.0},
                                    "engine": {"max_num_batched_tokens": 256, "max_num_seqs": 32,
                                               "long_prefill_token_threshold": 0}}),
    ("prefix-affinity x index+shed", {"index": {"kappa": 0.5, "slope": 1.0, "gamma": 2.0, "theta": 0.1, "beta": 1.0,
                                                "w_prefix": 0.5, "a_edf": 1.0},
                                      "shed_margin": 0.1, "router": {"alpha": 2.0, "beta": 30.0}}),
    ("round-robin x edf+shed+tpot-guard", {"shed_margin": 0.2, "engine": {"budget_u": 0.5, "budget_bmin": 0.3}}),
    ("round-robin x fcfs (tuned vLLM flags)", {"engine": {"max_num_batched_tokens": 128, "max_num_seqs": 16,
                                                          "long_prefill_token_threshold": 64}}),
]


@pytest.fixture(scope="module")
def test_objective():
    cfg = T.TuneConfig(**SMALL, replicas=2, routers=("round-robin", "prefix-affinity"), budget_rule="tpot-guard",
                       threads=1)
    return cfg, T.TrainObjective(cfg, "test")


@pytest.mark.parametrize("row, config", CONFIGS)
def test_the_objective_is_the_benchmarks_goodput_of_the_routed_row(test_objective, row, config):
    """The tuning objective of a routed row's config equals the benchmark's goodput of that row run with
    the same values as ``BenchConfig.routed`` (router parameters, margin, levers, rule): the values the
    search scores are the ones the test report judges."""
    cfg, obj = test_objective
    got = obj.goodput_per_unit(row, [config])[0]
    router, plain = row.split(" x ", 1)
    policy = plain.split("+")[0].split(" ")[0]
    rr = RoutedRow(index_params=IndexParams.from_dict(config["index"]) if "index" in config else None,
                   shed_margin=config.get("shed_margin"), levers=tuple(sorted(config.get("engine", {}).items())),
                   router_params=tuple(sorted(config.get("router", {}).items())))
    bc = ev.BenchConfig(suite=cfg.suite, split="test", max_traces=2, loads=(1.2,), policies=(policy,), shed=True,
                        bootstrap_b=200, replicas=2, routers=(router,), upper_bound=False,
                        levers=((plain, {"max_num_seqs": 8}),) if "engine" in config else (),
                        tpot_guard=(0.0, 0.0) if plain.endswith("+tpot-guard") else None,
                        routed=((row, rr),))
    rows = {r["label"]: r for r in ev.run_benchmark(bc).data["loads"][0]["rows"]}
    assert rows[plain]["goodput_per_unit"] == pytest.approx(got.tolist(), rel=1e-12)


def test_router_parameters_change_the_replay(test_objective):
    """alpha = beta = 0 (least-outstanding whenever the cached replica is busier) and a loose balance
    rule route differently: the values tuning searches reach the router."""
    _, obj = test_objective
    row = "prefix-affinity x sjf+shed"
    a, b = obj.goodput_per_unit(row, [{"shed_margin": 0.0, "router": {"alpha": 0.0, "beta": 0.0}},
                                      {"shed_margin": 0.0, "router": {"alpha": 4.0, "beta": 256.0}}])
    assert not np.array_equal(a, b)


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune-cluster") / "out"
    cfg = T.TuneConfig(**SMALL, replicas=2, routers=("round-robin", "prefix-affinity"), trials=3, k=3,
                       baselines=("sjf",), max_test_traces=2, out=str(out))
    res = T.run_tuning(cfg)
    return cfg, out, res


def test_every_routed_row_is_tuned_and_judged_with_its_own_values(tuned):
    cfg, out, res = tuned
    rep = json.loads((out / "report.json").read_text())
    doc = json.loads((out / "best_params.json").read_text())
    assert set(rep["studies"]) == set(cfg.rows)
    assert all(s["trials"] == cfg.trials for s in rep["studies"].values())
    part = doc["cluster"]
    assert part["replicas"] == 2 and part["routers"] == list(cfg.routers)
    assert set(part["rows"]) == set(cfg.rows)
    for row, v in part["rows"].items():
        best = rep["studies"][row]["best"]["config"]
        assert v.get("shed_margin") == best.get("shed_margin") and v.get("levers") == best.get("engine")
        assert ("router" in v) == row.startswith("prefix-affinity")
    # the top level: the first router's rows (a file every reader loads)
    assert doc["shed_margin"] == part["rows"]["round-robin x index+shed"]["shed_margin"]
    assert doc["levers"]["sjf+shed"] == part["rows"]["round-robin x sjf+shed"]["levers"]
    # the test report: every row behind each router, each with its own values
    test = rep["test"]
    assert test["cluster"]["replicas"] == 2 and test["cluster"]["routers"] == list(cfg.routers)
    pols = {p["label"]: p for p in test["evidence_inputs"]["policies"]}
    for row, v in part["rows"].items():
        p = pols[row]
        assert p.get("levers") == v.get("levers") and p.get("router_params") == v.get("router")
        if "shed_margin" in v:
            assert p["shed_margin"] == v["shed_margin"]
    # a routed row's train goodput is what its study's best trial scored
    assert doc["tuned"]["train_goodput"] == {r: s["best"]["train_goodput"] for r, s in rep["studies"].items()}


def test_bench_with_the_parameters_reproduces_the_test_report(tuned, tmp_path, capsys):
    cfg, out, _ = tuned
    rep = json.loads((out / "report.json").read_text())
    argv = ["bench", "--suite", cfg.suite, "--split", "test", "--loads", "1.2", "--replicas", "2", "--routers",
            ",".join(cfg.routers), "--policies", ",".join(T.test_policies(cfg)), "--max-traces", "2",
            "--bootstrap-b", "200", "--params", str(out / "best_params.json"), "--shed", "--quiet",
            "--out", str(tmp_path / "b")]
    assert cli.main(argv) == 0
    again = json.loads((tmp_path / "b" / "report.json").read_text())
    assert again["evidence_id"] == rep["test_evidence_id"]
    # on another replica count: a warning, the values kept
    capsys.readouterr()
    argv[argv.index("--replicas") + 1], argv[-1] = "3", str(tmp_path / "c")
    assert cli.main(argv) == 0
    assert "tuned on 2 replicas, benchmarked on 3" in capsys.readouterr().err


@pytest.mark.parametrize("rows, msg", [
    ({"nope x sjf+shed": {}}, "row 'nope x sjf+shed' is not '<router> x <row>' with a known router"),
    ({"round-robin x sjf+shed": {"router": {"alpha": 1.0}}}, "row 'round-robin x sjf+shed': router"),
    ({"prefix-affinity x sjf+shed": {"router": {"alpha": -1.0}}}, "alpha must be a finite number >= 0"),
    ({"prefix-affinity x sjf+shed": {"shed_margin": 7}}, "shed_margin must be in [0"),
    ({"prefix-affinity x sjf+shed": {"what": 1}}, "unknown: what"),
    ({"prefix-affinity x sjf+shed": {"levers": {"max_num_seqs": -3}}}, "max_num_seqs"),
    ({"prefix-affinity x bogus": {"shed_margin": 0.1}}, "'bogus' is not a tuned row"),
    ({"prefix-affinity x sjf": {"shed_margin": 0.1}}, "'sjf' is not a tuned row"),
    ({"prefix-affinity x sjf+shed": {"index": {}}}, "keys among shed_margin, levers, router (unknown: index)"),
    ({"round-robin x fcfs (tuned vLLM flags)": {"shed_margin": 0.1}}, "keys among levers, router"),
    ({"prefix-affinity x sjf+shed": {"router": {"alpha": True}}}, "router.alpha: must be a number, got True"),
    ({"prefix-affinity x index+shed": {"index": 5}}, "index: must be an object of IndexParams fields"),
])
def test_a_bad_cluster_part_is_one_line_naming_file_and_row(tmp_path, capsys, rows, msg):
    p = tmp_path / "p.json"
    part = {"replicas": 2, "routers": ["round-robin", "prefix-affinity"], "rows": rows}
    p.write_text(json.dumps({"shed_margin": 0.0, "cluster": part}))
    with pytest.raises(ConfigError) as e:
        load_routed(str(p))
    assert str(p) in str(e.value) and msg in str(e.value), str(e.value)
    assert cli.main(["bench", "--replicas", "2", "--params", str(p), "--max-traces", "1", "--quiet",
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err
    assert not (tmp_path / "o").exists()


def test_bench_config_checks_routed_rows():
    base = dict(replicas=2, routers=("round-robin",), upper_bound=False)
    with pytest.raises(ConfigError, match="not '<router> x <row>' with a router of this benchmark"):
        ev.BenchConfig(**base, routed=(("jsq x sjf+shed", RoutedRow()),))
    with pytest.raises(ConfigError, match="router round-robin has no parameter"):
        ev.BenchConfig(**base, routed=(("round-robin x sjf+shed", RoutedRow(router_params=(("beta", 1.0),))),))
    with pytest.raises(ConfigError, match="a cluster's settings"):
        ev.BenchConfig(routed=(("round-robin x sjf+shed", RoutedRow()),))
    assert set(ROUTER_NAMES) >= set(TUNED_ROUTERS) == {"prefix-affinity"}


ROW = {"round-robin x sjf+shed": {"shed_margin": 0.1}}


@pytest.mark.parametrize("part, msg", [
    ({"replicas": 2, "routers": 5, "rows": ROW}, "routers must be a non-empty list of distinct router names"),
    ({"replicas": 2, "routers": ["nope"], "rows": ROW}, "routers must be a non-empty list"),
    ({"replicas": 2, "rows": ROW}, "routers must be a non-empty list"),
    ({"replicas": 2, "routers": [], "rows": ROW}, "routers must be a non-empty list"),
    ({"replicas": 2, "routers": ["round-robin", "round-robin"], "rows": ROW}, "routers must be a non-empty list"),
    ({"replicas": 2, "routers": ["round-robin"], "metrics_staleness_ms": "x", "rows": ROW},
     "metrics_staleness_ms must be a number of ms >= 0"),
    ({"replicas": 1, "routers": ["round-robin"], "rows": ROW}, "replicas must be an integer >= 2"),
    (None, "with at least one row, got null"),
    ({"replicas": 2, "routers": ["round-robin"], "rows": {}}, "with at least one row"),
    ({"replicas": 2, "routers": ["round-robin"], "rows": {"prefix-affinity x sjf+shed": {}}},
     "row 'prefix-affinity x sjf+shed' is behind prefix-affinity, not one of routers ['round-robin']"),
])
def test_a_bad_cluster_header_is_one_line(tmp_path, part, msg):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"cluster": part}))
    with pytest.raises(ConfigError) as e:
        load_routed(str(p))
    assert msg in str(e.value), str(e.value)


def test_each_row_behind_a_router_runs_the_values_tuned_behind_it():
    """The rows a cluster tuning did not tune themselves take the values of the row they derive from,
    behind the same router: a +tpot-guard copy its row's (margin, levers, router); the no-shed rows
    the router's (and the index's) parameters of their +shed row, fcfs and priority of their
    tuned-flags row; the twins their row's at the profile's flags. Another router's rows are not
    touched."""
    from tokenbatch_env.evaluate.rows import build_rows
    ip = IndexParams(kappa=0.25)
    a = (("alpha", 3.0), ("beta", 2.0))
    lv = (("max_num_batched_tokens", 256),)
    routed = (("prefix-affinity x index+shed", RoutedRow(ip, 0.2, lv, a)),
              ("prefix-affinity x sjf+shed", RoutedRow(None, 0.9, lv, (("alpha", 1.0), ("beta", 0.0)))),
              ("prefix-affinity x fcfs (tuned vLLM flags)", RoutedRow(None, None, lv, (("alpha", 0.0), ("beta", 5.0)))))
    cfg = ev.BenchConfig(policies=("fcfs", "sjf", "index"), shed=True, replicas=2, upper_bound=False,
                         routers=("round-robin", "prefix-affinity"), tpot_guard=(0.0, 0.0), routed=routed,
                         levers=(("sjf+shed", {"max_num_seqs": 8}), ("fcfs (tuned vLLM flags)", {"max_num_seqs": 8})))
    rows = {r.label: r for r in build_rows(cfg)}
    pa = lambda x: rows[f"prefix-affinity x {x}"]  # noqa: E731
    assert pa("sjf+shed").shed_margin == 0.9 and pa("sjf+shed").levers == lv
    assert pa("sjf+shed+tpot-guard").shed_margin == 0.9 and pa("sjf+shed+tpot-guard").levers == lv
    assert pa("sjf+shed+tpot-guard").router_params == (("alpha", 1.0), ("beta", 0.0))
    twin = pa("sjf+shed (profile flags)")
    assert twin.shed_margin == 0.9 and twin.levers == () and twin.router_params == (("alpha", 1.0), ("beta", 0.0))
    for x in ("index", "index+tpot-guard", "index+shed", "index+shed+tpot-guard"):
        assert pa(x).index_params == ip and pa(x).router_params == a, x
    assert pa("sjf").router_params == (("alpha", 1.0), ("beta", 0.0)) and pa("sjf").levers == ()
    assert pa("fcfs").router_params == (("alpha", 0.0), ("beta", 5.0)) and pa("fcfs").levers == ()
    assert pa("fcfs (tuned vLLM flags)").levers == lv
    assert pa("edf+shed").router_params == () and pa("edf+shed").shed_margin == 0.0   # (not tuned: defaults)
    for label, r in rows.items():
        if label.startswith("round-robin x "):
            assert r.router_params == () and r.index_params is None, label


def test_bench_says_what_does_not_match_the_tuning(tuned, tmp_path, capsys):
    cfg, out, _ = tuned
    p = str(out / "best_params.json")
    base = ["bench", "--suite", cfg.suite, "--split", "test", "--loads", "1.2", "--policies", "sjf", "--max-traces",
            "1", "--bootstrap-b", "200", "--params", p, "--quiet"]
    assert cli.main([*base, "--replicas", "2", "--routers", "round-robin,jsq", "--metrics-staleness-ms", "5",
                     "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "rows tuned behind prefix-affinity not benchmarked (add --routers round-robin,prefix-affinity)" in err
    assert "no rows tuned behind jsq" in err and "tuned with metrics staleness 0 ms, benchmarked with 5 ms" in err
    assert cli.main([*base, "--out", str(tmp_path / "b")]) == 0
    assert "tuned on a cluster of 2 replicas; one engine runs its top level (the rows behind round-robin)" \
        in capsys.readouterr().err


def test_a_trace_tunings_objective_says_it_scores_windows():
    """The objective of a trace tuning (and so a resumed study's check and its evidence ids) names the
    scoring of each window's requests only: a study scored with the warm-up and cool-down is not resumed."""
    d = T.TuneConfig(trace=__file__, out="/tmp/x")   # (any existing file: only the config is read)
    assert d.objective_dict()["scored"] == "window"
    assert "scored" not in T.TuneConfig().objective_dict()


def test_bench_warns_when_a_single_engines_file_runs_routers_with_parameters(tmp_path, capsys):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"shed_margin": 0.1}))
    base = ["bench", "--loads", "1.2", "--policies", "sjf", "--max-traces", "1", "--bootstrap-b", "200",
            "--params", str(p), "--quiet", "--replicas", "2"]
    assert cli.main([*base, "--routers", "round-robin,prefix-affinity", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "tuned on one engine: prefix-affinity run at their default parameters" in err, err
    assert cli.main([*base, "--routers", "round-robin,jsq", "--out", str(tmp_path / "b")]) == 0
    assert "warning" not in capsys.readouterr().err   # (no router with parameters: nothing to say)
