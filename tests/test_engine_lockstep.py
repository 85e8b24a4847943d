"""The compiled kernel equals the same code run interpreted (NUMBA_DISABLE_JIT=1), record by record."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys
import numpy as np
import pytest
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


def test_package_code_indexes_without_wraparound_and_others_keep_it():
    """``_jit.WRAPAROUND_OFF``: functions compiled in this package take a negative index as out of
    range (with bounds checks on, an IndexError; the engine never uses one), while any other
    compiled function, here this test module's, keeps Python's wraparound. The probes are compiled
    with bounds checks so that the difference is an exception, not a stray read."""
    import numba

    from tokenbatch_env.engine import _jit

    assert _jit.WRAPAROUND_OFF

    def probe(a, i):
        return a[i]

    def probe2(a, i, j):
        return a[i, j]

    a = np.arange(6)
    b = a.reshape(2, 3)
    theirs, theirs2 = numba.njit(boundscheck=True)(probe), numba.njit(boundscheck=True)(probe2)
    assert theirs(a, -1) == 5 and theirs2(b, -1, -2) == 4
    for f in (probe, probe2):
        f.__module__ = "tokenbatch_env.engine.probe"   # compiled as if defined in the package
    ours, ours2 = numba.njit(boundscheck=True)(probe), numba.njit(boundscheck=True)(probe2)
    assert ours(a, 5) == 5 and ours2(b, 1, 1) == 4
    with pytest.raises(IndexError):
        ours(a, -1)
    with pytest.raises(IndexError):
        ours2(b, 1, -1)
    assert theirs(a, -6) == 0   # the other function, compiled after, still wraps


def test_compiled_functions_read_and_write_their_cache_under_a_lock():
    """Two processes (the xdist workers) saving two signatures of one function at once could leave
    numba's index pointing at the other's machine code: every registered dispatcher's cache is read,
    written and flushed under ``_jit._cache_lock``, which another process cannot take meanwhile."""
    pytest.importorskip("fcntl")   # (POSIX: without it the lock is a no-op)
    from tokenbatch_env.engine import _jit, kernel
    caches = [d._cache for d in _jit._REGISTRY if hasattr(d, "_cache")]
    assert len(caches) >= 40 and all(getattr(c, "tokenbatch_locked", False) for c in caches)
    cache = kernel.run_copies_kernel._cache
    lock = Path(cache.cache_path) / "tokenbatch.lock"
    probe = ("import fcntl, sys\nf = open(sys.argv[1], 'a+b')\ntry:\n"
             "    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)\n    print('free')\n"
             "except BlockingIOError:\n    print('held')")
    with _jit._cache_lock(cache, True):
        held = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True, timeout=60)
    free = subprocess.run([sys.executable, "-c", probe, str(lock)], capture_output=True, text=True, timeout=60)
    assert (held.stdout.strip(), free.stdout.strip()) == ("held", "free"), (held.stderr, free.stderr)


def test_every_compiled_function_is_guarded_against_stale_cached_code():
    """numba keys a function's cached machine code on its own file only: every compiled function
    (not an inlined helper) registered by ``engine._jit`` must be flushed by a ``guard_stale_cache``
    call, or one that inlines code of another file (the score formula, the outcome definition) keeps
    the old code after that file changes. Imports every module that compiles."""
    import importlib

    from tokenbatch_env.engine import _jit
    for m in ("engine.kernel", "engine.scoring", "engine.state", "engine.outcomes", "traces.prefix", "envs",
              "policies", "bounds", "evaluate", "control", "capacity", "metrics"):
        importlib.import_module(f"tokenbatch_env.{m}")
    compiled = [d for d in _jit._REGISTRY if hasattr(d, "_cache") and d.targetoptions.get("inline") != "always"
                and d.py_func.__module__.startswith("tokenbatch_env.")]   # (not the tests' own)
    assert len(compiled) >= 20   # (the kernel, its scores, the env's observations, rewards and layouts, ...)
    unguarded = [f"{d.py_func.__module__}.{d.py_func.__name__}" for d in compiled if id(d) not in _jit.GUARDED]
    assert not unguarded, f"not covered by guard_stale_cache: {unguarded}"



def test_engine_digest_covers_compiled_code_below_the_engine(tmp_path, monkeypatch):
    """The traces layer's compiled functions (``traces.prefix``) are linked by compiled code above
    them (the env's window layout): the digest every guard compares (``engine_digest``) covers their
    files, so that an edit there flushes that code too (numba's own cache notices only the edited
    file's functions)."""
    import importlib

    from tokenbatch_env.engine import _jit
    importlib.import_module("tokenbatch_env.traces.prefix")
    below = {Path(sys.modules[d.py_func.__module__].__file__).resolve() for d in _jit._REGISTRY
             if hasattr(d, "_cache") and d.py_func.__module__.startswith("tokenbatch_env.traces.")}
    assert below and below <= {Path(p).resolve() for p in _jit.LINKED_SOURCES}
    copy = tmp_path / "prefix.py"
    copy.write_bytes(Path(_jit.LINKED_SOURCES[0]).read_bytes())
    monkeypatch.setattr(_jit, "LINKED_SOURCES", (copy,))
    before = _jit.engine_digest()
    copy.write_text(copy.read_text() + "\n# an edit\n")
    assert _jit.engine_digest() != before


_ONE_VARIANT_PROBE = r"""
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
import tokenbatch_env.evaluate as ev
from tokenbatch_env.engine import _jit
from tokenbatch_env.engine.cost_model import CostModel
from tokenbatch_env.engine.outcomes import request_metrics
from tokenbatch_env.engine.simulate import EngineRun
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.envs import ACTION_NAMES, TokenBatchEnv, TokenBatchVectorEnv
from tokenbatch_env.traces.trace import Trace

small, rng, d = dict(window=24, warmup=8, cooldown=8), np.random.default_rng(0), len(ACTION_NAMES)
one = TokenBatchEnv(**small)                      # one copy: its arrays' layouts differ from N's
one.reset(seed=1)
for _ in range(40):
    if any(one.step(rng.uniform(-1, 1, d))[2:4]):
        one.reset()
for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
    vec = TokenBatchVectorEnv(3, autoreset_mode=mode, **small)
    vec.reset(seed=2)
    for _ in range(40):
        vec.step(rng.uniform(-1, 1, (3, d)))
ev.run_benchmark(ev.BenchConfig(max_traces=1, loads=(1.2,), policies=("fcfs", "edf", "index"), bootstrap_b=100,
                                progress=False))
tr = Trace.build(arrival_ns=np.arange(6, dtype=np.int64) * 10**6, prompt_tokens=[300, 40, 300, 40, 300, 40],
                 output_tokens=[9, 5, 9, 5, 9, 5], prefix_offsets=np.array([0, 1, 2, 3, 3, 4, 5]),
                 prefix_hashes=np.array([7, 7, 8, 8, 7], np.int64))
tr.subset([1, 2, 4])
run = EngineRun([tr] * 3, "linear", config=EngineConfig(max_num_batched_tokens=256))
ev.evaluate_index_params([tr, tr], "linear", [{}], shed_margins=0.5)    # tuning's path
from tokenbatch_env.engine.profiles import load_profile
from tokenbatch_env.policies import DropInParams, IndexParams, score_request_priority
score_request_priority(100, 10.0, 5.0, 1000.0, 400, 0, 0.2,          # the drop-in (and the vLLM plug-in's)
                       params=DropInParams.from_profile(load_profile("stress-512"), IndexParams(), 1000.0))
run.advance(until_ns=2 * 10**6)                   # a scalar, an array (read-only as broadcast), none
run.advance(until_ns=np.full(3, 4 * 10**6), active=np.array([True, False, True]))
run.advance()
request_metrics({k: np.zeros(4, np.int64) for k in ("end_state", "first_token_ns", "arrival_ns", "finish_ns",
                                                    "output_tokens")}, tr.subset([0, 1, 2, 3]))
frozen = np.array([10, 500])
frozen.flags.writeable = False
for p in ([10, 500], frozen):
    CostModel(c0=1.0, c_prefill=0.01).idle_prefill_ns(p, 256)
# every variant compiled for the current sources: this process's, and those in numba's on-disk index
# (which also lists the variants compiled as callees of others, never loaded into their dispatchers)
for f in _jit._REGISTRY:
    name = f"{f.py_func.__module__}.{f.py_func.__name__}"
    if not name.startswith("tokenbatch_env."):
        continue
    sigs = sorted({tuple(map(str, s)) for s in f.signatures}
                  | {tuple(map(str, k[0])) for k in f._cache._cache_file._load_index()})
    if len(sigs) > 1:   # name, variants, and where the first two differ (argument: types)
        diff = [f"{i}: {x} / {y}" for i, (x, y) in enumerate(zip(*sigs[:2])) if x != y]
        print(f"{name}: {len(sigs)} variants; arguments {'; '.join(diff) or 'differ in number'}")
"""


def test_main_paths_compile_each_function_once():
    """Each compiled function gets one machine-code variant on the package's main paths: the single
    env and the vector env (both autoreset modes), the evaluator, ``EngineRun.advance`` with every
    form of ``until_ns``, tuning's goodput matrix, the drop-in score, trace subsets, outcomes and the
    cost model (and
    whatever the tests before this one compiled, in either pytest-xdist worker: they share numba's
    on-disk cache, so a test compiling a second variant of a package function fails this one
    whenever it ran first). numba compiles a variant per argument type, and a
    read-only array, a column view of a one-copy array, a literal constant or an omitted default is
    another type: a second variant of the kernel cost ~2 minutes of compiling (the suite's time on a
    clean clone). Counted in a fresh process over its own variants and numba's on-disk index, which
    also holds the variants compiled as callees of other functions (a process that loads a caller
    from the cache never sees those); the index is numba's private API (``_load_index``)."""
    r = subprocess.run([sys.executable, "-c", _ONE_VARIANT_PROBE], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "", f"compiled more than once:\n{r.stdout}"
