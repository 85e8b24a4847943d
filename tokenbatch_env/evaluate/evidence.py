"""The evidence id (docs/design.md section 6): SHA-256 of the canonical JSON of everything a
benchmark's numbers depend on (trace digests, windows, loads, lambda_sat, engine config, profile,
policy parameters, predictor, residual-life table, bootstrap seed and B, package version; in cluster
mode the replicas, routers and metrics staleness)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from ..util import canonical_json
from .config import BenchConfig
from .rows import CONTROLLED, control_specs, row_guard, row_index_params


def num_or_str(x):
    """A shed margin (or any number) as report.json writes it: None, a float, or "inf"."""
    if x is None:
        return None
    return float(x) if math.isfinite(float(x)) else "inf"


def evidence_inputs(cfg: BenchConfig, wl, profile, rows: list) -> dict:
    """Everything the numbers of ``cfg``'s benchmark depend on (the workload ``wl``, ``profile``,
    the ``rows``), as JSON-able data: what ``evidence_id`` hashes."""
    from .. import __version__
    pol = []
    for r in rows:
        d = {"label": r.label, "policy": r.policy, "shed_margin": num_or_str(r.shed_margin),
             "estimates": "oracle" if r.reference else "predictor"}
        if r.router is not None:   # (cluster mode only)
            d["router"] = r.router
            if r.router_params:
                d["router_params"] = dict(r.router_params)
            if r.router_agent is not None:
                d["router_agent"] = {"env": dataclasses.asdict(r.router_agent.env), **dict(r.router_agent.evidence)}
        if r.pd:
            d["pd"] = {"prefill_replicas": r.pd[0], "decode_replicas": r.pd[1], "first_token_at": r.first_token_at,
                       "decode_router": cfg.decode_router, "kv_link": cfg.kv_link}
        if r.levers:
            d["levers"] = dict(r.levers)
        if r.guard:
            u, bmin = row_guard(r, cfg)
            d["budget_rule"] = {"rule": "tpot-guard", "u": u, "bmin": bmin}
        if r.policy == "index":
            d["index_params"] = dataclasses.asdict(row_index_params(r, cfg))
            d["t_ref_ms"] = wl.t_ref_ms
        if r.policy == "weights":
            d["weights"] = cfg.weights.to_dict()["w"]
            d["t_ref_ms"] = wl.t_ref_ms
        if r.policy == CONTROLLED:
            spec = next(s for s in control_specs(cfg) if s.label == r.label)
            d["controller"] = {"action_mode": spec.action_mode, "k": spec.k,
                               "decision_interval_ms": spec.decision_interval_ms,
                               "base_margin": num_or_str(spec.base_margin), **dict(spec.evidence),
                               **({"tpot_guard_base": list(spec.guard)} if spec.guard is not None else {})}
            d["t_ref_ms"] = wl.t_ref_ms
        pol.append(d)
    out = {
        "workload": {"kind": wl.kind, "name": wl.name,
                     "split": cfg.split if wl.kind == "suite" else None,
                     "trace_digests": wl.digests,
                     "windows": None if wl.windows is None else [list(w) for w in wl.windows],
                     **({"trace_split": cfg.trace_split, "rate_scale": cfg.rate_scale}
                        if cfg.trace_split is not None else {}),
                     **({"slo_rule": slo_rule_evidence(cfg)} if cfg.slo_rule is not None else {})},
        "loads": list(cfg.loads),
        "lambda_sat_rps": wl.lambda_sat,
        "engine_config": cfg.engine.to_dict(),
        "profile": {"name": profile.name, "profile": profile.to_dict()},
        "policies": pol,
        "predictor": wl.predictor.to_dict(),
        "residual_life_sha256": hashlib.sha256(np.ascontiguousarray(wl.residual_life).tobytes()).hexdigest(),
        "bootstrap": {"seed": cfg.bootstrap_seed, "B": cfg.bootstrap_b,
                      "block": wl.block},
        "capacity": ({"target": cfg.capacity_target, "steps": cfg.capacity_steps,
                      "gpu_price": cfg.gpu_price, "gpus": cfg.gpus} if cfg.capacity else None),
        "upper_bound": cfg.upper_bound,
        "package_version": __version__,
    }
    if cfg.cluster:   # (only then: a single engine's evidence id is the one it had before clusters)
        out["cluster"] = {"replicas": cfg.replicas, "routers": list(cfg.routers),
                          "metrics_staleness_ms": cfg.metrics_staleness_ms}
    return out


def slo_rule_evidence(cfg: BenchConfig) -> dict:
    """The SLO rule the user named: its name, content digest and seed."""
    from ..traces.slo_rules import load_slo_rule
    rule = load_slo_rule(cfg.slo_rule)
    return {"name": rule.name, "digest": rule.digest, "seed": cfg.slo_seed}


def evidence_id(inputs: dict) -> str:
    """SHA-256 of the canonical JSON of ``evidence_inputs``."""
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()
