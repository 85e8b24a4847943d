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
    if cfg.pd:   # (docs/design.md section 13; every report says where a P/D row's first token counts)
        from ..engine.kv_link import resolve_kv_link
        link = resolve_kv_link(cfg.kv_link)
        wl.notes.append(f"P/D rows '[P/D {cfg.pd[0]}:{cfg.pd[1]}, ...]': {cfg.pd[0]} prefill + {cfg.pd[1]} decode "
                        f"replicas, the row's router in front of the prefill replicas, decode router "
                        f"{cfg.decode_router}, KV over {link.describe()}; "
                        "'first token at prefill': token 1 at the end of the last prefill iteration (DistServe, "
                        "Splitwise: the transfer and the decode queue count in TPOT); 'first token at decode': at "
                        "the end of the first decode iteration (vLLM's P/D: they count in TTFT)")
    return wl


def cluster_block(stats: list, cfg: BenchConfig, router: str, row=None) -> dict:
    """A row's ``cluster`` entry at one load from its units' ``ClusterResult.replica_stats`` (a P/D
    ``row``'s with its split, link and first-token convention)."""
    q = sum(int(np.sum(s["prefix_query_tokens"])) for s in stats)
    h = sum(int(np.sum(s["prefix_hit_tokens"])) for s in stats)
    return {"replicas": cfg.replicas, "router": router,
            "utilisation": [float(x) for x in np.mean([s["utilisation"] for s in stats], axis=0)],
            "imbalance": float(np.mean([s["imbalance"] for s in stats])),
            "prefix_hit_rate": h / q if q > 0 else 0.0,
            **({"replaced_share": sum(s["replaced"] for s in stats) / max(1, sum(s["decisions"] for s in stats))}
               if stats and "replaced" in stats[0] else {}),
            **({"pd": {"prefill_replicas": row.pd[0], "decode_replicas": row.pd[1], "decode_router": cfg.decode_router,
                       "kv_link": cfg.kv_link, "first_token_at": row.first_token_at}}
               if row is not None and row.pd else {})}
