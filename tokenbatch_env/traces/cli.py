"""``tokenbatch traces``: inspect, convert and generate traces.

    tokenbatch traces info FILE [--format F] [--block-size N] [--json]
    tokenbatch traces convert IN OUT [--format F] [--block-size N] [--name NAME]
    tokenbatch traces generate SPEC [--out DIR]

Exit codes: 0 success; 2 bad input (a ``TraceError``, printed as one line by ``tokenbatch_env.cli``)
or bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import ConfigError, TraceError
from .trace import Trace

_QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


def configure(parser: argparse.ArgumentParser) -> None:
    from .io import FORMATS

    sub = parser.add_subparsers(dest="traces_command", metavar="ACTION")
    p = sub.add_parser("info", help="summarise a trace file",
                       description="Request count, span, rate, burstiness, length quantiles, "
                                   "prefix sharing, SLOs, digest and the load report of a trace.")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="input format (default: detected from extension and header)")
    p.add_argument("--block-size", type=int, default=None,
                   help="engine block size for Mooncake prefix chains (default 16)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(_action=_info)

    p = sub.add_parser("convert", help="convert any supported trace to canonical .npz or .csv",
                       description="Read IN with any reader and write OUT in the canonical format "
                                   "chosen by its extension (.npz or .csv).")
    p.add_argument("input", metavar="IN")
    p.add_argument("output", metavar="OUT")
    p.add_argument("--format", choices=FORMATS, default=None, help="input format (default: detected)")
    p.add_argument("--block-size", type=int, default=None,
                   help="engine block size for Mooncake prefix chains (default 16)")
    p.add_argument("--name", default=None, help="trace name stored in OUT (default: IN's stem)")
    p.set_defaults(_action=_convert)

    p = sub.add_parser("generate", help="generate the trace files of a suite spec",
                       description="Generate a suite's traces deterministically from its spec.")
    p.add_argument("spec", metavar="SPEC", help="suite spec name or JSON file")
    p.add_argument("--out", default=None, metavar="DIR", help="output directory (default: cache)")
    p.set_defaults(_action=_generate)
    parser.set_defaults(_traces_parser=parser)


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "_action", None)
    if action is None:
        args._traces_parser.print_help(sys.stderr)
        return 2
    return int(action(args) or 0)


# ---------------------------------------------------------------------------------------- info
def _quantiles(values: np.ndarray) -> dict:
    if values.size == 0:
        return {k: None for k, _ in _QUANTILES} | {"max": None, "mean": None}
    out = {k: int(np.quantile(values, q, method="inverted_cdf")) for k, q in _QUANTILES}
    out["max"] = int(values.max())
    out["mean"] = float(values.mean())
    return out


def _repeated_blocks(trace: Trace) -> int:
    """Chain blocks whose hash already appeared in an earlier request.

    For block-hash chains (equal hash = equal prefix up to that block) this is the number of
    prefix-cache hits an infinite cache would give, before vLLM's ``tokens - 1`` cap. Computed by one
    sort of packed (hash, row) keys: the hash's low bits give way to the row number, so two
    distinct hashes can merge with probability ~ blocks**2 / 2**(64 - row bits): negligible for a
    summary statistic.
    """
    n = len(trace)
    h = trace.prefix_hashes
    if h.size == 0:
        return 0
    bits = max(1, int(n).bit_length())
    row = np.repeat(np.arange(n, dtype=np.uint64), trace.prefix_lengths)
    with np.errstate(over="ignore"):
        key = (h.view(np.uint64) >> np.uint64(bits)) << np.uint64(bits)
    key |= row
    key.sort()
    group = key >> np.uint64(bits)
    rows = key & np.uint64((1 << bits) - 1)
    starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
    sizes = np.diff(np.append(starts, key.size))
    return int((rows > np.repeat(rows[starts], sizes)).sum())


def summarize(trace: Trace, report=None) -> dict:
    """The numbers ``tokenbatch traces info`` prints, as a JSON-ready dict."""
    n = len(trace)
    a = trace.arrival_ns
    span_s = float(a[-1] - a[0]) / 1e9 if n else 0.0
    gaps = np.diff(a).astype(np.float64)
    cv = float(gaps.std() / gaps.mean()) if gaps.size >= 2 and gaps.mean() > 0 else None
    prompt_total = int(trace.prompt_tokens.sum())
    chained = int(trace.prefix_lengths.sum()) * trace.block_size
    reusable = _repeated_blocks(trace) * trace.block_size
    out = {
        "name": trace.name,
        "source": trace.source,
        "requests": n,
        "span_s": span_s,
        "mean_rate_per_s": (n - 1) / span_s if span_s > 0 else None,
        "interarrival_cv": cv,
        "prompt_tokens": _quantiles(trace.prompt_tokens),
        "output_tokens": _quantiles(trace.output_tokens),
        "block_size": trace.block_size,
        "requests_with_prefix": int((trace.prefix_lengths > 0).sum()),
        "prefix_share": chained / prompt_total if prompt_total else 0.0,
        "reusable_prefix_share": reusable / prompt_total if prompt_total else 0.0,
        "has_slos": trace.has_slos,
        "has_priority": trace.has_priority,
        "classes": int(np.unique(trace.class_id).size),
        "priorities": int(np.unique(trace.priority).size),
        "digest": trace.digest,
    }
    if trace.has_slos:   # (an empty trace has none to summarise: None, like the length quantiles)
        for key, v in (("ttft_slo_ms", trace.ttft_slo_ns), ("tpot_slo_ms", trace.tpot_slo_ns)):
            out[key] = {k: float(np.quantile(v, q)) / 1e6 if n else None
                        for k, q in (("min", 0.0), ("p50", 0.5), ("max", 1.0))}
    if report is not None:
        out["load"] = {"format": report.format, "rows_read": report.rows_read,
                       "dropped_failed": report.dropped_failed, "dropped": report.dropped}
    return out


def _fmt(v, spec: str = ".3g") -> str:
    return "n/a" if v is None else format(v, spec)


def _info(args) -> int:
    from .io import load_trace

    trace, report = load_trace(args.file, args.format, block_size=args.block_size)
    s = summarize(trace, report)
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    lines = [
        f"file            {args.file}",
        f"format          {report.format}  (rows read {report.rows_read}, dropped failed "
        f"{report.dropped_failed})",
        f"name            {s['name']}" + (f"  (source {s['source']})" if s["source"] else ""),
        f"requests        {s['requests']}",
        f"span            {s['span_s']:.3f} s",
        f"mean rate       {_fmt(s['mean_rate_per_s'], '.4g')} req/s",
        f"burstiness      CV of inter-arrival gaps {_fmt(s['interarrival_cv'], '.3f')}",
    ]
    for key, label in (("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens")):
        q = s[key]
        lines.append(f"{label:<16}p50 {_fmt(q['p50'], 'd')}  p90 {_fmt(q['p90'], 'd')}  "
                     f"p99 {_fmt(q['p99'], 'd')}  max {_fmt(q['max'], 'd')}  "
                     f"mean {_fmt(q['mean'], '.1f')}")
    lines.append(f"prefix          {s['requests_with_prefix']} requests with a chain; chained "
                 f"{s['prefix_share']:.1%} of prompt tokens, reusable {s['reusable_prefix_share']:.1%} "
                 f"(infinite cache, block size {s['block_size']})")
    if s["has_slos"]:
        t1, t2 = s["ttft_slo_ms"], s["tpot_slo_ms"]
        lines.append(f"SLOs            TTFT {_fmt(t1['min'], '.4g')}..{_fmt(t1['max'], '.4g')} ms (p50 "
                     f"{_fmt(t1['p50'], '.4g')}), TPOT {_fmt(t2['min'], '.4g')}..{_fmt(t2['max'], '.4g')} ms "
                     f"(p50 {_fmt(t2['p50'], '.4g')})")
    else:
        lines.append("SLOs            none (filled at run time by an SLO rule: default-3class, or --slo-rule)")
    lines.append(f"classes         {s['classes']} class ids, " + (
        f"{s['priorities']} priority levels (the file's own)" if s["has_priority"] else
        "no priority column (filled at run time by the SLO rule)"))
    lines.append(f"digest          {s['digest']}")
    print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------------------- convert
def _convert(args) -> int:
    from .io import load_trace, save_trace

    suffix = Path(args.output).suffix.lower()
    if suffix not in (".npz", ".csv"):
        raise TraceError(f"cannot write {suffix or 'extension-less'} files: use .npz or .csv",
                         file=args.output)
    from .._io import check_writable

    if args.name is not None and not args.name.strip():
        raise ConfigError("--name: must not be empty (a trace's name labels its reports)")
    check_writable(args.output, "OUT")
    trace, report = load_trace(args.input, args.format, block_size=args.block_size, name=args.name)
    save_trace(trace, args.output)
    dropped = f", dropped {report.dropped_failed} failed rows" if report.dropped_failed else ""
    print(f"wrote {args.output}: {len(trace)} requests from {report.format} "
          f"({report.rows_read} rows{dropped}), digest {trace.digest}")
    return 0


# ---------------------------------------------------------------------------------------- generate
def _generate(args) -> Optional[int]:
    from .suites import generate_command

    return generate_command(args.spec, args.out)
