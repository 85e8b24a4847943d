"""The benchmark in cluster mode (docs/design.md section 12): ``BenchConfig.replicas`` R > 1 runs every
row on R engine replicas behind each router of ``BenchConfig.routers``.

* **Workload** (``bench_workload``): the cluster's load is rho = admitted arrival rate / (R x
  lambda_sat), so the workload's ``lambda_sat`` is R times the single engine's; a trace file's windows
  hold W x R scored requests (warm-up and cool-down x R), so that each replica sees about as many as
  a single engine's window. A suite trace keeps its requests (arrivals R times as fast).
* **Per-row numbers** (``cluster_block``): each row's replicas' utilisation (mean over units, per
  replica index), imbalance (max / mean busy time, mean over units) and prefix hit rate (hit tokens /
  queried tokens, pooled over units).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..workload import Workload, WorkloadSpec, prepare_workload
from .config import BenchConfig


def bench_workload(cfg: BenchConfig, profile) -> Workload:
    """The workload of ``cfg`` for ``profile``: ``prepare_workload`` itself for a single engine; in
    cluster mode the windows scaled to R replicas (``prepare_workload`` scales the load: the spec's
    ``replicas``; module docstring), said in its notes."""
    if not cfg.cluster:
        return prepare_workload(cfg, profile)
    R = cfg.replicas
    spec = WorkloadSpec.of(cfg)
    if spec.trace_file is not None:   # W x R scored requests per window, warm-up and cool-down x R
        spec = dataclasses.replace(spec, windows=spec.windows * R, warmup=spec.warmup * R,
                                   cooldown=spec.cooldown * R)
    wl = prepare_workload(spec, profile)   # (its errors name --windows W, not W x R)
    note = (f"cluster of {R} replicas behind {'each of ' if len(cfg.routers) > 1 else ''}{', '.join(cfg.routers)}"
            + (f" (metrics staleness {cfg.metrics_staleness_ms:g} ms)" if cfg.metrics_staleness_ms else "")
            + f": rho = admitted arrival rate / ({R} x lambda_sat)")
    if spec.trace_file is not None:
        note += (f"; windows of {cfg.windows} x {R} = {spec.windows} scored requests (warm-up {spec.warmup}, "
                 f"cool-down {spec.cooldown})")
    wl.notes.append(note + "; no upper bound (a single engine's)")
    return wl


def cluster_block(stats: list, cfg: BenchConfig, router: str) -> dict:
    """A row's ``cluster`` entry at one load from its units' ``ClusterResult.replica_stats``."""
    q = sum(int(np.sum(s["prefix_query_tokens"])) for s in stats)
    h = sum(int(np.sum(s["prefix_hit_tokens"])) for s in stats)
    return {"replicas": cfg.replicas, "router": router,
            "utilisation": [float(x) for x in np.mean([s["utilisation"] for s in stats], axis=0)],
            "imbalance": float(np.mean([s["imbalance"] for s in stats])),
            "prefix_hit_rate": h / q if q > 0 else 0.0}
