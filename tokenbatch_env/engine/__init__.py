"""The batched continuous-batching engine: state, step, KV pool, cost model, profiles.

Importing this package imports nothing else (no numba): each module is imported when used.
"""

#: cold compile times, CPU seconds on this project's 2-core machine (``benchmarks/bench_startup.py
#: --cold``: 65-68 s and 29 s): the engine's kernel (a first ``tokenbatch simulate``) and the env's
#: step on top of it (a first ``gym.make("TokenBatch-v0")`` reset and step once the kernel is cached;
#: the env passes its part to ``compile_notice`` with this figure).
#: The compile runs on one core: a busy machine takes longer.
COMPILE_SECONDS = {"engine": 70.0, "env": 30.0}


def compile_notice(extra=(), file=None) -> bool:
    """Print one line to stderr (``file``) if numba is about to compile the engine -- its on-disk
    cache holds no kernel for these sources on this machine (a clean clone, an edited engine file, a
    fresh ``NUMBA_CACHE_DIR``) -- saying so and about how long it takes. ``extra``: more compiled
    code about to run on top of the engine, as ``(what, dispatchers, seconds)`` parts
    (``_jit.notice_if_cold``), named in the same line when cold: the Gymnasium env passes its step
    (``("the env's step", [advance_observe], COMPILE_SECONDS["env"])``), so that the engine
    never imports the layers above it (docs/design.md section 1). At most once per process; cheap
    when the cache is warm (one index file read per function, none once loaded). Called by the
    engine's entry points (``EngineRun``, ``tokenbatch simulate``, the env's core); a command calls
    it before starting a progress bar that would otherwise sit at 0 during the compile. Returns
    whether it printed."""
    from . import _jit
    from . import kernel as K

    parts = [("the engine", [K.run_copies_kernel], COMPILE_SECONDS["engine"]), *extra]
    return _jit.notice_if_cold(parts, file)
