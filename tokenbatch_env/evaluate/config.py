"""The benchmark's configuration (docs/design.md section 6): ``BenchConfig``, one config per
evidence id, and the constants of the protocol (default rows and loads, the primary endpoint)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional

import numpy as np

from ..engine.levers import GUARD_SUFFIX
from ..errors import ConfigError, PolicyError
from ..params import RoutedRow

DEFAULT_LOADS = (0.6, 0.8, 1.0, 1.2, 1.5, 2.0)
DEFAULT_POLICIES = ("fcfs", "sjf", "edf", "llf", "index")
BASELINE_ROWS = ("fcfs", "edf+shed")
#: the router of a cluster benchmark when none is named (docs/design.md section 12)
DEFAULT_ROUTER = "round-robin"
PRIMARY_SUITE, PRIMARY_SPLIT, PRIMARY_LOAD = "seed-200", "test", 1.2
SHED_SUFFIX = "+shed"


def guard_fields(path: str) -> dict:
    """The ``BenchConfig`` fields of a parameters file tuned with the tpot-guard rule (docs/design.md
    section 11: a ``"tpot-guard"`` part or a twin's levers): the +tpot-guard rows beside every row
    (``tpot_guard`` at the rule's defaults, for the rows without tuned values) and the twins' own
    parameters; {} for a file without the rule."""
    from ..params import load_guard_params, load_levers
    tuned = load_guard_params(path)
    if tuned is None and not any(k.endswith(GUARD_SUFFIX) for k, _ in load_levers(path)):
        return {}
    out = {"tpot_guard": (0.0, 0.0)}
    if tuned is not None:
        out.update(guard_index_params=tuned[0], guard_shed_margins=tuned[1])
    return out


#: the index's parameters when none are given (``tokenbatch bench --defaults``): the shipped robust
#: defaults (docs/design.md section 10) or the formula's own (``IndexParams()``, margin 0)
DEFAULTS = ("robust", "formula")


def robust_fields(profile, path=None) -> dict:
    """The ``BenchConfig`` fields of the robust defaults (docs/design.md section 10) on ``profile``
    (resolved with the deployment's engine flags): their coefficients and shed margin on the index
    rows, and an ``index+shed+tpot-guard`` row (beside index+shed) with their u, B_min and vLLM's
    flags as fractions of the profile's. T_ref is the evaluated workload's (``t_ref_mode`` trace)."""
    from ..params import ROBUST_FILE, levers_for, load_robust_defaults
    from ..policies import IndexParams
    d = load_robust_defaults(path, "--defaults")
    params = IndexParams.from_dict(d["index"])
    margin = (("index", float(d["shed_margin"])),)
    levers = levers_for(profile, d["flag_fractions"], d["tpot_guard"])
    eid = d["meta"].get("evidence_id", "")
    return {"index_params": params, "shed_margins": margin, "guard_index_params": params, "guard_shed_margins": margin,
            "levers": (("index" + SHED_SUFFIX + GUARD_SUFFIX, levers),),
            "params_source": f"robust defaults ({Path(path or ROBUST_FILE).name}, evidence {eid[:12]})",
            "params_deployment": {"t_ref_mode": "trace", "profile": None}}


def _finite_pos(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) \
            or not math.isfinite(float(x)) or float(x) <= 0:
        raise ConfigError(f"{what}: must be a positive finite number, got {x!r}")
    return float(x)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Everything that determines a benchmark, so that one config gives one evidence id (every field
    enters it except ``progress``). Frozen; validated on construction.

    The fields mirror ``tokenbatch bench``'s options: the workload (``suite``/``split``/``max_traces``,
    or ``trace_file`` cut into ``windows`` with ``warmup``/``cooldown``), the ``profile`` and
    ``engine``, the rows (``policies``, ``shed``, ``index_params``, ``weights``, ``schedule``,
    ``controllers``), the ``loads`` (rho, relative to FCFS saturation), the statistics
    (``bootstrap_seed``, ``bootstrap_b``) and the optional ``capacity`` search and ``upper_bound``.
    ``replicas`` > 1 is cluster mode (docs/design.md section 12): every row runs on R engine replicas
    behind each of ``routers``, which read the replicas' state ``metrics_staleness_ms`` ago; these three
    enter the evidence id only then. The module docstring says how each is used.

    Raises:
        ConfigError: a field out of range or of the wrong type (the message names it).
        PolicyError: an unknown policy, or a bad shed margin.
    """

    suite: str = "seed-200"
    split: str = "test"
    profile: str = "stress-512"
    policies: tuple = DEFAULT_POLICIES
    shed: bool = False                          # add a +shed row for every policy
    loads: tuple = DEFAULT_LOADS
    index_params: object = None                 # IndexParams (None = defaults)
    weights: object = None                      # LinearWeights of the ``weights`` policy (None = defaults)
    shed_margins: tuple = ()                    # ((policy, margin), ...); default 0.0
    params_source: Optional[str] = None         # where the parameters came from (for the report)
    max_traces: Optional[int] = None
    bootstrap_seed: int = 0
    bootstrap_b: int = 10_000
    capacity: bool = False
    capacity_target: float = 0.9
    capacity_steps: int = 6
    gpu_price: Optional[float] = None           # $ per GPU-hour
    gpus: Optional[int] = None
    trace_file: Optional[str] = None            # a real trace instead of a suite
    trace_format: Optional[str] = None
    windows: Optional[int] = None               # scored requests per window (real trace)
    warmup: int = 0
    cooldown: int = 0
    engine: object = None                       # EngineConfig (None = defaults)
    upper_bound: bool = True
    progress: bool = False
    threads: int = 1                            # rows simulated concurrently (results identical)
    schedule: object = None                     # IndexSchedule: adds the "index-scheduled" row
    controllers: tuple = ()                     # control.ControlSpec rows (trained agents)
    trace_split: Optional[str] = None           # a trace file's time-ordered split (None: every window)
    rate_scale: float = 1.0                     # with trace_split: the native load's rate multiplier
    native_load: bool = False                   # with trace_split: also the trace's own timestamps' load
    slo_rule: Optional[str] = None              # an SLO rule (preset or file) replacing the workload's SLOs
    slo_seed: int = 0                           # its class draw's seed
    t_ref_ms: Optional[float] = None            # T_ref of a t_ref_mode "fixed" parameters file
    params_deployment: Optional[dict] = None    # the deployment its parameters were tuned on (warnings)
    levers: tuple = ()                          # ((row label, ((flag, value), ...)), ...): tuned levers
    tpot_guard: Optional[tuple] = None          # (u, B_min): a <row>+tpot-guard row beside every policy row
    guard_index_params: object = None           # IndexParams of index+tpot-guard rows (None: index_params)
    guard_shed_margins: Optional[tuple] = None  # ((policy, margin), ...) of +tpot-guard rows (None: shed_margins)
    replicas: int = 1                           # > 1: every row on a cluster of R replicas (docs/design.md s. 12)
    routers: tuple = (DEFAULT_ROUTER,)          # cluster mode: each row once per router (engine.cluster.ROUTER_NAMES)
    metrics_staleness_ms: float = 0.0           # cluster mode: the routers read the replicas' state this long ago
    routed: tuple = ()                          # cluster mode: (("<router> x <row>", RoutedRow), ...) tuned per row
    router_agents: tuple = ()                   # cluster mode: control.RouterAgent rows (trained routers)
    pd: tuple = ()                              # cluster mode: (Rp, Rd), Rp + Rd = R: P/D rows too (design s. 13)
    kv_link: str = "nvlink"                     # P/D rows: the KV link (engine.kv_link.KV_LINKS)
    decode_router: str = "least-kv"             # P/D rows: the decode router

    def __post_init__(self):
        from ..engine.state import EngineConfig
        from ..policies import BASELINES, IndexParams

        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if self.index_params is None:
            set_("index_params", IndexParams())
        elif not isinstance(self.index_params, IndexParams):
            raise ConfigError("index_params must be an IndexParams")
        from ..policies import LinearWeights
        if self.weights is None:
            set_("weights", LinearWeights())
        elif not isinstance(self.weights, LinearWeights):
            raise ConfigError("weights must be a LinearWeights")
        if self.engine is None:
            set_("engine", EngineConfig())
        elif not isinstance(self.engine, EngineConfig):
            raise ConfigError("engine must be an EngineConfig")
        from ..config_cli import check_names
        set_("policies", check_names(self.policies, BASELINES, "policies", "policy", PolicyError))
        loads = tuple(_finite_pos(x, "loads (rho)") for x in self.loads)
        if self.native_load and self.trace_split is None:
            raise ConfigError("loads: native (the trace's own timestamps) needs a trace file and its split "
                              "(--trace FILE --split train|validation|test)")
        if not loads and not self.native_load:
            raise ConfigError("loads: need at least one rho > 0")
        set_("loads", tuple(sorted(set(loads))))
        from ..policies import check_shed_margin
        for f in ("shed_margins", "guard_shed_margins"):
            if getattr(self, f) is None:
                continue
            sm = dict(getattr(self, f))
            for p, m in sm.items():
                if p not in BASELINES:
                    raise PolicyError(f"shed margin for unknown policy {p!r}; valid: {', '.join(BASELINES)}")
                check_shed_margin(m)
            set_(f, tuple(sorted(sm.items())))
        if self.guard_index_params is not None and not isinstance(self.guard_index_params, IndexParams):
            raise ConfigError("guard_index_params must be an IndexParams")
        from ..control import ControlSpec
        from ..policies import IndexSchedule
        if self.schedule is not None and not isinstance(self.schedule, IndexSchedule):
            raise ConfigError("schedule must be a policies.IndexSchedule")
        ctl = tuple(self.controllers)
        if any(not isinstance(c, ControlSpec) for c in ctl):
            raise ConfigError("controllers must be control.ControlSpec objects")
        labels = [c.label for c in ctl] + (["index-scheduled"] if self.schedule is not None else [])
        if len(set(labels)) != len(labels) or set(labels) & set(BASELINES) or \
                any(lab.endswith(SHED_SUFFIX) for lab in labels):
            raise ConfigError(f"controllers: labels must be unique and differ from the policy rows, got {labels}")
        set_("controllers", ctl)
        if self.max_traces is not None and (isinstance(self.max_traces, bool)
                                            or not isinstance(self.max_traces, int) or self.max_traces < 1):
            raise ConfigError(f"max_traces: must be an integer >= 1, got {self.max_traces!r}")
        for f, lo in (("bootstrap_seed", 0), ("bootstrap_b", 100), ("capacity_steps", 0),
                      ("warmup", 0), ("cooldown", 0), ("threads", 1)):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ConfigError(f"{f}: must be an integer >= {lo}, got {v!r}")
        t = self.capacity_target
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < float(t) <= 1):
            raise ConfigError(f"capacity_target: must be in (0, 1], got {t!r}")
        if (self.gpu_price is None) != (self.gpus is None):
            raise ConfigError("give --gpu-price and --gpus together (or neither)")
        if self.gpu_price is not None:
            _finite_pos(self.gpu_price, "gpu_price")
            if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
                raise ConfigError(f"gpus: must be an integer >= 1, got {self.gpus!r}")
        if self.trace_file is not None:
            if self.windows is None or isinstance(self.windows, bool) or not isinstance(self.windows, int) \
                    or self.windows < 1:
                raise ConfigError(f"windows: a real trace needs --windows W >= 1, got {self.windows!r}")
        elif self.windows is not None:
            raise ConfigError("windows: only with a real trace (--trace FILE)")
        if self.trace_split is not None and (self.trace_file is None
                                             or self.trace_split not in ("train", "validation", "test")):
            raise ConfigError(f"trace_split: train, validation or test of a trace file, got {self.trace_split!r}")
        if self.t_ref_ms is not None:
            set_("t_ref_ms", _finite_pos(self.t_ref_ms, "t_ref_ms"))
        set_("rate_scale", _finite_pos(self.rate_scale, "rate_scale"))
        if self.rate_scale != 1.0 and self.trace_split is None:
            raise ConfigError("rate_scale: scales a trace file's native load (--loads native with --split)")
        if isinstance(self.slo_seed, bool) or not isinstance(self.slo_seed, (int, np.integer)) or self.slo_seed < 0:
            raise ConfigError(f"slo_seed: must be an integer >= 0, got {self.slo_seed!r}")
        if self.slo_rule is not None:
            from ..traces.slo_rules import load_slo_rule
            load_slo_rule(self.slo_rule)   # (a bad rule: one line naming file and field, before any run)
        from ..params import check_row_levers
        set_("levers", check_row_levers(self.levers))
        if self.tpot_guard is not None:
            try:
                u, bmin = self.tpot_guard
                EngineConfig(budget_rule="tpot-guard", budget_u=u, budget_bmin=bmin)
            except (TypeError, ValueError):
                raise ConfigError(f"tpot_guard: expected (u, B_min), got {self.tpot_guard!r}") from None
            set_("tpot_guard", (float(u), float(bmin)))
        self._check_cluster(set_)

    def _check_cluster(self, set_) -> None:
        """The cluster fields (docs/design.md section 12): ``replicas`` >= 1, ``routers`` known names
        without duplicates, ``metrics_staleness_ms`` >= 0; routers and staleness only in cluster mode,
        and what cluster mode does not support yet."""
        R = self.replicas
        if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or R < 1:
            raise ConfigError(f"replicas: must be an integer >= 1, got {R!r}")
        from ..engine.flags import MAX_REPLICAS
        if R > MAX_REPLICAS:
            raise ConfigError(f"replicas: must be in [1, {MAX_REPLICAS}], got {R}")
        set_("replicas", int(R))
        routers = (self.routers,) if isinstance(self.routers, str) else tuple(self.routers)
        if routers != (DEFAULT_ROUTER,):   # (the routers' names without importing the cluster's engine)
            from ..config_cli import check_names
            from ..engine.cluster import ROUTER_NAMES
            check_names(routers, ROUTER_NAMES, "routers", "router")
        set_("routers", routers)
        st = self.metrics_staleness_ms
        if isinstance(st, bool) or not isinstance(st, (int, float, np.integer, np.floating)) \
                or not math.isfinite(float(st)) or float(st) < 0:
            raise ConfigError(f"metrics_staleness_ms: must be a finite number of ms >= 0, got {st!r}")
        set_("metrics_staleness_ms", float(st))
        if R == 1:   # the single engine, exactly as without these fields
            if routers != (DEFAULT_ROUTER,) or self.metrics_staleness_ms != 0.0 or self.routed or self.pd \
                    or self.router_agents:
                raise ConfigError("routers, metrics_staleness_ms, routed rows, pd and router agents: a cluster's "
                                  "settings, with replicas R > 1 (--replicas R)")
            if (self.kv_link, self.decode_router) != ("nvlink", "least-kv"):
                raise ConfigError("kv_link and decode_router: settings of P/D rows (pd, --pd Rp:Rd)")
            return
        self._check_pd(set_)
        self._check_routed(set_)
        self._check_router_agents(set_)
        if self.schedule is not None or self.controllers:
            raise ConfigError("controller rows (--schedule, agents) are not supported in cluster mode "
                              "(replicas > 1) yet")
        if self.capacity:
            raise ConfigError("capacity (--capacity) is not supported in cluster mode (replicas > 1) yet")
        if self.upper_bound:
            raise ConfigError("upper_bound: the upper bound is a single engine's; not supported in cluster mode "
                              "(replicas > 1) yet (give upper_bound=False)")

    def _check_router_agents(self, set_) -> None:
        """``router_agents``: ``control.RouterAgent`` objects with unique labels that are not routers'
        names, each trained on clusters of ``replicas`` replicas (a P/D agent on ``pd``'s split, link and
        decode router); not with staleness (the routing env has none)."""
        from ..control import RouterAgent
        agents = tuple(self.router_agents)
        if any(not isinstance(a, RouterAgent) for a in agents):
            raise ConfigError("router_agents must be control.RouterAgent objects")
        labels = [a.label for a in agents]
        from ..engine.cluster import ROUTER_NAMES
        if len(set(labels)) != len(labels) or set(labels) & set(ROUTER_NAMES) or any(" x " in x for x in labels):
            raise ConfigError(f"router_agents: labels must be unique, differ from the routers' names and hold no "
                              f"' x ', got {labels}")
        for a in agents:
            if a.env.replicas != self.replicas:
                raise ConfigError(f"router agent {a.label}: trained on clusters of {a.env.replicas} replicas, "
                                  f"not {self.replicas} (--replicas)")
            if a.env.pd and (tuple(self.pd), self.decode_router, self.kv_link) != (a.env.pd, a.env.decode_router,
                                                                                 a.env.kv_link):
                raise ConfigError(f"router agent {a.label}: trained on a P/D split {a.env.pd[0]}:{a.env.pd[1]} "
                                  f"(decode router {a.env.decode_router}, KV link {a.env.kv_link}): the benchmark's "
                                  "pd, decode_router and kv_link must be the same")
        if agents and self.metrics_staleness_ms:
            raise ConfigError("router agents: not with metrics staleness (the routing env has none)")
        set_("router_agents", agents)

    def _check_pd(self, set_) -> None:
        """``pd`` (Rp, Rd) >= 1 each with Rp + Rd = ``replicas``, its link and decode router known; P/D
        rows without staleness (docs/design.md section 13)."""
        if not self.pd:
            if (self.kv_link, self.decode_router) != ("nvlink", "least-kv"):
                raise ConfigError("kv_link and decode_router: settings of P/D rows (pd, --pd Rp:Rd)")
            set_("pd", ())
            return
        from ..engine.disagg import check_pd_split
        split = check_pd_split(self.pd, self.replicas, self.decode_router, self.kv_link)
        if self.metrics_staleness_ms:
            raise ConfigError("pd: metrics staleness is not supported for P/D rows (docs/design.md section 13)")
        set_("pd", split)

    def _check_routed(self, set_) -> None:
        """``routed``: labels ``"<router> x <row>"`` of this benchmark's routers, each a ``RoutedRow``
        whose router parameters are its router's and whose levers are valid."""
        from ..engine.cluster import ROUTERS, Router
        from ..params import check_row_levers
        from ..policies import IndexParams, check_shed_margin
        out = {}
        for item in self.routed:
            try:
                label, rr = item
            except (TypeError, ValueError):
                raise ConfigError(f"routed: expected (label, RoutedRow) pairs, got {item!r}") from None
            router, sep, plain = str(label).partition(" x ")
            if not sep or router not in self.routers:
                raise ConfigError(f"routed: {label!r} is not '<router> x <row>' with a router of this benchmark "
                                  f"({', '.join(self.routers)})")
            if not isinstance(rr, RoutedRow):
                raise ConfigError(f"routed[{label!r}]: expected a RoutedRow, got {type(rr).__name__}")
            if rr.index_params is not None and not isinstance(rr.index_params, IndexParams):
                raise ConfigError(f"routed[{label!r}]: index_params must be an IndexParams")
            if rr.shed_margin is not None:
                check_shed_margin(rr.shed_margin)
            params = dict(rr.router_params)
            unknown = sorted(set(params) - set(ROUTERS[router].params))
            if unknown:
                raise ConfigError(f"routed[{label!r}]: router {router} has no parameter(s) {unknown}"
                                  + (f"; valid: {', '.join(ROUTERS[router].params)}" if ROUTERS[router].params else ""))
            Router(router, **params)   # (validates the values)
            try:
                levers = check_row_levers(((plain, dict(rr.levers)),)) if rr.levers else ()
            except ConfigError as e:
                raise ConfigError(f"routed[{label!r}]: {e}") from None
            levers = levers[0][1] if levers else ()
            out[label] = dataclasses.replace(rr, levers=levers, router_params=tuple(sorted(params.items())))
        set_("routed", tuple(sorted(out.items())))

    @property
    def cluster(self) -> bool:
        """Cluster mode: every row on ``replicas`` > 1 engine replicas behind each router."""
        return self.replicas > 1

    def shed_margin(self, policy: str, guard: bool = False) -> float:
        """The +shed row's margin for ``policy`` (default 0.0); ``guard``: of its +tpot-guard row (its
        own tuned margin, else the row's without the rule)."""
        sm = dict(self.shed_margins)
        if guard and self.guard_shed_margins is not None:
            sm.update(self.guard_shed_margins)
        return float(sm.get(policy, 0.0))


