"""Clusters routed from outside (docs/design.md section 12, "Routing env"): ``RoutingRun`` holds E
clusters of R replicas, each replaying its own trace, and lets a caller route every arrival; the
loop is ``routing_kernel.route_step``. Routed as a router would route (every action replaced by the
base router's choice), each cluster equals ``simulate_cluster`` of its trace record for record."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from . import cluster_kernel as CK
from . import kernel as K
from . import routing_kernel as RK
from .cluster import ROW_SLACK, ClusterResult, Router, cluster_table, replica_batch, resolve_router, router_params
from .profiles import Profile
from .simulate import EnginePolicy, resolve_copies
from .state import EngineConfig


def decision_arrays(run, E: int, N: int, R: int) -> None:
    """What a caller reads at each cluster's pending arrival (``RoutingRun``'s and ``PDRoutingRun``'s):
    ``pending``, ``route`` [E, N], ``view`` [E, R, N_VIEW], ``pred``, ``mask`` [E, R], ``done``,
    ``replaced`` and the scored span ``s0``, ``s1``."""
    run.pending = np.zeros(E, np.int64)
    run.route = np.full((E, N), -1, np.int64)
    run.view = np.zeros((E, R, CK.N_VIEW), np.int64)
    run.pred = np.zeros((E, R), np.int64)
    run.mask = np.zeros((E, R), np.bool_)
    run.done = np.zeros(E, np.bool_)
    run.replaced = np.zeros(E, np.int64)
    run.s0, run.s1 = np.zeros(E, np.int64), np.zeros(E, np.int64)


class RoutingRun:
    """E clusters of R replicas of ``profile`` (each running ``policy`` with ``config``), cluster e
    replaying ``traces[e]`` (``load`` puts another trace on a cluster); the caller routes each arrival
    (``step``). After construction and after every ``step`` each cluster not ``done`` waits at its
    pending arrival ``pending[e]`` with the router's view of its replicas (``view[e]``,
    [R, cluster_kernel.N_VIEW]; ``pred[e]``: least-predicted-ttft's prediction, ns) and ``mask[e]``
    (the replicas that serve the prompt and have room for it). ``base_router`` replaces masked
    actions (and routes when asked to: action -1). ``capacity``: the largest trace any cluster will
    hold, as ``routing_capacity`` of a list of traces (default: of ``traces``); each replica's rows
    are ``room`` x its even share of it plus slack (a replica whose rows are full is masked)."""

    def __init__(self, traces: Sequence[Trace], profile: Union[str, Profile] = "stress-512",
                 policy: Union[str, EnginePolicy] = "fcfs", config: Optional[EngineConfig] = None, *,
                 replicas: int = 2, base_router: Union[str, Router] = "round-robin",
                 estimates: Optional[Sequence[np.ndarray]] = None, residual_life: Optional[np.ndarray] = None,
                 room: float = 2.0, capacity: Optional[tuple] = None, scored: Optional[Sequence[tuple]] = None):
        if not traces or not all(isinstance(t, Trace) for t in traces):
            raise ConfigError("RoutingRun routes a non-empty list of Traces, one per cluster")
        if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
        if not room >= 1:
            raise ConfigError(f"room must be >= 1 (a multiple of the even share), got {room!r}")
        E, R = len(traces), int(replicas)
        self.router = resolve_router(base_router)
        self.replicas = R
        _, self._resolved = resolve_copies([profile] * R, config, R)
        cap = routing_capacity(traces, self._resolved) if capacity is None else tuple(capacity)
        N, chains, rooms, n_uniq, top_chain, top_room, n_mml = cap
        self.capacity = cap
        self.block_size = self._resolved[0].block_size
        self.usable_blocks = max(1, self._resolved[0].usable_blocks)   # (a replica's KV pool: the view's scale)
        sizes = [max(1, min(tot, int(room * -(-tot // R)) + top + ROW_SLACK)) for tot, top in (
            (N, 0), (chains, top_chain), (rooms, top_room))]
        probe = Trace.build(arrival_ns=np.zeros(max(1, N), np.int64), prompt_tokens=np.ones(max(1, N), np.int64),
                            output_tokens=np.ones(max(1, N), np.int64), block_size=self._resolved[0].block_size)
        run, mml_of, active, claim, until, kargs = replica_batch(
            probe, [profile] * (E * R), policy, [config or EngineConfig()] * (E * R), None, residual_life,
            None, (None,) * 11 + (n_uniq,), sizes)
        A = run.arrays
        self._fresh = {f: np.array(getattr(A, f)[0]) for f in A._fields}   # a copy with no rows, as built
        self.run, self.mml_of, self._active, self._claim, self._until, self._kargs = \
            run, mml_of, active, claim, until, kargs
        self.n_uniq = n_uniq
        N = max(1, N)
        self.g = (np.zeros((E, N), np.int64), np.zeros((E, N), np.int64), np.zeros((E, n_mml, N), np.int64),
                  np.zeros((E, n_mml, N), np.bool_), np.zeros((E, N), np.int64), np.zeros((E, N), np.int64),
                  np.zeros((E, N), np.int64), np.full((E, N), np.nan), np.zeros((E, N + 1), np.int64),
                  np.zeros((E, max(1, chains)), np.int64), np.zeros((E, N), np.int64))
        self.u_next = np.full(E * R, n_uniq, np.int64)
        self.keys = np.zeros((E, 2), np.int64)
        self.rpar = router_params(self.router)
        self.rstate = np.zeros((E, 1), np.int64)
        decision_arrays(self, E, N, R)
        self.n_of = np.zeros(E, np.int64)
        self.row = np.full((E, N), -1, np.int64)
        self.cursor = np.zeros(E, np.int64)
        self.credited = np.zeros((E, N), np.bool_)
        self.traces: list = [None] * E
        self.n_iterations = 0
        for e, t in enumerate(traces):
            self.load(e, t, None if estimates is None else estimates[e], None if scored is None else scored[e])

    def load(self, e: int, trace: Trace, estimates: Optional[np.ndarray] = None,
             scored: Optional[tuple] = None) -> None:
        """Put ``trace`` on cluster e, its replicas as new, and run it to its first decision;
        ``scored``: the (start, stop) of its requests ``credit`` counts (default all). A trace beyond
        the run's ``capacity``: ``ConfigError``."""
        R, lo = self.replicas, e * self.replicas
        trace, key, _, table, _, _ = cluster_table(trace, self._resolved, estimates, R)
        n = len(trace)
        g_arrival, g_prompt, g_out, g_capped, g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, n_uniq = table
        if n > self.route.shape[1] or len(g_cval) > self.g[9].shape[1] or n_uniq > self.n_uniq \
                or g_out.shape[0] != self.g[2].shape[1]:
            raise ConfigError(f"cluster {e}: a trace of {n} requests beyond the run's capacity {self.capacity}")
        A = self.run.arrays
        for f in A._fields:
            getattr(A, f)[lo:lo + R] = self._fresh[f]
        A.now[lo:lo + R] = trace.arrival_ns[0] if n else 0
        self.u_next[lo:lo + R] = self.n_uniq
        g = self.g
        for dst, src in ((g[0], g_arrival), (g[1], g_prompt), (g[4], g_prio), (g[5], g_t1), (g[6], g_t2),
                         (g[7], g_est), (g[10], g_room)):
            dst[e, :n] = src
        g[2][e, :, :n], g[3][e, :, :n] = g_out, g_capped
        g[8][e, :n + 1] = g_coff
        g[8][e, n + 1:] = g_coff[-1]
        g[9][e, :len(g_cval)] = g_cval
        self.traces[e] = trace
        self.keys[e] = key
        self.rstate[e] = 0
        self.pending[e] = 0
        self.n_of[e] = n
        self.route[e] = -1
        self.row[e] = -1
        self.done[e] = False
        self.replaced[e] = 0
        self.s0[e], self.s1[e] = (0, n) if scored is None else scored
        self.cursor[e] = 0
        self.credited[e] = False
        run = self.run
        self._check(RK.next_decision(e, R, self.pending, self.n_of, self.route, self.row,
                                     self.view, self.pred, self.mask, self.done, g[0], g[1], g[8], g[9], g[10],
                                     self.u_next, run.cfg, A.n_req, A.arrival, A.chain_off, A.chain_val, A.now,
                                     A.it, A.next_arr, A.n_ended, A.n_run, A.n_wait, A.n_swap, A.n_pend, A.n_free,
                                     A.epoch, A.status, A.prompt, A.gen, A.computed, A.run_ids, A.wait_ids,
                                     A.pend_ids, A.table, A.slot_of, A.held, A.ref, A.hold_kv, A.hash_head,
                                     self._active, self._claim, self._until, self._kargs))

    def credit(self, clusters=None) -> np.ndarray:
        """Per cluster (all, or those of ``clusters``): its scored requests met that ended since the
        last call (a request rejected at the router, or ended unmet, counts 0)."""
        A = self.run.arrays
        E = self.done.shape[0]
        out = np.zeros(E, np.int64)
        which = np.arange(E, dtype=np.int64) if clusters is None else np.asarray(clusters, np.int64)
        RK.credit_many(which, out, self.replicas, self.s0, self.s1, self.cursor, self.credited, self.pending,
                       self.route, self.row, A.end_state, A.first_token, A.arrival, A.finish, A.out_len, A.t1, A.t2)
        return out

    def _check(self, total: int) -> None:
        if total == -2:
            raise RuntimeError("a cluster replica made no progress; please report this trace")
        if total == -3:
            raise RuntimeError("a replica's rows were full although masked; please report this trace")
        self.n_iterations += K.checked_total(total, self._kargs)

    def step(self, actions, acting=None) -> None:
        """Route each acting cluster's pending arrival to replica ``actions[e]`` (-1 or a masked
        replica: the base router's choice, counted in ``replaced``) and run it to its next decision
        (or, after its last arrival, to the end)."""
        E, R = self.done.shape[0], self.replicas
        actions = np.asarray(actions, np.int64)
        if actions.shape != (E,):
            raise ConfigError(f"actions: expected shape ({E},), got {actions.shape}")
        acting = np.ones(E, np.bool_) if acting is None else np.asarray(acting, np.bool_)
        A, g = self.run.arrays, self.g
        self._check(RK.route_step(
            R, self.router.spec.rid, self.rpar, self.keys, acting, actions, self.replaced, self.rstate, self.pending,
            self.n_of, self.route, self.row, self.view, self.pred, self.mask, self.done, g[0], g[1], g[2], g[3],
            self.mml_of, g[4], g[5], g[6], g[7], g[8], g[9], g[10], self.u_next, self.run.cfg, A.n_req, A.arrival,
            A.prompt, A.out_len, A.prio, A.capped, A.t1, A.t2, A.est, A.chain_off, A.chain_val, A.uniq_base, A.now,
            A.it, A.next_arr, A.n_ended, A.n_run, A.n_wait, A.n_swap, A.n_pend, A.n_free, A.status, A.gen,
            A.computed, A.run_ids, A.wait_ids, A.pend_ids, A.table, A.slot_of, A.held, A.ref, A.hold_kv,
            A.hash_head, A.epoch, self._active, self._claim, self._until, self._kargs))

    def result(self, e: int) -> ClusterResult:
        """Cluster e as ``simulate_cluster`` returns a replay (its ``records`` and ``replica_stats``)."""
        return self._result(e, self.run.result())

    def results(self) -> list:
        """Every cluster's ``result``, from one pass over the engine's state."""
        res = self.run.result()
        return [self._result(e, res) for e in range(self.done.shape[0])]

    def _result(self, e: int, res) -> ClusterResult:
        R, n = self.replicas, int(self.n_of[e])
        A = self.run.arrays
        engine = dataclasses.replace(res, traces=res.traces[e * R:(e + 1) * R],
                                     profiles=res.profiles[e * R:(e + 1) * R], configs=res.configs[e * R:(e + 1) * R],
                                     arrays=A._replace(**{f: getattr(A, f)[e * R:(e + 1) * R] for f in A._fields}))
        return ClusterResult(self.traces[e], self.run.profiles[e * R:(e + 1) * R], self.run.configs[e * R:(e + 1) * R],
                             self.run.policy.name, self.router, self.route[e, :n].copy(), self.row[e, :n].copy(),
                             engine, -1)


class PDRoutingRun:
    """E prefill/decode clusters (docs/design.md section 13) whose arrivals a caller routes to the
    prefill pool, one at a time: ``RoutingRun``'s interface (``pending``, ``view``, ``pred``, ``mask``,
    ``done``, ``replaced``, ``step``, ``credit``, ``load``, ``result``; ``replicas`` is the prefill
    pool's Rp, the action a prefill replica). Each cluster is its own ``disagg.PDState``, run by
    ``disagg_kernel.run_pd_kernel`` with external routing, which stops at every arrival a prefill
    replica serves; handoffs go to D by ``decode_router``. Each replica's rows hold the whole trace (no
    mask for room). Routed as the base router routes (every action -1), each cluster equals
    ``simulate_pd`` of its trace, record for record. ``credit`` counts a cluster's scored requests met
    once, when it is done (a handed-off request's outcome is known only on D)."""

    def __init__(self, traces: Sequence[Trace], profile: Union[str, Profile] = "stress-512",
                 policy: Union[str, EnginePolicy] = "fcfs", config: Optional[EngineConfig] = None, *,
                 prefill_replicas: int = 1, decode_replicas: int = 1, base_router: Union[str, Router] = "round-robin",
                 decode_router: Union[str, Router] = "least-kv", kv_link="nvlink", first_token_at: str = "prefill",
                 estimates: Optional[Sequence[np.ndarray]] = None, residual_life: Optional[np.ndarray] = None,
                 scored: Optional[Sequence[tuple]] = None):
        from .disagg import check_first_token_at, pd_pools
        from .kv_link import resolve_kv_link
        if not traces or not all(isinstance(t, Trace) for t in traces):
            raise ConfigError("PDRoutingRun routes a non-empty list of Traces, one per cluster")
        E = len(traces)
        Rp, Rd, self.configs, self._resolved = pd_pools(profile, config, prefill_replicas, decode_replicas)
        self.replicas, self.decode_replicas = Rp, Rd
        self.router, self.decode_router = resolve_router(base_router), resolve_router(decode_router)
        self.kv_link = resolve_kv_link(kv_link)
        self.first_token_at = check_first_token_at(first_token_at)
        self.profile, self.policy, self.residual_life = profile, policy, residual_life
        self.block_size = self._resolved[0].block_size
        self.usable_blocks = max(1, self._resolved[0].usable_blocks)
        N = max(len(t) for t in traces)
        self.g = tuple(np.zeros((E, N), dt) for dt in (np.int64,) * 7) + (np.full((E, N), np.nan),)
        decision_arrays(self, E, N, Rp)
        self.credited = np.zeros(E, np.bool_)
        self.n_iterations = 0
        self.states: list = [None] * E
        self._io = [None] * E
        self._hold = [0] * E
        self._actions: list = [[] for _ in range(E)]
        self._setup: list = [None] * E
        for e, t in enumerate(traces):
            self.load(e, t, None if estimates is None else estimates[e], None if scored is None else scored[e])

    def load(self, e: int, trace: Trace, estimates: Optional[np.ndarray] = None,
             scored: Optional[tuple] = None) -> None:
        """Put ``trace`` on cluster e, its replicas as new, and run it to its first decision."""
        n = len(trace)
        if n > self.route.shape[1]:
            raise ConfigError(f"cluster {e}: a trace of {n} requests beyond the run's {self.route.shape[1]}")
        Rp = self.replicas
        trace, key, est_all, table, share, _ = cluster_table(trace, self._resolved, estimates,
                                                             min(Rp, self.decode_replicas))
        sizes = [tot for tot, _ in share]   # (every replica's rows hold the whole trace: never full)
        self._setup[e] = (trace, key, est_all, table, sizes)
        for dst, src in ((1, table[1]), (5, table[5]), (6, table[6]), (7, table[7])):
            self.g[dst][e, :n] = src
        self.route[e] = -1
        self.done[e] = False
        self.replaced[e] = 0
        self.credited[e] = False
        self.s0[e], self.s1[e] = (0, n) if scored is None else scored
        self._actions[e] = []
        from .disagg import first_hold
        self._start(e, first_hold(self._resolved))

    def _start(self, e: int, hold: int) -> None:
        from . import disagg_kernel as DK
        from .disagg import PDState
        trace, key, est_all, table, sizes = self._setup[e]
        self.states[e] = PDState(trace, self.profile, self.policy, self.configs, self.router, self.decode_router,
                                 self.kv_link, None, self.residual_life, est_all, table, sizes, hold, key,
                                 self.replicas)
        self._hold[e] = hold
        self._io[e] = np.array([0, DK.NO_ACTION, 0], np.int64)
        self._advance(e)

    def _advance(self, e: int) -> None:
        """Run cluster e to its next decision or its end (a full hold store: replayed from the start
        with twice the store and the same actions)."""
        from . import disagg_kernel as DK
        st, io = self.states[e], self._io[e]
        total = DK.run_pd_kernel(True, io, *st.args)
        if total == K.HOLD_FULL:
            actions = self._actions[e]
            self._actions[e] = []
            self._start(e, 2 * self._hold[e])
            for a in actions:
                self._route(e, a)
            return
        if total == DK.DECIDE:
            Rp = self.replicas
            self.pending[e] = io[DK.IO_NEXT]
            self.view[e] = st.view[:Rp]
            self.pred[e] = st.pred[:Rp]
            self.mask[e] = st.cand[:Rp]
            return
        if total == -2:
            raise RuntimeError("a replica made no progress; please report this trace")
        if total == -3:
            raise RuntimeError("a P/D replica's rows were full at full size; please report this trace")
        self.n_iterations += K.checked_total(total, st.kargs)
        self.done[e] = True
        self.mask[e] = False

    def _route(self, e: int, action: int) -> None:
        from . import disagg_kernel as DK
        io = self._io[e]
        io[DK.IO_ACTION] = action
        self._actions[e].append(action)
        i = int(self.pending[e])
        self._advance(e)
        self.route[e, i] = self.states[e].out[0][i]
        self.replaced[e] = io[DK.IO_REPLACED]

    def step(self, actions, acting=None) -> None:
        """Route each acting cluster's pending arrival to prefill replica ``actions[e]`` (-1 or one
        outside the mask: the base router's choice, counted) and run it to its next decision."""
        E = self.done.shape[0]
        actions = np.asarray(actions, np.int64)
        if actions.shape != (E,):
            raise ConfigError(f"actions: expected shape ({E},), got {actions.shape}")
        acting = np.ones(E, np.bool_) if acting is None else np.asarray(acting, np.bool_)
        for e in np.flatnonzero(acting & ~self.done):
            self._route(int(e), int(actions[e]))

    def credit(self, clusters=None) -> np.ndarray:
        """Per cluster: its scored requests met, once, in the call after it is done (else 0)."""
        E = self.done.shape[0]
        out = np.zeros(E, np.int64)
        which = np.arange(E) if clusters is None else np.asarray(clusters, np.int64)
        for e in which:
            if self.done[e] and not self.credited[e]:
                met = self.result(int(e)).records()["met"]
                out[e] = int(met[self.s0[e]:self.s1[e]].sum())
                self.credited[e] = True
        return out

    def results(self) -> list:
        """Every cluster's ``result``."""
        return [self.result(e) for e in range(self.done.shape[0])]

    def result(self, e: int):
        """Cluster e as ``simulate_pd`` returns a replay (a ``disagg.PDResult``)."""
        from .disagg import PDResult
        st = self.states[e]
        trace = self._setup[e][0]
        route_p, row_p, route_d, row_d, handoff = st.out
        return PDResult(trace, st.run.profiles, st.run.configs, st.run.policy.name, self.router, self.decode_router,
                        self.kv_link, self.replicas, route_p, row_p, route_d, row_d, handoff, st.run.result(),
                        self.n_iterations, self.first_token_at)


def routing_capacity(traces: Sequence[Trace], resolved: Sequence[Profile], window: Optional[int] = None) -> tuple:
    """What a ``RoutingRun`` must hold to replay any of ``traces``, or with ``window`` any ``window``
    consecutive requests of one, on a cluster of ``resolved`` replica profiles: (requests, chain ids,
    unique block ids, dense chain ids, the largest chain, the largest room, context lengths)."""
    tabs = [cluster_table(t, resolved, None, len(resolved))[3] for t in traces]

    def most(x):   # the largest sum of ``window`` consecutive values (all of them without a window)
        if window is None or window >= len(x):
            return int(x.sum())
        c = np.concatenate([[0], np.cumsum(x)])
        return int((c[window:] - c[:-window]).max())
    n = max(len(tb[0]) for tb in tabs)
    return (n if window is None else min(n, int(window)), max(most(np.diff(tb[8])) for tb in tabs),
            max(most(tb[10]) for tb in tabs), max(tb[-1] for tb in tabs),
            max(int(np.diff(tb[8]).max(initial=0)) for tb in tabs), max(int(tb[10].max(initial=0)) for tb in tabs),
            tabs[0][2].shape[0])


__all__ = ["PDRoutingRun", "RoutingRun", "routing_capacity"]
