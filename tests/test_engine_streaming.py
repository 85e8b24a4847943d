"""Per-iteration and per-request records stream through bounded buffers: the same rows as the
whole-run arrays, written atomically."""

import csv

import numpy as np
import pytest

from tokenbatch_env.cli import main
from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine import simulate as S
from tokenbatch_env.engine.simulate import EngineRun, simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.policies import engine_policy
from tokenbatch_env.traces import Trace
from tokenbatch_env.traces.io import load_trace, save_npz
from tokenbatch_env.traces.suites import load_suite
from tokenbatch_env.traces.windows import scale_to_rate


def _trace():
    return load_suite("seed-200").trace("test", 0).subset(slice(0, 120))


def test_small_buffer_streams_the_same_rows_as_one_big_buffer():
    t = _trace()
    whole = simulate([t, t], "stress-512", config=EngineConfig(record_iterations=1_000_000))
    chunks = {0: [], 1: []}
    streamed = simulate([t, t], "stress-512", config=EngineConfig(record_iterations=37),
                        iteration_sink=lambda c, cols: chunks[c].append(cols))
    for c in (0, 1):
        assert max(len(ch["iteration"]) for ch in chunks[c]) <= 37
        want = whole.iterations(c)
        for k in want:
            got = np.concatenate([ch[k] for ch in chunks[c]])
            assert np.array_equal(got, want[k]), k
        for k, v in whole.records(c).items():
            assert np.array_equal(v, streamed.records(c)[k]), k


def test_cli_writes_iterations_csv(tmp_path, capsys):
    path = tmp_path / "t.npz"
    save_npz(_trace(), path)
    out = tmp_path / "iters.csv"
    recs = tmp_path / "recs.csv"
    assert main(["simulate", "--trace", str(path), "--iterations", str(out), "--records", str(recs)]) == 0
    rows = list(csv.reader(out.open()))
    assert rows[0][:3] == ["iteration", "start_ns", "end_ns"]
    its = [int(r[0]) for r in rows[1:]]
    assert its == list(range(len(its))) and len(its) > 100
    assert len(list(csv.reader(recs.open()))) == 121
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


# ---------------------------------------------------------------------- per-request records (sink)
def _overloaded(k=3, rate=8.0):
    s = load_suite("seed-200")
    return [scale_to_rate(s.trace("test", i).subset(slice(0, 120)), rate) for i in range(k)]


def _collector(n_copies):
    chunks = {c: [] for c in range(n_copies)}
    return chunks, lambda c, cols: chunks[c].append(cols)


def _assert_stream_is_records(res, chunks, size):
    for c in range(res.n_copies):
        want = res.records(c)
        assert chunks[c] and all(0 < len(ch["request"]) <= size for ch in chunks[c])
        assert all(list(ch) == list(want) for ch in chunks[c])
        for k, v in want.items():
            got = np.concatenate([ch[k] for ch in chunks[c]])
            assert got.dtype == v.dtype and np.array_equal(got, v), (c, k)


@pytest.mark.parametrize("policy", ["fcfs", "edf+shed"])
def test_record_chunks_concatenate_to_records(policy):
    """Time-outs and shedding end requests out of index order; the sink still emits index order."""
    trs = _overloaded()
    pol = engine_policy("edf", shed_margin=0.5) if policy == "edf+shed" else policy
    chunks, sink = _collector(3)
    res = simulate(trs, "stress-512", pol, EngineConfig(max_wait_ms=3000), chunk_steps=50,
                   record_sink=sink, record_chunk=7)
    _assert_stream_is_records(res, chunks, 7)
    es = np.concatenate([res.records(c)["end_state"] for c in range(3)])
    assert (es == (K.E_SHED if policy == "edf+shed" else K.E_TIMED_OUT)).sum() > 10
    fin = res.records(0)["finish_ns"]
    assert (np.diff(fin) < 0).any()  # requests did end out of order
    assert sum(len(chunks[c]) for c in range(3)) > 3 * 120 // 7
    # the default chunk and one run without a sink give the same records
    plain = simulate(trs, "stress-512", pol, EngineConfig(max_wait_ms=3000))
    for c in range(3):
        for k, v in plain.records(c).items():
            assert np.array_equal(v, res.records(c)[k]), k


def test_records_stream_during_the_run_and_stay_final():
    trs = _overloaded()
    chunks, sink = _collector(3)
    run = EngineRun(trs, "stress-512", "fcfs", EngineConfig(max_wait_ms=3000), record_sink=sink,
                    record_chunk=7)
    mid = int(np.median(trs[0].arrival_ns))
    run.advance(until_ns=mid, chunk_steps=50)
    early = sum(len(ch["request"]) for ch in chunks[0])
    assert 0 < early < len(trs[0])
    run.advance(chunk_steps=50)
    _assert_stream_is_records(run.result(), chunks, 7)
    run.result()  # a second call emits nothing twice
    assert sum(len(ch["request"]) for ch in chunks[0]) == len(trs[0])


def test_truncated_run_flushes_unfinished_at_result():
    trs = _overloaded()
    chunks, sink = _collector(3)
    run = EngineRun(trs, "stress-512", "fcfs", EngineConfig(max_iterations=700), record_sink=sink,
                    record_chunk=7)
    run.advance(chunk_steps=50)
    before = [sum(len(ch["request"]) for ch in chunks[c]) for c in range(3)]
    assert all(b < len(t) for b, t in zip(before, trs))
    assert not any((ch["end_state"] == K.E_UNFINISHED).any() for c in range(3) for ch in chunks[c])
    res = run.result()
    assert res.truncated.all()
    _assert_stream_is_records(res, chunks, 7)
    for c in range(3):
        tail = np.concatenate([ch["end_state"] for ch in chunks[c]])[before[c]:]
        assert (tail == K.E_UNFINISHED).sum() > 0


def _async_case(seed, n=60):
    rng = np.random.default_rng(seed)
    return Trace.build(arrival_ns=np.cumsum(rng.integers(0, 5_000_000, n)),
                       prompt_tokens=rng.integers(1, 120, n), output_tokens=rng.integers(1, 40, n),
                       priority=rng.integers(0, 3, n))


def test_async_request_preempted_after_finishing_is_not_emitted_early():
    """Async scheduling: a request that finished in the last iteration may still be preempted (and
    counted) at the next schedule; flushing after every iteration must not emit it before that."""
    trs = [_async_case(s) for s in range(16, 24)]  # seed 20 has such a preemption
    cfg = EngineConfig(num_blocks=30, max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=True,
                       prefix_caching=False)
    chunks, sink = _collector(len(trs))
    res = simulate(trs, "linear", "priority", cfg, chunk_steps=1, record_sink=sink, record_chunk=7)
    assert res.arrays.n_preempt.sum() > 0
    _assert_stream_is_records(res, chunks, 7)


def test_record_chunk_must_be_positive():
    with pytest.raises(ConfigError):
        EngineRun(_trace(), "stress-512", record_sink=lambda c, cols: None, record_chunk=0)


def _read_records_csv(path):
    rows = list(csv.DictReader(open(path, newline="")))
    return {k: [r[k] for r in rows] for k in rows[0]}


def test_cli_records_csv_equals_records(tmp_path):
    path = tmp_path / "t.npz"
    save_npz(scale_to_rate(_trace(), 8.0), path)
    out = tmp_path / "recs.csv"
    assert main(["simulate", "--trace", str(path), "--records", str(out), "--max-wait-ms", "3000"]) == 0
    trace, _ = load_trace(str(path))
    want = simulate(trace, "stress-512", "fcfs", EngineConfig(max_wait_ms=3000)).records(0)
    got = _read_records_csv(out)
    assert list(got) == [*want, "priority"]   # (the CLI adds the priority each request ran with)
    assert [int(s) for s in got["priority"]] == trace.priority.tolist()
    assert "timed_out" in got["end_state"]
    assert got["end_state"] == [K.END_STATE_NAMES[i] for i in want["end_state"]]
    for k, v in want.items():
        if k == "end_state":
            continue
        parse = {"b": lambda s: {"True": True, "False": False}[s], "f": float}.get(v.dtype.kind, int)
        assert [parse(s) for s in got[k]] == v.tolist(), k
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_refuses_an_output_that_is_its_input_or_the_other_output(tmp_path, capsys):
    """``--records``/``--iterations`` naming the input trace, or the same file as each other (however
    spelled), exit 2 before the run and leave the files as they were."""
    path = tmp_path / "t.npz"
    save_npz(scale_to_rate(_trace(), 8.0), path)
    before = path.read_bytes()
    assert main(["simulate", "--trace", str(path), "--records", str(path)]) == 2
    assert "--records " + str(path) + ": the same file as --trace" in capsys.readouterr().err
    assert path.read_bytes() == before
    out = tmp_path / "o.csv"
    assert main(["simulate", "--trace", str(path), "--records", str(out),
                 "--iterations", str(tmp_path / "." / "o.csv")]) == 2
    assert ": the same file as --records" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]
    assert main(["simulate", "--trace", str(path), "--rho", "1e-12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenbatch: error: --rho 1e-12: a load too low for this trace") and err.count("\n") == 1


def test_failed_run_leaves_no_records_file(tmp_path, monkeypatch):
    path = tmp_path / "t.npz"
    save_npz(scale_to_rate(_trace(), 8.0), path)
    real, calls = S.simulate, []

    def failing_simulate(*a, record_sink=None, **kw):
        def sink(c, cols):
            calls.append(len(cols["request"]))
            if len(calls) == 3:
                raise RuntimeError("disk full")
            record_sink(c, cols)  # two chunks reach the temp file first
        return real(*a, record_sink=sink, record_chunk=7, **kw)

    monkeypatch.setattr(S, "simulate", failing_simulate)
    fresh, kept, iters = tmp_path / "new.csv", tmp_path / "old.csv", tmp_path / "iters.csv"
    kept.write_text("previous\n")
    for out in (fresh, kept):
        calls.clear()
        with pytest.raises(RuntimeError, match="disk full"):
            main(["simulate", "--trace", str(path), "--records", str(out), "--iterations", str(iters)])
        assert len(calls) == 3
    assert not fresh.exists() and not iters.exists()
    assert kept.read_text() == "previous\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_cli_json_is_standard_and_names_both_digests(tmp_path, capsys):
    """``simulate --json`` is standard JSON (an infinite TTFT p99 as "inf", as in report.json; Python's
    Infinity token before), and says the digest of the trace as run beside the file's."""
    import json

    path = tmp_path / "t.npz"
    save_npz(scale_to_rate(_trace(), 8.0), path)
    trace, _ = load_trace(str(path))
    assert main(["simulate", "--trace", str(path), "--max-wait-ms", "3000", "--json"]) == 0
    text = capsys.readouterr().out
    d = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert d["ttft_p99_ms"] == "inf" and d["trace_digest"] == d["file_digest"] == trace.digest
    assert main(["simulate", "--trace", str(path), "--rho", "1.2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["file_digest"] == trace.digest != d["trace_digest"]   # rescaled to rho 1.2
    # the profile's content digest: a profile file under a shipped name (other blocks) differs
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.engine.state import EngineConfig
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(EngineConfig(num_blocks=128).resolve(load_profile("stress-512")).to_dict()))
    assert main(["simulate", "--trace", str(path), "--profile", str(prof), "--json"]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert d2["profile"] == d["profile"] == "stress-512" and len(d["profile_digest"]) == 64
    assert d2["profile_digest"] != d["profile_digest"]


def test_cli_bad_numbers_name_the_flag(tmp_path, capsys):
    path = tmp_path / "t.npz"
    save_npz(_trace(), path)
    for argv, msg in ((["--max-wait-ms", "-5"], "--max-wait-ms must be a positive number of ms, got -5.0"),
                      (["--max-wait-ms", "nan"], "--max-wait-ms must be a positive number of ms, got nan"),
                      (["--rho", "0"], "--rho must be a positive number, got 0.0"),
                      (["--sla-seed", "-1"], "--slo-seed must be an integer >= 0, got -1")):
        assert main(["simulate", "--trace", str(path), *argv]) == 2
        assert capsys.readouterr().err == f"tokenbatch: error: {msg}\n"
