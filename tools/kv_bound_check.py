"""The upper bound with and without its KV term (docs/design.md section 10, "Bounds"), per deployment
cell: the mean over a suite's test traces of the bound's goodput fraction, as ``tokenbatch bench``
computes it, and the largest per-trace drop. SLO rule "own" is the suite's own SLOs. Prints a
Markdown table on stdout (a few minutes for every cell).

    python tools/kv_bound_check.py                       # the shipped suites x profiles x rules, rho 1.2 and 2.0
    python tools/kv_bound_check.py --num-blocks 600      # every profile with a pool of 600 blocks
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from tokenbatch_env.errors import TokenBatchError

CELLS = [(s, p) for s in ("seed-200", "azure-code-like", "azure-conv-like", "mooncake-like")
         for p in ("stress-512", "llama2-7b-a100", "llama3-8b-h100")] + [("mooncake-like-long", "llama31-8b-h100")]


def check(suite: str, profile: str, rule, rho: float, num_blocks=None, max_traces=None) -> tuple:
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.engine.state import EngineConfig
    from tokenbatch_env.evaluate import BenchConfig, prepare_workload
    from tokenbatch_env.evaluate.benchmark import unit_upper_bound
    bc = BenchConfig(suite=suite, split="test", profile=profile, loads=(rho,), slo_rule=rule, max_traces=max_traces,
                     engine=EngineConfig(num_blocks=num_blocks))
    prof = bc.engine.resolve(load_profile(profile))
    wl = prepare_workload(bc, prof)
    a, b = (np.array([unit_upper_bound(t, prof, bc.engine, wl.scored[u], kv=kv) for u, t in enumerate(wl.at(rho))])
            for kv in (False, True))
    return float(a.mean()), float(b.mean()), float((a - b).max())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-blocks", type=int, default=None, help="the pool's blocks (default: each profile's)")
    p.add_argument("--max-traces", type=int, default=None, help="first N test traces (default all)")
    a = p.parse_args(argv)
    for flag, v in (("--num-blocks", a.num_blocks), ("--max-traces", a.max_traces)):
        if v is not None and v < (2 if flag == "--num-blocks" else 1):
            p.error(f"{flag}: must be >= {2 if flag == '--num-blocks' else 1}, got {v}")
    print("| suite | profile | SLO rule | rho | bound without KV term | with | largest per-trace drop |")
    print("|---|---|---|---|---|---|---|")
    for suite, profile in CELLS:
        for rule in (None, "mlperf-llama3_1-8b"):
            for rho in (1.2, 2.0):
                try:
                    old, new, drop = check(suite, profile, rule, rho, a.num_blocks, a.max_traces)
                except TokenBatchError as e:   # (e.g. a pool too small to measure lambda_sat on)
                    print(f"| {suite} | {profile} | {rule or 'own'} | {rho:g} | n/a: {e} | | |", flush=True)
                    continue
                print(f"| {suite} | {profile} | {rule or 'own'} | {rho:g} | {old:.4f} | {new:.4f} | {drop:.4f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
