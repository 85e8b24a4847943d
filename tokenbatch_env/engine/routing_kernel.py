"""Routing from outside, in compiled code (docs/design.md section 12, "Routing env"): E clusters of R
replicas each (copies e*R .. e*R+R-1 of one struct of arrays), every cluster's arrivals routed one
decision at a time by a caller (an agent), each cluster run by the colocated loop's own parts
(``cluster_kernel.advance_copies``, ``pool_views``, ``append_row``) so that a cluster routed as a
router would route it equals ``simulate_cluster`` record for record.

A cluster waits at its *pending* arrival ``a_next[e]``: its replicas advanced to that arrival's
instant, the router's view of each (``view[e]``, ``pred[e]``) and which replicas may take it
(``mask[e]``: the replica serves its prompt and has room for its row) read. ``route_step`` routes
each acting cluster's pending arrival to its action (a masked action: the base router's choice,
counted) and runs the cluster to its next arrival that some replica can serve (arrivals none can
serve are rejected at the router, as the loop does), or, after its last arrival, to the end.
"""

from __future__ import annotations

from ._jit import guard_stale_cache, njit
from . import kernel as K
from .cluster_kernel import FOREVER, R_ROUND_ROBIN, advance_copies, append_row, choose, has_room, pool_views
from .outcomes import request_outcome


@njit
def next_decision(e, R, a_next, n_of, route, row, view, pred, mask, done, g_arrival, g_prompt, g_coff,
                  g_cval, g_room, u_next, cfg_rows, n_req, arrival, chain_off, chain_val, now, it, next_arr, n_ended,
                  n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen, computed, run_ids, wait_ids,
                  pend_ids, table, slot_of, held, ref, hold_kv, hash_head, active, claim, until_ns, kargs):
    """Run cluster e to its next arrival some replica can serve and read its views and mask there;
    after its last arrival, run it to the end (``done[e]``). Returns the iterations run or the
    engine's error code (< 0)."""
    lo = e * R
    bs = cfg_rows[lo, K.C_BS]
    total = 0
    while a_next[e] < n_of[e]:
        a = a_next[e]
        t = g_arrival[e, a]
        d = advance_copies(t, lo, lo + R, cfg_rows, n_req, now, it, n_ended, active, claim, until_ns, kargs)
        if d < 0:
            return d
        total += d
        n_cand = pool_views(lo, R, t, True, True, g_prompt[e, a], a, bs, g_coff[e], g_cval[e], cfg_rows, now, it,
                            next_arr, n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen, computed,
                            run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, hash_head, n_req, n_ended,
                            view[e], pred[e], mask[e])
        if n_cand > 0:
            for j in range(R):
                if mask[e, j] and not has_room(lo + j, a, True, cfg_rows, g_coff[e], g_room[e], u_next, n_req,
                                               arrival, chain_off, chain_val, hash_head):
                    mask[e, j] = False
            return total
        route[e, a] = -1   # no replica serves its prompt: rejected at the router
        row[e, a] = -1
        a_next[e] = a + 1
    d = advance_copies(FOREVER, lo, lo + R, cfg_rows, n_req, now, it, n_ended, active, claim, until_ns, kargs)
    if d < 0:
        return d
    done[e] = True
    return total + d


@njit
def route_step(R, base_router, rpar, keys, acting, actions, replaced, rstate, a_next, n_of, route, row, view, pred,
               mask, done, g_arrival, g_prompt, g_out, g_capped, mml_of, g_prio, g_t1, g_t2, g_est, g_coff, g_cval,
               g_room, u_next, cfg_rows, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, chain_off,
               chain_val, uniq_base, now, it, next_arr, n_ended, n_run, n_wait, n_swap, n_pend, n_free, status, gen,
               computed, run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, hash_head, epoch, active,
               claim, until_ns, kargs):
    """Route each acting cluster's pending arrival (``acting[e]``, not ``done[e]``) to replica
    ``actions[e]``; an action outside ``mask[e]`` (or < 0) is replaced by ``base_router``'s choice
    among the mask (``replaced[e]`` counts them); then run the cluster to its next decision
    (``next_decision``). ``g_*``: each cluster's request table, row e ([E, ...], ``n_of[e]`` requests).
    Returns the iterations run, or the engine's error code (< 0)."""
    E = a_next.shape[0]
    total = 0
    for e in range(E):
        if not acting[e] or done[e]:
            continue
        lo = e * R
        i = a_next[e]
        j = actions[e]
        if j < 0 or j >= R or not mask[e, j]:
            n_ok = 0
            for q in range(R):
                if mask[e, q]:
                    n_ok += 1
            j = choose(base_router, rpar, keys[e, 0], keys[e, 1], i, mask[e], n_ok, view[e], rstate[e], pred[e])
            replaced[e] += 1
        elif base_router == R_ROUND_ROBIN:   # (its pointer follows the routed replica, as if it had chosen it)
            rstate[e, 0] = (j + 1) % R
        c = lo + j
        k = append_row(c, i, g_arrival[e, i], True, cfg_rows, g_prompt[e], g_out[e], g_capped[e], mml_of, g_prio[e],
                       g_t1[e], g_t2[e], g_est[e], g_coff[e], g_cval[e], g_room[e], u_next, n_req, arrival, prompt,
                       out_len, prio, capped, t1, t2, est, chain_off, chain_val, uniq_base, hash_head)
        if k < 0:
            return -3   # (the mask keeps full replicas out: not reached)
        route[e, i] = j
        row[e, i] = k
        a_next[e] = i + 1
        d = next_decision(e, R, a_next, n_of, route, row, view, pred, mask, done, g_arrival, g_prompt,
                          g_coff, g_cval, g_room, u_next, cfg_rows, n_req, arrival, chain_off, chain_val, now, it,
                          next_arr, n_ended, n_run, n_wait, n_swap, n_pend, n_free, epoch, status, prompt, gen,
                          computed, run_ids, wait_ids, pend_ids, table, slot_of, held, ref, hold_kv, hash_head, active,
                          claim, until_ns, kargs)
        if d < 0:
            return d
        total += d
    return total


guard_stale_cache([next_decision, route_step], tag="routing")


@njit
def credit(e, R, s0, s1, cursor, credited, pending, route, row, end_state, first_token, arrival, finish, out_len,
           t1, t2):
    """Cluster e's scored requests (indices ``s0[e]`` .. ``s1[e]``-1) met that ended since the last call
    (each counted once, ``credited[e]``): the routed requests from ``cursor[e]`` on, in arrival order,
    that have ended; a request rejected at the router ends unmet at its arrival."""
    lo = e * R
    got = 0
    i = cursor[e]
    moving = True
    while i < pending[e]:
        if not credited[e, i]:
            j = route[e, i]
            if j < 0:
                credited[e, i] = True
            else:
                c = lo + j
                k = row[e, i]
                if end_state[c, k] != K.E_NONE:
                    credited[e, i] = True
                    if s0[e] <= i < s1[e] and request_outcome(end_state[c, k], first_token[c, k], arrival[c, k],
                                                              finish[c, k], out_len[c, k], t1[c, k], t2[c, k],
                                                              True)[2]:
                        got += 1
        if moving and credited[e, i]:
            cursor[e] = i + 1
        else:
            moving = False
        i += 1
    return got


@njit
def credit_many(clusters, out, R, s0, s1, cursor, credited, pending, route, row, end_state, first_token, arrival,
                finish, out_len, t1, t2):
    """``credit`` of each cluster of ``clusters`` into ``out[e]``."""
    for q in range(clusters.shape[0]):
        e = clusters[q]
        out[e] = credit(e, R, s0, s1, cursor, credited, pending, route, row, end_state, first_token, arrival, finish,
                        out_len, t1, t2)


guard_stale_cache([credit, credit_many], tag="routing-credit")
