"""Upper bound on the number of requests any scheduler can serve within SLA (docs/design.md section 6).

``upper_bound(trace, profile)`` returns a :class:`BoundResult` whose ``ub`` is >= the ``met`` count
of *every* policy the engine can run on ``trace`` (FCFS, priority, score policies, oracles, shedding,
time-outs), because every step below only relaxes the engine. All coefficients of the cost model
are >= 0, which is what makes each step a relaxation.

Notation (request i): a = arrival (ns), N = prompt tokens, O = output tokens, T1/T2 = TTFT/TPOT SLO
(ns), bs = block size, B = the profile's B_max (``budget_max``: its max_num_batched_tokens unless it
gives a larger ``b_max``), c_* = cost coefficients in integer ps.

Best-case cached prefix
-----------------------
The engine looks up cached blocks only when a request holds nothing (admission, resume); hits are a
contiguous run of cached full blocks from block 0, capped at ``floor((tokens - 1)/bs)`` blocks
(vLLM's "at least one token is computed" cap; ``tokens = N`` before the first token). Blocks of i
that other requests can have computed are exactly its shared chain (``trace.prefix_chain(i)``); the
blocks past the chain are unique to i (they can only be hit after i itself computed them). So the
largest prefix i can ever find cached *before it computed anything* is

    h_i = bs * min(len(chain_i), floor((N - 1)/bs))        (0 with prefix caching off),

and every position in ``[h_i, N)`` must be computed by i itself, at least once, before its first
token: P_i = N - h_i prefill tokens.

(a) Unattainable requests
-------------------------
* ``N >= max_model_len`` (rejected at arrival) or ``O > max_model_len - N`` (``length_capped``,
  never met).
* TTFT. Before its first token, i's prefill runs as one or more *passes* (a preemption restarts a
  pass at the then-cached prefix). Each pass is a run of chunks ``[s, s+k)``, one per iteration,
  and an iteration containing such a chunk lasts at least ``c0 + c_p k + c_c2 k^2 + c_attn k s``
  (the other terms and the other requests only add). Gluing passes (truncating an earlier pass at
  the start of the next one, which only lowers its cost) shows the total is >= the cost of ONE pass
  from some h <= h_i to N. For one contiguous pass of P = N - h tokens in m chunks
  ``sum_j k_j s_j = h P + (P^2 - sum k^2)/2``, so its cost is

      m c0 + c_p P + (c_c2 - c_attn/2) sum k^2 + c_attn (N^2 - h^2)/2.

  With alpha = c_c2 - c_attn/2 >= 0 (all shipped profiles) the chunk-dependent part is minimised
  by m ~ P sqrt(alpha/c0) equal-sized chunks (m >= ceil(P/B)); we evaluate the exact integer
  minimum over m (discrete convexity: candidates around the real optimum, plus m = ceil(P/B)).
  Every term decreases with h, so h = h_i is the minimum. (alpha < 0: a looser valid bound, m =
  ceil(P/B) and sum k^2 <= N min(N, B).) NOTE: this is *not* ``CostModel.idle_prefill_ns(P, B)``:
  with c_c2 > c_attn/2 (stress-512, llama2-7b-a100: splitting a 2048 chunk into two of 1024 saves
  ~5.6 ms) chunking at B is not the fastest way to prefill, so ``idle_prefill_ns`` is not a lower
  bound on TTFT. Each iteration's ns time is ``ceil(ps/1000)``, so ``ceil(sum ps / 1000)`` is a
  lower bound on the sum. i is unattainable if this exceeds T1.
* TPOT. Each of the O-1 later tokens is emitted by its own iteration after the first token's
  iteration: either a decode (``c0 + c_d + c_kv * ctx``, ctx >= N; we use the smallest context N),
  or the recompute-completing chunk of a resume after a preemption. A resume of ``t = N + g``
  tokens hits at most ``floor((t-1)/bs)`` blocks, so its last chunk has k >= ((t-1) mod bs) + 1
  tokens; a 1-token chunk with ``computed == t - 1`` is *classified as a decode* by the kernel
  (kernel.py cost loop), so a cheaper-than-decode emission needs k >= 2 prefill tokens:
  ``c0 + c_p k + c_c2 k^2``. With prefix caching off a resume recomputes all t >= N+1 tokens
  between two emissions: ``c0 ceil((N+1)/B) + c_p (N+1)``. Per emission we take the min of the two
  (in ns, rounded up per iteration) and sum over g = 1..O-1; i is unattainable if the sum exceeds
  ``T2 (O-1)`` (plus a float-rounding margin, see ``_tpot_margin``, only when T2(O-1) >= 2^52 ns).

(b) Work relaxation
-------------------
An iteration with p prefill and d decode tokens, p + d <= B, lasts at least
``c0 + c_p p + c_d d >= p u_p + d u_d`` with ``u_p = c0/B + c_p``, ``u_d = c0/B + c_d``. Share each
iteration's time among the requests in it in proportion to these terms: the engine is then a single
unit-speed machine, and i receives

    w^p_i = P_i u_p                    before its first token, i.e. inside [a_i, D1_i],
    w_i   = w^p_i + sum_g e_g          before it finishes,     i.e. inside [a_i, D2_i],

where D1 = a + T1 and D2 = a + T1 + T2 (O-1) (iterations start at or after the arrival and end by
the first token / finish time, which a met request has by D1 / D2), and e_g is the work of the
g-th later emission: u_d for a decode or a 1-token resume chunk, >= k u_p for a k-token resume chunk
(the same k bound as above; with caching off k >= N+1). Preemption, recompute, KV limits,
max_num_seqs, swaps and idle gaps only add work or remove freedom, so the met set of any policy is
a set of jobs (w_i, a_i, D_i) feasibly scheduled on one preemptive machine.
All work values are rounded DOWN to whole ns (less work = weaker constraint = larger bound).

For a set of disjoint intervals I, the met jobs whose window [a, D] lies inside I are processed
inside I, so their works sum to <= |I|: their number is at most ``count(I)``, the number of
smallest works (among jobs inside I) whose sum fits |I|. Jobs inside no interval count 1 each. So

    UB = min over sets of disjoint intervals of  sum_I count(I) + #(jobs inside no interval),

computed by a DP over the sorted distinct release/deadline times (intervals with other endpoints
never help: shrinking an interval to the hull of the windows inside it keeps its job set and only
lowers count). ``F[j] = min(F[j-1] + #(D == t_j), min_{l<j} F[l] + count([t_l, t_j]) +
#(t_l < D <= t_j, a < t_l))``; count uses a Fenwick tree over work ranks, O(K^2 log n) for K
endpoints. For large traces (K^2 > DP_BUDGET) two restricted DPs are run and the smaller result
kept: intervals of at most ``max_span`` consecutive endpoints, and intervals whose endpoints lie on a
grid of ``GRID_POINTS`` endpoint quantiles (a job is inside [g_l, g_j] iff g_l <= a and D <= g_j).
Each minimises over FEWER interval sets, so its minimum is LARGER -- still a valid upper bound
(``BoundResult.exact_dp`` says which was used). The single interval spanning everything is always
added as a candidate.

(c) KV term
-----------
Work alone ignores the KV cache, so where memory binds (long prompts, a small pool) the bound above
is far from every policy. In the iteration that emits its k-th token (k = 1: the one completing its
prefill) request i holds the blocks of N + k - 1 tokens, ``ceil((N + k - 1)/bs)``; at most its shared
chain (``len(chain_i)`` blocks at the engine's block size; none with prefix caching off) can be held
by other requests too, so i alone holds at least

    u_i(k) = max(0, ceil((N + k - 1)/bs) - len(chain_i))

blocks in it. That iteration contains i's own work, a decode (``c0 + c_d + c_kv ctx``, ctx >= N) or
a prefill chunk of k >= 1 tokens (``>= c0 + c_p + c_c2``: the chunk that completes a prefill or a
resume may be a single token, and the budget or a threshold may leave any remainder), so it lasts at
least ``e_i = min(ceil((c0 + c_d + c_kv N)/1000), ceil((c0 + c_p + c_c2)/1000))`` ns (NOT the (a)
per-emission times, which bound the whole gap between two tokens, recompute included), and it lies
inside [a_i, D2_i] when i is met. Iterations do not overlap and together hold at most
``usable_blocks`` blocks, so the met jobs whose windows lie inside an interval I satisfy

    sum_i kv_i <= usable_blocks x |I|,    kv_i = e_i sum_k u_i(k)   (block-ns, exact integers).

``count(I) = min(count_w(I), count_kv(I))``, count_kv the number of the smallest kv_i (among the jobs
inside I) whose sum fits ``usable_blocks x |I|``; the DP is otherwise unchanged (a second Fenwick
tree, over kv ranks). On a trace whose kv sum would pass 2^60 the kv values are divided by a power
of two (rounded down) and the capacity rounded up: a relaxation again. ``kv=False`` gives the bound
without this term (never smaller).

The bound is computed with (w, D2) (and the KV term) and with (w^p, D1); ``ub`` is the min of both
and of the number of attainable requests. Exactness: each relaxation is the true optimum of the
one-machine problem when the met set is, e.g., a single request, or requests whose windows are
disjoint and roomy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np

from .engine._jit import guard_stale_cache, njit
from .engine.scoring import min_prefill_ps2_one
from .engine.profiles import Profile, load_profile
from .traces.trace import Trace

#: Default budget of DP transitions (K endpoints x span) before ``max_span`` is restricted.
DP_BUDGET = 60_000_000


@dataclasses.dataclass(frozen=True)
class BoundResult:
    """Upper bound on met requests. ``ub`` = min(n_attainable, ub_work_d2, ub_work_d1)."""

    ub: int
    ub_fraction: float          # ub / arrived (0.0 for an empty trace)
    n_requests: int
    n_unattainable: int
    n_attainable: int
    ub_work_d2: int             # work relaxation with (w, D2), and the KV term (c) when kv_term
    ub_work_d1: int             # work relaxation with (w^p, D1)
    n_rejected_or_capped: int   # part of n_unattainable: prompt >= max_model_len or output capped
    n_ttft_impossible: int      # part of n_unattainable: best-case TTFT > T1 (not counting the above)
    n_tpot_impossible: int      # part of n_unattainable: best-case TPOT > T2 (not counting the above)
    kv_term: bool               # ub_work_d2 includes the KV term (c)
    exact_dp: bool              # False if max_span restricted the interval sets (bound still valid)
    max_span: int
    attainable: np.ndarray = dataclasses.field(repr=False)   # bool [n]
    ttft_min_ns: np.ndarray = dataclasses.field(repr=False)  # int64 [n], best-case TTFT (lower bound)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("attainable")
        d.pop("ttft_min_ns")
        return d


# ------------------------------------------------------------------------------ per-request parts
def _chain_blocks(trace: Trace, block_size: int) -> np.ndarray:
    """Full engine blocks of each request's shared chain: the chain at the engine's block size
    (``traces.blocks.at_block_size``: a full block is shared iff its last trace block is)."""
    if trace.block_size != block_size:
        return trace.prefix_lengths.astype(np.int64) * trace.block_size // block_size
    return trace.prefix_lengths.astype(np.int64)


def best_case_hits(trace: Trace, block_size: int, prefix_caching: bool = True) -> np.ndarray:
    """h_i: tokens of i's prompt that can be cached before i computed anything (see module doc)."""
    n = len(trace)
    if not prefix_caching or n == 0:
        return np.zeros(n, np.int64)
    N = trace.prompt_tokens.astype(np.int64)
    return block_size * np.minimum(_chain_blocks(trace, block_size), np.maximum(N - 1, 0) // block_size)


@njit
def min_prefill_exceeds(N, h, c0, cp, cc2, cat, B, limit_ns):
    """``(min_prefill_ps2_one(N, h, ...) + 1999) // 2000 > limit_ns`` (the shortest prefill of [h, N),
    rounded up to ns, exceeds a limit), settled where possible by bounds that cost one division:
    with c0, alpha >= 0 the minimum lies between the cost of ceil(P/B) chunks (one of the
    candidates) and that cost without its alpha term (every candidate has at least that many)."""
    P = N - h
    alpha2 = 2 * cc2 - cat
    if alpha2 >= 0 and c0 >= 0:
        m_lo = (P + B - 1) // B
        if m_lo < 1:
            m_lo = 1
        base = 2 * cp * P + cat * (N * N - h * h) + 2 * c0 * m_lo
        q, r = P // m_lo, P % m_lo
        if (base + alpha2 * (r * (q + 1) ** 2 + (m_lo - r) * q * q) + 1999) // 2000 <= limit_ns:
            return False
        if (base + 1999) // 2000 > limit_ns:
            return True
    return (min_prefill_ps2_one(N, h, c0, cp, cc2, cat, B) + 1999) // 2000 > limit_ns


@njit
def _min_prefill_ps2_all(N, h, c0, cp, cc2, cat, B, out):
    for i in range(N.shape[0]):
        out[i] = min_prefill_ps2_one(N[i], h[i], c0, cp, cc2, cat, B)


def min_prefill_ps2(N, h, ps: np.ndarray, B: int) -> np.ndarray:
    """``min_prefill_ps2_one`` over arrays (broadcast)."""
    N, h = np.broadcast_arrays(np.asarray(N, np.int64), np.asarray(h, np.int64))
    shape = N.shape
    out = np.empty(N.size, np.int64)
    c0, cp, cc2, cat = (int(x) for x in ps[:4])
    N, h = (np.require(x.ravel(), None, ["C", "W"]) for x in (N, h))   # (one compiled variant)
    _min_prefill_ps2_all(N, h, c0, cp, cc2, cat, int(B), out)
    return out.reshape(shape)


def _ceil_div(a, b):
    return -((-a) // b)


def _residue_counts(N, O, bs):
    """cnt[i, r] = #{g in 1..O-1 : (N + g - 1) mod bs == r}, i.e. x in [N, N+O-2]."""
    r = np.arange(bs, dtype=np.int64)[None, :]
    hi = (N + O - 2)[:, None]
    lo = (N - 1)[:, None]
    return np.where(O[:, None] > 1, (hi - r) // bs - (lo - r) // bs, 0)


def _tpot_margin(v):
    """Slack for ``met``'s float test ``(finish - first)/(O-1) <= T2``: exact below 2^52 ns."""
    return np.where(v >= (1 << 52), v >> 50, 0)


@dataclasses.dataclass
class _Parts:
    attainable: np.ndarray
    capped: np.ndarray
    ttft_bad: np.ndarray
    tpot_bad: np.ndarray
    ttft_min_ns: np.ndarray
    wp_ns: np.ndarray
    w_ns: np.ndarray
    d1: np.ndarray
    d2: np.ndarray
    kv: np.ndarray      # block-ns of unshared KV held in i's emitting iterations (the KV term)
    usable: int         # the pool's usable blocks


@njit
def _kv_block_ns(N, O, shared, e, bs, out):
    """kv_i = sum over i's O emissions k of u_i(k) x e_i (ns), with u_i(k) = max(0, ceil((N + k -
    1)/bs) - shared_i) the unshared blocks i holds in the iteration that emits its k-th token and e_i
    the least such an iteration lasts (module doc, (c))."""
    for i in range(N.shape[0]):
        n = N[i]
        s = shared[i]
        tot = 0
        for k in range(1, O[i] + 1):
            u = (n + k - 1 + bs - 1) // bs - s
            if u > 0:
                tot += u
        out[i] = tot * e[i]


def request_parts(trace: Trace, prof: Profile, prefix_caching: bool = True) -> _Parts:
    """Per-request attainability, works (ns, rounded down) and deadlines (ns)."""
    if not trace.has_slos:
        raise ValueError("upper_bound needs a trace with SLOs (ttft_slo_ns / tpot_slo_ns)")
    # B_max: a lever may choose any budget up to it (docs/design.md section 10); a larger B only
    # relaxes the chunking below, so the bound holds for every such choice
    bs, B, mml = prof.block_size, prof.budget_max, prof.max_model_len
    ps = [int(x) for x in prof.cost.ps]
    c0, cp, cc2, cat, cd, ckv = ps
    a = trace.arrival_ns.astype(np.int64)
    N0 = trace.prompt_tokens.astype(np.int64)
    O0 = trace.output_tokens.astype(np.int64)
    T1 = trace.ttft_slo_ns.astype(np.int64)
    T2 = trace.tpot_slo_ns.astype(np.int64)
    capped = (N0 >= mml) | (O0 > mml - N0)
    # clip to the model length so that integer arithmetic stays far from overflow (rows are dropped)
    N = np.minimum(N0, mml)
    O = np.clip(O0, 1, mml)
    h = best_case_hits(trace, bs, prefix_caching)
    P = N - h

    # (a) TTFT
    ttft_min = _ceil_div(min_prefill_ps2(N, h, np.array(ps), B), 2000)
    ttft_bad = ~capped & (ttft_min > T1)

    # (a) TPOT and (b) decode work, per later emission, by residue r = (N + g - 1) mod bs
    dec_ns = _ceil_div(c0 + cd + ckv * N, 1000)                       # [n], smallest context N
    cnt = _residue_counts(N, O, bs)                                   # [n, bs]
    UP, UD = c0 + B * cp, c0 + B * cd                                 # B*u_p, B*u_d in ps
    if prefix_caching:
        k = np.arange(1, bs + 1, dtype=np.int64)[None, :]            # chunk >= r + 1
        res_ns = _ceil_div(c0 + cp * k + cc2 * k * k, 1000)          # [1, bs]
        emit_ns = np.minimum(dec_ns[:, None], res_ns)
        emit_ns[:, 0] = dec_ns                                        # k = 1 is a decode
        emit_w = np.minimum(UD, UP * k)                               # [1, bs]
        emit_w = np.broadcast_to(emit_w, cnt.shape).copy()
        emit_w[:, 0] = UD
    else:
        res_ns = _ceil_div(c0 * ((N + B) // B) + cp * (N + 1), 1000)
        emit_ns = np.minimum(dec_ns, res_ns)[:, None] + np.zeros((1, bs), np.int64)
        emit_w = np.minimum(UD, UP * (N + 1))[:, None] + np.zeros((1, bs), np.int64)
    tpot_sum = (cnt * emit_ns).sum(axis=1)
    span2 = T2 * (O - 1)
    tpot_bad = ~capped & ~ttft_bad & (tpot_sum > span2 + _tpot_margin(span2))

    attainable = ~(capped | ttft_bad | tpot_bad)
    # (b) works in ns rounded down; B*u in ps -> divide by 1000*B
    wp = (P * UP) // (1000 * B)
    w = (P * UP + (cnt * emit_w).sum(axis=1)) // (1000 * B)
    d1 = a + T1
    d2 = d1 + span2 + _tpot_margin(span2)

    # (c) KV: blocks that other requests can share are at most i's chain (none without caching).
    # Every iteration that emits one of i's tokens holds i's work: a decode (c0 + c_d + c_kv ctx, ctx
    # >= N) or a prefill chunk of k >= 1 tokens (>= c0 + c_p + c_c2: a prefill's or a resume's last
    # chunk may be a single token, the budget or the threshold may leave any remainder); so e_k >= e.
    e = np.minimum(dec_ns, _ceil_div(c0 + cp + cc2, 1000)).astype(np.int64)
    kv = np.empty(len(N), np.int64)
    shared = _chain_blocks(trace, bs) if prefix_caching else np.zeros(len(N), np.int64)
    _kv_block_ns(N, O, shared, e, bs, kv)
    return _Parts(attainable, capped, ttft_bad, tpot_bad, ttft_min, wp, w, d1, d2, kv, prof.usable_blocks)


# ------------------------------------------------------------------------------ the interval DP
#: kv sums are kept below this (scaled down when needed: ``interval_bound``); capacities saturate at it
KV_LIMIT = 1 << 62


@njit
def _fit_count(ft_c, ft_s, n, top, limit):
    """Number of the smallest inserted values (Fenwick trees by rank: counts, sums) whose sum <= limit."""
    pos = 0
    acc = 0
    cnt = 0
    step = top
    while step > 0:
        nxt = pos + step
        if nxt <= n and acc + ft_s[nxt] <= limit:
            pos = nxt
            acc += ft_s[nxt]
            cnt += ft_c[nxt]
        step //= 2
    return cnt


@njit
def _fenwick_add(ft_c, ft_s, n, p, v):
    while p <= n:
        ft_c[p] += 1
        ft_s[p] += v
        p += p & (-p)


@njit
def _fenwick_remove(ft_c, ft_s, n, p, v):
    while p <= n:
        ft_c[p] -= 1
        ft_s[p] -= v
        p += p & (-p)


@njit
def _interval_dp(t, ia, idd, rank, w, span, rank_kv, kv, cap, scale):
    """The DP of (b); with ``cap`` >= 0 also (c): count(I) = min(count_w, count_kv), count_kv the
    number of the smallest ``kv`` (block-ns, divided by ``scale``) that fit ``cap`` blocks x |I|."""
    n = ia.shape[0]
    K = t.shape[0]
    use_kv = cap >= 0
    # jobs grouped by release index (CSR)
    rel_cnt = np.zeros(K + 1, np.int64)
    for i in range(n):
        rel_cnt[ia[i] + 1] += 1
    for j in range(K):
        rel_cnt[j + 1] += rel_cnt[j]
    rel_ids = np.empty(n, np.int64)
    fill = rel_cnt[:K].copy()
    for i in range(n):
        rel_ids[fill[ia[i]]] = i
        fill[ia[i]] += 1
    n_end = np.zeros(K, np.int64)
    for i in range(n):
        n_end[idd[i]] += 1
    cum_end = np.zeros(K + 1, np.int64)  # cum_end[j+1] = #jobs with idd <= j
    for j in range(K):
        cum_end[j + 1] = cum_end[j] + n_end[j]
    # Fenwick trees over ranks 1..n: by work, and by kv
    ft_c = np.zeros(n + 1, np.int64)
    ft_s = np.zeros(n + 1, np.int64)
    fk_c = np.zeros(n + 1, np.int64)
    fk_s = np.zeros(n + 1, np.int64)
    top = 1
    while top * 2 <= n:
        top *= 2
    cap_lim = KV_LIMIT // cap if cap > 0 else KV_LIMIT
    inserted = np.empty(n, np.int64)
    G = np.zeros(K + 1, np.int64)
    for j in range(K):
        best = G[j] + n_end[j]
        n_ins = 0
        lmin = j - span
        if lmin < 0:
            lmin = 0
        for l in range(j - 1, lmin - 1, -1):
            for q in range(rel_cnt[l], rel_cnt[l + 1]):
                i = rel_ids[q]
                if idd[i] <= j:
                    _fenwick_add(ft_c, ft_s, n, rank[i] + 1, w[i])
                    if use_kv:
                        _fenwick_add(fk_c, fk_s, n, rank_kv[i] + 1, kv[i])
                    inserted[n_ins] = i
                    n_ins += 1
            if n_ins == 0:
                # no job inside: count 0 and every job ending in (l, j] is uncovered -> no gain
                continue
            L = t[j] - t[l]
            cnt = _fit_count(ft_c, ft_s, n, top, L)
            if use_kv:
                # cap x |I| in kv's units, rounded UP (scale > 1 only on huge sums: still a relaxation)
                Ls = (L + scale - 1) // scale
                lk = KV_LIMIT if Ls > cap_lim else Ls * cap
                ck = _fit_count(fk_c, fk_s, n, top, lk)
                if ck < cnt:
                    cnt = ck
            uncovered = cum_end[j + 1] - cum_end[l + 1] - n_ins
            v = G[l + 1] + cnt + uncovered
            if v < best:
                best = v
        G[j + 1] = best
        for q in range(n_ins):
            i = inserted[q]
            _fenwick_remove(ft_c, ft_s, n, rank[i] + 1, w[i])
            if use_kv:
                _fenwick_remove(fk_c, fk_s, n, rank_kv[i] + 1, kv[i])
    return G[K]


def count_fit(w, length: int) -> int:
    """Number of smallest works whose sum is <= length."""
    cs = np.cumsum(np.sort(np.asarray(w, np.int64)))
    return int(np.searchsorted(cs, length, side="right"))


#: Candidate endpoints of the coarse grid DP used (beside the span-restricted DP) on large traces.
GRID_POINTS = 1000


def _run_dp(t, r, d, w, rank, span, kvs):
    la = np.searchsorted(t, r, side="right") - 1   # last candidate <= release
    ld = np.searchsorted(t, d, side="left")        # first candidate >= deadline
    rank_kv, kv, cap, scale = kvs
    return int(_interval_dp(t, la.astype(np.int64), ld.astype(np.int64), rank, w, int(span), rank_kv, kv,
                            int(cap), int(scale)))


def kv_scale(kv) -> int:
    """The power of two that keeps the kv sums of the DP below 2^60 (1 on any realistic trace)."""
    total = float(np.sum(np.asarray(kv, np.float64)))
    s = 1
    while total / s > 2.0 ** 60:
        s *= 2
    return s


def interval_bound(release, deadline, work, *, kv=None, usable_blocks: Optional[int] = None,
                   max_span: Optional[int] = None) -> tuple[int, bool, int]:
    """The DP of (b) for jobs (work, release, deadline) in integer ns; with ``kv`` (block-ns per job)
    and ``usable_blocks`` also the KV term (c). Returns (bound, exact, span).

    Exact (all interval sets with endpoints at release/deadline times) when ``K^2 <= DP_BUDGET`` for
    K distinct endpoints or ``max_span >= K``. Otherwise the min of two RESTRICTED DPs, each valid
    (fewer interval sets -> larger minimum): intervals of at most ``span`` consecutive endpoints, and
    intervals with endpoints on a grid of ``GRID_POINTS`` endpoint quantiles (long intervals).
    """
    r = np.asarray(release, np.int64)
    d = np.asarray(deadline, np.int64)
    w = np.asarray(work, np.int64)
    n = r.shape[0]
    if n == 0:
        return 0, True, 0
    if (kv is None) != (usable_blocks is None):
        raise ValueError("interval_bound: kv and usable_blocks go together")
    t = np.unique(np.concatenate([r, d]))
    K = t.shape[0]
    auto = max_span is None
    if auto:
        max_span = K if K * K <= DP_BUDGET else max(64, DP_BUDGET // K)
    span = int(min(max_span, K))
    rank = np.empty(n, np.int64)
    rank[np.argsort(w, kind="stable")] = np.arange(n)
    scale = 1
    if kv is None:
        kvs = (rank, w, -1, scale)
    else:
        kv = np.asarray(kv, np.int64)
        scale = kv_scale(kv)
        kv = kv // scale      # (rounded down: a smaller need, a larger bound)
        rank_kv = np.empty(n, np.int64)
        rank_kv[np.argsort(kv, kind="stable")] = np.arange(n)
        kvs = (rank_kv, kv, int(usable_blocks), scale)
    ub = _run_dp(t, r, d, w, rank, span, kvs)
    if span < K and auto:
        grid = np.unique(t[np.linspace(0, K - 1, GRID_POINTS).round().astype(np.int64)])
        ub = min(ub, _run_dp(grid, r, d, w, rank, grid.shape[0], kvs))
    length = int(t[-1] - t[0])
    ub = min(ub, count_fit(w, length))
    if kv is not None:
        ub = min(ub, count_fit(kv, min(KV_LIMIT, -(-length // scale) * int(usable_blocks))))
    return ub, span >= K, span


# ------------------------------------------------------------------------------ API
def upper_bound(trace: Trace, profile: Union[str, Profile], *, prefix_caching: Optional[bool] = None,
                config=None, max_span: Optional[int] = None, kv: bool = True) -> BoundResult:
    """Upper bound on the number of requests of ``trace`` that any policy can serve within SLA: the
    yardstick for how much a scheduler leaves on the table (beside the report's best achieved row).

    Args:
        trace: a trace with SLOs.
        profile: an engine profile name or ``Profile``.
        prefix_caching: whether cached prefixes can be hit (None: ``config``'s switch, else on).
        config: an ``EngineConfig`` whose overrides (``max_num_batched_tokens``, ``num_blocks``,
            ...) apply to the profile.
        max_span: endpoints per interval in the DP (None: automatic); smaller is faster and looser
            on large traces, and any value gives a valid bound.
        kv: with the KV term (c) (default); False gives the bound without it, which ignores the
            KV cache (for comparison: never smaller).

    Returns:
        ``BoundResult``: ``ub`` (>= ``met`` of every policy the engine can run) and its parts.

    Raises:
        ValueError: the trace has no SLOs.
        ProfileError: an unknown or malformed profile.
    """
    prof = load_profile(profile) if isinstance(profile, str) else profile
    if config is not None:
        prof = config.resolve(prof)
        if prefix_caching is None:
            prefix_caching = bool(config.prefix_caching)
    if prefix_caching is None:
        prefix_caching = True
    n = len(trace)
    parts = request_parts(trace, prof, prefix_caching)
    ok = parts.attainable
    a = trace.arrival_ns.astype(np.int64)[ok]
    kv_args = {"kv": parts.kv[ok], "usable_blocks": parts.usable} if kv else {}
    ub2, ex2, sp2 = interval_bound(a, parts.d2[ok], parts.w_ns[ok], max_span=max_span, **kv_args)
    ub1, ex1, sp1 = interval_bound(a, parts.d1[ok], parts.wp_ns[ok], max_span=max_span)
    n_att = int(ok.sum())
    ub = min(n_att, ub1, ub2)
    return BoundResult(
        ub=ub, ub_fraction=(ub / n if n else 0.0), n_requests=n, n_unattainable=n - n_att,
        n_attainable=n_att, ub_work_d2=ub2, ub_work_d1=ub1,
        n_rejected_or_capped=int(parts.capped.sum()), n_ttft_impossible=int(parts.ttft_bad.sum()),
        n_tpot_impossible=int(parts.tpot_bad.sum()), kv_term=bool(kv), exact_dp=bool(ex1 and ex2),
        max_span=max(sp1, sp2), attainable=ok.copy(), ttft_min_ns=parts.ttft_min_ns)


# (compiled with the engine's decorator, so the checks on every compiled function see these too; they
# link no other file, so the flush on an engine change only costs a short recompile)
guard_stale_cache([min_prefill_exceeds, _min_prefill_ps2_all, _kv_block_ns, _fit_count, _fenwick_add, _fenwick_remove,
                   _interval_dp],
                  tag="bounds")
