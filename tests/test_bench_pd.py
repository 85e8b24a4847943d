"""`tokenbatch bench --replicas R --pd Rp:Rd` (docs/design.md section 13): every routed row again on the
split, once per first-token convention; each P/D row's goodput is its own replays'; the report says
which convention applies; bad input is one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenbatch_env import cli
from tokenbatch_env import evaluate as ev
from tokenbatch_env.errors import ConfigError

PD = dict(max_traces=2, loads=(1.2,), policies=("fcfs",), bootstrap_b=200, progress=False, replicas=3,
          upper_bound=False, pd=(1, 2))


def test_pd_rows_are_their_own_replays_with_both_conventions_stated():
    from tokenbatch_env.engine.disagg import simulate_pd
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate.cluster import bench_workload
    from tokenbatch_env.evaluate.outcomes import request_outcomes, unit_metrics
    from tokenbatch_env.policies import engine_policy
    cfg = ev.BenchConfig(**PD)
    rep = ev.run_benchmark(cfg)
    d = rep.data
    rows = {r["label"]: r for r in d["loads"][0]["rows"]}
    pd_labels = [lb for lb in rows if "[P/D" in lb]
    assert sorted(pd_labels) == sorted(f"{b} [P/D 1:2, first token at {f}]" for b in ("fcfs", "edf+shed", "index+shed")
                                       for f in ("prefill", "decode"))
    for lb in pd_labels:
        assert rows[lb]["cluster"]["pd"] == {"prefill_replicas": 1, "decode_replicas": 2, "decode_router": "least-kv",
                                             "kv_link": "nvlink", "first_token_at": lb.split("at ")[1][:-1]}
        assert len(rows[lb]["cluster"]["utilisation"]) == 3
    notes = " ".join(d["workload"]["notes"]) if "workload" in d and "notes" in d["workload"] else rep.to_markdown()
    assert "'first token at prefill': token 1 at the end of the last prefill iteration" in notes
    assert "'first token at decode': at the end of the first decode iteration" in notes
    # fcfs's P/D rows: the goodput of independent replays of the same copies
    prof = cfg.engine.resolve(load_profile(cfg.profile))
    wl = bench_workload(cfg, prof)
    est = wl.estimates(False)
    pol = engine_policy("fcfs", t_ref_ms=wl.t_ref_ms)
    copies = wl.at(1.2)
    for f in ("prefill", "decode"):
        per_unit = []
        for u, t in enumerate(copies):
            res = simulate_pd(t, prof, pol, cfg.engine, prefill_replicas=1, decode_replicas=2,
                              prefill_router="round-robin", estimates=est[u], residual_life=wl.residual_life)
            per_unit.append(unit_metrics(request_outcomes(res.records(f), t, wl.scored[u]))["goodput"])
        assert rows[f"fcfs [P/D 1:2, first token at {f}]"]["goodput"]["mean"] == pytest.approx(np.mean(per_unit))
    g = {f: rows[f"fcfs [P/D 1:2, first token at {f}]"]["goodput"]["mean"] for f in ("prefill", "decode")}
    assert g["prefill"] != rows["fcfs"]["goodput"]["mean"] or g["decode"] != rows["fcfs"]["goodput"]["mean"]
    # the split, the link and the decode router enter the evidence id
    e0 = rep.evidence_id
    for v in (dict(pd=(2, 1)), dict(kv_link="rdma"), dict(decode_router="jsq")):
        assert _eid(dataclasses.replace(cfg, **v)) != e0, v


def _eid(cfg):
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.evaluate.cluster import bench_workload
    prof = cfg.engine.resolve(load_profile(cfg.profile))
    return ev.evidence_id(ev.evidence_inputs(cfg, bench_workload(cfg, prof), prof, ev.build_rows(cfg)))


@pytest.mark.parametrize("kw, msg", [
    (dict(pd=(1, 1)), "pd: 1:1 must add up to the replicas R = 3"),
    (dict(pd=(0, 3)), "pd: replicas must be integers >= 1"),
    (dict(pd=(1, 2), kv_link="wifi"), "unknown KV link 'wifi'"),
    (dict(pd=(1, 2), decode_router="nope"), "decode_router: unknown router 'nope'"),
    (dict(pd=(1, 2), metrics_staleness_ms=2.0), "pd: metrics staleness is not supported for P/D rows"),
    (dict(pd=(), kv_link="rdma"), "kv_link and decode_router: settings of P/D rows"),
    (dict(replicas=1, pd=(1, 2)), "routers, metrics_staleness_ms, routed rows, pd and router agents: a cluster"),
])
def test_pd_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        ev.BenchConfig(**{**PD, **kw})


@pytest.mark.parametrize("argv, msg", [
    (["--replicas", "3", "--pd", "1:1"], "--pd 1:1: needs --replicas 2 (Rp + Rd)"),
    (["--pd", "1:2"], "--pd 1:2: needs --replicas 3 (Rp + Rd)"),
    (["--replicas", "3", "--pd", "a:b"], "--pd: expected Rp:Rd, integers >= 1 (e.g. 3:5), got 'a:b'"),
    (["--replicas", "3", "--pd", "0:3"], "--pd: expected Rp:Rd, integers >= 1"),
    (["--replicas", "3", "--kv-link", "rdma"], "--kv-link: a setting of P/D rows; add --pd Rp:Rd"),
    (["--replicas", "3", "--pd", "1:2", "--kv-link", "wifi"], "unknown KV link 'wifi'"),
])
def test_bench_cli_pd_bad_input_is_one_line(argv, msg, tmp_path, capsys):
    out = tmp_path / "r"
    rc = cli.main(["bench", "--max-traces", "1", "--loads", "1.2", "--no-upper-bound", "--out", str(out), *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_pd_tpot_guard_row_is_compared_with_its_own_pd_row():
    """A P/D row with the tpot-guard rule is paired with the same P/D row without it (the report's
    tpot-guard table reads that row's TPOT-only misses)."""
    from tokenbatch_env.report import guard_lines
    rep = ev.run_benchmark(ev.BenchConfig(**{**PD, "policies": ("fcfs",)}, tpot_guard=(0.0, 0.0)))
    entry = rep.data["loads"][0]
    rows = {r["label"]: r for r in entry["rows"]}
    g = "fcfs+tpot-guard [P/D 1:2, first token at prefill]"
    base = "fcfs [P/D 1:2, first token at prefill]"
    assert base in rows[g]["vs"]
    line = next(x for x in guard_lines(entry) if x[0] == g)
    assert line[-1] == f"{rows[base]['tpot_only_missed']} -> {rows[g]['tpot_only_missed']}"


def test_bench_cli_decode_router_is_checked_by_its_flag(tmp_path, capsys):
    out = tmp_path / "r"
    rc = cli.main(["bench", "--max-traces", "1", "--loads", "1.2", "--no-upper-bound", "--out", str(out),
                   "--replicas", "3", "--pd", "1:2", "--decode-router", "nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "--decode-router: unknown router 'nope'" in err and not out.exists()
