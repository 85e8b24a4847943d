"""A prefill/decode disaggregated cluster's loop, in compiled code (docs/design.md section 13).

Copies 0 .. Rp-1 of the engine's struct of arrays are the prefill pool (P), copies Rp .. Rp+Rd-1 the
decode pool (D). A request is routed to a P replica at its arrival (the prefill router) and runs
there as if O = 1, then holds its blocks (``hold_kv``: finished-holding). One with O > 1 is handed to
a D replica at the end of its last prefill iteration (the decode router), where it arrives with its
KV (engine rule 13): admitted through the gate, its transfer over the (P, D) link, then decoding.
The transfer's end (``kv_ready``, set by D at the admission) releases P's blocks; a request that
ends on P (O = 1) releases them at its end, so that P frees blocks in one order.

P depends on D (the releases) and D on P (the handoffs), so the replicas' iterations run one at a
time in the order of their start times, and every event at or before an iteration's start is
delivered before it is scheduled. At one instant t, in order: iterations ending at t complete;
handoffs at t are routed, then arrivals at t (trace order); D's iterations starting at t are
scheduled (their admissions start transfers, ending at once over a free link); releases at t free
P's blocks; P's iterations starting at t are scheduled. Handoffs and releases at one instant go in
the order of their P replica, then of their completion there (an iteration's completions in its
scheduling order, as rule 7 ends them), and iterations of one pool at one instant by replica index.
An iteration lasts > 0 ns, so each event is known before its instant: a handoff at the end of an
iteration that has run, a release at or after the start of the D iteration that admitted it. The
routers read the replicas' views as the colocated cluster's do (section 12; no staleness): a
prefill replica's view at t holds the blocks released at t (they free after D's schedules at t).
"""

from __future__ import annotations


from ._jit import guard_stale_cache, njit
from . import kernel as K
from .cluster_kernel import FOREVER, R_LEAST_PREDICTED_TTFT, R_ROUND_ROBIN, append_row, choose, pool_views, wants_hits

# event heaps: (time, tie key, request) rows
H_T, H_K, H_I = range(3)
# external prefill routing (``ext``; docs/design.md section 13, "Routing from outside"): ``a_io`` holds the
# next arrival, the caller's action for the pending one (NO_ACTION: none yet) and the actions replaced
IO_NEXT, IO_ACTION, IO_REPLACED = range(3)
NO_ACTION = -(1 << 40)
#: ``run_pd_kernel``'s return when an arrival waits for the caller's action (``view``, ``pred``, ``cand``
#: of the prefill pool hold the router's view at its instant)
DECIDE = -10


@njit
def heap_push(h, n, t, k, i):
    """Push (t, k, i) onto the binary heap ``h[:n[0]]`` (least (t, k) on top)."""
    j = n[0]
    n[0] += 1
    while j > 0:
        up = (j - 1) >> 1
        if h[up, H_T] < t or (h[up, H_T] == t and h[up, H_K] <= k):
            break
        h[j, 0], h[j, 1], h[j, 2] = h[up, 0], h[up, 1], h[up, 2]
        j = up
    h[j, H_T], h[j, H_K], h[j, H_I] = t, k, i


@njit
def heap_pop(h, n):
    """Remove the top of the heap (the caller read it)."""
    n[0] -= 1
    m = n[0]
    if m == 0:
        return
    t, k, i = h[m, 0], h[m, 1], h[m, 2]
    j = 0
    while True:
        a = 2 * j + 1
        if a >= m:
            break
        b = a + 1
        if b < m and (h[b, H_T] < h[a, H_T] or (h[b, H_T] == h[a, H_T] and h[b, H_K] < h[a, H_K])):
            a = b
        if t < h[a, H_T] or (t == h[a, H_T] and k <= h[a, H_K]):
            break
        h[j, 0], h[j, 1], h[j, 2] = h[a, 0], h[a, 1], h[a, 2]
        j = a
    h[j, 0], h[j, 1], h[j, 2] = t, k, i


@njit
def heap_top(h, n):
    return h[0, H_T] if n[0] > 0 else FOREVER


@njit
def next_start(c, cfg_rows, now, it, n_req, n_ended, next_arr, arrival, n_run, n_wait, n_pend, n_swap, n_xfer,
               xfer_ids, kv_ready, epoch):
    """When copy c's next iteration starts (FOREVER: never, until something is routed to it): now
    when it has work, else its next arrival or the end of its first KV transfer; a copy that found
    nothing to schedule now (``EP_BLOCKED``) waits for those too."""
    if it[c] >= cfg_rows[c, K.C_MAX_ITERS] or n_ended[c] >= n_req[c]:
        return FOREVER   # (async: a request that ended last leaves its pending free to the next schedule)
    blocked = n_run[c] == 0 and n_pend[c] == 0 and epoch[c, K.EP_BLOCKED] == now[c]
    if not blocked and n_run[c] + n_wait[c] + n_pend[c] + n_swap[c] > 0:
        return now[c]
    t = K.next_wake(c, n_req[c], next_arr, arrival, xfer_ids, n_xfer, kv_ready)
    if t >= FOREVER:
        return FOREVER
    return t if t > now[c] else now[c]


@njit
def run_pd_kernel(ext, a_io, Rp, p_router, d_router, rpar_p, rpar_d, key0, key1, g_arrival, g_prompt, g_out,
                  g_capped, mml_of, g_prio, g_t1, g_t2, g_est, g_coff, g_cval, g_room, u_next, route_p, row_p, route_d,
                  row_d, gid, handoff, seq, n_seq, adm, hq, n_hq, rq, n_rq, view, pred, cand, rstate_p, rstate_d,
                  cfg_rows, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, with_kv, kv_src, hold_kv,
                  chain_off, chain_val, uniq_base, now, it, next_arr, n_ended, n_run, n_wait, n_swap, n_pend, n_xfer,
                  xfer_ids, kv_ready, n_free, status, end_state, finish, gen, computed, run_ids, wait_ids, pend_ids,
                  table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, hash_head, epoch, sched_r, hold_blk,
                  hold_at, hold_ids, n_hold, hold_top, active, claim, until_ns, *kargs):
    """Route every request of the cluster's table (``g_*``, arrival order) to a P replica, hand each
    with O > 1 to a D replica at the end of its prefill, release P's blocks at its transfer's end, and
    run the replicas to the end (module docstring). ``route_p[i]``/``row_p[i]`` and ``route_d[i]``/
    ``row_d[i]``: where request i ran (-1: not there); ``handoff[i]`` the handoff's instant (-1: none);
    ``gid[c, k]`` the request in row k of copy c; ``adm[d]`` the next row of D copy d whose admission
    is not yet seen. Returns the iterations run, or a negative code: -1 a NaN score, -2 no progress,
    -3 a replica's rows, chain ids or hash ids full, ``kernel.HOLD_FULL`` a hold store full. With
    ``ext`` the caller routes the arrivals to P: at an arrival some P replica serves, without an action
    in ``a_io[IO_ACTION]`` the loop stops with ``DECIDE`` (the next arrival in ``a_io[IO_NEXT]``; every
    state in the arrays, so the next call resumes there), with one it routes it there (outside the
    candidates or < 0: ``p_router``'s choice, counted in ``a_io[IO_REPLACED]``; round-robin's pointer
    follows the routed replica)."""
    R = n_req.shape[0]
    Rd = R - Rp
    N = g_arrival.shape[0]
    bs = cfg_rows[0, K.C_BS]
    total = 0
    a = a_io[IO_NEXT]   # the next arrival
    while True:
        # the next iteration of each pool: the least start, then the lowest index
        s_d = FOREVER
        c_d = -1
        s_p = FOREVER
        c_p = -1
        for c in range(R):
            s = next_start(c, cfg_rows, now, it, n_req, n_ended, next_arr, arrival, n_run, n_wait, n_pend, n_swap,
                           n_xfer, xfer_ids, kv_ready, epoch)
            if c >= Rp and s < s_d:
                s_d = s
                c_d = c
            elif c < Rp and s < s_p:
                s_p = s
                c_p = c
        t_rel = heap_top(rq, n_rq)
        t_hand = heap_top(hq, n_hq)
        t_arr = g_arrival[a] if a < N else FOREVER
        t_ev = min(t_hand, t_arr)
        # at one instant: handoffs and arrivals, D's schedules, releases, P's schedules
        if t_ev < FOREVER and t_ev <= s_d and t_ev <= t_rel and t_ev <= s_p:
            pass   # (delivered below)
        elif c_d >= 0 and s_d <= t_rel and s_d <= s_p:
            t_ev = FOREVER   # (D's iteration runs below)
        elif t_rel < FOREVER and t_rel <= s_p:   # a transfer ended: its P replica frees the blocks
            i = rq[0, H_I]
            heap_pop(rq, n_rq)
            c = route_p[i]
            if hold_at[c, row_p[i]] >= 0:
                K.release_held(c, row_p[i], held, n_cached, ref, bhash, fq_prev, fq_next, n_free,
                               hold_blk, hold_at, hold_ids, n_hold, hold_top)
                if epoch[c, K.EP_BLOCKED] == now[c]:   # (blocked on its held blocks: it tries again now)
                    epoch[c, K.EP_BLOCKED] = -1
                    if now[c] < t_rel:
                        now[c] = t_rel
            else:   # (async: it ended but still waits for P's next schedule, which now frees its blocks)
                hold_kv[c, row_p[i]] = False
            continue
        else:
            t_ev = FOREVER   # (P's iteration runs below)
        s_min, c_min = (s_d, c_d) if c_d >= 0 and s_d <= s_p else (s_p, c_p)
        if t_ev < FOREVER:
            if t_hand == t_ev:   # a prefill ended: the decode router picks a D replica
                i = hq[0, H_I]
                heap_pop(hq, n_hq)
                p = g_prompt[i]
                n_cand = pool_views(Rp, Rd, t_ev, d_router == R_LEAST_PREDICTED_TTFT, wants_hits(d_router), p, i, bs,
                                    g_coff, g_cval, cfg_rows, now, it, next_arr, n_run, n_wait, n_swap, n_pend, n_free,
                                    epoch, status, prompt, gen, computed, run_ids, wait_ids, pend_ids, table, slot_of,
                                    held, ref, hold_kv, hash_head, n_req, n_ended, view, pred, cand)
                if n_cand == 0:   # no D replica serves it: it ends here, its blocks are freed
                    heap_push(rq, n_rq, t_ev, seq[i], i)
                    continue
                c = Rp + choose(d_router, rpar_d, key0, key1, i, cand[:Rd], n_cand, view[:Rd], rstate_d, pred[:Rd])
                k = append_row(c, i, t_ev, False, cfg_rows, g_prompt, g_out, g_capped, mml_of, g_prio, g_t1, g_t2,
                               g_est, g_coff, g_cval, g_room, u_next, n_req, arrival, prompt, out_len, prio, capped, t1,
                               t2, est, chain_off, chain_val, uniq_base, hash_head)   # (no prefix caching on D)
                if k < 0:
                    return -3
                with_kv[c, k] = True
                kv_src[c, k] = route_p[i]
                route_d[i] = c - Rp
                row_d[i] = k
                gid[c, k] = i
                continue
            # an arrival: the prefill router (or the caller) picks a P replica
            i = a
            p = g_prompt[i]
            want_q = ext or p_router == R_LEAST_PREDICTED_TTFT   # (outside the call: numba's bytecode)
            want_h = ext or wants_hits(p_router)
            n_cand = pool_views(0, Rp, t_ev, want_q, want_h, p, i, bs, g_coff, g_cval, cfg_rows, now, it, next_arr,
                                n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen, computed, run_ids,
                                wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, hash_head, n_req, n_ended, view,
                                pred, cand)
            if n_cand == 0:
                a += 1
                continue   # (rejected at the router: route_p[i] stays -1)
            if ext:
                j = a_io[IO_ACTION]
                if j == NO_ACTION:
                    a_io[IO_NEXT] = a
                    return DECIDE
                a_io[IO_ACTION] = NO_ACTION
                if j < 0 or j >= Rp or not cand[j]:
                    c = choose(p_router, rpar_p, key0, key1, i, cand[:Rp], n_cand, view[:Rp], rstate_p, pred[:Rp])
                    a_io[IO_REPLACED] += 1
                else:
                    c = j
                    if p_router == R_ROUND_ROBIN:   # (its pointer follows the routed replica)
                        rstate_p[0] = (c + 1) % Rp
            else:
                c = choose(p_router, rpar_p, key0, key1, i, cand[:Rp], n_cand, view[:Rp], rstate_p, pred[:Rp])
            a += 1
            k = append_row(c, i, t_ev, True, cfg_rows, g_prompt, g_out, g_capped, mml_of, g_prio, g_t1, g_t2, g_est,
                           g_coff, g_cval, g_room, u_next, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est,
                           chain_off, chain_val, uniq_base, hash_head)
            if k < 0:
                return -3
            out_len[c, k] = 1   # (P runs it as if O = 1)
            capped[c, k] = capped[c, k] and g_out[mml_of[c], i] == 1
            hold_kv[c, k] = True   # (every request's blocks free by a release: one order of frees)
            route_p[i] = c
            row_p[i] = k
            gid[c, k] = i
            continue
        if c_min < 0:
            a_io[IO_NEXT] = a
            break   # nothing left to run or deliver
        # one iteration of c_min (the kernel runs the iteration starting at s_min and stops)
        c = c_min
        if now[c] < s_min:   # (idle, or blocked on its transfers, until then: rule 13's clock jump)
            now[c] = s_min
        before = (now[c], it[c], n_ended[c], n_req[c] - next_arr[c], n_xfer[c], n_pend[c], n_free[c],
                  epoch[c, K.EP_BLOCKED])
        ended0 = n_ended[c]
        active[c] = True
        claim[0] = c
        until_ns[c] = s_min + 1
        done = K.run_copies_kernel(*kargs)
        active[c] = False
        if done < 0:
            return done
        if (now[c], it[c], n_ended[c], n_req[c] - next_arr[c], n_xfer[c], n_pend[c], n_free[c],
                epoch[c, K.EP_BLOCKED]) == before:   # (a blocked copy's first call: progress)
            return -2
        total += done
        if c < Rp:
            if n_ended[c] > ended0:   # prefills that ended in it, in the order it ended them (rule 7)
                e = now[c]
                for q in range(sched_r.shape[1]):
                    r = sched_r[c, q]
                    if r >= n_req[c] or status[c, r] != K.ENDED or finish[c, r] != e:
                        continue
                    i = gid[c, r]
                    if seq[i] >= 0:
                        continue
                    seq[i] = (c << 40) | n_seq[0]
                    n_seq[0] += 1
                    if end_state[c, r] == K.E_COMPLETED and g_out[mml_of[c], i] > 1:   # handed off at its end
                        handoff[i] = e
                        heap_push(hq, n_hq, e, seq[i], i)
                    else:   # it ended here: its blocks free now (as a colocated engine's would)
                        heap_push(rq, n_rq, e, seq[i], i)
        else:
            # admissions from the remote queue (FIFO, so in row order): releases at the transfers' ends
            while adm[c] < n_req[c]:
                r = adm[c]
                if kv_ready[c, r] >= 0:
                    t_e = kv_ready[c, r]
                elif status[c, r] == K.ENDED:   # (rejected on D: P frees the blocks then)
                    t_e = finish[c, r]
                else:
                    break
                i = gid[c, r]
                heap_push(rq, n_rq, t_e, seq[i], i)
                adm[c] += 1
    return total


guard_stale_cache([heap_push, heap_pop, heap_top, next_start, run_pd_kernel], tag="disagg")
