"""Engine throughput benchmark (run by hand; not a unit test).

    python benchmarks/bench_engine.py            # full run (1,024 copies, Azure conv replay, cold compile)
    python benchmarks/bench_engine.py --quick    # 128 copies, no cold-compile measurement
    python benchmarks/bench_engine.py --copies 256

Prints, see docs/benchmarks.md for the definitions:
  (a) engine steps/s and simulated iterations/s: N copies on ``stress-512`` under FCFS, seed-200 train
      traces cycled to N copies and each scaled to rho = 1.2 (rate 1.2 * lambda_sat);
  (b) the Azure LLM 2023 conversation trace replayed under FCFS on ``llama3-8b-h100``: wall time and
      iteration count;
  (c) memory per copy (sum of the EngineArrays' nbytes / copies) for (a) and (b), and per request:
      average (per copy / requests) and, for (b), marginal (whole trace vs its first half);
  (d) compile time from a cold numba cache (a subprocess with NUMBA_CACHE_DIR set to a temp dir);
  (e) with --rule-overhead only: the tpot-guard budget rule's time per iteration, jumps on and off.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
AZURE_CONV = ROOT.parent / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def _warm():
    """Load (or compile) the kernel once so the timed runs measure execution only."""
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.traces import Trace

    t = Trace.build(arrival_ns=np.zeros(1, np.int64), prompt_tokens=[10], output_tokens=[2])
    t0 = time.perf_counter()
    simulate(t, "linear")
    return time.perf_counter() - t0


def _mem_per_copy(arrays) -> float:
    return sum(a.nbytes for a in arrays) / arrays.now.shape[0]


def _state_bytes(trace, profile: str) -> int:
    """Engine state of one copy, built but not run (the arrays never grow while running)."""
    from tokenbatch_env.engine.simulate import EngineRun

    return sum(a.nbytes for a in EngineRun(trace, profile).arrays)


def bench_copies(copies: int, rho: float = 1.2, profile: str = "stress-512", n_sat: int = 4, config=None) -> dict:
    from tokenbatch_env.engine.saturation import measure_lambda_sat
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.traces.suites import load_suite
    from tokenbatch_env.traces.windows import scale_to_rate

    train = load_suite("seed-200").traces("train")
    lam = measure_lambda_sat(train[:n_sat], profile)
    scaled = [scale_to_rate(t, rho * lam) for t in train]
    traces = list(itertools.islice(itertools.cycle(scaled), copies))
    t0 = time.perf_counter()
    res = simulate(traces, profile, "fcfs", config)
    wall = time.perf_counter() - t0
    it = res.arrays.it
    return dict(copies=copies, lambda_sat=lam, rate=rho * lam, wall_s=wall, iterations=int(it.sum()),
                steps_per_s=it.sum() / wall, sim_iter_per_s=it.mean() / wall,
                requests=int(res.arrays.n_req.sum()), mem_per_copy=_mem_per_copy(res.arrays))


def bench_azure(path: Path = AZURE_CONV, profile: str = "llama3-8b-h100", repeats: int = 2) -> dict:
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.traces.io import load_trace

    trace, _ = load_trace(str(path))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = simulate(trace, profile, "fcfs")
        best = min(best, time.perf_counter() - t0)
    n, half = len(trace), len(trace) // 2
    marginal = (_state_bytes(trace, profile) - _state_bytes(trace.subset(slice(0, half)), profile)) / (n - half)
    return dict(requests=n, wall_s=best, iterations=int(res.arrays.it.sum()),
                mem_per_copy=_mem_per_copy(res.arrays), bytes_per_request=_mem_per_copy(res.arrays) / n,
                marginal_bytes_per_request=marginal)


def cold_compile_seconds() -> float:
    """Wall time of a first simulate() in a fresh interpreter with an empty numba cache."""
    code = ("import time, numpy as np\n"
            "from tokenbatch_env.traces import Trace\n"
            "from tokenbatch_env.engine.simulate import simulate\n"
            "t = Trace.build(arrival_ns=np.zeros(1, np.int64), prompt_tokens=[10], output_tokens=[2])\n"
            "t0 = time.perf_counter(); simulate(t, 'linear'); print(time.perf_counter() - t0)\n")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True,
                             capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def rule_overhead(copies: int, rounds: int = 3) -> int:
    """(e) The tpot-guard rule's cost (docs/design.md section 11): (a)'s copies with and without the
    rule, with jumps on and off, alternated ``rounds`` times; wall time per iteration (the rule
    changes iteration counts), best of the rounds."""
    from tokenbatch_env.engine.state import EngineConfig
    _warm()
    best = {}
    # "no-op": the rule computed at every iteration but B_min 1 (the budget never lowered): the same
    # iterations as without it, so the difference is the rule's own computation
    rules = {"none": {}, "tpot-guard": {"budget_rule": "tpot-guard"},
             "no-op": {"budget_rule": "tpot-guard", "budget_bmin": 1.0}}
    for _ in range(rounds):
        for jumps in (True, False):
            for rule, kw in rules.items():
                a = bench_copies(copies, config=EngineConfig(jumps=jumps, **kw))
                key = (jumps, rule)
                best[key] = min(best.get(key, float("inf")), a["wall_s"] / a["iterations"])
    for jumps in (True, False):
        base, on, noop = best[(jumps, "none")], best[(jumps, "tpot-guard")], best[(jumps, "no-op")]
        print(f"(e) jumps {'on ' if jumps else 'off'}: {base * 1e9:.1f} ns/iteration without the rule, "
              f"{on * 1e9:.1f} with tpot-guard ({(on / base - 1) * 100:+.1f}%), {noop * 1e9:.1f} with the rule "
              f"computed but B_min 1 ({(noop / base - 1) * 100:+.1f}%)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=None, help="copies for (a) (default 1024; 128 with --quick)")
    ap.add_argument("--quick", action="store_true", help="fewer copies, skip the cold-compile measurement")
    ap.add_argument("--no-azure", action="store_true", help="skip (b)")
    ap.add_argument("--rule-overhead", action="store_true",
                    help="only (e): the tpot-guard rule's time per iteration, jumps on and off")
    args = ap.parse_args(argv)
    copies = args.copies or (128 if args.quick else 1024)
    if args.rule_overhead:
        return rule_overhead(copies)

    print(f"warm-up (cached compile load): {_warm():.2f} s")
    a = bench_copies(copies)
    print(f"(a) stress-512, FCFS, seed-200 train cycled to {a['copies']} copies at rho 1.2 "
          f"(lambda_sat {a['lambda_sat']:.3f} req/s, rate {a['rate']:.3f} req/s), {a['requests']} requests")
    print(f"    wall {a['wall_s']:.2f} s, {a['iterations']:,} iterations (sum over copies)")
    print(f"    engine steps/s:          {a['steps_per_s']:,.0f}")
    print(f"    simulated iterations/s:  {a['sim_iter_per_s']:,.0f}")
    print(f"(c) memory per copy:         {a['mem_per_copy'] / 1024:,.1f} KiB "
          f"({a['mem_per_copy'] * a['copies'] / a['requests']:,.0f} bytes/request)")
    if not args.no_azure:
        if AZURE_CONV.exists():
            b = bench_azure(repeats=1 if args.quick else 2)
            print(f"(b) Azure conv ({b['requests']:,} requests), FCFS, llama3-8b-h100: "
                  f"{b['wall_s']:.2f} s, {b['iterations']:,} iterations "
                  f"({b['wall_s'] / b['iterations'] * 1e6:.2f} us/iteration)")
            print(f"(c) memory per copy:         {b['mem_per_copy'] / 2**20:,.1f} MiB "
                  f"({b['bytes_per_request']:,.0f} bytes/request on average, "
                  f"{b['marginal_bytes_per_request']:,.0f} marginal)")
        else:
            print(f"(b) skipped: {AZURE_CONV} not found")
    if not args.quick:
        print(f"(d) cold compile: {cold_compile_seconds():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
