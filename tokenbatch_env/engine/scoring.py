"""Score formulas evaluated inside the engine (docs/design.md section 4), one definition each.

The kernel calls these for every waiting and running request at the start of each iteration, with
the copy's parameter vector; ``tokenbatch_env.policies`` calls the very same compiled functions for
its vectorised API and the scalar drop-in, so there is one implementation of every formula.

Higher score = served first (and preempted last). Units: ms for service and slack.
"""

from __future__ import annotations

import math

import numpy as np

from ._jit import njit

# policy ids (the kernel's MODE_SCORE dispatches on these; P_EXTERNAL: no in-engine score, FCFS's and priority's)
P_EXTERNAL, P_SJF, P_EDF, P_LLF, P_INDEX, P_GITTINS, P_LINEAR = 0, 1, 2, 3, 4, 5, 6
POLICY_IDS = {"external": P_EXTERNAL, "sjf": P_SJF, "edf": P_EDF, "llf": P_LLF, "index": P_INDEX,
              "empirical-gittins": P_GITTINS, "weights": P_LINEAR}
POLICY_NAMES = {v: k for k, v in POLICY_IDS.items()}

# index parameter vector layout
(I_KAPPA, I_SLOPE, I_GAMMA, I_THETA, I_BETA, I_W_PREFIX, I_A_EDF, I_T_REF_MS, N_INDEX_PARAMS) = range(9)
# linear-score ("weights") parameter vector layout: 8 weights, then T_ref
LINEAR_FEATURES = ("log_s", "z", "queue_pos", "prefix_ratio", "blocks_needed", "to_deadline", "slack",
                   "first_token_out")
N_WEIGHTS = len(LINEAR_FEATURES)
I_LIN_T_REF_MS = N_WEIGHTS
#: width of every policy parameter vector (the engine keeps one [copies, N_THETA] array)
N_THETA = max(N_INDEX_PARAMS, N_WEIGHTS + 1)

Z_CLIP = 50.0


@njit
def expit(x):
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@njit
def clip_z(slack_ms, t1_ms):
    """z_i = clip(slack_i / T1_i, -50, 50)."""
    z = slack_ms / t1_ms
    if z > Z_CLIP:
        return Z_CLIP
    if z < -Z_CLIP:
        return -Z_CLIP
    return z


@njit
def service_ms(p_left, d_left, u_p, u_d):
    """S_i = max(P_i*u_p + d_i*u_d, u_d)."""
    s = p_left * u_p + d_left * u_d
    return s if s > u_d else u_d


@njit
def index_log_score(theta, prefix_ratio, s_ms, d_left, z, first_token_out, kv, blocks_needed,
                    usable_blocks, to_deadline_ms, block_size):
    """The Gittins-barrier index in log space (docs/design.md section 4)."""
    return index_log_dynamic(index_log_static(theta, prefix_ratio, s_ms, d_left, block_size), theta, z,
                             first_token_out, kv, blocks_needed, usable_blocks, to_deadline_ms)


@njit
def index_log_static(theta, prefix_ratio, s_ms, d_left, block_size):
    """The index's terms that do not move with the clock or the free blocks (the engine keeps them
    while a waiting request's cached prefix is unchanged)."""
    kappa = theta[I_KAPPA]
    out = math.log(1.0 + theta[I_W_PREFIX] * prefix_ratio) - math.log(s_ms)
    out -= math.log(1.0 + kappa * math.log(1.0 + d_left / block_size))
    return out


@njit
def index_log_dynamic(out, theta, z, first_token_out, kv, blocks_needed, usable_blocks, to_deadline_ms):
    """``index_log_score`` from its static part ``out`` (``index_log_static``)."""
    if not first_token_out:
        out += math.log(1.0 + theta[I_GAMMA] * expit(-theta[I_SLOPE] * z))
    gap = theta[I_THETA] - kv
    if gap > 0.0:
        out -= theta[I_BETA] * gap * gap * blocks_needed / usable_blocks
    out -= theta[I_A_EDF] * to_deadline_ms / theta[I_T_REF_MS]
    return out


@njit
def linear_score(theta, prefix_ratio, s_ms, z, first_token_out, blocks_needed, usable_blocks,
                 to_deadline_ms, slack_ms, queue_pos):
    """The ``weights`` policy (docs/design.md section 5): (w/|w|) . f over ``LINEAR_FEATURES`` =
    [ln(S/T_ref), z/10, queue_key/key_hi, prefix ratio, blocks needed/usable, to-deadline/T_ref,
    slack/T_ref, first token out]. Contains sjf (w = -e0), fcfs order (-e2), edf (-e5), llf (-e6).
    w = 0 scores every request 0 (ties: arrival, id)."""
    t_ref = theta[I_LIN_T_REF_MS]
    norm = 0.0
    for j in range(N_WEIGHTS):
        norm += theta[j] * theta[j]
    if norm == 0.0:
        return 0.0
    out = theta[0] * math.log(s_ms / t_ref) + theta[1] * (z / 10.0) + theta[2] * queue_pos
    out += theta[3] * prefix_ratio + theta[4] * (blocks_needed / usable_blocks)
    out += theta[5] * (to_deadline_ms / t_ref) + theta[6] * (slack_ms / t_ref)
    if first_token_out:
        out += theta[7]
    return out / math.sqrt(norm)


@njit
def policy_score(pid, theta, prefix_ratio, s_ms, d_left, slack_ms, t1_ms, first_token_out, kv,
                 blocks_needed, usable_blocks, to_deadline_ms, deadline_ms, block_size, queue_pos=0.0):
    """Score of one request under policy ``pid``. ``queue_pos`` = queue_key / key_hi (``weights`` only)."""
    if pid == P_SJF:
        return -s_ms
    if pid == P_EDF:
        return -deadline_ms
    if pid == P_LLF:
        return -slack_ms
    z = clip_z(slack_ms, t1_ms)
    if pid == P_LINEAR:
        return linear_score(theta, prefix_ratio, s_ms, z, first_token_out, blocks_needed, usable_blocks,
                            to_deadline_ms, slack_ms, queue_pos)
    return index_log_score(theta, prefix_ratio, s_ms, d_left, z, first_token_out, kv, blocks_needed,
                           usable_blocks, to_deadline_ms, block_size)


@njit
def idle_prefill_ns(prefill_tokens, computed_before, budget, ps):
    """Idle-engine time (ns) to prefill ``prefill_tokens`` after ``computed_before`` tokens, chunked
    at ``budget``: the exact integer cost model (``ps`` = coefficients in ps). A lower bound on any
    real completion time of that prefill, since every coefficient is >= 0."""
    total = 0
    done = computed_before
    left = prefill_tokens
    while left > 0:
        chunk = left if left < budget else budget
        t = ps[0] + ps[1] * chunk + ps[2] * chunk * chunk + ps[3] * chunk * done
        total += (t + 999) // 1000
        done += chunk
        left -= chunk
    return total


@njit
def idle_prefill_ns_array(prefill_tokens, budget, ps):
    out = prefill_tokens.copy()
    for i in range(prefill_tokens.shape[0]):
        out[i] = idle_prefill_ns(prefill_tokens[i], np.int64(0), budget, ps)   # (typed: no literal variant)
    return out


@njit
def min_prefill_ps2_one(N, h, c0, cp, cc2, cat, B):
    """Twice the minimum, over all chunkings (chunks <= B), of the ps cost of prefilling tokens
    [h, N) in one pass (``bounds`` module doc, (a)), for one request. Integer; exact for alpha >= 0."""
    P = N - h
    alpha2 = 2 * cc2 - cat                                       # 2 * alpha
    base = 2 * cp * P + cat * (N * N - h * h)                    # 2 c_p P + c_attn (N^2 - h^2)
    m_lo = (P + B - 1) // B
    if m_lo < 1:
        m_lo = 1
    if alpha2 < 0:
        # sum k^2 <= P * min(P, B) <= N * min(N, B) for any P in [P_i, N] (valid, loose)
        return base + 2 * c0 * m_lo + alpha2 * N * min(N, B)
    hi = P if P > 1 else 1
    best = -1
    m_star = 0
    if alpha2 > 0:
        # no per-iteration cost: more chunks are always cheaper
        m_star = hi if c0 == 0 else int(math.floor(P * math.sqrt(alpha2 / (2.0 * c0))))
    for d in range(-3, 4):
        if alpha2 == 0 and d > -3:
            break
        m = m_lo if d == -3 else m_star + d
        m = min(max(m, m_lo), hi)
        q, r = P // m, P % m
        v = 2 * c0 * m + alpha2 * (r * (q + 1) ** 2 + (m - r) * q * q)
        if best < 0 or v < best:
            best = v
    return base + best


@njit
def prefill_time_ns(prefill_tokens, computed_before, chunk_cap, ps):
    """prefill_time_i (docs/design.md section 4): the shortest idle-engine time (ns) to prefill
    ``prefill_tokens`` after ``computed_before`` tokens over every chunking with chunks <=
    ``chunk_cap`` (B, or a long-prefill threshold below it). A lower bound on any real completion
    of that prefill, so a slack computed with it never sheds a request that could still make its
    TTFT; chunking at B is not always the fastest (``c_c2 > c_attn / 2``)."""
    if prefill_tokens <= 0:
        return 0
    n = computed_before + prefill_tokens
    return (min_prefill_ps2_one(n, computed_before, ps[0], ps[1], ps[2], ps[3], chunk_cap) + 1999) // 2000


# --------------------------------------------------------------------------- empirical Gittins
# Rows of the Gittins table (``gittins_table``); columns are output lengths l = 0..n (n = size of
# the residual-life table): S(l) = P(L > l), A(l) = E[min(L, l)], then ``jump[k][l]`` = the 2^k-th
# successor of point l on the upper concave hull of the points {(A(j), 1 - S(j)) : j >= l} (-1: none).
G_S, G_A, G_JUMP = 0, 1, 2


def gittins_table(mrl) -> np.ndarray:
    """The empirical-Gittins lookup table of an output-length distribution, from its mean residual
    life table ``mrl[g] = E[L - g | L > g]`` (``predictors.ResidualLife.table``; the kernel already
    receives it). The table determines the distribution exactly: S(0) = 1 (L >= 1) and
    ``S(g+1)/S(g) = (mrl[g] - 1) / mrl[g+1]`` (from E[(L-g)^+] = S(g) mrl[g]). Beyond the table the
    distribution is unknown: its tail enters only through its mean (the last column is the point
    Delta = infinity, A = E[L], S = 0).

    Gittins index of X = a + (L - g) u_d given L > g (``gittins_score``): the sup over Delta is
    attained at Delta = a + (l - g) u_d for an integer l > g, where, with the unconditional S and A,
    ``P(X <= Delta) / E[min(X, Delta)] = (S(g) - S(l)) / (a S(g) + u_d (A(l) - A(g)))``: the slope
    from the query point (A(g) - a S(g)/u_d, 1 - S(g)) to the point (A(l), 1 - S(l)). The maximum is
    the tangent to the upper concave hull of the suffix {l > g}; all suffix hulls share one
    right-to-left monotone-chain stack (``next[l]`` = the hull of suffix l minus its first point),
    and binary lifting over ``next`` finds the tangent in O(log n) per request."""
    m = np.ascontiguousarray(mrl, np.float64)
    if m.ndim != 1 or m.size == 0 or not np.isfinite(m).all() or (m < 1.0).any():
        raise ValueError("empirical-gittins needs a 1-D residual-life table of finite values >= 1")
    n = m.size
    S = np.zeros(n + 1)
    S[0] = 1.0
    if n > 1:
        S[1:n] = np.cumprod((m[:-1] - 1.0) / m[1:])
    A = np.zeros(n + 1)
    A[1:n] = np.cumsum(S[:n - 1])
    A[n] = A[n - 1] + S[n - 1] * m[n - 1]           # Delta = infinity: E[L]
    # S[n] = 0 (the point Delta = infinity has P(X <= Delta) = 1)
    nxt = _suffix_hulls(A, 1.0 - S)
    levels = max(1, int(n + 1).bit_length())
    tab = np.empty((G_JUMP + levels, n + 1))
    tab[G_S], tab[G_A] = S, A
    j = nxt.copy()
    for k in range(levels):
        tab[G_JUMP + k] = j
        j = np.where(j >= 0, j[np.maximum(j, 0)], -1)
    return tab


def _suffix_hulls(x, y) -> np.ndarray:
    """``next[l]``: the upper concave hull of points l..end (x ascending) is l, next[l], ..."""
    n = x.shape[0]
    nxt = np.full(n, -1, np.int64)
    stack = np.empty(n, np.int64)
    top = 0
    xs, ys = x.tolist(), y.tolist()
    for p in range(n - 1, -1, -1):
        px, py = xs[p], ys[p]
        while top >= 2:
            t, q = stack[top - 1], stack[top - 2]
            # pop t unless it lies strictly above the segment p -> q
            if (xs[t] - px) * (ys[q] - py) - (ys[t] - py) * (xs[q] - px) >= 0.0:
                top -= 1
            else:
                break
        if top > 0:
            nxt[p] = stack[top - 1]
        stack[top] = p
        top += 1
    return nxt


@njit
def gittins_score(gtab, mrl, g, a_ms, u_d):
    """Gittins index (1/ms, higher first) of the remaining service X = a_ms + (L - g) * u_d, L from
    the table's distribution conditioned on L > g. Where the table knows no L > g (g past its end,
    or S(g) = 0), the remaining decode is the residual-life fallback ``mrl[min(g, n - 1)]`` tokens,
    deterministic: 1 / (a_ms + u_d * mrl)."""
    n = mrl.shape[0]
    if g < n and gtab[G_S, g] > 0.0:
        sg = gtab[G_S, g]
        ag = gtab[G_A, g]
        a_s = a_ms * sg
        v = g + 1
        nv = sg - gtab[G_S, v]
        dv = a_s + u_d * (gtab[G_A, v] - ag)
        w = int(gtab[G_JUMP, v])
        if w >= 0 and (sg - gtab[G_S, w]) * dv > nv * (a_s + u_d * (gtab[G_A, w] - ag)):
            # binary lifting: v = the last hull point whose successor has a larger ratio
            for k in range(gtab.shape[0] - G_JUMP - 1, -1, -1):
                w = int(gtab[G_JUMP + k, v])
                if w < 0:
                    continue
                x = int(gtab[G_JUMP, w])
                if x < 0:
                    continue
                nw = sg - gtab[G_S, w]
                dw = a_s + u_d * (gtab[G_A, w] - ag)
                if (sg - gtab[G_S, x]) * dw > nw * (a_s + u_d * (gtab[G_A, x] - ag)):
                    v = w
            v = int(gtab[G_JUMP, v])
            nv = sg - gtab[G_S, v]
            dv = a_s + u_d * (gtab[G_A, v] - ag)
        return nv / dv
    gi = g if g < n else n - 1
    return 1.0 / (a_ms + u_d * mrl[gi])
