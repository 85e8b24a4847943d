"""numba decorators used by the engine (one place, so the interpreted fallback is uniform), and the
guard against stale compiled code.

numba's on-disk cache of a function is keyed on its own source file only: a cached kernel that calls
a score formula keeps the old formula after ``scoring.py`` changes. ``guard_stale_cache`` flushes the
cached machine code of the given dispatchers whenever any engine source file changes (or a compiled
file below the engine that such code links, ``LINKED_SOURCES``).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
from pathlib import Path

_REGISTRY: list = []
#: ids of the dispatchers a ``guard_stale_cache`` call covers (tests check that every one is)
GUARDED: set = set()
_FETCH_ADD_LOCK = threading.Lock()   # the interpreted ``fetch_add``


def prefetch(arr, i, j):
    """A hint that ``arr[i, j]``'s cache line will be read soon (LLVM's ``prefetch``: it never
    faults and changes no result). Interpreted (``NUMBA_DISABLE_JIT``): nothing."""
    return None


def prefetch3(arr, i, j, k):
    """``prefetch`` of ``arr[i, j, k]`` (a 3-D array)."""
    return None


def fetch_add(arr, i, v):
    """Atomically ``old = arr[i]; arr[i] += v; return old`` (int64 ``arr``): how the engine threads
    share out copies (``kernel.next_copy``). Interpreted: under a lock."""
    with _FETCH_ADD_LOCK:
        old = int(arr[i])
        arr[i] = old + v
    return old


def _without_wraparound() -> bool:
    """Compile this package's integer array indices without Python's negative-index wraparound.

    numba wraps every signed index (``i < 0 ? i + n : i``) and offers no opt-out short of unsigned
    index types (numba PR #929; issue #3205 asks for one). Without the selects the env's step ran ~10%
    faster (docs/benchmarks.md), with the same results. The engine never indexes with a
    negative value: CI (``.ci/run``, step 3) runs the engine's and the env's tests again with bounds
    checks on (``NUMBA_BOUNDSCHECK=1``: a negative index then raises IndexError), and compiled
    results equal interpreted ones (``tests/test_engine_lockstep.py``). Scoped by the LLVM function
    being built, so that other packages' compiled code (and numba's own overloads, compiled as
    functions of their own) keeps Python's semantics. With a numba whose indexing lacks this hook,
    indices wrap as before (the same results, slower; ``WRAPAROUND_OFF`` is then False and a test
    fails)."""
    try:
        from numba.core import types
        from numba.np import arrayobj
    except ImportError:  # pragma: no cover
        return False
    wrapped = getattr(arrayobj, "fix_integer_index", None)
    if wrapped is None:  # pragma: no cover - another numba
        return False
    if getattr(wrapped, "tokenbatch_scope", None):
        return True
    pkg = __name__.split(".")[0]
    scope = f"{len(pkg)}{pkg}"   # in the mangled name of every function defined in this package

    def fix_integer_index(context, builder, idxty, idx, size):
        if idxty.signed and scope in builder.function.name:
            return context.cast(builder, idx, idxty, types.intp)
        return wrapped(context, builder, idxty, idx, size)
    fix_integer_index.tokenbatch_scope = scope
    arrayobj.fix_integer_index = fix_integer_index
    return True


@contextlib.contextmanager
def _cache_lock(cache, exclusive: bool):
    """An advisory lock on a numba cache directory (``fcntl.flock``; nothing where it is missing)."""
    try:
        import fcntl
        path = Path(cache.cache_path)
        path.mkdir(parents=True, exist_ok=True)
        f = open(path / "tokenbatch.lock", "a+b")
    except (ImportError, OSError):   # (no fcntl, or a read-only cache: numba then caches nothing anyway)
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _locked_cache(d):
    """``d`` with its on-disk cache read and written under ``_cache_lock``. numba saves an overload
    as two files, the function's index (written first) and the overload's data, numbered by what the
    index held, with no lock: two processes saving two signatures of one function at once (the
    tests' two xdist workers, several tuning workers on a fresh install) can leave the index
    pointing one signature at the other's machine code, which a later process loads and calls. Under
    the lock an index and its data change together."""
    cache = getattr(d, "_cache", None)
    if cache is None or not hasattr(cache, "save_overload") or getattr(cache, "tokenbatch_locked", False):
        return d
    save, load, flush = cache.save_overload, cache.load_overload, cache.flush

    def save_overload(sig, data):
        with _cache_lock(cache, True):
            return save(sig, data)

    def load_overload(sig, target_context):   # (numba's first step to run a function: load, else compile)
        if not _TARGET_READY:
            init_target()
        with _cache_lock(cache, False):
            return load(sig, target_context)

    def flush_locked():
        with _cache_lock(cache, True):
            return flush()
    cache.save_overload, cache.load_overload, cache.flush = save_overload, load_overload, flush_locked
    cache.tokenbatch_locked = True
    return d


_TARGET_READY = False
_TARGET_LOCK = threading.Lock()


def _scipy_blas_present() -> bool:
    """Whether ``import scipy.linalg.cython_blas`` would find its module, judged without importing
    scipy.linalg: scipy's top-level spec (nothing imported) and the extension module's file."""
    import importlib.machinery
    import importlib.util
    import os
    try:
        spec = importlib.util.find_spec("scipy")
    except (ImportError, ValueError):
        return False
    roots = list(getattr(spec, "submodule_search_locations", None) or []) if spec is not None else []
    return any(os.path.exists(os.path.join(root, "linalg", "cython_blas" + suffix))
               for root in roots for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def init_target() -> None:
    """Initialise numba's CPU target (its typing and lowering registries) as numba does before a
    process's first cache load or compile, less one import: numba's registries probe for BLAS
    (``numba.np.arraymath._HAVE_BLAS``, whether ``np.convolve``/``np.correlate`` may call ``np.dot``)
    by importing ``scipy.linalg``, a quarter of a warm ``tokenbatch simulate``'s start-up where scipy
    is installed (``benchmarks/bench_startup.py``). The probe is answered from the module's file
    instead, the same answer without the import; scipy.linalg is imported when compiled code first
    needs BLAS (numba's ``ensure_blas`` at typing, as before). Once per process, by the first load of
    any of this package's dispatchers; a process that already has ``numba.np.arraymath`` or
    ``scipy.linalg`` gets numba's own initialisation. No compiled code changes: numba's registries
    are the same, ``numba.np.linalg`` imported before the others instead of among them."""
    global _TARGET_READY
    with _TARGET_LOCK:
        if _TARGET_READY:
            return
        from numba.core.registry import cpu_target
        ctx = cpu_target.target_context
        linalg = real = None
        if "numba.np.arraymath" not in sys.modules and "scipy.linalg" not in sys.modules:
            try:
                from numba.np import linalg
                real = linalg.ensure_blas
            except (ImportError, AttributeError):  # pragma: no cover - another numba
                linalg = real = None
        if real is None:
            ctx.refresh()
        else:
            present = _scipy_blas_present()
            check_width = getattr(linalg, "_check_lapack_int_width", None)

            def ensure_blas():
                if not present:
                    raise ImportError("scipy 0.16+ is required for linear algebra")
                if check_width is not None:   # (numba's own check after its import: it reads scipy.__config__)
                    check_width()
            linalg.ensure_blas = ensure_blas
            try:
                ctx.refresh()
            finally:   # numba's own function again wherever numba bound the name meanwhile (arraymath)
                for name, mod in list(sys.modules.items()):
                    if name.startswith("numba.") and vars(mod).get("ensure_blas") is ensure_blas:
                        mod.ensure_blas = real
        _TARGET_READY = True


try:  # numba is a runtime dependency; without it the same functions run interpreted
    from numba import njit as _numba_njit

    #: this package's compiled code indexes without negative-index wraparound (``_without_wraparound``)
    WRAPAROUND_OFF = _without_wraparound()

    def njit(fn):
        d = _numba_njit(cache=True, nogil=True)(fn)
        _REGISTRY.append(_locked_cache(d))
        return d

    def helper(fn):
        """Small helpers, inlined at numba-IR level (no call). numba still increfs and decrefs each
        array argument per call: the kernel passes ``borrow``-ed views, for which that is a no-op."""
        d = _numba_njit(cache=True, nogil=True, inline="always")(fn)
        _REGISTRY.append(_locked_cache(d))
        return d
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic, overload as _overload

    def borrow(arr):
        """``arr`` as a borrowed view in compiled code: the same data, shape and strides without its
        NRT meminfo, so that the reference counting numba emits around every use (each inlined
        helper call increfs and decrefs each array argument: two atomic operations, which perf
        showed to be most of the kernel's time, on a cache line that two engine threads would fight
        over) becomes a no-op. Only for arguments the Python caller keeps alive for the whole call,
        never returned, and never for an array allocated in the same function (numba frees it after
        its last use, leaving the view dangling). Interpreted (``NUMBA_DISABLE_JIT``): ``arr``."""
        return arr

    @_intrinsic
    def _borrowed(typingctx, arr):
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, value=args[0])
            ary.meminfo = context.get_constant_null(_types.MemInfoPointer(sig.args[0].dtype))
            ary.parent = context.get_constant_null(_types.pyobject)
            return ary._getvalue()
        return arr(arr), codegen

    @_overload(borrow)
    def _borrow_impl(arr):
        if isinstance(arr, _types.Array):
            return lambda arr: _borrowed(arr)

    from llvmlite import ir as _ir
    from numba.core import cgutils as _cgutils

    def _item_pointer(context, builder, sig, args, ndim):
        """The address of ``arr[args[1:1 + ndim]]`` for an intrinsic whose first argument is ``arr``."""
        ary = context.make_array(sig.args[0])(context, builder, value=args[0])
        return _cgutils.get_item_pointer(context, builder, sig.args[0], ary, list(args[1:1 + ndim]),
                                         wraparound=False)

    def _prefetch_codegen(ndim):
        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig, args, ndim)
            if getattr(ptr.type, "is_opaque", False):   # LLVM with opaque pointers
                name = "llvm.prefetch.p0"
            else:
                ptr = builder.bitcast(ptr, _ir.IntType(8).as_pointer())
                name = "llvm.prefetch.p0i8"
            i32 = _ir.IntType(32)
            fn = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(_ir.VoidType(), [ptr.type, i32, i32, i32]), name)
            builder.call(fn, [ptr, i32(0), i32(3), i32(1)])   # read, keep in all cache levels, data
            return context.get_dummy_value()
        return codegen

    @_intrinsic
    def _prefetch(typingctx, arr, i, j):
        return _types.void(arr, i, j), _prefetch_codegen(2)

    @_intrinsic
    def _prefetch3(typingctx, arr, i, j, k):
        return _types.void(arr, i, j, k), _prefetch_codegen(3)

    @_overload(prefetch)
    def _prefetch_impl(arr, i, j):
        if isinstance(arr, _types.Array) and arr.ndim == 2:
            return lambda arr, i, j: _prefetch(arr, i, j)

    @_overload(prefetch3)
    def _prefetch3_impl(arr, i, j, k):
        if isinstance(arr, _types.Array) and arr.ndim == 3:
            return lambda arr, i, j, k: _prefetch3(arr, i, j, k)

    @_intrinsic
    def _fetch_add(typingctx, arr, i, v):
        def codegen(context, builder, sig, args):
            ptr = _item_pointer(context, builder, sig, args, 1)
            val = context.cast(builder, args[2], sig.args[2], _types.int64)
            return builder.atomic_rmw("add", ptr, val, "seq_cst")
        return _types.int64(arr, i, v), codegen

    @_overload(fetch_add)
    def _fetch_add_impl(arr, i, v):
        if isinstance(arr, _types.Array) and arr.ndim == 1 and arr.dtype == _types.int64:
            return lambda arr, i, v: _fetch_add(arr, i, v)
except ImportError:  # pragma: no cover
    WRAPAROUND_OFF = False

    def njit(fn):
        fn.py_func = fn
        return fn

    helper = njit

    def borrow(arr):
        return arr


#: compiled source files outside ``engine/`` that engine-dependent compiled code links, covered by
#: ``engine_digest`` like the engine's own: the traces layer's compiled prefix ids (docs/design.md
#: section 1; ``envs._window_columns`` calls them)
LINKED_SOURCES = (Path(__file__).parent.parent / "traces" / "prefix.py",)


def engine_digest(extra_sources=()) -> str:
    """SHA-256 of every engine source file and ``LINKED_SOURCES`` (what compiled engine code depends
    on), plus ``extra_sources``."""
    h = hashlib.sha256()
    for f in [*sorted(Path(__file__).parent.glob("*.py")), *LINKED_SOURCES, *map(Path, extra_sources)]:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def guard_stale_cache(dispatchers=None, tag: str = "engine", extra_sources=()) -> None:
    """Flush the on-disk compiled code of ``dispatchers`` (default: every function of the engine's
    own modules registered so far) when the engine sources (``engine_digest``, or ``extra_sources``,
    other files they link) changed since it was written; numba then recompiles on first use. The
    stamp lives in the first dispatcher's cache directory: the default leaves out the functions of
    modules outside ``engine/`` (``traces.prefix``, ``policies``: each has a guard of its own), so
    that the stamp is the engine's whichever module was imported first."""
    disp = [d for d in (_REGISTRY if dispatchers is None else dispatchers) if hasattr(d, "_cache")]
    if dispatchers is None:
        pkg = __name__.rsplit(".", 1)[0] + "."
        disp = [d for d in disp if d.py_func.__module__.startswith(pkg)]
    GUARDED.update(id(d) for d in disp)
    if not disp:
        return
    try:
        stamp = Path(disp[0]._cache.cache_path) / f"tokenbatch.{tag}.sha256"
        digest = engine_digest(extra_sources)
        if stamp.exists() and stamp.read_text() == digest:
            return
        for d in disp:
            d._cache.flush()
        from .._io import write_text_atomic
        write_text_atomic(stamp, digest)
    except (OSError, AttributeError):  # pragma: no cover - read-only cache dir: numba recompiles anyway
        pass


# ------------------------------------------------------------------ the first-run compile notice
_NOTICE_LOCK = threading.Lock()
_NOTICE_SHOWN = False


def cached(d) -> bool:
    """Whether running dispatcher ``d`` needs no compile: it has machine code in this process, or
    numba's on-disk cache holds some for its current source on this machine (its index file lists an
    overload whose machine and bytecode key match; the signature about to be used is not known before
    the arguments are, so any counts), or it is not compiled at all (numba missing or disabled). Reads
    one index file: cheap. True when the cache cannot be read (no notice for a guess)."""
    cache = getattr(d, "_cache", None)
    if cache is None or getattr(cache, "tokenbatch_warm", False) or getattr(d, "overloads", None):
        return True   # (interpreted; found before; or machine code in this process)
    try:
        index = cache._cache_file._load_index()   # ({} when absent, stale or of another numba)
        try:
            key = cache._index_key(None, d.targetctx.codegen())
            warm = any(k[1:] == key[1:] for k in index)
        except Exception:  # noqa: BLE001  # pragma: no cover - another numba's key
            warm = bool(index)
    except Exception:  # noqa: BLE001  # pragma: no cover - unreadable cache (or another numba): say nothing
        warm = True
    if warm:   # (not read again in this process)
        cache.tokenbatch_warm = True
    return warm


def notice_if_cold(parts, file=None) -> bool:
    """Print one line to ``file`` (stderr) when any of ``parts`` -- (what, dispatchers, seconds) -- is
    about to be compiled (``cached``): what is compiled, once, and about how long it takes (the
    cold parts' seconds summed). At most once per process; returns whether it printed."""
    global _NOTICE_SHOWN
    if _NOTICE_SHOWN:
        return False
    with _NOTICE_LOCK:
        if _NOTICE_SHOWN:
            return False
        cold = [(what, secs) for what, disp, secs in parts if not all(cached(d) for d in disp)]
        if not cold:
            return False
        _NOTICE_SHOWN = True
    secs = sum(s for _, s in cold)
    took = f"{round(secs / 60)} min" if secs >= 60 else f"{int(round(secs, -1))} s"
    print(f"tokenbatch: compiling {' and '.join(w for w, _ in cold)} with numba, once (about {took}, longer on "
          f"a busy machine); later runs load it from the cache", file=file if file is not None else sys.stderr,
          flush=True)
    return True
