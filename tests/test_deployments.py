"""Real deployments (docs/design.md section 10): loads are admitted loads, reports say what the
engine's length limit denies every policy, vLLM's engine flags reach the engine and the evidence id,
and a coarser block size keeps exactly the prefix sharing it can see."""

from __future__ import annotations

import dataclasses
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
    (["--num-blocks", "1"], "--num-blocks: must be an integer >= 2"),
    (["--block-size", "x"], "--block-size: must be an integer"),
    (["--max-model-len", "0"], "--max-model-len: must be an integer >= 1"),
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


# ------------------------------------------------------------------ units travel with parameters
def _params(tmp_path, meta):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"index": {}, "shed_margin": 0.0, "meta": meta}))
    return str(path)


def test_fixed_t_ref_is_used_and_a_different_profile_warns(tmp_path, capsys):
    """A tuned file's T_ref (t_ref_mode fixed) prices the index wherever it is evaluated; tuned on
    another profile or predictor: a warning line each."""
    from tokenbatch_env.params import deployment_of
    from tokenbatch_env.predictors import PredictorSpec
    dep = deployment_of(load_profile("llama2-7b-a100"), PredictorSpec("oracle"), 777.0)
    out = tmp_path / "o"
    argv = ["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "index", "--bootstrap-b", "100",
            "--no-upper-bound", "--out", str(out)]
    assert cli.main(argv + ["--params", _params(tmp_path, dep)]) == 0
    text = capsys.readouterr().out
    d = json.loads((out / "report.json").read_text())
    assert d["t_ref_ms"] == 777.0
    assert all(p["t_ref_ms"] == 777.0 for p in d["evidence_inputs"]["policies"] if p["policy"] == "index")
    assert len(d["warnings"]) == 2 and "tuned on profile llama2-7b-a100; evaluated on stress-512" in text
    assert "tuned with predictor" in text
    # the same file in trace mode: the workload's own T_ref, no T_ref note
    assert cli.main(argv + ["--params", _params(tmp_path, {**dep, "t_ref_mode": "trace"})]) == 0
    capsys.readouterr()
    d2 = json.loads((out / "report.json").read_text())
    assert d2["t_ref_ms"] != 777.0 and d2["evidence_id"] != d["evidence_id"]


def test_matching_deployment_gives_no_warning(tmp_path, capsys):
    from tokenbatch_env.params import deployment_of
    from tokenbatch_env.predictors import PredictorSpec
    prof = load_profile("stress-512")
    wl = ev.prepare_workload(ev.BenchConfig(max_traces=2), prof)
    dep = deployment_of(prof, wl.predictor, wl.t_ref_ms)
    assert dep["predictor"] == PredictorSpec.from_dict(dep["predictor"]).to_dict()
    out = tmp_path / "o"
    assert cli.main(["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "index", "--bootstrap-b", "100",
                     "--no-upper-bound", "--out", str(out), "--params", _params(tmp_path, dep)]) == 0
    assert "WARNING" not in capsys.readouterr().out
    # other engine settings on the same profile name: the digest tells
    assert cli.main(["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "index", "--bootstrap-b", "100",
                     "--no-upper-bound", "--out", str(out), "--params", _params(tmp_path, dep),
                     "--max-num-seqs", "32"]) == 0
    assert "other engine settings" in capsys.readouterr().out


@pytest.mark.parametrize("meta, needle", [
    ({"t_ref_mode": "sometimes", "t_ref_ms": 5}, "meta.t_ref_mode"),
    ({"t_ref_mode": "fixed", "t_ref_ms": -1}, "meta.t_ref_ms"),
    ({"t_ref_mode": "fixed"}, "meta.t_ref_ms"),
])
def test_bad_deployment_is_one_line(tmp_path, capsys, meta, needle):
    rc = cli.main(["bench", "--max-traces", "1", "--loads", "1.2", "--policies", "index", "--quiet",
                   "--out", str(tmp_path / "o"), "--params", _params(tmp_path, meta)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ a trace file's splits, no leakage
def _trace_file(tmp_path, n=1000):
    t = load_suite("seed-200").traces("train")[0]
    reps = [t.replace(arrival_ns=t.arrival_ns + k * (int(t.arrival_ns[-1]) + 1)) for k in range(n // len(t) + 1)]
    from tokenbatch_env.traces.trace import Trace
    cat = Trace.build(arrival_ns=np.concatenate([r.arrival_ns for r in reps])[:n],
                      prompt_tokens=np.concatenate([r.prompt_tokens for r in reps])[:n],
                      output_tokens=np.concatenate([r.output_tokens for r in reps])[:n],
                      ttft_slo_ns=np.concatenate([r.ttft_slo_ns for r in reps])[:n],
                      tpot_slo_ns=np.concatenate([r.tpot_slo_ns for r in reps])[:n], name="long")
    path = tmp_path / "trace.npz"
    save_npz(cat, path)
    return path, cat


def test_trace_splits_are_time_ordered_and_fit_nothing_to_test(tmp_path):
    path, trace = _trace_file(tmp_path)
    base = ev.BenchConfig(trace_file=str(path), windows=30, warmup=10, cooldown=10, loads=(1.2,), policies=("fcfs",))
    prof = load_profile("stress-512")
    wls = {s: ev.prepare_workload(dataclasses.replace(base, trace_split=s), prof)
           for s in ("train", "validation", "test")}
    # parts: the first 60%, the next 20%, the last 20% of the requests, windows inside each
    starts = {s: int(w.parent.arrival_ns[0]) for s, w in wls.items()}
    assert starts["train"] == trace.arrival_ns[0] < starts["validation"] < starts["test"]
    assert len(wls["train"].parent) == 600 and len(wls["validation"].parent) == 200
    assert all(hi <= len(w.parent) for w in wls.values() for _, hi, _, _ in w.windows)
    # fitted from the train part only: same on every split, and changing the test part changes nothing
    for k in ("lambda_sat", "t_ref_ms", "admitted_share", "nominal_rps"):
        assert getattr(wls["test"], k) == getattr(wls["train"], k)
    np.testing.assert_array_equal(wls["test"].residual_life, wls["train"].residual_life)
    out = trace.output_tokens.copy()
    out[800:] = 7
    t1 = trace.ttft_slo_ns.copy()
    t1[800:] = 10 ** 9
    path2 = tmp_path / "changed.npz"
    save_npz(trace.replace(output_tokens=out, ttft_slo_ns=t1), path2)
    changed = ev.prepare_workload(dataclasses.replace(base, trace_file=str(path2), trace_split="test"), prof)
    assert changed.t_ref_ms == wls["test"].t_ref_ms and changed.lambda_sat == wls["test"].lambda_sat
    np.testing.assert_array_equal(changed.residual_life, wls["test"].residual_life)
    # one time factor: every split scaled by the train part's rate
    assert wls["test"].scale_factor(1.2) == wls["train"].scale_factor(1.2)


def test_too_few_windows_per_split_names_the_largest_w(tmp_path):
    path, _ = _trace_file(tmp_path, n=600)
    cfg = ev.BenchConfig(trace_file=str(path), windows=40, loads=(1.2,), policies=("fcfs",), trace_split="test")
    with pytest.raises(ConfigError, match=r"windows per split \{'train': 9, 'validation': 3, 'test': 3\}.*"
                                          r"use --windows 24 or less"):
        ev.prepare_workload(cfg, load_profile("stress-512"))


# ------------------------------------------------------------------ SLO rules in the evaluator and tuning
def test_bench_keeps_a_trace_own_priority_unless_a_rule_is_named(tmp_path):
    t = load_suite("seed-200").traces("train")[0].subset(np.arange(300))
    prio = (np.arange(300) % 5).astype(np.int64)
    t = t.replace(priority=prio)
    # a file with its own priority but no SLOs
    from tokenbatch_env.traces.trace import Trace
    bare = Trace.build(arrival_ns=t.arrival_ns, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
                       priority=prio, name="bare")
    path = tmp_path / "bare.npz"
    save_npz(bare, path)
    prof = load_profile("stress-512")
    cfg = ev.BenchConfig(trace_file=str(path), windows=100, loads=(1.0,), policies=("priority",))
    wl = ev.prepare_workload(cfg, prof)
    np.testing.assert_array_equal(wl.parent.priority, prio)
    assert wl.parent.has_slos and "kept the trace's own priority" in wl.notes[0]
    named = ev.prepare_workload(dataclasses.replace(cfg, slo_rule="default-3class"), prof)
    assert not np.array_equal(named.parent.priority, prio) and "replaced" in named.notes[0]


def test_a_named_rule_enters_the_evidence_and_mlperf_gets_its_verdict(tmp_path, capsys):
    out = tmp_path / "o"
    base = ["bench", "--max-traces", "2", "--loads", "1.2", "--policies", "fcfs,sjf", "--bootstrap-b", "100",
            "--no-upper-bound", "--out", str(out)]
    assert cli.main(base) == 0
    capsys.readouterr()
    plain = json.loads((out / "report.json").read_text())
    assert "slo_rule" not in plain["evidence_inputs"]["workload"]
    assert cli.main(base + ["--slo-rule", "mlperf-llama3_1-8b"]) == 0
    text = capsys.readouterr().out
    d = json.loads((out / "report.json").read_text())
    ev_rule = d["evidence_inputs"]["workload"]["slo_rule"]
    assert ev_rule["name"] == "mlperf-llama3_1-8b" and len(ev_rule["digest"]) == 64
    assert d["evidence_id"] != plain["evidence_id"] and "MLPerf verdict" in text
    for row in d["loads"][0]["rows"]:
        m = row["mlperf"]
        assert m["limits"] == {"ttft_ms": 2000.0, "tpot_ms": 100.0}
        p99 = [float(m[k]) for k in ("p99_ttft_ms", "p99_tpot_ms")]   # ("inf": JSON has no infinity)
        assert m["valid"] == (p99[0] <= 2000 and p99[1] <= 100)
    # every request's TTFT SLO is the preset's 2 s: T_ref is its median
    assert d["t_ref_ms"] == 2000.0


@pytest.mark.parametrize("rule, needle", [
    ('{"name": "x", "classes": [{"name": "a", "ttft": {"a_ms": -1, "b": 0}, "tpot_ms": 50, "share": 1}]}',
     "a_ms"),
    ('{"name": "x", "bogus": 1, "classes": []}', "bogus"),
])
def test_a_bad_rule_file_is_one_line_before_any_run(tmp_path, capsys, rule, needle):
    path = tmp_path / "rule.json"
    path.write_text(rule)
    rc = cli.main(["bench", "--max-traces", "1", "--loads", "1.2", "--policies", "fcfs", "--quiet",
                   "--out", str(tmp_path / "o"), "--slo-rule", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "rule.json" in err and len(err.strip().splitlines()) == 1, err


def test_long_contexts_on_an_extrapolated_profile_get_a_sensitivity_block(tmp_path):
    t = load_suite("seed-200").traces("train")[0].subset(np.arange(200))
    long = t.replace(prompt_tokens=t.prompt_tokens.astype(np.int64) + 6000,
                     prefix_offsets=np.zeros(201, np.int64), prefix_hashes=np.zeros(0, np.uint64))
    path = tmp_path / "long.npz"
    save_npz(long, path)
    cfg = ev.BenchConfig(trace_file=str(path), windows=50, profile="llama31-8b-h100", loads=(1.2,),
                         policies=("fcfs", "sjf"), bootstrap_b=100, upper_bound=False,
                         slo_rule="mlperf-llama3_1-8b-interactive")
    d = ev.run_benchmark(cfg).data
    s = d["sensitivity"]
    assert s["rho"] == 1.2 and s["longest_context"] > 4096
    assert set(s["variants"]) == {"c_attn x0.5", "c_attn x2", "c_kv x0.5", "c_kv x2"}
    labels = {r["label"] for r in d["loads"][0]["rows"]}
    assert all(set(v) == labels for v in s["variants"].values())
    # a slower attention term cannot help FCFS here; the variants differ from each other
    assert s["variants"]["c_attn x2"]["fcfs"] <= s["variants"]["c_attn x0.5"]["fcfs"]
    assert len({v["fcfs"] for v in s["variants"].values()}) > 1
    # short contexts, or a profile that asks for none: no block
    short = ev.run_benchmark(dataclasses.replace(cfg, trace_file=None, windows=None, max_traces=2)).data
    assert "sensitivity" not in short
    other = ev.run_benchmark(dataclasses.replace(cfg, profile="llama3-8b-h100", engine=EngineConfig(
        max_model_len=8192))).data
    assert "sensitivity" not in other


def test_the_upper_bound_uses_b_max():
    """The bound holds for every budget a lever may choose up to B_max: a prompt that needs fewer,
    larger chunks than B allows to make its TTFT counts as attainable only with B_max; B_max = B is
    the old bound."""
    from tokenbatch_env.bounds import upper_bound
    from tokenbatch_env.traces.trace import Trace
    p = dataclasses.replace(load_profile("llama2-7b-a100"), max_num_batched_tokens=64)
    P = 4000
    t1 = int(p.cost.idle_prefill_ns(P, 2048))   # (in 2 chunks; at B = 64 it takes 63)
    assert t1 < p.cost.idle_prefill_ns(P, 64)
    t = Trace.build(arrival_ns=np.array([0]), prompt_tokens=np.array([P]), output_tokens=np.array([2]),
                    ttft_slo_ns=np.array([t1]), tpot_slo_ns=np.array([10 ** 9]))
    assert upper_bound(t, p).ub == 0
    assert upper_bound(t, dataclasses.replace(p, b_max=64)).ub == 0
    assert upper_bound(t, dataclasses.replace(p, b_max=2048)).ub == 1
    seed = load_suite("seed-200").traces("test")[0]
    q = load_profile("stress-512")
    assert upper_bound(seed, dataclasses.replace(q, b_max=q.max_num_batched_tokens)).ub == upper_bound(seed, q).ub


def test_bench_replays_a_tuned_native_load_on_a_trace_split(tmp_path, capsys):
    """--loads native on a trace's split: the trace's own timestamps (times --rate-scale), the split in
    the report; --rate-scale without native, or native without a split, is one line."""
    t = load_suite("seed-200").traces("train")[0]
    path = tmp_path / "t.npz"
    save_npz(t, path)
    out = tmp_path / "o"
    base = ["bench", "--trace", str(path), "--windows", "10", "--warmup", "5", "--cooldown", "5", "--policies", "fcfs",
            "--bootstrap-b", "100", "--no-upper-bound", "--quiet", "--out", str(out)]
    assert cli.main(base + ["--split", "test", "--loads", "native"]) == 0
    d = json.loads((out / "report.json").read_text())
    cfg = ev.BenchConfig(trace_file=str(path), windows=10, warmup=5, cooldown=5, trace_split="test",
                         policies=("fcfs",), loads=(1.0,))
    wl = ev.prepare_workload(cfg, load_profile("stress-512"))
    assert d["workload"]["split"] == "test" and [e["rho"] for e in d["loads"]] == [pytest.approx(wl.native_rho)]
    assert cli.main(base + ["--split", "test", "--loads", "native,1.5", "--rate-scale", "2"]) == 0
    d2 = json.loads((out / "report.json").read_text())
    assert [e["rho"] for e in d2["loads"]] == pytest.approx(sorted([2 * wl.native_rho, 1.5]))
    assert d2["evidence_inputs"]["workload"]["rate_scale"] == 2.0
    capsys.readouterr()
    for argv, needle in ((["--loads", "native"], "--loads native"), (["--split", "test", "--rate-scale", "2"],
                                                                     "--rate-scale scales the native load")):
        assert cli.main(base + argv) == 2
        assert needle in capsys.readouterr().err


def test_an_explicit_context_beyond_the_kv_pool_is_refused():
    with pytest.raises(ConfigError, match="max_model_len 8192 exceeds the KV pool"):
        EngineConfig(num_blocks=300, max_model_len=8192).resolve(load_profile("stress-512"))
