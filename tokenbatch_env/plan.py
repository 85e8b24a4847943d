"""Capacity planning: how many replicas a deployment needs (docs/design.md section 12).

``plan_capacity(PlanConfig) -> dict`` replays one trace on clusters of R replicas for every row
(router x replica policy) and finds, per row, the smallest R whose goodput over the admitted,
uncapped requests meets the target at both R and R + 1: doubling from R = 1, then bisection, then
R + 1 checked (and, if it misses, the search goes on upward and the row is flagged non-monotone).
Every R evaluated is listed with its goodput and a moving-block bootstrap CI (units: the admitted
uncapped requests in arrival order, cut into ``units`` consecutive groups). One static R serves
the whole trace: the deployment is sized for its peak.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .engine.cluster import ROUTER_NAMES, Router
from .engine.state import EngineConfig, admitted_uncapped
from .errors import ConfigError
from .policies import engine_policy
from .predictors import ResidualLife, estimates
from .traces.trace import Trace
from .workload import default_predictor

HOURS_PER_YEAR = 8766   # 365.25 days
#: the reference row: savings and gains are counted against it (docs/design.md section 12)
REFERENCE = ("round-robin", "fcfs", False)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """A row: a router, a replica policy (its plain name) and whether it sheds."""

    router: str
    policy: str
    shed: bool = False

    @property
    def label(self) -> str:
        return f"{self.router} x {self.policy}{'+shed' if self.shed else ''}"


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What ``plan_capacity`` searches: ``trace`` (SLOs set, at the rate to plan for) on replicas of
    ``profile`` with ``engine`` settings, rows ``routers`` x ``policies`` (x shed variants with
    ``shed``), round-robin x fcfs always included; ``target`` goodput; R up to ``max_replicas``."""

    trace: Trace
    profile: object                      # Profile (resolved with ``engine`` by the caller or here)
    engine: EngineConfig = EngineConfig()
    routers: tuple = ("round-robin", "least-outstanding", "jsq", "least-kv", "po2", "prefix-affinity",
                      "least-predicted-ttft")
    policies: tuple = ("fcfs", "sjf", "edf")
    shed: bool = False
    target: float = 0.9
    max_replicas: int = 256
    gpu_price_usd: float = 2.0           # per GPU-hour
    gpus_per_replica: int = 1
    units: int = 40
    bootstrap_b: int = 2000
    bootstrap_seed: int = 0
    workers: int = 1
    staleness_ms: float = 0.0            # the routers read the replicas' state this long ago
    pd: bool = False                     # also the prefill/decode splits (plan_pd; docs/design.md section 13)
    pd_trials: int = 8                   # splits (and colocated lever settings) tried per GPU count
    pd_gpus: tuple = ()                  # GPU counts evaluated besides the search's
    decode_router: str = "least-kv"      # the splits' decode router
    kv_link: str = "nvlink"              # the splits' KV link (engine.kv_link.KV_LINKS)

    def __post_init__(self):
        if not self.trace.has_slos:
            raise ConfigError("plan: the trace needs SLOs (an SLO rule sets them)")
        if not 0 < self.target <= 1:
            raise ConfigError(f"--target must be in (0, 1], got {self.target}")
        for r in self.routers:
            if r not in ROUTER_NAMES:
                raise ConfigError(f"unknown router {r!r}; valid: {', '.join(ROUTER_NAMES)}")
        from .policies import POLICIES
        for p in self.policies:
            if p not in POLICIES or p == "srpt-oracle":
                raise ConfigError(f"unknown policy {p!r} for a plan; valid: "
                                  f"{', '.join(sorted(k for k in POLICIES if k != 'srpt-oracle'))}")
        from .engine.flags import MAX_REPLICAS
        if not 1 <= int(self.max_replicas) <= MAX_REPLICAS:
            raise ConfigError(f"--max-replicas must be in [1, {MAX_REPLICAS}], got {self.max_replicas}")
        if not (np.isfinite(self.gpu_price_usd) and self.gpu_price_usd >= 0):
            raise ConfigError(f"--gpu-price must be a number >= 0, got {self.gpu_price_usd}")
        if int(self.workers) < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.pd:
            self._check_pd()

    def _check_pd(self) -> None:
        from .engine.kv_link import resolve_kv_link
        if self.staleness_ms:
            raise ConfigError("--pd: metrics staleness is not supported for P/D clusters (docs/design.md section 13)")
        if self.decode_router not in ROUTER_NAMES:
            raise ConfigError(f"--decode-router: unknown router {self.decode_router!r}; valid: "
                              f"{', '.join(ROUTER_NAMES)}")
        resolve_kv_link(self.kv_link)
        if isinstance(self.pd_trials, bool) or not isinstance(self.pd_trials, int) or self.pd_trials < 1:
            raise ConfigError(f"--pd-trials must be an integer >= 1, got {self.pd_trials!r}")
        if self.max_replicas < 2:
            raise ConfigError("--pd: --max-replicas must be >= 2 (a split needs a prefill and a decode replica)")
        for g in self.pd_gpus:
            if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or not 2 <= g <= self.max_replicas + 1:
                raise ConfigError(f"--pd-gpus: each a GPU count in [2, --max-replicas + 1 = {self.max_replicas + 1}], "
                                  f"got {g!r}")

    def usd_per_year(self, replicas: int) -> float:
        """What ``replicas`` replicas cost a year at ``gpu_price_usd`` per GPU-hour."""
        return replicas * self.gpus_per_replica * self.gpu_price_usd * HOURS_PER_YEAR

    def rows(self) -> list:
        routers = list(dict.fromkeys([REFERENCE[0], *self.routers]))
        policies = list(dict.fromkeys([REFERENCE[1], *self.policies]))
        out = [PlanRow(r, p, False) for r in routers for p in policies]
        if self.shed:
            out += [PlanRow(r, p, True) for r in routers for p in policies]
        return out


def evaluate_row(trace: Trace, profile, engine: EngineConfig, row: PlanRow, R: int, units: int, B: int,
                 seed: int, est=None, residual_life=None, staleness_ms: float = 0.0) -> dict:
    """Goodput of ``row`` on ``R`` replicas: over the admitted uncapped requests (point), and its
    moving-block bootstrap CI over ``units`` consecutive groups of them."""
    from .engine.cluster import simulate_cluster
    from .metrics import bootstrap_ci, default_block
    res = simulate_cluster(trace, profile, row_policy(trace, row), engine, replicas=R, router=Router(row.router),
                           estimates=est, residual_life=residual_life, staleness_ms=staleness_ms)
    ok = admitted_uncapped(trace.prompt_tokens, trace.output_tokens, profile.max_model_len)
    met = res.records()["met"][ok].astype(np.float64)
    groups = [g for g in np.array_split(met, min(units, max(1, met.size))) if g.size]
    per_unit = np.array([g.mean() for g in groups]) if groups else np.zeros(1)
    _, lo, hi = bootstrap_ci(per_unit, B=B, seed=seed, block=default_block(per_unit.size))
    st = res.replica_stats()
    return {"replicas": R, "goodput": float(met.mean()) if met.size else 0.0, "ci95": [float(lo), float(hi)],
            "imbalance": st["imbalance"], "prefix_hit_rate": st["prefix_hit_rate"]}


def t_ref_ms(trace: Trace) -> float:
    """The index's and shed rule's time unit: the trace's median TTFT SLO (ms)."""
    return float(np.median(trace.ttft_slo_ns)) / 1e6 if len(trace) else 1.0


def search_min(good, R_max: int, start: int = 1):
    """Section 12's search (module docstring): the smallest R >= ``start`` with ``good(R)`` and
    ``good(R + 1)`` (R + 1 may be ``R_max`` + 1), doubling from ``start``, then bisection, then R + 1
    checked (on upward when it misses); None if not reached up to ``R_max``."""
    lo, hi = start - 1, start   # lo misses the target (start - 1: taken as missing), hi meets it
    while not good(hi):
        if hi >= R_max:
            return None
        lo, hi = hi, min(2 * hi, R_max)
    while hi - lo > 1:   # bisection, as if goodput were monotone in R
        mid = (lo + hi) // 2
        if good(mid):
            hi = mid
        else:
            lo = mid
    R = hi
    while R <= R_max:   # R + 1 must meet it too
        if good(R + 1):
            return R
        R += 2   # up to the next R that meets it
        while R <= R_max and not good(R):
            R += 1
    return None


def non_monotone(passes) -> bool:
    """A larger R misses the target where a smaller one met it (``passes`` in increasing R)."""
    return any(passes[i] and not passes[j] for i in range(len(passes)) for j in range(i + 1, len(passes)))


def row_policy(trace: Trace, row: PlanRow):
    """The replica policy of ``row`` (its shed rule at margin 0, the trace's T_ref)."""
    return engine_policy(row.policy, shed_margin=0.0 if row.shed else None, t_ref_ms=t_ref_ms(trace))


def search_row(cfg: PlanConfig, row: PlanRow, profile, engine, est=None, residual_life=None) -> dict:
    """Section 12's search for one row (module docstring)."""
    seen: dict = {}

    def good(R: int) -> bool:
        if R not in seen:
            seen[R] = evaluate_row(cfg.trace, profile, engine, row, R, cfg.units, cfg.bootstrap_b,
                                   cfg.bootstrap_seed, est, residual_life, cfg.staleness_ms)
        return seen[R]["goodput"] >= cfg.target

    found = search_min(good, int(cfg.max_replicas))
    evaluated = [seen[k] for k in sorted(seen)]
    at = seen.get(found)
    return {"router": row.router, "policy": row.policy, "shed": row.shed, "label": row.label,
            "replicas": found, "at": at, "evaluated": evaluated,
            "non_monotone": non_monotone([e["goodput"] >= cfg.target for e in evaluated]),
            # the point meets the target but its CI reaches below it: the R is not certain
            "ci_below_target": bool(at is not None and at["ci95"][0] < cfg.target),
            "usd_per_year": cfg.usd_per_year(found) if found is not None else None}


def _search_task(args):
    return search_row(*args)


def plan_inputs(cfg: PlanConfig, profile) -> dict:
    """What a plan's numbers depend on (its evidence id hashes this)."""
    from . import __version__
    t = cfg.trace
    return {"trace_digest": t.digest, "profile": profile.to_dict(), "engine_config": cfg.engine.to_dict(),
            "rows": [r.label for r in cfg.rows()], "predictor": default_predictor().to_dict(),
            "target": cfg.target, "max_replicas": int(cfg.max_replicas),
            "units": cfg.units, "bootstrap": [cfg.bootstrap_b, cfg.bootstrap_seed],
            "gpu_price_usd": cfg.gpu_price_usd, "gpus_per_replica": cfg.gpus_per_replica,
            **({"metrics_staleness_ms": cfg.staleness_ms} if cfg.staleness_ms else {}),
            **({"pd": {"trials": cfg.pd_trials, "gpus": sorted(int(g) for g in cfg.pd_gpus),
                       "decode_router": cfg.decode_router, "kv_link": cfg.kv_link,
                       "lever_seed": cfg.bootstrap_seed}} if cfg.pd else {}),
            "tokenbatch_version": __version__}


def plan_capacity(cfg: PlanConfig, progress: bool = False) -> dict:
    """Every row's search (in ``cfg.workers`` processes: the same results as one), then the gains:
    router gain (best router x fcfs vs round-robin x fcfs), policy gain (round-robin x best policy),
    both (the best row), each in replicas and $/year."""
    profile = cfg.engine.resolve(cfg.profile)
    rows = cfg.rows()
    # the deployable policies' length estimates (the default predictor's, as bench's for a real trace)
    # and the residual-life table of the trace's own outputs
    est = estimates(cfg.trace, default_predictor())
    rl = ResidualLife.from_lengths(cfg.trace.output_tokens).table
    tasks = [(cfg, r, profile, cfg.engine, est, rl) for r in rows]
    import contextlib
    import sys

    from tqdm.auto import tqdm
    with contextlib.ExitStack() as stack:
        searches = local_map(stack, cfg.workers if len(rows) > 1 else 1)(_search_task, tasks)
        results = list(tqdm(searches, total=len(rows), desc="plan rows", unit="row", disable=not progress,
                            leave=False, file=sys.stderr))
    by = {(r["router"], r["policy"], r["shed"]): r for r in results}
    ref = by[REFERENCE]
    best = best_of

    def gain(r):
        if r is None:
            return None
        # (the reference needing more than max_replicas: a lower bound)
        least = ref["replicas"] if ref["replicas"] is not None else int(cfg.max_replicas) + 1
        saved = least - r["replicas"]
        return {"row": r["label"], "replicas": r["replicas"], "at_least": ref["replicas"] is None,
                "replicas_saved": saved, "fraction_saved": saved / least,
                "usd_per_year_saved": (cfg.usd_per_year(saved) if ref["replicas"] is None
                                       else ref["usd_per_year"] - r["usd_per_year"])}
    gains = {
        "router": gain(best([r for r in results if r["policy"] == "fcfs" and not r["shed"]])),
        "policy": gain(best([r for r in results if r["router"] == "round-robin"])),
        "both": gain(best(results)),
    }
    from .evaluate.evidence import evidence_id
    from .traces.windows import empirical_rate_rps
    inputs = plan_inputs(cfg, profile)
    n_ok = int(admitted_uncapped(cfg.trace.prompt_tokens, cfg.trace.output_tokens, profile.max_model_len).sum())
    return {"format": "tokenbatch-plan", "version": 1, "evidence_id": evidence_id(inputs),
            "trace": {"name": cfg.trace.name, "digest": cfg.trace.digest, "requests": len(cfg.trace),
                      "rate_rps": float(empirical_rate_rps(cfg.trace)) if len(cfg.trace) > 1 else None,
                      "admitted_uncapped": n_ok},
            "profile": profile.name, "target": cfg.target,
            "sized_for": "the whole trace with one static R (no autoscaling: provisioned through its peaks; the "
                         "target is the whole trace's goodput)",
            "metrics_staleness_ms": cfg.staleness_ms,
            "reference": ref["label"], "gpu_price_usd_per_hour": cfg.gpu_price_usd,
            "gpus_per_replica": cfg.gpus_per_replica, "rows": results, "gains": gains, "inputs": inputs}


def local_map(stack, workers: int):
    """``map``, or with ``workers`` > 1 a pool of local processes' (entered on ``stack``), in task
    order: the same results as one process."""
    if workers <= 1:
        return map
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    return stack.enter_context(ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))).map


def best_of(rows: list):
    """The row needing the fewest replicas (ties: the higher goodput there), None if none reached."""
    reached = [r for r in rows if r["replicas"] is not None]
    return min(reached, key=lambda r: (r["replicas"], -r["at"]["goodput"])) if reached else None


def plot_plan(plan: dict, path) -> None:
    """Goodput vs replicas, one line per row (its evaluated R), the target as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in plan["rows"]:
        ev = r["evaluated"]
        x = [e["replicas"] for e in ev]
        y = [e["goodput"] for e in ev]
        lw = 2.2 if r["label"] in (plan["reference"], (plan["gains"]["both"] or {}).get("row")) else 0.9
        line, = ax.plot(x, y, marker="o", ms=3, lw=lw, label=r["label"] + (f" (R {r['replicas']})" if r["replicas"]
                                                                           else " (not reached)"))
        if r["at"] is not None:   # the chosen R, with its CI
            ax.errorbar([r["replicas"]], [r["at"]["goodput"]], ms=7, marker="s", color=line.get_color(),
                        yerr=[[r["at"]["goodput"] - r["at"]["ci95"][0]], [r["at"]["ci95"][1] - r["at"]["goodput"]]])
    ax.set_xscale("log", base=2)
    ticks = sorted({e["replicas"] for r in plan["rows"] for e in r["evaluated"]})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("replicas")
    save_goodput_plot(fig, ax, plan, f"goodput vs replicas (target {plan['target']:g})", path)


def save_goodput_plot(fig, ax, plan: dict, what: str, path) -> None:
    """A plan's goodput plot finished (the target line, labels, legend) and written atomically."""
    import matplotlib.pyplot as plt

    from ._io import atomic_path
    ax.axhline(plan["target"], ls="--", color="k", lw=1)
    ax.set_ylabel("goodput (admitted uncapped requests)")
    ax.set_title(f"{plan['trace']['name']} on {plan['profile']}: {what}")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def format_plan(plan: dict) -> str:
    """The console table: one line per row, then the gains."""
    tr = plan["trace"]
    rate = f"{tr['rate_rps']:.3f} req/s" if tr["rate_rps"] is not None else "one request"
    lines = [f"plan      {tr['name']} ({tr['requests']} requests at {rate}, {tr['admitted_uncapped']} admitted "
             f"uncapped) on {plan['profile']} replicas"
             + (f"; routers read state {plan['metrics_staleness_ms']:g} ms old"
                if plan["metrics_staleness_ms"] else ""),
             f"target    goodput >= {plan['target']:g} over the admitted uncapped requests, at R and R + 1; "
             f"sized for {plan['sized_for']}",
             f"evidence  {plan['evidence_id'][:16]}"]
    denied = 1 - tr["admitted_uncapped"] / tr["requests"] if tr["requests"] else 0.0
    if denied > 0.05:
        lines.append(f"WARNING   {denied:.1%} of the requests can never be met (the context limit rejects or caps "
                     "them): they are left out of the goodput")
    lines += ["",
             f"{'row':<40} {'R':>5}  {'goodput [95% CI]':<24} {'$/year':>12}  evaluated (R: goodput)"]
    for r in plan["rows"]:
        at = r["at"]
        g = f"{at['goodput']:.3f} [{at['ci95'][0]:.3f}, {at['ci95'][1]:.3f}]" if at else "not reached"
        usd = f"{r['usd_per_year']:,.0f}" if r["usd_per_year"] is not None else "-"
        ev = " ".join(f"{e['replicas']}:{e['goodput']:.3f}" for e in r["evaluated"])
        flag = ("  NON-MONOTONE" if r["non_monotone"] else "") \
            + ("  CI below target" if r["ci_below_target"] else "")
        lines.append(f"{r['label']:<40} {r['replicas'] if r['replicas'] is not None else '-':>5}  {g:<24} "
                     f"{usd:>12}  {ev}{flag}")
    lines.append("(CI: 95% moving-block bootstrap over 40 consecutive groups of requests; \"CI below target\": the "
                 "R's goodput meets the target but its CI reaches below it)")
    lines.append("")
    for k, name in (("router", "router gain (best router x fcfs)"), ("policy", "policy gain (round-robin x best "
                                                                                "policy)"), ("both", "both")):
        gk = plan["gains"][k]
        if gk is not None and gk["row"] == plan["reference"]:
            lines.append(f"{name}: none ({plan['reference']} itself needs the fewest)")
        elif gk is None:
            lines.append(f"{name}: not available (every such row missed the target up to --max-replicas)")
        else:
            most = "at least " if gk["at_least"] else ""
            lines.append(f"{name}: {gk['row']} needs {gk['replicas']} replica{'s' if gk['replicas'] != 1 else ''}, "
                         f"{most}{gk['replicas_saved']} "
                         f"({most}{gk['fraction_saved']:.0%}) fewer than {plan['reference']}"
                         + (" (which needs more than --max-replicas)" if gk["at_least"] else "")
                         + f", {most}${gk['usd_per_year_saved']:,.0f}/year saved at "
                         f"${plan['gpu_price_usd_per_hour']:g}/GPU-hour")
    return "\n".join(lines)


def json_rows(plan: dict) -> list:
    """``--json``'s rows: router, policy (the plain name), replicas (None: not reached), goodput at
    it, $/year, and the variant fields."""
    rows = [{"router": r["router"], "policy": r["policy"], "replicas": r["replicas"],
             "goodput": r["at"]["goodput"] if r["at"] else None, "usd_per_year": r["usd_per_year"],
             "shed": r["shed"], "levers": None, "kind": "colocated", "prefill_replicas": None,
             "decode_replicas": None} for r in plan["rows"]]
    return rows
