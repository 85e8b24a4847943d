"""Real deployments (docs/design.md section 10): loads are admitted loads, reports say what the
engine's length limit denies every policy, vLLM's engine flags reach the engine and the evidence id,
and a coarser block size keeps exactly the prefix sharing it can see."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenbatch_env import cli
from tokenbatch_env import evaluate as ev
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.traces.blocks import at_block_size
from tokenbatch_env.traces.io import save_npz
from tokenbatch_env.traces.suites import load_suite


@pytest.fixture(autouse=True)
def _bench_registered(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "bench", ("tokenbatch_env.bench_cli", "bench"))


def _long_trace(tmp_path, n=400, long_every=4):
    """seed-200 requests with every ``long_every``-th prompt made longer than stress-512's context."""
    t = load_suite("seed-200").traces("train")[0].subset(np.arange(n))
    p = t.prompt_tokens.astype(np.int64).copy()
    p[::long_every] = 5000
    t = t.replace(prompt_tokens=p, prefix_offsets=np.zeros(n + 1, np.int64), prefix_hashes=np.zeros(0, np.uint64))
    path = tmp_path / "long.npz"
    save_npz(t, path)
    return path


def test_loads_are_admitted_loads(tmp_path):
    """With a quarter of the prompts rejected, rho x lambda_sat is the rate of the admitted ones."""
    path = _long_trace(tmp_path)
    cfg = ev.BenchConfig(trace_file=str(path), windows=50, loads=(1.0,), policies=("fcfs",), bootstrap_b=200)
    prof = load_profile("stress-512")
    wl = ev.prepare_workload(cfg, prof)
    assert wl.admitted_share == pytest.approx(0.75, abs=0.01)
    rho = 1.3
    scaled = wl.at(rho)
    arrivals = np.concatenate([u.arrival_ns for u in scaled])
    prompts = np.concatenate([u.prompt_tokens for u in scaled])
    adm = prompts < prof.max_model_len
    span_s = (arrivals.max() - arrivals.min()) / 1e9
    assert adm.sum() / span_s == pytest.approx(rho * wl.lambda_sat, rel=0.08)
    assert wl.rate(rho) == pytest.approx(rho * wl.lambda_sat / wl.admitted_share)


def test_suites_admit_everything_so_their_loads_are_unchanged():
    prof = load_profile("stress-512")
    wl = ev.prepare_workload(ev.BenchConfig(max_traces=2), prof)
    assert wl.admitted_share == 1.0 and wl.rate(1.2) == 1.2 * wl.lambda_sat


def test_report_gives_the_ceiling_and_warns(tmp_path, capsys):
    path = _long_trace(tmp_path)
    out = tmp_path / "o"
    assert cli.main(["bench", "--trace", str(path), "--windows", "100", "--loads", "1.2", "--policies", "fcfs,sjf",
                     "--bootstrap-b", "100", "--no-upper-bound", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    d = json.loads((out / "report.json").read_text())
    a = d["admission"]
    assert a["max_model_len"] == 4096 and a["rejected_share"] == pytest.approx(0.25, abs=0.01)
    assert a["ceiling"] == pytest.approx(1 - a["rejected_share"] - a["capped_share"])
    assert a["warning"] and "WARNING" in text and "can never be met" in text
    for row in d["loads"][0]["rows"]:
        assert row["rejected"] == pytest.approx(a["rejected_share"] * row["arrived"], abs=1)
        # goodput over the admitted uncapped requests: the same met requests over fewer arrivals
        assert row["goodput_admitted_uncapped"] == pytest.approx(
            row["met"] / (row["arrived"] * a["ceiling"]), rel=1e-6)
        assert row["goodput_admitted_uncapped"] >= row["goodput"]["mean"] - 1e-9


def test_no_warning_when_everything_is_admitted(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli.main(["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "fcfs", "--bootstrap-b", "100",
                     "--no-upper-bound", "--out", str(out)]) == 0
    assert "WARNING" not in capsys.readouterr().out
    d = json.loads((out / "report.json").read_text())
    assert d["admission"]["rejected_share"] == 0 and not d["admission"]["warning"]


def test_engine_flags_reach_the_engine_and_the_evidence_id(tmp_path, capsys):
    base = ["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "fcfs", "--bootstrap-b", "100",
            "--no-upper-bound", "--quiet"]
    ids, engines = {}, {}
    for name, extra in (("default", []), ("flags", ["--num-blocks", "300", "--max-num-seqs", "64",
                                                     "--max-num-batched-tokens", "256", "--max-model-len", "2048",
                                                     "--block-size", "32", "--no-prefix-caching", "--async"])):
        out = tmp_path / name
        assert cli.main(base + extra + ["--out", str(out)]) == 0
        d = json.loads((out / "report.json").read_text())
        ids[name], engines[name] = d["evidence_id"], d["evidence_inputs"]["engine_config"]
    assert ids["default"] != ids["flags"]
    assert "block_size" not in engines["default"] and "max_model_len" not in engines["default"]
    assert engines["flags"] == {**engines["default"], "num_blocks": 300, "max_num_seqs": 64,
                                "max_num_batched_tokens": 256, "max_model_len": 2048, "block_size": 32,
                                "prefix_caching": False, "async_scheduling": True}


@pytest.mark.parametrize("argv, needle", [
    (["--num-blocks", "1"], "--num-blocks: must be >= 2"),
    (["--block-size", "x"], "--block-size: must be an integer"),
    (["--max-model-len", "0"], "--max-model-len: must be >= 1"),
    (["--block-size", "24"], "an engine block size must be a multiple of it"),
])
def test_bad_engine_flags_are_one_line(tmp_path, capsys, argv, needle):
    rc = cli.main(["bench", "--max-traces", "1", "--loads", "1.2", "--policies", "fcfs", "--bootstrap-b", "100",
                   "--no-upper-bound", "--quiet", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_block_size_override_keeps_the_kv_capacity():
    p = load_profile("stress-512")
    q = EngineConfig(block_size=64).resolve(p)
    assert q.block_size == 64 and q.usable_blocks == p.usable_blocks * 16 // 64
    assert EngineConfig(max_model_len=1000).resolve(p).max_model_len == 1000


def test_coarser_chains_share_exactly_the_whole_coarse_blocks():
    t = load_suite("seed-200").traces("train")[0].subset(np.arange(200))
    assert t.prefix_lengths.max() >= 4
    c = at_block_size(t, 32)
    assert c.block_size == 32
    np.testing.assert_array_equal(c.prefix_lengths, t.prefix_lengths // 2)
    # two requests share their first k coarse blocks iff they share their first 2k fine ones
    for i in range(0, 200, 7):
        for j in range(1, 200, 11):
            fine = _common(t, i, j)
            assert _common(c, i, j) == fine // 2
    assert at_block_size(t, 16) is t
    with pytest.raises(ConfigError, match="multiple"):
        at_block_size(t, 24)


def _common(t, i, j) -> int:
    a = t.prefix_hashes[t.prefix_offsets[i]:t.prefix_offsets[i + 1]]
    b = t.prefix_hashes[t.prefix_offsets[j]:t.prefix_offsets[j + 1]]
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k
