"""Clusters: R engine replicas behind a router (docs/design.md section 12).

``simulate_cluster(trace, profile, policy, replicas=R, router="jsq")`` replays one trace on a cluster
and returns per-request records in trace order, each naming the replica that served it, and the
replicas' busy time and prefix-cache counters. The loop (routing, the router's view, the order of
events at one instant) is compiled: ``engine/cluster_kernel.py``. Every replica runs the engine's own
step, so a replica is exactly a single engine fed the requests routed to it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from . import cluster_kernel as CK
from . import kernel as K
from .profiles import Profile
from .outcomes import request_metrics
from .simulate import EnginePolicy, EngineRun, SimResult, resolve_copies, request_columns
from .state import EngineConfig, capped_outputs, slo_deadlines


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """A router's kernel id, its parameters' defaults (name: default; ``Router`` holds them) and the
    ranges tuning searches them in (name: (lo, hi, scale), scale ``linear`` or ``log1p``)."""

    rid: int
    params: dict
    ranges: dict = dataclasses.field(default_factory=dict)


#: the routers of docs/design.md section 12, by name (``first``: everything to the first replica
#: that can serve the prompt, for the exactness tests only; not listed)
ROUTERS = {
    "round-robin": RouterSpec(CK.R_ROUND_ROBIN, {}),
    "random": RouterSpec(CK.R_RANDOM, {}),
    "least-outstanding": RouterSpec(CK.R_LEAST_OUTSTANDING, {}),
    "jsq": RouterSpec(CK.R_JSQ, {}),
    "least-kv": RouterSpec(CK.R_LEAST_KV, {}),
    "po2": RouterSpec(CK.R_PO2, {}),
    # alpha: the busiest share above the least-loaded replica's outstanding count the longest hit may
    # take; beta: the requests it may add on top (docs/design.md section 12)
    "prefix-affinity": RouterSpec(CK.R_PREFIX_AFFINITY, {"alpha": 0.5, "beta": 8.0},
                                  {"alpha": (0.0, 4.0, "linear"), "beta": (0.0, 256.0, "log1p")}),
    "least-predicted-ttft": RouterSpec(CK.R_LEAST_PREDICTED_TTFT, {}),
}
ROUTER_NAMES = tuple(ROUTERS)
_TEST_ROUTERS = {"first": RouterSpec(CK.R_FIRST, {})}
#: the routers that read the replicas' state (the others read only their own counters and streams)
_READS_STATE = (CK.R_JSQ, CK.R_LEAST_KV, CK.R_PREFIX_AFFINITY, CK.R_LEAST_PREDICTED_TTFT)


@dataclasses.dataclass(frozen=True)
class Router:
    """A router and its parameters (``ROUTERS[name].params``; the others are ignored) and the seed of
    the random stream (``random``, ``po2``)."""

    name: str = "round-robin"
    alpha: float = 0.5
    beta: float = 8.0
    seed: int = 0

    def __post_init__(self):
        if self.name not in ROUTERS and self.name not in _TEST_ROUTERS:
            raise ConfigError(f"unknown router {self.name!r}; valid: {', '.join(ROUTER_NAMES)}")
        for k in ("alpha", "beta"):
            v = getattr(self, k)
            if not np.isfinite(v) or v < 0:
                raise ConfigError(f"router {self.name}: {k} must be a finite number >= 0, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ConfigError(f"router seed must be an integer >= 0, got {self.seed!r}")

    @property
    def spec(self) -> RouterSpec:
        return ROUTERS.get(self.name) or _TEST_ROUTERS[self.name]

    @property
    def label(self) -> str:
        """The name, with the parameters that differ from their defaults."""
        extra = [f"{k}={getattr(self, k):g}" for k, d in self.spec.params.items() if getattr(self, k) != d]
        return self.name + (f"({','.join(extra)})" if extra else "")


#: the routers with parameters (tuning searches them: ``RouterSpec.ranges``)
TUNED_ROUTERS = tuple(n for n, s in ROUTERS.items() if s.ranges)


def resolve_router(router: Union[str, Router]) -> Router:
    return router if isinstance(router, Router) else Router(str(router))


def replica_profiles(profile, replicas: Optional[int]) -> list:
    """One profile (name or Profile) per replica: ``profile`` a list of them, or one for all
    ``replicas``. Raises ``ConfigError`` for R < 1 or a list of the wrong length."""
    if replicas is not None and (isinstance(replicas, bool) or int(replicas) < 1):
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    if isinstance(profile, (list, tuple)):
        if replicas is not None and len(profile) != replicas:
            raise ConfigError(f"replica profiles: got {len(profile)} for {replicas} replicas")
        profiles = list(profile)
    else:
        profiles = [profile] * (1 if replicas is None else replicas)
    if not profiles:
        raise ConfigError("a cluster needs at least one replica")
    return profiles


@dataclasses.dataclass
class ClusterResult:
    """A cluster replay: ``route[i]`` the replica request i went to (-1: rejected at the router),
    ``row[i]`` its row there; the replicas' struct of arrays ``arrays`` ([R, ...])."""

    trace: Trace
    profiles: Sequence[Profile]      # per replica, resolved
    configs: Sequence[EngineConfig]
    policy: str
    router: Router
    route: np.ndarray
    row: np.ndarray
    engine: SimResult                # the replicas' own outcomes (copy c = replica c, its rows in routing order)
    n_iterations: int

    @property
    def arrays(self) -> K.EngineArrays:
        return self.engine.arrays

    def iterations(self, replica: int) -> dict:
        """Replica ``replica``'s per-iteration records (with ``EngineConfig.record_iterations``)."""
        return self.engine.iterations(replica)

    @property
    def replicas(self) -> int:
        return len(self.profiles)

    def records(self) -> dict:
        """Per-request records in trace order (``SimResult.records``' columns) and ``replica``."""
        A, t = self.arrays, self.trace
        c = np.maximum(self.route, 0)
        k = np.maximum(self.row, 0)
        out = np.flatnonzero(self.route < 0)
        mml = max(p.max_model_len for p in self.profiles)
        room_len = capped_lengths(t.prompt_tokens[out], t.output_tokens[out], mml)[0]

        rec = request_columns(A, lambda a: np.asarray(a)[c, k].copy(), np.arange(len(t)))
        if len(out):   # rejected at the router: recorded as the engine records a prompt it cannot serve
            fills = {"arrival_ns": t.arrival_ns[out], "prompt_tokens": t.prompt_tokens[out],
                     "output_tokens": room_len, "finish_ns": t.arrival_ns[out], "end_state": K.E_REJECTED,
                     "preemptions": 0, "recomputed_tokens": 0, "swapped_blocks": 0}
            for name, v in rec.items():
                if name != "request":
                    v[out] = fills.get(name, -1)
        rec.update(request_metrics(rec, t))
        rec["replica"] = self.route.copy()
        return rec

    def replica_stats(self) -> dict:
        """Per replica: requests routed, busy time (ns), utilisation (busy / the trace's span to the
        last end), and vLLM's prefix-cache counters (admitted prompt tokens queried, hit); the
        cluster's imbalance (max / mean busy time) and prefix hit rate."""
        return replica_stats(self.arrays, self.trace, np.bincount(self.route[self.route >= 0],
                                                                  minlength=self.replicas)[:self.replicas],
                             int((self.route < 0).sum()))


def replica_stats(A, trace: Trace, requests: np.ndarray, rejected: int) -> dict:
    """``ClusterResult.replica_stats`` of the replicas (copies) of ``A`` that served ``requests``
    each, ``rejected`` rejected at the router."""
    R = A.epoch.shape[0]
    busy = A.epoch[:, K.EP_BUSY].astype(np.int64)
    q = A.epoch[:, K.EP_QUERY_TOK].astype(np.int64)
    h = A.epoch[:, K.EP_HIT_TOK].astype(np.int64)
    t0 = int(trace.arrival_ns[0]) if len(trace) else 0
    span = max(1, int(max(A.now.max(), trace.arrival_ns[-1] if len(trace) else 0)) - t0)
    mean = busy.mean() if R else 0.0
    return {
        "requests": requests, "rejected_at_router": rejected,
        "busy_ns": busy, "utilisation": busy / span,
        "imbalance": float(busy.max() / mean) if mean > 0 else 1.0,
        "prefix_query_tokens": q, "prefix_hit_tokens": h,
        "prefix_hit_rate": float(h.sum() / q.sum()) if q.sum() > 0 else 0.0,
    }


def capped_lengths(prompt, output, max_model_len) -> tuple:
    """Rule 8's (output lengths, length-capped) (``state.capped_outputs``, called as the engine calls
    it: 2-D)."""
    out, capped = capped_outputs(np.array(prompt, np.int64)[None], np.array(output, np.int64)[None], max_model_len)
    return out[0], capped[0]


def request_table(trace: Trace, resolved: Sequence[Profile], est_all: Optional[np.ndarray]) -> tuple:
    """A cluster's request table (``trace`` at the replicas' block size): the trace's columns
    (writable copies: a read-only array would compile other variants), each replica context length's
    output lengths and caps (rule 8, one row per distinct ``max_model_len``, sorted), the deadlines
    as the engine holds them, the estimates, its chains' offsets and dense ids, each request's room of
    unique block ids and the number of chain ids: ``(g_arrival, g_prompt, g_out, g_capped, g_prio,
    g_t1, g_t2, g_est, g_coff, g_cval, g_room, n_uniq)``."""
    bs = resolved[0].block_size
    N = len(trace)
    g_arrival, g_prompt, g_output, g_prio = (np.array(a, np.int64) for a in (
        trace.arrival_ns, trace.prompt_tokens, trace.output_tokens, trace.priority))
    mmls = sorted({p.max_model_len for p in resolved})
    caps = [capped_lengths(g_prompt, g_output, m) for m in mmls]
    g_out = np.stack([o for o, _ in caps])
    g_t1, g_t2 = (np.array(d, np.int64) for d in slo_deadlines(trace))
    g_est = np.full(N, np.nan) if est_all is None else np.array(est_all, np.float64)
    n_uniq, inv = trace.prefix_ids()
    g_coff = np.array(trace.prefix_offsets, np.int64)
    g_room = (g_prompt + g_out.max(axis=0) + bs - 1) // bs + 1 - np.diff(g_coff)
    return (g_arrival, g_prompt, g_out, np.stack([c for _, c in caps]), g_prio, g_t1, g_t2, g_est, g_coff,
            np.array(inv, np.int64), g_room, n_uniq)


def stream_key(trace: Trace) -> tuple:
    d = trace.digest
    return int(d[:8], 16), int(d[8:16], 16)


#: rows (and chain and hash ids) each replica gets beyond twice its even share (tests set it to 0)
ROW_SLACK = 64


def cluster_table(trace: Trace, resolved: Sequence[Profile], estimates, replicas: int) -> tuple:
    """A cluster loop's inputs: ``(trace at the replicas' block size, the router streams' key,
    estimates, request table, share, sizes)``. ``share``: the totals (and largest single need) of rows,
    chain ids and unique hash ids; ``sizes``: each replica's first room, twice its even share of
    ``replicas`` (``grow_sizes`` when a router sends one more). Bad estimates: one line."""
    est_all = None if estimates is None else np.asarray(estimates, np.float64)
    if est_all is not None and est_all.shape != (len(trace),):
        raise ConfigError(f"estimates have shape {est_all.shape}, expected ({len(trace)},)")
    bs = resolved[0].block_size
    key = stream_key(trace)   # (the trace as given: the stream is shared at any block size)
    if trace.block_size != bs:
        from ..traces.blocks import at_block_size
        trace = at_block_size(trace, bs)
    table = request_table(trace, resolved, est_all)
    chain_len, g_room = np.diff(table[8]), table[10]
    share = [(len(trace), 0), (int(chain_len.sum()), int(chain_len.max(initial=0))),
             (int(g_room.sum()), int(g_room.max(initial=0)))]
    sizes = [min(tot, 2 * -(-tot // replicas) + top + ROW_SLACK) for tot, top in share]
    return trace, key, est_all, table, share, sizes


def grow_sizes(sizes: list, share: list) -> list:
    """The replicas' room doubled (a replica was full), up to the totals."""
    if sizes == [tot for tot, _ in share]:
        raise RuntimeError("a cluster replica ran out of rows at full size; please report this trace")
    return [min(tot, 2 * x) for x, (tot, _) in zip(sizes, share)]


def router_params(router: Router) -> np.ndarray:
    """A router's parameters as the compiled loops read them (``rpar``)."""
    rpar = np.zeros(CK.N_RPAR)
    rpar[CK.RP_ALPHA], rpar[CK.RP_BETA], rpar[CK.RP_SEED] = router.alpha, router.beta, router.seed
    return rpar


def replica_batch(trace, profiles, policy, config, guard, residual_life, est, table, sizes, **arrays) -> tuple:
    """The replicas of a cluster loop, one engine copy each with no rows yet (the routers append
    them), each with ``sizes`` = (rows, chain ids, unique hash ids) of room; ``arrays``: more fields of
    the struct of arrays replaced. Returns ``(run, mml_of, active, claim, until, kargs)``: each
    replica's row of rule 8's output lengths, the loop's scratch and ``kernel.kernel_args``."""
    N, R = len(trace), len(profiles)
    width, H, U = sizes
    n_uniq = table[-1]
    head = trace.subset(slice(0, max(1, width))) if N else trace
    run = EngineRun([head] * R, profiles, policy, config, residual_life=residual_life,
                    estimates=None if est is None else [est[:len(head)]] * R)
    if guard is not None:
        run.set_guard(slice(None), guard[0], guard[1])
    run.cfg[:, K.C_STOP_IDLE] = 1   # (a replica's iteration at t waits for the other arrivals at t)
    A = run.arrays = run.arrays._replace(chain_val=np.zeros((R, max(1, H)), np.int64),
                                         hash_head=np.full((R, max(1, U + n_uniq)), -1, np.int32), **arrays)
    A.n_req[:] = 0
    A.chain_off[:] = 0
    A.now[:] = trace.arrival_ns[0] if N else 0
    active, claim, until = np.zeros(R, np.bool_), np.zeros(1, np.int64), np.zeros(R, np.int64)
    mmls = sorted({p.max_model_len for p in run.profiles})
    mml_of = np.array([mmls.index(p.max_model_len) for p in run.profiles], np.int64)
    kargs = K.kernel_args(A, run.cfg, run.fcfg, run.theta, run.shed_margin, run.mrl, run.tier, run.score, active,
                          1 << 62, until, claim=claim)
    return run, mml_of, active, claim, until, kargs


def _run_cluster(trace, profiles, policy, config, router, guard, residual_life, est, table, sizes, stale_ns, key):
    """One run of the compiled cluster loop over the cluster's request table ``table`` (its columns
    for ``run_cluster_kernel``, then the dense chain ids' count), each replica with ``sizes`` = (rows,
    chain ids, unique hash ids): (its result, the run, route, row, kernel args); result -3: a replica
    was full."""
    N, R = len(trace), len(profiles)
    g_arrival, g_prompt, g_out, g_capped, g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, n_uniq = table
    run, mml_of, active, claim, until, kargs = replica_batch(trace, profiles, policy, config, guard, residual_life,
                                                             est, table, sizes)
    A = run.arrays
    route = np.full(N, -1, np.int64)
    row = np.full(N, -1, np.int64)
    # the views read at t - S and not yet used: at most the arrivals within S of one another, plus one
    ring = 1 if stale_ns == 0 or N == 0 else int(
        (np.arange(N) - np.searchsorted(trace.arrival_ns, trace.arrival_ns - stale_ns, side="left")).max()) + 2
    total = CK.run_cluster_kernel(
        router.spec.rid, router_params(router), key[0], key[1], stale_ns, g_arrival, g_prompt, g_out, g_capped, mml_of,
        g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, np.full(R, n_uniq, np.int64), route, row,
        np.zeros((R, CK.N_VIEW), np.int64), np.zeros((ring, R, CK.N_VIEW), np.int64), np.zeros((ring, R), np.int64),
        np.zeros(R, np.int64), np.zeros(1, np.int64),
        run.cfg, A.n_req, A.arrival, A.prompt, A.out_len, A.prio, A.capped, A.t1, A.t2, A.est, A.chain_off,
        A.chain_val, A.uniq_base, A.now, A.it, A.next_arr, A.n_ended, A.n_run, A.n_wait, A.n_swap, A.n_pend,
        A.n_free, A.status, A.gen, A.computed, A.run_ids, A.wait_ids, A.pend_ids, A.table, A.slot_of, A.held, A.ref,
        A.hold_kv, A.hash_head, A.epoch, active, claim, until, *kargs)
    return total, run, route, row, kargs


def simulate_cluster(trace: Trace, profile: Union[str, Profile, Sequence[Union[str, Profile]]] = "stress-512",
                     policy: Union[str, EnginePolicy] = "fcfs",
                     config: Union[None, EngineConfig, Sequence[EngineConfig]] = None, *,
                     replicas: Optional[int] = None, router: Union[str, Router] = "round-robin",
                     staleness_ms: float = 0.0, estimates: Optional[np.ndarray] = None,
                     residual_life: Optional[np.ndarray] = None, guard: Optional[tuple] = None) -> ClusterResult:
    """Replay ``trace`` on ``replicas`` engine replicas (or one per entry of a ``profile`` list: mixed
    profiles share a block size) behind ``router``; each replica runs ``policy`` with ``config`` (one,
    or one per replica). ``staleness_ms``: the router reads the replicas' state as of that long ago
    (``--metrics-staleness-ms``). ``estimates``: the trace's output-length estimates (one per request);
    ``guard``: the tpot-guard rule's (u, B_min) when ``config`` turns it on."""
    if not isinstance(trace, Trace):
        raise ConfigError("simulate_cluster replays one Trace")
    router = resolve_router(router)
    profile_list = replica_profiles(profile, replicas)
    R = len(profile_list)
    stale = float(staleness_ms)
    if not np.isfinite(stale) or stale < 0:
        raise ConfigError(f"metrics staleness must be a number of ms >= 0, got {staleness_ms!r}")
    _, resolved = resolve_copies(profile_list, config, R)
    trace, key, est_all, table, share, sizes = cluster_table(trace, resolved, estimates, R)
    # (staleness delays only what routers read of the replicas' state: the others keep their counters)
    stale_ns = int(round(stale * 1e6)) if router.spec.rid in _READS_STATE else 0
    while True:
        total, run, route, row, kargs = _run_cluster(trace, profile_list, policy, config, router, guard,
                                                     residual_life, est_all, table, sizes, stale_ns, key)
        if total != -3:
            break
        sizes = grow_sizes(sizes, share)
    if total == -2:
        raise RuntimeError("a cluster replica made no progress; please report this trace")
    total = K.checked_total(total, kargs)
    res = run.result()
    return ClusterResult(trace, run.profiles, run.configs, run.policy.name, router, route, row, res, total)
