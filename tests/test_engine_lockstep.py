"""The compiled kernel equals the same code run interpreted (NUMBA_DISABLE_JIT=1), record by record."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, "tests")
from engine_helpers import tiny_trace, run
from tokenbatch_env.policies import engine_policy
rng = np.random.default_rng(5)
n = 14
tr = tiny_trace(np.cumsum(rng.integers(0, 30, n)), rng.integers(33, 200, n), rng.integers(1, 40, n),
                prio=rng.integers(0, 3, n), t1_ms=300, t2_ms=40,
                chains=[[7, 8][: int(k)] for k in rng.integers(0, 3, n)])
out = {}
for name, pol in [("fcfs", "fcfs"), ("priority", "priority"),
                  ("index+shed", engine_policy("index", shed_margin=0.5, t_ref_ms=300.0))]:
    r = run(tr, pol, num_blocks=24, max_num_batched_tokens=64, async_scheduling=True)
    rec = r.records(0)
    out[name] = {k: np.asarray(v).tolist() for k, v in rec.items()}
print(json.dumps(out))
"""


def _run(disable_jit: bool) -> dict:
    env = dict(os.environ, NUMBA_DISABLE_JIT="1" if disable_jit else "0")
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_compiled_equals_interpreted():
    compiled, interpreted = _run(False), _run(True)
    assert compiled.keys() == interpreted.keys()
    for name in compiled:
        for k in compiled[name]:
            assert np.array_equal(compiled[name][k], interpreted[name][k]), (name, k)


def test_prefetch_is_a_pure_hint():
    """``_jit.prefetch`` (the kernel prefetches the next copy's state) compiles for the engine's
    array dtypes and changes no result; interpreted it is a no-op."""
    import numba

    from tokenbatch_env.engine._jit import prefetch

    @numba.njit
    def total(a):
        s = 0.0
        for i in range(a.shape[0]):
            for j in range(0, a.shape[1], 8):
                prefetch(a, i, j)
            s += a[i].sum()
        return s

    rng = np.random.default_rng(0)
    for dt in (np.int8, np.int32, np.int64, np.float64, np.bool_):
        a = (rng.integers(0, 5, (7, 33))).astype(dt)
        assert total(a) == a.sum()
    assert prefetch(np.zeros((2, 2)), 1, 1) is None


def test_every_compiled_function_is_guarded_against_stale_cached_code():
    """numba keys a function's cached machine code on its own file only: every compiled function
    (not an inlined helper) registered by ``engine._jit`` must be flushed by a ``guard_stale_cache``
    call, or one that inlines code of another file (the score formula, the outcome definition) keeps
    the old code after that file changes. Imports every module that compiles."""
    import importlib

    from tokenbatch_env.engine import _jit
    for m in ("engine.kernel", "engine.scoring", "engine.state", "engine.outcomes", "envs", "policies",
              "bounds", "evaluate", "control", "capacity", "metrics"):
        importlib.import_module(f"tokenbatch_env.{m}")
    compiled = [d for d in _jit._REGISTRY if hasattr(d, "_cache") and d.targetoptions.get("inline") != "always"]
    assert len(compiled) >= 20   # (the kernel, its scores, the env's observations, rewards and layouts, ...)
    unguarded = [f"{d.py_func.__module__}.{d.py_func.__name__}" for d in compiled if id(d) not in _jit.GUARDED]
    assert not unguarded, f"not covered by guard_stale_cache: {unguarded}"
