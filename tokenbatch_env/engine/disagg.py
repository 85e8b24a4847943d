"""Prefill/decode disaggregation (docs/design.md section 13): a prefill pool and a decode pool, the KV
cache moved between them over a link. ``simulate_pd`` replays a trace on such a cluster; the loop is
``disagg_kernel.run_pd_kernel``."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from . import cluster_kernel as CK
from . import disagg_kernel as DK
from . import kernel as K
from .cluster import (Router, capped_lengths, cluster_table, grow_sizes, replica_batch, replica_stats,
                      resolve_router, router_params)
from .kv_link import KVLink, resolve_kv_link
from .outcomes import request_metrics
from .profiles import Profile
from .simulate import EnginePolicy, SimResult, request_columns, resolve_copies
from .state import EngineConfig

#: when a request's first token counts (docs/design.md section 13, 6.): at the end of its last
#: prefill iteration on P (DistServe, Splitwise: the transfer and D's queueing fall in TPOT), or at
#: the end of its first iteration on D (vLLM's P/D)
FIRST_TOKEN_AT = ("prefill", "decode")
#: first_token_at's meaning, said in every P/D report
FIRST_TOKEN_MEANING = {
    "prefill": "token 1 at the end of the last prefill iteration on P (DistServe, Splitwise: the KV transfer "
               "and D's queueing count in TPOT)",
    "decode": "token 1 at the end of the first iteration on D (vLLM's P/D: the transfer counts in TTFT)"}


@dataclasses.dataclass
class PDResult:
    """A disaggregated replay. Copies 0 .. Rp-1 of ``engine`` are the prefill replicas, Rp .. the
    decode replicas; request i ran in row ``row_p[i]`` of prefill replica ``route_p[i]`` (-1: rejected
    at the prefill router) and, handed off at ``handoff_ns[i]`` (-1: not handed off: O = 1, or it
    ended on P), in row ``row_d[i]`` of decode replica ``route_d[i]`` (-1: none)."""

    trace: Trace
    profiles: Sequence[Profile]
    configs: Sequence[EngineConfig]
    policy: str
    prefill_router: Router
    decode_router: Router
    kv_link: KVLink
    prefill_replicas: int
    route_p: np.ndarray
    row_p: np.ndarray
    route_d: np.ndarray
    row_d: np.ndarray
    handoff_ns: np.ndarray
    engine: SimResult
    n_iterations: int
    first_token_at: str = "prefill"

    @property
    def arrays(self) -> K.EngineArrays:
        return self.engine.arrays

    @property
    def decode_replicas(self) -> int:
        return len(self.profiles) - self.prefill_replicas

    def replica_stats(self) -> dict:
        """``ClusterResult.replica_stats`` over all replicas (P first, then D): a prefill replica's
        requests are the arrivals routed to it, a decode replica's the handoffs it admitted."""
        Rp, R = self.prefill_replicas, len(self.profiles)
        req = np.concatenate([np.bincount(self.route_p[self.route_p >= 0], minlength=Rp)[:Rp],
                              np.bincount(self.route_d[self.route_d >= 0], minlength=R - Rp)[:R - Rp]])
        return replica_stats(self.arrays, self.trace, req, int((self.route_p < 0).sum()))

    def records(self, first_token_at: Optional[str] = None) -> dict:
        """Per-request records in trace order (``SimResult.records``' columns, TTFT, TPOT and met
        with the first token ``first_token_at``: default the run's), with ``prefill_replica``,
        ``decode_replica``, ``handoff_ns`` and ``kv_ready_ns`` (its transfer's end; -1: none). Times
        are the request's: its arrival, its end wherever it ended; preemptions and recomputed tokens
        sum both pools'."""
        fta = check_first_token_at(self.first_token_at if first_token_at is None else first_token_at)
        A, t, Rp = self.arrays, self.trace, self.prefill_replicas
        n = len(t)
        cp, kp = np.maximum(self.route_p, 0), np.maximum(self.row_p, 0)
        cd, kd = Rp + np.maximum(self.route_d, 0), np.maximum(self.row_d, 0)
        rec = request_columns(A, lambda a: np.asarray(a)[cp, kp].copy(), np.arange(n))
        mml = max(p.max_model_len for p in self.profiles)
        o_true = capped_lengths(t.prompt_tokens, t.output_tokens, mml)[0]
        rec["output_tokens"] = o_true.copy()
        d = self.route_d >= 0
        for name in ("finish_ns", "finish_iteration", "end_state"):
            rec[name][d] = np.asarray(getattr(A, _FIELD[name]))[cd[d], kd[d]]
        for name in ("preemptions", "recomputed_tokens", "swapped_blocks"):
            rec[name][d] += np.asarray(getattr(A, _FIELD[name]))[cd[d], kd[d]]
        rec["output_tokens"][d] = A.out_len[cd[d], kd[d]]
        if fta == "decode":   # token 1 at the end of its first iteration on D
            rec["first_token_ns"][d] = A.kv_first[cd[d], kd[d]]
            rec["first_token_iteration"][d] = A.first_token_it[cd[d], kd[d]]
        lost = (self.handoff_ns >= 0) & ~d   # handed off, but no decode replica serves it
        rec["end_state"][lost] = K.E_REJECTED
        rec["finish_ns"][lost] = self.handoff_ns[lost]
        out = self.route_p < 0   # rejected at the prefill router
        fills = {"arrival_ns": t.arrival_ns[out], "prompt_tokens": t.prompt_tokens[out], "output_tokens": o_true[out],
                 "finish_ns": t.arrival_ns[out], "end_state": K.E_REJECTED, "preemptions": 0,
                 "recomputed_tokens": 0, "swapped_blocks": 0}
        for name, v in rec.items():
            if name != "request" and out.any():
                v[out] = fills.get(name, -1)
        rec.update(request_metrics(rec, t))
        rec["prefill_replica"] = self.route_p.copy()
        rec["decode_replica"] = self.route_d.copy()
        rec["handoff_ns"] = self.handoff_ns.copy()
        rec["kv_ready_ns"] = np.where(d, A.kv_ready[cd, kd], -1)
        return rec


_FIELD = {"finish_ns": "finish", "finish_iteration": "finish_it", "end_state": "end_state",
          "preemptions": "n_preempt", "recomputed_tokens": "recomputed", "swapped_blocks": "swapped"}


def pd_pools(profile, config: Optional[EngineConfig], prefill_replicas, decode_replicas) -> tuple:
    """(Rp, Rd, each replica's ``EngineConfig``, the resolved profiles) of a P/D cluster: ``config``
    on the prefill replicas, the same without prefix caching on the decode replicas (a handoff arrives
    with its KV; ``simulate_pd``'s and ``routing.PDRoutingRun``'s). Counts not integers >= 1:
    ``ConfigError`` naming them."""
    for name, v in (("prefill_replicas", prefill_replicas), ("decode_replicas", decode_replicas)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    Rp, Rd = int(prefill_replicas), int(decode_replicas)
    base = EngineConfig() if config is None else config
    configs = [base] * Rp + [dataclasses.replace(base, prefix_caching=False)] * Rd
    _, resolved = resolve_copies([profile] * (Rp + Rd), configs, Rp + Rd)
    return Rp, Rd, configs, resolved


def first_hold(resolved) -> int:
    """A P/D run's first hold store per replica: twice the largest KV pool (doubled when full)."""
    return 2 * max(p.usable_blocks for p in resolved)


def check_pd_split(pd, replicas: int, decode_router: str, kv_link) -> tuple:
    """(Rp, Rd) of a P/D split ``pd``: two integers >= 1 adding up to ``replicas``, its KV link and
    decode router known; else one ``ConfigError`` naming the field (``evaluate.BenchConfig``'s and
    ``envs.ClusterEnvConfig``'s check)."""
    try:
        rp, rd = pd
    except (TypeError, ValueError):
        raise ConfigError(f"pd: expected (prefill replicas, decode replicas), got {pd!r}") from None
    for v in (rp, rd):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ConfigError(f"pd: replicas must be integers >= 1, got {pd!r}")
    if rp + rd != replicas:
        raise ConfigError(f"pd: {rp}:{rd} must add up to the replicas R = {replicas}")
    from .cluster import ROUTER_NAMES
    resolve_kv_link(kv_link)
    if decode_router not in ROUTER_NAMES:
        raise ConfigError(f"decode_router: unknown router {decode_router!r}; valid: {', '.join(ROUTER_NAMES)}")
    return int(rp), int(rd)


def check_first_token_at(value) -> str:
    if value not in FIRST_TOKEN_AT:
        raise ConfigError(f"first_token_at: one of {', '.join(FIRST_TOKEN_AT)}, got {value!r}")
    return value


def simulate_pd(trace: Trace, profile: Union[str, Profile] = "stress-512", policy: Union[str, EnginePolicy] = "fcfs",
                config: Optional[EngineConfig] = None, *, prefill_replicas: int = 1, decode_replicas: int = 1,
                prefill_router: Union[str, Router] = "round-robin", decode_router: Union[str, Router] = "least-kv",
                kv_link: Union[str, KVLink] = "nvlink", first_token_at: str = "prefill",
                estimates: Optional[np.ndarray] = None, residual_life: Optional[np.ndarray] = None,
                guard: Optional[tuple] = None) -> PDResult:
    """Replay ``trace`` on ``prefill_replicas`` prefill and ``decode_replicas`` decode replicas of
    ``profile``, each running ``policy`` with ``config`` (the decode replicas without prefix caching);
    arrivals go to a prefill replica by ``prefill_router``, handoffs to a decode replica by
    ``decode_router`` (any section-12 router), the KV over ``kv_link`` (a ``KVLink`` or a preset:
    ``nvlink``, ``rdma``, ``none``). ``guard``: the tpot-guard rule's (u, B_min) when ``config`` turns
    it on."""
    if not isinstance(trace, Trace):
        raise ConfigError("simulate_pd replays one Trace")
    Rp, Rd, configs, resolved = pd_pools(profile, config, prefill_replicas, decode_replicas)
    rp, rd = resolve_router(prefill_router), resolve_router(decode_router)
    link = resolve_kv_link(kv_link)
    check_first_token_at(first_token_at)
    # (each pool's replicas room for twice the even share of the smaller pool)
    trace, key, est_all, table, share, sizes = cluster_table(trace, resolved, estimates, min(Rp, Rd))
    hold = first_hold(resolved)
    while True:
        total, run, out, kargs = _run_pd(trace, profile, policy, configs, rp, rd, link, guard, residual_life,
                                         est_all, table, sizes, hold, key, Rp)
        if total == -3:
            sizes = grow_sizes(sizes, share)
            continue
        if total == K.HOLD_FULL:
            hold *= 2
            continue
        break
    if total == -2:
        raise RuntimeError("a replica made no progress; please report this trace")
    total = K.checked_total(total, kargs)
    res = run.result()
    route_p, row_p, route_d, row_d, handoff = out
    return PDResult(trace, run.profiles, run.configs, run.policy.name, rp, rd, link, Rp, route_p, row_p, route_d,
                    row_d, handoff, res, total, first_token_at)


def _run_pd(trace, profile, policy, configs, rp, rd, link, guard, residual_life, est, table, sizes, hold, key, Rp):
    st = PDState(trace, profile, policy, configs, rp, rd, link, guard, residual_life, est, table, sizes, hold, key, Rp)
    total = DK.run_pd_kernel(False, np.array([0, DK.NO_ACTION, 0], np.int64), *st.args)
    return total, st.run, st.out, st.kargs


class PDState:
    """One P/D cluster's state for ``disagg_kernel.run_pd_kernel``: the engine batch (``run``), the
    loop's arguments after ``ext`` and ``a_io`` (``args``), its outputs (``out``: route_p, row_p,
    route_d, row_d, handoff), the prefill router's scratch (``view``, ``pred``, ``cand``: the view at a
    ``DECIDE``) and the engine kernel's arguments (``kargs``)."""

    def __init__(self, trace, profile, policy, configs, rp, rd, link, guard, residual_life, est, table, sizes, hold,
                 key, Rp):
        N, R = len(trace), len(configs)
        g_arrival, g_prompt, g_out, g_capped, g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, n_uniq = table
        run, mml_of, active, claim, until, kargs = replica_batch(
            trace, [profile] * R, policy, configs, guard, residual_life, est, table, sizes,
            link_free=np.zeros((R, Rp), np.int64), hold_blk=np.zeros((R, 1, hold), np.int32))
        for c in range(Rp, R):   # the decode replicas price the transfers over their links
            run.cfg[c, K.C_XFER_PS_PER_TOKEN] = link.ps_per_token(run.profiles[c].kv_bytes_per_token)
            run.cfg[c, K.C_XFER_LAT_NS] = link.latency_ns
        A = run.arrays
        A.epoch[:, K.EP_BLOCKED] = -1
        self.out = route_p, row_p, route_d, row_d, handoff = tuple(np.full(N, -1, np.int64) for _ in range(5))
        gid = np.full((R, A.arrival.shape[1]), -1, np.int64)
        self.view, self.pred = np.zeros((R, CK.N_VIEW), np.int64), np.zeros(R, np.int64)
        self.cand = np.zeros(R, np.bool_)
        self.run, self.kargs = run, kargs
        self.args = (
            Rp, rp.spec.rid, rd.spec.rid, router_params(rp), router_params(rd), key[0], key[1], g_arrival, g_prompt,
            g_out, g_capped, mml_of, g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, np.full(R, n_uniq, np.int64),
            route_p, row_p, route_d, row_d, gid, handoff, np.full(max(1, N), -1, np.int64), np.zeros(1, np.int64),
            np.zeros(R, np.int64), np.zeros((max(1, N), 3), np.int64), np.zeros(1, np.int64),
            np.zeros((max(1, N), 3), np.int64), np.zeros(1, np.int64), self.view, self.pred, self.cand,
            np.zeros(1, np.int64), np.zeros(1, np.int64),
            run.cfg, A.n_req, A.arrival, A.prompt, A.out_len, A.prio, A.capped, A.t1, A.t2, A.est, A.with_kv, A.kv_src,
            A.hold_kv, A.chain_off, A.chain_val, A.uniq_base, A.now, A.it, A.next_arr, A.n_ended, A.n_run, A.n_wait,
            A.n_swap, A.n_pend, A.n_xfer, A.xfer_ids, A.kv_ready, A.n_free, A.status, A.end_state, A.finish, A.gen,
            A.computed, A.run_ids, A.wait_ids, A.pend_ids, A.table, A.slot_of, A.held, A.n_cached, A.ref, A.bhash,
            A.fq_prev, A.fq_next, A.hash_head, A.epoch, A.sched_r, A.hold_blk, A.hold_at, A.hold_ids, A.n_hold,
            A.hold_top, active, claim, until, *kargs)
