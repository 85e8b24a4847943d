"""Drive the kernel over N traces at once and collect per-request outcomes.

``simulate(traces, profile, policy="fcfs")`` is the one entry point used by the CLI, the evaluator,
the envs and tuning. Every policy runs in the kernel: vLLM's FCFS and priority orders, or an
in-engine score (``EnginePolicy``, docs/design.md sections 3 and 4).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from . import compile_notice
from . import kernel as K
from .outcomes import request_metrics
from .profiles import Profile, load_profile
from .scoring import N_THETA, P_EXTERNAL
from .state import NEVER, EngineConfig, build_arrays, copies_of, make_cfg_rows

_POOL_PREFIX = "tokenbatch-engine"   # the engine threads' names (``EngineRun.map_groups``)

BUILTIN_MODES = {"fcfs": K.MODE_FCFS, "priority": K.MODE_PRIORITY}


@dataclasses.dataclass(frozen=True, eq=False)
class EnginePolicy:
    """How the engine orders requests: vLLM's FCFS or priority order (``mode``), or an in-engine
    score (``mode=MODE_SCORE`` and ``pid`` from ``engine.scoring``) with parameters ``theta``
    ([NP] shared, or [C, NP] one row per copy). ``shed_margin`` (None, a number, or one per copy;
    negative or None = off) applies the common shed rule in any mode."""

    name: str
    mode: int
    pid: int = 0
    theta: Optional[np.ndarray] = None
    shed_margin: Union[None, float, np.ndarray] = None


class _Copies:
    """The copies' settings: ``traces``, ``profiles`` and ``configs``, one per copy."""

    @property
    def n_copies(self) -> int:
        return len(self.traces)

    @property
    def profile(self) -> Profile:
        """The copies' profile (resolved), when they share one."""
        return _shared(self.profiles, "profile")

    @property
    def config(self) -> EngineConfig:
        """The copies' engine config, when they share one."""
        return _shared(self.configs, "engine config")


@dataclasses.dataclass
class SimResult(_Copies):
    """Per-request outcomes, [C, R] arrays (padding beyond ``n_req[c]`` is meaningless)."""

    traces: Sequence[Trace]
    profiles: Sequence[Profile]       # per copy, resolved
    configs: Sequence[EngineConfig]   # per copy
    policy: str
    arrays: K.EngineArrays

    def records(self, copy: int = 0) -> dict:
        """One copy's request records as columns (docs/design.md section 3, "Outcomes")."""
        return record_columns(self.arrays, self.traces[copy], copy, 0, len(self.traces[copy]))

    def iterations(self, copy: int = 0) -> dict:
        m = int(self.arrays.n_iter_rec[copy]) if self.configs[copy].record_iterations else 0
        block = self.arrays.iter_rec[copy, :m]
        return {name: block[:, i].copy() for i, name in enumerate(K.ITER_COLUMNS)}

    @property
    def truncated(self) -> np.ndarray:
        return self.arrays.n_ended < self.arrays.n_req


class _SloRows:
    """The SLO columns of some request rows, all that ``request_metrics`` reads (None: no SLOs)."""

    def __init__(self, ttft_slo_ns, tpot_slo_ns):
        self.has_slos = ttft_slo_ns is not None
        self.ttft_slo_ns, self.tpot_slo_ns = ttft_slo_ns, tpot_slo_ns

    @classmethod
    def of(cls, trace: Trace, lo: int, hi: int) -> "_SloRows":
        """Rows [lo, hi) of a trace."""
        return cls(trace.ttft_slo_ns[lo:hi], trace.tpot_slo_ns[lo:hi]) if trace.has_slos else cls(None, None)


def record_columns(A: K.EngineArrays, trace: Trace, copy: int, lo: int, hi: int) -> dict:
    """Request records of rows [lo, hi) of one copy: the one implementation behind
    ``SimResult.records`` and the streaming ``record_sink``."""
    return _record_columns(A, copy, lo, hi, _SloRows.of(trace, lo, hi))


def record_rows(A: K.EngineArrays, copies: np.ndarray, lo: int, hi: int, ttft_slo_ns, tpot_slo_ns) -> dict:
    """``record_columns`` of rows [lo, hi) of several copies at once, as [copies, hi - lo] columns;
    the SLOs of those rows are given ([copies, hi - lo])."""
    return _record_columns(A, np.asarray(copies, np.int64), lo, hi, _SloRows(ttft_slo_ns, tpot_slo_ns))


def _record_columns(A: K.EngineArrays, copy, lo: int, hi: int, slos) -> dict:
    request = np.arange(lo, hi)
    rec = request_columns(A, lambda a: np.asarray(a[copy, lo:hi]).copy(),
                          request if np.ndim(copy) == 0 else np.tile(request, (len(copy), 1)))
    rec.update(request_metrics(rec, slos))
    return rec


def request_columns(A: K.EngineArrays, col: Callable, request: np.ndarray) -> dict:
    """The request records' engine columns (docs/design.md section 3, "Outcomes"), ``col(array)``
    taking each one's rows out of the struct of arrays (a copy); ``request`` their ids. Without the
    SLO outcome columns (``outcomes.request_metrics``)."""
    return {
        "request": request,
        "arrival_ns": col(A.arrival), "prompt_tokens": col(A.prompt),
        "output_tokens": col(A.out_len), "first_scheduled_ns": col(A.first_sched),
        "first_token_ns": col(A.first_token), "first_token_iteration": col(A.first_token_it),
        "finish_ns": col(A.finish), "finish_iteration": col(A.finish_it),
        "preemptions": col(A.n_preempt), "recomputed_tokens": col(A.recomputed),
        "swapped_blocks": col(A.swapped),
        "end_state": col(A.end_state).astype(np.int64),
    }


def _resolve_policy(policy) -> EnginePolicy:
    if isinstance(policy, EnginePolicy):
        if policy.mode == K.MODE_SCORE and policy.pid == P_EXTERNAL:
            raise ConfigError(f"engine policy {policy.name!r}: MODE_SCORE needs an in-engine score id "
                              f"(engine.scoring.POLICY_IDS), got {policy.pid}")
        return policy
    if isinstance(policy, str) and policy in BUILTIN_MODES:
        return EnginePolicy(policy, BUILTIN_MODES[policy])
    raise ConfigError(f"unknown engine policy {policy!r}; valid: {sorted(BUILTIN_MODES)} or an "
                      f"EnginePolicy (see tokenbatch_env.policies)")


def _shared(values: Sequence, what: str):
    """The one value every copy shares (a batch of per-copy settings has none: use the list)."""
    first = values[0]
    if any(v is not first and v != first for v in values[1:]):
        raise ConfigError(f"the copies have different {what}s: use the per-copy list ({what.split()[-1]}s[c])")
    return first


def resolve_copies(profile, config, C: int) -> tuple:
    """Per-copy (configs, profiles): each copy's profile with its config's overrides applied
    (``EngineConfig.resolve``), resolved once per distinct pair."""
    configs = copies_of(EngineConfig() if config is None else config, C, EngineConfig, "engine config")
    if isinstance(profile, (list, tuple)):
        if len(profile) != C:
            raise ConfigError(f"profile: expected one profile or one per copy ({C}), got {len(profile)}")
        names = {p: load_profile(p) for p in profile if isinstance(p, str)}
        bases = [names[p] if isinstance(p, str) else p for p in profile]
    else:
        bases = [load_profile(profile) if isinstance(profile, str) else profile] * C
    done: dict = {}
    profiles = []
    for p, e in zip(bases, configs):
        key = (id(p), id(e))
        if key not in done:
            done[key] = e.resolve(p)
        profiles.append(done[key])
    return tuple(configs), tuple(profiles)


def _per_copy(value, C: int, what: str, width: Optional[int] = None) -> np.ndarray:
    a = np.asarray(value, np.float64)
    shape = (C,) if width is None else (C, width)
    if a.shape == shape:
        return np.ascontiguousarray(a)
    if a.shape == shape[1:]:
        return np.ascontiguousarray(np.broadcast_to(a, shape))
    raise ConfigError(f"{what}: expected shape {shape[1:]} or {shape}, got {a.shape}")


class EngineRun(_Copies):
    """N engine copies (one trace each) advanced in pieces: the one driver behind ``simulate``, the
    Gymnasium envs and controlled replays (decision epochs) and tuning. ``advance`` stops each copy
    at the first iteration boundary at or after ``until_ns``; ``advance_to_decision`` at its next
    decision epoch (``start_epochs``); ``set_policy_params`` changes per-copy parameters between."""

    def __init__(self, traces: Union[Trace, Sequence[Trace]],
                 profile: Union[str, Profile, Sequence[Union[str, Profile]]] = "stress-512",
                 policy: Union[str, EnginePolicy] = "fcfs",
                 config: Union[None, EngineConfig, Sequence[EngineConfig]] = None,
                 *, estimates: Optional[Sequence[np.ndarray]] = None,
                 residual_life: Optional[np.ndarray] = None,
                 iteration_sink: Optional[Callable[[int, dict], None]] = None,
                 record_sink: Optional[Callable[[int, dict], None]] = None, record_chunk: int = 65_536,
                 threads: int = 1, with_kv: Optional[Sequence[np.ndarray]] = None,
                 kv_src: Optional[Sequence[np.ndarray]] = None, kv_link=None):
        """``iteration_sink(copy, columns)`` receives per-iteration records in chunks of at most
        ``config.record_iterations`` rows; ``record_sink(copy, columns)`` receives each copy's final
        request records in request order, at most ``record_chunk`` rows a call (the columns of
        ``SimResult.records``), the rest when ``result()`` marks them ``unfinished``: files of any
        length are written with bounded buffers.

        ``threads``: each kernel call runs on this many threads at once, which share out the active
        copies as they go, a chunk of consecutive copies at a time (``kernel.next_copy``: no thread
        idles while another has copies left; the compiled kernel releases the GIL; copies are
        independent rows, so results are identical for any value). With an iteration or record
        sink it runs on one.

        ``profile`` and ``config``: the batch's, or one per copy (docs/design.md section 11: each copy
        its own budget, threshold, max_num_seqs, KV pool, async setting or GPU; one block size per
        batch). ``profiles[c]`` and ``configs[c]`` are copy c's (resolved); ``profile`` and
        ``config`` the batch's when all copies share one.

        ``with_kv[c]`` (one bool array per trace): requests that arrive with their prompt's KV cache and
        first token, computed elsewhere (engine rule 13, docs/design.md section 13: a decode replica's
        view of a prefill/decode handoff); ``kv_src[c]`` the link each one's KV comes over (int per
        request, default 0) and ``kv_link`` the links' ``KVLink`` (or a preset's name; default none:
        the KV is there at admission): its transfer starts at admission once its link is free."""
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or int(threads) < 1:
            raise ConfigError(f"threads: must be an integer >= 1, got {threads!r}")
        self.threads = int(threads)
        self._pool = None
        if isinstance(traces, Trace):
            traces = [traces]
        self.traces = list(traces)
        C = len(self.traces)
        self.configs, self.profiles = resolve_copies(profile, config, C)
        self.policy = _resolve_policy(policy)
        compile_notice()   # (one line, once, if numba is about to compile the kernel: a run would look hung)
        self.arrays = A = build_arrays(self.traces, self.profiles, self.configs, estimates, with_kv=with_kv,
                                       kv_src=kv_src)
        if iteration_sink is not None and self.configs[0].record_iterations < 1:
            raise ConfigError("an iteration sink needs record_iterations >= 1 (the buffer size)")
        self.iteration_sink = iteration_sink
        if record_sink is not None and int(record_chunk) < 1:
            raise ConfigError(f"record_chunk must be >= 1, got {record_chunk}")
        self.record_sink, self.record_chunk = record_sink, int(record_chunk)
        self.cfg, self.fcfg = make_cfg_rows(self.profiles, self.configs, self.policy.mode, self.policy.pid,
                                            stream_records=iteration_sink is not None)
        if kv_link is not None:
            from .kv_link import resolve_kv_link
            link = resolve_kv_link(kv_link)
            for c, prof in enumerate(self.profiles):
                self.cfg[c, K.C_XFER_PS_PER_TOKEN] = link.ps_per_token(prof.kv_bytes_per_token)
                self.cfg[c, K.C_XFER_LAT_NS] = link.latency_ns
        self._cfg_decide = self.cfg.copy()
        self._cfg_decide[:, K.C_DECIDE] = 1
        R = A.arrival.shape[1]
        self.theta = np.zeros((C, N_THETA))
        self.shed_margin = np.full(C, -1.0)
        self.set_policy_params(self.policy.theta, self.policy.shed_margin)
        mrl = np.ones(1) if residual_life is None else np.ascontiguousarray(residual_life, np.float64)
        if mrl.ndim != 1 or mrl.size == 0 or not np.isfinite(mrl).all():
            raise ConfigError("residual_life must be a non-empty 1-D table of finite values")
        self.mrl = mrl
        self.tier = np.zeros((C, R), np.int8)
        self.score = np.zeros((C, R), np.float64)
        self._rec_emitted = np.zeros(C, np.int64)  # per copy: requests [0, n) handed to record_sink

    def set_policy_params(self, theta=None, shed_margin=None) -> None:
        """Per-copy policy parameters ([NP] or [C, NP]; shed margin scalar or [C], None/inf/<0 = off)."""
        C = self.n_copies
        if theta is not None:
            self.theta[:] = _per_copy(theta, C, "policy theta", N_THETA)
        if shed_margin is not None or theta is None:
            m = _per_copy(-1.0 if shed_margin is None else shed_margin, C, "shed_margin")
            self.shed_margin[:] = np.where(np.isfinite(m), m, -1.0)

    def set_guard(self, rows, u, bmin) -> None:
        """The tpot-guard rule's u and B_min of copies ``rows`` (a mask or indices; scalars or one per
        row), for runs built with the rule on (docs/design.md section 11)."""
        self.fcfg[rows, K.F_GUARD_U] = u
        self.fcfg[rows, K.F_GUARD_BMIN] = bmin

    @property
    def done(self) -> np.ndarray:
        A = self.arrays
        return (A.n_ended >= A.n_req) | (A.it >= self.cfg[:, K.C_MAX_ITERS])

    def advance(self, until_ns=None, active=None, *, chunk_steps: int = 20_000, bar=None) -> int:
        """Run the ``active`` copies until each has ended or reached ``until_ns`` (scalar or [C]).
        Returns the number of iterations run."""
        A, C = self.arrays, self.n_copies
        # (a writable copy: a read-only [C] view would compile a second kernel, ~2 min)
        until = np.full(C, NEVER, np.int64) if until_ns is None else \
            np.broadcast_to(np.asarray(until_ns, np.int64), (C,)).copy()
        base = np.ones(C, bool) if active is None else np.asarray(active, bool)
        total = 0
        while True:
            act = base & ~self.done & (A.now < until)
            if not act.any():
                return total
            total += self._run(self.cfg, act, until, chunk_steps, bar)

    def start_epochs(self, rows=None, *, interval_ns: int, scored=None, shed_on: bool) -> None:
        """Start decision epochs (docs/design.md section 5) for copies ``rows`` (default all) at their
        current clock: one every ``interval_ns``. ``scored`` = (lo, hi), scalars or one per row
        (default: every request), the requests whose end terminates the episode; ``shed_on``: the
        decision rule counts sheddable requests (the episode has a shed margin)."""
        A = self.arrays
        rows = np.arange(self.n_copies) if rows is None else np.asarray(rows, np.int64)
        if int(interval_ns) < 1:
            raise ConfigError(f"interval_ns must be >= 1, got {interval_ns}")
        lo, hi = (0, A.n_req[rows]) if scored is None else scored
        lo = np.broadcast_to(np.asarray(lo, np.int64), rows.shape)
        hi = np.broadcast_to(np.asarray(hi, np.int64), rows.shape)
        if ((lo < 0) | (lo > hi) | (hi > A.n_req[rows])).any():
            raise ConfigError(f"scored range must satisfy 0 <= lo <= hi <= requests, got {scored}")
        ep = A.epoch
        ep[rows, K.EP_T0] = A.now[rows]
        ep[rows, K.EP_DT] = int(interval_ns)
        ep[rows, K.EP_S0] = lo
        ep[rows, K.EP_S1] = hi
        ep[rows, K.EP_OPEN] = lo
        ep[rows, K.EP_SHED] = int(bool(shed_on))
        ep[rows, K.EP_STOP] = K.STOP_NONE

    def advance_to_decision(self, active=None, *, chunk_steps: int = 20_000,
                            meanwhile: Optional[Callable[[], None]] = None,
                            kernel: Optional[Callable] = None) -> np.ndarray:
        """Run each ``active`` copy (default all) to its next decision: the first iteration boundary
        at or after a decision epoch where a decision is needed or every scored request has ended,
        or the end of all its requests, or its iteration cap; epochs in between are skipped with the
        parameters held. Returns each copy's stop reason (``K.STOP_*``; STOP_NONE if not active).
        ``meanwhile()``, if given, runs once in an engine thread before it joins the first kernel
        call (``map_groups``): for work on rows not ``active``, such as laying out new episodes.
        ``kernel``, if given, replaces ``K.run_copies`` (same signature and result; each engine
        thread's call gets the shared ``claim`` counter and its own ``mine`` mask): for a caller that
        runs the compiled kernel itself (``K.kernel_args``), e.g. with per-copy work on each batch of
        copies right after advancing them (the env's observations and rewards)."""
        A, C = self.arrays, self.n_copies
        act = np.ones(C, bool) if active is None else np.array(active, bool)
        if (A.epoch[act, K.EP_DT] < 1).any():
            raise ConfigError("advance_to_decision: call start_epochs for these copies first")
        A.epoch[:, K.EP_STOP] = K.STOP_NONE
        while act.any():
            self._run(self._cfg_decide, act, A.now, chunk_steps, None, meanwhile, kernel)  # (until_ns unused)
            meanwhile = None
            act &= A.epoch[:, K.EP_STOP] == K.STOP_NONE
        if meanwhile is not None:
            meanwhile()
        return A.epoch[:, K.EP_STOP].copy()

    def _run(self, cfg, act, until, chunk_steps, bar, meanwhile=None, kernel=None) -> int:
        """One kernel call (``K.run_copies``, or ``kernel``) over the ``act`` copies (on each engine
        thread, sharing them out), then the sinks and the no-progress check; ``meanwhile`` in one of
        the threads before its call."""
        A = self.arrays
        before = int(A.n_ended.sum())
        snap = (A.now.copy(), A.it.copy(), A.n_ended.copy(), A.n_wait.copy(), A.n_run.copy())

        claim = np.zeros(1, np.int64)   # the threads share out the copies of ``act`` as they go

        run_copies = K.run_copies if kernel is None else kernel

        def run(g):
            return run_copies(A, cfg, self.fcfg, self.theta, self.shed_margin, self.mrl, self.tier, self.score, g,
                              chunk_steps, until, claim=claim, mine=np.zeros_like(g))
        if self.iteration_sink is None and self.record_sink is None:
            total = sum(self.map_groups(run, act, split=False, meanwhile=meanwhile))
        else:   # the sinks see the buffers of one call
            if meanwhile is not None:
                meanwhile()
            total = run(act)
        if self.iteration_sink is not None:
            self.flush_iterations()
        if self.record_sink is not None:
            self.flush_records()
        stuck = act & (A.now == snap[0]) & (A.it == snap[1]) & (A.n_ended == snap[2]) \
            & (A.n_wait == snap[3]) & (A.n_run == snap[4])
        if cfg[0, K.C_DECIDE]:
            stuck &= A.epoch[:, K.EP_STOP] == K.STOP_NONE
        if stuck.any():  # a safety net: the engine must never spin without progress
            raise RuntimeError(f"engine made no progress on copies {np.flatnonzero(stuck)[:10].tolist()} "
                               f"at t={A.now[stuck][:3].tolist()} ns; please report this trace")
        if bar is not None:
            bar.update(int(A.n_ended.sum()) - before)
        return total

    def map_groups(self, fn: Callable[[np.ndarray], object], act: np.ndarray, min_group: int = 1,
                   split: bool = True, meanwhile: Optional[Callable[[], None]] = None) -> list:
        """``[fn(g) for g in groups]`` run concurrently, where the groups split the copies of the mask
        ``act`` into at most ``threads`` contiguous disjoint masks of about equal size, at least
        ``min_group`` copies each (one group, ``act`` itself, when that leaves one). For functions
        that touch only the rows of their group and release the GIL (the compiled kernels): the
        calling thread runs the first group, a pool made on first use the others; all have
        finished when this returns, and the first group (in copy order) that raised raises.
        ``split=False``: every call gets ``act`` itself (for the kernel, whose concurrent calls share
        the copies out among themselves as they go: no thread idles while another has copies left).
        ``meanwhile()``: run first by the pool thread of the second group (or inline, before a single
        group); with ``split=False`` the others have claimed its share of the copies by the time
        it joins. Called from a pool thread (nested), this runs inline: never waits on its own pool."""
        act = np.asarray(act, bool)
        n_groups = 1
        if self.threads > 1 and not threading.current_thread().name.startswith(_POOL_PREFIX):
            n_active = int(np.count_nonzero(act))
            n_groups = min(self.threads, n_active // max(1, int(min_group)))
        if n_groups <= 1:
            if meanwhile is not None:
                meanwhile()
            return [fn(act)]
        groups = [act] * n_groups
        if split:
            for i, part in enumerate(np.array_split(np.flatnonzero(act), n_groups)):
                groups[i] = np.zeros_like(act)
                groups[i][part] = True
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=_POOL_PREFIX)

        def after_meanwhile(g):
            meanwhile()
            return fn(g)
        futures = [self._pool.submit(after_meanwhile if i == 0 and meanwhile is not None else fn, g)
                   for i, g in enumerate(groups[1:])]
        try:
            first = fn(groups[0])
        finally:
            errors = [f.exception() for f in futures]   # waits: no group outlives this call
        for e in errors:
            if e is not None:
                raise e
        return [first] + [f.result() for f in futures]

    def close(self) -> None:
        """Stop the worker threads (``threads > 1``); the run stays usable (they restart on demand)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __getstate__(self):   # the thread pool does not pickle (nor copy)
        state = self.__dict__.copy()
        state["_pool"] = None
        return state

    def flush_iterations(self) -> None:
        """Hand buffered per-iteration records to the sink and empty the buffers."""
        A = self.arrays
        for c in np.flatnonzero(A.n_iter_rec > 0):
            m = int(A.n_iter_rec[c])
            block = A.iter_rec[c, :m]
            self.iteration_sink(int(c), {name: block[:, i].copy() for i, name in enumerate(K.ITER_COLUMNS)})
            A.n_iter_rec[c] = 0

    def flush_records(self) -> None:
        """Hand the next final records to the record sink: per copy the contiguous prefix of ended
        requests, so rows stay in order. Under async scheduling a request that ended in the last
        iteration can still be preempted (counted) at the next schedule: not final until then."""
        A, e = self.arrays, self._rec_emitted
        C, R = A.end_state.shape
        if R == 0:
            return
        open_ = e < A.n_req
        head = A.end_state[np.arange(C), np.minimum(e, R - 1)]
        done = self.done
        for c in np.flatnonzero(open_ & (head != K.E_NONE)):  # cheap test: the next row has ended
            lo, n = int(e[c]), int(A.n_req[c])
            hi, w = lo, 1024
            while hi < n:  # the first open request at or after lo (windows: O(rows handed over))
                seg = A.end_state[c, hi:min(n, hi + w)] == K.E_NONE
                if seg.any():
                    hi += int(seg.argmax())
                    break
                hi += seg.size
                w *= 2
            if not done[c] and A.n_pend[c] > 0:
                hi = min(hi, int(A.pend_ids[c, :A.n_pend[c]].min()))
            for a in range(lo, hi, self.record_chunk):
                b = min(hi, a + self.record_chunk)
                self.record_sink(int(c), record_columns(A, self.traces[c], int(c), a, b))
                e[c] = b

    def result(self) -> SimResult:
        """Outcomes so far; requests still open at the iteration cap are marked ``unfinished``."""
        A = self.arrays
        R = A.arrival.shape[1]
        capped = (A.it >= self.cfg[:, K.C_MAX_ITERS])[:, None]
        unfinished = capped & (A.end_state == K.E_NONE) & (np.arange(R)[None, :] < A.n_req[:, None])
        A.end_state[unfinished] = K.E_UNFINISHED
        if self.record_sink is not None:
            self.flush_records()
        return SimResult(self.traces, self.profiles, self.configs, self.policy.name, A)


def simulate(traces: Union[Trace, Sequence[Trace]], profile: Union[str, Profile] = "stress-512",
             policy: Union[str, EnginePolicy] = "fcfs", config: Optional[EngineConfig] = None,
             *, estimates: Optional[Sequence[np.ndarray]] = None,
             residual_life: Optional[np.ndarray] = None, progress: bool = False,
             chunk_steps: int = 20_000,
             iteration_sink: Optional[Callable[[int, dict], None]] = None,
             record_sink: Optional[Callable[[int, dict], None]] = None,
             record_chunk: int = 65_536, with_kv: Optional[Sequence[np.ndarray]] = None,
             kv_src: Optional[Sequence[np.ndarray]] = None, kv_link=None) -> SimResult:
    """Replay each trace on its own engine copy, all copies stepped together, until every request
    has ended or the iteration cap is hit (unfinished requests are then ``unfinished``).

    ``estimates`` (one float array per trace) and ``residual_life`` (a mean-residual-life table,
    see ``tokenbatch_env.predictors``) feed the in-engine scores; requests without an estimate use
    the table (default: 1 token left). ``iteration_sink``/``record_sink`` stream records to the
    caller in bounded chunks (see ``EngineRun``); ``with_kv``, ``kv_src``, ``kv_link``: requests that
    arrive with their KV, over which link (engine rule 13, see ``EngineRun``)."""
    run = EngineRun(traces, profile, policy, config, estimates=estimates, residual_life=residual_life,
                    iteration_sink=iteration_sink, record_sink=record_sink, record_chunk=record_chunk,
                    with_kv=with_kv, kv_src=kv_src, kv_link=kv_link)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=int(run.arrays.n_req.sum()), unit="req", desc=f"simulate {run.policy.name}",
                   leave=False)
    try:
        run.advance(chunk_steps=chunk_steps, bar=bar)
    finally:
        if bar is not None:
            bar.close()
    return run.result()
