"""Start-up time of a warm `tokenbatch simulate`: the command run on a one-request
trace in fresh processes, numba's cache already compiled, and where that time goes.

    python benchmarks/bench_startup.py               # 10 timed runs after 1 warm-up, and the breakdown
    python benchmarks/bench_startup.py --runs 20
    python benchmarks/bench_startup.py --cold        # the cold compile instead (empty NUMBA_CACHE_DIR): minutes

The simulation of one request is nothing; what is measured is everything around it. Lines printed:

- ``warm``: the wall time of ``tokenbatch simulate --trace ONE --profile stress-512`` (the console
  script beside this Python) in N fresh processes, after one untimed warm-up run: median and min
  (the target is <= 0.5 s), and the median CPU time of those processes.
- ``breakdown``: medians over N instrumented processes (``--child``) of each phase, wall ms:
  python start-up (``python -c pass``, separate processes), ``import tokenbatch_env`` (numpy,
  gymnasium), numba's import, numba's target initialisation (its typing and lowering registries,
  which numba builds at a process's first cache load: ``engine._jit.init_target``), the engine
  modules the command imports, loading the compiled functions from numba's cache, the rest of the
  command (the simulation, the summary, the output), and the interpreter's exit (the instrumented
  process's wall time less all of the above; the collector's passes over numba's objects at
  shutdown, which ``tokenbatch_env.cli`` skips by freezing them at exit).
- ``cold`` (``--cold``, instead of the above): a first ``tokenbatch simulate`` with an empty
  ``NUMBA_CACHE_DIR`` (the engine's compile), then a first ``gym.make("TokenBatch-v0")`` reset and
  step in the same directory (the env's step on top of the cached kernel): wall and CPU seconds,
  the figures behind the first-run notice's estimate (``engine.COMPILE_SECONDS``).

The warm-up run writes Python's bytecode cache (``__pycache__/*.pyc``) even where
``PYTHONDONTWRITEBYTECODE`` is set (as on this project's machines, where the package's sources were
otherwise compiled to bytecode again at every start), so that "warm" means every cache warm;
``--no-bytecode`` keeps the environment as it is.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()   # (the instrumented process's own imports, below, are not the command's)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

PHASES = [("python", "python start-up"), ("package", "import tokenbatch_env"), ("numba", "numba import"),
          ("target", "numba target init"), ("modules", "engine modules"), ("load", "cache load"),
          ("rest", "simulate + output"), ("exit", "interpreter exit")]
#: the modules ``tokenbatch simulate`` imports (those it imports beyond them count under "simulate + output")
COMMAND_MODULES = ["tokenbatch_env.cli", "tokenbatch_env.engine.simulate_cli", "tokenbatch_env.engine.simulate",
                   "tokenbatch_env.metrics", "tokenbatch_env.traces.io", "tokenbatch_env.traces.sla",
                   "tokenbatch_env.traces.windows", "tokenbatch_env.evaluate"]
ENV_PROBE = ("import gymnasium as gym, tokenbatch_env\n"
             "env = gym.make('TokenBatch-v0'); env.reset(seed=0); env.step(env.action_space.sample())")


def one_request_trace(path: Path) -> Path:
    """A canonical CSV trace of one request (docs/design.md section 2)."""
    from tokenbatch_env.traces.io import save_trace
    from tokenbatch_env.traces.trace import Trace
    save_trace(Trace.build(arrival_ns=[0], prompt_tokens=[100], output_tokens=[10], name="one",
                           source="bench_startup"), path)
    return path


def command(trace: Path, profile: str) -> list:
    """``tokenbatch simulate`` through the console script installed beside this Python (a shim on
    PATH, e.g. pyenv's, would add its own start-up), else ``python -m tokenbatch_env.cli``."""
    script = Path(sys.executable).with_name("tokenbatch")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "tokenbatch_env.cli"]
    return head + ["simulate", "--trace", str(trace), "--profile", profile]


def _run(cmd, env=None) -> tuple[float, float]:
    """Wall and CPU seconds of one process (its output discarded; a failure raises)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def child(trace: str, profile: str) -> None:
    """One instrumented process: the phases' wall seconds as one JSON line on stdout."""
    import contextlib
    import io
    marks = [time.perf_counter()]
    import tokenbatch_env  # noqa: F401
    marks.append(time.perf_counter())
    import numba  # noqa: F401
    from numba.core import caching
    marks.append(time.perf_counter())
    loads = [0.0, 0]
    real = caching.Cache.load_overload

    def load_overload(self, sig, target_context):   # (before any dispatcher exists: each captures this)
        loads[1] += 1
        t = time.perf_counter()
        try:
            return real(self, sig, target_context)
        finally:
            loads[1] -= 1
            if loads[1] == 0:
                loads[0] += time.perf_counter() - t
    caching.Cache.load_overload = load_overload
    from tokenbatch_env.engine import _jit
    if hasattr(_jit, "init_target"):
        _jit.init_target()
    else:   # (a version without it: numba's own initialisation, as its first cache load does)
        from numba.core.registry import cpu_target
        cpu_target.target_context.refresh()
    marks.append(time.perf_counter())
    import importlib
    for m in COMMAND_MODULES:
        importlib.import_module(m)
    marks.append(time.perf_counter())
    from tokenbatch_env.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["simulate", "--trace", trace, "--profile", profile])
    marks.append(time.perf_counter())
    if rc != 0:
        raise SystemExit(f"tokenbatch simulate exited {rc}")
    d = [b - a for a, b in zip(marks, marks[1:])]
    print(json.dumps({"package": d[0], "numba": d[1], "target": d[2], "modules": d[3], "load": loads[0],
                      "rest": d[4] - loads[0], "span": marks[-1] - _T0}))


def _ms(x: float) -> str:
    return f"{1000 * x:,.0f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10, help="timed processes (and instrumented ones), default 10")
    ap.add_argument("--profile", default="stress-512")
    ap.add_argument("--trace", default=None, help="trace file (default: a one-request trace made here)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the instrumented processes")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="leave PYTHONDONTWRITEBYTECODE as it is for the warm-up (no .pyc written)")
    ap.add_argument("--cold", action="store_true", help="time the cold compile instead (minutes)")
    ap.add_argument("--child", nargs=2, metavar=("TRACE", "PROFILE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        trace = Path(args.trace) if args.trace else one_request_trace(Path(tmp) / "one.csv")
        cmd = command(trace, args.profile)
        if args.cold:
            cold(cmd)
            return 0
        warm_env = dict(os.environ)
        if not args.no_bytecode:
            warm_env.pop("PYTHONDONTWRITEBYTECODE", None)
        _run(cmd, warm_env)   # warm-up (compiles numba's cache if it is cold, writes bytecode)
        runs = [_run(cmd) for _ in range(args.runs)]
        walls = [w for w, _ in runs]
        print(f"warm `tokenbatch simulate --trace ONE --profile {args.profile}` (one request), {args.runs} fresh "
              f"processes after 1 warm-up: "
              f"median {statistics.median(walls):.3f} s, min {min(walls):.3f} s wall (target <= 0.5 s); "
              f"CPU median {statistics.median(c for _, c in runs):.3f} s")
        bytecode = "kept as it is" if args.no_bytecode else "written by the warm-up"
        print(f"PYTHONDONTWRITEBYTECODE {'set' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'unset'}; "
              f"bytecode cache {bytecode}")
        if not args.no_breakdown:
            py = [_run([sys.executable, "-c", "pass"])[0] for _ in range(args.runs)]
            rows = []
            for _ in range(args.runs):
                t = time.perf_counter()
                out = subprocess.run([sys.executable, __file__, "--child", str(trace), args.profile], check=True,
                                     capture_output=True, text=True).stdout
                wall = time.perf_counter() - t
                rows.append(json.loads(out.strip().splitlines()[-1]))
                rows[-1]["exit"] = max(0.0, wall - statistics.median(py) - rows[-1]["span"])
            med = {"python": statistics.median(py)}
            med.update({k: statistics.median(r[k] for r in rows) for k, _ in PHASES[1:]})
            parts = "; ".join(f"{label} {_ms(med[k])}" for k, label in PHASES)
            print(f"breakdown (median of {args.runs}, wall ms): {parts}; total {_ms(sum(med.values()))}")
    return 0


def cold(cmd) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-startup-numba-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        w, c = _run(cmd, env)
        w2, c2 = _run([sys.executable, "-c", ENV_PROBE], env)
    print(f"cold compile (empty NUMBA_CACHE_DIR): the engine (a first tokenbatch simulate) {w:.1f} s wall, "
          f"{c:.1f} s CPU; then the env's step (a first gym.make, reset and step) {w2:.1f} s wall, {c2:.1f} s CPU")


if __name__ == "__main__":
    sys.exit(main())
