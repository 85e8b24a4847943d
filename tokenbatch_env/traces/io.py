"""Trace readers and writers (docs/design.md section 2).

Formats (``fmt`` names):

``npz``
    The canonical binary format: one int64 array per column (``ttft_slo_ns``/``tpot_slo_ns`` absent
    when the trace has no SLOs, ``priority`` when it has no priority of its own) plus a JSON ``meta``
    string (format version, block size, name, source, digest). Round-trips exactly; the digest is
    checked on load.
``csv``
    The canonical text format, for reading and writing by hand. Line 1 is a comment
    ``# tokenbatch-trace v1 {"block_size": 16, "name": ..., "source": ...}`` (optional on input:
    without it, block size 16 and the file's stem as name); line 2 the header
    ``arrival_ns,prompt_tokens,output_tokens,ttft_slo_ms,tpot_slo_ms,priority,class_id,prefix_hashes``.
    SLOs are decimal milliseconds written exactly from the integer nanoseconds and parsed back by
    integer arithmetic (no float on the way; more than 6 decimals are rounded to the nearest ns).
    SLO cells are empty for traces without SLOs (all rows or none); the ``priority`` column is left
    out for a trace without a priority of its own. ``prefix_hashes`` is the request's block-hash
    chain, space-separated (may be empty). On input only ``arrival_ns``, ``prompt_tokens`` and
    ``output_tokens`` are required, in any column order.
``azure``
    Azure LLM inference trace 2023 (``TIMESTAMP,ContextTokens,GeneratedTokens``), timestamps
    ``YYYY-MM-DD HH:MM:SS.fffffff`` parsed by our own integer parser (1 to 9 fractional digits).
``mooncake``
    Mooncake FAST'25 JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).
    Hash id ``h`` of a full 512-token block becomes ``512 / block_size`` engine block hashes
    ``block_hash(NS_MOONCAKE, h, 0..)``; a partial last 512-token block is unique to its request.
``burstgpt``
    BurstGPT CSV (``Timestamp`` s, ``Model``, ``Request tokens``, ``Response tokens``,
    ``Total tokens``, ``Log Type``). Rows with 0 response tokens are failed requests: dropped and
    counted in the load report (``LoadReport.dropped_failed``).

Arrival times of the external formats (azure, mooncake, burstgpt) are made relative to the first
loaded request, so every such trace starts at 0; equal timestamps are legal and keep file order.

**Which columns a file had.** ``Trace.has_slos`` and ``Trace.has_priority`` say whether the file
really had SLO and priority columns (a canonical file: the column is present; the external formats
have neither), so that an SLO rule fills only what is missing (docs/design.md section 2). The
writers leave out what the trace lacks, so the flags survive a round trip; files and digests of
traces that have both are unchanged.

**Errors.** Bad input raises one ``TraceError`` naming the file, the row and the column (the file's
own column name, e.g. ``'ContextTokens'``). For text formats ``row`` is the **1-based line number
in the file** (the header is line 1, so for a CSV opened in a spreadsheet it is the spreadsheet row,
and ``sed -n '<row>p' FILE`` prints it); for NPZ files it is the 1-based request number. Nothing
partially loaded is ever returned.

Public API: ``save_npz``/``load_npz``, ``save_csv``/``load_csv``, ``read_azure``, ``read_mooncake``,
``read_burstgpt``, ``detect_format``, ``load_trace``, ``save_trace``. The ``read_*`` functions and
``load_trace`` return a ``LoadResult`` (a named tuple ``(trace, report)``); ``load_npz`` and
``load_csv`` return the ``Trace`` itself (nothing is ever dropped from a canonical file).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io as _stdio
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .._io import atomic_path
from ..errors import TraceError
from .trace import MAX_SLO_NS, MAX_TOKENS, NS_MOONCAKE, Trace, block_hash_runs

__all__ = [
    "FORMATS", "READERS", "TraceReader", "LoadReport", "LoadResult", "save_npz", "load_npz", "save_csv", "load_csv",
    "read_azure", "read_mooncake", "read_burstgpt", "detect_format", "load_trace", "save_trace",
]

#: Tokens per Mooncake hash id.
MOONCAKE_BLOCK_TOKENS = 512
CSV_MAGIC = "# tokenbatch-trace v1"
NPZ_FORMAT = "tokenbatch-trace"
NPZ_VERSION = 1
CANONICAL_COLUMNS = ("arrival_ns", "prompt_tokens", "output_tokens", "ttft_slo_ms", "tpot_slo_ms",
                     "priority", "class_id", "prefix_hashes")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
#: Any parsed integer beyond this magnitude is rejected before it can overflow int64 arithmetic.
_BIG = 2**62
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_NS_PER_MS = 10**6
_NS_PER_S = 10**9


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a reader did: rows read from the file, rows dropped (and why), requests loaded."""

    file: str
    format: str
    rows_read: int
    requests: int
    dropped_failed: int = 0

    @property
    def dropped(self) -> int:
        return self.rows_read - self.requests


class LoadResult(NamedTuple):
    """A loaded trace and its ``LoadReport``; unpacks as ``trace, report = load_trace(path)``."""

    trace: Trace
    report: LoadReport


# ---------------------------------------------------------------------------------------- parsing
class _Bad(Exception):
    """A bad field; the caller adds file, row and column."""


_DECIMAL = re.compile(r"\s*([+-]?)(\d*)(?:\.(\d*))?(?:[eE]([+-]?\d+))?\s*\Z")
_NONFINITE = {"nan", "+nan", "-nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"}


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _scaled(text: str, scale: int, *, exact: bool = False) -> int:
    """Exact integer value of decimal ``text`` times ``10**scale``, rounded half away from zero.

    Integer arithmetic only: ``_scaled("1.5", 6) == 1500000`` exactly; NaN/inf/garbage raise, and
    so does a value that needs rounding when ``exact``.
    """
    m = _DECIMAL.match(text)
    if m is None or not (m.group(2) or m.group(3)):
        t = text.strip()
        if t.lower() in _NONFINITE:
            raise _Bad(f"NaN or infinite value {_shown(t)}")
        if not t:
            raise _Bad("empty value")
        raise _Bad(f"not a number: {_shown(t)}")
    sign, whole, frac, exp = m.groups()
    frac = frac or ""
    e = int(exp) if exp and len(exp) < 6 else (0 if not exp else 10**6)
    if abs(e) > 30:
        raise _Bad(f"value out of range: {_shown(text.strip())}")
    digits = int((whole or "0") + frac)
    shift = scale + e - len(frac)
    if shift >= 0:
        value = digits * 10**shift
    else:
        q, r = divmod(digits, 10**-shift)
        if r and exact:
            raise _Bad(f"not an integer: {_shown(text.strip())}")
        value = q + (1 if 2 * r >= 10**-shift else 0)
    if value > _BIG:
        raise _Bad(f"value out of range: {_shown(text.strip())}")
    return -value if sign == "-" else value


def _int(text: str) -> int:
    """An integer field ("12", also "12.0" or "1e3"); fractions, NaN, garbage, huge values raise."""
    try:
        v = int(text)
    except ValueError:
        return _scaled(text, 0, exact=True)
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise _Bad(f"value out of range: {_shown(text.strip())}")
    return v


def _ms_to_ns(v) -> int:
    """A JSON millisecond timestamp (int or float literal) to integer ns, exactly."""
    if v.__class__ is int:
        if not -_BIG // _NS_PER_MS <= v <= _BIG // _NS_PER_MS:
            raise _Bad(f"value out of range: {v}")
        return v * _NS_PER_MS
    if isinstance(v, _JsonNumber):
        return _scaled(v, 6)
    raise _Bad(f"not a number: {_shown(json.dumps(v))}")


def _json_int(value, what: str = "an integer") -> int:
    """An integer from JSON (int, or a float literal with an integral value)."""
    if value.__class__ is int:
        if not -_BIG <= value <= _BIG:
            raise _Bad(f"value out of range: {value}")
        return value
    if isinstance(value, _JsonNumber):
        return _int(value)
    raise _Bad(f"not {what}: {_shown(json.dumps(value))}")


_INT_TYPE = {int}


class _JsonNumber(str):
    """A JSON number literal with a fraction or exponent, kept as text for exact parsing."""


def _json_constant(name: str):
    e = _Bad(f"NaN or infinite value {name!r}")
    e.constant = name
    raise e


# ---------------------------------------------------------------------------------------- helpers
def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceError("no such file", file=str(path)) from None
    except IsADirectoryError:
        raise TraceError("is a directory, not a trace file", file=str(path)) from None
    except OSError as e:
        raise TraceError(f"cannot read: {e.strerror or e}", file=str(path)) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TraceError("not UTF-8 text", file=str(path), row=line) from None
    if not text.strip():
        raise TraceError("empty file", file=str(path))
    return text


def _header_index(path: str, line: int, header: Sequence[str], required: Sequence[str],
                  optional: Sequence[str] = ()) -> dict:
    names = [h.strip() for h in header]
    idx = {}
    for col in list(required) + list(optional):
        if col in names:
            idx[col] = names.index(col)
        elif col in required:
            raise TraceError(f"missing column (header has {', '.join(names)})", file=path,
                             row=line, column=col)
    return idx


def _csv_rows(text: str, path: str, first_line: int = 1):
    """(line numbers, rows) of the non-blank CSV records of ``text`` (whose line 1 is file line
    ``first_line``). No field is refused for its size: the csv module's default limit (128 KiB) is
    raised to the text's length while reading (a canonical CSV's ``prefix_hashes`` cell of a long
    prompt holds thousands of hashes: ~170 kB for Mooncake's 135k-token prompts)."""
    reader = csv.reader(_stdio.StringIO(text))
    lines, rows = [], []
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text)))
    try:
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            rows.append(row)
            lines.append(reader.line_num + first_line - 1)
    except csv.Error as e:
        raise TraceError(f"malformed CSV: {e}", file=path, row=reader.line_num + first_line - 1) from None
    finally:
        csv.field_size_limit(limit)
    return lines, rows


def _field_count_error(path, line, header_names, row):
    if len(row) < len(header_names):
        raise TraceError(f"truncated row: {len(row)} of {len(header_names)} fields", file=path,
                         row=line, column=header_names[len(row)].strip())
    raise TraceError(f"{len(row)} fields, header has {len(header_names)}", file=path, row=line,
                     column=f"#{len(header_names) + 1}")


def _check_range(path: str, lines, values: np.ndarray, column: str, lo: int, hi: int,
                 what: str = "value", show: Callable[[int], str] = str) -> None:
    bad = (values < lo) | (values > hi)
    if bad.any():
        i = int(np.argmax(bad))
        v = int(values[i])
        if v < 0 and lo >= 0:
            reason = f"negative {what} {show(v)}"
        elif v == 0 and lo >= 1:
            reason = f"zero {what} (must be > 0)"
        elif v > hi:
            reason = f"absurd {what} {show(v)} (at most {show(hi)})"
        else:
            reason = f"{what} {show(v)} out of range {show(lo)}..{show(hi)}"
        raise TraceError(reason, file=path, row=int(lines[i]), column=column)


def _check_sorted(path: str, lines, times: np.ndarray, column: str) -> None:
    dec = np.flatnonzero(np.diff(times) < 0)
    if dec.size:
        i = int(dec[0]) + 1
        raise TraceError("timestamp decreases (rows must be sorted by arrival)", file=path,
                         row=int(lines[i]), column=column)


def _build(path: str, lines, colmap: dict, **kw) -> Trace:
    """``Trace.build`` with its errors (0-based index, internal column) mapped to file terms."""
    try:
        return Trace.build(**kw)
    except TraceError as e:
        row = e.row
        if row is not None and lines is not None and 0 <= row < len(lines):
            row = int(lines[row])
        raise TraceError(e.reason, file=path, row=row,
                         column=colmap.get(e.column, e.column)) from None


def _name(path: Path) -> str:
    return path.stem


# ---------------------------------------------------------------------------------------- NPZ
_NPZ_COLUMNS = ("arrival_ns", "prompt_tokens", "output_tokens", "ttft_slo_ns", "tpot_slo_ns",
                "priority", "class_id", "prefix_offsets", "prefix_hashes")


def save_npz(trace: Trace, path) -> None:
    """Write ``trace`` to ``path`` in the canonical NPZ format, atomically."""
    arrays = {c: np.ascontiguousarray(getattr(trace, c), dtype="<i8") for c in _NPZ_COLUMNS
              if getattr(trace, c) is not None and (c != "priority" or trace.has_priority)}
    meta = {"format": NPZ_FORMAT, "version": NPZ_VERSION, "block_size": trace.block_size,
            "name": trace.name, "source": trace.source, "digest": trace.digest,
            "requests": len(trace)}
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # uncompressed: hash chains are random bytes, deflate only costs time


def load_npz(path) -> Trace:
    """Read a canonical NPZ trace; the stored digest must match the content."""
    p = Path(path)
    f = str(p)
    if not p.exists():
        raise TraceError("no such file", file=f)
    if p.is_file() and p.stat().st_size == 0:
        raise TraceError("empty file", file=f)
    try:
        with np.load(p, allow_pickle=False) as z:
            names = set(z.files)
            if "meta" not in names:
                raise TraceError("not a tokenbatch trace (no 'meta' entry)", file=f, column="meta")
            try:
                meta = json.loads(str(z["meta"]))
            except (ValueError, TypeError):
                raise TraceError("unreadable metadata", file=f, column="meta") from None
            if not isinstance(meta, dict) or meta.get("format") != NPZ_FORMAT:
                raise TraceError("not a tokenbatch trace", file=f, column="meta")
            if meta.get("version") != NPZ_VERSION:
                raise TraceError(f"unsupported version {meta.get('version')!r} (this reader: "
                                 f"{NPZ_VERSION})", file=f, column="meta")
            cols = {}
            for c in _NPZ_COLUMNS:
                if c in names:
                    cols[c] = z[c]
                elif c not in ("ttft_slo_ns", "tpot_slo_ns", "priority"):
                    raise TraceError("missing column", file=f, column=c)
    except TraceError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise TraceError(f"not a readable .npz file ({e})".replace("\n", " "), file=f) from None
    for c, a in cols.items():
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise TraceError(f"must be a 1-D integer array, got {a.dtype} {a.shape}", file=f, column=c)
    n = cols["arrival_ns"].shape[0]
    trace = _build(f, np.arange(1, n + 2), {}, **cols, block_size=meta.get("block_size", 16),
                   name=meta.get("name", _name(p)), source=meta.get("source", ""))
    if "digest" in meta and meta["digest"] != trace.digest:
        raise TraceError("content does not match the stored digest (file corrupted or edited)",
                         file=f, column="meta")
    return trace


# ---------------------------------------------------------------------------------------- CSV
def _ms_text(ns: int) -> str:
    """Integer ns as an exact decimal ms string: 1500000 -> '1.5', 2000000 -> '2'."""
    q, r = divmod(ns, _NS_PER_MS)
    return f"{q}.{r:06d}".rstrip("0") if r else str(q)


def save_csv(trace: Trace, path) -> None:
    """Write ``trace`` to ``path`` in the canonical CSV format, atomically."""
    meta = {"block_size": trace.block_size, "name": trace.name, "source": trace.source,
            "slos": trace.has_slos}
    header = [c for c in CANONICAL_COLUMNS if c != "priority" or trace.has_priority]
    out = [f"{CSV_MAGIC} {json.dumps(meta, ensure_ascii=True)}", ",".join(header)]
    arr = trace.arrival_ns.tolist()
    pr = trace.prompt_tokens.tolist()
    ou = trace.output_tokens.tolist()
    prio = [f"{v}," for v in trace.priority.tolist()] if trace.has_priority else [""] * len(arr)
    cls = trace.class_id.tolist()
    n = len(arr)
    if trace.has_slos:
        t1 = [_ms_text(v) for v in trace.ttft_slo_ns.tolist()]
        t2 = [_ms_text(v) for v in trace.tpot_slo_ns.tolist()]
    else:
        t1 = t2 = [""] * n
    off = trace.prefix_offsets.tolist()
    hashes = trace.prefix_hashes.tolist()
    for i in range(n):
        chain = " ".join(map(str, hashes[off[i]:off[i + 1]]))
        out.append(f"{arr[i]},{pr[i]},{ou[i]},{t1[i]},{t2[i]},{prio[i]}{cls[i]},{chain}")
    text = "\n".join(out) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8", newline="\n")


def _load_csv(path) -> LoadResult:
    p = Path(path)
    f = str(p)
    text = _read_text(p)
    meta = {}
    first_line = 1
    if text.startswith("#"):
        first, _, text = text.partition("\n")
        first_line = 2
        if first.startswith(CSV_MAGIC):
            rest = first[len(CSV_MAGIC):].strip()
            if rest:
                try:
                    meta = json.loads(rest)
                except ValueError:
                    raise TraceError("unreadable metadata in the comment line", file=f, row=1) from None
                if not isinstance(meta, dict):
                    raise TraceError("unreadable metadata in the comment line", file=f, row=1)
        elif first.startswith("# tokenbatch-trace"):
            raise TraceError(f"unsupported canonical CSV version {first.strip()!r}", file=f, row=1)
    lines, rows = _csv_rows(text, f, first_line)
    if not rows:
        raise TraceError("empty file (no header)", file=f, row=first_line)
    header, hline = rows[0], lines[0]
    idx = _header_index(f, hline, header, CANONICAL_COLUMNS[:3], CANONICAL_COLUMNS[3:])
    has_t1, has_t2 = "ttft_slo_ms" in idx, "tpot_slo_ms" in idx
    if has_t1 != has_t2:
        raise TraceError("give both SLO columns or neither", file=f, row=hline,
                         column="tpot_slo_ms" if has_t1 else "ttft_slo_ms")
    rows, lines = rows[1:], lines[1:]
    n = len(rows)
    width = len(header)
    ia, ip, io_ = idx["arrival_ns"], idx["prompt_tokens"], idx["output_tokens"]
    it1, it2 = idx.get("ttft_slo_ms"), idx.get("tpot_slo_ms")
    ipr, icl, ih = idx.get("priority"), idx.get("class_id"), idx.get("prefix_hashes")
    arrival, prompt, output = [0] * n, [0] * n, [0] * n
    t1, t2 = ([0] * n, [0] * n) if has_t1 else (None, None)
    prio, cls = [0] * n, [0] * n
    lens, hashes = [0] * n, []
    slo_state = None  # True: SLO cells filled, False: empty; must agree on every row
    line = col = None
    try:
        for i, row in enumerate(rows):
            line = lines[i]
            if len(row) != width:
                _field_count_error(f, line, header, row)
            col = "arrival_ns"
            arrival[i] = _int(row[ia])
            col = "prompt_tokens"
            prompt[i] = _int(row[ip])
            col = "output_tokens"
            output[i] = _int(row[io_])
            if has_t1:
                a, b = row[it1].strip(), row[it2].strip()
                filled = bool(a)
                if bool(b) != filled:
                    col = "tpot_slo_ms" if filled else "ttft_slo_ms"
                    raise _Bad("SLO cells must be both filled or both empty")
                if slo_state is None:
                    slo_state = filled
                elif filled != slo_state:
                    col = "ttft_slo_ms"
                    raise _Bad("SLO cells are empty in some rows and filled in others (all or none)")
                if filled:
                    col = "ttft_slo_ms"
                    t1[i] = _scaled(a, 6)
                    col = "tpot_slo_ms"
                    t2[i] = _scaled(b, 6)
            if ipr is not None:
                col = "priority"
                prio[i] = _int(row[ipr])
            if icl is not None:
                col = "class_id"
                cls[i] = _int(row[icl])
            if ih is not None:
                col = "prefix_hashes"
                cell = row[ih].split()
                if cell:
                    try:
                        chain = list(map(int, cell))
                    except ValueError:
                        chain = [_int(c) for c in cell]
                    if min(chain) < _INT64_MIN or max(chain) > _INT64_MAX:
                        raise _Bad("hash out of the int64 range")
                    lens[i] = len(chain)
                    hashes.extend(chain)
    except _Bad as e:
        raise TraceError(str(e), file=f, row=line, column=col) from None
    if not (slo_state or (n == 0 and has_t1 and meta.get("slos"))):
        t1 = t2 = None  # an empty trace keeps its SLO columns through the comment's "slos" flag
    arrival_a = np.array(arrival, dtype=np.int64)
    _check_range(f, lines, arrival_a, "arrival_ns", 0, _BIG, "arrival time")
    _check_sorted(f, lines, arrival_a, "arrival_ns")
    prompt_a = np.array(prompt, dtype=np.int64)
    output_a = np.array(output, dtype=np.int64)
    _check_range(f, lines, prompt_a, "prompt_tokens", 1, MAX_TOKENS, "tokens")
    _check_range(f, lines, output_a, "output_tokens", 1, MAX_TOKENS, "tokens")
    if t1 is not None:
        for col, vals in (("ttft_slo_ms", t1), ("tpot_slo_ms", t2)):
            _check_range(f, lines, np.array(vals, np.int64), col, 1, MAX_SLO_NS, "SLO",
                         show=lambda ns: ("-" if ns < 0 else "") + _ms_text(abs(ns)) + " ms")
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    colmap = {"ttft_slo_ns": "ttft_slo_ms", "tpot_slo_ns": "tpot_slo_ms",
              "prefix_offsets": "prefix_hashes"}
    trace = _build(f, lines, colmap, arrival_ns=arrival_a, prompt_tokens=prompt_a,
                   output_tokens=output_a, ttft_slo_ns=t1, tpot_slo_ns=t2,
                   priority=prio if ipr is not None else None,
                   class_id=cls, prefix_offsets=offsets, prefix_hashes=np.array(hashes, np.int64),
                   block_size=meta.get("block_size", 16), name=meta.get("name", _name(p)),
                   source=meta.get("source", ""))
    return LoadResult(trace, LoadReport(f, "csv", n, n))


def load_csv(path) -> Trace:
    """Read a canonical CSV trace (see the module docstring for the layout)."""
    return _load_csv(path).trace


# ---------------------------------------------------------------------------------------- Azure
_AZURE_TS = re.compile(r"\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\s*\Z")
_DAYS_IN_MONTH = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _days_from_civil(y: int, m: int, d: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm, integers only)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def _leap(y: int) -> bool:
    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)


def parse_timestamp_ns(text: str, _day_cache: dict = {}) -> int:  # noqa: B006 (cache by design)
    """``YYYY-MM-DD HH:MM:SS[.f{1,9}]`` (no time zone) to integer ns since 1970-01-01, exactly."""
    m = _AZURE_TS.match(text)
    if m is None:
        t = text.strip()
        if t.lower() in _NONFINITE:
            raise _Bad(f"NaN or infinite value {_shown(t)}")
        raise _Bad(f"not a timestamp YYYY-MM-DD HH:MM:SS.fffffff: {_shown(t)}")
    y, mo, d, hh, mi, ss, frac = m.groups()
    day_key = (y, mo, d)
    days = _day_cache.get(day_key)
    if days is None:
        yi, moi, di = int(y), int(mo), int(d)
        if not 1 <= moi <= 12:
            raise _Bad(f"month out of range in {_shown(text.strip())}")
        dim = 29 if moi == 2 and _leap(yi) else _DAYS_IN_MONTH[moi - 1]
        if not 1 <= di <= dim:
            raise _Bad(f"day out of range in {_shown(text.strip())}")
        days = _days_from_civil(yi, moi, di)
        if len(_day_cache) < 4096:
            _day_cache[day_key] = days
    h, mi_, s = int(hh), int(mi), int(ss)
    if h > 23 or mi_ > 59 or s > 59:
        raise _Bad(f"time of day out of range in {_shown(text.strip())}")
    ns = int(frac.ljust(9, "0")) if frac else 0
    return ((days * 24 + h) * 60 + mi_) * 60 * _NS_PER_S + s * _NS_PER_S + ns


def _csv_table(path, required: Sequence[str]):
    """A headed CSV with at least one data row: (file name, header, column index, data rows, their
    line numbers); errors name the file, line and missing column."""
    p = Path(path)
    f = str(p)
    lines, rows = _csv_rows(_read_text(p), f)
    header, hline = rows[0], lines[0]
    idx = _header_index(f, hline, header, required)
    if len(rows) == 1:
        raise TraceError("no data rows after the header", file=f, row=hline + 1)
    return f, header, idx, rows[1:], lines[1:]


def read_azure(path, *, block_size: int = 16, name: Optional[str] = None) -> LoadResult:
    """Read an Azure LLM inference trace CSV; arrivals relative to the first row. No SLOs/prefixes."""
    p = Path(path)
    f, header, idx, rows, lines = _csv_table(p, AZURE_COLUMNS)
    n, width = len(rows), len(header)
    it, ic, ig = idx["TIMESTAMP"], idx["ContextTokens"], idx["GeneratedTokens"]
    ts, ctx, gen = [0] * n, [0] * n, [0] * n
    line = col = None
    try:
        for i, row in enumerate(rows):
            if len(row) != width:
                _field_count_error(f, lines[i], header, row)
            col = "TIMESTAMP"
            ts[i] = parse_timestamp_ns(row[it])
            col = "ContextTokens"
            ctx[i] = _int(row[ic])
            col = "GeneratedTokens"
            gen[i] = _int(row[ig])
    except _Bad as e:
        line = lines[i]
        raise TraceError(str(e), file=f, row=line, column=col) from None
    t = np.array(ts, dtype=np.int64)
    _check_sorted(f, lines, t, "TIMESTAMP")
    prompt, output = np.array(ctx, np.int64), np.array(gen, np.int64)
    _check_range(f, lines, prompt, "ContextTokens", 1, MAX_TOKENS, "tokens")
    _check_range(f, lines, output, "GeneratedTokens", 1, MAX_TOKENS, "tokens")
    trace = _build(f, lines, {"arrival_ns": "TIMESTAMP", "prompt_tokens": "ContextTokens",
                              "output_tokens": "GeneratedTokens"},
                   arrival_ns=t - t[0], prompt_tokens=prompt, output_tokens=output,
                   block_size=block_size, name=name or _name(p), source=f"azure:{p.name}")
    return LoadResult(trace, LoadReport(f, "azure", n, n))


# ---------------------------------------------------------------------------------------- Mooncake
def _truncated_field(line_text: str) -> str:
    """Best guess at the field a truncated JSON line stops in: the last key that appears in it."""
    present = [(line_text.rfind(f'"{k}"'), k) for k in MOONCAKE_FIELDS if f'"{k}"' in line_text]
    return max(present)[1] if present else MOONCAKE_FIELDS[0]


def read_mooncake(path, block_size: int = 16, *, name: Optional[str] = None) -> LoadResult:
    """Read a Mooncake JSONL trace; ``hash_ids`` become engine block-hash chains (module docstring)."""
    p = Path(path)
    f = str(p)
    bs = int(block_size)
    if bs < 1 or MOONCAKE_BLOCK_TOKENS % bs:
        raise TraceError(f"block_size must divide {MOONCAKE_BLOCK_TOKENS} for Mooncake traces, "
                         f"got {block_size}", file=f, column="hash_ids")
    per = MOONCAKE_BLOCK_TOKENS // bs
    text = _read_text(p)
    lines, ts, inp, out, nids, ids = [], [], [], [], [], []
    col = None
    decoder = json.JSONDecoder(parse_float=_JsonNumber, parse_constant=_json_constant)
    decode = decoder.decode
    for lineno, raw in enumerate(text.split("\n"), 1):
        if not raw.strip():
            continue
        try:
            col = None
            obj = decode(raw)
            if obj.__class__ is not dict:
                raise _Bad("not a JSON object")
            col = "timestamp"
            ts.append(_ms_to_ns(obj["timestamp"]))
            col = "input_length"
            inp.append(_json_int(obj["input_length"]))
            col = "output_length"
            out.append(_json_int(obj["output_length"]))
            col = "hash_ids"
            h = obj["hash_ids"]
            if h.__class__ is not list:
                raise _Bad("not a list of integers")
            if h and set(map(type, h)) != _INT_TYPE:
                x = next(x for x in h if x.__class__ is not int)
                raise _Bad(f"not an integer hash id: {_shown(json.dumps(x))}")
            nids.append(len(h))
            ids.extend(h)
            lines.append(lineno)
        except _Bad as e:
            if col is None and hasattr(e, "constant"):  # NaN/Infinity met while decoding
                col = _truncated_field(raw[:raw.find(e.constant)])
            raise TraceError(str(e), file=f, row=lineno, column=col) from None
        except KeyError:
            raise TraceError("missing field", file=f, row=lineno, column=col) from None
        except ValueError as e:
            if isinstance(e, json.JSONDecodeError) and e.pos >= len(raw.rstrip()):
                raise TraceError("truncated line (incomplete JSON)", file=f, row=lineno,
                                 column=_truncated_field(raw)) from None
            raise TraceError(f"not valid JSON ({e})", file=f, row=lineno,
                             column=col or _truncated_field(raw[:getattr(e, "pos", len(raw))])) from None
    n = len(lines)
    t = np.array(ts, dtype=np.int64)
    _check_range(f, lines, t, "timestamp", 0, _BIG, "timestamp")
    _check_sorted(f, lines, t, "timestamp")
    prompt, output = np.array(inp, np.int64), np.array(out, np.int64)
    _check_range(f, lines, prompt, "input_length", 1, MAX_TOKENS, "tokens")
    _check_range(f, lines, output, "output_length", 1, MAX_TOKENS, "tokens")
    count = np.array(nids, np.int64)
    want = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    bad = np.flatnonzero(count != want)
    if bad.size:
        i = int(bad[0])
        raise TraceError(f"{count[i]} hash ids for {prompt[i]} input tokens (expected "
                         f"ceil({prompt[i]}/{MOONCAKE_BLOCK_TOKENS}) = {want[i]})", file=f,
                         row=lines[i], column="hash_ids")
    # Full 512-token blocks form the chain; a partial last block is unique to the request.
    full = prompt // MOONCAKE_BLOCK_TOKENS
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(count, out=starts[1:])
    try:
        ids_a = np.array(ids, dtype=np.int64)
    except OverflowError:
        i = next(k for k in range(n) for x in ids[starts[k]:starts[k + 1]] if not _INT64_MIN <= x <= _INT64_MAX)
        raise TraceError("hash id out of range", file=f, row=lines[i], column="hash_ids") from None
    pos = np.arange(ids_a.shape[0], dtype=np.int64) - np.repeat(starts[:-1], count)
    chain_ids = ids_a[pos < np.repeat(full, count)]
    hashes = block_hash_runs(NS_MOONCAKE, chain_ids, per)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(full * per, out=offsets[1:])
    trace = _build(f, lines, {"arrival_ns": "timestamp", "prompt_tokens": "input_length",
                              "output_tokens": "output_length", "prefix_hashes": "hash_ids",
                              "prefix_offsets": "hash_ids"},
                   arrival_ns=t - t[0] if n else t, prompt_tokens=prompt, output_tokens=output,
                   prefix_offsets=offsets, prefix_hashes=hashes, block_size=bs,
                   name=name or _name(p), source=f"mooncake:{p.name}")
    return LoadResult(trace, LoadReport(f, "mooncake", n, n))


# ---------------------------------------------------------------------------------------- BurstGPT
def read_burstgpt(path, *, block_size: int = 16, name: Optional[str] = None) -> LoadResult:
    """Read a BurstGPT CSV; failed requests (0 response tokens) are dropped and counted."""
    p = Path(path)
    f, header, idx, rows, lines = _csv_table(p, BURSTGPT_COLUMNS)
    n, width = len(rows), len(header)
    it, irq, irs = idx["Timestamp"], idx["Request tokens"], idx["Response tokens"]
    ts, req, resp = [0] * n, [0] * n, [0] * n
    col = None
    try:
        for i, row in enumerate(rows):
            if len(row) != width:
                _field_count_error(f, lines[i], header, row)
            col = "Timestamp"
            ts[i] = _scaled(row[it], 9)
            col = "Request tokens"
            req[i] = _int(row[irq])
            col = "Response tokens"
            resp[i] = _int(row[irs])
    except _Bad as e:
        raise TraceError(str(e), file=f, row=lines[i], column=col) from None
    t = np.array(ts, np.int64)
    _check_range(f, lines, t, "Timestamp", 0, _BIG, "timestamp")
    _check_sorted(f, lines, t, "Timestamp")
    prompt, output = np.array(req, np.int64), np.array(resp, np.int64)
    _check_range(f, lines, output, "Response tokens", 0, MAX_TOKENS, "tokens")
    keep = output > 0
    kept_lines = np.asarray(lines, np.int64)[keep]
    if not keep.any():
        raise TraceError(f"all {n} rows are failed requests (0 response tokens)", file=f,
                         row=lines[0], column="Response tokens")
    prompt, output, t = prompt[keep], output[keep], t[keep]
    _check_range(f, kept_lines, prompt, "Request tokens", 1, MAX_TOKENS, "tokens")
    trace = _build(f, kept_lines, {"arrival_ns": "Timestamp", "prompt_tokens": "Request tokens",
                                   "output_tokens": "Response tokens"},
                   arrival_ns=t - t[0], prompt_tokens=prompt, output_tokens=output,
                   block_size=block_size, name=name or _name(p), source=f"burstgpt:{p.name}")
    return LoadResult(trace, LoadReport(f, "burstgpt", n, len(trace), dropped_failed=n - len(trace)))


# ---------------------------------------------------------------------------------------- dispatch
def detect_format(path) -> str:
    """The format of ``path`` from its extension and first line (one of ``FORMATS``)."""
    p = Path(path)
    f = str(p)
    suffix = p.suffix.lower()
    if suffix == ".npz":
        return "npz"
    try:
        with open(p, "rb") as fh:
            head = fh.read(64 * 1024)
    except FileNotFoundError:
        raise TraceError("no such file", file=f) from None
    except OSError as e:
        raise TraceError(f"cannot read: {e.strerror or e}", file=f) from None
    if head.startswith(b"PK\x03\x04"):
        return "npz"
    text = head.decode("utf-8-sig", errors="replace")
    nonblank = [ln for ln in text.splitlines() if ln.strip()]
    if not nonblank:
        raise TraceError("empty file", file=f)
    if nonblank[0].startswith("# tokenbatch-trace"):
        return "csv"
    first = next((ln for ln in nonblank if not ln.startswith("#")), nonblank[0])
    if first.lstrip().startswith("{") or suffix in (".jsonl", ".json"):
        return "mooncake"
    # A header naming any column of a format picks it (the reader then names a missing column).
    names = {c.strip() for c in next(csv.reader([first]), [])}
    overlap = {"azure": len(names & set(AZURE_COLUMNS)),
               "burstgpt": len(names & (set(BURSTGPT_COLUMNS) | {"Model", "Log Type", "Total tokens"})),
               "csv": len(names & set(CANONICAL_COLUMNS))}
    best = max(overlap, key=overlap.get)
    if overlap[best] > 0:
        return best
    raise TraceError(f"cannot tell the trace format from the first line {_shown(first)}; pass "
                     f"--format ({', '.join(FORMATS)})", file=f, row=1)


def _canonical(path, fmt: str, *, block_size: Optional[int] = None,
               name: Optional[str] = None) -> LoadResult:
    if fmt == "npz":
        trace = load_npz(path)
        result = LoadResult(trace, LoadReport(str(path), "npz", len(trace), len(trace)))
    else:
        result = _load_csv(path)
    trace = result.trace
    if block_size is not None and int(block_size) != trace.block_size:
        raise TraceError(f"block_size {block_size} given, but the trace was written with "
                         f"block_size {trace.block_size}", file=str(path))
    if name is not None:
        result = LoadResult(trace.replace(name=name), result.report)
    return result


@dataclasses.dataclass(frozen=True)
class TraceReader:
    """A registered trace format (docs/design.md section 2). Adding a format is one entry in
    ``READERS``: ``load_trace``, ``tokenbatch traces convert --format`` and the readers' contract
    test read the registry.

    Attributes:
        name: the format's name (``--format``).
        read: ``read(path, *, block_size=..., name=...) -> LoadResult``; bad input raises
            ``TraceError`` naming file, row and column.
        summary: one line for help texts.
    """

    name: str
    read: Callable[..., LoadResult]
    summary: str


READERS = {r.name: r for r in (
    TraceReader("npz", functools.partial(_canonical, fmt="npz"), "canonical binary (exact round trip)"),
    TraceReader("csv", functools.partial(_canonical, fmt="csv"), "canonical text (exact round trip)"),
    TraceReader("azure", read_azure, "Azure LLM inference trace CSV (2023)"),
    TraceReader("mooncake", read_mooncake, "Mooncake JSONL (hash_ids -> block-hash chains)"),
    TraceReader("burstgpt", read_burstgpt, "BurstGPT CSV (failed requests dropped and counted)"),
)}
#: Format names accepted by ``load_trace(fmt=...)`` and ``--format`` (registry order).
FORMATS = tuple(READERS)


def load_trace(path, fmt: Optional[str] = None, *, block_size: Optional[int] = None,
               name: Optional[str] = None) -> LoadResult:
    """Load a trace file of any supported format, with a report of what was read and dropped.

    Public traces come in several layouts; every one ends as a validated ``Trace`` whose digest
    the results cite, and the report says which rows did not make it (e.g. BurstGPT's failed ones).

    Args:
        path: the file (``str`` or path-like).
        fmt: one of ``FORMATS`` (``npz``, ``csv``, ``azure``, ``mooncake``, ``burstgpt``); None
            detects it from the extension and the first line (``detect_format``).
        block_size: the engine block size of the prefix chains (Mooncake's hash ids are split into
            blocks of it; default 16), or the metadata of prefix-free formats. For the canonical
            formats it must equal the stored one.
        name: a new name for the trace (default: the stored one, or the file's stem).

    Returns:
        ``LoadResult``, which unpacks as ``trace, report = load_trace(path)``.

    Raises:
        TraceError: unknown or undetectable format, unreadable or missing file, a bad row (named by
            file, row and column), an NPZ file whose content does not match its stored digest, a
            canonical file written with another ``block_size``.
    """
    if fmt is None:
        fmt = detect_format(path)
    reader: Optional[TraceReader] = READERS.get(fmt)
    if reader is None:
        raise TraceError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", file=str(path))
    kw = {"name": name}
    if block_size is not None:
        kw["block_size"] = block_size
    return reader.read(path, **kw)


def save_trace(trace: Trace, path) -> None:
    """Write ``trace`` in a canonical format, atomically, so that ``load_trace`` gives it back exactly.

    Args:
        trace: the trace to write.
        path: the file; its extension picks the format: ``.npz`` (binary, fast) or ``.csv`` (text,
            for editing by hand). An existing file is replaced only once the new one is complete.

    Raises:
        TraceError: the extension is neither ``.npz`` nor ``.csv``.
        OutputError: the path cannot be written (its directory, permissions, a full disk).
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".npz":
        save_npz(trace, path)
    elif suffix == ".csv":
        save_csv(trace, path)
    else:
        raise TraceError(f"cannot write {suffix or 'extension-less'} files: use .npz or .csv",
                         file=os.fspath(path))
