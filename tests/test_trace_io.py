"""Trace readers and writers: the real traces in ../shared, hand-written fixtures, bad input.

Error rows are 1-based line numbers in the file (header = line 1); see tokenbatch_env/traces/io.py.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_path
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch_env.errors import TraceError
from tokenbatch_env.traces import io as tio
from tokenbatch_env.traces.trace import NS_MOONCAKE, Trace, block_hash

FIX = Path(__file__).parent / "fixtures"
AZURE = ("traces", "azure_llm_2023")
MOONCAKE = ("traces", "mooncake_fast25")


def fixture(name: str) -> str:
    return str(FIX / name)


# ------------------------------------------------------------------------------------ real traces
def test_azure_code_real():
    path = shared_path(*AZURE, "AzureLLMInferenceTrace_code.csv")
    assert tio.detect_format(path) == "azure"
    trace, report = tio.load_trace(path)
    assert len(trace) == 8819 and report.rows_read == 8819 and report.dropped == 0
    # 18:17:03.9799600 -> 18:17:04.0319600 -> 18:17:04.0781490
    assert trace.arrival_ns[:3].tolist() == [0, 52_000_000, 98_189_000]
    assert trace.prompt_tokens[:3].tolist() == [4808, 3180, 110]
    assert trace.output_tokens[:3].tolist() == [10, 8, 27]
    assert int(trace.arrival_ns[-1]) == 3_435_948_056_000  # 19:14:19.9280160 - 18:17:03.9799600
    assert int(trace.prompt_tokens.max()) == 7437
    assert not trace.has_slos and trace.prefix_hashes.size == 0
    assert trace.source == "azure:AzureLLMInferenceTrace_code.csv"
    assert trace.digest == "05cfbfe3b6022194d9797227498188f545b5b1dbb57c79cb0cd405428b6dea52"


def test_azure_conv_real_and_round_trips(tmp_path):
    path = shared_path(*AZURE, "AzureLLMInferenceTrace_conv.csv")
    trace, report = tio.load_trace(path)
    assert len(trace) == 19366
    assert trace.arrival_ns[:2].tolist() == [0, 4_314_579_000]  # 18:15:46.6805900 -> :50.9951690
    assert trace.prompt_tokens[:3].tolist() == [374, 396, 879]
    assert trace.output_tokens[:3].tolist() == [44, 109, 55]
    assert int(trace.arrival_ns[-1]) == 3_501_721_937_000
    assert int(trace.output_tokens.max()) == 1000 and int((trace.output_tokens == 1000).sum()) == 11
    for out in (tmp_path / "conv.npz", tmp_path / "conv.csv"):
        tio.save_trace(trace, out)
        back, _ = tio.load_trace(out)
        assert back.digest == trace.digest and back.name == trace.name


def test_mooncake_conversation_real():
    path = shared_path(*MOONCAKE, "conversation_trace.jsonl")
    assert tio.detect_format(path) == "mooncake"
    trace, report = tio.load_trace(path)
    assert len(trace) == 12031 and report.rows_read == 12031
    assert trace.arrival_ns[:4].tolist() == [0, 0, 0, 0]  # equal timestamps are legal
    assert int(trace.arrival_ns[-1]) == 3_536_999 * 10**6
    assert trace.prompt_tokens[:2].tolist() == [6758, 7322]
    assert trace.output_tokens[:2].tolist() == [500, 490]
    # row 0: hash ids 0..13, 6758 tokens = 13 full 512-blocks + a partial one (unique)
    chain0 = trace.prefix_chain(0)
    assert chain0.size == 13 * 32
    assert chain0[:32].tolist() == block_hash(NS_MOONCAKE, 0, np.arange(32)).tolist()
    assert chain0[32:64].tolist() == block_hash(NS_MOONCAKE, 1, np.arange(32)).tolist()
    # every request starts with hash id 0: the first 32 blocks are shared by all full-block chains
    chain1 = trace.prefix_chain(1)
    assert np.array_equal(chain1[:32], chain0[:32]) and chain1[32] != chain0[32]
    assert (trace.prefix_lengths <= trace.prompt_tokens // trace.block_size).all()


def test_mooncake_synthetic_real(tmp_path):
    path = shared_path(*MOONCAKE, "synthetic_trace.jsonl")
    trace, report = tio.load_trace(path)
    assert len(trace) == 3993
    assert trace.arrival_ns[:4].tolist() == [0, 0, 40_000_000, 277_000_000]
    assert int(trace.arrival_ns[-1]) == 1_022_025 * 10**6
    assert trace.prompt_tokens[:2].tolist() == [40160, 36640]
    assert trace.prefix_lengths[0] == (40160 // 512) * 32
    coarse = tio.read_mooncake(path, block_size=64).trace
    assert coarse.prefix_lengths[0] == (40160 // 512) * 8 and coarse.digest != trace.digest
    tio.save_npz(trace, tmp_path / "syn.npz")
    assert tio.load_npz(tmp_path / "syn.npz").digest == trace.digest


# ------------------------------------------------------------------------------------ fixtures
def test_azure_fixture_timestamps_cross_midnight():
    trace, report = tio.read_azure(fixture("azure_ok.csv"))
    # 23:59:59.9999999, 00:00:00.0000001 (next day), 00:00:00.5 (1 digit), 00:00:01 (no fraction)
    assert trace.arrival_ns.tolist() == [0, 200, 500_000_100, 1_000_000_100]
    assert trace.prompt_tokens.tolist() == [100, 200, 300, 4]
    assert trace.output_tokens.tolist() == [10, 20, 1, 7]
    assert report == tio.LoadReport(fixture("azure_ok.csv"), "azure", 4, 4, 0)


@given(a=st.datetimes(dt.datetime(1900, 1, 1), dt.datetime(2200, 1, 1)),
       b=st.datetimes(dt.datetime(1900, 1, 1), dt.datetime(2200, 1, 1)),
       digits=st.integers(0, 7))
@settings(max_examples=200, deadline=None)
def test_timestamp_parser_matches_datetime(a, b, digits):
    def text(d):
        frac = f"{d.microsecond:06d}0"[:digits]
        return d.strftime("%Y-%m-%d %H:%M:%S") + (f".{frac}" if digits else "")

    def truncated_us(d):
        return int(f"{d.microsecond:06d}0"[:digits].ljust(7, "0")) // 10

    delta = (b.replace(microsecond=truncated_us(b)) - a.replace(microsecond=truncated_us(a)))
    want = (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000
    assert tio.parse_timestamp_ns(text(b)) - tio.parse_timestamp_ns(text(a)) == want


def test_timestamp_parser_epoch_and_digits():
    assert tio.parse_timestamp_ns("1970-01-01 00:00:00") == 0
    assert tio.parse_timestamp_ns("1970-01-01 00:00:00.0000001") == 100
    assert tio.parse_timestamp_ns("1970-01-01T00:00:01.123456789") == 1_123_456_789
    assert tio.parse_timestamp_ns("2024-03-01 00:00:00") - tio.parse_timestamp_ns(
        "2024-02-28 00:00:00") == 2 * 86400 * 10**9  # leap day


def test_mooncake_fixture_chains():
    trace, report = tio.read_mooncake(fixture("mooncake_ok.jsonl"))
    assert trace.arrival_ns.tolist() == [0, 0, 12_500_000, 3_000_000_000]  # float ms, exact
    h = lambda key: block_hash(NS_MOONCAKE, key, np.arange(32)).tolist()  # noqa: E731
    assert trace.prefix_chain(0).tolist() == h(0)  # 1000 tokens: 1 full block, id 1 partial
    assert trace.prefix_chain(1).tolist() == h(0) + h(2)  # 1024 tokens: both blocks full
    assert trace.prefix_chain(2).tolist() == []  # 100 tokens: only a partial block
    assert trace.prefix_chain(3).tolist() == h(0) + h(1) + h(3)  # id 4 is the partial tail
    assert report.rows_read == 4
    coarse = tio.read_mooncake(fixture("mooncake_ok.jsonl"), block_size=32).trace
    assert coarse.block_size == 32 and coarse.prefix_lengths.tolist() == [16, 32, 0, 48]
    with pytest.raises(TraceError, match="must divide 512"):
        tio.read_mooncake(fixture("mooncake_ok.jsonl"), block_size=48)


def test_burstgpt_failed_rows_dropped_and_counted():
    trace, report = tio.load_trace(fixture("burstgpt_ok.csv"))
    assert report.format == "burstgpt"
    assert (report.rows_read, report.dropped_failed, report.requests, report.dropped) == (5, 2, 3, 2)
    assert len(trace) == 3
    assert trace.arrival_ns.tolist() == [0, 113 * 10**9, 195_250_000_000]  # relative to row 1
    assert trace.prompt_tokens.tolist() == [472, 417, 90]
    assert trace.output_tokens.tolist() == [18, 276, 12]


def test_canonical_csv_fixture():
    trace = tio.load_csv(fixture("canonical_ok.csv"))
    assert (trace.name, trace.source, trace.block_size) == ("hand-written", "tests/fixtures", 16)
    assert trace.ttft_slo_ns.tolist() == [250 * 10**6, 250_500_000, 1, 10**9]
    assert trace.tpot_slo_ns.tolist() == [25 * 10**6, 25 * 10**6, 100_000, 50 * 10**6]
    assert trace.priority.tolist() == [0, 0, -1, 3] and trace.class_id.tolist() == [0, 1, 2, 0]
    assert trace.prefix_offsets.tolist() == [0, 2, 4, 4, 8]
    assert trace.prefix_hashes.tolist() == [11, 12, 11, 12, 11, 12, 13, 14]


def test_canonical_csv_minimal_any_column_order():
    trace = tio.load_csv(fixture("canonical_minimal.csv"))
    assert tio.detect_format(fixture("canonical_minimal.csv")) == "csv"
    assert trace.arrival_ns.tolist() == [0, 10] and trace.prompt_tokens.tolist() == [100, 200]
    assert trace.output_tokens.tolist() == [5, 6] and not trace.has_slos
    assert trace.name == "canonical_minimal" and trace.block_size == 16


def test_canonical_csv_layout(tmp_path):
    t = Trace.build(arrival_ns=[0, 7], prompt_tokens=[40, 3], output_tokens=[2, 1],
                    ttft_slo_ns=[1_500_000, 2 * 10**6], tpot_slo_ns=[1, 123_456_789],
                    priority=[-2, 0], class_id=[1, 0], prefix_offsets=[0, 2, 2],
                    prefix_hashes=[-5, 2**63 - 1], name="a, \"b\"\nc", source="s=1")
    tio.save_csv(t, tmp_path / "t.csv")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0].startswith("# tokenbatch-trace v1 {")
    assert lines[1] == ",".join(tio.CANONICAL_COLUMNS)
    assert lines[2] == f"0,40,2,1.5,0.000001,-2,1,-5 {2**63 - 1}"
    assert lines[3] == "7,3,1,2,123.456789,0,0,"
    assert tio.load_csv(tmp_path / "t.csv").name == "a, \"b\"\nc"


def test_canonical_csv_round_trips_a_prefix_chain_longer_than_csvs_field_limit(tmp_path):
    """A 135k-token prompt's chain (Mooncake's longest: ~8.4k hashes, ~170 kB in one cell) is past
    the csv module's default 128 KiB field limit; written, it must read back (it did not)."""
    import csv
    n = 9000
    hashes = np.arange(n, dtype=np.int64) * 1_000_000_007 + 2**62
    t = Trace.build(arrival_ns=[0, 5], prompt_tokens=[n * 16, 16], output_tokens=[3, 1],
                    prefix_offsets=[0, n, n + 1], prefix_hashes=[*hashes.tolist(), 7], name="long")
    tio.save_csv(t, tmp_path / "long.csv")
    assert max(map(len, (tmp_path / "long.csv").read_text().splitlines())) > csv.field_size_limit()
    before = csv.field_size_limit()
    assert tio.load_trace(tmp_path / "long.csv").trace.digest == t.digest
    assert csv.field_size_limit() == before   # the process-wide limit is restored


def test_empty_trace_round_trips(tmp_path):
    for slo in (None, []):
        t = Trace.build(arrival_ns=[], prompt_tokens=[], output_tokens=[], ttft_slo_ns=slo,
                        tpot_slo_ns=slo)
        for p in (tmp_path / "e.npz", tmp_path / "e.csv"):
            tio.save_trace(t, p)
            assert tio.load_trace(p).trace.digest == t.digest


# ------------------------------------------------------------------------------------ bad input
BAD = [
    # fixture, row (1-based line), column, fragment of the reason
    ("azure_missing_column.csv", 1, "GeneratedTokens", "missing column"),
    ("azure_non_numeric.csv", 3, "ContextTokens", "not a number"),
    ("azure_negative.csv", 4, "GeneratedTokens", "negative"),
    ("azure_zero_tokens.csv", 2, "ContextTokens", "zero tokens"),
    ("azure_nan.csv", 3, "GeneratedTokens", "NaN"),
    ("azure_decreasing.csv", 4, "TIMESTAMP", "decreases"),
    ("azure_truncated.csv", 4, "GeneratedTokens", "truncated"),
    ("azure_absurd.csv", 3, "ContextTokens", "absurd"),
    ("azure_bad_date.csv", 3, "TIMESTAMP", "day out of range"),
    ("burstgpt_missing_column.csv", 1, "Response tokens", "missing column"),
    ("burstgpt_negative.csv", 3, "Response tokens", "negative"),
    ("burstgpt_zero_request.csv", 4, "Request tokens", "zero tokens"),
    ("canonical_slo_zero.csv", 4, "ttft_slo_ms", "zero SLO"),
    ("canonical_slo_negative.csv", 5, "tpot_slo_ms", "negative SLO"),
    ("canonical_slo_partial.csv", 4, "ttft_slo_ms", "all or none"),
    ("canonical_inf.csv", 3, "ttft_slo_ms", "infinite"),
    ("canonical_chain_too_long.csv", 4, "prefix_hashes", "chain longer"),
    ("canonical_bad_hash.csv", 4, "prefix_hashes", "not a number"),
    ("mooncake_truncated.jsonl", 3, "hash_ids", "truncated"),
    ("mooncake_hash_count.jsonl", 2, "hash_ids", "expected ceil(1100/512) = 3"),
    ("mooncake_missing_field.jsonl", 2, "output_length", "missing field"),
    ("mooncake_decreasing.jsonl", 3, "timestamp", "decreases"),
    ("mooncake_zero_output.jsonl", 1, "output_length", "zero tokens"),
    ("mooncake_nan.jsonl", 2, "timestamp", "NaN"),
    ("mooncake_negative.jsonl", 2, "input_length", "negative"),
    ("mooncake_non_numeric.jsonl", 1, "input_length", "not an integer"),
    ("mooncake_absurd.jsonl", 2, "output_length", "absurd"),
]


@pytest.mark.parametrize("name,row,column,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_file_row_and_column(name, row, column, fragment):
    path = fixture(name)
    with pytest.raises(TraceError) as info:
        tio.load_trace(path)
    e = info.value
    assert (e.file, e.row, e.column) == (path, row, column)
    message = str(e)
    assert message.startswith(f"{path}, row {row}, column {column!r}: ")
    assert fragment in message and "\n" not in message


@pytest.mark.parametrize("name,fmt,row", [
    ("azure_empty.csv", "azure", None), ("mooncake_empty.jsonl", "mooncake", None),
    ("azure_header_only.csv", "azure", 2),
])
def test_empty_files(name, fmt, row):
    path = fixture(name)
    with pytest.raises(TraceError, match="empty file|no data rows") as info:
        tio.load_trace(path, fmt)
    assert info.value.file == path and info.value.row == row
    if fmt == "azure" and row is None:  # detection also names the file
        with pytest.raises(TraceError, match="empty file"):
            tio.load_trace(path)


def test_explicit_format_applies_reader_checks():
    # an Azure file read as BurstGPT: the BurstGPT reader names its first missing column
    with pytest.raises(TraceError) as info:
        tio.load_trace(fixture("azure_ok.csv"), "burstgpt")
    assert (info.value.row, info.value.column) == (1, "Timestamp")
    with pytest.raises(TraceError, match="unknown format"):
        tio.load_trace(fixture("azure_ok.csv"), "parquet")


def test_undetectable_format(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceError, match="--format") as info:
        tio.load_trace(p)
    assert info.value.row == 1
    with pytest.raises(TraceError, match="no such file"):
        tio.load_trace(tmp_path / "missing.csv")


def _good_trace():
    return Trace.build(arrival_ns=[0, 5, 9], prompt_tokens=[40, 16, 3], output_tokens=[2, 1, 4],
                       prefix_offsets=[0, 2, 3, 3], prefix_hashes=[1, 2, 1], name="g")


def _rewrite_npz(src, dst, drop=(), change=None):
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files if k not in drop}
    arrays.update(change or {})
    with open(dst, "wb") as f:
        np.savez(f, **arrays)


def test_npz_bad_inputs(tmp_path):
    good = tmp_path / "good.npz"
    tio.save_npz(_good_trace(), good)
    cases = []
    p = tmp_path / "missing.npz"
    _rewrite_npz(good, p, drop=("output_tokens",))
    cases.append((p, None, "output_tokens", "missing column"))
    p = tmp_path / "edited.npz"
    _rewrite_npz(good, p, change={"output_tokens": np.array([2, 1, 5])})
    cases.append((p, None, "meta", "digest"))
    p = tmp_path / "zero.npz"
    _rewrite_npz(good, p, change={"output_tokens": np.array([2, 0, 4])})
    cases.append((p, 2, "output_tokens", "token count"))
    p = tmp_path / "float.npz"
    _rewrite_npz(good, p, change={"prompt_tokens": np.array([40.0, 16.0, 3.0])})
    cases.append((p, None, "prompt_tokens", "integer array"))
    p = tmp_path / "version.npz"
    meta = json.loads(str(np.load(good)["meta"]))
    _rewrite_npz(good, p, change={"meta": np.array(json.dumps(meta | {"version": 99}))})
    cases.append((p, None, "meta", "unsupported version"))
    p = tmp_path / "truncated.npz"
    data = good.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    cases.append((p, None, None, "not a readable .npz"))
    p = tmp_path / "empty.npz"
    p.write_bytes(b"")
    cases.append((p, None, None, "empty file"))
    p = tmp_path / "plain.npz"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("x.npy", b"junk")
    cases.append((p, None, "meta", "not a tokenbatch trace"))
    for path, row, column, fragment in cases:
        with pytest.raises(TraceError) as info:
            tio.load_trace(path)
        e = info.value
        assert (e.file, e.row, e.column) == (str(path), row, column), path.name
        assert fragment in str(e) and "\n" not in str(e), (path.name, str(e))


def test_canonical_block_size_and_name_options(tmp_path):
    p = tmp_path / "g.npz"
    tio.save_npz(_good_trace(), p)
    assert tio.load_trace(p, name="renamed").trace.name == "renamed"
    assert tio.load_trace(p, block_size=16).trace.block_size == 16
    with pytest.raises(TraceError, match="block_size 32 given"):
        tio.load_trace(p, block_size=32)
    assert tio.load_trace(fixture("azure_ok.csv"), block_size=32).trace.block_size == 32


def test_detect_format_of_fixtures(tmp_path):
    assert tio.detect_format(fixture("azure_ok.csv")) == "azure"
    assert tio.detect_format(fixture("burstgpt_ok.csv")) == "burstgpt"
    assert tio.detect_format(fixture("canonical_ok.csv")) == "csv"
    assert tio.detect_format(fixture("mooncake_ok.jsonl")) == "mooncake"
    p = tmp_path / "no_extension"
    tio.save_npz(_good_trace(), p)
    assert tio.detect_format(p) == "npz" and tio.load_trace(p).trace.name == "g"


def test_save_trace_rejects_unknown_extension(tmp_path):
    with pytest.raises(TraceError, match="use .npz or .csv"):
        tio.save_trace(_good_trace(), tmp_path / "t.parquet")


@pytest.mark.parametrize("suffix", [".npz", ".csv"])
def test_writes_are_atomic(tmp_path, monkeypatch, suffix):
    path = tmp_path / f"t{suffix}"
    tio.save_trace(_good_trace(), path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", boom)
    monkeypatch.setattr(Path, "write_text", boom)
    with pytest.raises(KeyboardInterrupt):
        tio.save_trace(_good_trace().replace(name="other"), path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == [path.name]
