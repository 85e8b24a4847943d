"""From an engine profile and a trace to capacity-audit records, and the fluid model beside the
simulator (docs/design.md section 9; ``tokenbatch audit --trace FILE --profile NAME``).

The fluid audit (:mod:`tokenbatch_env.capacity`) knows nothing of engines or traces: it takes a
``SchedulerProfile`` (a token rate, its prefill/decode split, an iteration time, batch limits) and
``RequestClass`` records (rates, mean sizes, peak concurrency). This module derives those records
from what the engine knows, audits them, replays the same trace through the simulator (FCFS, the
default ``EngineConfig``) and sets each fluid prediction beside the measurement.

Mapping choices (every one is also echoed in the ``mapping`` block of the output)
----------------------------------------------------------------------------------

**Served requests.** Demand is what the engine will actually serve: requests whose prompt is
``>= max_model_len`` are rejected at arrival (docs/design.md section 3, rule 8) and are left out of
every mean and rate (their count is reported); outputs are capped at ``max_model_len - prompt``
as the engine caps them. ``P`` and ``O`` below are the served prompts and (capped) outputs.

**Scheduler profile.**

- ``token_capacity_per_second = floor(lambda_sat * mean(P + O))`` with
  ``lambda_sat = measure_lambda_sat(trace, profile)`` (FCFS's always-backlogged completion rate).
- ``prefill_share_permille = round(1000 * sum(P) / sum(P + O))`` (the trace's token mix, clamped to
  1..999). The fluid audit counts all ``O`` output tokens as decode work, so the split uses ``O``
  too, although the engine emits the first token with the prefill's last chunk.
- ``iteration_time_ms = ceil(t(typical batch))`` from the profile's cost model. The *typical
  batch* is the fluid mean iteration of an engine completing ``lambda_sat`` requests per second:
  an iteration of length ``T`` carries ``lambda_sat * T`` requests' worth of work, i.e.
  ``c = lambda_sat*T*mean(P)`` prefill tokens and ``D = lambda_sat*T*(mean(O)-1)`` decodes (the
  first output token rides with the prefill), and ``T = t(c, D, ...)`` is solved as a fixed point
  (start ``T = c0``). If ``c + D`` would exceed the token budget B, both are scaled down to fill
  exactly B (``budget_bound``: the budget-limited regime); D is capped at ``max_num_seqs``. This
  covers both saturation regimes: a KV-limited engine (few running requests, small batches) and a
  budget-limited one (full batches). The per-chunk cost terms spread a prompt's prefill evenly
  over iterations (its chunk is ``min(P, c)`` tokens) and use size-biased expectations (a prefill
  token belongs to a prompt of size ``P`` with probability proportional to ``P``):
  ``sum(chunk^2) = c * E[P min(P,c)] / E[P]``, ``sum(chunk * computed_before) =
  c * E[P max(P-c,0)] / (2 E[P])``; a decode's context is its decode-step-weighted mean
  ``E[(O-1)(P + O/2)] / E[O-1]``. The terms are rounded to integers and timed by
  ``CostModel.iteration_ns``. The mapping also shows the iteration time *implied* by a full budget
  at ``lambda_sat`` (``B / (lambda_sat * (mean(P) + mean(O) - 1))``) and the simulator's measured
  mean iteration, so the choice can be judged.
- ``max_prefill_chunk_tokens = min(B, per-iteration prefill service)`` where the service is the
  audit's own ``prefill_capacity * iteration_time_ms // 1000``; so the audit's validation
  ("prefill chunk exceeds declared per-iteration service") holds by construction.
- ``max_active_sequences = profile.max_num_seqs``;
  ``kv_bytes_per_token = profile.kv_bytes_per_token``.
- ``max_consecutive_priority_iterations``: a user input (``--priority-iterations``), default
  :data:`DEFAULT_PRIORITY_ITERATIONS` = 1: the engine runs FCFS, which never serves a later
  arrival ahead of an earlier one, so the smallest bound the record accepts is the honest one.
- ``admission_control_enabled = False``: the engine, like vLLM, admits every arrival (admission
  control at arrival is a beyond-vLLM option, off). The audit therefore always reports
  ``admission-control-disabled``; that REJECT is by design and the output says so, listing the
  other violations separately.
- ``scheduler_id = "tokenbatch-fcfs-<profile>"``.

**Request classes.** One per ``class_id`` present in the trace when the trace carries SLOs, else
one class ``all``; classes are named ``class-<id>``. Per class:

- ``arrival_millirps = round(1000 * n_k / span_s)`` with ``span_s`` the trace's arrival span
  (first to last arrival; at least 1 ms), i.e. the class's share of the trace's mean rate.
- ``prompt_tokens``, ``output_tokens``: the class's means, rounded half up (at least 1).
- ``priority``: 1 + the dense rank of the class's most common trace priority (lower is served
  first in both), capped at 1000.
- ``peak_concurrency``: the simulator's peak number of the class's requests in service at once
  (intervals ``[first_scheduled, finish)`` of the FCFS replay, at least 1). This is a measured
  input, not a prediction; the mapping also shows Little's law (``lambda_k * mean service time``)
  for comparison. The per-class peaks need not coincide, so their sum can exceed the engine's
  measured peak (reported as "active sequences").

**Scope.** Eight identities derived deterministically from the trace digest, the profile and the
mapping version (see :func:`derive_scope`). A contract given by file fixes the scope instead: the
workload is then built in the contract's scope, so the two bind.

**Default contract** (no ``--contract``), from the trace's SLOs (assigned by the default SLA rule
with seed 0, relative to the *audited* profile's idle TTFT, when the trace has none):
``max_ttft_ms = ceil(median T1)``, ``max_tpot_ms = ceil(median T2)``, ``max_queue_delay_ms`` and
``max_starvation_ms`` = the same median T1 (a request should neither wait nor starve longer than its
first-token budget), utilization caps 999/999/999 (the largest the record accepts: "not saturated"),
``max_kv_bytes = usable_blocks * block_size * kv_bytes_per_token`` (the engine's KV pool).

**Simulated side** (FCFS replay of the same trace, per-iteration records on):
utilization = busy time (sum of iteration durations) / makespan (first arrival to last finish);
the prefill/decode utilizations are that times the scheduled prefill (decode) token share over the
mapping's prefill (decode) share, the analogue of the fluid ``demand / (capacity * share)``;
queue delay = mean of ``first_scheduled - arrival``; worst TTFT = max (and p99) over requests that
got a first token; TPOT = mean over completed requests with ``O > 1``; peak KV bytes = max
``blocks_used`` x ``block_size`` x ``kv_bytes_per_token`` (blocks held by requests; freed blocks
that still hold cached prefixes count as free, as in the engine; a shared prefix block counts
once). The table's notes say where and why the two columns differ; the fluid model sees mean
rates and mean sizes, the simulator sees bursts, the size distribution and head-of-line blocking.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import numpy as np

from .capacity import (BatchingContract, BatchingReport, BatchingWorkload, CapacityError,
                       RequestClass, SchedulerProfile, SCOPE_SIZE, audit_batching)

__all__ = ["BRIDGE_VERSION", "DEFAULT_PRIORITY_ITERATIONS", "TraceAudit", "derive_scope",
           "default_contract", "typical_batch", "audit_trace", "format_trace_audit"]

BRIDGE_VERSION = "tokenbatch-capacity-bridge-v1"
#: Default ``max_consecutive_priority_iterations`` (FCFS never lets a later arrival overtake).
DEFAULT_PRIORITY_ITERATIONS = 1
#: Cap on per-iteration records kept for the simulated side (10 int64 columns each).
MAX_RECORDED_ITERATIONS = 4_000_000
_UTIL_CAP = 999
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_.:/@-]")


def _ident(text: str) -> str:
    """``text`` made a valid audit identity (disallowed characters become ``-``, <= 128 chars)."""
    s = _BAD_ID_CHARS.sub("-", str(text))
    if not s or not s[0].isalnum():
        s = "x" + s
    return s[:128]


def _ceil_ms(ns) -> int:
    return int(-(-int(ns) // 1_000_000))


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def derive_scope(trace_digest: str, profile, priority_iterations: int, sla_source: str) -> tuple:
    """The eight scope identities of a trace audit (deterministic, distinct)."""
    p = profile
    scope = (
        BRIDGE_VERSION,
        f"trace:{trace_digest}",
        _ident(f"profile:{p.name}"),
        _ident(f"profile-provenance:{p.provenance}"),
        f"engine:vllm-v1-fcfs:B{p.max_num_batched_tokens}:S{p.max_num_seqs}:bs{p.block_size}",
        f"kv-pool:{p.usable_blocks}x{p.block_size}x{p.kv_bytes_per_token}",
        _ident(f"sla:{sla_source}"),
        f"priority-iterations:{priority_iterations}",
    )
    assert len(set(scope)) == SCOPE_SIZE
    return scope


def typical_batch(P: np.ndarray, O: np.ndarray, profile, lambda_sat: float) -> dict:
    """The fluid mean batch of an FCFS engine serving ``lambda_sat`` requests/s, and its cost-model
    time ``t_ns`` (see the module docstring): the fixed point of ``T = t(batch(T))``, where an
    iteration of length T carries ``lambda_sat * T`` requests' worth of work, scaled down to the
    token budget B when it would exceed it (``budget_bound``)."""
    B, S = profile.max_num_batched_tokens, profile.max_num_seqs
    P = P.astype(np.float64)
    O = O.astype(np.float64)
    pm, om1 = float(P.mean()), float((O - 1).mean())
    ctx_d = float(((O - 1) * (P + O / 2)).mean()) / om1 if om1 > 0 else 0.0
    cost = profile.cost
    lam_ms = lambda_sat / 1000.0  # requests per ms

    def batch(T_ms: float):
        n = lam_ms * T_ms
        c, D = n * pm, n * om1
        bound = c + D > B
        if bound:
            f = B / (c + D)
            c, D = c * f, D * f
        D = min(D, float(S))
        c = max(c, 1.0)
        csq = c * float((P * np.minimum(P, c)).mean()) / pm
        cctx = c * float((P * np.maximum(P - c, 0)).mean()) / (2 * pm)
        return c, D, csq, cctx, D * ctx_d, bound

    def t_ms(b) -> float:
        c, D, csq, cctx, dctx, _ = b
        return (cost.c0 + cost.c_prefill * c + cost.c_c2 * csq + cost.c_attn * cctx
                + cost.c_decode * D + cost.c_kv * dctx)

    T = cost.c0
    for _ in range(200):
        T_new = t_ms(batch(T))
        if abs(T_new - T) <= 1e-9 * max(1.0, T):
            T = T_new
            break
        T = T_new
    c, D, csq, cctx, dctx, bound = batch(T)
    ints = [_round_half_up(x) for x in (c, csq, cctx, D, dctx)]
    t_ns = int(cost.iteration_ns(*ints))
    return {"prefill_tokens": ints[0], "sum_chunk_sq": ints[1], "sum_chunk_ctx": ints[2],
            "decodes": ints[3], "sum_decode_ctx": ints[4], "budget_bound": bool(bound),
            "t_ns": t_ns}


def default_contract(trace, profile, scope: tuple) -> BatchingContract:
    """The contract derived from the trace's SLOs (see the module docstring)."""
    t1 = max(1, _ceil_ms(np.median(trace.ttft_slo_ns)))
    t2 = max(1, _ceil_ms(np.median(trace.tpot_slo_ns)))
    day = 86_400_000
    t1, t2 = min(t1, day), min(t2, day)
    kv = profile.usable_blocks * profile.block_size * profile.kv_bytes_per_token
    return BatchingContract(
        scope=scope, max_total_utilization_permille=_UTIL_CAP,
        max_prefill_utilization_permille=_UTIL_CAP, max_decode_utilization_permille=_UTIL_CAP,
        max_queue_delay_ms=t1, max_ttft_ms=t1, max_tpot_ms=t2, max_starvation_ms=t1,
        max_kv_bytes=min(kv, 10**18))


def _peak_overlap(start: np.ndarray, end: np.ndarray) -> int:
    """Most half-open intervals ``[start, end)`` alive at once (ends sort before equal starts)."""
    if start.size == 0:
        return 0
    t = np.concatenate([start, end])
    d = np.concatenate([np.ones(start.size, np.int64), -np.ones(end.size, np.int64)])
    order = np.lexsort((d, t))
    return int(np.cumsum(d[order]).max())


@dataclasses.dataclass
class TraceAudit:
    """The result of :func:`audit_trace`: the records, the audit, the comparison, the mapping."""

    contract: BatchingContract
    workload: BatchingWorkload
    report: BatchingReport
    rows: list          # [{quantity, fluid, simulated, note}]
    mapping: dict

    @property
    def other_violations(self) -> tuple:
        return tuple(v for v in self.report.violations if v != "admission-control-disabled")

    def to_dict(self) -> dict:
        return {"audit": self.report.to_dict(), "fluid_vs_sim": self.rows, "mapping": self.mapping}


def audit_trace(trace, profile, *, contract: Optional[BatchingContract] = None,
                priority_iterations: int = DEFAULT_PRIORITY_ITERATIONS, sla_seed: int = 0,
                lambda_sat: Optional[float] = None) -> TraceAudit:
    """Derive the records from ``trace`` and ``profile`` (a Profile), audit, simulate FCFS and
    compare. ``lambda_sat`` may be given to skip its measurement (tests); otherwise it is
    ``measure_lambda_sat(trace, profile)``."""
    from .engine.kernel import E_COMPLETED
    from .engine.saturation import measure_lambda_sat
    from .engine.simulate import simulate
    from .engine.state import EngineConfig, capped_outputs
    from .errors import ConfigError
    from .traces.sla import DEFAULT_SLA, SlaSpec, assign_slas

    if type(priority_iterations) is not int or not 1 <= priority_iterations <= 1_000_000:
        raise CapacityError("bounded non-boolean integer required", where="--priority-iterations",
                            detail=f"got {priority_iterations!r}; valid: an int in [1, 1000000]")
    if len(trace) == 0:
        raise ConfigError(f"trace {trace.name!r} is empty")

    # --- SLOs and classes
    had_slos = trace.has_slos
    if had_slos:
        sla_source = "trace"
        trace_for_contract = trace
    else:
        # SLOs relative to the audited profile's idle TTFT (a profile from a file: the default
        # rule's own profile), used for the default contract only; one request class.
        spec = SlaSpec(profile.name if _is_shipped(profile) else DEFAULT_SLA.profile,
                       DEFAULT_SLA.classes)
        trace_for_contract = assign_slas(trace, spec, seed=sla_seed)
        sla_source = f"assigned-default-seed{sla_seed}-{spec.profile}"

    # --- served requests (rule 8)
    max_len = profile.max_model_len
    served = trace.prompt_tokens < max_len
    n_rejected = int((~served).sum())
    if not served.any():
        raise ConfigError(f"trace {trace.name!r}: every prompt is >= max_model_len {max_len} of "
                          f"profile {profile.name!r}; nothing to audit")
    P = trace.prompt_tokens[served].astype(np.int64)
    # (as one row: the engine's [copies, requests] arrays, so one compiled variant)
    O, _capped = (x[0] for x in capped_outputs(P[None, :], trace.output_tokens[served].astype(np.int64)[None, :],
                                               max_len))
    n_capped = int(_capped.sum())

    # --- scope and contract
    derived_scope = derive_scope(trace.digest, profile, priority_iterations, sla_source)
    if contract is None:
        contract = default_contract(trace_for_contract, profile, derived_scope)
        contract_source = "derived from the trace's SLOs"
    else:
        contract_source = "file"
    scope = contract.scope

    # --- lambda_sat and the scheduler profile
    if lambda_sat is None:
        lambda_sat = measure_lambda_sat(trace, profile)
    if not (math.isfinite(lambda_sat) and lambda_sat > 0):
        raise ConfigError(f"lambda_sat must be a positive finite rate, measured {lambda_sat!r}")
    mean_total = float((P + O).sum()) / P.size
    capacity = int(math.floor(lambda_sat * mean_total))
    share = min(999, max(1, _round_half_up(1000 * float(P.sum()) / float((P + O).sum()))))
    tb = typical_batch(P, O, profile, lambda_sat)
    iter_ms = max(1, _ceil_ms(tb["t_ns"]))
    B = profile.max_num_batched_tokens
    per_iteration = capacity * share // 1000 * iter_ms // 1000
    chunk = max(1, min(B, per_iteration))
    sched = SchedulerProfile(
        scope=scope, scheduler_id=_ident(f"tokenbatch-fcfs-{profile.name}"),
        token_capacity_per_second=capacity, prefill_share_permille=share,
        max_active_sequences=profile.max_num_seqs, max_prefill_chunk_tokens=chunk,
        iteration_time_ms=iter_ms, max_consecutive_priority_iterations=priority_iterations,
        kv_bytes_per_token=profile.kv_bytes_per_token)

    # --- simulate FCFS (same trace, same engine)
    B_ = profile.max_num_batched_tokens
    bound = int((-(-P // B_) + O).sum() + -(-int((P + O).sum()) // B_) + 1024)
    n_rec = min(bound, MAX_RECORDED_ITERATIONS)
    res = simulate(trace, profile, "fcfs", EngineConfig(record_iterations=n_rec))
    rec = res.records(0)
    its = res.iterations(0)
    n_iter_total = int(res.arrays.it[0])
    truncated_iters = len(its["iteration"]) < n_iter_total

    # --- request classes
    arr = trace.arrival_ns
    span_ns = max(int(arr[-1] - arr[0]), 1_000_000)
    cls_all = trace_for_contract.class_id if had_slos else np.zeros(len(trace), np.int64)
    prio_all = trace_for_contract.priority if had_slos else np.zeros(len(trace), np.int64)
    cls_served = cls_all[served]
    fs, fin = rec["first_scheduled_ns"], rec["finish_ns"]
    end_of_run = int(max(fin.max(), fs.max(), 0))
    ids = sorted(set(cls_served.tolist()))
    prio_levels = sorted(set(int(np.bincount(prio_all[served][cls_served == k] -
                                             prio_all.min()).argmax() + prio_all.min())
                             for k in ids))
    classes, class_map = [], []
    for k in ids:
        m = cls_served == k
        idx = np.flatnonzero(served)[m]
        n_k = int(m.sum())
        pk = prio_all[idx]
        mode_prio = int(np.bincount(pk - prio_all.min()).argmax() + prio_all.min())
        rank = min(1000, 1 + prio_levels.index(mode_prio))
        millirps = max(1, _round_half_up(1000.0 * n_k * 1e9 / span_ns))
        pm = max(1, _round_half_up(float(P[m].mean())))
        om = max(1, _round_half_up(float(O[m].mean())))
        started = fs[idx] >= 0
        st = fs[idx][started]
        en = np.where(fin[idx][started] >= 0, fin[idx][started], end_of_run)
        peak = max(1, _peak_overlap(st, en))
        little = (n_k / (span_ns / 1e9)) * (float((en - st).mean()) / 1e9 if st.size else 0.0)
        name = f"class-{k}" if had_slos else "all"
        classes.append(RequestClass(scope=scope, class_id=_ident(name), priority=rank,
                                    arrival_millirps=millirps, prompt_tokens=pm, output_tokens=om,
                                    peak_concurrency=peak))
        class_map.append({"class_id": _ident(name), "trace_class_id": int(k) if had_slos else None,
                          "requests": n_k, "trace_priority": mode_prio, "priority": rank,
                          "arrival_millirps": millirps, "prompt_tokens": pm, "output_tokens": om,
                          "peak_concurrency": peak,
                          "littles_law_mean_in_service": round(little, 3)})
    workload = BatchingWorkload(scope=scope, contract_content_id=contract.content_id,
                                scheduler=sched, request_classes=tuple(classes),
                                admission_control_enabled=False)
    report = audit_batching(contract, workload)

    # --- the simulated side
    bs, kvb = profile.block_size, profile.kv_bytes_per_token
    es = rec["end_state"]
    got_tok = rec["first_token_ns"] >= 0
    ttft_ms = (rec["ttft_ns"][got_tok] / 1e6)
    sched_ok = fs >= 0
    queue_ms = float(((fs - rec["arrival_ns"])[sched_ok]).mean() / 1e6) if sched_ok.any() else None
    tp_mask = (es == E_COMPLETED) & (rec["output_tokens"] > 1)
    tpot_ms = float(rec["tpot_ns"][tp_mask].mean() / 1e6) if tp_mask.any() else None
    makespan = int(fin.max() - rec["arrival_ns"].min()) if (fin >= 0).any() else 0
    dur = its["end_ns"] - its["start_ns"]
    busy = int(dur.sum())
    pre_tok, dec_tok = int(its["prefill_tokens"].sum()), int(its["decodes"].sum())
    tok = pre_tok + dec_tok
    util = busy / makespan if makespan > 0 and not truncated_iters else None
    sim_share = pre_tok / tok if tok else None
    peak_blocks = int(its["blocks_used"].max()) if len(dur) else 0
    peak_running = int(its["running"].max()) if len(dur) else 0
    mean_iter_ms = float(dur.mean() / 1e6) if len(dur) else None

    def pm_(x):
        return None if x is None else int(round(1000 * x))

    sim_pre_util = (None if util is None or sim_share is None
                    else util * sim_share / (share / 1000))
    sim_dec_util = (None if util is None or sim_share is None
                    else util * (1 - sim_share) / (1 - share / 1000))
    win = 60_000_000_000
    counts = np.bincount(((arr - arr[0]) // win).astype(np.int64)[served])
    mean_per_win = served.sum() * win / span_ns
    burst = float(counts.max() / mean_per_win) if span_ns >= win else 1.0
    r = report
    fluid_active = sum(c.peak_concurrency for c in classes)
    trunc_note = " (iteration records truncated: n/a)" if truncated_iters else ""
    rows = [
        _row("utilization_permille", r.total_utilization_permille, pm_(util),
             "fluid: mean demand / capacity; sim: busy time / makespan" + trunc_note
             + _why_util(r.total_utilization_permille, pm_(util))),
        _row("prefill_utilization_permille", r.prefill_utilization_permille, pm_(sim_pre_util),
             "sim: busy share x scheduled prefill-token share / prefill_share; sim prefill "
             "excludes prefix-cache hits and includes recomputation"),
        _row("decode_utilization_permille", r.decode_utilization_permille, pm_(sim_dec_util),
             "sim counts O-1 decode tokens per request (the first token rides with the prefill)"),
        _row("prefill_token_share_permille", share, pm_(sim_share),
             "mapping: sum(P)/sum(P+O) of served requests; sim: scheduled prefill / all tokens"),
        _row("iteration_ms", iter_ms, _r(mean_iter_ms, 3),
             "fluid: cost model at the mean batch of an engine completing lambda_sat req/s ("
             + ("budget-bound: B tokens" if tb["budget_bound"] else "below the token budget")
             + "); sim: mean over the iterations run (smaller batches below saturation)"),
        _row("queue_delay_ms", r.estimated_queue_delay_ms, _r(queue_ms, 3),
             "fluid: iteration*rho/(1-rho), one iteration as the service time, at the MEAN rate; "
             "sim: mean first_scheduled - arrival"
             + (f"; sim higher: a request needs ceil(P/chunk) iterations of prefill service and "
                f"waits behind earlier ones (FCFS, head-of-line blocking on KV and batch slots), "
                f"and arrivals come in bursts (peak 60 s rate {burst:.1f}x the mean)"
                if queue_ms is not None and queue_ms > r.estimated_queue_delay_ms else "")),
        _row("worst_ttft_ms", r.estimated_worst_ttft_ms,
             _r(float(ttft_ms.max()) if ttft_ms.size else None, 3),
             "fluid: mean queue + the worst class's MEAN-prompt prefill; sim: max over requests "
             "with a first token (the largest prompts, the worst burst)"),
        _row("ttft_p99_ms", None, _r(_p99(ttft_ms), 3), "sim only (requests with a first token)"),
        _row("tpot_ms", r.estimated_tpot_ms, _r(tpot_ms, 3),
             "fluid: max(iteration, sum(peak concurrency) / decode capacity), the decode partition "
             "shared by all concurrent sequences; sim: mean over completed requests, where one "
             "iteration decodes every running sequence and may carry a prefill chunk"),
        _row("active_sequences", fluid_active, peak_running,
             "fluid: sum of per-class simulated peaks (they need not coincide); sim: max running"),
        _row("peak_kv_bytes", r.peak_kv_bytes, peak_blocks * bs * kvb,
             "fluid: every concurrent request holds its full P+O; sim: max blocks_used x "
             f"block_size x kv_bytes_per_token{trunc_note}"
             + ("; sim filled the whole KV pool (the engine's real limit: it queues or preempts "
                "instead)" if peak_blocks >= profile.usable_blocks else "")),
        _row("starvation_bound_ms", r.declared_starvation_bound_ms, None,
             "fluid only: (priority iterations + 1) x iteration; FCFS never reorders"),
    ]
    implied_ms = (B * 1000.0 / (lambda_sat * (float(P.mean()) + float(O.mean()) - 1))
                  if float(P.mean()) + float(O.mean()) > 1 else None)
    mapping = {
        "bridge": BRIDGE_VERSION,
        "trace": {"name": trace.name, "digest": trace.digest, "requests": len(trace),
                  "served_requests": int(P.size), "rejected_at_arrival": n_rejected,
                  "length_capped": n_capped, "arrival_span_s": span_ns / 1e9,
                  "peak_60s_rate_over_mean": round(burst, 3),
                  "slos": sla_source},
        "profile": {"name": profile.name, "provenance": profile.provenance,
                    "max_num_batched_tokens": B, "max_num_seqs": profile.max_num_seqs,
                    "block_size": bs, "usable_blocks": profile.usable_blocks,
                    "kv_bytes_per_token": kvb, "max_model_len": max_len},
        "lambda_sat_rps": lambda_sat,
        "mean_prompt_tokens": float(P.mean()), "mean_output_tokens": float(O.mean()),
        "token_capacity_per_second": capacity,
        "prefill_share_permille": share,
        "typical_batch": tb, "iteration_time_ms": iter_ms,
        "implied_iteration_ms_at_lambda_sat": implied_ms,
        "prefill_service_per_iteration": per_iteration, "max_prefill_chunk_tokens": chunk,
        "max_consecutive_priority_iterations": priority_iterations,
        "admission_control_enabled": False,
        "classes": class_map,
        "scope": list(scope), "derived_scope": list(derived_scope),
        "contract_source": contract_source,
        "contract": contract.to_dict(), "workload": workload.to_dict(),
        "simulation": {"policy": "fcfs", "iterations": n_iter_total,
                       "iterations_recorded": int(len(dur)), "busy_ms": busy / 1e6,
                       "makespan_ms": makespan / 1e6, "peak_blocks_used": peak_blocks,
                       "end_states": _end_states(es), "preemptions": int(rec["preemptions"].sum())},
        "admission_control_note": ("admission-control-disabled is reported by design: the engine "
                                   "(like vLLM) has no admission control"),
    }
    return TraceAudit(contract, workload, report, rows, mapping)


def _is_shipped(profile) -> bool:
    from .engine.profiles import list_profiles

    return profile.name in list_profiles()


def _end_states(es: np.ndarray) -> dict:
    from .engine.kernel import END_STATE_NAMES

    return {n: int((es == i).sum()) for i, n in enumerate(END_STATE_NAMES) if (es == i).any()}


def _p99(x: np.ndarray):
    return float(np.percentile(x, 99, method="inverted_cdf")) if x.size else None


def _r(x, nd):
    return None if x is None else round(float(x), nd)


def _row(quantity, fluid, sim, note) -> dict:
    return {"quantity": quantity, "fluid": fluid, "simulated": sim, "note": note}


def _why_util(fluid, sim) -> str:
    if fluid is None or sim is None:
        return ""
    if sim > fluid:
        return ("; sim higher: below saturation iterations are smaller and pay the fixed cost c0 "
                "more often than at the saturated token rate")
    if sim < fluid:
        return ("; sim lower: the engine ran bigger, more efficient batches than the capacity "
                "assumes")
    return ""


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def format_trace_audit(ta: TraceAudit) -> str:
    """The readable report: the mapping headline, the comparison table, the decision and ids."""
    m, r = ta.mapping, ta.report
    t, p = m["trace"], m["profile"]
    lines = [
        f"trace    {t['name']}  {t['requests']} requests ({t['served_requests']} served, "
        f"{t['rejected_at_arrival']} rejected at arrival: prompt >= max_model_len "
        f"{p['max_model_len']}), digest {t['digest'][:16]}, SLOs: {t['slos']}",
        f"profile  {p['name']} [{p['provenance']}]  B={p['max_num_batched_tokens']} "
        f"max_num_seqs={p['max_num_seqs']}",
        f"mapping  lambda_sat={m['lambda_sat_rps']:.4f} req/s x mean(P+O)="
        f"{m['mean_prompt_tokens'] + m['mean_output_tokens']:.1f} -> capacity "
        f"{m['token_capacity_per_second']} tok/s; prefill share {m['prefill_share_permille']} "
        f"permille; iteration {m['iteration_time_ms']} ms (typical batch "
        f"{m['typical_batch']['decodes']} decodes + {m['typical_batch']['prefill_tokens']} "
        f"prefill tokens); chunk {m['max_prefill_chunk_tokens']}; classes "
        + ", ".join(f"{c['class_id']}({c['arrival_millirps']} mrps, P={c['prompt_tokens']}, "
                    f"O={c['output_tokens']}, peak={c['peak_concurrency']})" for c in m["classes"]),
        f"contract {m['contract_source']}",
        "",
    ]
    head = ("quantity", "fluid", "simulated", "note")
    table = [head] + [(row["quantity"], _fmt(row["fluid"]), _fmt(row["simulated"]), row["note"])
                      for row in ta.rows]
    w = [max(len(x[i]) for x in table) for i in range(3)]
    for x in table:
        lines.append(f"{x[0]:<{w[0]}} | {x[1]:>{w[1]}} | {x[2]:>{w[2]}} | {x[3]}")
    lines.append("")
    lines.append(f"decision={r.decision}")
    if r.violations:
        lines.append(f"violations={','.join(r.violations)}")
        lines.append("note: admission-control-disabled is by design (the engine, like vLLM, has no "
                     "admission control); other violations: "
                     + (",".join(ta.other_violations) or "none"))
    lines += [
        f"{'contract content_id':<22}{ta.contract.content_id}",
        f"{'workload content_id':<22}{ta.workload.content_id}",
        f"{'evidence_id':<22}{r.evidence_id}",
        f"claim={r.claim} (the simulated column is the engine's FCFS replay)",
    ]
    return "\n".join(lines) + "\n"
