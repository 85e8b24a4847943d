"""Drive the kernel over N traces at once and collect per-request outcomes.

``simulate(traces, profile, policy="fcfs")`` is the one entry point used by the CLI, the evaluator,
the envs and tuning. Policies that need fresh scores every iteration pass a ``Scorer``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from . import kernel as K
from .outcomes import request_metrics
from .profiles import Profile, load_profile
from .state import NEVER, EngineConfig, build_arrays, make_cfg

BUILTIN_MODES = {"fcfs": K.MODE_FCFS, "priority": K.MODE_PRIORITY}


@dataclasses.dataclass
class Scorer:
    """A score policy: ``fn(arrays, now) -> (tier int8 [C,R], score float64 [C,R], shed bool [C,R])``.

    ``time_dependent=False`` lets the engine keep the scores for many iterations (they must then be
    valid for requests that have not arrived yet, e.g. EDF's deadlines).
    """

    fn: Callable
    time_dependent: bool = True
    name: str = "score"


@dataclasses.dataclass
class SimResult:
    """Per-request outcomes, [C, R] arrays (padding beyond ``n_req[c]`` is meaningless)."""

    traces: Sequence[Trace]
    profile: Profile
    config: EngineConfig
    policy: str
    arrays: K.EngineArrays

    @property
    def n_copies(self) -> int:
        return len(self.traces)

    def records(self, copy: int = 0) -> dict:
        """One copy's request records as columns (DESIGN.md section 3, "Outcomes")."""
        A, n, t = self.arrays, len(self.traces[copy]), self.traces[copy]
        col = lambda a: np.asarray(a[copy, :n]).copy()  # noqa: E731
        rec = {
            "request": np.arange(n), "arrival_ns": col(A.arrival), "prompt_tokens": col(A.prompt),
            "output_tokens": col(A.out_len), "first_scheduled_ns": col(A.first_sched),
            "first_token_ns": col(A.first_token), "first_token_iteration": col(A.first_token_it),
            "finish_ns": col(A.finish), "finish_iteration": col(A.finish_it),
            "preemptions": col(A.n_preempt), "recomputed_tokens": col(A.recomputed),
            "end_state": col(A.end_state).astype(np.int64),
        }
        rec.update(request_metrics(rec, t))
        return rec

    def iterations(self, copy: int = 0) -> dict:
        m = int(self.arrays.n_iter_rec[copy]) if self.config.record_iterations else 0
        block = self.arrays.iter_rec[copy, :m]
        return {name: block[:, i].copy() for i, name in enumerate(K.ITER_COLUMNS)}

    @property
    def truncated(self) -> np.ndarray:
        return self.arrays.n_ended < self.arrays.n_req


def _resolve_policy(policy) -> tuple[int, Optional[Scorer], str]:
    if isinstance(policy, Scorer):
        return K.MODE_SCORE, policy, policy.name
    if isinstance(policy, str) and policy in BUILTIN_MODES:
        return BUILTIN_MODES[policy], None, policy
    raise ConfigError(f"unknown engine policy {policy!r}; valid: {sorted(BUILTIN_MODES)} or a Scorer")


def simulate(traces: Union[Trace, Sequence[Trace]], profile: Union[str, Profile] = "stress-512",
             policy: Union[str, Scorer] = "fcfs", config: Optional[EngineConfig] = None,
             *, progress: bool = False, chunk_steps: int = 20_000) -> SimResult:
    """Replay each trace on its own engine copy, all copies stepped together, until every request
    has ended or the iteration cap is hit (unfinished requests are then ``unfinished``)."""
    if isinstance(traces, Trace):
        traces = [traces]
    traces = list(traces)
    config = config or EngineConfig()
    prof = config.resolve(load_profile(profile) if isinstance(profile, str) else profile)
    mode, scorer, name = _resolve_policy(policy)
    A = build_arrays(traces, prof, config)
    cfg = make_cfg(prof, config, mode)
    C, R = A.arrival.shape
    until = np.full(C, NEVER, np.int64)
    zeros_tier = np.zeros((C, R), np.int8)
    zeros_score = np.zeros((C, R), np.float64)
    no_shed = np.zeros((C, R), np.bool_)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=int(A.n_req.sum()), unit="req", desc=f"simulate {name}", leave=False)
    try:
        while True:
            active = (A.n_ended < A.n_req) & (A.it < config.max_iterations)
            if not active.any():
                break
            if scorer is not None:
                tier, score, shed = scorer.fn(A, A.now)
                steps = 1 if scorer.time_dependent else chunk_steps
            else:
                tier, score, shed, steps = zeros_tier, zeros_score, no_shed, chunk_steps
            before = int(A.n_ended.sum())
            K.run_copies(A, cfg, tier, score, shed, active, steps, until)
            if bar is not None:
                bar.update(int(A.n_ended.sum()) - before)
    finally:
        if bar is not None:
            bar.close()
    # requests left at the iteration cap end as unfinished (not met)
    unfinished = (A.end_state == K.E_NONE) & (np.arange(R)[None, :] < A.n_req[:, None])
    A.end_state[unfinished] = K.E_UNFINISHED
    return SimResult(traces, prof, config, name, A)
