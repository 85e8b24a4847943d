"""Scalar drop-in benchmark (run by hand; not a unit test).

    python benchmarks/bench_dropin.py             # 200,000 calls per measure
    python benchmarks/bench_dropin.py --calls 50000

Prints, see docs/benchmarks.md for the definitions:
  (a) ``score_request_priority`` from Python: microseconds per call (best of 5 repeats), on
      random requests drawn once up front (profile ``stress-512``, tuned-looking parameters);
  (b) the compiled score alone (``engine.scoring.policy_score`` called from numba, i.e. the
      kernel's cost per request), ns per request;
  (c) ``engine.scoring.gittins_score`` (empirical-Gittins, seed-200 train table) from numba, ns
      per request.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenbatch_env.engine import scoring as S
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.policies import DropInParams, IndexParams, score_request_priority


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(1, 4000, n), rng.lognormal(5, 1, n), rng.uniform(0, 3000, n),
            rng.choice([250.0, 1000.0, 3000.0], n), rng.integers(0, 512, n), rng.uniform(0, 0.9, n))


@S.njit
def _compiled_loop(p, d, w, t1, free, ratio, theta, ps, u_p, u_d, budget, usable, bs):
    acc = 0.0
    for i in range(p.shape[0]):
        s_ms = S.service_ms(float(p[i]), d[i], u_p, u_d)
        slack = t1[i] - w[i] - S.idle_prefill_ns(p[i], 0, budget, ps) / 1e6
        acc += S.policy_score(S.P_INDEX, theta, ratio[i], s_ms, d[i], slack, t1[i], False,
                              free[i] / usable, float((p[i] + bs - 1) // bs), float(usable),
                              t1[i] - w[i], 0.0, float(bs))
    return acc


@S.njit
def _gittins_loop(tab, mrl, g, a, u_d):
    acc = 0.0
    for i in range(g.shape[0]):
        acc += S.gittins_score(tab, mrl, g[i], a[i], u_d)
    return acc


def best_of(fn, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200_000)
    a = ap.parse_args(argv)
    n = a.calls
    prof = load_profile("stress-512")
    params = DropInParams.from_profile(prof, IndexParams(kappa=0.7, slope=2.0, gamma=30.0, theta=0.5,
                                                         beta=50.0, w_prefix=1.0, a_edf=1.0), 1000.0)
    reqs = _requests(n)
    p, d, w, t1, free, ratio = (x.tolist() for x in reqs)
    score_request_priority(p[0], d[0], w[0], t1[0], free[0], 0, ratio[0], params=params)  # compile

    def single():
        f = score_request_priority
        for i in range(n):
            f(p[i], d[i], w[i], t1[i], free[i], 0, ratio[i], params=params)

    t_a = best_of(single)
    theta, ps = params._arrays
    args = (reqs[0].astype(np.int64), reqs[1], reqs[2], reqs[3], reqs[4].astype(np.float64), reqs[5], theta, ps,
            params.u_p_ms, params.u_d_ms, params.budget, params.usable_blocks, params.block_size)
    _compiled_loop(*args)
    t_c = best_of(lambda: _compiled_loop(*args))
    print(f"profile stress-512, {n:,} random requests, best of 5")
    print(f"(a) score_request_priority, one call:   {t_a / n * 1e6:8.3f} us/call")
    print(f"(b) compiled policy_score (kernel path): {t_c / n * 1e9:8.1f} ns/request")
    try:
        from tokenbatch_env.predictors import ResidualLife
        from tokenbatch_env.traces.suites import load_suite
        L = np.concatenate([t.output_tokens for t in load_suite("seed-200").traces("train")])
        mrl = ResidualLife.from_lengths(L).table
        tab = S.gittins_table(mrl)
        rng = np.random.default_rng(1)
        g = rng.integers(0, int(L.max()), n)
        pre = rng.integers(0, 4000, n) * params.u_p_ms * (rng.random(n) < 0.3)
        _gittins_loop(tab, mrl, g, pre, params.u_d_ms)
        t_d = best_of(lambda: _gittins_loop(tab, mrl, g, pre, params.u_d_ms))
        print(f"(c) compiled gittins_score:              {t_d / n * 1e9:8.1f} ns/request "
              f"(table {tab.shape[0]} x {tab.shape[1]}, {tab.nbytes / 1024:.0f} KiB)")
    except Exception as e:  # noqa: BLE001 - the suite may be absent on a user's clone
        print(f"(c) skipped: {e}")


if __name__ == "__main__":
    main()
