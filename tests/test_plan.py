"""Capacity planning (docs/design.md section 12): the search over R, its flags, the gains, the
command's outputs and bad input."""

import json

import numpy as np
import pytest

from engine_helpers import tiny_trace
from tokenbatch_env import plan as P
from tokenbatch_env.engine.cluster import simulate_cluster
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError


def _trace(n=400, gap_ms=6.0, seed=3):
    rng = np.random.default_rng(seed)
    return tiny_trace(np.cumsum(rng.exponential(gap_ms, n)), rng.integers(20, 400, n), rng.integers(2, 60, n),
                      t1_ms=400, t2_ms=60)


def _cfg(trace, **kw):
    kw.setdefault("routers", ("round-robin", "jsq"))
    kw.setdefault("policies", ("fcfs", "sjf"))
    kw.setdefault("max_replicas", 16)
    kw.setdefault("bootstrap_b", 200)
    return P.PlanConfig(trace, load_profile("linear"), EngineConfig(), **kw)


def test_each_row_s_replicas_are_confirmed_by_replays():
    """A row's R meets the target at R and R + 1 and misses it at R - 1, each checked by an
    independent replay; every R the search evaluated is listed with the replay's goodput."""
    tr = _trace()
    cfg = _cfg(tr)
    plan = P.plan_capacity(cfg)
    assert [r["label"] for r in plan["rows"]] == ["round-robin x fcfs", "round-robin x sjf", "jsq x fcfs",
                                                  "jsq x sjf"]
    est, rl = P.estimates(tr, P.default_predictor()), P.ResidualLife.from_lengths(tr.output_tokens).table
    prof = load_profile("linear")
    ok = P.admitted_uncapped(tr.prompt_tokens, tr.output_tokens, prof.max_model_len)

    def replay(row, R):
        pol = P.engine_policy(row["policy"], shed_margin=None, t_ref_ms=P.t_ref_ms(tr))
        res = simulate_cluster(tr, prof, pol, EngineConfig(), replicas=R, router=row["router"], estimates=est,
                               residual_life=rl)
        return float(res.records()["met"][ok].mean())
    reached = 0
    for row in plan["rows"]:
        for e in row["evaluated"]:
            assert e["goodput"] == replay(row, e["replicas"])
            assert e["ci95"][0] <= e["goodput"] + 0.05 and e["ci95"][1] >= e["goodput"] - 0.05
        R = row["replicas"]
        if R is None:
            continue
        reached += 1
        assert replay(row, R) >= 0.9 and replay(row, R + 1) >= 0.9
        assert R == 1 or replay(row, R - 1) < 0.9
        assert row["usd_per_year"] == R * 2.0 * P.HOURS_PER_YEAR
    assert reached >= 2
    ref = plan["rows"][0]
    both = plan["gains"]["both"]
    assert both["replicas_saved"] == ref["replicas"] - both["replicas"] >= 0
    assert plan["evidence_id"] == P.plan_capacity(cfg)["evidence_id"]


@pytest.mark.parametrize("curve, want, flagged, evaluated", [
    # doubling 1, 2, 4 (meets), bisection 3 (misses), then 5 confirms 4
    ({1: .1, 2: .5, 3: .8, 4: .95, 5: .96}, 4, False, [1, 2, 3, 4, 5]),
    # 4 meets but 5 misses: on to 6 (meets), 7 confirms: non-monotone
    ({1: .1, 2: .5, 3: .8, 4: .95, 5: .85, 6: .93, 7: .94}, 6, True, [1, 2, 3, 4, 5, 6, 7]),
    # never reached up to max_replicas 8
    ({k: .5 for k in range(1, 10)}, None, False, [1, 2, 4, 8]),
    # R = 1 meets, 2 confirms
    ({1: .95, 2: .97}, 1, False, [1, 2]),
])
def test_search_doubles_bisects_and_confirms(curve, want, flagged, evaluated, monkeypatch):
    def fake(trace, profile, engine, row, R, *a, **k):
        return {"replicas": R, "goodput": curve.get(R, 0.99), "ci95": [0, 1], "imbalance": 1.0,
                "prefix_hit_rate": 0.0}
    monkeypatch.setattr(P, "evaluate_row", fake)
    out = P.search_row(_cfg(_trace(20), max_replicas=8), P.PlanRow("round-robin", "fcfs"), None, None)
    assert out["replicas"] == want and out["non_monotone"] == flagged
    assert [e["replicas"] for e in out["evaluated"]] == evaluated


def test_workers_give_the_same_plan():
    tr = _trace(200)
    one = P.plan_capacity(_cfg(tr, routers=("round-robin", "least-outstanding"), policies=("fcfs",)))
    two = P.plan_capacity(_cfg(tr, routers=("round-robin", "least-outstanding"), policies=("fcfs",), workers=2))
    assert json.dumps(one["rows"]) == json.dumps(two["rows"]) and one["evidence_id"] == two["evidence_id"]


def _file(tmp_path):
    from tokenbatch_env.traces import io as tio
    path = tmp_path / "t.csv"
    tio.save_csv(_trace(200), path)
    return path


def test_plan_cli_json_rows_and_files(tmp_path, capsys):
    from tokenbatch_env.cli import main
    path = _file(tmp_path)
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(path), "--profile", "linear", "--routers", "jsq", "--policies", "sjf",
                 "--shed", "--rate-scale", "1.5", "--max-replicas", "8", "--out", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["router"], r["policy"], r["shed"]) for r in rows} == {
        (a, b, s) for a in ("round-robin", "jsq") for b in ("fcfs", "sjf") for s in (False, True)}
    for r in rows:
        assert set(r) >= {"router", "policy", "replicas", "goodput", "usd_per_year"}
        assert (r["replicas"] is None) == (r["usd_per_year"] is None)
    data = json.loads((out / "plan.json").read_text())
    assert (out / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data["rows"]) == 8 and data["evidence_id"]
    assert main(["plan", "--trace", str(path), "--profile", "linear", "--routers", "jsq", "--policies", "fcfs",
                 "--max-replicas", "8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "router gain (best router x fcfs)" in text and "one static R (no autoscaling" in text
    assert "200 requests at 146.004 req/s" in text


@pytest.mark.parametrize("argv, msg", [
    (["--routers", "nope"], "--routers: unknown router 'nope'"),
    (["--routers", "jsq,jsq"], "--routers: duplicates"),
    (["--routers", ""], "--routers: need at least one"),
    (["--policies", "fcfs,nope"], "unknown policy 'nope'"),
    (["--policies", "sjf+shed"], "--policies: write the policy name without +shed"),
    (["--rate", "0"], "--rate must be a positive number, got 0.0"),
    (["--rate", "fast"], "--rate: must be a number, got 'fast'"),
    (["--rate", "3", "--rate-scale", "2"], "--rate and --rate-scale: give one"),
    (["--rate-scale", "-2"], "--rate-scale must be a positive number, got -2.0"),
    (["--target", "1.5"], "--target must be in (0, 1], got 1.5"),
    (["--target", "abc"], "--target: must be a number, got 'abc'"),
    (["--max-replicas", "0"], "--max-replicas: must be >= 1, got 0"),
    (["--max-replicas", "1.5"], "--max-replicas: must be an integer, got '1.5'"),
    (["--workers", "0"], "--workers: must be >= 1, got 0"),
    (["--metrics-staleness-ms", "-1"], "--metrics-staleness-ms must be a number of ms >= 0, got -1.0"),
])
def test_plan_cli_bad_input_is_one_line_and_writes_nothing(argv, msg, tmp_path, capsys):
    from tokenbatch_env.cli import main
    path = _file(tmp_path)
    out = tmp_path / "plan"
    assert main(["plan", "--trace", str(path), "--profile", "linear", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenbatch: error: {msg}") and err.count("\n") == 1, err
    assert not out.exists()


def test_plan_config_needs_slos():
    tr = tiny_trace([0.0, 1.0], [10, 10], [2, 2])
    with pytest.raises(ConfigError, match="needs SLOs"):
        P.PlanConfig(tr, load_profile("linear"))


def test_gains_are_a_lower_bound_when_the_reference_is_not_reached(monkeypatch):
    """round-robin x fcfs needs more than max_replicas, sjf reaches at 4: it saves at least
    max_replicas + 1 - 4."""
    def fake(trace, profile, engine, row, R, *a, **k):
        g = 0.5 if row.policy == "fcfs" else (0.95 if R >= 4 else 0.5)
        return {"replicas": R, "goodput": g, "ci95": [0, 1], "imbalance": 1.0, "prefix_hit_rate": 0.0}
    monkeypatch.setattr(P, "evaluate_row", fake)
    plan = P.plan_capacity(_cfg(_trace(20), routers=("round-robin",), max_replicas=8))
    g = plan["gains"]["policy"]
    assert g["at_least"] and g["replicas"] == 4 and g["replicas_saved"] == 5
    assert plan["gains"]["router"] is None
    assert "at least 5 (at least 56%) fewer" in P.format_plan(plan)
