"""The observation of TokenBatch-v0 and -v1 (docs/design.md sections 5 and 11; ``TokenBatchEnv``'s
"Observation Space"): its layout and fixed normalisation constants (``OBS_LAYOUT``, ``obs_layout``, ``obs_dim``,
``obs_scales``) and ``observe_kernel``, the compiled observation rows the engine threads write as
they advance the copies; ``observe`` observes the copies of any ``EngineRun`` (the controlled
replay's too, ``control.run_controlled``)."""

from __future__ import annotations

import math

import numpy as np

from ..engine import kernel as K
from ..engine import scoring as S
from ..engine._jit import borrow, guard_stale_cache, njit, prefetch

# ------------------------------------------------------------------ fixed normalisation constants
OBS_CLIP = 10.0              # every observation entry lies in [-10, 10]
Z_SCALE = 10.0               # z / 10  (z itself is clipped to [-50, 50] as in the index)
LOG_S_SCALE = 4.0            # ln(S / T_ref) / 4
LOG_QUEUE_SCALE = math.log1p(1024.0)     # ln(1 + waiting) / ln(1025)
LOG_TOKENS_SCALE = math.log1p(1e6)       # ln(1 + tokens) / ln(1 + 1e6)
LOG_REQ_TOKENS_SCALE = math.log1p(1e5)   # per-request prefill / decode tokens
RATE_WINDOW_S = 10.0         # arrival-rate estimate: arrivals in the last 10 s / lambda_sat
QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
N_ENGINE = 6
REQ_FEATURES = ("z", "log_s", "log_prefill_left", "log_decode_left", "prefix_ratio", "blocks_needed",
                "waited_over_t1", "to_deadline_over_tref", "log_t1_over_tref", "first_token_out")
F = len(REQ_FEATURES)
NQ = len(QUANTILES)
#: TokenBatch-v1's TPOT state (docs/design.md section 11), after the request rows
TPOT_FEATURES = ("decodes_frac", "tau_dec_over_min_t2", *[f"credit_q{int(q * 100)}" for q in QUANTILES],
                 "guarded_empty", "tpot_behind_frac")
N_TPOT = len(TPOT_FEATURES)
CREDIT_SCALE = math.log1p(100.0)   # a credit c_i / T2_i as sign(x) ln(1 + |x|) / ln(101)


def obs_layout(k: int, tpot: bool = False) -> list:
    """Names of the observation entries, in order (see ``TokenBatchEnv``'s docstring); ``tpot``
    (v1): the TPOT state last."""
    names = ["kv_free_frac", "running_frac", "log_queue_len", "log_queued_tokens", "arrival_rate_rho",
             "budget_demand"]
    names += [f"z_q{int(q * 100)}" for q in QUANTILES] + [f"log_s_q{int(q * 100)}" for q in QUANTILES]
    names += ["queue_empty", "queue_lost_frac"]
    for j in range(k):
        names += [f"req{j}_{f}" for f in REQ_FEATURES]
    names += [f"req{j}_valid" for j in range(k)]
    return names + (list(TPOT_FEATURES) if tpot else [])


OBS_LAYOUT = obs_layout(8)
#: entries before the K request rows: engine state and queue summary
N_GLOBAL = N_ENGINE + 2 * NQ + 2


def obs_dim(k: int, tpot: bool = False) -> int:
    """Length of the observation with K observed requests (``len(obs_layout(k, tpot))``)."""
    return N_GLOBAL + k * (F + 1) + (N_TPOT if tpot else 0)


_N_REQ_FEATS = 10  # features per observed request (``observe_kernel``)
_SMALL_SORT = 15  # numba's quicksort sorts up to this many items by insertion


@njit
def _lt(a, b):
    """numba's float order for sorting (NaN last)."""
    return a < b or (b != b and a == a)


@njit
def _sort_small(x, out):
    """``out[:n] = np.sort(x)`` (n = len(x)) without an allocation for small n: numba's np.sort
    sorts up to ``_SMALL_SORT`` items by this very (stable) insertion, so the result is the same to
    the bit (the order of -0.0 and 0.0 included)."""
    n = x.shape[0]
    if n > _SMALL_SORT:
        out[:n] = np.sort(x)
        return
    for i in range(n):
        v = x[i]
        j = i
        while j > 0 and _lt(v, out[j - 1]):
            out[j] = out[j - 1]
            j -= 1
        out[j] = v


@njit
def _argsort_stable(x, out):
    """``out[:n] = np.argsort(x, kind="mergesort")``: a stable sort's permutation is unique, so
    insertion gives the same one (without an allocation) for small n."""
    n = x.shape[0]
    if n > 2 * _SMALL_SORT:
        out[:n] = np.argsort(x, kind="mergesort")
        return
    for i in range(n):
        v = x[i]
        j = i
        while j > 0 and _lt(v, x[out[j - 1]]):
            out[j] = out[j - 1]
            j -= 1
        out[j] = i


@njit
def observe_kernel(active, kq, mrl, cfg_rows, fcfg_rows, ocfg, out, now, n_wait, n_run, n_free, next_arr, wait_ids,
                   run_ids, prompt, gen, computed, arrival, t1, est, hash_head, chain_off, chain_val, uniq_base,
                   epoch, tpot, status, first_token, t2, zs_buf, ls_buf, zsort, lsort, order, feats, cr_buf, cr_sort,
                   lo):
    """Observation rows of the ``active`` copies (see ``TokenBatchEnv``). The per-request entries are
    the engine's own index inputs (``kernel.request_inputs``); ``cfg_rows``/``fcfg_rows`` are the
    engine's (one row per copy),
    ``ocfg`` = [t_ref_ms, lambda_sat, rate_window_ns]; the episode start is ``epoch[c, EP_T0]``.
    ``tpot`` (v1): also the TPOT state, from ``status``, ``first_token`` and ``t2``. The last eight
    are scratch (``observe`` allocates them, so that they are borrowed too); copies below ``lo`` are
    not looked at."""
    # borrowed views (``engine._jit.borrow``): no reference counting per helper call
    zs_buf = borrow(zs_buf)
    ls_buf = borrow(ls_buf)
    zsort = borrow(zsort)
    lsort = borrow(lsort)
    order = borrow(order)
    feats = borrow(feats)
    cr_buf = borrow(cr_buf)
    cr_sort = borrow(cr_sort)
    status = borrow(status)
    first_token = borrow(first_token)
    t2 = borrow(t2)
    active = borrow(active)
    mrl = borrow(mrl)
    cfg_rows = borrow(cfg_rows)
    fcfg_rows = borrow(fcfg_rows)
    ocfg = borrow(ocfg)
    out = borrow(out)
    now = borrow(now)
    n_wait = borrow(n_wait)
    n_run = borrow(n_run)
    n_free = borrow(n_free)
    next_arr = borrow(next_arr)
    wait_ids = borrow(wait_ids)
    run_ids = borrow(run_ids)
    prompt = borrow(prompt)
    gen = borrow(gen)
    computed = borrow(computed)
    arrival = borrow(arrival)
    t1 = borrow(t1)
    est = borrow(est)
    hash_head = borrow(hash_head)
    chain_off = borrow(chain_off)
    chain_val = borrow(chain_val)
    uniq_base = borrow(uniq_base)
    epoch = borrow(epoch)
    bs = cfg_rows[0, K.C_BS]   # (one block size per engine batch)
    bsh = K.block_shift(bs)
    t_ref = ocfg[0]
    lam = ocfg[1]
    win_ns = ocfg[2]
    nq = 5
    qs = (0.0, 0.25, 0.5, 0.75, 1.0)
    nfeat = _N_REQ_FEATS
    base_req = 6 + 2 * nq + 2
    n_copies = active.shape[0]
    c_next = 0
    for c in range(lo, n_copies):
        if not active[c]:
            continue
        if c_next <= c:   # prefetch the next copy's rows (the engine's state is colder than the caches)
            c_next = K.next_active(active, c)
            if c_next < n_copies:
                prefetch(wait_ids, c_next, 0)
                prefetch(run_ids, c_next, 0)
                lo, hi = K.latest_rows(next_arr[c_next], arrival.shape[1])
                for j in range(lo, hi + 1, 8):
                    prefetch(prompt, c_next, j)
                    prefetch(gen, c_next, j)
                    prefetch(computed, c_next, j)
                    prefetch(arrival, c_next, j)
                    prefetch(t1, c_next, j)
                    prefetch(est, c_next, j)
                    prefetch(uniq_base, c_next, j)
                    prefetch(chain_off, c_next, j)
        cfg = cfg_rows[c]
        budget = cfg[K.C_BUDGET]
        # the largest chunk a prefill gets, as the engine's own S_i (docs/design.md section 4)
        chunk_cap = cfg[K.C_THRESHOLD] if 0 < cfg[K.C_THRESHOLD] < budget else budget
        usable = float(cfg[K.C_USABLE])
        max_seqs = float(cfg[K.C_MAX_SEQS])
        prefix_on = cfg[K.C_PREFIX] != 0
        ps = cfg[K.C_PS0:K.C_PS0 + 4]
        u_p = fcfg_rows[c, K.F_U_P]
        u_d = fcfg_rows[c, K.F_U_D]
        t_now = now[c]
        nw = n_wait[c]
        row = out[c]
        row[:] = 0.0
        zs = zs_buf[:nw]
        ls = ls_buf[:nw]
        queued = 0.0
        lost = 0
        for i in range(nw):
            r = wait_ids[c, i]
            hits = 0
            if prefix_on:  # the engine's prefix-cache lookup
                hits = K.prefix_hits(hash_head, chain_off, chain_val, uniq_base, c, r, prompt[c, r] + gen[c, r], bs,
                                      bsh)
            cached, p_left, blocks, first_out, to_deadline, slack, d_left, s_ms = K.request_inputs(
                True, hits, prompt[c, r], gen[c, r], 0, 0, arrival[c, r] + t1[c, r] - t_now, est[c, r], mrl, bs,
                chunk_cap, ps, u_p, u_d, bsh)
            t1_ms = t1[c, r] / 1e6
            z = S.clip_z(slack, t1_ms)
            if not first_out and slack < 0.0:
                lost += 1
            zs[i] = z
            ls[i] = math.log(s_ms / t_ref)
            queued += p_left
            feats[i, 0] = z / 10.0
            feats[i, 1] = ls[i] / 4.0
            feats[i, 2] = math.log1p(p_left) / math.log1p(1e5)
            feats[i, 3] = math.log1p(d_left) / math.log1p(1e5)
            feats[i, 4] = cached / prompt[c, r]
            feats[i, 5] = blocks / usable
            feats[i, 6] = (t_now - arrival[c, r]) / 1e6 / t1_ms
            feats[i, 7] = to_deadline / t_ref
            feats[i, 8] = math.log(t1_ms / t_ref)
            feats[i, 9] = 1.0 if first_out else 0.0
        # engine state
        row[0] = n_free[c] / usable
        row[1] = n_run[c] / max_seqs
        row[2] = math.log1p(nw) / math.log1p(1024.0)
        row[3] = math.log1p(queued) / math.log1p(1e6)
        lo = 0   # arrivals are in order: bisect for the first visible one in the rate window
        hi = next_arr[c]
        while lo < hi:
            mid = (lo + hi) // 2
            if arrival[c, mid] > t_now - win_ns:
                hi = mid
            else:
                lo = mid + 1
        cnt = next_arr[c] - lo
        span = t_now - epoch[c, K.EP_T0]
        if span > win_ns:
            span = win_ns
        if span < 1e8:
            span = 1e8
        row[4] = cnt / (span / 1e9) / lam
        demand = 0.0
        for j in range(n_run[c]):
            q = run_ids[c, j]
            left = prompt[c, q] + gen[c, q] - computed[c, q]
            if gen[c, q] > 0 and left <= 1:
                demand += 1.0
            else:
                demand += left
        demand /= budget
        row[5] = demand if demand < 1.0 else 1.0
        # queue summary
        if nw == 0:
            row[6 + 2 * nq] = 1.0
        else:
            _sort_small(zs, zsort)
            _sort_small(ls, lsort)
            for qi in range(nq):
                pos = int(qs[qi] * (nw - 1) + 0.5)
                row[6 + qi] = zsort[pos] / 10.0
                row[6 + nq + qi] = lsort[pos] / 4.0
            row[6 + 2 * nq + 1] = lost / nw
        # the K waiting requests with the lowest z (ties: the engine's waiting-list order, deterministic)
        _argsort_stable(zs, order)
        m = nw if nw < kq else kq
        for j in range(m):
            i = order[j]
            for f in range(nfeat):
                row[base_req + j * nfeat + f] = feats[i, f]
            row[base_req + kq * nfeat + j] = 1.0
        if tpot:
            _tpot_state(row, base_req + kq * (nfeat + 1), c, cfg, max_seqs, t_now, n_run, run_ids, status, prompt,
                        gen, computed, first_token, t2, cr_buf, cr_sort)
        for f in range(row.shape[0]):
            v = row[f]
            if v != v:
                row[f] = 0.0
            elif v > 10.0:
                row[f] = 10.0
            elif v < -10.0:
                row[f] = -10.0


@njit
def _tpot_state(row, at, c, cfg, max_seqs, t_now, n_run, run_ids, status, prompt, gen, computed, first_token, t2,
                cr_buf, cr_sort):
    """v1's TPOT state of copy c into ``row[at:]`` (docs/design.md section 11, the tpot-guard rule's
    own quantities, ``kernel.guard_slack``): decodes / max_num_seqs; tau_dec / the smallest T2 of the
    running requests past their first token (0 if none has a TPOT SLO); quantiles of the guarded
    requests' credits c_i / T2_i as sign(x) ln(1 + |x|) / ln(101), 0 with ``guarded_empty`` = 1 when
    none is guarded; the share of running requests behind their TPOT SLO (credit < 0: even a token
    emitted now would leave their mean time per output token above T2)."""
    D = 0
    ctx = 0
    n = 0
    for j in range(n_run[c]):
        q = run_ids[c, j]
        if status[c, q] == K.ENDED:   # async: finished, not schedulable
            continue
        n += 1
        if gen[c, q] > 0 and computed[c, q] == prompt[c, q] + gen[c, q] - 1:
            D += 1
            ctx += computed[c, q]
    tau_dec = cfg[K.C_PS0] + cfg[K.C_PS_DECODE] * D + cfg[K.C_PS_KV] * ctx   # ps
    t2_min = K.NO_TPOT_SLO_NS
    ng = 0
    lost = 0
    for j in range(n_run[c]):
        q = run_ids[c, j]
        g = gen[c, q]
        T2 = t2[c, q]
        if status[c, q] == K.ENDED or g == 0 or T2 >= K.NO_TPOT_SLO_NS:
            continue
        if T2 < t2_min:
            t2_min = T2
        credit = float(T2) * float(g) - float(t_now - first_token[c, q])   # ns
        if credit < 0.0:
            lost += 1
        if computed[c, q] == prompt[c, q] + g - 1 and T2 * 1000 > tau_dec:
            cr_buf[ng] = credit / T2
            ng += 1
    row[at] = D / max_seqs
    row[at + 1] = tau_dec / 1000.0 / t2_min if t2_min < K.NO_TPOT_SLO_NS else 0.0
    if ng == 0:
        row[at + 7] = 1.0
    else:
        _sort_small(cr_buf[:ng], cr_sort)
        for qi in range(5):
            x = cr_sort[int((0.0, 0.25, 0.5, 0.75, 1.0)[qi] * (ng - 1) + 0.5)]
            row[at + 2 + qi] = (math.log1p(x) if x >= 0.0 else -math.log1p(-x)) / math.log1p(100.0)
    row[at + 8] = lost / n if n > 0 else 0.0


# ------------------------------------------------------------------ shared with the controlled replay
def obs_scales(t_ref_ms: float, lambda_sat: float) -> np.ndarray:
    """The observation's normalisation constants beyond the engine's (``observe``'s ``ocfg``)."""
    return np.array([t_ref_ms, lambda_sat, RATE_WINDOW_S * 1e9])


def observe(run, mask, obs, k: int, ocfg, tpot: bool = False) -> None:
    """Observation rows of the ``mask`` copies of an ``EngineRun`` (episode start: ``start_epochs``);
    ``tpot``: v1's, with the TPOT state."""
    observe_kernel(mask, *observe_args(run, obs, k, ocfg, tpot), 0)


def observe_args(run, obs, k: int, ocfg, tpot: bool = False) -> tuple:
    """``observe_kernel``'s arguments after its mask (with fresh scratch: one set per thread)."""
    A = run.arrays
    return (k, run.mrl, run.cfg, run.fcfg, ocfg, obs, A.now, A.n_wait, A.n_run, A.n_free, A.next_arr, A.wait_ids,
            A.run_ids, A.prompt, A.gen, A.computed, A.arrival, A.t1, A.est, A.hash_head, A.chain_off, A.chain_val,
            A.uniq_base, A.epoch, bool(tpot), A.status, A.first_token, A.t2, *_observe_scratch(A.wait_ids.shape[1]))


def _observe_scratch(R: int):
    """``observe_kernel``'s scratch for queues of up to R requests (z, ln S and their sorted copies, an
    order, the per-request features; v1's credits and their sorted copy)."""
    return (np.empty(R), np.empty(R), np.empty(R), np.empty(R), np.empty(R, np.int64),
            np.empty((R, _N_REQ_FEATS)), np.empty(R), np.empty(R))


# (last: every compiled function of this module is defined) ``observe_kernel`` links engine code
# (``kernel.request_inputs``): flush this module's cached machine code when any engine source changes
# (the engine's own guard, one implementation)
guard_stale_cache([_lt, _sort_small, _argsort_stable, _tpot_state, observe_kernel], tag="envs.observation")
