"""The env benchmark script runs end to end on a tiny budget (its figures are in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conftest import require_extra

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_env.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_env", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_env_tiny(capsys):
    """The default run (the speed-up measured paired) on a tiny budget, with the sequential (b) and
    the breakdown; its (c), the SB3 adapter, needs the rl extra."""
    require_extra("stable_baselines3")
    bench = _load()
    assert bench.main(["--copies", "3", "--steps", "4", "--warm", "1", "--breakdown", "--sequential", "--paired", "2",
                       "--native-steps-per-round", "2", "--sync-steps-per-round", "1"]) == 0
    out = capsys.readouterr().out
    assert "same rewards as (a): True" in out and "(same rewards: True)" in out
    speedups = [ln for ln in out.splitlines() if "speed-up" in ln]
    assert len(speedups) == 2 and all("x (the target, >= 30x, is at 1,024 copies)" in ln for ln in speedups)
    assert "paired, 2 rounds of 2 native and 1 SyncVectorEnv steps" in speedups[1]
    adapter = next(ln for ln in out.splitlines() if ln.startswith("(c)"))
    assert "alternated step by step" in adapter and "median per step" in adapter
    line = next(ln for ln in out.splitlines() if "per copy-step" in ln)
    parts = dict(p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split("; "))
    total = float(parts.pop("total"))
    assert total > 0 and abs(sum(float(v) for v in parts.values()) - total) <= 0.05   # (printed to 0.01)


def test_bench_env_paired_tiny(capsys):
    """``--paired``: native and SyncVectorEnv alternated in rounds, on the same actions (rewards
    checked on the steps both took); both rates and the per-round ratios printed."""
    bench = _load()
    assert bench.main(["--copies", "3", "--steps", "6", "--warm", "1", "--paired", "3", "--native-steps-per-round",
                       "2", "--no-adapter", "--sync-steps-per-round", "1"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "paired" in ln)
    assert "3 rounds of 2 native and 1 SyncVectorEnv steps" in line and line.endswith("same rewards: True")
    assert "x (the target, >= 30x, is at 1,024 copies)" in line and "95% bootstrap interval over the rounds" in line
    r = bench.bench_paired(3, 2, 2, 1, 1)
    assert len(r["round_ratios"]) == 2 and r["native_sps"] > 0 and r["sync_sps"] > 0 and r["same_rewards"]
    lo, hi = r["ratio_ci"]
    assert lo <= r["native_sps"] / r["sync_sps"] <= hi


def test_paired_ratio_interval():
    """The interval resamples whole rounds: equal rounds give a point, its ends are ratios of
    resampled sums (bounded by the extreme rounds'), it narrows with more rounds, and it is
    deterministic."""
    import numpy as np
    bench = _load()
    assert bench.ratio_ci([0.1] * 5, [2.0] * 5, 20, 4) == pytest.approx((100.0, 100.0))
    rng = np.random.default_rng(3)
    nat, syn = rng.uniform(0.08, 0.12, 40), rng.uniform(1.5, 2.5, 40)
    lo, hi = bench.ratio_ci(nat, syn, 20, 4)
    per_round = (20 / nat) / (4 / syn)
    assert per_round.min() < lo < (20 / nat.sum()) / (4 / syn.sum()) < hi < per_round.max()
    lo4, hi4 = bench.ratio_ci(np.tile(nat, 4), np.tile(syn, 4), 20, 4)
    assert hi4 - lo4 < 0.7 * (hi - lo)
    assert bench.ratio_ci(nat, syn, 20, 4) == (lo, hi)


def test_no_sync_runs_the_native_env_alone(capsys):
    """--no-sync (as in the commands of earlier sessions): no SyncVectorEnv, unless --paired is given."""
    bench = _load()
    assert bench.main(["--copies", "2", "--steps", "2", "--warm", "1", "--no-sync", "--no-adapter"]) == 0
    out = capsys.readouterr().out
    assert "(a) native" in out and "SyncVectorEnv" not in out and "speed-up" not in out
    assert bench.main(["--copies", "2", "--steps", "2", "--warm", "1", "--no-sync", "--no-adapter", "--paired", "1",
                       "--native-steps-per-round", "1", "--sync-steps-per-round", "1"]) == 0
    assert "(a)/(b) paired, 1 rounds" in capsys.readouterr().out


def test_speed_up_verdict_judged_unrounded():
    bench = _load()
    assert bench._versus_target(29.996, 1024) == "29.99x (target >= 30x: missed)"
    assert bench._versus_target(30.0, 1024) == "30.00x (target >= 30x: met)"
    assert bench._versus_target(57.71, 1024) == "57.71x (target >= 30x: met)"
    assert bench._versus_target(6.2, 8) == "6.20x (the target, >= 30x, is at 1,024 copies)"


def test_bench_env_paired_bad_input(capsys):
    bench = _load()
    for args in (["--paired", "-1"], ["--paired", "2", "--sync-steps-per-round", "0"],
                 ["--native-steps-per-round", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.main(args + ["--no-adapter"])
        assert e.value.code == 2
        assert "--paired must be >= 0" in capsys.readouterr().err
    for args in (["--steps", "0"], ["--copies", "0"], ["--warm", "-1"], ["--sequential", "--sync-copies", "0"]):
        with pytest.raises(SystemExit) as e:
            bench.main(args + ["--no-adapter"])
        assert e.value.code == 2
        assert "--copies, --sync-copies and --steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.main(["--ceiling", "0", "--no-adapter"])
    assert e.value.code == 2 and "--ceiling must be >= 1 round, got 0" in capsys.readouterr().err


def test_bench_env_ceiling_tiny(capsys):
    """``--ceiling``: the native env at its threads, with one thread, and SyncVectorEnv alternated on
    the same actions and steps; the compiled work per copy-step and the speed-up it allows printed."""
    bench = _load()
    assert bench.main(["--copies", "3", "--steps", "2", "--warm", "1", "--no-sync", "--no-adapter", "--ceiling", "2",
                       "--native-steps-per-round", "2"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("(d)"))
    assert "(d) ceiling, 2 rounds of 2 steps of each env (3 copies)" in line and "native at 1 thread " in line
    assert "Ceiling 1 x SyncVectorEnv / k1 = " in line and line.endswith("same rewards: True")
    c = bench.bench_ceiling(3, 2, 3, 1)
    assert c["same_rewards"] and c["threads"] == 1
    assert 0 < c["k1"] < c["one_thread_us"] and 0 < c["native_kernel_us"] < c["native_us"]
    assert c["native_resets_us"] >= 0 and c["native_serial_us"] > 0
    assert c["ceiling"] == pytest.approx(c["sync_us"] / c["k1"])
    assert c["speedup"] == pytest.approx(c["sync_us"] / c["native_us"])
    assert c["rest"] == pytest.approx(c["native_us"] - c["native_kernel_us"])


def test_ceiling_model():
    """The model's k1 for the target meets the target, with the native env's rest and share and the
    single env's other work held; the rest it allows meets it with k1 held; a rest too large for any
    k1 gives k_needed <= 0; a target within the threads' share, None."""
    bench = _load()
    m = bench.ceiling_model(10.0, 160.0, 7.0, 11.0, 2)
    assert m["ceiling"] == pytest.approx(32.0) and m["share"] == pytest.approx(1.1)
    assert m["rest"] == pytest.approx(1.5) and m["budget"] == pytest.approx(160.0 / 30)
    k = m["k_needed"]
    assert 0 < k < 10.0 and (160.0 - 10.0 + k) / (k * 1.1 / 2 + 1.5) == pytest.approx(30.0)
    assert 160.0 / (10.0 * 1.1 / 2 + m["rest_allowed"]) == pytest.approx(30.0)
    assert bench.ceiling_model(10.0, 160.0, 11.0, 11.0, 2)["k_needed"] <= 0   # a rest of 5.5 us > 160/30
    assert bench.ceiling_model(10.0, 160.0, 7.0, 11.0, 64)["k_needed"] is None   # 30 x 1.1 <= 64
