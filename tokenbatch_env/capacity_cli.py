"""`tokenbatch audit`: the fluid capacity audit (docs/design.md section 9).

    tokenbatch audit CONTRACT.json WORKLOAD.json [--json]
    tokenbatch audit --trace FILE --profile NAME [--contract FILE] [--priority-iterations N]
                     [--json]

Trace mode derives the records from the trace and the engine profile, audits them, replays the
trace through the simulator (FCFS) and prints the fluid prediction beside the measurement; the
mapping is documented in ``tokenbatch_env/capacity_bridge.py``.

Exit status: 0 within the declared bound, 1 rejected (the report lists the violations), 2 invalid
input (one line naming the file and field).
"""

from __future__ import annotations

import argparse
import json

from .capacity import CapacityError, audit_batching, format_report, load_contract, load_workload


def configure(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("%(prog)s CONTRACT WORKLOAD [--json]\n"
                    "       %(prog)s --trace FILE --profile NAME [--contract FILE] [--json]")
    parser.description = ("Audit a workload against a batching contract with the closed-form fluid "
                          "capacity model (no simulation). Exit 0 within bound, 1 rejected, "
                          "2 invalid input.")
    parser.add_argument("contract_file", nargs="?", metavar="CONTRACT",
                        help="batching contract JSON (its fields by name; content_id optional)")
    parser.add_argument("workload_file", nargs="?", metavar="WORKLOAD",
                        help="batching workload JSON (scheduler and request classes nested)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as a JSON object keyed by its field names")
    trace = parser.add_argument_group(
        "trace mode", "derive the scheduler profile and request classes from a trace replayed "
                      "under an engine profile, instead of CONTRACT and WORKLOAD")
    trace.add_argument("--trace", metavar="FILE", help="trace file (replaces CONTRACT WORKLOAD)")
    trace.add_argument("--profile", metavar="NAME", help="engine profile name (with --trace)")
    trace.add_argument("--contract", dest="trace_contract", metavar="FILE",
                       help="batching contract JSON for trace mode (with --trace)")
    trace.add_argument("--priority-iterations", dest="priority_iterations", type=int, default=None,
                       metavar="N", help="max_consecutive_priority_iterations of the derived "
                                         "scheduler profile (default 1: FCFS never reorders)")


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        if args.contract_file is not None or args.workload_file is not None:
            raise CapacityError("give CONTRACT WORKLOAD or --trace FILE, not both",
                                where="audit")
        if args.profile is None:
            raise CapacityError("--trace needs --profile NAME", where="audit")
        return run_trace(args)
    if (args.profile is not None or args.trace_contract is not None
            or getattr(args, "priority_iterations", None) is not None):
        raise CapacityError("--profile, --contract and --priority-iterations go with --trace FILE",
                            where="audit")
    if args.contract_file is None or args.workload_file is None:
        raise CapacityError("needs CONTRACT and WORKLOAD files (or --trace FILE --profile NAME)",
                            where="audit")
    contract = load_contract(args.contract_file)
    workload = load_workload(args.workload_file)
    report = audit_batching(contract, workload)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report, contract, workload), end="")
    return 0 if report.within_bound else 1


def run_trace(args: argparse.Namespace) -> int:
    """Trace mode: ``args.trace``, ``args.profile``, optional ``args.trace_contract``,
    ``args.priority_iterations`` and ``args.json``. Derives the contract and workload from the trace
    and the engine profile (``capacity_bridge``), audits them, simulates FCFS and prints both."""
    from .capacity_bridge import DEFAULT_PRIORITY_ITERATIONS, audit_trace, format_trace_audit

    priority_iterations = getattr(args, "priority_iterations", None)
    if priority_iterations is None:
        priority_iterations = DEFAULT_PRIORITY_ITERATIONS
    contract = load_contract(args.trace_contract) if args.trace_contract is not None else None
    trace, profile = _trace_and_profile(args.trace, args.profile)
    result = audit_trace(trace, profile, contract=contract, priority_iterations=priority_iterations)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, default=_json_default))
    else:
        print(format_trace_audit(result), end="")
    return 0 if result.report.within_bound else 1


def _trace_and_profile(path: str, name: str):
    """Load the profile (cheap, so a bad name fails first) and the trace; errors are one line."""
    import os

    from .engine.profiles import load_profile
    from .traces.io import load_trace

    profile = load_profile(name)
    if not os.path.exists(path):
        raise CapacityError("cannot read file", where=str(path), detail="no such file")
    trace, _report = load_trace(path)
    return trace, profile


def _json_default(value):
    import numpy as np

    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
