"""`tokenbatch traces ...`: in-process through tokenbatch_env.cli.main, plus one console-script run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tokenbatch_env.cli import main
from tokenbatch_env.traces import io as tio

FIX = Path(__file__).parent / "fixtures"


def run(capsys, *argv):
    code = main(["traces", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert err.startswith("tokenbatch: error: ") and err.endswith("\n")
    assert err.count("\n") == 1 and "Traceback" not in err
    for f in fragments:
        assert f in err, (f, err)


def test_info_text(capsys):
    code, out, err = run(capsys, "info", FIX / "canonical_ok.csv")
    assert code == 0 and err == ""
    trace = tio.load_csv(FIX / "canonical_ok.csv")
    assert "requests        4" in out
    assert f"digest          {trace.digest}" in out
    assert "span            2.000 s" in out
    assert "prompt tokens   p50 33  p90 64  p99 64  max 64" in out
    assert "SLOs            TTFT" in out
    assert "burstiness" in out and "prefix" in out and "dropped failed 0" in out


def test_info_of_an_empty_trace(capsys, tmp_path):
    """A canonical CSV with its header and no rows is an empty trace: ``info`` says so ("n/a" where a
    statistic needs requests; None in JSON), it does not fail inside NumPy."""
    f = tmp_path / "empty.csv"
    header = (FIX / "canonical_ok.csv").read_text().splitlines()[1]
    f.write_text('# tokenbatch-trace v1 {"block_size": 16, "name": "e", "source": "t", "slos": true}\n' + header + "\n")
    assert len(tio.load_csv(f)) == 0
    code, out, err = run(capsys, "info", f)
    assert code == 0 and err == "" and "requests        0" in out
    assert "SLOs            TTFT n/a..n/a ms (p50 n/a), TPOT n/a..n/a ms (p50 n/a)" in out
    code, out, _ = run(capsys, "info", f, "--json")
    s = json.loads(out)
    assert code == 0 and s["requests"] == 0 and s["ttft_slo_ms"] == {"min": None, "p50": None, "max": None}


def test_info_json_reports_dropped_rows(capsys):
    code, out, _ = run(capsys, "info", FIX / "burstgpt_ok.csv", "--json")
    assert code == 0
    s = json.loads(out)
    assert s["requests"] == 3 and s["load"] == {"format": "burstgpt", "rows_read": 5,
                                                "dropped_failed": 2, "dropped": 2}
    assert s["has_slos"] is False and s["has_priority"] is False and s["span_s"] == 195.25
    assert s["output_tokens"]["max"] == 276
    assert s["mean_rate_per_s"] == pytest.approx(2 / 195.25)


def test_info_prefix_share(capsys):
    code, out, _ = run(capsys, "info", FIX / "mooncake_ok.jsonl", "--json")
    assert code == 0
    s = json.loads(out)
    total = 1000 + 1024 + 100 + 1600
    assert s["prefix_share"] == pytest.approx((512 + 1024 + 1536) / total)
    # seen earlier: rows 1 and 3 reuse id 0 (512 tokens each); row 3's id 1 is not reusable,
    # because in row 0 it was the partial last block, which is unique to its request
    assert s["reusable_prefix_share"] == pytest.approx((512 + 512) / total)
    assert s["requests_with_prefix"] == 3


def test_info_with_block_size_and_format(capsys):
    code, out, _ = run(capsys, "info", FIX / "mooncake_ok.jsonl", "--format", "mooncake",
                       "--block-size", "64", "--json")
    assert code == 0 and json.loads(out)["block_size"] == 64


def test_convert_round_trip(capsys, tmp_path):
    out_npz = tmp_path / "sub" / "a.npz"
    code, out, err = run(capsys, "convert", FIX / "burstgpt_ok.csv", out_npz, "--name", "bg")
    assert code == 0 and err == ""
    trace = tio.load_npz(out_npz)
    assert trace.name == "bg" and len(trace) == 3
    assert "dropped 2 failed rows" in out and trace.digest in out
    out_csv = tmp_path / "a.csv"
    assert run(capsys, "convert", out_npz, out_csv)[0] == 0
    assert tio.load_csv(out_csv).digest == trace.digest


def test_bad_input_exits_2_with_one_line(capsys):
    path = FIX / "azure_negative.csv"
    code, out, err = run(capsys, "info", path)
    assert code == 2 and out == ""
    assert_one_line_error(err, str(path), "row 4", "'GeneratedTokens'", "negative")
    code, _, err = run(capsys, "convert", FIX / "mooncake_truncated.jsonl", Path("/nonexistent") / "x.npz")
    assert code == 2
    assert_one_line_error(err, "row 3", "'hash_ids'", "truncated")


def test_convert_refuses_unknown_output_extension_before_reading(capsys, tmp_path):
    code, _, err = run(capsys, "convert", FIX / "azure_ok.csv", tmp_path / "x.parquet")
    assert code == 2 and not (tmp_path / "x.parquet").exists()
    assert_one_line_error(err, "use .npz or .csv")
    code, _, err = run(capsys, "convert", FIX / "azure_ok.csv", tmp_path / "x.npz", "--name", " ")
    assert code == 2 and not (tmp_path / "x.npz").exists()
    assert_one_line_error(err, "--name: must not be empty")


def test_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:  # argparse: unknown --format choice
        main(["traces", "info", str(FIX / "azure_ok.csv"), "--format", "parquet"])
    assert info.value.code == 2
    capsys.readouterr()
    code, out, err = run(capsys)  # no action: usage on stderr, exit 2
    assert code == 2 and "info" in err and "convert" in err and "generate" in err


def test_generate_is_wired_lazily(capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("tokenbatch_env.traces.suites")
    fake.generate_command = lambda spec, out: calls.append((spec, out)) or 0
    monkeypatch.setitem(sys.modules, "tokenbatch_env.traces.suites", fake)
    assert run(capsys, "generate", "smoke", "--out", "dir")[0] == 0
    assert run(capsys, "generate", "other")[0] == 0
    assert calls == [("smoke", "dir"), ("other", None)]


def test_console_script():
    exe = Path(sys.executable).with_name("tokenbatch")
    script = str(exe) if exe.exists() else shutil.which("tokenbatch")
    if script is None:
        pytest.skip("the tokenbatch console script is not installed (pip install -e .)")
    ok = subprocess.run([script, "traces", "info", str(FIX / "azure_ok.csv")], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "requests        4" in ok.stdout, ok.stderr
    bad = subprocess.run([script, "traces", "info", str(FIX / "mooncake_nan.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert_one_line_error(bad.stderr, "mooncake_nan.jsonl", "row 2", "'timestamp'", "NaN")
