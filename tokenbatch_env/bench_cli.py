"""`tokenbatch bench`: the section-6 benchmark (policies x traces x loads) with its reports.

Writes ``report.json`` (byte-identical on rerun, evidence id inside), ``report.md``,
``goodput_vs_load.png``, ``ttft_cdf.png`` and the sidecar ``run_meta.json`` into ``--out``; prints
the primary endpoint (seed-200) and the leaderboard. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import math
import sys

from .errors import ConfigError
from .util import parse_loads, split_native


def configure(p: argparse.ArgumentParser) -> None:
    # values are parsed here (not by argparse types) so bad input gives one line and exit 2
    p.add_argument("--suite", default=None, help="suite name or spec .json (default seed-200)")
    p.add_argument("--split", default=None, help="suite split (default test); with --trace: train, validation "
                                                 "or test, the trace's time-ordered 60/20/20 parts (default: "
                                                 "every window)")
    p.add_argument("--profile", default="stress-512", help="engine profile (tokenbatch profiles list)")
    p.add_argument("--policies", default="fcfs,sjf,edf,llf,index",
                   help="comma-separated: fcfs,priority,sjf,srpt-oracle,edf,llf,empirical-gittins,index,weights "
                        "(default fcfs,sjf,edf,llf,index; fcfs and edf+shed are always added as baselines; index+shed "
                        "for seed-200's primary endpoint)")
    p.add_argument("--shed", action="store_true", help="add a +shed row for every policy")
    p.add_argument("--loads", default="0.6,0.8,1.0,1.2,1.5,2.0",
                   help="comma-separated rho values (x lambda_sat; default 0.6,0.8,1.0,1.2,1.5,2.0); with --trace "
                        "and --split, 'native' is the trace's own timestamps (its rate times --rate-scale)")
    p.add_argument("--rate-scale", default=None, help="with --loads native: multiply the trace's arrival rate by this")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--params", default=None,
                   help='JSON file {"index": {IndexParams fields}, "shed_margin": x, "edf": {"shed_margin": y}, '
                        '"levers": {"edf+shed": {"max_num_batched_tokens": 512}}} (tokenbatch tune writes it); a row '
                        'with levers runs with them, beside itself at the profile\'s flags; a file tuned with '
                        '--budget-rule tpot-guard adds the +tpot-guard rows with their own tuned parameters')
    p.add_argument("--defaults", default=None, metavar="robust|formula|FILE",
                   help="the index's parameters when --params is not given: robust (default; the shipped robust "
                        "defaults, tuned over many deployments: their coefficients and shed margin on the index rows "
                        "and, with --shed, an index+shed+tpot-guard row with their own tpot-guard u and B_min and "
                        "vLLM's flags as fractions of this deployment's: the profile's, or the engine flags given), "
                        "a robust-defaults file (tuning/robust_defaults.py writes one) or formula (IndexParams() and "
                        "margin 0)")
    p.add_argument("--max-traces", default=None, help="use only the first N traces (or windows)")
    p.add_argument("--bootstrap-seed", default="0", help="bootstrap seed (enters the evidence id)")
    p.add_argument("--bootstrap-b", default="10000", help="bootstrap resamples (default 10000, at least 100)")
    p.add_argument("--capacity", action="store_true", help="also compute capacity at SLO (many more runs)")
    p.add_argument("--target", default="0.9", help="capacity goodput target (default 0.9)")
    p.add_argument("--gpu-price", default=None, help="$ per GPU-hour (capacity savings)")
    p.add_argument("--gpus", default=None, help="number of GPUs (capacity savings)")
    p.add_argument("--trace", default=None, help="a real trace file instead of a suite (windows)")
    p.add_argument("--format", default=None, help="trace format (default: detected)")
    p.add_argument("--windows", default=None, help="scored requests per window (with --trace)")
    p.add_argument("--warmup", default="0", help="requests simulated before each window, not scored")
    p.add_argument("--cooldown", default="0", help="requests simulated after each window, not scored")
    p.add_argument("--no-upper-bound", action="store_true", help="skip the upper bound")
    p.add_argument("--slo-rule", default=None, metavar="FILE|NAME",
                   help="SLO rule (a preset: tokenbatch_env/data/slo_rules, or a JSON file); given, it sets every "
                        "request's SLOs and priority (default: a trace's own; default-3class for the columns a "
                        "trace file lacks)")
    p.add_argument("--slo-seed", default="0", help="seed of the SLO rule's class draw (default 0)")
    g = p.add_argument_group("cluster (docs/design.md section 12)")
    g.add_argument("--replicas", default=None, metavar="R",
                   help="run every row on R engine replicas behind a router (default 1: the single engine); rho "
                        "is then the admitted arrival rate / (R x lambda_sat): a suite's traces keep their "
                        "requests, arriving R times as fast; a trace file's windows, warm-up and cool-down hold R "
                        "times the requests; no upper bound, --capacity or controllers yet")
    g.add_argument("--routers", default=None, metavar="R1,R2,...",
                   help="with --replicas: comma-separated routers, each row once per router, labelled "
                        "'<router> x <row>' when several (default round-robin; tokenbatch simulate --help lists "
                        "them); the first router's fcfs is the reference")
    g.add_argument("--metrics-staleness-ms", default=None, metavar="S",
                   help="with --replicas: the routers read the replicas' state as of S ms ago (default 0)")
    g.add_argument("--pd", default=None, metavar="Rp:Rd",
                   help="with --replicas R: also every row on Rp prefill + Rd decode replicas (Rp + Rd = R; "
                        "docs/design.md section 13), the rows' router in front of the prefill replicas, twice: "
                        "'[P/D Rp:Rd, first token at prefill]' (DistServe, Splitwise) and '... at decode' (vLLM)")
    g.add_argument("--kv-link", default=None, help="with --pd: the KV link, nvlink, rdma or none (default nvlink)")
    g.add_argument("--decode-router", default=None,
                   help="with --pd: the decode router (default least-kv; tokenbatch simulate --help lists the routers)")
    from .engine.flags import add_budget_flags, add_engine_flags
    add_engine_flags(p)
    add_budget_flags(p, bench=True)
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")


def _int(text, name, lo=None):
    if text is None:
        return None
    try:
        v = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"--{name}: must be an integer, got {text!r}") from None
    if lo is not None and v < lo:
        raise ConfigError(f"--{name}: must be >= {lo}, got {v}")
    return v


def _float(text, name):
    if text is None:
        return None
    try:
        v = float(str(text).strip())
    except ValueError:
        raise ConfigError(f"--{name}: must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise ConfigError(f"--{name}: must be finite, got {text!r}")
    return v


def parse_policies(text: str) -> tuple:
    from .errors import PolicyError
    from .policies import BASELINES
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise PolicyError(f"--policies: need at least one; valid: {', '.join(BASELINES)}")
    for s in items:
        base = s[:-5] if s.endswith("+shed") else s
        if base not in BASELINES:
            raise PolicyError(f"unknown policy {s!r}; valid: {', '.join(BASELINES)} (add --shed for +shed rows)")
    if any(s.endswith("+shed") for s in items):
        raise PolicyError("--policies: write the policy name without +shed and add --shed")
    return tuple(dict.fromkeys(items))


def parse_routers(text) -> tuple:
    """``--routers``: comma-separated router names (``engine.cluster.ROUTER_NAMES``), no duplicates."""
    from .config_cli import check_names
    from .engine.cluster import ROUTER_NAMES
    return check_names([x.strip() for x in str(text).split(",") if x.strip()], ROUTER_NAMES, "--routers", "router")


def cluster_kwargs(args) -> dict:
    """The ``BenchConfig`` cluster fields of ``--replicas``, ``--routers``, ``--metrics-staleness-ms`` ({}
    when none is given); a bad value is one line naming its flag."""
    kw = {}
    R = _int(args.replicas, "replicas", 1)
    if R is not None:
        from .engine.flags import MAX_REPLICAS
        if R > MAX_REPLICAS:
            raise ConfigError(f"--replicas: must be in [1, {MAX_REPLICAS}], got {R}")
        kw["replicas"] = R
    if args.routers is not None or args.metrics_staleness_ms is not None:
        if R is None or R == 1:
            raise ConfigError("--routers and --metrics-staleness-ms: a cluster's settings, with --replicas R > 1")
        if args.routers is not None:
            kw["routers"] = parse_routers(args.routers)
        st = _float(args.metrics_staleness_ms, "metrics-staleness-ms")
        if st is not None:
            if st < 0:
                raise ConfigError(f"--metrics-staleness-ms: must be a number of ms >= 0, got "
                                  f"{args.metrics_staleness_ms!r}")
            kw["metrics_staleness_ms"] = st
    if args.pd is None and (args.kv_link is not None or args.decode_router is not None):
        raise ConfigError(f"{'--kv-link' if args.kv_link is not None else '--decode-router'}: a setting of P/D rows; "
                          "add --pd Rp:Rd")
    if args.pd is not None:
        from .config_cli import parse_split
        rp, rd = parse_split(args.pd)
        if R is None or R != rp + rd:
            raise ConfigError(f"--pd {rp}:{rd}: needs --replicas {rp + rd} (Rp + Rd)")
        kw["pd"] = (rp, rd)
        if args.kv_link is not None:
            kw["kv_link"] = args.kv_link
        if args.decode_router is not None:
            from .engine.cluster import ROUTER_NAMES
            if args.decode_router not in ROUTER_NAMES:
                raise ConfigError(f"--decode-router: unknown router {args.decode_router!r}; valid: "
                                  f"{', '.join(ROUTER_NAMES)}")
            kw["decode_router"] = args.decode_router
    return kw


def routed_fields(path: str, cluster: dict) -> dict:
    """``BenchConfig.routed`` from a cluster tuning's ``--params`` file (``params.load_routed``): the
    rows behind the benchmarked routers; {} for a file without them. What does not match the tuning
    (the replica count, the staleness, routers tuned but not benchmarked or benchmarked but not tuned,
    one engine) is a warning on stderr: the values run are said, never silently swapped."""
    from .evaluate.config import DEFAULT_ROUTER
    from .params import load_routed
    rd = load_routed(path)
    R = cluster.get("replicas", 1)

    def warn(msg):
        print(f"warning: --params {path}: {msg}", file=sys.stderr)

    if rd is None:
        from .engine.cluster import TUNED_ROUTERS
        with_params = [r for r in cluster.get("routers", ()) if r in TUNED_ROUTERS]
        if R > 1 and with_params:
            warn(f"tuned on one engine: {', '.join(with_params)} run at their default parameters, every "
                 f"router behind the file's rows (tokenbatch tune --replicas {R} tunes them together)")
        return {}
    tuned = rd["routers"]
    if R == 1:
        warn(f"tuned on a cluster of {rd['replicas']} replicas; one engine runs its top level (the rows "
             f"behind {tuned[0]})")
        return {}
    routers = cluster.get("routers", (DEFAULT_ROUTER,))
    if rd["replicas"] != R:
        warn(f"tuned on {rd['replicas']} replicas, benchmarked on {R}")
    if rd["metrics_staleness_ms"] != cluster.get("metrics_staleness_ms", 0.0):
        warn(f"tuned with metrics staleness {rd['metrics_staleness_ms']:g} ms, benchmarked with "
             f"{cluster.get('metrics_staleness_ms', 0.0):g} ms")
    skipped = [r for r in tuned if r not in routers]
    if skipped:
        warn(f"rows tuned behind {', '.join(skipped)} not benchmarked (add --routers {','.join(tuned)})")
    untuned = [r for r in routers if r not in tuned]
    if untuned:
        warn(f"no rows tuned behind {', '.join(untuned)}: they run the file's top level (the rows behind "
             f"{tuned[0]}) at the router's default parameters")
    return {"routed": tuple((label, rr) for label, rr in rd["routed"] if label.split(" x ", 1)[0] in routers)}


def config_from_args(args):
    from .engine.profiles import load_profile
    from .evaluate import BenchConfig
    from .evaluate.config import guard_fields
    from .params import load_deployment, load_levers, load_params_file, load_weights

    from .engine.flags import budget_overrides, engine_config, resolve_with_flags
    engine = engine_config(args)
    cluster = cluster_kwargs(args)
    # (an unknown profile: one line listing the valid ones)
    deployment = resolve_with_flags(engine, load_profile(args.profile), args)
    kw = {}
    guard = budget_overrides(args)
    if guard:   # a <row>+tpot-guard row beside every row
        kw["tpot_guard"] = (guard.get("budget_u", 0.0), guard.get("budget_bmin", 0.0))
    from pathlib import Path

    from .evaluate.config import DEFAULTS
    if args.defaults is not None and args.params:
        raise ConfigError("--defaults: the index's parameters when --params is not given; give one of them")
    defaults = args.defaults or "robust"
    if defaults not in DEFAULTS and not Path(defaults).is_file():
        raise ConfigError(f"--defaults: one of {', '.join(DEFAULTS)} or a robust-defaults file, got {defaults!r}")
    if not args.params and defaults != "formula":
        from .evaluate.config import robust_fields
        kw.update(robust_fields(deployment, None if defaults == "robust" else defaults))
    if args.params:
        params, margins = load_params_file(args.params)
        kw.update(index_params=params, shed_margins=margins, params_source=args.params,
                  weights=load_weights(args.params), levers=load_levers(args.params))
        if args.budget_rule != "none":
            # tuned with the rule: its +tpot-guard rows (u, B_min: their own, else the flags'); an explicit
            # --budget-rule none leaves them out
            for k, v in guard_fields(args.params).items():
                kw.setdefault(k, v)
        kw.update(routed_fields(args.params, cluster))   # (a cluster tuning's rows, router by router)
        dep = load_deployment(args.params)
        if dep is not None:
            kw["params_deployment"] = dep
            if dep["t_ref_mode"] == "fixed":
                kw["t_ref_ms"] = float(dep["t_ref_ms"])
    if args.budget_rule == "none":   # (explicit: no +tpot-guard row, not even a levered one)
        from .engine.levers import GUARD_SUFFIX
        kw["levers"] = tuple((k, v) for k, v in kw.get("levers", ()) if not k.endswith(GUARD_SUFFIX))
    if args.trace is not None and args.windows is None:
        raise ConfigError("--trace needs --windows W (scored requests per window)")
    if args.trace is None and args.windows is not None:
        raise ConfigError("--windows needs --trace FILE")
    native, rest = split_native(args.loads)
    if native and (args.trace is None or args.split is None):
        raise ConfigError("--loads native: the trace's own timestamps, with --trace FILE --split train|validation|test")
    loads = parse_loads(rest) if rest or not native else ()
    rate_scale = 1.0
    if args.rate_scale is not None:
        if not native:
            raise ConfigError("--rate-scale scales the native load: give --loads native")
        rate_scale = _float(args.rate_scale, "rate-scale")
        if rate_scale <= 0:
            raise ConfigError(f"--rate-scale: must be > 0, got {args.rate_scale!r}")
    target = _float(args.target, "target")
    if not 0 < target <= 1:
        raise ConfigError(f"--target: the capacity goodput target must be in (0, 1], got {args.target!r}")
    if args.trace is not None and args.suite is not None:
        raise ConfigError("--suite goes without --trace (a trace file replaces the suite)")
    if args.trace is not None and args.split is not None and args.split not in ("train", "validation", "test"):
        raise ConfigError(f"--split with --trace: train, validation or test (the trace's parts by time), "
                          f"got {args.split!r}")
    return BenchConfig(
        suite=args.suite or "seed-200", split=(args.split if args.trace is None else None) or "test",
        trace_split=args.split if args.trace is not None else None, profile=args.profile,
        policies=parse_policies(args.policies),
        shed=args.shed, loads=loads, native_load=native, rate_scale=rate_scale,
        max_traces=_int(args.max_traces, "max-traces", 1),
        bootstrap_seed=_int(args.bootstrap_seed, "bootstrap-seed", 0),
        bootstrap_b=_int(args.bootstrap_b, "bootstrap-b", 100), capacity=args.capacity,
        capacity_target=target, gpu_price=_float(args.gpu_price, "gpu-price"),
        gpus=_int(args.gpus, "gpus", 1), trace_file=args.trace, trace_format=args.format,
        windows=_int(args.windows, "windows", 1), warmup=_int(args.warmup, "warmup", 0),
        cooldown=_int(args.cooldown, "cooldown", 0),
        # (the upper bound is a single engine's: off in cluster mode)
        upper_bound=not args.no_upper_bound and cluster.get("replicas", 1) == 1,
        progress=not args.quiet, engine=engine, slo_rule=args.slo_rule,
        slo_seed=_int(args.slo_seed, "slo-seed", 0), **cluster, **kw)


def run(args) -> int:
    from .evaluate import run_benchmark
    from .report import check_report_out

    cfg = config_from_args(args)
    check_report_out(args.out, "--out")   # before the runs, not after them
    report = run_benchmark(cfg)
    paths = report.write(args.out)
    if not args.quiet:
        sys.stdout.write(report.summary_text())
        print(f"\nwrote {', '.join(str(p) for p in paths)}  ({report.meta['wall_time_s']:.1f} s)")
    return 0


def main(argv=None) -> int:
    """``python -m tokenbatch_env.bench_cli ...`` (same as ``tokenbatch bench ...``)."""
    from .cli import COMMANDS, main as cli_main
    COMMANDS.setdefault("bench", ("tokenbatch_env.bench_cli",
                                  "benchmark policies on a suite (docs/design.md section 6)"))
    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
