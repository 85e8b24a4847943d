"""The trace-reader registry (docs/design.md section 2): every registered format passes one
contract, and the command line lists exactly the registry's formats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenbatch_env.errors import TraceError
from tokenbatch_env.traces.io import FORMATS, READERS, detect_format, load_trace, save_trace

FIX = Path(__file__).resolve().parent / "fixtures"
#: format -> a good file of it (the canonical formats are written from the CSV fixture)
GOOD = {"csv": FIX / "canonical_ok.csv", "azure": FIX / "azure_ok.csv", "mooncake": FIX / "mooncake_ok.jsonl",
        "burstgpt": FIX / "burstgpt_ok.csv"}


def good_file(fmt: str, tmp_path: Path) -> Path:
    if fmt == "npz":
        trace, _ = load_trace(GOOD["csv"])
        save_trace(trace, tmp_path / "t.npz")
        return tmp_path / "t.npz"
    return GOOD[fmt]


def test_every_format_has_a_good_fixture():
    assert set(FORMATS) == set(GOOD) | {"npz"} and FORMATS == tuple(READERS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_contract(fmt, tmp_path):
    """Detected from its own file; read into a valid trace with a report; renamed on request; the
    canonical writers give it back exactly; an empty file is one TraceError naming the file."""
    path = good_file(fmt, tmp_path)
    assert READERS[fmt].summary
    assert detect_format(path) == fmt
    trace, report = load_trace(path, fmt)
    assert len(trace) > 0 and report.requests == len(trace) and report.format == fmt
    assert np.all(np.diff(trace.arrival_ns) >= 0) and np.all(trace.output_tokens >= 1)
    assert load_trace(path, fmt, name="renamed").trace.name == "renamed"
    for ext in (".npz", ".csv"):
        save_trace(trace, tmp_path / f"back{ext}")
        assert load_trace(tmp_path / f"back{ext}").trace.digest == trace.digest
    empty = tmp_path / f"empty{path.suffix}"
    empty.write_bytes(b"")
    with pytest.raises(TraceError) as e:
        load_trace(empty, fmt)
    assert str(empty) in str(e.value)


def test_convert_lists_the_registry(capsys):
    from tokenbatch_env import cli
    with pytest.raises(SystemExit):
        cli.main(["traces", "convert", "--help"])
    assert "{" + ",".join(FORMATS) + "}" in capsys.readouterr().out.replace("\n", "").replace(" ", "")
