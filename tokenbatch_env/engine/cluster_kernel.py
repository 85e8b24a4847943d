"""A cluster's loop: R engine copies (replicas) behind a router, in compiled code (docs/design.md
section 12).

The replicas are copies of the engine's struct of arrays (``kernel.EngineArrays``), each with its own
queues, slots and block pool. Their request rows start empty: the router appends each arrival to the
chosen replica's rows as it routes it, so a replica sees exactly the requests routed to it, in
arrival order. Between two arrivals the replicas do not interact, so each is advanced by the
engine's own step (``kernel.run_copies_kernel``) up to the next routing instant: a replica's jump
ends at the cluster's next arrival, and its iterations are the single engine's.

Order at one instant t (section 12): iterations ending at t complete (every replica is advanced
through the iterations that start before t); the arrivals at t are routed in trace order, each
seeing the router's counters updated by the earlier ones; iterations starting at t are scheduled
after (at the next advance) and see them.

The router's view of replica c at t: its state at its last iteration boundary <= t. For an iteration
in flight across t (started before t, ends after) that is the state as that iteration was scheduled
at its start -- its admissions, preemptions and block claims made, its completions not yet -- which
the kernel keeps in ``epoch[c, EP_V_*]``; prefix-cache contents and queued prefill tokens are the
same at that point as at its end (blocks are hashed when scheduled, freeing keeps their hashes).
With a staleness S > 0 that view is read at t - S instead (its own advance, before the routing at
t); the router's own counters are always at t.
"""

from __future__ import annotations

import numpy as np

from ._jit import guard_stale_cache, njit
from . import kernel as K
from .scoring import idle_prefill_ns

# router ids (``ROUTERS`` in ``engine.cluster``: the names and their parameters)
(R_ROUND_ROBIN, R_RANDOM, R_LEAST_OUTSTANDING, R_JSQ, R_LEAST_KV, R_PO2, R_PREFIX_AFFINITY,
 R_LEAST_PREDICTED_TTFT, R_FIRST) = range(9)
# router parameters (``rpar``): prefix-affinity's alpha and beta, the random stream's seed
(RP_ALPHA, RP_BETA, RP_SEED, N_RPAR) = range(4)
# the view of one replica (``view`` columns)
(V_RUN, V_WAIT, V_FREE, V_QUEUED, V_OUT, V_REM, V_HITS, V_SINCE_N, V_SINCE_TOK, V_NEXT, N_VIEW) = range(11)
_M32 = 0xFFFFFFFF
FOREVER = np.iinfo(np.int64).max // 2   # a time no run reaches


@njit
def _mul32(x, c):
    """(x * c) mod 2^32 for x, c < 2^32, without overflowing int64 (the same interpreted)."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


@njit
def _fmix32(h):
    """murmur3's 32-bit finaliser: a bijection that mixes every input bit into every output bit."""
    h = h & _M32
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


@njit
def stream_u32(key0, key1, index, seed, draw):
    """The router's counter-based random stream: a 32-bit value from (trace digest ``key0``/``key1``,
    request index, router seed, draw number). Every row and every replica count share it."""
    h = _fmix32(draw + 0x9E3779B9)
    h = _fmix32(h ^ (seed & _M32))
    h = _fmix32(h ^ (index & _M32))
    h = _fmix32(h ^ (key1 & _M32))
    return _fmix32(h ^ (key0 & _M32))


@njit
def _pick(v, a, b):
    """The tie rule between candidates a and b of equal key: fewer outstanding, then lowest index."""
    if v[b, V_OUT] < v[a, V_OUT] or (v[b, V_OUT] == v[a, V_OUT] and b < a):
        return b
    return a


@njit
def choose(router, rpar, key0, key1, i, cand, n_cand, v, rstate, pred):
    """The replica request i goes to, among ``cand`` (``n_cand`` >= 1), from the view ``v``
    ([R, N_VIEW]); ``pred`` (least-predicted-ttft's prediction per replica, ns). ``rstate[0]`` is
    round-robin's pointer."""
    R = cand.shape[0]
    if router == R_ROUND_ROBIN:
        for j in range(R):
            c = (rstate[0] + j) % R
            if cand[c]:
                rstate[0] = (c + 1) % R
                return c
    if router == R_FIRST:
        for c in range(R):
            if cand[c]:
                return c
    seed = np.int64(rpar[RP_SEED])
    if router == R_RANDOM or router == R_PO2:
        k1 = (stream_u32(key0, key1, i, seed, 0) * n_cand) >> 32
        k2 = -1
        if router == R_PO2 and n_cand > 1:
            k2 = (stream_u32(key0, key1, i, seed, 1) * (n_cand - 1)) >> 32
            if k2 >= k1:
                k2 += 1
        c1 = -1
        c2 = -1
        k = 0
        for c in range(R):
            if cand[c]:
                if k == k1:
                    c1 = c
                if k == k2:
                    c2 = c
                k += 1
        if c2 < 0 or v[c1, V_OUT] < v[c2, V_OUT]:
            return c1
        if v[c2, V_OUT] < v[c1, V_OUT]:
            return c2
        return c1 if c1 < c2 else c2
    best = -1
    for c in range(R):
        if not cand[c]:
            continue
        if best < 0:
            best = c
            continue
        if router == R_LEAST_OUTSTANDING:
            d = v[c, V_OUT] - v[best, V_OUT]
        elif router == R_JSQ:
            d = (v[c, V_WAIT] + v[c, V_SINCE_N]) - (v[best, V_WAIT] + v[best, V_SINCE_N])
        elif router == R_LEAST_KV:
            d = v[best, V_FREE] - v[c, V_FREE]
        elif router == R_PREFIX_AFFINITY:
            d = v[best, V_HITS] - v[c, V_HITS]
        else:   # R_LEAST_PREDICTED_TTFT
            d = pred[c] - pred[best]
        if d < 0:
            best = c
        elif d == 0:
            best = _pick(v, best, c)
    if router == R_PREFIX_AFFINITY:
        least = -1
        for c in range(R):
            if cand[c] and (least < 0 or v[c, V_OUT] < v[least, V_OUT]):
                least = c
        if v[best, V_OUT] > (1.0 + rpar[RP_ALPHA]) * v[least, V_OUT] + rpar[RP_BETA]:
            return least
    return best


@njit
def request_hits(hash_head, c, g_coff, g_cval, prompt_i, i, bs):
    """Request i's cached leading blocks on replica c (its hash table, cached free blocks included),
    capped as the engine caps them (at least one prompt token is computed): the engine's
    ``kernel.prefix_hits`` for a request not yet in the replica's rows (its own blocks past its
    shared chain are unique to it, never cached)."""
    lo = g_coff[i]
    n = g_coff[i + 1] - lo
    m = (prompt_i - 1) // bs
    if n < m:
        m = n
    k = 0
    while k < m and hash_head[c, g_cval[lo + k]] >= 0:
        k += 1
    return k


@njit
def pending_frees(c, n_pend, pend_ids, table, slot_of, held, ref, hold_kv):
    """The blocks replica c frees when it retires its pending requests (async: those that finished
    at its last iteration's end free their blocks at the next schedule, but those of a prefill
    replica that hold their KV, ``hold_kv``): each block whose every reference is one of theirs.
    ``ref`` is restored."""
    freed = 0
    for k in range(n_pend[c]):
        r = pend_ids[c, k]
        if hold_kv[c, r]:
            continue
        s = slot_of[c, r]
        for j in range(held[c, r]):
            b = table[c, s, j]
            ref[c, b] -= 1
            if ref[c, b] == 0:
                freed += 1
    for k in range(n_pend[c]):
        r = pend_ids[c, k]
        if hold_kv[c, r]:
            continue
        s = slot_of[c, r]
        for j in range(held[c, r]):
            ref[c, table[c, s, j]] += 1
    return freed


@njit
def in_flight(c, t, now, it):
    """Replica c has an iteration in flight across t (a replica that never ran holds its first
    arrival's time, not an iteration's end)."""
    return now[c] > t and it[c] > 0


@njit
def replica_view(c, t, now, it, next_arr, n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen,
                 computed, run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, want_queued, out):
    """The state part of ``out[V_*]`` of replica c at t: its state at its last iteration boundary <= t
    (as scheduled, for an iteration in flight), and ``V_NEXT``, its first row not yet visible to it
    (``router_counters`` fills the router's own counters)."""
    if in_flight(c, t, now, it):
        out[V_RUN] = epoch[c, K.EP_V_RUN]
        out[V_FREE] = epoch[c, K.EP_V_FREE]
        out[V_REM] = now[c] - t
    else:
        out[V_RUN] = n_run[c] - n_pend[c]       # (async: those that finished at this boundary have ended)
        out[V_FREE] = n_free[c]
        if n_pend[c] > 0 and now[c] < t:
            # an idle async replica: its last schedule (at its last end, before t) freed them
            out[V_FREE] += pending_frees(c, n_pend, pend_ids, table, slot_of, held, ref, hold_kv)
        out[V_REM] = 0
    out[V_WAIT] = n_wait[c] + n_swap[c]
    out[V_NEXT] = next_arr[c]
    q = 0
    if want_queued:
        for k in range(n_wait[c]):
            r = wait_ids[c, k]
            q += prompt[c, r] + gen[c, r] - computed[c, r]
        for k in range(n_run[c]):
            r = run_ids[c, k]
            left = prompt[c, r] + gen[c, r] - computed[c, r]
            if status[c, r] != K.ENDED and (gen[c, r] == 0 or left > 1):
                q += left
    out[V_QUEUED] = q


@njit
def router_counters(c, t, now, it, n_req, n_ended, epoch, prompt, out):
    """The router's own counters for replica c at t, into ``out``: outstanding (routed less the ends
    seen at boundaries <= t), and the requests and prompt tokens routed since the view was read (its
    rows from ``out[V_NEXT]`` on)."""
    ended = epoch[c, K.EP_V_ENDED] if in_flight(c, t, now, it) else n_ended[c]
    out[V_OUT] = n_req[c] - ended
    out[V_SINCE_N] = n_req[c] - out[V_NEXT]
    tok = 0
    for k in range(out[V_NEXT], n_req[c]):
        tok += prompt[c, k]
    out[V_SINCE_TOK] = tok


@njit
def predicted_ttft(c, v, p, bs, cfg_rows):
    """least-predicted-ttft's prediction for a prompt of p tokens on replica c with the view ``v``:
    its iteration in flight's remaining time, then the queued and routed prefill work and the prompt
    (less its cached blocks) at the replica's chunk cap, idle (ns)."""
    cap = cfg_rows[c, K.C_BUDGET]
    if 0 < cfg_rows[c, K.C_THRESHOLD] < cap:
        cap = cfg_rows[c, K.C_THRESHOLD]
    work = v[V_QUEUED] + v[V_SINCE_TOK] + p - v[V_HITS] * bs
    return v[V_REM] + idle_prefill_ns(work, np.int64(0), cap, cfg_rows[c, K.C_PS0:K.C_PS0 + 4])


@njit
def has_room(c, i, with_chain, cfg_rows, g_coff, g_room, u_next, n_req, arrival, chain_off, chain_val, hash_head):
    """Replica c has room for request i's row, its chain (``with_chain``) and, under prefix caching,
    its unique hash ids (``append_row`` appends it)."""
    k = n_req[c]
    nch = g_coff[i + 1] - g_coff[i] if with_chain else 0
    if k + 1 > arrival.shape[1] or chain_off[c, k] + nch > chain_val.shape[1]:
        return False
    return not (cfg_rows[c, K.C_PREFIX] != 0 and u_next[c] + g_room[i] > hash_head.shape[1])


@njit
def append_row(c, i, t, with_chain, cfg_rows, g_prompt, g_out, g_capped, mml_of, g_prio, g_t1, g_t2, g_est, g_coff,
               g_cval, g_room, u_next, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, chain_off, chain_val,
               uniq_base, hash_head):
    """Append request i of the cluster's table to replica c's rows, arriving at t: its columns (its
    output length and cap at c's context length), its prefix chain when ``with_chain`` and its unique
    block ids under prefix caching. Returns its row, or -1 when c's rows, chain ids or hash ids are
    full (the caller runs again with room for more)."""
    if not has_room(c, i, with_chain, cfg_rows, g_coff, g_room, u_next, n_req, arrival, chain_off, chain_val,
                    hash_head):
        return -1
    k = n_req[c]
    lo = g_coff[i]
    nch = g_coff[i + 1] - lo if with_chain else 0
    o = chain_off[c, k]
    prefix_c = cfg_rows[c, K.C_PREFIX] != 0
    arrival[c, k] = t
    prompt[c, k] = g_prompt[i]
    out_len[c, k] = g_out[mml_of[c], i]
    capped[c, k] = g_capped[mml_of[c], i]
    prio[c, k] = g_prio[i]
    t1[c, k] = g_t1[i]
    t2[c, k] = g_t2[i]
    est[c, k] = g_est[i]
    for j in range(nch):
        chain_val[c, o + j] = g_cval[lo + j]
    chain_off[c, k + 1] = o + nch
    uniq_base[c, k] = 0
    if prefix_c:
        uniq_base[c, k] = u_next[c]
        u_next[c] += g_room[i]
    n_req[c] = k + 1
    return k


@njit
def wants_hits(router):
    """The router reads a request's cached prefix per replica (``V_HITS``)."""
    return router == R_PREFIX_AFFINITY or router == R_LEAST_PREDICTED_TTFT


@njit
def pool_views(lo, R, t, want_q, want_hits, p, i, bs, g_coff, g_cval, cfg_rows, now, it, next_arr, n_run, n_wait,
               n_swap, n_pend, n_free, epoch, status, prompt, gen, computed, run_ids, wait_ids, pend_ids, table,
               slot_of, held, ref, hold_kv, hash_head, n_req, n_ended, view, pred, cand):
    """The router's view (section 12) of copies lo .. lo+R-1 at t for request i of prompt p (``g_coff``,
    ``g_cval``: its table's chains): ``view[j]``, with its cached prefix (``want_hits``) and
    least-predicted-ttft's prediction ``pred[j]`` (``want_q``); ``cand[j]``: copy lo + j can serve
    the prompt. Returns how many can."""
    n_cand = 0
    for j in range(R):
        c = lo + j
        cand[j] = p < cfg_rows[c, K.C_MAX_LEN]
        if cand[j]:
            n_cand += 1
        v = view[j]
        replica_view(c, t, now, it, next_arr, n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen,
                     computed, run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, want_q, v)
        v[V_HITS] = 0
        if want_hits and cfg_rows[c, K.C_PREFIX] != 0:
            v[V_HITS] = request_hits(hash_head, c, g_coff, g_cval, p, i, bs)
        router_counters(c, t, now, it, n_req, n_ended, epoch, prompt, v)
        if want_q:
            pred[j] = predicted_ttft(c, v, p, bs, cfg_rows)
    return n_cand


@njit
def advance_copies(t, lo, hi, cfg_rows, n_req, now, it, n_ended, active, claim, until_ns, kargs):
    """Run the iterations of copies lo .. hi-1 that start before t (the engine's own step). Returns
    the iterations run, -1 (a NaN score: the kernel's own code) or -2 (a replica made no progress)."""
    total = 0
    for c in range(lo, hi):
        while n_ended[c] < n_req[c] and now[c] < t and it[c] < cfg_rows[c, K.C_MAX_ITERS]:
            before = (now[c], it[c], n_ended[c])
            active[c] = True
            claim[0] = c
            until_ns[c] = t
            done = K.run_copies_kernel(*kargs)
            active[c] = False
            if done < 0:
                return -1
            if (now[c], it[c], n_ended[c]) == before:
                return -2
            total += done
    return total


@njit
def run_cluster_kernel(router, rpar, key0, key1, stale_ns, g_arrival, g_prompt, g_out, g_capped, mml_of, g_prio, g_t1,
                       g_t2, g_est, g_coff, g_cval, g_room, u_next, route, row, view, snap, snap_hits, pred, rstate,
                       cfg_rows, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, chain_off, chain_val,
                       uniq_base, now, it, next_arr, n_ended, n_run, n_wait, n_swap, n_pend, n_free, status, gen,
                       computed, run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, hash_head, epoch,
                       active, claim, until_ns, *kargs):
    """Route every request of the cluster's table (``g_*``, in arrival order) and run the replicas to
    the end; replica c's output lengths and length caps are row ``mml_of[c]`` of ``g_out``/``g_capped``
    (one per distinct max_model_len, rule 8). ``route[i]`` is the replica request i went to (-1: no
    replica can serve its prompt: rejected at the router), ``row[i]`` its row there. ``kargs``:
    ``kernel.kernel_args`` of the replicas' struct of arrays, the arrays named before it being the
    same objects. A replica's
    unique block ids are its own (``u_next[c]``, the next free one; request i takes ``g_room[i]``),
    so each replica's rows, chains and hash table are sized for its share of the trace. Returns the
    iterations run, ``_advance``'s error code, or -3 when a replica's rows, chain ids or hash ids
    are full (the caller runs again with room for more)."""
    R = n_req.shape[0]
    N = g_arrival.shape[0]
    ring = snap.shape[0]   # the views read at t - S and not yet used: a ring of them
    bs = cfg_rows[0, K.C_BS]
    want_q = router == R_LEAST_PREDICTED_TTFT
    want_hits = wants_hits(router)
    cand = np.zeros(R, np.bool_)
    total = 0
    a_snap = 0   # (staleness) the next request whose view is read at its arrival - S
    a = 0
    while a < N:
        t = g_arrival[a]
        if stale_ns > 0 and a_snap < N and g_arrival[a_snap] - stale_ns <= t:
            ts = g_arrival[a_snap] - stale_ns
            done = advance_copies(ts, 0, R, cfg_rows, n_req, now, it, n_ended, active, claim, until_ns, kargs)
            if done < 0:
                return done
            total += done
            for c in range(R):
                replica_view(c, ts, now, it, next_arr, n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt,
                             gen, computed, run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv,
                             want_q, snap[a_snap % ring, c])
                snap_hits[a_snap % ring, c] = 0
                if want_hits and cfg_rows[c, K.C_PREFIX] != 0:
                    snap_hits[a_snap % ring, c] = request_hits(hash_head, c, g_coff, g_cval, g_prompt[a_snap], a_snap,
                                                               bs)
            a_snap += 1
            continue
        done = advance_copies(t, 0, R, cfg_rows, n_req, now, it, n_ended, active, claim, until_ns, kargs)
        if done < 0:
            return done
        total += done
        p = g_prompt[a]
        if stale_ns > 0:
            n_cand = 0
            for c in range(R):
                cand[c] = p < cfg_rows[c, K.C_MAX_LEN]
                if cand[c]:
                    n_cand += 1
                v = view[c]
                for j in range(N_VIEW):   # the replica's state as read at t - S
                    v[j] = snap[a % ring, c, j]
                v[V_HITS] = snap_hits[a % ring, c]
                router_counters(c, t, now, it, n_req, n_ended, epoch, prompt, v)   # (at t)
                if want_q:
                    pred[c] = predicted_ttft(c, v, p, bs, cfg_rows)
        else:
            n_cand = pool_views(0, R, t, want_q, want_hits, p, a, bs, g_coff, g_cval, cfg_rows, now, it, next_arr,
                                n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen, computed, run_ids,
                                wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, hash_head, n_req, n_ended,
                                view, pred, cand)
        if n_cand == 0:
            route[a] = -1
            row[a] = -1
            a += 1
            continue
        c = choose(router, rpar, key0, key1, a, cand, n_cand, view, rstate, pred)
        # append request a to replica c's rows (its arrival becomes visible at c's next iteration start)
        k = append_row(c, a, t, True, cfg_rows, g_prompt, g_out, g_capped, mml_of, g_prio, g_t1, g_t2, g_est, g_coff,
                       g_cval, g_room, u_next, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, chain_off,
                       chain_val, uniq_base, hash_head)
        if k < 0:
            return -3
        route[a] = c
        row[a] = k
        a += 1
    done = advance_copies(FOREVER, 0, R, cfg_rows, n_req, now, it, n_ended, active, claim, until_ns, kargs)
    if done < 0:
        return done
    return total + done


guard_stale_cache([_mul32, _fmix32, stream_u32, _pick, choose, request_hits, pending_frees, in_flight, predicted_ttft,
                   has_room, append_row, replica_view, router_counters, wants_hits, pool_views, advance_copies,
                   run_cluster_kernel], tag="cluster")
