"""Cluster throughput benchmark (run by hand; not a unit test).

    python benchmarks/bench_cluster.py                       # every router, 8 replicas, the trace at 8x its rate
    python benchmarks/bench_cluster.py --routers jsq --repeats 1
    python benchmarks/bench_cluster.py --replicas 4 --speedup 4 --json

Prints, see docs/benchmarks.md for the definitions:
  (a) the single engine replaying the Azure LLM 2023 conversation trace under FCFS on
      ``llama3-8b-h100``: wall time (best of --repeats) and iteration count;
  (b) per router, ``simulate_cluster`` on --replicas replicas of the same engine replaying that trace
      with its arrival times divided by --speedup: wall time (best of --repeats), iterations (summed
      over the replicas), iterations/s, requests, and the target (<= 1 s);
  (c) the engine state's memory (sum of the EngineArrays' nbytes): the single engine's and the cluster's;
  (d) per --pd split Rp:Rd, ``simulate_pd`` (prefill/decode disaggregation, docs/design.md section 13)
      on Rp + Rd replicas replaying the trace at --pd-speedup x its rate over NVLink: wall time (best of
      --repeats), iterations, iterations/s, requests, and the target (<= 2 s at 16 replicas).
``--json`` prints one JSON object with the same figures instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
AZURE_CONV = ROOT.parent / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
PROFILE = "llama3-8b-h100"
TARGET_S = 1.0
PD_TARGET_S = 2.0


def _best(repeats: int, fn, *args, **kw):
    """(best wall seconds of ``repeats`` calls of ``fn(*args, **kw)``, the last call's result)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn(*args, **kw)
        best = min(best, time.perf_counter() - t0)
    return best, res


def _warm(replicas: int) -> float:
    """Load (or compile) the engine's, the cluster's and the P/D loop's kernels once, on a tiny trace."""
    from tokenbatch_env.engine.cluster import simulate_cluster
    from tokenbatch_env.engine.disagg import simulate_pd
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.traces import Trace

    t = Trace.build(arrival_ns=np.arange(4, dtype=np.int64) * 1000, prompt_tokens=[10] * 4, output_tokens=[2] * 4)
    t0 = time.perf_counter()
    simulate(t, PROFILE, "fcfs")
    simulate_cluster(t, PROFILE, "fcfs", replicas=replicas, router="jsq")
    simulate_pd(t, PROFILE, "fcfs")
    return time.perf_counter() - t0


def _nbytes(arrays) -> int:
    return int(sum(a.nbytes for a in arrays))


def run(routers, replicas: int, speedup: float, repeats: int, splits=(), pd_speedup: float = 16.0) -> dict:
    from tokenbatch_env.engine.cluster import simulate_cluster
    from tokenbatch_env.engine.disagg import simulate_pd
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.traces.io import load_trace
    from tokenbatch_env.traces.windows import time_scale

    warm = _warm(replicas)
    trace, _ = load_trace(str(AZURE_CONV))
    wall, res = _best(repeats, simulate, trace, PROFILE, "fcfs")
    out = dict(trace=AZURE_CONV.name, profile=PROFILE, policy="fcfs", replicas=replicas, speedup=speedup,
               repeats=repeats, warm_s=warm,
               single=dict(requests=len(trace), wall_s=wall, iterations=int(res.arrays.it.sum()),
                           state_bytes=_nbytes(res.arrays)),
               cluster={})
    scaled = time_scale(trace, 1 / speedup)
    for name in routers:
        wall, res = _best(repeats, simulate_cluster, scaled, PROFILE, "fcfs", replicas=replicas, router=name)
        out["cluster"][name] = dict(requests=len(scaled), wall_s=wall, iterations=int(res.n_iterations),
                                    iter_per_s=res.n_iterations / wall, target_met=wall <= TARGET_S,
                                    state_bytes=_nbytes(res.arrays))
    if splits:
        out["pd_speedup"] = pd_speedup
        pd_scaled = time_scale(trace, 1 / pd_speedup)
        out["pd"] = {}
        for rp, rd in splits:
            wall, res = _best(repeats, simulate_pd, pd_scaled, PROFILE, "fcfs", prefill_replicas=rp,
                              decode_replicas=rd, kv_link="nvlink")
            out["pd"][f"{rp}:{rd}"] = dict(requests=len(pd_scaled), wall_s=wall, iterations=int(res.n_iterations),
                                           iter_per_s=res.n_iterations / wall,
                                           target_met=wall <= PD_TARGET_S if rp + rd == 16 else None,
                                           state_bytes=_nbytes(res.arrays))
    return out


def main(argv=None) -> int:
    from tokenbatch_env.config_cli import parse_split
    from tokenbatch_env.engine.cluster import ROUTER_NAMES
    from tokenbatch_env.errors import ConfigError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routers", default=",".join(ROUTER_NAMES), help="comma list (default: all)")
    ap.add_argument("--replicas", type=int, default=8, help="cluster replicas (default 8)")
    ap.add_argument("--speedup", type=float, default=8.0,
                    help="the cluster's trace at this many times its rate (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each measure; the best is kept (default 3)")
    ap.add_argument("--pd", default="8:8,4:12",
                    help="comma list of prefill:decode splits for (d); '' skips (d) (default 8:8,4:12)")
    ap.add_argument("--pd-speedup", type=float, default=16.0,
                    help="(d)'s trace at this many times its rate (default 16)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTER_NAMES]
    if bad or not routers:
        ap.error(f"--routers: unknown {', '.join(bad) or '(none given)'}; valid: {', '.join(ROUTER_NAMES)}")
    if args.replicas < 1 or args.repeats < 1 or not args.speedup > 0 or not args.pd_speedup > 0:
        ap.error("--replicas and --repeats must be >= 1, --speedup and --pd-speedup > 0")
    splits = []
    for part in (p.strip() for p in args.pd.split(",")):
        if not part:
            continue
        try:
            splits.append(parse_split(part))
        except ConfigError as e:
            ap.error(str(e))
    if not AZURE_CONV.exists():
        print(f"bench_cluster: {AZURE_CONV} not found (the Azure LLM 2023 conv trace is needed)", file=sys.stderr)
        return 2

    d = run(routers, args.replicas, args.speedup, args.repeats, splits, args.pd_speedup)
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    s = d["single"]
    print(f"warm-up (cached compile load): {d['warm_s']:.2f} s; best of {args.repeats} runs below")
    print(f"(a) single engine, Azure conv ({s['requests']:,} requests), FCFS, {PROFILE}: {s['wall_s']:.3f} s, "
          f"{s['iterations']:,} iterations")
    print(f"(b) cluster: {args.replicas} replicas, the trace at {args.speedup:g}x its rate, FCFS, {PROFILE}")
    print(f"    {'router':<22}{'wall s':>8}{'iterations':>13}{'iter/s':>13}{'requests':>10}  target <= 1 s")
    for name, c in d["cluster"].items():
        print(f"    {name:<22}{c['wall_s']:>8.3f}{c['iterations']:>13,}{c['iter_per_s']:>13,.0f}{c['requests']:>10,}  "
              f"{'met' if c['target_met'] else 'not met'}")
    mem = {c["state_bytes"] for c in d["cluster"].values()}
    print(f"(c) engine state: single {s['state_bytes'] / 2**20:,.1f} MiB, cluster "
          f"{' / '.join(f'{m / 2**20:,.1f}' for m in sorted(mem))} MiB ({args.replicas} replicas)")
    if d.get("pd"):
        print(f"(d) P/D: prefill:decode replicas, the trace at {d['pd_speedup']:g}x its rate, FCFS, {PROFILE}, "
              f"NVLink, round-robin / least-kv")
        print(f"    {'split':<22}{'wall s':>8}{'iterations':>13}{'iter/s':>13}{'requests':>10}  target <= 2 s at 16")
        for name, c in d["pd"].items():
            met = "n/a" if c["target_met"] is None else ("met" if c["target_met"] else "not met")
            print(f"    {name:<22}{c['wall_s']:>8.3f}{c['iterations']:>13,}{c['iter_per_s']:>13,.0f}"
                  f"{c['requests']:>10,}  {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
