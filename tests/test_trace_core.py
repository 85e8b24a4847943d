"""Trace core: block hashes, the content digest (stable and sensitive), exact canonical round trips.

The hypothesis strategy ``traces()`` is shared with test_trace_io.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbatch_env.errors import TraceError
from tokenbatch_env.traces import io as tio
from tokenbatch_env.traces.trace import (MAX_SLO_NS, MAX_TOKENS, NS_MOONCAKE, NS_PREFIX_GROUP,
                                         Trace, block_hash, block_hash_runs)

INT64 = st.integers(-(2**63), 2**63 - 1)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def traces(draw, min_size: int = 0, max_size: int = 8) -> Trace:
    """Random valid traces: equal arrivals, extreme token counts and SLOs, empty and full prefix
    chains, any int64 hash, negative priorities, traces with and without SLOs and priorities, odd
    metadata."""
    n = draw(st.integers(min_size, max_size))
    bs = draw(st.sampled_from([1, 16, 32]))
    gaps = draw(st.lists(st.sampled_from([0, 0, 1, 999_999, 10**9]) | st.integers(0, 10**12),
                         min_size=n, max_size=n))
    start = draw(st.integers(0, 10**15))
    arrival = start + np.cumsum(np.array(gaps, np.int64)) if n else np.zeros(0, np.int64)
    tokens = st.integers(1, 64) | st.sampled_from([1, MAX_TOKENS])
    prompt = draw(st.lists(tokens, min_size=n, max_size=n))
    output = draw(st.lists(tokens, min_size=n, max_size=n))
    slo = st.integers(1, 10**9) | st.sampled_from([1, 999_999, 1_000_001, MAX_SLO_NS])
    t1 = t2 = None
    if draw(st.booleans()):
        t1 = draw(st.lists(slo, min_size=n, max_size=n))
        t2 = draw(st.lists(slo, min_size=n, max_size=n))
    lens = [draw(st.integers(0, min(p // bs, 4))) for p in prompt]
    hashes = draw(st.lists(INT64 | st.integers(0, 5), min_size=sum(lens), max_size=sum(lens)))
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
    return Trace.build(
        arrival_ns=arrival, prompt_tokens=prompt, output_tokens=output, ttft_slo_ns=t1, tpot_slo_ns=t2,
        priority=draw(st.none() | st.lists(st.integers(-5, 5) | INT64, min_size=n, max_size=n)),
        class_id=draw(st.lists(st.integers(0, 1_000_000), min_size=n, max_size=n)),
        prefix_offsets=offsets, prefix_hashes=np.array(hashes, np.int64), block_size=bs,
        name=draw(text) or "t", source=draw(text))


def columns(trace: Trace) -> dict:
    return {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}


# ------------------------------------------------------------------------------------ block hashes
def test_block_hash_is_pinned():
    """The hash is part of every digest of a trace with prefixes: it must never change."""
    values = block_hash(NS_MOONCAKE, np.array([0, 0, 1, 2**40]), np.array([0, 1, 0, 31])).tolist()
    assert values == [1259121850600046442, 6952133413443977248, 2109394175486476283,
                      6913122761052271896]
    assert int(block_hash(NS_PREFIX_GROUP, 0, 0)) != int(block_hash(NS_MOONCAKE, 0, 0))


@given(keys=st.lists(INT64, max_size=20), per=st.integers(0, 40), ns=st.integers(0, 10))
@settings(max_examples=50, deadline=None)
def test_block_hash_runs_equals_block_hash(keys, per, ns):
    k = np.array(keys, np.int64)
    want = block_hash(ns, np.repeat(k, per), np.tile(np.arange(per), len(k)))
    got = block_hash_runs(ns, k, per)
    assert got.dtype == np.int64 and got.tolist() == want.tolist()


# ------------------------------------------------------------------------------------ digest
def test_digest_is_pinned(tmp_path):
    """A golden digest: a change to the canonical byte layout must bump DIGEST_VERSION knowingly."""
    t = Trace.build(arrival_ns=[0, 0, 5], prompt_tokens=[32, 16, 7], output_tokens=[1, 2, 3],
                    ttft_slo_ns=[10**9] * 3, tpot_slo_ns=[5 * 10**7] * 3,
                    prefix_offsets=[0, 2, 3, 3], prefix_hashes=[7, 8, 7])
    assert t.digest == PINNED_DIGEST


PINNED_DIGEST = "57b3bd61760722bd9b4465bab784ad0fba02a33b9a67ef199378e00e9f32c07e"


@given(trace=traces())
@SETTINGS
def test_digest_stable(trace):
    """Same arrays give the same digest: rebuilt from copies, from lists, from narrower dtypes,
    with other metadata, after NPZ and CSV round trips (covered in test_trace_io too)."""
    cols = columns(trace)
    again = Trace.build(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in cols.items()})
    assert again.digest == trace.digest
    as_lists = Trace.build(**{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in cols.items()})
    assert as_lists.digest == trace.digest
    assert trace.replace(name="other", source="elsewhere").digest == trace.digest
    if len(trace) and int(trace.prompt_tokens.max()) < 2**31:
        assert trace.replace(prompt_tokens=trace.prompt_tokens.astype(np.int32)).digest == trace.digest


def _edits(trace: Trace):
    """Every single-field edit of every row that keeps the trace valid, as ``replace`` kwargs."""
    n = len(trace)
    a = trace.arrival_ns
    for i in range(n):
        if i == n - 1 or a[i] < a[i + 1]:
            yield f"arrival_ns[{i}]+1", {"arrival_ns": _bump(a, i, +1)}
        if a[i] > (a[i - 1] if i else 0):
            yield f"arrival_ns[{i}]-1", {"arrival_ns": _bump(a, i, -1)}
        for col, hi in (("prompt_tokens", MAX_TOKENS), ("output_tokens", MAX_TOKENS),
                        ("ttft_slo_ns", MAX_SLO_NS), ("tpot_slo_ns", MAX_SLO_NS),
                        ("class_id", 1_000_000), ("priority", 2**63 - 1)):
            v = getattr(trace, col)
            if v is None:
                continue
            step = -1 if v[i] == hi else +1
            if col == "prompt_tokens" and step == -1 and (v[i] - 1) // trace.block_size < \
                    trace.prefix_lengths[i]:
                continue
            yield f"{col}[{i}]{step:+d}", {col: _bump(v, i, step)}
    h = trace.prefix_hashes
    for j in range(h.shape[0]):
        yield f"prefix_hashes[{j}]^1", {"prefix_hashes": _bump(h, j, 0, xor=1)}
    lens = trace.prefix_lengths
    for i in range(n):
        if lens[i]:  # drop the last block of request i's chain
            off = trace.prefix_offsets
            keep = np.ones(h.shape[0], bool)
            keep[off[i + 1] - 1] = False
            new_off = off.copy()
            new_off[i + 1:] -= 1
            yield f"chain[{i}] shorter", {"prefix_offsets": new_off, "prefix_hashes": h[keep]}
            if i + 1 < n and lens[i + 1] < trace.prompt_tokens[i + 1] // trace.block_size:
                # move the boundary: same flat hashes, the block now belongs to request i + 1
                moved = off.copy()
                moved[i + 1] -= 1
                yield f"chain[{i}] last block moved to {i + 1}", {"prefix_offsets": moved}
    if trace.has_slos:
        yield "SLOs dropped", {"ttft_slo_ns": None, "tpot_slo_ns": None}
    yield "block_size", {"block_size": trace.block_size + 1}


def _bump(arr, i, step, xor=None):
    out = np.array(arr, np.int64).copy()
    out[i] = out[i] ^ xor if xor is not None else out[i] + step
    return out


@given(trace=traces(min_size=1, max_size=5))
@SETTINGS
def test_digest_sensitive_to_every_single_field_edit(trace):
    seen = {trace.digest: "original"}
    for what, change in _edits(trace):
        try:
            edited = trace.replace(**change)
        except TraceError:  # e.g. block_size + 1 makes a chain too long: not a valid edit
            continue
        assert edited.digest not in seen, (what, seen.get(edited.digest))
        seen[edited.digest] = what
    assert len(seen) > 2 * len(trace)


def test_digest_separates_slo_columns_and_row_count():
    base = dict(arrival_ns=[0, 1], prompt_tokens=[5, 5], output_tokens=[2, 2])
    t = Trace.build(**base, ttft_slo_ns=[3, 4], tpot_slo_ns=[4, 3])
    swapped = Trace.build(**base, ttft_slo_ns=[4, 3], tpot_slo_ns=[3, 4])
    assert t.digest != swapped.digest
    empty = Trace.build(arrival_ns=[], prompt_tokens=[], output_tokens=[])
    empty_slo = Trace.build(arrival_ns=[], prompt_tokens=[], output_tokens=[], ttft_slo_ns=[],
                            tpot_slo_ns=[])
    assert empty.digest != empty_slo.digest


# ------------------------------------------------------------------------------------ round trips
@given(trace=traces())
@SETTINGS
def test_npz_and_csv_round_trips_are_exact(trace, tmp_path_factory):
    d = tmp_path_factory.mktemp("rt")
    for path, load in ((d / "t.npz", tio.load_npz), (d / "t.csv", tio.load_csv)):
        tio.save_trace(trace, path)
        back = load(path)
        assert back.digest == trace.digest, path.suffix
        assert (back.name, back.source, back.block_size) == (trace.name, trace.source,
                                                             trace.block_size)
        assert back.has_slos == trace.has_slos and back.has_priority == trace.has_priority
        for col, v in columns(trace).items():
            w = getattr(back, col)
            if isinstance(v, np.ndarray):
                assert w.dtype == np.int64 and np.array_equal(w, v), col
        # and through the dispatcher
        again, report = tio.load_trace(path)
        assert again.digest == trace.digest and report.rows_read == len(trace)


@given(ns=st.integers(1, 10**17))
@settings(max_examples=200, deadline=None)
def test_ms_text_is_exact(ns):
    text = tio._ms_text(ns)
    assert tio._scaled(text, 6) == ns
    assert "e" not in text and not text.endswith(".")


@pytest.mark.parametrize("text,scale,want", [
    ("1.5", 6, 1_500_000), ("0.000001", 6, 1), ("0.0000005", 6, 1), ("0.0000004", 6, 0),
    ("-2.25", 2, -225), ("1e3", 0, 1000), ("1.5E-3", 9, 1_500_000), (".5", 1, 5), ("7.", 0, 7),
    (" 3 ", 0, 3), ("+4", 0, 4),
])
def test_scaled_decimal_parser(text, scale, want):
    assert tio._scaled(text, scale) == want


@pytest.mark.parametrize("text,fragment", [
    ("nan", "NaN or infinite"), ("-Infinity", "NaN or infinite"), ("", "empty"), ("1.2.3", "not a number"),
    ("0x10", "not a number"), ("1e400", "out of range"), ("1" * 30, "out of range"),
])
def test_scaled_decimal_parser_rejects(text, fragment):
    with pytest.raises(tio._Bad, match=fragment):
        tio._scaled(text, 6)


def test_int_field_parser():
    assert tio._int("12") == 12 and tio._int("12.0") == 12 and tio._int("1e3") == 1000
    for bad, fragment in (("12.5", "not an integer"), ("abc", "not a number"), ("NaN", "NaN"),
                          (str(2**63), "out of range")):
        with pytest.raises(tio._Bad, match=fragment):
            tio._int(bad)
