"""Beside the upper bound (docs/design.md section 6): the best achieved row (deployable rows only),
the oracle selector (per-unit best of those rows) and "gap closed" measured against the best achieved
row, with or without the bound."""

from __future__ import annotations

import numpy as np
import pytest

from tokenbatch_env import evaluate as ev
from tokenbatch_env.metrics import bootstrap_ci
from tokenbatch_env.report import bound_rows, console_summary, gap_line, report_markdown

#: rho 0.1: every row within 0.02 of FCFS (gap closed not shown); rho 1.2: a wide gap, and the
#: reference srpt-oracle+shed above every deployable row
SMALL = dict(max_traces=3, loads=(0.1, 1.2), policies=("fcfs", "edf", "srpt-oracle"), shed=True,
             bootstrap_b=200, progress=False)


@pytest.fixture(scope="module")
def report():
    return ev.run_benchmark(ev.BenchConfig(**SMALL, upper_bound=False))


def _entry(report, rho):
    return next(e for e in report.data["loads"] if e["rho"] == rho)


def test_best_achieved_is_the_best_deployable_row(report):
    for e in report.data["loads"]:
        deploy = [d for d in e["rows"] if not d["reference"]]
        best = max(deploy, key=lambda d: d["goodput"]["mean"])
        assert e["best_achieved"] == {"label": best["label"], "goodput": best["goodput"]}
        assert not next(d for d in e["rows"] if d["label"] == e["best_achieved"]["label"])["reference"]
    e = _entry(report, 1.2)   # a reference row is higher: named apart, never the best achieved
    top = max(e["rows"], key=lambda d: d["goodput"]["mean"])
    assert top["reference"] and e["best_achieved"]["label"] != top["label"]
    assert e["best_achieved_reference"] == {"label": top["label"], "goodput": top["goodput"]}


def test_oracle_selector_is_the_per_unit_max_over_deployable_rows(report):
    B, seed = SMALL["bootstrap_b"], report.data["evidence_inputs"]["bootstrap"]["seed"]
    for e in report.data["loads"]:
        per = np.max([d["goodput_per_unit"] for d in e["rows"] if not d["reference"]], axis=0)
        o = e["oracle_selector"]
        assert o["per_unit"] == per.tolist()
        m, lo, hi = bootstrap_ci(per, B=B, seed=seed)
        assert o["mean"] == m and o["ci95"] == [lo, hi]
        assert o["mean"] >= e["best_achieved"]["goodput"]["mean"]
        refs = [d for d in e["rows"] if d["reference"]]
        assert refs and all(len(d["goodput_per_unit"]) == len(per) for d in refs)


def test_gap_closed_is_against_the_best_achieved_row(report):
    e = _entry(report, 1.2)
    assert e["best_achieved"]["goodput"]["mean"] - e["fcfs_goodput"] >= 0.02
    assert e["gap_closed_printed"] is True and "upper_bound" not in e   # (no bound needed)
    rows = {d["label"]: d for d in e["rows"]}
    assert rows[e["best_achieved"]["label"]]["gap_closed"] == 1.0
    assert rows["fcfs"]["gap_closed"] == 0.0
    span = e["best_achieved"]["goodput"]["mean"] - e["fcfs_goodput"]
    for d in e["rows"]:
        assert d["gap_closed"] == pytest.approx((d["goodput"]["mean"] - e["fcfs_goodput"]) / span)


def test_gap_closed_is_none_below_002(report):
    e = _entry(report, 0.1)
    assert e["best_achieved"]["goodput"]["mean"] - e["fcfs_goodput"] < 0.02
    assert e["gap_closed_printed"] is False
    assert all("gap_closed" in d and d["gap_closed"] is None for d in e["rows"])
    assert "gap closed not shown: best achieved - FCFS < 0.02" in gap_line(e)


def test_the_bound_does_not_change_them(report):
    """With the upper bound computed, best achieved, the oracle selector and gap closed are the same
    numbers; the bound only adds its own entry."""
    with_ub = ev.run_benchmark(ev.BenchConfig(**SMALL))
    for a, b in zip(report.data["loads"], with_ub.data["loads"]):
        assert "upper_bound" in b and "gap_closed_printed" not in b["upper_bound"]
        assert [r[0] for r in bound_rows(b)] == ["upper bound"] + [r[0] for r in bound_rows(a)]
        for k in ("best_achieved", "best_achieved_reference", "oracle_selector", "gap_closed_printed"):
            assert a.get(k) == b.get(k), k
        assert [d["gap_closed"] for d in a["rows"]] == [d["gap_closed"] for d in b["rows"]]


def test_reports_print_them_beside_the_leaderboard(report):
    e = _entry(report, 1.2)
    for text in (console_summary(report.data), report_markdown(report.data)):
        assert f"best achieved ({e['best_achieved']['label']})" in text
        assert "oracle selector (per-window best of rows)" in text
        assert f"best achieved {e['best_achieved']['label']}" in text and "best observed" not in text
    assert "gap closed not shown" not in console_summary(report.data)   # (rho 1.2 is the primary load)
    assert [r[0] for r in bound_rows(e)] == [f"best achieved ({e['best_achieved']['label']})",
                                             "oracle selector (per-window best of rows)"]


def test_oracle_selector_on_windows_uses_the_moving_block_bootstrap(tmp_path):
    """Windows cut from one trace: the oracle selector's CI is the moving-block one, as a row's."""
    from tokenbatch_env.traces.io import save_npz
    from tokenbatch_env.traces.suites import load_suite
    path = tmp_path / "t.npz"
    save_npz(load_suite("seed-200").traces("train")[0].subset(np.arange(400)), path)
    r = ev.run_benchmark(ev.BenchConfig(trace_file=str(path), windows=50, warmup=0, cooldown=0, loads=(1.2,),
                                        policies=("fcfs", "edf"), shed=True, bootstrap_b=200, progress=False,
                                        upper_bound=False))
    bs = r.data["evidence_inputs"]["bootstrap"]
    assert bs["block"] and bs["block"] > 1
    o = r.data["loads"][0]["oracle_selector"]
    m, lo, hi = bootstrap_ci(o["per_unit"], B=bs["B"], seed=bs["seed"], block=bs["block"])
    assert o["mean"] == m and o["ci95"] == [lo, hi]
    assert o["ci95"] != list(bootstrap_ci(o["per_unit"], B=bs["B"], seed=bs["seed"])[1:])
