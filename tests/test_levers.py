"""The iteration-size levers as tuned rows (docs/design.md section 11): the search space (bounded by
the profile's B_max, vLLM's constraints), the warm starts, a parameters file's levers, and the
benchmark's levered rows beside themselves at the profile's flags."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tokenbatch_env.engine.levers import FLAGS_SUFFIX, LEVERS, check_levers, with_levers
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError

optuna = pytest.importorskip("optuna")

from tokenbatch_env import tuning as T  # noqa: E402


def _space(profile="stress-512", **kw):
    return T.TuneConfig(profile=profile, **kw).lever_space(T.INDEX_ROW)


def test_lever_space_is_bounded_by_the_profile():
    """B up to the profile's B_max (its B by default), max_num_seqs up to its own, the threshold up
    to B_max; the references are the profile's flags, threshold off; no levers for the
    index-scheduled buckets or with --no-levers."""
    sp = _space()
    assert sp == {"max_num_batched_tokens": [64, 2048, 2048], "max_num_seqs": [8, 256, 256],
                  "long_prefill_token_threshold": [16, 2048, 0]}
    assert T.TuneConfig().lever_space("index@rho1.2") is None
    assert T.TuneConfig(levers=False).lever_space(T.INDEX_ROW) is None
    assert T.TuneConfig(levers=False).rows == (T.INDEX_ROW, "edf+shed", "sjf+shed", "llf+shed", "weights+shed",
                                               "index@rho1", "index@rho1.2", "index@rho1.5")
    assert set(T.FLAGS_ROWS) <= set(T.TuneConfig().rows)
    assert T.TuneConfig(comparators=False).rows == (T.INDEX_ROW, "edf+shed", "sjf+shed", "llf+shed",
                                                    *T.FLAGS_ROWS)
    # a profile with a larger B_max: the budget range reaches it
    from tokenbatch_env.engine.profiles import load_profile
    big = dataclasses.replace(load_profile("stress-512"), name="big", b_max=8192)
    import tokenbatch_env.engine.profiles as P
    orig = P.load_profile
    try:
        P.load_profile = lambda name: big if name == "big" else orig(name)
        cfg = T.TuneConfig.__new__(T.TuneConfig)
        object.__setattr__(cfg, "levers", True)
        object.__setattr__(cfg, "profile", "big")
        assert cfg.lever_space(T.INDEX_ROW)["max_num_batched_tokens"] == [64, 8192, 2048]
    finally:
        P.load_profile = orig


@pytest.mark.parametrize("row", [T.INDEX_ROW, "edf+shed", T.FLAGS_ROWS[0], T.WEIGHTS_ROW])
def test_suggested_levers_respect_vllm(row):
    """Every drawn trial: levers in range, max_num_seqs <= the budget (vLLM refuses more), a
    threshold at or above the budget written as off; the row's own parameters beside them."""
    sp = _space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3), direction="maximize")
    seen_off = seen_on = False
    for _ in range(200):
        t = study.ask()
        c = T.suggest_config(row, t, sp)
        lv = c["engine"]
        assert set(lv) == set(LEVERS)
        B, S, thr = lv["max_num_batched_tokens"], lv["max_num_seqs"], lv["long_prefill_token_threshold"]
        assert 64 <= B <= 2048 and 1 <= S <= min(B, 256)
        assert thr == 0 or 16 <= thr < B
        seen_off |= thr == 0
        seen_on |= thr > 0
        EngineConfig(**lv)   # a valid engine config
        assert ("shed_margin" in c) == (row not in T.FLAGS_ROWS)
        study.tell(t, 0.0)
    assert seen_off and seen_on


def test_warm_starts_include_the_profile_flags():
    """A levered row's warm starts are its policy warm starts at the profile's flags (so the search
    can always fall back to the unlevered optimum), then a quarter of the budget; a flags row starts
    at the profile's flags."""
    sp = _space()
    ws = T.warm_starts(T.INDEX_ROW, sp)
    base = T.warm_starts(T.INDEX_ROW)
    assert len(ws) == len(base) + 1
    for w, b in zip(ws, base):
        assert w == {**b, "max_num_batched_tokens": 2048, "max_num_seqs": 256, "long_prefill_token_threshold": 2048}
    assert ws[-1]["max_num_batched_tokens"] == 512
    flags = T.warm_starts(T.FLAGS_ROWS[0], sp)
    assert flags[0] == {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "long_prefill_token_threshold": 2048}
    # enqueued, they give the profile's flags (threshold off) through suggest_config
    study = optuna.create_study()
    study.enqueue_trial(ws[0])
    c = T.suggest_config(T.INDEX_ROW, study.ask(), sp)
    assert c["engine"] == {"max_num_batched_tokens": 2048, "max_num_seqs": 256, "long_prefill_token_threshold": 0}


def test_check_levers_errors():
    assert check_levers({"max_num_seqs": 4, "max_num_batched_tokens": 256}, "x") == (
        ("max_num_batched_tokens", 256), ("max_num_seqs", 4))
    with pytest.raises(ConfigError, match="x: unknown lever 'num_blocks'"):
        check_levers({"num_blocks": 4}, "x")
    with pytest.raises(ConfigError, match="x: max_num_seqs must be an integer >= 1, got 0"):
        check_levers({"max_num_seqs": 0}, "x")
    with pytest.raises(ConfigError, match="long_prefill_token_threshold must be an integer >= 0"):
        check_levers({"long_prefill_token_threshold": 1.5}, "x")
    assert with_levers(EngineConfig(), {}) == EngineConfig()
    assert with_levers(EngineConfig(), (("max_num_seqs", 4),)).max_num_seqs == 4


def _params_file(tmp_path, levers, name="p.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"index": {}, "shed_margin": 0.0, "edf": {"shed_margin": 0.0}, "levers": levers}))
    return str(p)


def test_params_file_levers_are_validated(tmp_path):
    from tokenbatch_env.params import load_levers, load_params_file
    good = _params_file(tmp_path, {"edf+shed": {"max_num_batched_tokens": 512},
                                   "fcfs" + FLAGS_SUFFIX: {"max_num_seqs": 16}})
    assert load_levers(good) == (("edf+shed", (("max_num_batched_tokens", 512),)),
                                 ("fcfs" + FLAGS_SUFFIX, (("max_num_seqs", 16),)))
    for bad, msg in [({"nope+shed": {"max_num_seqs": 4}}, "'nope\\+shed' is not a row with levers"),
                     ({"sjf" + FLAGS_SUFFIX: {"max_num_seqs": 4}}, "is not a row with levers"),
                     ({"edf+shed": {"max_num_seqs": -1}}, r"levers\['edf\+shed'\]: max_num_seqs must be"),
                     ({"edf+shed": {"block_size": 32}}, "unknown lever 'block_size'")]:
        with pytest.raises(ConfigError, match=msg):
            load_params_file(_params_file(tmp_path, bad, "bad.json"))
    p = tmp_path / "list.json"
    p.write_text(json.dumps({"levers": [1, 2]}))
    with pytest.raises(ConfigError, match="'levers' must be an object"):
        load_params_file(str(p))


def test_bench_levered_rows_and_their_twins(tmp_path):
    """``bench --params`` with levers: each levered row runs with them (its goodput per unit equals
    that row simulated with the levered engine config on the same units), beside its twin at the
    profile's flags (equal to the row of a bench without levers); its ``vs`` holds the levers' paired
    gain; the flags rows of FCFS and priority are twinned with the plain rows; levers enter the
    evidence id."""
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate import BenchConfig, goodput_matrix, run_benchmark
    from tokenbatch_env.params import load_levers
    from tokenbatch_env.policies import engine_policy
    from tokenbatch_env.workload import prepare_workload

    lv = {"edf+shed": {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 64},
          "priority" + FLAGS_SUFFIX: {"max_num_batched_tokens": 512, "max_num_seqs": 32}}
    base = dict(policies=("fcfs", "edf"), shed=True, loads=(1.2,), max_traces=3, bootstrap_b=200,
                upper_bound=False)
    plain = run_benchmark(BenchConfig(**base)).data
    rep = run_benchmark(BenchConfig(**base, levers=load_levers(_params_file(tmp_path, lv)))).data
    rows = {d["label"]: d for d in rep["loads"][0]["rows"]}
    prow = {d["label"]: d for d in plain["loads"][0]["rows"]}
    assert set(rows) == set(prow) | {"edf+shed (profile flags)", "priority", "priority" + FLAGS_SUFFIX}
    assert rows["edf+shed (profile flags)"]["goodput_per_unit"] == prow["edf+shed"]["goodput_per_unit"]
    assert rows["edf+shed"]["levers"] == lv["edf+shed"]
    assert rows["edf+shed"]["profile_flags_row"] == "edf+shed (profile flags)"
    gain = rows["edf+shed"]["vs"]["edf+shed (profile flags)"]
    g, g0 = np.array(rows["edf+shed"]["goodput_per_unit"]), np.array(prow["edf+shed"]["goodput_per_unit"])
    assert gain["diff"] == pytest.approx(float((g - g0).mean()))
    assert not np.array_equal(g, g0)
    assert rows["priority" + FLAGS_SUFFIX]["profile_flags_row"] == "priority"
    # the index+shed row is judged against every tuned row, vLLM's flags rows included
    assert {"edf+shed", "priority" + FLAGS_SUFFIX} <= set(rows["index+shed"]["vs"])
    assert rep["evidence_id"] != plain["evidence_id"]
    # the levered row is that row simulated with the levered engine config
    cfg = BenchConfig(**base)
    prof = load_profile(cfg.profile)
    wl = prepare_workload(cfg, prof)
    units = wl.at(1.2)
    pol = engine_policy("edf", shed_margin=0.0, t_ref_ms=wl.t_ref_ms)
    direct = goodput_matrix(units, 1, prof, pol, configs=[with_levers(EngineConfig(), lv["edf+shed"])],
                            estimates=wl.estimates(), residual_life=wl.residual_life, scored=wl.scored)[0]
    np.testing.assert_allclose(direct, g)
    md = run_benchmark(BenchConfig(**base, levers=load_levers(_params_file(tmp_path, lv))))
    assert "Tuned levers at rho 1.2" in md.to_markdown()
    assert "--long-prefill-token-threshold 64" in md.summary_text()


def test_tpot_only_misses_are_counted():
    """``tpot_only_missed``: completed, first token within its TTFT SLO, TPOT over its SLO; a TTFT
    miss is not one, nor is a met request."""
    from engine_helpers import tiny_trace
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.evaluate import pooled_metrics, request_outcomes
    # linear profile: a decode iteration takes ~5 ms; request 0's TPOT SLO 1 ms (missed), request 1's
    # 100 ms (met), request 2's TTFT SLO 1 ms (missed on TTFT, not counted)
    tr = tiny_trace([0, 0, 0], [16, 16, 16], [5, 5, 5], t1_ms=np.array([500.0, 500.0, 1.0]),
                    t2_ms=np.array([1.0, 100.0, 1.0]))
    rec = simulate(tr, "linear").records(0)
    o = request_outcomes(rec, tr)
    assert o["tpot_only_miss"].tolist() == [True, False, False]
    assert pooled_metrics([o], [1, 2, 3, 4], ["c"])["tpot_only_missed"] == 1


def test_levers_beyond_the_profile_are_refused(tmp_path):
    """A hand-written budget above B_max (the upper bound's) or max_num_seqs above the profile's: one
    line naming the row."""
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark
    from tokenbatch_env.params import load_levers
    for lv, msg in [({"edf+shed": {"max_num_batched_tokens": 4096}}, "exceeds the profile's B_max 2048"),
                    ({"edf+shed": {"max_num_seqs": 512}}, "max_num_seqs 512 exceeds the profile's 256")]:
        with pytest.raises(ConfigError, match=msg):
            run_benchmark(BenchConfig(loads=(1.2,), max_traces=1, bootstrap_b=200, upper_bound=False,
                                      levers=load_levers(_params_file(tmp_path, lv))))
