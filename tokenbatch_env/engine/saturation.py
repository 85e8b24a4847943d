"""lambda_sat: FCFS's saturation throughput (docs/design.md section 2, "Load").

Measured by replaying the requests as an always-backlogged stream (every arrival at t = 0, so the
queue never empties) under FCFS, and counting completions per second between the 20th and 80th
percentile of completion times (warm-up and drain excluded). Deterministic: no randomness enters.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from .kernel import E_COMPLETED, E_LENGTH_CAPPED
from .profiles import Profile
from .simulate import simulate
from .state import EngineConfig

WARMUP_Q, DRAIN_Q = 0.2, 0.8


def backlogged(trace: Trace) -> Trace:
    return trace.replace(arrival_ns=np.zeros(len(trace), np.int64))


def measure_lambda_sat(traces: Union[Trace, Sequence[Trace]], profile: Union[str, Profile],
                       config: Optional[EngineConfig] = None) -> float:
    """Completed requests per second of an always-backlogged FCFS engine (mean over traces). The
    engine's ``config`` applies, less the ways requests leave without service (client time-outs,
    admission control): those would measure how fast the backlog is dropped, not served (a 60 s
    time-out that never fires at the load simulated rescaled its arrivals by 1.26x)."""
    if isinstance(traces, Trace):
        traces = [traces]
    if any(len(t) < 10 for t in traces):
        raise ConfigError("lambda_sat needs at least 10 requests per trace")
    config = dataclasses.replace(config or EngineConfig(), max_wait_ms=None, timeout_running=False,
                                 admission_control=False)
    res = simulate([backlogged(t) for t in traces], profile, "fcfs", config)
    rates = []
    for c in range(len(traces)):
        rec = res.records(c)
        ok = (rec["end_state"] == E_COMPLETED) | (rec["end_state"] == E_LENGTH_CAPPED)
        f = np.sort(rec["finish_ns"][ok])
        if f.size < 10:
            raise ConfigError(f"trace {traces[c].name!r}: too few completions to measure lambda_sat")
        lo, hi = int(WARMUP_Q * f.size), int(DRAIN_Q * f.size)
        span = f[hi] - f[lo]
        rates.append((hi - lo) * 1e9 / span if span > 0 else float("inf"))
    return float(np.mean(rates))


# ------------------------------------------------------------------------- suite manifests
#: profiles whose lambda_sat every shipped suite's manifest records
MANIFEST_PROFILES = ("stress-512", "llama2-7b-a100", "llama3-8b-h100")


def _round6(x: float) -> float:
    return float(f"{x:.6g}")


def suite_lambda_sat(suite_name: str, profile: str) -> float:
    """lambda_sat of a suite's family: the mean over its TRAIN traces, each replayed backlogged
    under FCFS with the default engine configuration (6 significant digits, as recorded)."""
    from ..traces.suites import load_suite

    return _round6(measure_lambda_sat(load_suite(suite_name).traces("train"), profile))


def write_suite_lambda_sat(suite_name: str, profiles=MANIFEST_PROFILES) -> dict:
    """Measure and record lambda_sat in the suite's shipped manifest (atomic rewrite)."""
    import json

    from .._io import write_text_atomic
    from ..traces.suites import manifest_path

    path = manifest_path(suite_name)
    manifest = json.loads(path.read_text())
    lam = dict(manifest.get("lambda_sat") or {})
    for p in profiles:
        lam[p] = suite_lambda_sat(suite_name, p)
    manifest["lambda_sat"] = dict(sorted(lam.items()))
    write_text_atomic(path, json.dumps(manifest, indent=1) + "\n")
    return manifest["lambda_sat"]


def main(argv=None) -> int:
    import argparse

    from ..traces.suites import list_suites

    ap = argparse.ArgumentParser(prog="python -m tokenbatch_env.engine.saturation",
                                 description="Measure lambda_sat and record it in suite manifests.")
    ap.add_argument("suites", nargs="*", help="suite names (default: every shipped suite)")
    ap.add_argument("--profiles", default=",".join(MANIFEST_PROFILES))
    args = ap.parse_args(argv)
    for name in args.suites or list_suites():
        lam = write_suite_lambda_sat(name, [p for p in args.profiles.split(",") if p])
        print(f"{name}: " + ", ".join(f"{p} {v} req/s" for p, v in lam.items()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
