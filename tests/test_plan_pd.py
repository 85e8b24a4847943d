"""Planning a disaggregated deployment (docs/design.md section 13, "Comparisons"; ``plan --pd``): every
figure is an independent replay's, both sides get the same trials, the fewest GPUs is confirmed, the
JSON rows and the command's outputs and bad input."""

import json

import numpy as np
import pytest

from engine_helpers import tiny_trace
from test_plan import _file
from tokenbatch_env import plan as P
from tokenbatch_env import plan_pd as PD
from tokenbatch_env.engine.cluster import simulate_cluster
from tokenbatch_env.engine.disagg import simulate_pd
from tokenbatch_env.engine.levers import lever_space, with_levers
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.metrics import default_block, paired_difference


def _trace(n=300, gap_ms=4.0, seed=5):
    rng = np.random.default_rng(seed)
    return tiny_trace(np.cumsum(rng.exponential(gap_ms, n)), rng.integers(100, 600, n), rng.integers(2, 40, n),
                      t1_ms=300, t2_ms=40)


def _cfg(trace, **kw):
    kw.setdefault("routers", ("least-outstanding",))
    kw.setdefault("policies", ("fcfs",))
    kw.setdefault("max_replicas", 12)
    kw.setdefault("bootstrap_b", 200)
    kw.setdefault("pd_trials", 3)
    kw.setdefault("pd_gpus", (6,))
    return P.PlanConfig(trace, load_profile("linear"), EngineConfig(), pd=True, **kw)


def test_every_pd_figure_is_a_replay_and_the_fewest_gpus_is_confirmed():
    """Each split's goodput (both conventions) and each colocated lever trial's are independent
    replays'; both sides have as many trials; the best of each, the gain's paired CI, and the fewest
    GPUs (meeting the target at G and G + 1, missing at G - 1) follow from them."""
    tr = _trace()
    cfg = _cfg(tr)
    plan = PD.plan_with_pd(cfg)
    pd = plan["pd"]
    prof = load_profile("linear")
    est, rl = P.estimates(tr, P.default_predictor()), P.ResidualLife.from_lengths(tr.output_tokens).table
    ok = P.admitted_uncapped(tr.prompt_tokens, tr.output_tokens, prof.max_model_len)
    pol = P.row_policy(tr, P.PlanRow(pd["router"], pd["policy"], pd["shed"]))

    def split(G, rp):
        res = simulate_pd(tr, prof, pol, EngineConfig(), prefill_replicas=rp, decode_replicas=G - rp,
                          prefill_router=pd["router"], decode_router="least-kv", kv_link="nvlink", estimates=est,
                          residual_life=rl)
        recs = {f: res.records(f) for f in ("prefill", "decode")}
        for f, rec in recs.items():   # (why they missed, from the same replay's records)
            ttft_in = ((rec["first_token_ns"] >= 0) & (rec["ttft_ns"] <= tr.ttft_slo_ns))[ok]
            want_miss[G, rp, f] = {"missed_ttft": float((~ttft_in).mean()),
                                   "missed_tpot_only": float((ttft_in & ~rec["met"][ok]).mean())}
        moved = ok & (recs["prefill"]["kv_ready_ns"] >= 0)
        want_wait[G, rp] = np.median((recs["prefill"]["kv_ready_ns"] - recs["prefill"]["handoff_ns"])[moved]) / 1e6
        return {f: rec["met"][ok].astype(float) for f, rec in recs.items()}

    def colocated(G, lv):
        res = simulate_cluster(tr, prof, pol, with_levers(EngineConfig(), lv), replicas=G, router=pd["router"],
                               estimates=est, residual_life=rl)
        return res.records()["met"][ok].astype(float)

    want_miss, want_wait = {}, {}
    gs = [e["gpus"] for e in pd["by_gpus"]]
    assert 6 in gs and gs == sorted(gs) and min(gs) >= 2
    for e in pd["by_gpus"]:
        G = e["gpus"]
        assert [s["prefill_replicas"] for s in e["splits"]] == PD.splits_of(G, 3)
        assert len(e["colocated"]["trials"]) == len(e["splits"]) == e["trials"]
        assert e["colocated"]["trials"][0]["levers"] == {}   # the profile's own flags first
        mets = {s["prefill_replicas"]: split(G, s["prefill_replicas"]) for s in e["splits"]}
        for s in e["splits"]:
            assert s["decode_replicas"] == G - s["prefill_replicas"]
            for f in ("prefill", "decode"):
                assert s["goodput"][f] == mets[s["prefill_replicas"]][f].mean()
                assert s["misses"][f] == pytest.approx(want_miss[G, s["prefill_replicas"], f])
                assert s["goodput"][f] + sum(s["misses"][f].values()) == pytest.approx(1.0)
            assert s["handoff_to_kv_ms_p50"] == pytest.approx(want_wait[G, s["prefill_replicas"]])
        co = [colocated(G, t["levers"]) for t in e["colocated"]["trials"]]
        assert [t["goodput"] for t in e["colocated"]["trials"]] == [m.mean() for m in co]
        k = int(np.argmax([m.mean() for m in co]))
        assert e["colocated"]["goodput"] == co[k].mean() == max(t["goodput"] for t in e["colocated"]["trials"])
        for f, b in e["best"].items():
            assert b["goodput"] == max(s["goodput"][f] for s in e["splits"])
            u = PD.unit_means(mets[b["prefill_replicas"]][f], cfg.units)
            v = PD.unit_means(co[k], cfg.units)
            want = paired_difference(u, v, B=200, seed=0, block=default_block(u.size))
            assert [b["gain"]["mean"], *b["gain"]["ci95"]] == pytest.approx(list(want))
    by = {e["gpus"]: e for e in pd["by_gpus"]}
    reached = 0
    for f, fw in pd["fewest"].items():
        G = fw["gpus"]
        if G is None:
            continue
        reached += 1
        assert by[G]["best"][f]["goodput"] >= 0.9 and by[G + 1]["best"][f]["goodput"] >= 0.9
        assert G == 2 or by[G - 1]["best"][f]["goodput"] < 0.9
        assert fw["split"] == [by[G]["best"][f]["prefill_replicas"], by[G]["best"][f]["decode_replicas"]]
    assert reached == 2
    assert plan["evidence_id"] == PD.plan_with_pd(cfg)["evidence_id"]
    assert plan["evidence_id"] != PD.plan_with_pd(_cfg(tr, kv_link="rdma"))["evidence_id"]


def test_json_rows_add_the_split_and_the_colocated_rows_of_each_gpu_count():
    plan = PD.plan_with_pd(_cfg(_trace(150)))
    rows = PD.json_rows(plan)
    kinds = [r["kind"] for r in rows]
    assert kinds[0] == "colocated" and {"colocated", "pd", "pd@gpus", "colocated@gpus"} == set(kinds)
    for r in rows:
        assert {"prefill_replicas", "decode_replicas", "replicas", "goodput"} <= set(r)
        if r["kind"].startswith("colocated"):
            assert r["prefill_replicas"] is None and r["decode_replicas"] is None
        elif r["replicas"] is not None:
            assert r["replicas"] == r["prefill_replicas"] + r["decode_replicas"]
        else:
            assert r["prefill_replicas"] is None and r["decode_replicas"] is None
    gs = {e["gpus"] for e in plan["pd"]["by_gpus"]}
    assert {r["replicas"] for r in rows if r["kind"] == "colocated@gpus"} == gs
    assert sorted(r["first_token_at"] for r in rows if r["kind"] == "pd") == ["decode", "prefill"]


def test_lever_trials_and_splits():
    prof = load_profile("llama3-8b-h100")
    a, b = PD.lever_trials(prof, 6, 0, 8), PD.lever_trials(prof, 6, 0, 8)
    assert a == b and a[0] == {} and len(a) == 6 and PD.lever_trials(prof, 6, 1, 8) != a
    space = lever_space(prof)
    for lv in a[1:]:
        for k, v in lv.items():
            lo, hi, _ = space[k]
            assert lo <= v <= hi or (k == "long_prefill_token_threshold" and v == 0)
        assert lv["max_num_seqs"] <= lv["max_num_batched_tokens"]
    assert PD.splits_of(4, 8) == [1, 2, 3]
    assert PD.splits_of(16, 4) == [1, 6, 10, 15]


def test_plan_cli_pd_prints_both_conventions_and_writes_the_split_plot(tmp_path, capsys):
    from tokenbatch_env.cli import main
    path = _file(tmp_path)
    out = tmp_path / "plan"
    argv = ["plan", "--trace", str(path), "--profile", "linear", "--routers", "round-robin", "--policies", "fcfs",
            "--max-replicas", "8", "--pd", "--pd-trials", "2", "--pd-gpus", "4", "--kv-link", "rdma", "--out",
            str(out), "--quiet"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "first token at prefill: token 1 at the end of the last prefill iteration on P" in text
    assert "first token at decode: token 1 at the end of the first iteration on D" in text
    assert "KV over rdma (50 GB/s" in text and "fewest GPUs, first token at prefill" in text
    assert (out / "plan_pd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "plan.json").read_text())
    assert data["pd"]["kv_link"]["name"] == "rdma" and 4 in [e["gpus"] for e in data["pd"]["by_gpus"]]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["kind"] for r in rows} == {"colocated", "pd", "pd@gpus", "colocated@gpus"}


@pytest.mark.parametrize("argv, msg", [
    (["--pd-trials", "3"], "--pd-trials: a --pd setting; add --pd"),
    (["--kv-link", "rdma"], "--kv-link: a --pd setting; add --pd"),
    (["--pd", "--pd-trials", "0"], "--pd-trials: must be >= 1, got 0"),
    (["--pd", "--pd-gpus", "1"], "--pd-gpus: must be >= 2, got 1"),
    (["--pd", "--pd-gpus", "10"], "--pd-gpus: each a GPU count in [2, --max-replicas + 1 = 9], got 10"),
    (["--pd", "--pd-gpus", ","], "--pd-gpus: give GPU counts"),
    (["--pd", "--kv-link", "wifi"], "unknown KV link 'wifi'; valid: nvlink, rdma, none"),
    (["--pd", "--decode-router", "nope"], "--decode-router: unknown router 'nope'"),
    (["--pd", "--metrics-staleness-ms", "5"], "--pd: metrics staleness is not supported for P/D clusters"),
    (["--pd", "--max-replicas", "1"], "--pd: --max-replicas must be >= 2"),
])
def test_plan_cli_pd_bad_input_is_one_line_and_writes_nothing(argv, msg, tmp_path, capsys):
    from tokenbatch_env.cli import main
    path = _file(tmp_path)
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(path), "--profile", "linear", "--max-replicas", "8", "--out", str(out),
                 *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenbatch: error: {msg}") and err.count("\n") == 1, err
    assert not out.exists()


def test_pd_config_is_checked():
    with pytest.raises(ConfigError, match="--pd-trials must be an integer >= 1"):
        _cfg(_trace(20), pd_trials=0)
