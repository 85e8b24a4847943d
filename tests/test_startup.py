"""Start-up: the start-up benchmark runs end to end on a tiny budget (its speed is
the benchmark's to measure, not asserted here); numba's target initialised without importing
scipy.linalg, with numba's own answer to its BLAS probe; the first-run compile notice's detection
(cold for an empty cache, warm for a compiled one, on a tiny dispatcher and never compiling the
engine) and its one line, printed once."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_startup.py"
TINY = "from tokenbatch_env.engine._jit import njit\n\n\n@njit\ndef tiny(x):\n    return x + 1\n"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


JIT_OFF = os.environ.get("NUMBA_DISABLE_JIT", "0") not in ("", "0")
needs_jit = pytest.mark.skipif(JIT_OFF, reason="numba disabled (NUMBA_DISABLE_JIT): nothing is compiled")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **env))


def test_bench_startup_tiny(capsys):
    """One timed process and one instrumented one: the lines are printed and the breakdown's phases
    add up to its total; the kernel's cache is then warm (the warm-up compiled it if it was not)."""
    bench = _load(BENCH, "bench_startup")
    assert bench.main(["--runs", "1", "--no-bytecode"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warm `tokenbatch simulate --trace ONE --profile stress-512` (one request), 1 fresh")
    assert "median" in out[0] and "target <= 0.5 s" in out[0] and "CPU median" in out[0]
    assert "bytecode cache kept as it is" in out[1]
    line = out[2]
    assert line.startswith("breakdown (median of 1, wall ms): python start-up ")
    parts = dict(p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split("; "))
    total = int(parts.pop("total").replace(",", ""))
    assert list(parts) == [label for _, label in bench.PHASES]
    assert abs(sum(int(v.replace(",", "")) for v in parts.values()) - total) <= len(parts)   # (rounded to ms)
    from tokenbatch_env.engine import _jit, kernel
    assert _jit.cached(kernel.run_copies_kernel)


@needs_jit
def test_numba_target_initialised_without_scipy_linalg():
    """``init_target`` builds numba's registries without importing scipy.linalg, and its BLAS probe
    gets numba's own answer; numba's BLAS functions still compile (importing scipy.linalg then)."""
    probe = ("import sys\nimport numba.np.arraymath as am, numba.np.linalg as la\n"
             "print(am._HAVE_BLAS, 'scipy.linalg' in sys.modules, am.ensure_blas is la.ensure_blas, "
             "la.ensure_blas.__qualname__)\n")
    ours = _python("from tokenbatch_env.engine import _jit\n_jit.init_target()\n" + probe
                   + "import numba, numpy as np\nif am._HAVE_BLAS:\n    f = numba.njit(lambda a: np.dot(a, a))\n"
                   "    print(f(np.arange(3.0)), 'scipy.linalg' in sys.modules)")
    assert ours.returncode == 0, ours.stderr
    numbas = _python("from numba.core.registry import cpu_target\ncpu_target.target_context.refresh()\n" + probe)
    assert numbas.returncode == 0, numbas.stderr
    have, linalg_imported, same, name = ours.stdout.split("\n")[0].split()
    assert (linalg_imported, same, name) == ("False", "True", "ensure_blas")
    assert have == numbas.stdout.split()[0]   # numba's answer (scipy.linalg imported to get it)
    if have == "True":
        assert ours.stdout.split("\n")[1] == "5.0 True"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A one-line compiled function in its own file (its own numba cache: empty), the notice not yet shown."""
    from tokenbatch_env.engine import _jit
    monkeypatch.setattr(_jit, "_NOTICE_SHOWN", False)
    path = tmp_path / "tb_tiny_probe.py"
    path.write_text(TINY)
    return path


@needs_jit
def test_detection_cold_then_warm(tiny):
    """Cold for an empty cache; warm once compiled (in this process, and for a new dispatcher of the
    same function, from numba's index on disk); cold again when the source changes."""
    import numba
    from tokenbatch_env.engine import _jit
    mod = _load(tiny, "tb_tiny_probe")
    assert not _jit.cached(mod.tiny)
    assert mod.tiny(1) == 2
    assert _jit.cached(mod.tiny)
    fresh = numba.njit(cache=True)(mod.tiny.py_func)   # (nothing in memory: the index on disk)
    assert not fresh.overloads and _jit.cached(fresh)
    tiny.write_text(TINY.replace("x + 1", "x + 2"))    # (numba's cache: keyed on the source's stamp)
    edited = _load(tiny, "tb_tiny_probe_edited")
    assert not _jit.cached(edited.tiny)
    assert _jit.cached(lambda x: x)   # interpreted: nothing to compile


@needs_jit
def test_notice_printed_once_and_only_when_cold(tiny, monkeypatch):
    """Nothing when all is compiled; one line naming the cold parts and their time; none after it."""
    from tokenbatch_env.engine import _jit
    mod = _load(tiny, "tb_tiny_probe")
    other = tiny.with_name("tb_tiny_probe_warm.py")   # (its own file: its own cache)
    other.write_text(TINY)
    warm = _load(other, "tb_tiny_probe_warm").tiny
    warm(1)
    buf = io.StringIO()
    assert not _jit.notice_if_cold([("the warm one", [warm], 5.0)], buf)
    assert buf.getvalue() == ""
    assert _jit.notice_if_cold([("the warm one", [warm], 5.0), ("the tiny function", [mod.tiny], 100.0)], buf)
    assert not _jit.notice_if_cold([("the tiny function", [mod.tiny], 100.0)], buf)
    assert buf.getvalue() == ("tokenbatch: compiling the tiny function with numba, once (about 2 min, longer on a "
                              "busy machine); later runs load it from the cache\n")
    monkeypatch.setattr(_jit, "_NOTICE_SHOWN", False)   # (another process)
    buf = io.StringIO()
    assert _jit.notice_if_cold([("a", [mod.tiny], 20.0), ("b", [warm], 5.0), ("c", [mod.tiny], 12.0)], buf)
    assert buf.getvalue().startswith("tokenbatch: compiling a and c with numba, once (about 30 s, longer on")


@needs_jit
def test_compile_notice_on_an_empty_cache_dir(tmp_path):
    """The public function, in a process whose NUMBA_CACHE_DIR is empty: one line on stderr, however
    often it is called (nothing is compiled: the check reads numba's index); with ``extra`` the
    caller's part too, in the same line, its seconds added (the env passes its step so); nothing when
    numba is disabled. The engine imports nothing above it for this (no ``tokenbatch_env.envs``)."""
    probe = tmp_path / "tb_tiny_probe.py"
    probe.write_text(TINY)
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('tb_tiny_probe', {str(probe)!r})\n"
            "mod = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(mod)\n"
            "from tokenbatch_env.engine import compile_notice\n"
            "print(compile_notice({a}), compile_notice(), compile_notice({a}), 'tokenbatch_env.envs' in sys.modules)")
    extra = "extra=[('the tiny function', [mod.tiny], 30.0)]"
    r = _python(code.format(a=""), NUMBA_CACHE_DIR=str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False", "False"]
    assert r.stderr.splitlines() == ["tokenbatch: compiling the engine with numba, once (about 1 min, longer on a "
                                     "busy machine); later runs load it from the cache"]
    r = _python(code.format(a=extra), NUMBA_CACHE_DIR=str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False", "False", "False"]
    [line] = r.stderr.splitlines()
    assert line.startswith("tokenbatch: compiling the engine and the tiny function with numba, once (about 2 min")
    r = _python(code.format(a=extra), NUMBA_CACHE_DIR=str(tmp_path / "c"), NUMBA_DISABLE_JIT="1")
    assert r.returncode == 0, r.stderr
    assert (r.stdout.split(), r.stderr) == (["False", "False", "False", "False"], "")
