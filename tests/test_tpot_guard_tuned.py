"""The tpot-guard rule's u and B_min as tuned parameters (docs/design.md section 11): the index's and
each baseline's +shed row get a ``+tpot-guard`` twin that tunes them with the rest; a parameters
file keeps the twins' policy parameters and levers; the benchmark runs each twin with its own."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenbatch_env.engine.levers import FLAGS_SUFFIX, GUARD_LEVERS, GUARD_SUFFIX, LEVERS, check_levers, with_levers
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError, TokenBatchError

optuna = pytest.importorskip("optuna")

from tokenbatch_env import tuning as T  # noqa: E402

GUARD_INDEX = T.INDEX_ROW + GUARD_SUFFIX


def test_guard_rows_and_their_space():
    """With the rule: a twin of the index's and each baseline's +shed row, after them; its space is
    the row's levers plus u in [-0.5, 2] and B_min in [0, 1] (references: the rule's defaults), also
    with --no-levers; other rows' spaces are unchanged; the rule stays out of the config's dict when
    off (the evidence ids of runs without it do not move)."""
    cfg = T.TuneConfig(budget_rule="tpot-guard", comparators=False)
    assert cfg.rows == (T.INDEX_ROW, "edf+shed", "sjf+shed", "llf+shed", *T.FLAGS_ROWS, GUARD_INDEX,
                        "edf+shed" + GUARD_SUFFIX, "sjf+shed" + GUARD_SUFFIX, "llf+shed" + GUARD_SUFFIX)
    sp = cfg.lever_space(GUARD_INDEX)
    assert sp == {**cfg.lever_space(T.INDEX_ROW), "budget_u": [-0.5, 2.0, 0.0], "budget_bmin": [0.0, 1.0, 0.0]}
    # the twins come last: the other rows keep their place, so their samplers' seeds
    full = T.TuneConfig(budget_rule="tpot-guard")
    assert full.rows[:len(T.TuneConfig().rows)] == T.TuneConfig().rows
    assert cfg.lever_space(T.INDEX_ROW) == T.TuneConfig().lever_space(T.INDEX_ROW)
    assert T.TuneConfig(budget_rule="tpot-guard", levers=False).lever_space("edf+shed" + GUARD_SUFFIX) == {
        "budget_u": [-0.5, 2.0, 0.0], "budget_bmin": [0.0, 1.0, 0.0]}
    assert T.TuneConfig(levers=False).lever_space("edf+shed") is None
    assert "budget_rule" not in T.TuneConfig().to_dict()
    assert cfg.to_dict()["budget_rule"] == "tpot-guard"
    assert T.row_kind(GUARD_INDEX) == "index" and T.row_kind("sjf+shed" + GUARD_SUFFIX) == "margin"
    with pytest.raises(ConfigError, match="budget_rule: unknown 'tpot'; valid: none, tpot-guard"):
        T.TuneConfig(budget_rule="tpot")


@pytest.mark.parametrize("levers", [True, False])
def test_guard_suggestions_and_warm_starts(levers):
    """Every drawn trial of a twin: u and B_min in range beside the row's own parameters, a valid
    engine configuration with the rule on; its warm starts are the row's at the rule's defaults and
    the last has B_min 1 (the rule never lowers the budget); enqueued, a warm start gives u 0, B_min 0."""
    cfg = T.TuneConfig(budget_rule="tpot-guard", levers=levers)
    sp = cfg.lever_space(GUARD_INDEX)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5), direction="maximize")
    for _ in range(100):
        t = study.ask()
        c = T.suggest_config(GUARD_INDEX, t, sp)
        lv = c["engine"]
        assert set(lv) == set(GUARD_LEVERS) | (set(LEVERS) if levers else set())
        assert -0.5 <= lv["budget_u"] <= 2.0 and 0.0 <= lv["budget_bmin"] <= 1.0
        eng = with_levers(EngineConfig(), lv)
        assert eng.budget_rule == "tpot-guard" and eng.guard[1:] == (lv["budget_u"], lv["budget_bmin"])
        assert "index" in c and "shed_margin" in c
        study.tell(t, 0.0)
    ws = T.warm_starts(GUARD_INDEX, sp)
    plain = T.warm_starts(T.INDEX_ROW, cfg.lever_space(T.INDEX_ROW))
    assert len(ws) == len(plain) + 1
    for w, p in zip(ws, plain):
        assert w == {**p, "budget_u": 0.0, "budget_bmin": 0.0}
    assert ws[-1]["budget_bmin"] == 1.0
    study = optuna.create_study()
    study.enqueue_trial(ws[0])
    c = T.suggest_config(GUARD_INDEX, study.ask(), sp)
    assert (c["engine"]["budget_u"], c["engine"]["budget_bmin"]) == (0.0, 0.0)


def test_guard_levers_are_validated():
    assert check_levers({"budget_u": 0.5, "budget_bmin": 1}, "x", guard=True) == (("budget_bmin", 1.0),
                                                                                  ("budget_u", 0.5))
    with pytest.raises(ConfigError, match=r"x: unknown lever 'budget_u' \(budget_u is a lever of \+tpot-guard rows\)"):
        check_levers({"budget_u": 0.5}, "x")
    with pytest.raises(ConfigError, match=r"x: budget_bmin must be a number in \[0, 1\], got 1.5"):
        check_levers({"budget_bmin": 1.5}, "x", guard=True)
    with pytest.raises(ConfigError, match=r"x: budget_u must be a number in \[-0.5, 2\], got True"):
        check_levers({"budget_u": True}, "x", guard=True)


def _write(tmp_path, doc, name="p.json"):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def test_params_file_guard_part(tmp_path):
    """``"tpot-guard"`` holds the twins' own policy parameters; the twins' levers may hold u and
    B_min, no other row's may; a twin of a flags row is refused."""
    from tokenbatch_env.params import load_guard_params, load_levers, load_params_file
    from tokenbatch_env.policies import IndexParams
    doc = {"index": {}, "shed_margin": 0.0, "tpot-guard": {"index": {"kappa": 2.0}, "shed_margin": 0.25,
                                                           "edf": {"shed_margin": 0.5}},
           "levers": {GUARD_INDEX: {"budget_u": 0.5, "budget_bmin": 0.2, "max_num_batched_tokens": 512}}}
    good = _write(tmp_path, doc)
    params, margins = load_guard_params(good)
    assert params == IndexParams(kappa=2.0) and margins == (("edf", 0.5), ("index", 0.25))
    assert load_params_file(good)[0] == IndexParams()
    assert load_levers(good) == ((GUARD_INDEX, (("budget_bmin", 0.2), ("budget_u", 0.5),
                                                ("max_num_batched_tokens", 512))),)
    assert load_guard_params(_write(tmp_path, {"index": {}}, "plain.json")) is None
    for bad, msg in [({"tpot-guard": {"weights": {}}}, "'tpot-guard' must be an object with keys among"),
                     ({"tpot-guard": {"edf": {"shed_margin": -1}}}, "p.json: tpot-guard: edf.shed_margin"),
                     ({"tpot-guard": {"index": {"kappa": "x"}}}, "p.json: tpot-guard"),
                     ({"levers": {"edf+shed": {"budget_u": 0.1}}}, "unknown lever 'budget_u'"),
                     ({"levers": {"fcfs" + FLAGS_SUFFIX + GUARD_SUFFIX: {"budget_u": 0.1}}}, "not a row with levers"),
                     ({"levers": {"edf+shed" + GUARD_SUFFIX: {"budget_u": 3}}}, r"budget_u must be a number in")]:
        with pytest.raises(TokenBatchError, match=msg):
            load_params_file(_write(tmp_path, bad))


def test_a_partial_guard_part_falls_back_to_the_rows_own(tmp_path):
    """What a file's "tpot-guard" part leaves out is the row's without the rule: the index's parameters
    and margin, each policy's margin (the weights row's too, which the part cannot hold)."""
    from tokenbatch_env.evaluate import BenchConfig, build_rows
    from tokenbatch_env.evaluate.rows import row_index_params
    from tokenbatch_env.params import load_guard_params, load_params_file
    from tokenbatch_env.policies import IndexParams
    path = _write(tmp_path, {"index": {"kappa": 1.5}, "shed_margin": 0.1, "sjf": {"shed_margin": 0.2},
                             "weights": {"shed_margin": 0.6}, "tpot-guard": {"edf": {"shed_margin": 0.5}}})
    params, margins = load_params_file(path)
    gp, gm = load_guard_params(path)
    assert gp is None and gm == (("edf", 0.5),)
    cfg = BenchConfig(policies=("sjf", "edf", "index", "weights"), shed=True, index_params=params,
                      shed_margins=margins, tpot_guard=(0.0, 0.0), guard_index_params=gp, guard_shed_margins=gm)
    rows = {r.label: r for r in build_rows(cfg)}
    assert rows[GUARD_INDEX].shed_margin == 0.1 and row_index_params(rows[GUARD_INDEX], cfg) == IndexParams(kappa=1.5)
    assert rows["sjf+shed" + GUARD_SUFFIX].shed_margin == 0.2
    assert rows["edf+shed" + GUARD_SUFFIX].shed_margin == 0.5
    assert rows["weights+shed" + GUARD_SUFFIX].shed_margin == 0.6


def test_bench_runs_each_twin_with_its_own_parameters(tmp_path):
    """``bench --params`` with a file tuned with the rule: the +tpot-guard rows appear without
    ``--budget-rule``; index+shed+tpot-guard runs with its own index parameters, margin, flags, u
    and B_min (its goodput per unit is that configuration simulated directly); a row without tuned
    values runs at the rule's defaults; the tuned values enter the evidence id."""
    import argparse

    from tokenbatch_env.bench_cli import config_from_args, configure

    def build_parser():
        p = argparse.ArgumentParser()
        configure(p)
        return p
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate import goodput_matrix, run_benchmark
    from tokenbatch_env.policies import IndexParams, engine_policy
    from tokenbatch_env.workload import prepare_workload

    gl = {"budget_u": 0.5, "budget_bmin": 0.1, "max_num_batched_tokens": 1024}
    doc = {"index": {}, "shed_margin": 0.0, "tpot-guard": {"index": {"kappa": 3.0, "a_edf": 1.0}, "shed_margin": 0.3},
           "levers": {GUARD_INDEX: gl}}
    path = _write(tmp_path, doc)
    argv = ["--policies", "fcfs,index", "--shed", "--loads", "1.2", "--max-traces", "3", "--bootstrap-b", "200",
            "--params", path]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.tpot_guard == (0.0, 0.0)
    cfg = cfg.__class__(**{**cfg.__dict__, "upper_bound": False})
    rep = run_benchmark(cfg).data
    rows = {d["label"]: d for d in rep["loads"][0]["rows"]}
    assert rows[GUARD_INDEX]["tpot_guard"] == {"u": 0.5, "bmin": 0.1}
    assert rows[GUARD_INDEX]["levers"] == gl
    assert rows["fcfs" + GUARD_SUFFIX]["tpot_guard"] == {"u": 0.0, "bmin": 0.0}
    assert rows[GUARD_INDEX]["shed_margin"] == 0.3 and rows["index+shed"]["shed_margin"] == 0.0
    assert "index+shed" in rows[GUARD_INDEX]["vs"]
    prof = load_profile(cfg.profile)
    wl = prepare_workload(cfg, prof)
    if cfg.t_ref_ms is not None:
        wl.t_ref_ms = cfg.t_ref_ms
    pol = engine_policy("index", params=IndexParams(kappa=3.0, a_edf=1.0), shed_margin=0.3, t_ref_ms=wl.t_ref_ms)
    direct = goodput_matrix(wl.at(1.2), 1, prof, pol, configs=[with_levers(EngineConfig(), gl)],
                            estimates=wl.estimates(), residual_life=wl.residual_life, scored=wl.scored)[0]
    np.testing.assert_allclose(direct, rows[GUARD_INDEX]["goodput_per_unit"])
    doc["levers"][GUARD_INDEX]["budget_u"] = 0.25
    other = config_from_args(build_parser().parse_args(argv[:-1] + [_write(tmp_path, doc, "q.json")]))
    other = other.__class__(**{**other.__dict__, "upper_bound": False})
    assert run_benchmark(other).evidence_id != rep["evidence_id"]


def test_tuning_with_the_rule_end_to_end(tmp_path):
    """A tiny tuning run with the rule: a study per twin with the same budget, u and B_min in every
    twin trial's engine config, the parameters file's ``"tpot-guard"`` part and the twins' levers,
    and the test report's twins run with their tuned values."""
    from tokenbatch_env.params import load_guard_params, load_levers
    cfg = T.TuneConfig(trials=3, k=3, baselines=("sjf",), out=str(tmp_path), progress=False, comparators=False,
                       levers=False, max_train_traces=2, max_test_traces=2, eval_loads=(1.2,), bootstrap_b=200,
                       budget_rule="tpot-guard")
    res = T.run_tuning(cfg)
    data = res["data"]
    assert set(data["studies"]) == {T.INDEX_ROW, "sjf+shed", GUARD_INDEX, "sjf+shed" + GUARD_SUFFIX}
    for row, s in data["studies"].items():
        assert s["trials"] == 3
        for h in s["history"]:
            assert ("engine" in h["config"]) == row.endswith(GUARD_SUFFIX)
    params = str(tmp_path / "best_params.json")
    assert load_guard_params(params) is not None
    lv = dict(load_levers(params))
    assert set(lv) == {GUARD_INDEX, "sjf+shed" + GUARD_SUFFIX}
    rows = {d["label"]: d for d in data["test"]["loads"][0]["rows"]}
    for label in lv:
        tuned = dict(lv[label])
        assert rows[label]["tpot_guard"] == {"u": tuned["budget_u"], "bmin": tuned["budget_bmin"]}
    assert "tpot-guard: the index's and each baseline's +shed row have a +tpot-guard twin" in \
        (tmp_path / "report.md").read_text()


def test_twin_levers_alone_add_the_twins_and_budget_rule_none_leaves_them_out(tmp_path):
    """A file whose only trace of the rule is a twin's levers adds the +tpot-guard rows as a file with a
    "tpot-guard" part does; an explicit ``--budget-rule none`` leaves them out (and says how to add them)."""
    import argparse

    from tokenbatch_env.bench_cli import config_from_args, configure
    from tokenbatch_env.evaluate import build_rows
    path = _write(tmp_path, {"index": {}, "edf": {"shed_margin": 0.2},
                             "levers": {"edf+shed" + GUARD_SUFFIX: {"budget_u": 0.4, "budget_bmin": 0.3}}})
    p = argparse.ArgumentParser()
    configure(p)
    base = ["--policies", "fcfs,edf", "--shed", "--params", path]
    cfg = config_from_args(p.parse_args(base))
    rows = {r.label: r for r in build_rows(cfg)}
    assert "edf+shed" + GUARD_SUFFIX in rows and cfg.tpot_guard == (0.0, 0.0)
    assert rows["edf+shed" + GUARD_SUFFIX].shed_margin == 0.2
    off = config_from_args(p.parse_args(base + ["--budget-rule", "none"]))
    assert off.tpot_guard is None
    assert not any(r.guard for r in build_rows(off))
