"""`tokenbatch plan`: how many replicas (GPUs) a deployment needs for a goodput target, per router x
policy row, and what the best router and policy save (docs/design.md section 12)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from .errors import ConfigError


def _routers() -> tuple:
    from .engine.cluster import ROUTER_NAMES
    return ROUTER_NAMES


def configure(p: argparse.ArgumentParser) -> None:
    from .engine.flags import add_engine_flags
    p.add_argument("--trace", required=True, help="trace file (any supported format)")
    p.add_argument("--format", default=None, help="trace format (default: detected)")
    p.add_argument("--slo-rule", default=None, metavar="FILE|NAME",
                   help="SLO rule (preset or JSON file); given, it sets every request's SLOs and priority "
                        "(default: the trace's own, default-3class for a trace without SLOs)")
    p.add_argument("--slo-seed", default="0", help="seed of the SLO rule's class draw (default 0)")
    p.add_argument("--profile", required=True, help="each replica's engine profile (tokenbatch profiles list)")
    p.add_argument("--target", default="0.9",
                   help="goodput target over the admitted, uncapped requests (default 0.9)")
    p.add_argument("--routers", default=None, metavar="R1,R2,...",
                   help="routers (default: all but random; round-robin is always included)")
    p.add_argument("--policies", default="fcfs,sjf,edf", metavar="P1,P2,...",
                   help="replica policies (default fcfs,sjf,edf; fcfs is always included)")
    p.add_argument("--shed", action="store_true", help="also every policy with the common shed rule (+shed)")
    p.add_argument("--rate", default=None, metavar="X",
                   help="plan for X requests/s: the trace's timestamps rescaled to that mean rate (default: the "
                        "trace's own rate)")
    p.add_argument("--rate-scale", default=None, metavar="X", help="plan for X times the trace's own rate")
    p.add_argument("--metrics-staleness-ms", default="0", metavar="S",
                   help="the routers read the replicas' state as of S ms ago (default 0)")
    p.add_argument("--max-replicas", default="256", help="the largest R searched (default 256)")
    p.add_argument("--gpu-price", default="2.0", metavar="USD",
                   help="USD per GPU-hour for the $/year figures (default 2.0)")
    p.add_argument("--workers", default="1", help="rows searched in N local processes, same results (default 1)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write plan.json and plan.png (goodput vs replicas per row) here (default runs/plan/TRACE)")
    p.add_argument("--json", action="store_true",
                   help="print only a JSON list of rows {router, policy, replicas, goodput, usd_per_year, ...}")
    p.add_argument("--pd", action="store_true",
                   help="(no value) also prefill/decode disaggregation: per GPU count the Rp:Rd splits, both "
                        "first-token conventions, beside the colocated "
                        "cluster with its levers tuned on as many trials (docs/design.md section 13); writes "
                        "plan_pd.png")
    p.add_argument("--pd-trials", default="8", metavar="T",
                   help="--pd: splits (and colocated lever settings) tried per GPU count (default 8)")
    p.add_argument("--pd-gpus", default=None, metavar="G1,G2,...",
                   help="--pd: GPU counts evaluated besides the search's (e.g. 8; at most --max-replicas + 1)")
    p.add_argument("--decode-router", default="least-kv",
                   help="--pd: the decode router (default least-kv; tokenbatch simulate --help lists the routers)")
    p.add_argument("--kv-link", default="nvlink", help="--pd: the KV link: nvlink, rdma or none (default nvlink)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (on stderr)")
    add_engine_flags(p)


def run(args) -> int:
    from . import _io
    from .bench_cli import parse_policies, parse_routers
    from .config_cli import parse_float, parse_int
    from .engine import compile_notice
    from .engine.flags import engine_overrides, resolve_with_flags
    from .engine.profiles import load_profile
    from .engine.state import EngineConfig
    from .plan import PlanConfig, format_plan, plot_plan
    from .plan_pd import format_pd, json_rows, plan_with_pd, plot_pd
    from .traces.io import load_trace
    from .traces.slo_rules import DEFAULT_RULE, apply_slo_rule, load_slo_rule
    from .traces.windows import scale_to_rate, time_scale

    if args.rate is not None and args.rate_scale is not None:
        raise ConfigError("--rate and --rate-scale: give one")
    num = {}
    for flag, v in (("--rate", args.rate), ("--rate-scale", args.rate_scale), ("--target", args.target),
                    ("--gpu-price", args.gpu_price), ("--metrics-staleness-ms", args.metrics_staleness_ms)):
        num[flag] = None if v is None else parse_float(v, flag)
        if num[flag] is not None and not np.isfinite(num[flag]):
            raise ConfigError(f"{flag}: must be finite, got {v!r}")
    for flag in ("--rate", "--rate-scale"):
        if num[flag] is not None and num[flag] <= 0:
            raise ConfigError(f"{flag} must be a positive number, got {num[flag]}")
    if not 0 < num["--target"] <= 1:
        raise ConfigError(f"--target must be in (0, 1], got {num['--target']}")
    if num["--metrics-staleness-ms"] < 0:
        raise ConfigError(f"--metrics-staleness-ms must be a number of ms >= 0, got {num['--metrics-staleness-ms']}")
    max_r = parse_int(args.max_replicas, "--max-replicas", 1)
    workers = parse_int(args.workers, "--workers", 1)
    slo_seed = parse_int(args.slo_seed, "--slo-seed", 0)
    routers = parse_routers(args.routers) if args.routers is not None else \
        tuple(r for r in _routers() if r != "random")
    policies = parse_policies(args.policies)
    bad = [p for p in policies if "+" in p or p == "srpt-oracle"]
    if bad:
        raise ConfigError(f"--policies: {bad[0]!r}: plain policy names (--shed adds the +shed variants; no oracle)")
    pd_flags = [f for f, v in (("--pd-trials", args.pd_trials != "8"), ("--pd-gpus", args.pd_gpus is not None),
                                 ("--decode-router", args.decode_router != "least-kv"),
                                 ("--kv-link", args.kv_link != "nvlink")) if v]
    if pd_flags and not args.pd:
        raise ConfigError(f"{pd_flags[0]}: a --pd setting; add --pd")
    pd_trials = parse_int(args.pd_trials, "--pd-trials", 1)
    pd_gpus = tuple(parse_int(g.strip(), "--pd-gpus", 2) for g in (args.pd_gpus or "").split(",") if g.strip())
    if args.pd_gpus is not None and not pd_gpus:
        raise ConfigError("--pd-gpus: give GPU counts, e.g. 8 or 4,8")
    trace, _ = load_trace(args.trace, args.format)
    out = args.out or os.path.join("runs", "plan", os.path.splitext(os.path.basename(args.trace))[0])
    _io.check_writable(os.path.join(out, "plan.json"), "--out")
    profile = load_profile(args.profile)
    config = EngineConfig(**engine_overrides(args))
    engine = resolve_with_flags(config, profile, args)
    rule = load_slo_rule(args.slo_rule if args.slo_rule is not None else DEFAULT_RULE)
    compile_notice()
    trace, _ = apply_slo_rule(trace, rule, seed=slo_seed, profile=engine, explicit=args.slo_rule is not None)
    if num["--rate"] is not None:
        trace = scale_to_rate(trace, num["--rate"])
    elif num["--rate-scale"] is not None:
        trace = time_scale(trace, 1.0 / num["--rate-scale"])
    cfg = PlanConfig(trace, profile, config, routers=routers, policies=policies, shed=args.shed,
                     target=num["--target"], max_replicas=max_r, gpu_price_usd=num["--gpu-price"], workers=workers,
                     staleness_ms=num["--metrics-staleness-ms"], pd=args.pd, pd_trials=pd_trials, pd_gpus=pd_gpus,
                     decode_router=args.decode_router, kv_link=args.kv_link)
    plan = plan_with_pd(cfg, progress=not args.quiet)
    os.makedirs(out, exist_ok=True)
    with _io.atomic_path(os.path.join(out, "plan.json")) as tmp:
        with open(tmp, "w") as f:
            json.dump(plan, f, indent=1)
    plot_plan(plan, os.path.join(out, "plan.png"))
    pngs = [os.path.join(out, "plan.png")]
    if args.pd:
        plot_pd(plan, os.path.join(out, "plan_pd.png"))
        pngs.append(os.path.join(out, "plan_pd.png"))
    if args.json:
        print(json.dumps(json_rows(plan)))
        return 0
    print(format_plan(plan) + (format_pd(plan) if args.pd else ""))
    print(f"\nwrote {os.path.join(out, 'plan.json')} and {' and '.join(pngs)}")
    return 0
