"""Small builders shared by the engine tests."""

import numpy as np

from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.traces import Trace


def tiny_trace(arrival_ms, prompt, output, prio=None, t1_ms=None, t2_ms=None, chains=None):
    n = len(prompt)
    kw = {}
    if t1_ms is not None:
        kw = dict(ttft_slo_ns=np.broadcast_to(np.int64(t1_ms * 1e6), (n,)).copy(),
                  tpot_slo_ns=np.broadcast_to(np.int64(t2_ms * 1e6), (n,)).copy())
    if chains is not None:
        kw["prefix_offsets"] = np.concatenate([[0], np.cumsum([len(c) for c in chains])])
        kw["prefix_hashes"] = np.array([h for c in chains for h in c], np.int64)
    return Trace.build(arrival_ns=np.round(np.asarray(arrival_ms, float) * 1e6).astype(np.int64),
                       prompt_tokens=prompt, output_tokens=output, priority=prio, **kw)


def run(trace, policy="fcfs", profile="linear", **cfg):
    cfg.setdefault("record_iterations", 10_000)
    return simulate(trace, profile, policy, EngineConfig(**cfg))
