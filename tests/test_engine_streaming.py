"""Per-iteration records stream through a bounded buffer: same rows as one big buffer."""

import csv

import numpy as np

from tokenbatch_env.cli import main
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.traces.io import save_npz
from tokenbatch_env.traces.suites import load_suite


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
