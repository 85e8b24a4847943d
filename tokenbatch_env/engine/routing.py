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


class RoutingRun:
    """E clusters of R replicas of ``profile`` (each running ``policy`` with ``config``), cluster e
    replaying ``traces[e]``; the caller routes each arrival (``step``). After construction and after
    every ``step`` each cluster not ``done`` waits at its pending arrival ``pending[e]`` with the
    router's view of its replicas (``view[e]``, [R, cluster_kernel.N_VIEW]; ``pred[e]``:
    least-predicted-ttft's prediction, ns) and ``mask[e]`` (the replicas that serve the prompt and
    have room for it). ``base_router`` replaces masked actions (and routes when asked to: action -1).
    ``room``: each replica's rows as a multiple of its even share of the largest trace (a replica
    whose rows are full is masked)."""

    def __init__(self, traces: Sequence[Trace], profile: Union[str, Profile] = "stress-512",
                 policy: Union[str, EnginePolicy] = "fcfs", config: Optional[EngineConfig] = None, *,
                 replicas: int = 2, base_router: Union[str, Router] = "round-robin",
                 estimates: Optional[Sequence[np.ndarray]] = None, residual_life: Optional[np.ndarray] = None,
                 room: float = 2.0):
        if not traces or not all(isinstance(t, Trace) for t in traces):
            raise ConfigError("RoutingRun routes a non-empty list of Traces, one per cluster")
        if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1, got {replicas!r}")
        if not room >= 1:
            raise ConfigError(f"room must be >= 1 (a multiple of the even share), got {room!r}")
        E, R = len(traces), int(replicas)
        self.router = resolve_router(base_router)
        self.replicas = R
        _, resolved = resolve_copies([profile] * R, config, R)
        est = [None] * E if estimates is None else list(estimates)
        tabs = [cluster_table(t, resolved, x, R) for t, x in zip(traces, est)]
        self.traces = [tb[0] for tb in tabs]
        tables = [tb[3] for tb in tabs]
        N = max(1, max(len(t) for t in self.traces))
        n_uniq = max(tb[-1] for tb in tables)
        chains = max(int(np.diff(tb[8]).sum()) for tb in tables)
        rooms = max(int(tb[10].sum()) for tb in tables)
        top_chain = max(int(np.diff(tb[8]).max(initial=0)) for tb in tables)
        top_room = max(int(tb[10].max(initial=0)) for tb in tables)
        sizes = [min(tot, int(room * -(-tot // R)) + top + ROW_SLACK) for tot, top in (
            (N, 0), (chains, top_chain), (rooms, top_room))]
        n_mml = tables[0][2].shape[0]
        self.g = self._stack(tables, N, n_mml, max(1, chains))
        probe = self.traces[int(np.argmax([len(t) for t in self.traces]))]
        fake = (*tables[0][:-1], n_uniq)
        run, mml_of, active, claim, until, kargs = replica_batch(
            probe, [profile] * (E * R), policy, [config or EngineConfig()] * (E * R), None, residual_life,
            None, fake, [max(1, s) for s in sizes])
        self.run, self.mml_of, self._active, self._claim, self._until, self._kargs = \
            run, mml_of, active, claim, until, kargs
        A = run.arrays
        for e, t in enumerate(self.traces):   # each cluster's replicas start at its first arrival
            A.now[e * R:(e + 1) * R] = t.arrival_ns[0] if len(t) else 0
        self.u_next = np.full(E * R, n_uniq, np.int64)
        self.keys = np.array([tb[1] for tb in tabs], np.int64).reshape(E, 2)
        self.rpar = router_params(self.router)
        self.rstate = np.zeros((E, 1), np.int64)
        self.pending = np.zeros(E, np.int64)
        self.n_of = np.array([len(t) for t in self.traces], np.int64)
        self.route = np.full((E, N), -1, np.int64)
        self.row = np.full((E, N), -1, np.int64)
        self.view = np.zeros((E, R, CK.N_VIEW), np.int64)
        self.pred = np.zeros((E, R), np.int64)
        self.mask = np.zeros((E, R), np.bool_)
        self.done = np.zeros(E, np.bool_)
        self.replaced = np.zeros(E, np.int64)
        self.n_iterations = 0
        for e in range(E):
            self._check(RK.next_decision(e, R, self.router.spec.rid, self.pending, self.n_of, self.route, self.row,
                                         self.view, self.pred, self.mask, self.done, self.g[0], self.g[1], self.g[8],
                                         self.g[9], self.g[10], self.u_next, run.cfg, A.n_req, A.arrival,
                                         A.chain_off, A.chain_val, A.now, A.it, A.next_arr, A.n_ended, A.n_run,
                                         A.n_wait, A.n_swap, A.n_pend, A.n_free, A.epoch, A.status, A.prompt, A.gen,
                                         A.computed, A.run_ids, A.wait_ids, A.pend_ids, A.table, A.slot_of, A.held,
                                         A.ref, A.hold_kv, A.hash_head, active, claim, until, kargs))

    @staticmethod
    def _stack(tables, N, n_mml, H):
        """The clusters' request tables as [E, ...] arrays (padded)."""
        E = len(tables)
        arrival, prompt, prio, t1, t2, room = (np.zeros((E, N), np.int64) for _ in range(6))
        out, capped = np.zeros((E, n_mml, N), np.int64), np.zeros((E, n_mml, N), np.bool_)
        est = np.full((E, N), np.nan)
        coff = np.zeros((E, N + 1), np.int64)
        cval = np.zeros((E, H), np.int64)
        for e, tb in enumerate(tables):
            g_arrival, g_prompt, g_out, g_capped, g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, _ = tb
            n = len(g_arrival)
            for dst, src in ((arrival, g_arrival), (prompt, g_prompt), (prio, g_prio), (t1, g_t1), (t2, g_t2),
                             (est, g_est), (room, g_room)):
                dst[e, :n] = src
            out[e, :, :n], capped[e, :, :n] = g_out, g_capped
            coff[e, :n + 1] = g_coff
            coff[e, n + 1:] = g_coff[-1]
            cval[e, :len(g_cval)] = g_cval
        return arrival, prompt, out, capped, prio, t1, t2, est, coff, cval, room

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
        R, n = self.replicas, int(self.n_of[e])
        A = self.run.arrays
        res = self.run.result()
        engine = dataclasses.replace(res, traces=res.traces[e * R:(e + 1) * R],
                                     profiles=res.profiles[e * R:(e + 1) * R], configs=res.configs[e * R:(e + 1) * R],
                                     arrays=A._replace(**{f: getattr(A, f)[e * R:(e + 1) * R] for f in A._fields}))
        return ClusterResult(self.traces[e], self.run.profiles[e * R:(e + 1) * R], self.run.configs[e * R:(e + 1) * R],
                             self.run.policy.name, self.router, self.route[e, :n].copy(), self.row[e, :n].copy(),
                             engine, -1)


__all__ = ["RoutingRun"]
