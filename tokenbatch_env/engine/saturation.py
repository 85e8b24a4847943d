"""lambda_sat: FCFS's saturation throughput (DESIGN.md section 2, "Load").

Measured by replaying the requests as an always-backlogged stream (every arrival at t = 0, so the
queue never empties) under FCFS, and counting completions per second between the 20th and 80th
percentile of completion times (warm-up and drain excluded). Deterministic: no randomness enters.
"""

from __future__ import annotations

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
    """Completed requests per second of an always-backlogged FCFS engine (mean over traces)."""
    if isinstance(traces, Trace):
        traces = [traces]
    if any(len(t) < 10 for t in traces):
        raise ConfigError("lambda_sat needs at least 10 requests per trace")
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
