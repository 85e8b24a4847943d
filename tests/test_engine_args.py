"""The kernel's argument list, by name (docs/design.md section 3): ``kernel.kernel_args`` builds
``run_copies_kernel``'s ~80 positional arguments from ``KERNEL_ARGS``, reading the struct of arrays by
field name. Checked field by field against the kernel's own signature and ``EngineArrays``, and on
a built state: each position holds the very array its name says."""

from __future__ import annotations

import inspect

import numpy as np

from tokenbatch_env.engine import kernel as K
from tokenbatch_env.engine.simulate import EngineRun
from tokenbatch_env.engine.state import NEVER
from engine_helpers import tiny_trace


def _kernel_params() -> list:
    py = getattr(K.run_copies_kernel, "py_func", K.run_copies_kernel)   # (the Python function under numba's dispatcher)
    return list(inspect.signature(py).parameters)


def test_kernel_parameters_are_the_names_passed():
    """Position by position, the kernel's parameter names are ``KERNEL_ARGS``."""
    params, names = _kernel_params(), list(K.KERNEL_ARGS)
    assert len(params) == len(names), (len(params), len(names))
    for i, (p, n) in enumerate(zip(params, names)):
        assert p == n, f"kernel parameter {i} is {p!r}, kernel_args passes {n!r}"
    assert len(set(names)) == len(names)


def test_each_name_has_its_role():
    """The state part is fields of ``EngineArrays`` (all of them, each once); the call's arguments
    and the scratch are not fields, so no name can be read from the wrong place."""
    fields = K.EngineArrays._fields
    for n in K.KERNEL_STATE_ARGS:
        assert n in fields, f"kernel state argument {n!r} is not an EngineArrays field"
    assert sorted(K.KERNEL_STATE_ARGS) == sorted(fields), set(fields) ^ set(K.KERNEL_STATE_ARGS)
    for n in (*K.KERNEL_CALL_ARGS, *K.KERNEL_SCRATCH_ARGS):
        assert n not in fields, f"kernel argument {n!r} shadows an EngineArrays field"
    assert K.KERNEL_ARGS == K.KERNEL_CALL_ARGS + K.KERNEL_STATE_ARGS + K.KERNEL_SCRATCH_ARGS


def test_kernel_args_put_each_array_at_its_name():
    """On a built state, ``kernel_args`` puts ``getattr(A, name)`` itself (not a copy) at every
    state position, and each of the call's own arguments at its name's position."""
    trace = tiny_trace([0.0, 1.0, 2.0], [100, 200, 300], [5, 6, 7], t1_ms=500.0, t2_ms=50.0)
    run = EngineRun([trace], "stress-512", "fcfs")
    A = run.arrays
    C = A.arrival.shape[0]
    call = dict(cfg=run.cfg, fcfg=run.fcfg, theta=run.theta, shed_margin=run.shed_margin, mrl=run.mrl,
                tier=run.tier, score=run.score, active=np.ones(C, bool), max_steps=20_000,
                until_ns=np.full(C, NEVER, np.int64), claim=np.zeros(1, np.int64), mine=np.zeros(C, bool))
    args = K.kernel_args(A, call["cfg"], call["fcfg"], call["theta"], call["shed_margin"], call["mrl"],
                         call["tier"], call["score"], call["active"], call["max_steps"], call["until_ns"],
                         claim=call["claim"], mine=call["mine"])
    assert len(args) == len(K.KERNEL_ARGS)
    at = dict(zip(K.KERNEL_ARGS, args))
    for n in K.KERNEL_STATE_ARGS:
        assert at[n] is getattr(A, n), n
    for n, v in call.items():
        assert at[{"cfg": "cfg_rows", "fcfg": "fcfg_rows"}.get(n, n)] is v, n
    assert at["nan_score"].tolist() == [-1, -1]
    for n in K.KERNEL_SCRATCH_ARGS:
        assert isinstance(at[n], np.ndarray), n
    # and the kernel runs on them: every request of the copy ends
    assert K.checked_total(K.run_copies_kernel(*args), args) > 0
    assert int(A.n_ended[0]) == 3


def test_score_mode_needs_an_in_engine_score():
    """Scores come from the kernel only: an ``EnginePolicy`` in MODE_SCORE without an in-engine score
    id (``P_EXTERNAL``, FCFS's and priority's) is refused, naming the policy."""
    import pytest

    from tokenbatch_env.engine.scoring import P_EXTERNAL
    from tokenbatch_env.engine.simulate import EnginePolicy
    from tokenbatch_env.errors import ConfigError
    trace = tiny_trace([0.0], [100], [5])
    with pytest.raises(ConfigError, match="'mine'.*in-engine score id"):
        EngineRun([trace], "stress-512", EnginePolicy("mine", K.MODE_SCORE, P_EXTERNAL))
    EngineRun([trace], "stress-512", EnginePolicy("fcfs", K.MODE_FCFS, P_EXTERNAL))
