"""`tokenbatch simulate`: replay one trace through the engine and print the headline numbers."""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import hashlib
import json
import os

import numpy as np

from .._io import atomic_path
from ..config_cli import LazyChoices
from .flags import (MAX_REPLICAS, add_budget_flags, add_engine_flags, budget_overrides, engine_overrides,
                    resolve_with_flags)
from ..errors import ConfigError, TraceError


def _vllm_modes() -> tuple:
    from ..policies import vllm_modes
    return vllm_modes()


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (any supported format)")
    p.add_argument("--format", default=None, help="trace format (default: detected)")
    p.add_argument("--profile", default=None, help="engine profile (tokenbatch profiles list; default stress-512)")
    p.add_argument("--policy", default="fcfs", choices=LazyChoices(_vllm_modes),
                   help="scheduling policy (default fcfs)")
    p.add_argument("--rho", type=float, default=None,
                   help="rescale arrivals to rho x lambda_sat (FCFS saturation rate, measured; a cluster's: the sum "
                        "over its replicas); default: the trace's own timestamps")
    p.add_argument("--slo-rule", default=None, metavar="FILE|NAME",
                   help="SLO rule (a preset: tokenbatch_env/data/slo_rules, or a JSON file); given, it sets "
                        "every request's SLOs and priority, the trace's own replaced (default: default-3class, "
                        "only for the columns the trace lacks)")
    p.add_argument("--slo-seed", "--sla-seed", dest="sla_seed", type=int, default=0,
                   help="seed of the SLO rule's class draw")
    p.add_argument("--max-wait-ms", type=float, default=None, help="client time-out for a first token")
    p.add_argument("--records", default=None,
                   help="write per-request records (CSV; with the priority each request ran with)")
    p.add_argument("--iterations", default=None, help="write per-iteration records (CSV)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    g = p.add_argument_group("cluster (docs/design.md section 12)")
    g.add_argument("--replicas", default=None, metavar="R",
                   help=f"replay on R engine replicas behind a router (default 1: the single engine; at most "
                        f"{MAX_REPLICAS})")
    g.add_argument("--router", default=None, choices=LazyChoices(_routers),
                   help="how arrivals are routed to replicas (default round-robin)")
    g.add_argument("--replica-profiles", default=None, metavar="P1,P2,...",
                   help="one profile per replica (mixed GPUs; one block size), instead of --profile for all")
    g.add_argument("--metrics-staleness-ms", default=None, metavar="S",
                   help="the router reads the replicas' state as of S ms ago (default 0; routers that read only their "
                        "own counters, round-robin, random, least-outstanding and po2, are unaffected)")
    g.add_argument("--pd", default=None, metavar="Rp:Rd",
                   help="prefill/decode disaggregation (docs/design.md section 13): Rp prefill + Rd decode "
                        "replicas (--replicas, if given, must be Rp + Rd); --router then routes arrivals to the "
                        "prefill replicas")
    g.add_argument("--decode-router", default=None, choices=LazyChoices(_routers),
                   help="with --pd: how handoffs are routed to decode replicas (default least-kv)")
    g.add_argument("--kv-link", default=None, help="with --pd: the KV link, nvlink, rdma or none (default nvlink)")
    g.add_argument("--first-token-at", default=None, choices=("prefill", "decode"),
                   help="with --pd: token 1 at the end of the last prefill iteration (prefill, the default: "
                        "DistServe, Splitwise) or of the first decode iteration (decode: vLLM's P/D); --records' "
                        "TTFT and TPOT follow it, its decode_replica numbers the decode pool from 0")
    add_engine_flags(p)
    add_budget_flags(p)


def _pd_args(args, R):
    """(Rp, Rd, decode router, link, first_token_at) of a P/D run, or None; bad values raise
    ``ConfigError`` naming the flag."""
    from ..config_cli import parse_split
    given = [f for f, v in (("--decode-router", args.decode_router), ("--kv-link", args.kv_link),
                            ("--first-token-at", args.first_token_at)) if v is not None]
    if args.pd is None:
        if given:
            raise ConfigError(f"{given[0]}: a setting of a P/D run; add --pd Rp:Rd")
        return None
    rp, rd = parse_split(args.pd)
    if rp + rd > MAX_REPLICAS:
        raise ConfigError(f"--pd {rp}:{rd}: at most {MAX_REPLICAS} replicas in all")
    if R is not None and R != rp + rd:
        raise ConfigError(f"--pd {rp}:{rd}: --replicas {R} is not Rp + Rd = {rp + rd}")
    if args.replica_profiles is not None:
        raise ConfigError("--pd and --replica-profiles: a P/D run has one profile (--profile)")
    if args.metrics_staleness_ms is not None:
        raise ConfigError("--pd and --metrics-staleness-ms: staleness is not supported in P/D (docs/design.md "
                          "section 13)")
    from .kv_link import resolve_kv_link
    link = resolve_kv_link(args.kv_link or "nvlink")
    return rp, rd, args.decode_router or "least-kv", link, args.first_token_at or "prefill"


def _rate(trace):
    from ..traces.windows import empirical_rate_rps
    return float(empirical_rate_rps(trace)) if len(trace) > 1 else None


def _routers() -> tuple:
    from .cluster import ROUTER_NAMES
    return ROUTER_NAMES




def _cluster_args(args):
    """(replicas, profile names, staleness ms, P/D settings or None) of a cluster run, or None for the
    single engine (also ``--replicas 1`` alone). Bad values raise ``ConfigError`` naming the flag."""
    from ..config_cli import parse_float, parse_int
    names = None
    if args.replica_profiles is not None:
        names = [x.strip() for x in args.replica_profiles.split(",")]
        if not all(names):
            raise ConfigError(f"--replica-profiles {args.replica_profiles!r}: an empty profile name")
        if args.profile is not None:
            raise ConfigError("--profile and --replica-profiles: give one (--replica-profiles names every replica's)")
    R = None if args.replicas is None else parse_int(args.replicas, "--replicas")
    if R is not None and not 1 <= R <= MAX_REPLICAS:
        raise ConfigError(f"--replicas must be in [1, {MAX_REPLICAS}], got {R}")
    st = 0.0 if args.metrics_staleness_ms is None else parse_float(args.metrics_staleness_ms, "--metrics-staleness-ms")
    if not (np.isfinite(st) and st >= 0):
        raise ConfigError(f"--metrics-staleness-ms must be a number of ms >= 0, got {st}")
    pd = _pd_args(args, R)
    if pd is not None:
        return pd[0] + pd[1], [args.profile or "stress-512"] * (pd[0] + pd[1]), 0.0, pd
    if R is None and names is not None:
        R = len(names)
    if names is not None and len(names) != R:
        raise ConfigError(f"--replica-profiles: {len(names)} profiles for --replicas {R}")
    if (R or 1) == 1 and names is None:
        if args.router is not None or args.metrics_staleness_ms is not None:
            raise ConfigError("--router and --metrics-staleness-ms: a cluster's settings, with --replicas R > 1")
        return None
    return R, names or [args.profile or "stress-512"] * R, st, None


def _csv_sink(stack: contextlib.ExitStack, path: str, names=None, convert=None):
    """A sink writing chunks of columns to ``path`` through a temp file renamed when ``stack``
    closes without an exception (a failed run leaves no partial file). Without ``names`` the
    header is the first (converted) chunk's keys; ``sink.header(names)`` writes it if no chunk came."""
    tmp = stack.enter_context(atomic_path(path))
    w = csv.writer(stack.enter_context(open(tmp, "w", newline="")))
    state = {"names": None}

    def header(cols_names):
        if state["names"] is None:
            state["names"] = list(cols_names)
            w.writerow(state["names"])

    def sink(copy, cols):
        if convert is not None:
            cols = convert(cols)
        header(names if names is not None else cols)
        w.writerows(zip(*(np.asarray(cols[k]).tolist() for k in state["names"])))

    sink.header = header
    if names is not None:
        header(names)
    return sink


def _engine_summary(engine, config) -> dict:
    """The engine settings a run used (the profile's, overridden by the flags)."""
    return {"max_num_batched_tokens": engine.max_num_batched_tokens, "max_num_seqs": engine.max_num_seqs,
            "num_blocks": engine.num_blocks, "block_size": engine.block_size, "max_model_len": engine.max_model_len,
            "prefix_caching": config.prefix_caching, "async_scheduling": engine.async_scheduling,
            "long_prefill_token_threshold": config.threshold,
            **({"budget_rule": "tpot-guard", "budget_u": config.guard[1], "budget_bmin": config.guard[2]}
               if config.budget_rule == "tpot-guard" else {})}


def run(args) -> int:
    from ..metrics import summarize
    from ..traces.io import load_trace
    from ..traces.slo_rules import DEFAULT_RULE, apply_slo_rule, load_slo_rule
    from ..workload import admission_summary
    from ..traces.windows import scale_to_rate
    from .kernel import END_STATE_NAMES, ITER_COLUMNS
    from . import compile_notice
    from .profiles import load_profile
    from .simulate import simulate
    from .state import EngineConfig

    from .._io import check_writable

    seen = {os.path.realpath(args.trace): "--trace"}
    for opt, out in (("--records", args.records), ("--iterations", args.iterations)):
        if out is not None:
            other = seen.setdefault(os.path.realpath(out), opt)
            if other != opt:   # (one would replace the other, or the input trace)
                raise ConfigError(f"{opt} {out}: the same file as {other}")
            check_writable(out, opt)   # before the run, not after it
    cluster = _cluster_args(args)
    if cluster is not None and args.iterations:
        raise ConfigError("--iterations: per-iteration records of a cluster are not written (--records names "
                          "each request's replica)")
    trace, report = load_trace(args.trace, args.format)
    profile = load_profile((args.profile or "stress-512") if cluster is None else cluster[1][0])
    replica_profiles = None if cluster is None else [load_profile(n) for n in cluster[1]]
    if replica_profiles is not None:
        sizes = sorted({resolve_with_flags(EngineConfig(**engine_overrides(args)), p, args).block_size
                        for p in replica_profiles})
        if len(sizes) > 1:
            raise ConfigError(f"--replica-profiles: one block size per cluster, got {sizes}")
    if args.rho is not None and not (np.isfinite(args.rho) and args.rho > 0):
        raise ConfigError(f"--rho must be a positive number, got {args.rho}")
    if args.sla_seed < 0:
        raise ConfigError(f"--slo-seed must be an integer >= 0, got {args.sla_seed}")
    if args.max_wait_ms is not None and not (np.isfinite(args.max_wait_ms) and args.max_wait_ms > 0):
        raise ConfigError(f"--max-wait-ms must be a positive number of ms, got {args.max_wait_ms}")
    overrides = {**engine_overrides(args), **budget_overrides(args)}
    # per-iteration records stream to disk through a bounded buffer (any trace length)
    config = EngineConfig(max_wait_ms=args.max_wait_ms, record_iterations=65_536 if args.iterations else 0,
                          **overrides)
    engine = resolve_with_flags(config, profile, args)
    rule = load_slo_rule(args.slo_rule if args.slo_rule is not None else DEFAULT_RULE)
    file_digest = trace.digest
    bs = overrides.get("block_size")
    if bs is not None and bs != trace.block_size:
        if trace.prefix_hashes.size == 0:   # (no chains: the block size is only the trace's label)
            trace = trace.replace(block_size=bs)
        else:   # (re-chained when the engine lays the copy out, ``traces.blocks.at_block_size``)
            from ..traces.blocks import check_block_size
            try:
                check_block_size(trace, bs)
            except ConfigError as e:
                raise ConfigError(f"--block-size {bs}: {e}") from None
    compile_notice()   # (before the SLO rule's and the engine's first compiled calls)
    # the trace's own SLOs and priority are kept unless the rule is named (docs/design.md section 2);
    # SLOs relative to a profile use the deployment's configuration (the profile with the engine flags,
    # docs/design.md section 10)
    trace, slo_note = apply_slo_rule(trace, rule, seed=args.sla_seed, profile=engine,
                                     explicit=args.slo_rule is not None)
    lam = None
    if args.rho is not None:
        from .saturation import measure_lambda_sat
        # at the deployment's flags without the budget rule (docs/design.md section 10: loads and SLOs
        # at the reference configuration; the rule changes only the run)
        ref = dataclasses.replace(config, budget_rule=None, budget_u=None, budget_bmin=None)
        # a cluster's: the sum over its replicas (docs/design.md section 12)
        lam = sum(measure_lambda_sat(trace, p, ref) for p in (replica_profiles or [profile]))
        try:
            trace = scale_to_rate(trace, args.rho * lam)
        except (ConfigError, TraceError) as e:   # (its times stretched beyond the engine's int64 ns)
            raise ConfigError(f"--rho {args.rho:g}: a load too low for this trace ({e})") from None
    def end_state_names(cols):
        return dict(cols, end_state=np.array([END_STATE_NAMES[i] for i in cols["end_state"]]),
                    priority=trace.priority[np.asarray(cols["request"], np.int64)])

    # records stream to temp files through bounded buffers, renamed into place only on success
    with contextlib.ExitStack() as stack:
        it_sink = _csv_sink(stack, args.iterations, ITER_COLUMNS) if args.iterations else None
        rec_sink = _csv_sink(stack, args.records, convert=end_state_names) if args.records else None
        if cluster is None:
            res = simulate(trace, profile, args.policy, config, progress=args.progress,
                           iteration_sink=it_sink, record_sink=rec_sink)
            rec = res.records(0)
        elif cluster[3] is not None:   # prefill/decode disaggregation (docs/design.md section 13)
            from .disagg import simulate_pd
            rp, rd, drouter, link, fta = cluster[3]
            res = simulate_pd(trace, profile, args.policy, config, prefill_replicas=rp, decode_replicas=rd,
                              prefill_router=args.router or "round-robin", decode_router=drouter, kv_link=link,
                              first_token_at=fta)
            rec = res.records()
            if rec_sink is not None:
                rec_sink(0, rec)
        else:
            from .cluster import simulate_cluster
            res = simulate_cluster(trace, replica_profiles, args.policy, config, replicas=cluster[0],
                                   router=args.router or "round-robin", staleness_ms=cluster[2])
            rec = res.records()
            if rec_sink is not None:
                rec_sink(0, rec)
        if rec_sink is not None:
            rec_sink.header([*rec, "priority"])  # an empty trace: the header alone
    s = summarize(rec, trace)
    if cluster is not None:
        st = res.replica_stats()
        router = res.prefill_router if cluster[3] is not None else res.router
        s["cluster"] = {"replicas": cluster[0], "profiles": cluster[1], "router": router.label,
                        "metrics_staleness_ms": cluster[2], "arrival_rate_rps": _rate(trace),
                        "requests": st["requests"].tolist(), "rejected_at_router": st["rejected_at_router"],
                        "utilisation": st["utilisation"].tolist(), "imbalance": st["imbalance"],
                        "prefix_hit_rate": st["prefix_hit_rate"]}
        if cluster[3] is not None:
            from .disagg import FIRST_TOKEN_MEANING
            rp, rd, drouter, link, fta = cluster[3]
            s["cluster"]["pd"] = {"prefill_replicas": rp, "decode_replicas": rd,
                                  "decode_router": res.decode_router.label, "kv_link": dataclasses.asdict(link),
                                  "kv_link_text": link.describe(), "first_token_at": fta,
                                  "first_token_at_means": FIRST_TOKEN_MEANING[fta],
                                  "handed_off": int((res.handoff_ns >= 0).sum())}
    from ..util import canonical_json
    s.update({"trace": trace.name, "trace_digest": trace.digest, "file_digest": file_digest, "profile": profile.name,
              "profile_provenance": profile.provenance,
              # (the profile's content: a file may reuse a shipped profile's name)
              "profile_digest": hashlib.sha256(canonical_json(profile.to_dict()).encode()).hexdigest(),
              "policy": args.policy, "lambda_sat_rps": lam, "rho": args.rho,
              "slo_rule": rule.name, "slo_rule_digest": rule.digest, "slo_note": slo_note,
              "engine": _engine_summary(engine, config),
              "admission": admission_summary(trace.prompt_tokens, trace.output_tokens, engine.max_model_len)})
    if args.json:   # standard JSON: +-inf as "inf"/"-inf", NaN as null (as in report.json), values exact
        from ..report import rounded
        print(json.dumps(rounded(s, 17), indent=1, allow_nan=False))
        return 0
    as_run = (f"digest as run {trace.digest[:16]}, file {file_digest[:16]}" if trace.digest != file_digest
              else f"digest {trace.digest[:16]}")
    print(f"trace     {trace.name}  ({len(trace)} requests, {as_run})")
    print(f"slo rule  {slo_note}")
    print(f"profile   {profile.name} [{profile.provenance}]  policy {args.policy}"
          + (f"  rho {args.rho} (lambda_sat {lam:.3f} req/s)" if lam else ""))
    e = _engine_summary(engine, config)
    if cluster is not None and len(set(cluster[1])) > 1:
        print("engine    (replica 0's; the others run their own profiles with the same flags)")
    print(f"engine    B {e['max_num_batched_tokens']}  max_num_seqs {e['max_num_seqs']}  {e['num_blocks']} blocks "
          f"x {e['block_size']} tokens  max_model_len {e['max_model_len']}  prefix caching "
          f"{'on' if e['prefix_caching'] else 'off'}  {'async' if e['async_scheduling'] else 'sync'}"
          + (f"  long_prefill_token_threshold {e['long_prefill_token_threshold']}"
             if e["long_prefill_token_threshold"] else "")
          + (f"  budget rule tpot-guard (u {e['budget_u']:g}, B_min {e['budget_bmin']:g})"
             if "budget_rule" in e else "")
          + (f"  (given: {', '.join(sorted(overrides))})" if overrides else ""))
    if cluster is not None:
        cl = s["cluster"]
        runs = []   # the replicas' profiles in order, runs of one profile compressed
        for n in cl["profiles"]:
            if runs and runs[-1][1] == n:
                runs[-1][0] += 1
            else:
                runs.append([1, n])
        mix = ", ".join(f"{k} x {n}" for k, n in runs)
        rate = f"{cl['arrival_rate_rps']:.3f} req/s" if cl["arrival_rate_rps"] is not None else "-"
        print(f"cluster   {cl['replicas']} replicas ({mix})  router {cl['router']}  arrivals {rate}"
              + (f"  metrics staleness {cl['metrics_staleness_ms']:g} ms" if cl["metrics_staleness_ms"] else ""))
        if "pd" in cl:
            pd = cl["pd"]
            rp = pd["prefill_replicas"]
            which = "replica 0" if rp == 1 else f"replicas 0-{rp - 1}"
            print(f"P/D       {rp} prefill ({which}, router {cl['router']}) + {pd['decode_replicas']} decode "
                  f"(replicas {rp}-{cl['replicas'] - 1} overall, numbered 0-{pd['decode_replicas'] - 1} in "
                  f"decode_replica; router {pd['decode_router']}, no prefix caching); KV over {pd['kv_link_text']}; "
                  f"{pd['handed_off']} handed off")
            print(f"          first token at {pd['first_token_at']}: {pd['first_token_at_means']}")

        def per(values, fmt):
            if len(values) <= 16:
                return " ".join(fmt(v) for v in values)
            return f"min {fmt(min(values))} mean {fmt(float(np.mean(values)))} max {fmt(max(values))}"
        print(f"replicas  requests {per(cl['requests'], str)}  rejected at the router {cl['rejected_at_router']}")
        print(f"          utilisation (busy / first arrival to last end) {per(cl['utilisation'], lambda u: f'{u:.2f}')}"
              f"  imbalance {cl['imbalance']:.3f} (max / mean busy time)  prefix hit rate {cl['prefix_hit_rate']:.1%}")
    a = s["admission"]
    print(f"admission rejected {a['rejected_share']:.1%}, length-capped {a['capped_share']:.1%} of the arrivals "
          f"(max_model_len {e['max_model_len']}); ceiling {a['ceiling']:.3f}")
    if a["warning"]:
        print(f"WARNING   {a['rejected_share'] + a['capped_share']:.1%} of the arrivals can never be met: the "
              f"context limit rejects or caps them")
    print(f"goodput   {s['goodput']:.4f}   completed {s['completed']}/{s['requests']}   "
          f"end states {s['end_states']}")
    print(f"TTFT ms   p50 {s['ttft_p50_ms']:.1f}  p99 {s['ttft_p99_ms']:.1f}  (all arrived; "
          f"completed only: p50 {s['ttft_p50_completed_ms']:.1f}  p99 {s['ttft_p99_completed_ms']:.1f})")
    print(f"TPOT ms   p50 {s['tpot_p50_ms']:.2f}  p99 {s['tpot_p99_ms']:.2f}")
    print(f"thruput   {s['throughput_tok_s']:.1f} output tok/s  {s['throughput_req_s']:.3f} req/s   "
          f"preemptions {s['preemptions']}  recomputed tokens {s['recomputed_tokens']}")
    return 0
