"""The benchmark's rows (docs/design.md section 6): which policies a ``BenchConfig`` puts on the
leaderboard (``build_rows``: the requested ones, the required baselines, the controllers) and the
one simulate call that runs a row on every (load, unit) copy (``run_row``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .config import PRIMARY_SUITE, SHED_SUFFIX, BenchConfig


@dataclasses.dataclass(frozen=True)
class Row:
    """One leaderboard row: a policy, with or without the common shed rule."""

    label: str
    policy: str
    shed_margin: Optional[float]     # None = no shedding
    reference: bool = False          # uses oracle information (not deployable)
    added: bool = False              # added as a required baseline / primary-endpoint row


def build_rows(cfg: BenchConfig) -> list:
    rows, seen = [], set()

    def add(policy, shed, added=False):
        label = policy + (SHED_SUFFIX if shed else "")
        if label in seen:
            return
        seen.add(label)
        rows.append(Row(label, policy, cfg.shed_margin(policy) if shed else None,
                        policy == "srpt-oracle", added))

    if "fcfs" not in cfg.policies:
        add("fcfs", False, True)
    for p in cfg.policies:
        add(p, False)
        if cfg.shed:
            add(p, True)
    add("edf", True, True)
    if is_primary_suite(cfg):
        add("index", True, True)
    for spec in control_specs(cfg):
        rows.append(Row(spec.label, CONTROLLED, None))
    return rows


#: ``Row.policy`` of a controller row (``index-scheduled``, trained agents)
CONTROLLED = "controlled"
#: what a controller row is also compared with, pairwise (docs/design.md section 8), when present
CONTROL_COMPARATORS = ("index+shed", "index-scheduled", "weights+shed")


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
    pol = engine_policy(row.policy, params=cfg.index_params if row.policy == "index" else None,
                        weights=cfg.weights, shed_margin=row.shed_margin, t_ref_ms=wl.t_ref_ms)
    return simulate(traces, profile, pol, cfg.engine, estimates=est, residual_life=wl.residual_life)
