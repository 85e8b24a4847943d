"""The benchmark's rows (docs/design.md section 6): which policies a ``BenchConfig`` puts on the
leaderboard (``build_rows``: the requested ones, the required baselines, the controllers) and the
one simulate call that runs a row on every (load, unit) copy (``run_row``). In cluster mode
(docs/design.md section 12) every row runs once per router, a cluster replay per copy."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..engine.levers import FLAGS_SUFFIX, PD_LABEL, PROFILE_FLAGS_SUFFIX, with_guard, with_levers
from .config import GUARD_SUFFIX, PRIMARY_SUITE, SHED_SUFFIX, BenchConfig


@dataclasses.dataclass(frozen=True)
class Row:
    """One leaderboard row: a policy, with or without the common shed rule."""

    label: str
    policy: str
    shed_margin: Optional[float]     # None = no shedding
    reference: bool = False          # uses oracle information (not deployable)
    added: bool = False              # added as a required baseline / primary-endpoint row
    levers: tuple = ()               # its tuned iteration-size levers ((flag, value), ...; docs/design.md s. 11)
    twin: Optional[str] = None       # a levered row: the label of the same row at the profile's flags
    guard: bool = False              # runs with the tpot-guard budget rule (``BenchConfig.tpot_guard``)
    index_params: object = None      # a +tpot-guard index row's own IndexParams (None: the config's)
    router: Optional[str] = None     # cluster mode: the router in front of its replicas (None: one engine)
    router_params: tuple = ()        # cluster mode: its router's tuned parameters (BenchConfig.routed)
    pd: tuple = ()                   # a P/D row: (Rp, Rd) (BenchConfig.pd; docs/design.md section 13)
    first_token_at: Optional[str] = None   # a P/D row: where its first token counts (prefill, decode)
    router_agent: object = None      # cluster mode: a trained router (control.RouterAgent) as its router


def routed_label(cfg: BenchConfig, router: Optional[str], label: str) -> str:
    """The label of the row ``label`` (a single engine's label: ``fcfs``, ``edf+shed``, ...) behind
    ``router``: ``"<router> x <label>"`` when a cluster benchmark has several routers, else ``label``."""
    return f"{router} x {label}" if router is not None and len(cfg.routers) > 1 else label


def plain_label(row: Row, cfg: BenchConfig) -> str:
    """A row's label without its router (``routed_label``'s inverse)."""
    prefix = f"{row.router} x " if row.router_agent is not None else routed_label(cfg, row.router, "")
    return row.label[len(prefix):] if prefix and row.label.startswith(prefix) else row.label


def build_rows(cfg: BenchConfig) -> list:
    """The leaderboard's rows. A row with tuned levers (``cfg.levers``, docs/design.md section 11)
    runs with them and gets a twin at the profile's flags (``<label> (profile flags)``); FCFS's and
    priority's tuned levers are rows of their own (``fcfs (tuned vLLM flags)``), twinned with the
    plain row."""
    rows, seen = [], set()
    levers = dict(cfg.levers)

    def add(policy, shed, added=False):
        label = policy + (SHED_SUFFIX if shed else "")
        if label in seen:
            return
        seen.add(label)
        margin = cfg.shed_margin(policy) if shed else None
        if label in levers:
            twin = label + PROFILE_FLAGS_SUFFIX
            rows.append(Row(label, policy, margin, policy == "srpt-oracle", added, levers[label], twin))
            rows.append(Row(twin, policy, margin, policy == "srpt-oracle", True))
        else:
            rows.append(Row(label, policy, margin, policy == "srpt-oracle", added))

    if "fcfs" not in cfg.policies:
        add("fcfs", False, True)
    for p in cfg.policies:
        add(p, False)
        if cfg.shed:
            add(p, True)
    add("edf", True, True)
    if is_primary_suite(cfg):
        add("index", True, True)
    if cfg.tpot_guard is not None:   # beside every policy row, as +shed (docs/design.md section 11)
        bases = [r for r in rows if not r.label.endswith(PROFILE_FLAGS_SUFFIX)]
    else:   # beside a row whose +tpot-guard row has levers of its own (the robust defaults' index+shed)
        by_label = {r.label + GUARD_SUFFIX: r for r in rows}
        bases = [by_label[label] for label in levers if label in by_label]
    for r in bases:
        label = r.label + GUARD_SUFFIX   # its own tuned parameters and levers when it has them
        rows.append(dataclasses.replace(
            r, label=label, added=True, guard=True, twin=None, levers=levers.get(label, r.levers),
            shed_margin=None if r.shed_margin is None else cfg.shed_margin(r.policy, guard=True),
            index_params=cfg.guard_index_params if r.policy == "index" else None))
    for policy in ("fcfs", "priority"):   # vLLM's own orders with tuned flags
        label = policy + FLAGS_SUFFIX
        if label in levers:
            add(policy, False, True)
            rows.append(Row(label, policy, None, False, True, levers[label], policy))
    for spec in control_specs(cfg):
        rows.append(Row(spec.label, CONTROLLED, None))
    if cfg.cluster:   # every row behind each router (docs/design.md section 12), router by router
        rows = [routed_row(cfg, router, r) for router in cfg.routers for r in rows]
    if cfg.pd:   # each routed row again on the split, the router in front of its prefill replicas
        from ..engine.disagg import FIRST_TOKEN_AT
        rows += [pd_row(cfg, r, f) for r in rows if r.policy != CONTROLLED for f in FIRST_TOKEN_AT]
    rows += [router_agent_row(a) for a in cfg.router_agents]
    return rows


def router_agent_row(agent) -> Row:
    """A trained router's row: ``"<agent> x <replica row>"``, its replicas running the replica
    policy it was trained with (its env's policy, shed margin, index and levers)."""
    env = agent.env
    return Row(f"{agent.label} x {router_agent_plain(env)}", env.policy, env.shed_margin, added=True,
               levers=env.levers, index_params=env.index_params, router=agent.label, router_agent=agent, pd=env.pd,
               first_token_at=env.first_token_at if env.pd else None)


def router_agent_plain(env, split: bool = True) -> str:
    """The row a router agent's replicas run, without a router (``index+shed``; a P/D agent's with
    its split and convention, ``pd_label``, unless not ``split``)."""
    plain = env.policy + (SHED_SUFFIX if env.shed_margin is not None else "")
    return pd_label(env.pd, plain, env.first_token_at) if env.pd and split else plain


def pd_label(pd: tuple, label: str, first_token_at: str) -> str:
    """A P/D row's label: ``"<row> [P/D Rp:Rd, first token at <first_token_at>]"`` (``pd``: (Rp, Rd))."""
    return f"{label}{PD_LABEL}{pd[0]}:{pd[1]}, first token at {first_token_at}]"


def pd_row(cfg: BenchConfig, r: Row, first_token_at: str) -> Row:
    """The routed row ``r`` on ``cfg.pd``'s split (docs/design.md section 13)."""
    return dataclasses.replace(r, label=pd_label(cfg.pd, r.label, first_token_at), added=True, pd=cfg.pd,
                               first_token_at=first_token_at,
                               twin=None if r.twin is None else pd_label(cfg.pd, r.twin, first_token_at))


def routed_row(cfg: BenchConfig, router: str, r: Row) -> Row:
    """``r`` behind ``router``, with the values tuned behind it when ``cfg.routed`` has them
    (docs/design.md section 12, "Tuning"; ``routed_source`` says which row's values apply)."""
    out = dataclasses.replace(r, router=router, label=routed_label(cfg, router, r.label),
                              twin=None if r.twin is None else routed_label(cfg, router, r.twin))
    rr, whole = routed_source(cfg, router, r)
    if rr is None:
        return out
    if whole:
        if rr.shed_margin is not None and r.shed_margin is not None:
            out = dataclasses.replace(out, shed_margin=float(rr.shed_margin))
        if not r.label.endswith(PROFILE_FLAGS_SUFFIX):   # (a twin: the same values at the profile's flags)
            out = dataclasses.replace(out, levers=rr.levers)
    if rr.index_params is not None and r.policy == "index":
        out = dataclasses.replace(out, index_params=rr.index_params)
    return dataclasses.replace(out, router_params=rr.router_params)


def routed_source(cfg: BenchConfig, router: str, r: Row) -> tuple:
    """(RoutedRow or None, whole) of ``r`` behind ``router``: a tuned row's own values (its ``(profile
    flags)`` twin's too), whole; the ``+tpot-guard`` copy of a row tuned without the rule, that row's,
    whole (as on one engine); a row without shedding (``<p>``, ``<p>+tpot-guard``), the router's and
    the index's parameters only, of ``<p>+shed`` (with the rule's first), or for fcfs and priority of
    their tuned-flags row (so that the levers' gain against them is the levers' alone)."""
    routed = dict(cfg.routed)
    if not routed:
        return None, False
    key = f"{router} x ".__add__
    base = r.label.removesuffix(PROFILE_FLAGS_SUFFIX)
    for label in (base, base.removesuffix(GUARD_SUFFIX)):
        if key(label) in routed and (label == base or label.endswith(SHED_SUFFIX) or FLAGS_SUFFIX in label):
            return routed[key(label)], True
    if r.shed_margin is None and r.policy != CONTROLLED:
        guard = base.endswith(GUARD_SUFFIX)
        for label in ([f"{r.policy}{SHED_SUFFIX}{GUARD_SUFFIX}"] if guard else []) + [
                f"{r.policy}{SHED_SUFFIX}", f"{r.policy}{FLAGS_SUFFIX}"]:
            if key(label) in routed:
                return routed[key(label)], False
    return None, False


#: ``Row.policy`` of a controller row (``index-scheduled``, trained agents)
CONTROLLED = "controlled"
#: what a controller row is also compared with, pairwise (docs/design.md section 8), when present
#: (index+shed+tpot-guard: the tuned index with the budget rule, a TokenBatch-v1 agent's base)
CONTROL_COMPARATORS = ("index+shed", "index-scheduled", "weights+shed", "index+shed" + GUARD_SUFFIX)


def control_specs(cfg: BenchConfig) -> list:
    """The controller rows of ``cfg`` (index-scheduled first, then the agents)."""
    from ..control import schedule_spec
    return ([schedule_spec(cfg.schedule)] if cfg.schedule is not None else []) + list(cfg.controllers)


def is_primary_suite(cfg: BenchConfig) -> bool:
    return cfg.trace_file is None and cfg.suite == PRIMARY_SUITE


def run_row(row: Row, wl, traces: list, est: list, profile, cfg: BenchConfig):
    """One simulate call of ``row`` on ``traces`` (copies of one batch; ``est``: their length
    estimates) of the workload ``wl``: a controller row is replayed under its controller."""
    from ..engine.simulate import simulate
    from ..policies import engine_policy
    if row.policy == CONTROLLED:
        from ..control import run_controlled
        spec = next(s for s in control_specs(cfg) if s.label == row.label)
        return run_controlled(traces, profile, cfg.engine, spec, estimates=est, residual_life=wl.residual_life,
                              t_ref_ms=wl.t_ref_ms, lambda_sat=wl.lambda_sat)
    pol = engine_policy(row.policy, params=row_index_params(row, cfg) if row.policy == "index" else None,
                        weights=cfg.weights, shed_margin=row.shed_margin, t_ref_ms=wl.t_ref_ms)
    # (``profile`` is resolved with ``cfg.engine`` already; resolving again with the row's levers on top
    # changes only what they set)
    if row.router is not None:
        return run_cluster_row(row, wl, traces, est, profile, cfg, pol)
    return simulate(traces, profile, pol, row_engine(row, cfg), estimates=est, residual_life=wl.residual_life)


class ClusterRuns:
    """A row's cluster replays, one per copy (docs/design.md section 12): ``records(i)`` copy i's
    per-request records in trace order (``SimResult.records``' columns and ``replica``; a P/D row's
    with its first token where the row counts it), and ``replica_stats(i)`` its replicas'
    utilisation, imbalance and prefix-cache counters."""

    def __init__(self, runs: list, first_token_at: Optional[str] = None):
        self.runs = runs
        self.first_token_at = first_token_at

    def records(self, copy: int = 0) -> dict:
        if self.first_token_at is not None:
            return self.runs[copy].records(self.first_token_at)
        return self.runs[copy].records()

    def replica_stats(self, copy: int = 0) -> dict:
        return self.runs[copy].replica_stats()


def run_cluster_row(row: Row, wl, traces: list, est: list, profile, cfg: BenchConfig, pol) -> ClusterRuns:
    """``row`` in cluster mode: each copy replayed on ``cfg.replicas`` replicas behind the row's router
    (``engine.cluster.simulate_cluster``), every replica at the row's engine configuration. A
    +tpot-guard row's u and B_min are its engine configuration's (``row_engine``) and are also given
    as the cluster's ``guard``, which sets them per replica as ``EngineRun.set_guard`` does."""
    from ..engine.cluster import simulate_cluster
    engine = row_engine(row, cfg)
    guard = row_guard(row, cfg) if row.guard else None
    if row.router_agent is not None:   # (a trained router: the routing env's dynamics and observation)
        from ..control import run_routed
        return run_routed(traces, profile, pol, engine, row.router_agent, estimates=est,
                          residual_life=wl.residual_life)
    from ..engine.cluster import Router
    router = Router(row.router, **dict(row.router_params))
    if row.pd:   # (docs/design.md section 13: the row's router in front of the prefill replicas)
        from ..engine.disagg import simulate_pd
        return ClusterRuns([simulate_pd(t, profile, pol, engine, prefill_replicas=row.pd[0],
                                        decode_replicas=row.pd[1], prefill_router=router,
                                        decode_router=cfg.decode_router, kv_link=cfg.kv_link,
                                        first_token_at=row.first_token_at, estimates=est[i],
                                        residual_life=wl.residual_life, guard=guard)
                            for i, t in enumerate(traces)], row.first_token_at)
    return ClusterRuns([simulate_cluster(t, profile, pol, engine, replicas=cfg.replicas, router=router,
                                         staleness_ms=cfg.metrics_staleness_ms, estimates=est[i],
                                         residual_life=wl.residual_life, guard=guard)
                        for i, t in enumerate(traces)])


def row_index_params(row: Row, cfg: BenchConfig):
    """The IndexParams an index row runs with: its own (a tuned +tpot-guard row) or the config's."""
    return row.index_params if row.index_params is not None else cfg.index_params


def row_guard(row: Row, cfg: BenchConfig) -> Optional[tuple]:
    """(u, B_min) of a +tpot-guard row: its tuned levers', else the benchmark's; None for other rows."""
    if not row.guard:
        return None
    lv = dict(row.levers)
    u, bmin = cfg.tpot_guard if cfg.tpot_guard is not None else (0.0, 0.0)   # (the rule's defaults)
    return (lv.get("budget_u", u), lv.get("budget_bmin", bmin))


def row_engine(row: Row, cfg: BenchConfig):
    """The engine configuration a row runs with: the benchmark's, its tuned levers, its budget rule."""
    engine = with_levers(cfg.engine, row.levers)
    return with_guard(engine, *row_guard(row, cfg)) if row.guard else engine
