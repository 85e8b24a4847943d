#!/usr/bin/env python
"""Tuning speed: trials per minute of the index search on seed-200/train at rho 1.2 (stress-512).

    python benchmarks/bench_tuning.py                    # 200 index trials, k 8, 40 train traces
    python benchmarks/bench_tuning.py --trials 64 --k 16 --max-train-traces 120
    python benchmarks/bench_tuning.py --default-run      # also time `python tuning/optuna_search.py`
    python benchmarks/bench_tuning.py --default-run-only --no-comparators-too   # the script, with and
                                                         # without the comparators (no index bench)

Runs ``tokenbatch_env.tuning.optimize`` on the index study alone (no baselines, no test evaluation)
in a fresh SQLite study in a temporary directory, after one warm-up engine run (so the numba kernel
is compiled/loaded before the clock starts). Prints trials/min, the engine share of the wall time
(simulate calls) and the Optuna share (ask/suggest/tell and storage). Target: 200 trials in <= 3 min
on 2 cores. ``--default-run`` times the newcomer's command end to end (search of the index, three
baselines and the comparators weights+shed and index-scheduled + the test-split evaluation) in a
subprocess, with its CPU seconds (user + system: a fairer figure than wall time on a shared
machine); ``--no-comparators-too`` also times it with ``--no-comparators``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--max-train-traces", type=int, default=40)
    p.add_argument("--load", type=float, default=1.2)
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    p.add_argument("--default-run", action="store_true", help="also time the default script end to end")
    p.add_argument("--default-run-only", action="store_true", help="only time the default script")
    p.add_argument("--no-levers", action="store_true", help="the index's own parameters only (vLLM's flags fixed)")
    p.add_argument("--no-comparators-too", action="store_true",
                   help="with --default-run: also time the script with --no-comparators")
    a = p.parse_args(argv)
    if a.default_run_only:
        return default_runs(a.no_comparators_too)

    import optuna  # noqa: F401
    from tokenbatch_env import tuning as T

    with tempfile.TemporaryDirectory() as tmp:
        cfg = T.TuneConfig(trials=a.trials, k=a.k, max_train_traces=a.max_train_traces, loads=(a.load,),
                           baselines=(), out=tmp, threads=a.threads, progress=False, comparators=False,
                           levers=not a.no_levers)
        obj = T.TrainObjective(cfg)
        T.open_studies(cfg)                       # a new study: the warm starts are enqueued, as in the script
        t = time.perf_counter()
        obj.evaluate(T.INDEX_ROW, [{"index": {}, "shed_margin": 0.0}])            # warm-up / compile
        warm = time.perf_counter() - t
        engine_s = [0.0]
        ev = obj.evaluate

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return ev(*args, **kw)
            finally:
                engine_s[0] += time.perf_counter() - t0

        obj.evaluate = timed
        t0 = time.perf_counter()
        T.optimize(cfg, objective=obj)
        wall = time.perf_counter() - t0
        st = T.open_studies(cfg, write_attrs=False)[T.INDEX_ROW]
        n = sum(t.state.name == "COMPLETE" for t in st.trials)
        copies = n * obj.n_units
        res = {"trials": n, "k": a.k, "train_traces": a.max_train_traces, "load": a.load,
               "engine_threads": obj.threads, "wall_s": round(wall, 2),
               "trials_per_min": round(60 * n / wall, 1),
               "engine_s": round(engine_s[0], 2), "optuna_s": round(wall - engine_s[0], 2),
               "copies_per_s": round(copies / engine_s[0], 1), "warmup_s": round(warm, 2),
               "best_train_goodput": round(st.best_value, 5),
               "target_200_trials_in_180_s": bool(wall * 200 / max(n, 1) <= 180)}
    print(json.dumps(res, indent=1))
    if a.default_run:
        return default_runs(a.no_comparators_too)
    return 0


def default_runs(no_comparators_too: bool) -> int:
    """Time `python tuning/optuna_search.py` (fresh study) and, optionally, with --no-comparators."""
    rc = 0
    for extra in ([], ["--no-comparators"]) if no_comparators_too else ([],):
        with tempfile.TemporaryDirectory() as tmp:
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, str(ROOT / "tuning" / "optuna_search.py"), "--out", tmp,
                                "--quiet", *extra], cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            meta = json.loads((Path(tmp) / "run_meta.json").read_text()) if r.returncode == 0 else {}
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        print(json.dumps({"default_run": " ".join(["optuna_search.py", *extra]), "wall_s": round(wall, 1),
                          "cpu_s": round(cpu, 1), "returncode": r.returncode,
                          "search_wall_s": meta.get("search_wall_s"),
                          "test_eval_wall_s": meta.get("test_eval_wall_s")}, indent=1), flush=True)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
