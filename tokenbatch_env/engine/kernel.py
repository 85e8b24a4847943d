"""The engine's step: one vLLM V1 scheduling iteration for every copy (docs/design.md section 3).

This module is the one implementation of the dynamics. It is written in the subset of Python that
numba compiles; with ``NUMBA_DISABLE_JIT=1`` the very same functions run interpreted (the reference
path, compared with the compiled one in a lockstep test). Everything is integer arithmetic; the clock is int64 ns.

Numbers in comments refer to docs/design.md section 3's rules.

Departure from docs/design.md section 3, "Jumps": a jump also runs while requests wait, as long as none
can be admitted during it (each fails the admission gate, or, without skip_hol, the queue's head
does: with the in-engine scores' order the waiting requests are rescored at each jumped iteration
and the jump ends before the first whose head passes), bounded by their shed and time-out instants
and by the decision epochs that need a decision. Jumped == stepped is tested record by record.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

from ._jit import borrow, fetch_add, guard_stale_cache, helper, njit, prefetch, prefetch3
from .scoring import (P_EXTERNAL, P_GITTINS, P_INDEX, clip_z, gittins_score, index_log_dynamic, prefill_time_ns,
                      index_log_static, policy_score, service_ms)

# ---------------------------------------------------------------------------------- constants
# request status
FUTURE, WAITING, RUNNING, ENDED, SWAPPED, TRANSFERRING = 0, 1, 2, 3, 4, 5
# end states (docs/design.md section 3, "Outcomes")
E_NONE, E_COMPLETED, E_SHED, E_TIMED_OUT, E_LENGTH_CAPPED, E_REJECTED, E_UNFINISHED = 0, 1, 2, 3, 4, 5, 6
END_STATE_NAMES = ("none", "completed", "shed", "timed_out", "length_capped", "rejected", "unfinished")
# policy modes for ordering
MODE_FCFS, MODE_PRIORITY, MODE_SCORE = 0, 1, 2

# cfg vector indices
(C_BUDGET, C_MAX_SEQS, C_BS, C_USABLE, C_WATERMARK, C_MAX_LEN, C_PREFIX, C_ASYNC, C_MODE, C_JUMPS,
 C_MAX_WAIT, C_TIMEOUT_RUNNING, C_SKIP_HOL, C_MAX_ITERS,
 C_PS0, C_PS_PREFILL, C_PS_C2, C_PS_ATTN, C_PS_DECODE, C_PS_KV, C_RESUME_FIRST, C_PID, C_WAIT_PREEMPT, C_ADMISSION,
 C_SWAP, C_HOST_BLOCKS, C_SWAP_PS_PER_BLOCK, C_REC_STREAM, C_DECIDE, C_THRESHOLD, C_BUDGET_RULE, C_STOP_IDLE,
 C_XFER_PS_PER_TOKEN, C_XFER_LAT_NS, N_CFG) = range(35)
# ``cfg[C_XFER_PS_PER_TOKEN]``, ``cfg[C_XFER_LAT_NS]``: the KV transfer of a request that arrives with
# its KV (rule 13) over its link (``kv_src``): N tokens take N x ps_per_token (rounded up to ns) +
# latency after the link is free (docs/design.md section 13); both 0: no transfer
# ``cfg[C_STOP_IDLE]``: an idle copy whose clock jumps to its next arrival at or past ``until_ns`` stops
# there (a cluster's replica, docs/design.md section 12: its iteration at t waits for the other
# arrivals at t); otherwise that arrival's iteration runs (``EngineRun.advance``: the first iteration
# boundary at or after ``until_ns``)
# float cfg vector indices: ms per prefill / decode token at a full batch (docs/design.md section 4);
# the tpot-guard rule's u and B_min (section 11)
(F_U_P, F_U_D, F_GUARD_U, F_GUARD_BMIN, N_FCFG) = range(5)
# budget rules (``cfg[C_BUDGET_RULE]``, docs/design.md section 11)
BUDGET_NONE, BUDGET_TPOT_GUARD = 0, 1
BUDGET_RULES = ("none", "tpot-guard")
#: a TPOT SLO at or above this many ns is none (requests without SLOs hold NEVER // 4): not guarded
NO_TPOT_SLO_NS = 10**15

# decision epochs (docs/design.md section 5), ``EngineArrays.epoch`` columns: the episode start, the epoch
# length (ns), the scored requests [s0, s1), the first scored request not yet seen ended (end states
# never revert, so this cursor only moves forward), shedding on (the decision rule's), and why the
# copy last stopped (written with ``cfg[C_DECIDE]``). Then what a cluster's router reads (docs/design.md
# section 12): the running requests, free blocks and ended requests as the copy's last iteration was
# scheduled (before its completions: the view of an iteration in flight), and the copy's totals of
# busy time (ns), admitted tokens and their prefix-cache hits (vLLM's queries and hits)
(EP_T0, EP_DT, EP_S0, EP_S1, EP_OPEN, EP_SHED, EP_STOP, EP_V_RUN, EP_V_FREE, EP_V_ENDED, EP_BUSY, EP_QUERY_TOK,
 EP_HIT_TOK, EP_BLOCKED, N_EP) = range(15)
# ``epoch[c, EP_BLOCKED]``: a cluster's replica (``C_STOP_IDLE``) with nothing running and KV transfers in
# flight or blocks held for them found nothing to schedule at this instant (section 13): its loop, which
# knows the rows not yet routed to it and the releases, runs it next at the first transfer's end, a
# release or its next arrival (-1 or stale: not blocked)
STOP_NONE, STOP_DECIDE, STOP_ENDED, STOP_CAP = 0, 1, 2, 3
#: the kernel's result when a copy's hold store (``hold_blk``) is full: the caller sizes it again
HOLD_FULL = -4
_FOREVER = np.iinfo(np.int64).max // 2  # a time no run reaches

# per-iteration record columns (docs/design.md section 3, "per-iteration records")
ITER_COLUMNS = ("iteration", "start_ns", "end_ns", "prefill_tokens", "decodes", "scheduled_reqs",
                "preempted", "blocks_used", "running", "waiting")
N_ITER_COLS = len(ITER_COLUMNS)


class EngineArrays(NamedTuple):
    """Struct of arrays with a leading copy axis. Static trace columns first, then dynamic state."""

    # static, [C] or [C, R]
    n_req: np.ndarray
    arrival: np.ndarray
    prompt: np.ndarray
    out_len: np.ndarray          # output tokens to generate (capped at max_model_len - prompt)
    prio: np.ndarray             # vLLM priority (lower is served first)
    capped: np.ndarray           # bool: output was capped (end state length_capped)
    t1: np.ndarray               # TTFT SLO (ns); used by in-engine scores and shedding
    t2: np.ndarray               # TPOT SLO (ns); used by the tpot-guard budget rule
    est: np.ndarray              # output-length estimate at arrival (float; NaN: use residual life)
    with_kv: np.ndarray          # bool: arrives with its prompt's KV and its first token (rule 13)
    kv_src: np.ndarray           # the link its KV comes over (an index into link_free)
    hold_kv: np.ndarray          # bool: ended, its blocks stay held until released (a prefill replica's)
    chain_off: np.ndarray        # [C, R+1] CSR offsets into chain_val
    chain_val: np.ndarray        # [C, H] dense shared-block ids (per copy)
    uniq_base: np.ndarray        # [C, R] dense id of the request's first unique block
    # dynamic per copy [C]
    now: np.ndarray
    it: np.ndarray
    next_arr: np.ndarray
    n_ended: np.ndarray
    key_hi: np.ndarray
    key_lo: np.ndarray
    n_run: np.ndarray
    n_wait: np.ndarray
    n_free: np.ndarray
    n_slot_free: np.ndarray
    n_pend: np.ndarray
    n_iter_rec: np.ndarray
    # dynamic per request [C, R]
    status: np.ndarray
    end_state: np.ndarray
    computed: np.ndarray
    gen: np.ndarray
    qkey: np.ndarray
    slot_of: np.ndarray
    held: np.ndarray
    n_cached: np.ndarray         # leading blocks of the request already hashed into the cache
    first_sched: np.ndarray
    first_token: np.ndarray
    first_token_it: np.ndarray
    finish: np.ndarray
    finish_it: np.ndarray
    n_preempt: np.ndarray
    recomputed: np.ndarray
    resumed: np.ndarray          # bool: preempted and waiting to resume (resume_first pins these)
    # lists
    run_ids: np.ndarray          # [C, S] admission order
    wait_ids: np.ndarray         # [C, R] unordered
    slot_free: np.ndarray        # [C, S] stack of free table slots
    pend_ids: np.ndarray         # [C, S] finished requests whose blocks free after the next schedule
    table: np.ndarray            # [C, S, maxb] block ids held, by slot
    # block pool [C, NB] (+2 sentinels on the free queue)
    ref: np.ndarray
    bhash: np.ndarray
    hnext: np.ndarray
    fq_prev: np.ndarray
    fq_next: np.ndarray
    hash_head: np.ndarray        # [C, U] first block holding dense hash id, -1 if none
    # scratch per copy
    sched_r: np.ndarray          # [C, S] requests scheduled this iteration
    sched_new: np.ndarray        # [C, S] tokens scheduled
    sched_cb: np.ndarray         # [C, S] computed before
    iter_rec: np.ndarray         # [C, maxrec, N_ITER_COLS]
    jump_ids: np.ndarray         # [C, S] scratch: running requests bucketed by block phase
    jump_off: np.ndarray         # [C, bs + 1] scratch: bucket offsets
    emit_it: np.ndarray          # [C, R] iteration of the request's latest token (-1: none yet)
    swapped: np.ndarray          # [C, R] blocks swapped out to host memory (cumulative)
    swap_ids: np.ndarray         # [C, R] the swapped queue, FIFO (beyond vLLM: V0 swap preemption)
    n_swap: np.ndarray           # [C]
    host_free: np.ndarray        # [C] free host blocks for swapping
    epoch: np.ndarray            # [C, N_EP] decision-epoch state (EP_* columns)
    kv_ready: np.ndarray         # [C, R] the end of its KV transfer (rule 13; -1: none)
    kv_first: np.ndarray         # [C, R] rule 13: the end of its first iteration here (its token 2; -1: none)
    link_free: np.ndarray        # [C, L] when each link's last transfer ends (FIFO per link)
    xfer_ids: np.ndarray         # [C, S] admitted requests whose KV is in transfer, in admission order
    n_xfer: np.ndarray           # [C]
    hold_blk: np.ndarray         # [C, 1, NH] block ids of the requests holding their KV (hold_kv), by offset
    hold_at: np.ndarray          # [C, R] a holding request's offset into hold_blk (-1: not holding)
    hold_ids: np.ndarray         # [C, R] the holding requests, in offset order
    n_hold: np.ndarray           # [C]
    hold_top: np.ndarray         # [C] hold_blk's first unused entry


# Performance note. Every ``A.field`` read of the NamedTuple inside a numba function is a new
# reference to the array (an NRT incref/decref pair, i.e. two atomic operations plus an opaque call
# that blocks LLVM's load hoisting). The hot path therefore never touches ``A``: ``run_copies``
# unpacks the fields once and every function below receives plain arrays.

# ---------------------------------------------------------------------------------- block size
@helper
def block_shift(bs):
    """log2(bs) if the block size is a power of two (then ``_bdiv``/``_bmod`` shift and mask), else -1."""
    sh = 0
    while (1 << sh) < bs:
        sh += 1
    return sh if (1 << sh) == bs else -1


@helper
def _bdiv(x, bs, bsh):
    """x // bs. bsh = ``block_shift(bs)``: a shift equals floor division for every int64 x when bs
    is a power of two (numba's ``//`` by a runtime value is an idiv plus sign fix-ups)."""
    if bsh >= 0:
        return x >> bsh
    return x // bs


@helper
def _bmod(x, bs, bsh):
    """x % bs (Python's sign), as ``_bdiv``."""
    if bsh >= 0:
        return x & (bs - 1)
    return x % bs


# ---------------------------------------------------------------------------------- block pool
@helper
def _fq_remove(fq_prev, fq_next, n_free, c, b):
    p = fq_prev[c, b]
    n = fq_next[c, b]
    fq_next[c, p] = n
    fq_prev[c, n] = p
    fq_prev[c, b] = -1
    fq_next[c, b] = -1
    n_free[c] -= 1


@helper
def _fq_splice(fq_prev, fq_next, c, first, last, p):
    """Link the chain first..last (linked among itself) into the free queue right after p (the front
    sentinel or a block in the queue); the caller counts its blocks in ``n_free``."""
    n = fq_next[c, p]
    fq_next[c, p] = first
    fq_prev[c, first] = p
    fq_next[c, last] = n
    fq_prev[c, n] = last


@helper
def _chain_append(fq_prev, fq_next, c, last, b):
    """Link b after ``last``, the end of a chain being built (-1: b starts it)."""
    if last >= 0:
        fq_next[c, last] = b
        fq_prev[c, b] = last


@helper
def _fq_prepend(fq_prev, fq_next, n_free, c, b, head):
    """Insert b right after ``head`` (the queue's front sentinel, or a block already in the queue)."""
    _fq_splice(fq_prev, fq_next, c, b, b, head)
    n_free[c] += 1


@helper
def _uncache(bhash, hash_head, hnext, c, b):
    """Remove block b from the hash map (it is about to be reused)."""
    h = bhash[c, b]
    if h < 0:
        return
    cur = hash_head[c, h]
    if cur == b:
        hash_head[c, h] = hnext[c, b]
    else:
        while cur >= 0:
            nxt = hnext[c, cur]
            if nxt == b:
                hnext[c, cur] = hnext[c, b]
                break
            cur = nxt
    hnext[c, b] = -1
    bhash[c, b] = -1


@helper
def _alloc(fq_prev, fq_next, n_free, bhash, hash_head, hnext, ref, table, slot_of, held, c, r, k, head):
    """Pop k blocks from the free queue's front (evicting cached ones lazily) into r's table. The
    popped run is unlinked as one piece (the same links as k ``_fq_remove`` of the front), with the
    counters kept in registers: every store to an array may alias any other for the compiler, so
    per-block updates of ``held``/``n_free`` would reload all of them at each block."""
    s = slot_of[c, r]
    h = held[c, r]
    b = fq_next[c, head]
    for _ in range(k):
        nxt = fq_next[c, b]
        fq_prev[c, b] = -1
        fq_next[c, b] = -1
        _uncache(bhash, hash_head, hnext, c, b)
        ref[c, b] = 1
        table[c, s, h] = b
        h += 1
        b = nxt
    fq_next[c, head] = b
    fq_prev[c, b] = head
    held[c, r] = h
    n_free[c] -= k


@helper
def _hash_ids(chain_off, uniq_base, c, r):
    """Where r's block hash ids come from, for ``_hash_id``: (start of its shared prefix chain in
    ``chain_val``, the chain's length n, and its own (unique) ids' base less n). Read once per walk
    over r's blocks: inside a loop that stores to any array the compiler must reload them."""
    lo = chain_off[c, r]
    n = chain_off[c, r + 1] - lo
    return lo, n, uniq_base[c, r] - n


@helper
def _hash_id(chain_val, c, lo, n, ub, j):
    """The dense hash id of block j of the request whose ``_hash_ids`` are (lo, n, ub): its shared
    chain's ids first, then its own consecutive ones."""
    return chain_val[c, lo + j] if j < n else ub + j


@helper
def _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off, chain_val, uniq_base,
                  c, r, upto_tokens, bs, bsh):
    """Hash r's full blocks up to ``upto_tokens`` into the prefix cache (vLLM caches on allocation)."""
    full = _bdiv(upto_tokens, bs, bsh)
    j = n_cached[c, r]
    if j >= full:
        return
    s = slot_of[c, r]
    lo, n, ub = _hash_ids(chain_off, uniq_base, c, r)
    while j < full:
        b = table[c, s, j]
        if bhash[c, b] < 0:
            h = _hash_id(chain_val, c, lo, n, ub, j)
            bhash[c, b] = h
            # append to the hash's block list (the first inserted is returned on lookup)
            cur = hash_head[c, h]
            if cur < 0:
                hash_head[c, h] = b
            else:
                while hnext[c, cur] >= 0:
                    cur = hnext[c, cur]
                hnext[c, cur] = b
            hnext[c, b] = -1
        j += 1
    n_cached[c, r] = full


@helper
def _free_blocks(ids, s, o, n, ref, bhash, fq_prev, fq_next, n_free, c, head, tail):
    """Release the blocks ``ids[c, s, o:o + n]`` (a table slot's, or a hold store's) in reverse order
    (tail evicted first). Cached ones are appended to the free queue; hashless ones go to its front
    as a group, keeping that order (vLLM's ``BlockPool.free_blocks``: ``prepend_n`` then
    ``append_n``). Each group is chained first and spliced in once: the same queue as inserting
    block by block (profiled: those inserts, each reading the links the previous one wrote, were 5%
    of the env's step)."""
    front0 = front1 = -1   # the hashless group (first, last), in release order
    back0 = back1 = -1     # the cached group
    freed = 0
    for j in range(n - 1, -1, -1):
        b = ids[c, s, o + j]
        left = ref[c, b] - 1
        ref[c, b] = left
        if left == 0:
            freed += 1
            if bhash[c, b] < 0:
                _chain_append(fq_prev, fq_next, c, front1, b)
                front0 = b if front1 < 0 else front0
                front1 = b
            else:
                _chain_append(fq_prev, fq_next, c, back1, b)
                back0 = b if back1 < 0 else back0
                back1 = b
    if front0 >= 0:   # right after the front sentinel
        _fq_splice(fq_prev, fq_next, c, front0, front1, head)
    if back0 >= 0:    # at the back, before the sentinel
        _fq_splice(fq_prev, fq_next, c, back0, back1, fq_prev[c, tail])
    n_free[c] += freed


@helper
def _free_request_blocks(table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free,
                         slot_free, n_slot_free, c, r, head, tail):
    """Release r's blocks (``_free_blocks``: its table slot's) and its slot."""
    s = slot_of[c, r]
    _free_blocks(table, s, 0, held[c, r], ref, bhash, fq_prev, fq_next, n_free, c, head, tail)
    held[c, r] = 0
    n_cached[c, r] = 0
    slot_free[c, n_slot_free[c]] = s
    n_slot_free[c] += 1
    slot_of[c, r] = -1


@helper
def _hold(table, slot_of, held, slot_free, n_slot_free, hold_blk, hold_at, hold_ids, n_hold, hold_top, c, r):
    """Take r out of the running list and keep its blocks (docs/design.md section 13: a prefill
    replica's request, finished-holding until its KV has moved): its block ids move from its table
    slot, which is freed, to ``hold_blk`` (compacted when full). Returns False if they do not fit
    there even then (the caller sizes it again)."""
    n = held[c, r]
    if hold_top[c] + n > hold_blk.shape[2]:   # compact: the holders' blocks, in offset order, from 0
        top = 0
        for k in range(n_hold[c]):
            q = hold_ids[c, k]
            o = hold_at[c, q]
            for j in range(held[c, q]):
                hold_blk[c, 0, top + j] = hold_blk[c, 0, o + j]
            hold_at[c, q] = top
            top += held[c, q]
        hold_top[c] = top
        if top + n > hold_blk.shape[2]:
            return False
    s = slot_of[c, r]
    o = hold_top[c]
    for j in range(n):
        hold_blk[c, 0, o + j] = table[c, s, j]
    hold_at[c, r] = o
    hold_top[c] = o + n
    hold_ids[c, n_hold[c]] = r
    n_hold[c] += 1
    slot_free[c, n_slot_free[c]] = s
    n_slot_free[c] += 1
    slot_of[c, r] = -1
    return True


@njit
def release_held(c, r, held, n_cached, ref, bhash, fq_prev, fq_next, n_free, hold_blk, hold_at, hold_ids, n_hold,
                 hold_top):
    """Free the blocks request r of copy c holds (``_hold``) as a completion frees a request's:
    in reverse order, hashless ones to the free queue's front, cached ones to its back."""
    nb = ref.shape[1]
    o = hold_at[c, r]
    _free_blocks(hold_blk, 0, o, held[c, r], ref, bhash, fq_prev, fq_next, n_free, c, nb, nb + 1)
    if o + held[c, r] == hold_top[c]:
        hold_top[c] = o
    for k in range(n_hold[c]):
        if hold_ids[c, k] == r:
            for q in range(k, n_hold[c] - 1):
                hold_ids[c, q] = hold_ids[c, q + 1]
            n_hold[c] -= 1
            break
    if n_hold[c] == 0:
        hold_top[c] = 0
    hold_at[c, r] = -1
    held[c, r] = 0
    n_cached[c, r] = 0


@helper
def _retire(run_ids, n_run, table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free, slot_free,
            n_slot_free, c, r, head, tail, hold_kv, hold_blk, hold_at, hold_ids, n_hold, hold_top):
    """Take r out of the running list and release its blocks (a completion, or async's pending free),
    or keep them (``_hold``) when it holds its KV for a transfer (``hold_kv``, a prefill replica's).
    Returns False when the hold store is full."""
    for q in range(n_run[c]):
        if run_ids[c, q] == r:
            _run_remove_at(run_ids, n_run, c, q)
            break
    if hold_kv[c, r]:
        return _hold(table, slot_of, held, slot_free, n_slot_free, hold_blk, hold_at, hold_ids, n_hold, hold_top,
                     c, r)
    _free_request_blocks(table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free, slot_free,
                         n_slot_free, c, r, head, tail)
    return True


@helper
def prefix_hits(hash_head, chain_off, chain_val, uniq_base, c, r, num_tokens, bs, bsh=-1):
    """Cached leading blocks of r: a contiguous chain from block 0, capped at num_tokens - 1."""
    max_blocks = _bdiv(num_tokens - 1, bs, bsh)
    lo, n, ub = _hash_ids(chain_off, uniq_base, c, r)
    k = 0
    while k < max_blocks:
        if hash_head[c, _hash_id(chain_val, c, lo, n, ub, k)] < 0:
            break
        k += 1
    return k


# ---------------------------------------------------------------------------------- request inputs
@helper
def request_inputs(waiting, hits, prompt, gen, computed, held, to_deadline_ns, est, mrl, bs, budget, ps, u_p,
                   u_d, bsh=-1):
    """The index inputs of one request (docs/design.md section 4): one definition for the in-engine scores,
    the shed rule, the decision rule and the env's observation. The request's state comes as scalars
    (prompt, generated and computed tokens, held blocks, ns to its TTFT deadline, output estimate
    (NaN: the residual-life table ``mrl``), and, if waiting, its cached prefix blocks ``hits`` from
    ``prefix_hits``), so that callers need not pass the [C, R] state arrays. Returns (cached tokens:
    hits if waiting, else computed prompt; prefill left P; blocks needed; first token out; ms to the
    deadline; slack ms; estimated decode left d; S ms)."""
    cached, p_left, blocks_needed, first_out, idle_ms, d_left, s_ms = request_static(
        waiting, hits, prompt, gen, computed, held, est, mrl, bs, budget, ps, u_p, u_d, bsh)
    to_deadline_ms, slack_ms = _slack(to_deadline_ns, first_out, idle_ms)
    return cached, p_left, blocks_needed, first_out, to_deadline_ms, slack_ms, d_left, s_ms


@helper
def _slack(to_deadline_ns, first_out, idle_ms):
    """(ms to the deadline, slack ms) of ``request_inputs``: the only inputs that move with the clock."""
    to_deadline_ms = to_deadline_ns / 1e6
    slack_ms = to_deadline_ms
    if not first_out:
        slack_ms -= idle_ms
    return to_deadline_ms, slack_ms


@helper
def request_static(waiting, hits, prompt, gen, computed, held, est, mrl, bs, budget, ps, u_p, u_d, bsh=-1):
    """``request_inputs`` less the clock's part (``_slack``): (cached tokens, P, blocks needed, first
    token out, idle prefill ms, d, S ms); constant while a waiting request's hits are."""
    num_tokens = prompt + gen
    if waiting:
        done = hits * bs
        cached = done
        p_left = num_tokens - done
        blocks_needed = _bdiv(num_tokens + bs - 1, bs, bsh) - hits
    else:
        done = computed
        cached = done if done < prompt else prompt
        p_left = num_tokens - done
        if gen > 0 and p_left == 1:
            p_left = 0  # decoding
        blocks_needed = held
    first_out = gen > 0
    idle_ms = prefill_time_ns(p_left, done, budget, ps) / 1e6
    mrl_g = mrl[gen if gen < mrl.shape[0] else mrl.shape[0] - 1]
    if est != est:  # NaN: the family's mean residual life
        d_left = mrl_g
    else:
        d_left = est - gen
        if d_left < 1.0:
            d_left = 1.0
    s_ms = service_ms(float(p_left), d_left, u_p, u_d)
    return cached, p_left, blocks_needed, first_out, idle_ms, d_left, s_ms


@helper
def _request_score(waiting, hits, p, g, comp, hld, arr, t1r, est_r, queue_pos, t_now, mrl, gtab, theta_c, pid, sm,
                   kvf, usable, bs, bsh, budget, ps, u_p, u_d, scoring):
    """The in-engine score of one request at iteration start ``t_now`` (docs/design.md section 4) and
    the common shed rule. Returns (shed now, tier, score); the score only with ``scoring``."""
    cached, p_left, blocks_needed, first_out, idle_ms, d_left, s_ms = request_static(
        waiting, hits, p, g, comp, hld, est_r, mrl, bs, budget, ps, u_p, u_d, bsh)
    ratio = cached / p
    return _score_at(waiting, first_out, idle_ms, ratio, p_left, blocks_needed, s_ms, d_left,
                     _index_static(pid, theta_c, ratio, s_ms, d_left, bs, scoring), g, arr, t1r, queue_pos,
                     t_now, mrl, gtab, theta_c, pid, sm, kvf, usable, bs, u_p, u_d, scoring)


@helper
def _index_static(pid, theta_c, ratio, s_ms, d_left, bs, scoring):
    """The index's static terms (``scoring.index_log_static``); 0 for the other policies."""
    if scoring and pid == P_INDEX:
        return index_log_static(theta_c, ratio, s_ms, d_left, float(bs))
    return 0.0


@helper
def _score_at(waiting, first_out, idle_ms, ratio, p_left, blocks_needed, s_ms, d_left, base, g, arr, t1r, queue_pos,
              t_now, mrl, gtab, theta_c, pid, sm, kvf, usable, bs, u_p, u_d, scoring):
    """``_request_score`` from the request's static inputs (``request_static``, ``_index_static``):
    what moves with the clock (``t_now``) and the free blocks (``kvf``)."""
    to_deadline_ms, slack_ms = _slack(arr + t1r - t_now, first_out, idle_ms)
    if waiting and not first_out and sm >= 0.0 and slack_ms < -sm * (t1r / 1e6):
        return True, 0, 0.0
    if not scoring:
        return False, 0, 0.0
    tr = -1 if (not first_out and slack_ms < 0.0) else 0
    if pid == P_GITTINS:  # known prefill cost + the family's decode cost
        sc = gittins_score(gtab, mrl, g, p_left * u_p, u_d)
    elif pid == P_INDEX:   # policy_score's, from the static terms
        sc = index_log_dynamic(base, theta_c, clip_z(slack_ms, t1r / 1e6), first_out, kvf, float(blocks_needed),
                               usable, to_deadline_ms)
    else:
        sc = policy_score(pid, theta_c, ratio, s_ms, d_left, slack_ms, t1r / 1e6, first_out, kvf,
                          float(blocks_needed), usable, to_deadline_ms, float(arr + t1r), float(bs), queue_pos)
    return False, tr, sc


@helper
def _put_score(tier, score, nan_score, c, r, tr, sc):
    """Store r's (tier, score); a NaN score is recorded in ``nan_score`` instead and gives False (the
    kernel then stops and its caller raises)."""
    tier[c, r] = tr
    if sc != sc:
        nan_score[0] = c
        nan_score[1] = r
        return False
    score[c, r] = sc
    return True


@helper
def _first_slack_below(base, idle_ms, thr):
    """The first time t (ns) at which a waiting request's slack, computed as ``request_inputs`` does
    ((base - t)/1e6 - idle_ms, base = arrival + T1), is below ``thr``: the predicate is monotone in
    t, so a bracket then bisection on the exact float expression. ``_FOREVER`` if that is later."""
    guess = float(base) - (idle_ms + thr) * 1e6
    if not guess < float(_FOREVER):
        return _FOREVER
    g = np.int64(guess)
    lo = g - 2
    hi = g + 2
    step = 2
    while (base - lo) / 1e6 - idle_ms < thr:
        lo -= step
        step *= 2
    step = 2
    while not ((base - hi) / 1e6 - idle_ms < thr):
        if hi >= _FOREVER:
            return _FOREVER
        hi += step
        step *= 2
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if (base - mid) / 1e6 - idle_ms < thr:
            hi = mid
        else:
            lo = mid
    return hi


@helper
def _hits_evictable(hash_head, chain_off, chain_val, uniq_base, ref, c, r, num_tokens, bs, bsh, ev_blocks, n_ev):
    """``prefix_hits`` of r and how many of those hit blocks sit in the free queue (ref 0: they count
    against the free blocks), in one walk; the latter are written to ``ev_blocks[n_ev:]`` while it
    has room. Returns (hits, evictable)."""
    max_blocks = _bdiv(num_tokens - 1, bs, bsh)
    room = ev_blocks.shape[0] - n_ev
    lo, n, ub = _hash_ids(chain_off, uniq_base, c, r)
    k = 0
    ev = 0
    while k < max_blocks:
        b = hash_head[c, _hash_id(chain_val, c, lo, n, ub, k)]
        if b < 0:
            break
        if ref[c, b] == 0:
            if ev < room:
                ev_blocks[n_ev + ev] = b
            ev += 1
        k += 1
    return k, ev


@helper
def _waiting_blocked(c, nw, wait_ids, prompt, gen, arrival, t1, hash_head, chain_off, chain_val, uniq_base, ref,
                     n_free, ev_blocks, prefix_on, can_admit, watermark, max_wait, sm, budget, ps, dec_one, bs, bsh,
                     full, w_hits, only):
    """A jump's view of the waiting requests (docs/design.md section 3, "Jumps"): how many pass the
    admission gate now (``n_fit``; without ``full`` the scan stops at the first, since a normal step
    may admit it), the first iteration start at which one would be shed or timed out (``lim_w``),
    their cached hit blocks in the free queue (written to ``ev_blocks[:n_ev]``; a claim that evicts
    one changes that request's hits) and, with ``dec_one`` (deciding, one waiting request, shedding
    on), its deadline and idle prefill for the decision rule. Returns (n_fit, lim_w, n_ev, dec_on,
    dec_base, dec_idle); n_ev > len(ev_blocks) means the evictions cannot be followed. The hits of
    ``wait_ids[c, q]`` go to ``w_hits[q]`` (all of them with ``full``). ``only`` >= 0: look at
    ``wait_ids[c, only]`` alone (the head, when nothing else can decide the jump)."""
    n_fit = 0
    lim_w = _FOREVER
    n_ev = 0
    dec_on = False
    dec_base = 0
    dec_idle = 0.0
    q_lo, q_hi = (only, only + 1) if only >= 0 else (0, nw)
    for q in range(q_lo, q_hi):
        r = wait_ids[c, q]
        num_tokens = prompt[c, r] + gen[c, r]
        hits = 0
        evictable = 0
        if prefix_on:
            hits, evictable = _hits_evictable(hash_head, chain_off, chain_val, uniq_base, ref, c, r, num_tokens, bs,
                                              bsh, ev_blocks, n_ev)
            n_ev += evictable
        w_hits[q] = hits
        if can_admit and _gate(num_tokens, hits, evictable, watermark, n_free[c], bs, bsh):
            n_fit += 1
            if not full:
                return n_fit, lim_w, n_ev, dec_on, dec_base, dec_idle  # it may be admitted: step normally
        if gen[c, r] > 0:
            continue  # has its first token: never shed, never timed out
        if max_wait >= 0 and arrival[c, r] + max_wait < lim_w:
            lim_w = arrival[c, r] + max_wait
        base = arrival[c, r] + t1[c, r]
        idle_ms = prefill_time_ns(num_tokens - hits * bs, hits * bs, budget, ps) / 1e6
        if sm >= 0.0:
            ts = _first_slack_below(base, idle_ms, -sm * (t1[c, r] / 1e6))
            if ts < lim_w:
                lim_w = ts
        if dec_one:
            dec_on = True
            dec_base = base
            dec_idle = idle_ms
    return n_fit, lim_w, n_ev, dec_on, dec_base, dec_idle


@helper
def _waiting_statics(c, nw, wait_ids, w_hits, w_st, prompt, gen, est, mrl, theta_c, pid, bs, bsh, budget, ps, u_p, u_d):
    """``w_st[q]``: the static score inputs (``request_static``, ``_index_static``) of waiting request
    ``wait_ids[c, q]`` with ``w_hits[q]`` hits, for ``_score_at``."""
    for q in range(nw):
        r = wait_ids[c, q]
        cached, p_left, blocks_needed, first_out, idle_ms, d_left, s_ms = request_static(
            True, w_hits[q], prompt[c, r], gen[c, r], 0, 0, est[c, r], mrl, bs, budget, ps, u_p, u_d, bsh)
        w_st[q, 0] = 1.0 if first_out else 0.0
        w_st[q, 1] = idle_ms
        w_st[q, 2] = cached / prompt[c, r]
        w_st[q, 3] = p_left
        w_st[q, 4] = blocks_needed
        w_st[q, 5] = s_ms
        w_st[q, 6] = d_left
        w_st[q, 7] = _index_static(pid, theta_c, w_st[q, 2], s_ms, d_left, bs, True)


@helper
def _queue_head(c, lim, wait_ids, resumed, resume_first, qkey, prio, arrival, mode, tier, score):
    """Index in ``wait_ids[:lim]`` of the request admission tries first (rule 5): the best in queue
    order; with resume_first, preempted requests first."""
    bi = 0
    rb = wait_ids[c, 0]
    for k in range(1, lim):
        rk = wait_ids[c, k]
        if resume_first and resumed[c, rk] != resumed[c, rb]:
            if resumed[c, rk]:
                bi = k
                rb = rk
            continue
        if _better(qkey, prio, arrival, c, rk, rb, mode, tier, score):
            bi = k
            rb = rk
    return bi


@helper
def _gate(num_tokens, hits, evictable, watermark, free, bs, bsh):
    """Rule 5's admission gate: the sequence's blocks less its hits, plus its hits sitting in the free
    queue (they count against the free blocks) and the watermark, fit the free blocks."""
    return _bdiv(num_tokens + bs - 1, bs, bsh) - hits + evictable + watermark <= free


@helper
def _head_fits(c, r, prompt, gen, hash_head, chain_off, chain_val, uniq_base, ref, n_free, ev_blocks, prefix_on,
               watermark, bs, bsh):
    """(r passes the admission gate now, its hits)."""
    num_tokens = prompt[c, r] + gen[c, r]
    hits = 0
    evictable = 0
    if prefix_on:
        hits, evictable = _hits_evictable(hash_head, chain_off, chain_val, uniq_base, ref, c, r, num_tokens, bs, bsh,
                                          ev_blocks, ev_blocks.shape[0])
    return _gate(num_tokens, hits, evictable, watermark, n_free[c], bs, bsh), hits


# ---------------------------------------------------------------------------------- tpot-guard
@helper
def guard_chunk(slack_ps, b_ps, c2_ps, cap):
    """p_t of the tpot-guard rule (docs/design.md section 11): the largest p in [0, cap] with
    ``b_ps * p + c2_ps * p**2 <= slack_ps`` (all integers, b_ps and c2_ps >= 0): a prefill chunk of p
    tokens that fits the time left in the iteration. The float root is corrected to the exact one."""
    if slack_ps <= 0:
        return 0
    if c2_ps == 0:
        if b_ps == 0:
            return cap
        p = slack_ps // b_ps
        return p if p < cap else cap
    x = (np.sqrt(float(b_ps) * float(b_ps) + 4.0 * float(c2_ps) * float(slack_ps)) - float(b_ps)) / (2.0 * c2_ps)
    p = np.int64(x) if x < float(cap) else cap
    while p < cap and b_ps * (p + 1) + c2_ps * (p + 1) * (p + 1) <= slack_ps:
        p += 1
    while p > 0 and b_ps * p + c2_ps * p * p > slack_ps:
        p -= 1
    return p


@helper
def guard_slack(c, run_ids, n_run, status, prompt, gen, computed, first_token, t2, t_now, pending, cfg, u):
    """The tpot-guard rule's state before an iteration (docs/design.md section 11): ``(D, cb, slack)``.
    D decoding requests with contexts summing to ctx take ``tau_dec = c0 + c_decode D + c_kv ctx``; a
    decoding request with a TPOT SLO T2 > tau_dec is guarded, with credit ``T2 (g + 1) - e`` (g
    tokens after its first, e the time since its first token: in the engine's clock a token is
    emitted at its iteration's end, the next iteration's start, so a token in flight under async
    scheduling is already in g); the iteration may last ``tau_t = max(tau_dec, (1 + u) min credit)``.
    ``slack = tau_t - tau_dec`` (ps), or -1 when the budget stays B: nothing pending (``pending``:
    requests wait or are swapped; or a running one is mid-prefill or mid-recompute) or nothing
    guarded. ``cb``: the largest computed-before among the running partial prefills."""
    D = 0
    ctx = 0
    cb_max = 0
    for i in range(n_run[c]):
        r = run_ids[c, i]
        if status[c, r] == ENDED:   # async: finished, not schedulable
            continue
        if gen[c, r] > 0 and computed[c, r] == prompt[c, r] + gen[c, r] - 1:
            D += 1
            ctx += computed[c, r]
        else:
            pending = True
            if computed[c, r] > cb_max:
                cb_max = computed[c, r]
    if not pending or D == 0:
        return D, cb_max, np.int64(-1)
    tau_dec = cfg[C_PS0] + cfg[C_PS_DECODE] * D + cfg[C_PS_KV] * ctx   # ps
    min_credit = 0.0
    guarded = False
    for i in range(n_run[c]):
        r = run_ids[c, i]
        if status[c, r] == ENDED or gen[c, r] == 0 or computed[c, r] != prompt[c, r] + gen[c, r] - 1:
            continue
        T2 = t2[c, r]
        if T2 >= NO_TPOT_SLO_NS or T2 * 1000 <= tau_dec:
            continue
        credit = (float(T2) * float(gen[c, r]) - float(t_now - first_token[c, r])) * 1000.0   # ps
        if not guarded or credit < min_credit:
            min_credit = credit
            guarded = True
    if not guarded:
        return D, cb_max, np.int64(-1)
    slack = (1.0 + u) * min_credit - float(tau_dec)
    if slack <= 0.0:
        return D, cb_max, np.int64(0)
    return D, cb_max, (np.int64(slack) if slack < 4e18 else np.int64(4e18))


@helper
def guard_budget(B, D, slack_ps, cb, cfg, bmin, bs):
    """B_t of the tpot-guard rule from ``guard_slack``'s D and slack: p_t, the largest prefill chunk
    that fits the slack (``guard_chunk``, priced at computed-before ``cb``: the largest among the
    running partial prefills and the waiting queue head's cached tokens), then
    ``B_t = min(B, max(D + max(p_t, bs), ceil(bmin B)))``: every iteration makes progress."""
    p = guard_chunk(slack_ps, cfg[C_PS_PREFILL] + cfg[C_PS_ATTN] * cb, cfg[C_PS_C2], B)
    floor = np.int64(np.ceil(bmin * B))
    x = D + (p if p > bs else bs)
    if x < floor:
        x = floor
    return x if x < B else B


# ---------------------------------------------------------------------------------- decision epochs
@helper
def next_wake(c, n, next_arr, arrival, xfer_ids, n_xfer, kv_ready):
    """When copy c, with nothing to schedule now, can next: its next arrival (of its ``n`` rows) or
    the first end of its KV transfers in flight (rule 13); ``_FOREVER`` if neither."""
    t = arrival[c, next_arr[c]] if next_arr[c] < n else _FOREVER
    for i in range(n_xfer[c]):
        if kv_ready[c, xfer_ids[c, i]] < t:
            t = kv_ready[c, xfer_ids[c, i]]
    return t


@helper
def _next_epoch(epoch, c, t):
    """The first decision epoch strictly after t."""
    t0 = epoch[c, EP_T0]
    dt = epoch[c, EP_DT]
    return t0 + ((t - t0) // dt + 1) * dt


@helper
def _scored_ended(epoch, end_state, c):
    """Every scored request has ended (amortised O(1): the cursor only moves forward)."""
    j = epoch[c, EP_OPEN]
    s1 = epoch[c, EP_S1]
    while j < s1 and end_state[c, j] != E_NONE:
        j += 1
    epoch[c, EP_OPEN] = j
    return j >= s1


@njit  # once per epoch, not per iteration: kept out of the kernel's hot loop
def _decision_needed(c, shed_on, t_now, n_wait, wait_ids, prompt, gen, arrival, t1, est, mrl, hash_head,
                     chain_off, chain_val, uniq_base, prefix_on, bs, budget, ps, u_p, u_d):
    """docs/design.md section 5: a decision is needed at an epoch unless fewer than 2 requests wait and
    nothing is sheddable (shedding on and a waiting request without a first token has slack < 0)."""
    nw = n_wait[c]
    if nw >= 2:
        return True
    if nw == 0 or not shed_on:
        return False
    r = wait_ids[c, 0]
    hits = 0
    if prefix_on:
        hits = prefix_hits(hash_head, chain_off, chain_val, uniq_base, c, r, prompt[c, r] + gen[c, r], bs)
    _, _, _, first_out, _, slack_ms, _, _ = request_inputs(
        True, hits, prompt[c, r], gen[c, r], 0, 0, arrival[c, r] + t1[c, r] - t_now, est[c, r], mrl, bs, budget,
        ps, u_p, u_d)
    return not first_out and slack_ms < 0.0


# ---------------------------------------------------------------------------------- ordering
@helper
def _better(qkey, prio, arrival, c, r1, r2, mode, tier, score):
    """True if r1 is served before r2. The order key is (tier, score), higher first -- FCFS:
    (0, -queue_key), priority: (0, -priority), both vLLM's own orders -- then arrival asc, id asc."""
    if mode == MODE_FCFS:
        s1 = -float(qkey[c, r1])
        s2 = -float(qkey[c, r2])
    elif mode == MODE_PRIORITY:
        s1 = -float(prio[c, r1])
        s2 = -float(prio[c, r2])
    else:
        t1 = int(tier[c, r1])
        t2 = int(tier[c, r2])
        if t1 != t2:
            return t1 > t2
        s1 = float(score[c, r1])
        s2 = float(score[c, r2])
    if s1 != s2:
        return s1 > s2
    a1 = arrival[c, r1]
    a2 = arrival[c, r2]
    if a1 != a2:
        return a1 < a2
    return r1 < r2


# ---------------------------------------------------------------------------------- list helpers
@helper
def _run_remove_at(run_ids, n_run, c, i):
    n = n_run[c]
    for k in range(i, n - 1):
        run_ids[c, k] = run_ids[c, k + 1]
    n_run[c] = n - 1


@helper
def _wait_add(wait_ids, n_wait, status, c, r):
    wait_ids[c, n_wait[c]] = r
    n_wait[c] += 1
    status[c, r] = WAITING


@helper
def _wait_remove_at(wait_ids, n_wait, c, i):
    n = n_wait[c] - 1
    wait_ids[c, i] = wait_ids[c, n]
    n_wait[c] = n


@helper
def _end(status, end_state, finish, n_ended, c, r, state, t):
    status[c, r] = ENDED
    end_state[c, r] = state
    finish[c, r] = t
    n_ended[c] += 1


@njit
def _preempt(c, vi, acc, run_ids, n_run, sched, req, pool, slots, queues, swap_on):
    """Rule 4: preempt running[vi]: give back its tokens and budget if it was already scheduled this
    iteration, then either recompute (free all its blocks, back to the waiting queue; FCFS:
    prepended via the smallest queue key) or, with swap preemption (beyond vLLM, V0 semantics),
    move its blocks to host memory and put it in the swapped queue. Swap needs room on the host
    and no shared block (a block another request also holds); otherwise it falls back to
    recompute. ``acc = [ns, budget, swapped blocks]`` is updated in place. Returns the victim."""
    sched_r, sched_new, sched_cb = sched
    recomputed, computed, n_preempt, resumed, qkey, status, held, n_cached = req
    ref, bhash, fq_prev, fq_next, n_free, hash_head, hnext = pool
    table, slot_of, slot_free, n_slot_free = slots
    key_lo, wait_ids, n_wait, pend_ids, n_pend, swap_ids, n_swap, host_free, swapped = queues
    nb = ref.shape[1]
    v = run_ids[c, vi]
    _run_remove_at(run_ids, n_run, c, vi)
    ns = acc[0]
    for k in range(ns):
        if sched_r[c, k] == v:
            acc[1] += sched_new[c, k]
            for q in range(k, ns - 1):
                sched_r[c, q] = sched_r[c, q + 1]
                sched_new[c, q] = sched_new[c, q + 1]
                sched_cb[c, q] = sched_cb[c, q + 1]
            acc[0] = ns - 1
            break
    if status[c, v] == ENDED:
        # async: finished last iteration, still in `running` during this schedule (vLLM 0.33 keeps
        # it there until update_from_output); preempting it frees its blocks now, and it counts
        for k in range(n_pend[c]):
            if pend_ids[c, k] == v:
                pend_ids[c, k] = pend_ids[c, n_pend[c] - 1]
                n_pend[c] -= 1
                break
        _free_request_blocks(table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free,
                             slot_free, n_slot_free, c, v, nb, nb + 1)
        n_preempt[c, v] += 1
        return v
    n_preempt[c, v] += 1
    if swap_on != 0:
        s = slot_of[c, v]
        h = held[c, v]
        exclusive = True
        for j in range(h):
            if ref[c, table[c, s, j]] != 1:
                exclusive = False
                break
        if exclusive and h <= host_free[c]:
            # the GPU copies become plain free blocks (front of the free queue, like hashless ones)
            cursor = nb
            for j in range(h - 1, -1, -1):
                b = table[c, s, j]
                ref[c, b] = 0
                _uncache(bhash, hash_head, hnext, c, b)
                _fq_prepend(fq_prev, fq_next, n_free, c, b, cursor)
                cursor = b
            n_cached[c, v] = 0
            # its table slot is freed too (a swap-in claims new blocks, in a slot taken then): the
            # slots are sized for the running requests, and swapped ones keeping theirs could leave an
            # admission none (it then took another request's, corrupting both tables)
            slot_free[c, n_slot_free[c]] = s
            n_slot_free[c] += 1
            slot_of[c, v] = -1
            host_free[c] -= h
            swapped[c, v] += h
            acc[2] += h
            status[c, v] = SWAPPED
            swap_ids[c, n_swap[c]] = v
            n_swap[c] += 1
            return v
    recomputed[c, v] += computed[c, v]
    _free_request_blocks(table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free,
                         slot_free, n_slot_free, c, v, nb, nb + 1)
    computed[c, v] = 0
    resumed[c, v] = True
    qkey[c, v] = key_lo[c]
    key_lo[c] -= 1
    _wait_add(wait_ids, n_wait, status, c, v)
    return v


@helper
def next_active(mask, c):
    """The first copy after c in ``mask`` (``mask.shape[0]`` if none): the one to prefetch."""
    n = mask.shape[0]
    c += 1
    while c < n and not mask[c]:
        c += 1
    return c


#: copies claimed at a time by an engine thread (``next_copy``): whole cache lines of the per-copy
#: scalars (8 int64 each) are then written by one thread (claims of 8 copies, whose lines straddle
#: two threads' claims as numpy aligns arrays to 16 bytes, were no faster than fixed halves: ad hoc)
CLAIM_CHUNK = 32


@helper
def next_copy(active, claim, c, end):
    """The next active copy after c among those this thread has claimed (up to ``end``), and the end
    of its claim. When none is left there, the next ``CLAIM_CHUNK`` copies are claimed from the
    counter ``claim[0]``, which every thread of a kernel call shares (``fetch_add``): work is
    shared out as it goes, so no thread idles while another still has copies. ``active.shape[0]``
    when every copy is claimed. One thread alone takes the active copies in order."""
    n = active.shape[0]
    c += 1
    while True:
        while c < end:
            if active[c]:
                return c, end
            c += 1
        lo = fetch_add(claim, 0, CLAIM_CHUNK)
        if lo >= n:
            return n, n
        c = lo
        end = min(lo + CLAIM_CHUNK, n)


@helper
def latest_rows(hi, n):
    """Rows [lo, hi] (both included) of a copy's latest requests, up to its next arrival ``hi`` and
    below its ``n`` requests: the ones its next iterations mostly read (prefetched)."""
    lo = hi - 24
    if lo < 0:
        lo = 0
    if hi > n - 1:
        hi = n - 1
    return lo, hi


@njit
def _prefetch_copy(c, hi, n, ref, bhash, hnext, fq_prev, fq_next, arrival, prompt, out_len, t1, est, status,
                   end_state, computed, gen, qkey, slot_of, held, n_cached, emit_it, first_sched, first_token, finish,
                   uniq_base, chain_off, run_ids, wait_ids):
    """Prefetch what copy c's iterations read most: its block pool and the rows of its latest
    requests (those up to ``hi``, its next arrival). The copies' state is far larger than the caches,
    so each copy's first touches miss; the kernel issues these while the previous copy runs."""
    nb = ref.shape[1]
    for j in range(0, nb + 2, 16):   # 16 int32 per 64-byte line
        prefetch(fq_next, c, j)
        prefetch(fq_prev, c, j)
    for j in range(0, nb, 16):
        prefetch(ref, c, j)
        prefetch(hnext, c, j)
    for j in range(0, nb, 8):   # 8 int64
        prefetch(bhash, c, j)
    prefetch(run_ids, c, 0)
    prefetch(wait_ids, c, 0)
    lo, hi = latest_rows(hi, n)
    for j in range(lo, hi + 1, 8):
        prefetch(arrival, c, j)
        prefetch(prompt, c, j)
        prefetch(out_len, c, j)
        prefetch(t1, c, j)
        prefetch(est, c, j)
        prefetch(computed, c, j)
        prefetch(gen, c, j)
        prefetch(qkey, c, j)
        prefetch(slot_of, c, j)
        prefetch(held, c, j)
        prefetch(n_cached, c, j)
        prefetch(emit_it, c, j)
        prefetch(first_sched, c, j)
        prefetch(first_token, c, j)
        prefetch(finish, c, j)
        prefetch(uniq_base, c, j)
        prefetch(chain_off, c, j)
    prefetch(status, c, lo)
    prefetch(end_state, c, lo)


# ---------------------------------------------------------------------------------- one iteration
@njit
def run_copies_kernel(cfg_rows, fcfg_rows, theta, shed_margin, mrl, nan_score, tier, score, active, claim, mine,
                      max_steps, until_ns,
                      n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, with_kv, kv_src, hold_kv,
                      chain_off, chain_val,
                      uniq_base, now, it, next_arr, n_ended, key_hi, key_lo, n_run,
                      n_wait, n_free, n_slot_free, n_pend, n_iter_rec, status, end_state, computed,
                      gen, qkey, slot_of, held, n_cached, first_sched, first_token, first_token_it,
                      finish, finish_it, n_preempt, recomputed, resumed, run_ids, wait_ids, slot_free,
                      pend_ids, table, ref, bhash, hnext, fq_prev, fq_next, hash_head,
                      sched_r, sched_new, sched_cb, iter_rec, jump_ids, jump_off, emit_it, swapped, swap_ids,
                      n_swap, host_free, epoch, kv_ready, kv_first, link_free, xfer_ids, n_xfer, hold_blk, hold_at,
                      hold_ids, n_hold, hold_top, gtab, acc, ev_blocks, w_hits, w_st):
    """``run_copies`` with the struct of arrays unpacked (``kernel_args``: every parameter by name,
    ``KERNEL_ARGS``). One iteration of copy c is the body of the inner loop (written inline: a call
    with more than 30 arguments cannot be inlined by numba).
    ``gtab``: the empirical-Gittins table (``scoring.gittins_table(mrl)``); ``acc``, ``ev_blocks``,
    ``w_hits``, ``w_st``: this call's scratch (``_scratch``), allocated by the caller so that they
    too are borrowed (an array allocated here could not be)."""
    # borrowed views of every array (``_jit.borrow``): the helpers' reference counting becomes a no-op
    gtab = borrow(gtab)
    acc = borrow(acc)          # [ns, budget, swapped blocks] of the iteration (``_preempt``)
    ev_blocks = borrow(ev_blocks)  # jump scratch: the waiting requests' evictable hit blocks
    w_hits = borrow(w_hits)    # ... their hits, and their static score inputs
    w_st = borrow(w_st)
    cfg_rows = borrow(cfg_rows)
    fcfg_rows = borrow(fcfg_rows)
    theta = borrow(theta)
    shed_margin = borrow(shed_margin)
    mrl = borrow(mrl)
    nan_score = borrow(nan_score)
    tier = borrow(tier)
    score = borrow(score)
    active = borrow(active)
    claim = borrow(claim)
    mine = borrow(mine)
    until_ns = borrow(until_ns)
    n_req = borrow(n_req)
    arrival = borrow(arrival)
    prompt = borrow(prompt)
    out_len = borrow(out_len)
    prio = borrow(prio)
    capped = borrow(capped)
    t1 = borrow(t1)
    t2 = borrow(t2)
    est = borrow(est)
    chain_off = borrow(chain_off)
    chain_val = borrow(chain_val)
    uniq_base = borrow(uniq_base)
    now = borrow(now)
    it = borrow(it)
    next_arr = borrow(next_arr)
    n_ended = borrow(n_ended)
    key_hi = borrow(key_hi)
    key_lo = borrow(key_lo)
    n_run = borrow(n_run)
    n_wait = borrow(n_wait)
    n_free = borrow(n_free)
    n_slot_free = borrow(n_slot_free)
    n_pend = borrow(n_pend)
    n_iter_rec = borrow(n_iter_rec)
    status = borrow(status)
    end_state = borrow(end_state)
    computed = borrow(computed)
    gen = borrow(gen)
    qkey = borrow(qkey)
    slot_of = borrow(slot_of)
    held = borrow(held)
    n_cached = borrow(n_cached)
    first_sched = borrow(first_sched)
    first_token = borrow(first_token)
    first_token_it = borrow(first_token_it)
    finish = borrow(finish)
    finish_it = borrow(finish_it)
    n_preempt = borrow(n_preempt)
    recomputed = borrow(recomputed)
    resumed = borrow(resumed)
    run_ids = borrow(run_ids)
    wait_ids = borrow(wait_ids)
    slot_free = borrow(slot_free)
    pend_ids = borrow(pend_ids)
    table = borrow(table)
    ref = borrow(ref)
    bhash = borrow(bhash)
    hnext = borrow(hnext)
    fq_prev = borrow(fq_prev)
    fq_next = borrow(fq_next)
    hash_head = borrow(hash_head)
    sched_r = borrow(sched_r)
    sched_new = borrow(sched_new)
    sched_cb = borrow(sched_cb)
    iter_rec = borrow(iter_rec)
    jump_ids = borrow(jump_ids)
    jump_off = borrow(jump_off)
    emit_it = borrow(emit_it)
    swapped = borrow(swapped)
    swap_ids = borrow(swap_ids)
    n_swap = borrow(n_swap)
    host_free = borrow(host_free)
    epoch = borrow(epoch)
    # one configuration row per copy (docs/design.md section 11); the block size, the policy and the
    # decision and record modes are the batch's (``state.make_cfg_rows`` checks them equal)
    bs = cfg_rows[0, C_BS]
    bsh = block_shift(bs)
    mode = cfg_rows[0, C_MODE]
    nb = ref.shape[1]   # the largest copy's pool: its free-queue sentinels are every copy's
    head = nb
    tail = nb + 1
    pid = cfg_rows[0, C_PID]
    score_inkernel = mode == MODE_SCORE and pid != P_EXTERNAL
    decide = cfg_rows[0, C_DECIDE] != 0
    # argument groups for _preempt (a call with more than 30 arguments cannot be compiled)
    req_t = (recomputed, computed, n_preempt, resumed, qkey, status, held, n_cached)
    pool_t = (ref, bhash, fq_prev, fq_next, n_free, hash_head, hnext)
    slots_t = (table, slot_of, slot_free, n_slot_free)
    queues_t = (key_lo, wait_ids, n_wait, pend_ids, n_pend, swap_ids, n_swap, host_free, swapped)
    total = 0
    n_copies = now.shape[0]
    # the active copies are shared out between the engine threads as they go (``next_copy``); the
    # next one is prefetched as this one starts (``_prefetch_copy``)
    c_next, claimed_to = next_copy(active, claim, -1, 0)
    while c_next < n_copies:
        c = c_next
        c_next, claimed_to = next_copy(active, claim, c, claimed_to)
        if c_next < n_copies:
            _prefetch_copy(c_next, next_arr[c_next], n_req[c_next], ref, bhash, hnext, fq_prev, fq_next, arrival,
                           prompt, out_len, t1, est, status, end_state, computed, gen, qkey, slot_of, held,
                           n_cached, emit_it, first_sched, first_token, finish, uniq_base, chain_off, run_ids,
                           wait_ids)
        mine[c] = True
        n = n_req[c]
        cfg = cfg_rows[c]
        fcfg = fcfg_rows[c]
        max_wait = cfg[C_MAX_WAIT]
        prefix_on = cfg[C_PREFIX] != 0
        async_on = cfg[C_ASYNC] != 0
        # without async scheduling, a jump may end with an iteration in which requests complete: their
        # blocks free at its end, after its (failed) admissions, so it is one more decode iteration
        # whose completions are applied after it, as the normal step would
        fin_on = not async_on
        k_min = 1 if fin_on else 2  # the shortest jump taken (iterations)
        usable = float(cfg[C_USABLE])
        ps = cfg[C_PS0:C_PS0 + 4]
        skip_hol = cfg[C_SKIP_HOL] != 0
        resume_first = cfg[C_RESUME_FIRST] != 0
        waiting_preempts = cfg[C_WAIT_PREEMPT] != 0 and mode != MODE_FCFS
        swap_on = cfg[C_SWAP]
        budget_cfg = cfg[C_BUDGET]
        # the largest chunk a prefill can get: B, or the long-prefill threshold below it (prefill_time_i
        # and S_i chunk at it, docs/design.md section 4)
        chunk_cap = cfg[C_THRESHOLD] if 0 < cfg[C_THRESHOLD] < budget_cfg else budget_cfg
        u_p = fcfg[F_U_P]
        u_d = fcfg[F_U_D]
        if prefix_on:
            # the prefix-hit walks of the waiting requests (the copy's first scoring or jump does
            # them) start with two cold misses each, their chain's ids then the hash-map lines at
            # those ids: fetched for all of them at once here (the copy's rows arrived meanwhile)
            nw0 = n_wait[c] if n_wait[c] < 8 else 8
            for i in range(nw0):
                r = wait_ids[c, i]
                if chain_off[c, r + 1] > chain_off[c, r]:
                    prefetch(chain_val, c, chain_off[c, r])
            for i in range(nw0):
                r = wait_ids[c, i]
                lo, nch, ub = _hash_ids(chain_off, uniq_base, c, r)
                prefetch(hash_head, c, _hash_id(chain_val, c, lo, nch, ub, 0))
        # FCFS: index in wait_ids of the head of the queue (smallest queue key), -1 if unknown. The
        # cache stays exact: arrivals get larger keys, FCFS victims the smallest (and in FCFS
        # ``resumed`` is equivalent to a negative key, so resume_first does not change the order).
        fbest = -1
        # Stop at until_ns[c] or, deciding (docs/design.md section 5), at the first iteration boundary at or
        # after an epoch where a decision is needed or every scored request has ended; epochs that
        # need none are skipped here, so the copy runs on with the same parameters.
        until = _next_epoch(epoch, c, now[c]) if decide else until_ns[c]
        stop = STOP_NONE
        steps = 0
        while True:
            if it[c] >= cfg[C_MAX_ITERS]:
                stop = STOP_CAP
                break
            if now[c] >= until:
                if not decide:
                    break
                if _scored_ended(epoch, end_state, c):
                    stop = STOP_ENDED
                    break
                if _decision_needed(c, epoch[c, EP_SHED] != 0, now[c], n_wait, wait_ids, prompt, gen, arrival, t1,
                                    est, mrl, hash_head, chain_off, chain_val, uniq_base, prefix_on, bs,
                                    chunk_cap, ps, u_p, u_d):
                    stop = STOP_DECIDE
                    break
                until = _next_epoch(epoch, c, now[c])
            if steps >= max_steps:
                break
            steps += 1
            if cfg[C_REC_STREAM] != 0 and n_iter_rec[c] >= iter_rec.shape[1]:
                break  # record buffer full: the driver flushes it to disk and calls again
            # ------------------------------------------------------------ one iteration of copy c
            if n_ended[c] >= n:
                stop = STOP_ENDED
                break  # copy done

            # Idle engine: jump the clock to the next arrival (a cluster's replica stops there if that
            # is at or past until_ns: see C_STOP_IDLE).
            if n_run[c] == 0 and n_wait[c] == 0 and n_pend[c] == 0 and n_swap[c] == 0:
                nxt = next_wake(c, n, next_arr, arrival, xfer_ids, n_xfer, kv_ready)   # (rule 13: or a transfer's end)
                if nxt < _FOREVER and nxt > now[c]:
                    now[c] = nxt
                    if cfg[C_STOP_IDLE] != 0 and now[c] >= until:
                        break
            t_now = now[c]

            # Rule 1: arrivals visible iff arrival <= iteration start. Rule 8: too-long prompts rejected.
            queued = -1  # admission control: prefill tokens queued ahead (computed on first use)
            while next_arr[c] < n and arrival[c, next_arr[c]] <= t_now:
                r = next_arr[c]
                next_arr[c] += 1
                if prompt[c, r] >= cfg[C_MAX_LEN]:
                    _end(status, end_state, finish, n_ended, c, r, E_REJECTED, arrival[c, r])
                    continue
                if with_kv[c, r]:
                    # Rule 13: it arrives with its prompt's KV (computed elsewhere) and its first token
                    # (emitted there: first_token is its arrival here). It joins the remote queue
                    # (the swapped queue, FIFO, served before the waiting queue) holding no block here.
                    computed[c, r] = prompt[c, r]
                    gen[c, r] = 1
                    first_token[c, r] = arrival[c, r]
                    if out_len[c, r] <= 1:   # (nothing left to generate)
                        _end(status, end_state, finish, n_ended, c, r,
                             E_LENGTH_CAPPED if capped[c, r] else E_COMPLETED, arrival[c, r])
                        continue
                    qkey[c, r] = key_hi[c]
                    key_hi[c] += 1
                    status[c, r] = SWAPPED
                    swap_ids[c, n_swap[c]] = r
                    n_swap[c] += 1
                    continue
                if cfg[C_ADMISSION] != 0:
                    # beyond vLLM: refuse a request whose TTFT would be missed even if the engine
                    # served the prefill work already queued ahead of it at full-batch speed
                    if queued < 0:
                        queued = 0
                        for k in range(n_wait[c]):
                            q = wait_ids[c, k]
                            queued += prompt[c, q] + gen[c, q]
                        for k in range(n_run[c]):
                            q = run_ids[c, k]
                            left = prompt[c, q] + gen[c, q] - computed[c, q]
                            if left > 1 or gen[c, q] == 0:
                                queued += left
                    if (queued + prompt[c, r]) * fcfg[F_U_P] > t1[c, r] / 1e6:
                        _end(status, end_state, finish, n_ended, c, r, E_REJECTED, arrival[c, r])
                        continue
                    queued += prompt[c, r]
                qkey[c, r] = key_hi[c]
                key_hi[c] += 1
                _wait_add(wait_ids, n_wait, status, c, r)

            # Rule 13: a request whose KV transfer has ended is running (its seat and blocks were
            # taken at its admission), in admission order
            if n_xfer[c] > 0:
                i = 0
                while i < n_xfer[c]:
                    r = xfer_ids[c, i]
                    if kv_ready[c, r] <= t_now:
                        for q in range(i, n_xfer[c] - 1):
                            xfer_ids[c, q] = xfer_ids[c, q + 1]
                        n_xfer[c] -= 1
                        status[c, r] = RUNNING
                        run_ids[c, n_run[c]] = r
                        n_run[c] += 1
                        if prefix_on and _bdiv(computed[c, r], bs, bsh) > n_cached[c, r]:
                            _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off, chain_val,
                                          uniq_base, c, r, computed[c, r], bs, bsh)
                    else:
                        i += 1

            # In-engine scores (docs/design.md section 4) and the common shed rule, from the state at
            # the iteration's start: slack = arrival + T1 - now - prefill_time.
            # Running requests' scores are read only to choose a preemption victim (or by a waiting
            # request that may preempt): they are computed only when a claim of this iteration could
            # fail, i.e. when the running requests' block needs at the full budget exceed the free
            # blocks (an upper bound: the running pass's claims can only be smaller).
            sm = shed_margin[c]
            n_scored = n_wait[c]
            if score_inkernel:
                if waiting_preempts:
                    n_scored += n_run[c]
                else:
                    bound = 0
                    for q in range(n_run[c]):
                        r = run_ids[c, q]
                        left = prompt[c, r] + gen[c, r] - computed[c, r]
                        if status[c, r] == ENDED or left <= 0:
                            continue
                        if left > budget_cfg:
                            left = budget_cfg
                        need = _bdiv(computed[c, r] + left + bs - 1, bs, bsh) - held[c, r]
                        if need > 0:
                            bound += need
                    if bound > n_free[c]:
                        n_scored += n_run[c]
            if n_scored > 0 and (score_inkernel or sm >= 0.0):
                kvf = n_free[c] / usable
                i = 0
                while i < n_scored:
                    waiting = i < n_wait[c]
                    r = wait_ids[c, i] if waiting else run_ids[c, i - n_wait[c]]
                    hits = 0
                    if waiting and prefix_on:
                        hits = prefix_hits(hash_head, chain_off, chain_val, uniq_base, c, r,
                                            prompt[c, r] + gen[c, r], bs, bsh)
                    shed_now, tr, sc = _request_score(
                        waiting, hits, prompt[c, r], gen[c, r], computed[c, r], held[c, r], arrival[c, r], t1[c, r],
                        est[c, r], qkey[c, r] / (key_hi[c] if key_hi[c] > 1 else 1), t_now, mrl, gtab, theta[c], pid,
                        sm, kvf, usable, bs, bsh, chunk_cap, ps, u_p, u_d, score_inkernel)
                    if shed_now:
                        _end(status, end_state, finish, n_ended, c, r, E_SHED, t_now)
                        if fbest == i:
                            fbest = -1
                        elif fbest == n_wait[c] - 1:
                            fbest = i
                        _wait_remove_at(wait_ids, n_wait, c, i)
                        n_scored -= 1
                        continue
                    if score_inkernel and not _put_score(tier, score, nan_score, c, r, tr, sc):
                        return -1
                    i += 1

            # Rule 12: client time-outs (a no-op without max_wait).
            i = 0
            while max_wait >= 0 and i < n_wait[c]:
                r = wait_ids[c, i]
                if gen[c, r] == 0 and t_now >= arrival[c, r] + max_wait:
                    _end(status, end_state, finish, n_ended, c, r, E_TIMED_OUT, t_now)
                    if fbest == i:
                        fbest = -1
                    elif fbest == n_wait[c] - 1:
                        fbest = i
                    _wait_remove_at(wait_ids, n_wait, c, i)
                else:
                    i += 1
            if max_wait >= 0 and cfg[C_TIMEOUT_RUNNING] != 0:
                i = 0
                while i < n_run[c]:
                    r = run_ids[c, i]
                    if gen[c, r] == 0 and t_now >= arrival[c, r] + max_wait:
                        _run_remove_at(run_ids, n_run, c, i)
                        _free_request_blocks(table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free,
                                             slot_free, n_slot_free, c, r, head, tail)
                        _end(status, end_state, finish, n_ended, c, r, E_TIMED_OUT, t_now)
                    else:
                        i += 1

            if n_ended[c] >= n:
                stop = STOP_ENDED
                break  # copy done
            if n_run[c] == 0 and n_wait[c] == 0 and n_pend[c] == 0 and n_swap[c] == 0:
                total += 1  # everything visible ended; the next call jumps to the next arrival
                continue

            # Jump (docs/design.md section 3, "Jumps"): while every running request is decoding, nothing
            # is pending, no waiting request can be admitted, and no arrival, completion (except in
            # the jump's last iteration, without async scheduling), unservable block claim, shed, time-out,
            # needed decision (``until``) or iteration cap falls inside, iterations only add one
            # token per request. They are advanced here without the scheduling passes, with the
            # same block claims in the same order, so the state afterwards is the one k single
            # steps would give.
            if (cfg[C_JUMPS] != 0 and n_pend[c] == 0 and n_swap[c] == 0 and n_xfer[c] == 0 and n_run[c] > 0
                    and n_run[c] <= cfg[C_BUDGET] and (n_wait[c] == 0 or not waiting_preempts)):
                D = n_run[c]
                k_done = cfg[C_MAX_ITERS] - it[c]
                if cfg[C_REC_STREAM] != 0 and iter_rec.shape[1] - n_iter_rec[c] < k_done:
                    k_done = iter_rec.shape[1] - n_iter_rec[c]
                kv0 = 0
                all_decoding = True
                for q in range(D):
                    r = run_ids[c, q]
                    if (gen[c, r] == 0 or computed[c, r] != prompt[c, r] + gen[c, r] - 1
                            or first_token_it[c, r] < 0):   # (rule 13: its first iteration here is stepped)
                        all_decoding = False
                        break
                    left = out_len[c, r] - gen[c, r] - 1  # iterations before the completing one
                    if fin_on:
                        left += 1
                    if left < k_done:
                        k_done = left
                    kv0 += computed[c, r]
                # Waiting requests stay blocked for the whole jump if each fails the admission gate
                # now: the free blocks only fall, decodes cache only their own unique blocks, and a
                # claim that evicts one of their cached hit blocks only raises their needs (then
                # they are rescanned). Their shed and time-out instants (the first iteration start
                # at which each would fire, from their hits) bound the jump. Without skip_hol it is
                # enough that the queue's head fails the gate (rule 6: head-of-line blocking); if
                # others pass it and the order is the in-engine scores', which move with the clock
                # and the free blocks, the waiting requests are rescored at each iteration start,
                # as a normal step would, and the jump ends before the first whose head passes.
                nw = n_wait[c]
                lim_w = _FOREVER
                n_ev = 0  # evictable hit blocks of the waiting requests (in the free queue): ev_blocks[:n_ev]
                dec_on = False  # deciding with one waiting request: a decision is needed once its slack < 0
                dec_base = 0
                dec_idle = 0.0
                can_admit = cfg[C_BUDGET] - D > 0 and D < cfg[C_MAX_SEQS]
                dec_one = decide and nw == 1 and epoch[c, EP_SHED] != 0
                hol_full = can_admit and not skip_hol   # only the head must fail the gate
                hol = False   # ... and others pass it
                scan_only = -1   # the waiting request the jump's view looks at alone (-1: all of them)
                if all_decoding and k_done >= k_min and nw > 0:
                    hb = -1
                    if hol_full:
                        hb = _queue_head(c, nw, wait_ids, resumed, resume_first, qkey, prio, arrival, mode, tier,
                                         score)
                    if hol_full and _head_fits(
                            c, wait_ids[c, hb],
                            prompt, gen, hash_head, chain_off, chain_val, uniq_base, ref, n_free, ev_blocks,
                            prefix_on, cfg[C_WATERMARK], bs, bsh)[0]:
                        all_decoding = False   # admission takes it: step normally
                    else:
                        # vLLM's orders (static during a jump: no arrival inside it) with no shed rule and
                        # no time-out: only the head decides the jump (it can only get further from
                        # fitting), so the others are not looked at: a long blocked queue costs O(1)
                        if hol_full and mode != MODE_SCORE and sm < 0.0 and max_wait < 0 and not dec_one:
                            scan_only = hb
                        n_fit, lim_w, n_ev, dec_on, dec_base, dec_idle = _waiting_blocked(
                            c, nw, wait_ids, prompt, gen, arrival, t1, hash_head, chain_off, chain_val, uniq_base,
                            ref, n_free, ev_blocks, prefix_on, can_admit, cfg[C_WATERMARK], max_wait, sm, chunk_cap,
                            ps, dec_one, bs, bsh, hol_full, w_hits, scan_only)
                        hol = n_fit > 0
                        all_decoding = n_ev <= nb and (n_fit == 0 or hol_full)
                hol_rescore = hol and score_inkernel and all_decoding and k_done >= k_min
                if hol_rescore:
                    _waiting_statics(c, nw, wait_ids, w_hits, w_st, prompt, gen, est, mrl, theta[c], pid, bs, bsh,
                                     chunk_cap, ps, u_p, u_d)
                if all_decoding and k_done >= k_min:
                    # bucket the running requests by the iteration (mod bs) at which they claim a block
                    for ph in range(bs + 1):
                        jump_off[c, ph] = 0
                    for q in range(D):
                        r = run_ids[c, q]
                        ph = _bmod(-computed[c, r], bs, bsh)  # = (bs - computed % bs) % bs
                        jump_off[c, ph] += 1
                        # the lines the jump's claims and block caching will touch (cold: the copy
                        # last ran a step ago), fetched while the jump's iterations are counted
                        j = n_cached[c, r]
                        prefetch3(table, c, slot_of[c, r], j)
                        if prefix_on:
                            lo, nch, ub = _hash_ids(chain_off, uniq_base, c, r)
                            prefetch(hash_head, c, _hash_id(chain_val, c, lo, nch, ub, j))
                    for ph in range(1, bs):   # each bucket's end, then filled from its end down
                        jump_off[c, ph] += jump_off[c, ph - 1]
                    jump_off[c, bs] = D
                    for q in range(D - 1, -1, -1):  # stable: running order within a bucket
                        r = run_ids[c, q]
                        ph = _bmod(-computed[c, r], bs, bsh)  # = (bs - computed % bs) % bs
                        jump_off[c, ph] -= 1
                        jump_ids[c, jump_off[c, ph]] = r
                    # bucket ph is jump_ids[c, jump_off[c, ph]:jump_off[c, ph + 1]]
                    # deciding, an epoch inside a jump is checked at the first iteration start at or
                    # after it (nothing ends inside, so only the waiting requests can need a decision)
                    # and skipped if none is needed, unless every scored request has ended (it then
                    # terminates); ``lim`` also stops at the next arrival, ``next_t`` at the waiting
                    # requests' shed and time-out instants too (rescanned when their hits change)
                    lim = until
                    if decide and not _scored_ended(epoch, end_state, c):
                        lim = _FOREVER
                    if next_arr[c] < n and arrival[c, next_arr[c]] < lim:
                        lim = arrival[c, next_arr[c]]   # the next arrival
                    next_t = lim if lim < lim_w else lim_w
                    a_ps = cfg[C_PS0] + cfg[C_PS_DECODE] * D + cfg[C_PS_KV] * kv0
                    b_ps = cfg[C_PS_KV] * D
                    # iteration k lasts (a_ps + b_ps * k + 999) // 1000 ns: kept as quotient dq and
                    # remainder dr, stepped exactly (no division per iteration)
                    dq = (a_ps + 999) // 1000
                    dr = (a_ps + 999) - dq * 1000
                    bq = b_ps // 1000
                    br = b_ps - bq * 1000
                    t = now[c]
                    free = n_free[c]
                    k = 0
                    ph = 0  # k % bs
                    m_last = -1  # the record of the jump's last iteration, if kept
                    while k < k_done and t < next_t:
                        if decide and t >= until:
                            if nw >= 2 or (dec_on and (dec_base - t) / 1e6 - dec_idle < 0.0):
                                break  # a decision is needed here: the loop's epoch check stops
                            until = _next_epoch(epoch, c, t)
                        if hol_rescore and k > 0:
                            # the normal step's scoring at this iteration start (nothing is shed
                            # before lim_w), then its admission's head, which must still fail the gate
                            # (their hits are the last scan's, ``w_hits``: only claims evicting their hit
                            # blocks change them, and those rescan)
                            kvf = n_free[c] / usable
                            for q in range(nw):
                                r = wait_ids[c, q]
                                _, tr, sc = _score_at(
                                    True, w_st[q, 0] != 0.0, w_st[q, 1], w_st[q, 2], np.int64(w_st[q, 3]),
                                    np.int64(w_st[q, 4]), w_st[q, 5], w_st[q, 6], w_st[q, 7], gen[c, r], arrival[c, r],
                                    t1[c, r], qkey[c, r] / (key_hi[c] if key_hi[c] > 1 else 1), t, mrl, gtab, theta[c],
                                    pid, sm, kvf, usable, bs, u_p, u_d, True)
                                if not _put_score(tier, score, nan_score, c, r, tr, sc):
                                    return -1
                            if _head_fits(c, wait_ids[c, _queue_head(c, nw, wait_ids, resumed, resume_first, qkey,
                                                                     prio, arrival, mode, tier, score)],
                                          prompt, gen, hash_head, chain_off, chain_val, uniq_base, ref, n_free,
                                          ev_blocks, prefix_on, cfg[C_WATERMARK], bs, bsh)[0]:
                                break   # it may be admitted now: the normal step takes this iteration
                        claims = jump_off[c, ph + 1] - jump_off[c, ph]
                        if claims > free:
                            break  # an unservable claim: the normal step handles it
                        evicts = False
                        if n_ev > 0:
                            b = fq_next[c, head]
                            for _ in range(claims):
                                if bhash[c, b] >= 0:
                                    for j in range(n_ev):
                                        if ev_blocks[j] == b:
                                            evicts = True
                                            break
                                if evicts:
                                    break
                                b = fq_next[c, b]
                        for q in range(jump_off[c, ph], jump_off[c, ph + 1]):
                            _alloc(fq_prev, fq_next, n_free, bhash, hash_head, hnext, ref, table, slot_of,
                                   held, c, jump_ids[c, q], 1, head)
                        free -= claims
                        if evicts:
                            # a waiting request lost cached hit blocks: it needs more blocks than before
                            # (lost hits >= lost evictable ones) while fewer are free, so it stays blocked,
                            # but its prefill, slack and shed instant change: rescan the waiting requests
                            # (as the next iteration's scoring would) and bound the jump anew
                            n_fit, lim_w, n_ev, dec_on, dec_base, dec_idle = _waiting_blocked(
                                c, nw, wait_ids, prompt, gen, arrival, t1, hash_head, chain_off, chain_val,
                                uniq_base, ref, n_free, ev_blocks, prefix_on, can_admit, cfg[C_WATERMARK],
                                max_wait, sm, chunk_cap, ps, dec_one, bs, bsh, hol_full, w_hits, scan_only)
                            if hol_rescore:   # their hits may have changed
                                _waiting_statics(c, nw, wait_ids, w_hits, w_st, prompt, gen, est, mrl, theta[c], pid,
                                                 bs, bsh, chunk_cap, ps, u_p, u_d)
                            next_t = lim if lim < lim_w else lim_w
                            if n_ev > nb or (n_fit > 0 and not hol):
                                next_t = t  # (the latter cannot happen, see above; end the jump after this iteration)
                        end = t + dq
                        m = n_iter_rec[c]
                        m_last = -1
                        if m < iter_rec.shape[1]:
                            m_last = m
                            iter_rec[c, m, 0] = it[c] + k
                            iter_rec[c, m, 1] = t
                            iter_rec[c, m, 2] = end
                            iter_rec[c, m, 3] = 0
                            iter_rec[c, m, 4] = D
                            iter_rec[c, m, 5] = D
                            iter_rec[c, m, 6] = 0
                            iter_rec[c, m, 7] = cfg[C_USABLE] - n_free[c]
                            iter_rec[c, m, 8] = D
                            iter_rec[c, m, 9] = nw
                            n_iter_rec[c] = m + 1
                        t = end
                        k += 1
                        ph += 1
                        if ph == bs:
                            ph = 0
                        dq += bq
                        dr += br
                        if dr >= 1000:
                            dq += 1
                            dr -= 1000
                    if k > 0:
                        epoch[c, EP_V_RUN] = n_run[c]   # the last iteration as scheduled (section 12)
                        epoch[c, EP_V_FREE] = n_free[c]
                        epoch[c, EP_V_ENDED] = n_ended[c]
                        epoch[c, EP_BUSY] += t - now[c]
                        for q in range(D):
                            r = run_ids[c, q]
                            computed[c, r] += k
                            gen[c, r] += k
                            emit_it[c, r] = it[c] + k - 1
                            # the last schedule of the jump saw computed - 1 known tokens under async
                            upto = computed[c, r] - (1 if async_on else 0)
                            if prefix_on and _bdiv(upto, bs, bsh) > n_cached[c, r]:
                                _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off,
                                              chain_val, uniq_base, c, r, upto, bs, bsh)
                        if fin_on:  # completions of the last iteration, in running order (rule 7)
                            q = 0
                            while q < n_run[c]:
                                r = run_ids[c, q]
                                if gen[c, r] < out_len[c, r]:
                                    q += 1
                                    continue
                                _end(status, end_state, finish, n_ended, c, r,
                                     E_LENGTH_CAPPED if capped[c, r] else E_COMPLETED, t)
                                finish_it[c, r] = it[c] + k - 1
                                if not _retire(run_ids, n_run, table, slot_of, held, n_cached, ref, bhash, fq_prev,
                                               fq_next, n_free, slot_free, n_slot_free, c, r, head, tail, hold_kv,
                                               hold_blk, hold_at, hold_ids, n_hold, hold_top):
                                    return HOLD_FULL
                            if m_last >= 0:
                                iter_rec[c, m_last, 7] = cfg[C_USABLE] - n_free[c]
                                iter_rec[c, m_last, 8] = n_run[c]
                        now[c] = t
                        it[c] += k
                        total += k
                        continue

            budget = cfg[C_BUDGET]
            if cfg[C_BUDGET_RULE] == BUDGET_TPOT_GUARD:
                # the iteration's token budget B_t (docs/design.md section 11). (A jump never needs it:
                # it runs decode-only iterations with no prefill to admit, where B_t > D admits the
                # same as B.)
                g_d, g_cb, g_slack = guard_slack(c, run_ids, n_run, status, prompt, gen, computed, first_token, t2,
                                                 t_now, n_wait[c] + n_swap[c] > 0, cfg, fcfg[F_GUARD_U])
                if g_slack >= 0:
                    if n_wait[c] > 0 and prefix_on and cfg[C_PS_ATTN] != 0:   # the waiting head's cached tokens
                        if mode != MODE_FCFS or fbest < 0:
                            bh = _queue_head(c, n_wait[c], wait_ids, resumed, resume_first, qkey, prio, arrival,
                                             mode, tier, score)
                            if mode == MODE_FCFS:
                                fbest = bh   # (the admission's own head: its cache, exact in FCFS)
                        else:
                            bh = fbest
                        rh = wait_ids[c, bh]
                        hb = prefix_hits(hash_head, chain_off, chain_val, uniq_base, c, rh, prompt[c, rh] + gen[c, rh],
                                         bs, bsh) * bs
                        if hb > g_cb:
                            g_cb = hb
                    budget = guard_budget(budget, g_d, g_slack, g_cb, cfg, fcfg[F_GUARD_BMIN], bs)
            ns = 0
            preempted = 0
            acc[2] = 0  # blocks swapped out or in during this iteration
            # vLLM's long_prefill_token_threshold (docs/design.md section 11): with more than one
            # request running or waiting at the iteration's start, no request is given more new
            # tokens than it (after its prefix hits, before the budget); 0 is off
            thr = cfg[C_THRESHOLD] if n_run[c] + n_wait[c] > 1 else 0

            # Rule 2: RUNNING first, in admission order.
            idx = 0
            stop_running = False
            while idx < n_run[c] and budget > 0 and not stop_running:
                r = run_ids[c, idx]
                if status[c, r] == ENDED:  # async: finished at the previous iteration
                    idx += 1
                    continue
                num_tokens = prompt[c, r] + gen[c, r]
                new = num_tokens - computed[c, r]
                if 0 < thr < new:
                    new = thr
                if new > budget:
                    new = budget
                if new <= 0:
                    idx += 1
                    continue
                scheduled = False
                while True:
                    # Rule 3: lazy block claims; a request holds ceil(computed / bs) blocks.
                    need = _bdiv(computed[c, r] + new + bs - 1, bs, bsh) - held[c, r]
                    if need <= n_free[c]:
                        if need > 0:
                            _alloc(fq_prev, fq_next, n_free, bhash, hash_head, hnext, ref, table, slot_of, held,
                                   c, r, need, head)
                        # blocks are hashed once their tokens are known: with async scheduling the
                        # token of the previous iteration is still in flight while this one is scheduled
                        upto = computed[c, r] + new
                        if async_on and emit_it[c, r] == it[c] - 1 and upto > num_tokens - 1:
                            upto = num_tokens - 1
                        if prefix_on and _bdiv(upto, bs, bsh) > n_cached[c, r]:
                            _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off, chain_val,
                                          uniq_base, c, r, upto, bs, bsh)
                        scheduled = True
                        break
                    # Rule 4: preempt a victim and retry.
                    if mode == MODE_FCFS:
                        vi = n_run[c] - 1
                    elif mode == MODE_PRIORITY:
                        # vLLM: max(running, key=(priority, arrival)); ties keep the earliest admitted
                        vi = 0
                        for k in range(1, n_run[c]):
                            rk = run_ids[c, k]
                            rv = run_ids[c, vi]
                            if prio[c, rk] > prio[c, rv] or (prio[c, rk] == prio[c, rv]
                                                             and arrival[c, rk] > arrival[c, rv]):
                                vi = k
                    else:
                        vi = 0
                        for k in range(1, n_run[c]):
                            if _better(qkey, prio, arrival, c, run_ids[c, vi], run_ids[c, k], mode, tier, score):
                                vi = k
                    if vi < idx:
                        idx -= 1
                    acc[0] = ns
                    acc[1] = budget
                    v = _preempt(c, vi, acc, run_ids, n_run, (sched_r, sched_new, sched_cb), req_t, pool_t,
                                 slots_t, queues_t, swap_on)
                    ns = acc[0]
                    budget = acc[1]
                    if status[c, v] == WAITING:
                        fbest = n_wait[c] - 1  # (only used in FCFS mode, where v now heads the queue)
                    preempted += 1
                    if v == r:
                        if mode == MODE_FCFS:
                            stop_running = True
                        break
                if scheduled:
                    sched_r[c, ns] = r
                    sched_new[c, ns] = new
                    sched_cb[c, ns] = computed[c, r]
                    ns += 1
                    budget -= new
                    idx += 1

            # Rules 5-6: admission, only if nothing was preempted in this iteration. Candidates are
            # wait_ids[:lim]; with skip_hol (beyond vLLM) a request that does not fit moves past lim.
            # Beyond vLLM, swap (V0): the swapped queue is served before the waiting queue, in FIFO
            # order; a swap-in needs blocks for the whole current sequence plus the watermark.
            # Rule 13 (docs/design.md section 13): a request that arrived with its KV is admitted the
            # same way (the gate for ceil((N + 1)/bs) blocks + watermark), claiming ceil(N/bs) blocks
            # at once, without a swap's cost (never preempted: it holds no host blocks).
            if preempted == 0:
                while n_swap[c] > 0 and budget > 0 and n_run[c] + n_xfer[c] < cfg[C_MAX_SEQS]:
                    r = swap_ids[c, 0]
                    num_tokens = prompt[c, r] + gen[c, r]
                    if _bdiv(num_tokens + bs - 1, bs, bsh) + cfg[C_WATERMARK] > n_free[c]:
                        break
                    for q in range(n_swap[c] - 1):
                        swap_ids[c, q] = swap_ids[c, q + 1]
                    n_swap[c] -= 1
                    remote = with_kv[c, r] and n_preempt[c, r] == 0
                    if remote:
                        h = _bdiv(prompt[c, r] + bs - 1, bs, bsh)
                    else:
                        h = held[c, r]
                        host_free[c] += h
                        acc[2] += h
                    held[c, r] = 0
                    n_slot_free[c] -= 1   # (a free one: fewer than max_num_seqs run)
                    slot_of[c, r] = slot_free[c, n_slot_free[c]]
                    _alloc(fq_prev, fq_next, n_free, bhash, hash_head, hnext, ref, table, slot_of, held,
                           c, r, h, head)
                    if remote:
                        # its KV transfer starts once the link is free (FIFO per link); it ends at
                        # kv_ready, when the request runs (the transfer's source frees its blocks)
                        lk = kv_src[c, r]
                        t0 = link_free[c, lk] if link_free[c, lk] > t_now else t_now
                        kv_ready[c, r] = t0 + (computed[c, r] * cfg[C_XFER_PS_PER_TOKEN] + 999) // 1000 \
                            + cfg[C_XFER_LAT_NS]
                        link_free[c, lk] = kv_ready[c, r]
                        if kv_ready[c, r] > t_now:
                            status[c, r] = TRANSFERRING
                            xfer_ids[c, n_xfer[c]] = r
                            n_xfer[c] += 1
                            continue
                    status[c, r] = RUNNING
                    run_ids[c, n_run[c]] = r
                    n_run[c] += 1
                    new = num_tokens - computed[c, r]
                    if new > budget:
                        new = budget
                    need = _bdiv(computed[c, r] + new + bs - 1, bs, bsh) - held[c, r]
                    if need > 0:
                        _alloc(fq_prev, fq_next, n_free, bhash, hash_head, hnext, ref, table, slot_of, held,
                               c, r, need, head)
                    upto = computed[c, r] + new
                    if async_on and emit_it[c, r] == it[c] - 1 and upto > num_tokens - 1:
                        upto = num_tokens - 1
                    if prefix_on and _bdiv(upto, bs, bsh) > n_cached[c, r]:
                        _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off, chain_val,
                                      uniq_base, c, r, upto, bs, bsh)
                    sched_r[c, ns] = r
                    sched_new[c, ns] = new
                    sched_cb[c, ns] = computed[c, r]
                    ns += 1
                    budget -= new

            if preempted == 0 and n_swap[c] == 0:
                lim = n_wait[c]
                while lim > 0 and budget > 0 and n_run[c] + n_xfer[c] < cfg[C_MAX_SEQS]:
                    # the best waiting request in queue order (resume_first pins preempted ones first)
                    if mode == MODE_FCFS and fbest >= 0:
                        bi = fbest
                    else:
                        bi = _queue_head(c, lim, wait_ids, resumed, resume_first, qkey, prio, arrival, mode, tier,
                                         score)
                    r = wait_ids[c, bi]
                    fbest = bi
                    num_tokens = prompt[c, r] + gen[c, r]
                    while True:
                        fits, hits = _head_fits(c, r, prompt, gen, hash_head, chain_off, chain_val, uniq_base, ref,
                                                n_free, ev_blocks, prefix_on, cfg[C_WATERMARK], bs, bsh)
                        if fits:
                            break
                        if not waiting_preempts or n_run[c] == 0:
                            break
                        # beyond vLLM: a waiting request may preempt a lower-ranked running one.
                        # Only requests never preempted before are eligible victims: scores change
                        # when a request moves between queues, and without this two requests could
                        # preempt each other forever (each victim can lose its place once).
                        vi = np.int64(-1)   # (typed: a literal -1 compiled _preempt twice)
                        for k in range(n_run[c]):
                            if n_preempt[c, run_ids[c, k]] > 0:
                                continue
                            if vi < 0 or _better(qkey, prio, arrival, c, run_ids[c, vi], run_ids[c, k], mode,
                                                 tier, score):
                                vi = k
                        if vi < 0 or not _better(qkey, prio, arrival, c, r, run_ids[c, vi], mode, tier, score):
                            break
                        acc[0] = ns
                        acc[1] = budget
                        _preempt(c, vi, acc, run_ids, n_run, (sched_r, sched_new, sched_cb), req_t, pool_t,
                                 slots_t, queues_t, swap_on)
                        ns = acc[0]
                        budget = acc[1]
                        preempted += 1  # (the victim's freed blocks may be hits now: recounted above)
                    if not fits:
                        if not skip_hol:
                            break  # head-of-line blocking (rule 6)
                        lim -= 1
                        wait_ids[c, bi] = wait_ids[c, lim]
                        wait_ids[c, lim] = r
                        fbest = -1
                        continue
                    if budget <= 0:
                        break  # a preempted victim's budget was the whole budget left
                    new = num_tokens - hits * bs
                    if 0 < thr < new:
                        new = thr
                    if new > budget:
                        new = budget
                    # remove candidate bi, keeping skipped requests (and new victims) past lim
                    lim -= 1
                    wait_ids[c, bi] = wait_ids[c, lim]
                    wait_ids[c, lim] = wait_ids[c, n_wait[c] - 1]
                    n_wait[c] -= 1
                    fbest = -1
                    # take a table slot
                    n_slot_free[c] -= 1
                    sl = slot_free[c, n_slot_free[c]]
                    slot_of[c, r] = sl
                    lo, n_ch, ub = _hash_ids(chain_off, uniq_base, c, r)
                    for j in range(hits):  # touch the hit blocks
                        b = hash_head[c, _hash_id(chain_val, c, lo, n_ch, ub, j)]
                        if ref[c, b] == 0:
                            _fq_remove(fq_prev, fq_next, n_free, c, b)
                        ref[c, b] += 1
                        table[c, sl, j] = b
                    held[c, r] = hits
                    n_cached[c, r] = hits
                    computed[c, r] = hits * bs
                    if prefix_on:
                        epoch[c, EP_QUERY_TOK] += num_tokens
                        epoch[c, EP_HIT_TOK] += hits * bs
                    need = _bdiv(hits * bs + new + bs - 1, bs, bsh) - hits
                    if need > 0:
                        _alloc(fq_prev, fq_next, n_free, bhash, hash_head, hnext, ref, table, slot_of, held,
                               c, r, need, head)
                    if prefix_on:
                        _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off, chain_val,
                                      uniq_base, c, r, hits * bs + new, bs, bsh)
                    status[c, r] = RUNNING
                    resumed[c, r] = False
                    run_ids[c, n_run[c]] = r
                    n_run[c] += 1
                    sched_r[c, ns] = r
                    sched_new[c, ns] = new
                    sched_cb[c, ns] = hits * bs
                    ns += 1
                    budget -= new

            # async: vLLM's update_from_output for the previous iteration runs now (after this
            # schedule): it hashes the blocks completed by the tokens that just became known, for
            # every request still running then, including one that finished
            if async_on and prefix_on:
                for q in range(n_run[c]):
                    r = run_ids[c, q]
                    if emit_it[c, r] == it[c] - 1 and _bdiv(computed[c, r], bs, bsh) > n_cached[c, r]:
                        _cache_blocks(table, slot_of, n_cached, bhash, hash_head, hnext, chain_off, chain_val,
                                      uniq_base, c, r, computed[c, r], bs, bsh)
            # async scheduling (rule 10): blocks of requests that finished last iteration free now
            pending = n_pend[c]
            for k in range(pending):
                if not _retire(run_ids, n_run, table, slot_of, held, n_cached, ref, bhash, fq_prev, fq_next, n_free,
                               slot_free, n_slot_free, c, pend_ids[c, k], head, tail, hold_kv, hold_blk, hold_at,
                               hold_ids, n_hold, hold_top):
                    return HOLD_FULL
            n_pend[c] = 0

            if ns == 0:
                if n_run[c] == 0 and preempted == 0 and pending == 0 and (
                        n_xfer[c] > 0 or (n_hold[c] > 0 and cfg[C_STOP_IDLE] != 0)):
                    # nothing runs until a KV transfer ends (rule 13), blocks held for a transfer are
                    # released (a prefill replica, section 13) or a request arrives: not a request
                    # that can never fit
                    if cfg[C_STOP_IDLE] != 0:
                        epoch[c, EP_BLOCKED] = t_now
                        break
                    now[c] = max(t_now, next_wake(c, n, next_arr, arrival, xfer_ids, n_xfer, kv_ready))
                    total += 1
                    continue
                # Nothing could run. With nothing running or pending, the head request can never fit
                # (its whole sequence plus the watermark exceeds the empty pool): reject it.
                if n_run[c] == 0 and n_swap[c] > 0 and preempted == 0 and pending == 0:
                    # the swapped head cannot fit even in an empty pool: recompute it instead
                    r = swap_ids[c, 0]
                    for q in range(n_swap[c] - 1):
                        swap_ids[c, q] = swap_ids[c, q + 1]
                    n_swap[c] -= 1
                    if with_kv[c, r] and n_preempt[c, r] == 0:
                        # (rule 13: its KV can never be admitted here; recomputing needs as many blocks)
                        _end(status, end_state, finish, n_ended, c, r, E_REJECTED, t_now)
                        total += 1
                        continue
                    host_free[c] += held[c, r]
                    held[c, r] = 0   # (its slot was freed as it was swapped out)
                    recomputed[c, r] += computed[c, r]
                    computed[c, r] = 0
                    resumed[c, r] = True
                    qkey[c, r] = key_lo[c]
                    key_lo[c] -= 1
                    _wait_add(wait_ids, n_wait, status, c, r)
                    total += 1
                    continue
                if n_run[c] == 0 and n_wait[c] > 0 and preempted == 0 and pending == 0:
                    bi = 0
                    for k in range(1, n_wait[c]):
                        if _better(qkey, prio, arrival, c, wait_ids[c, k], wait_ids[c, bi], mode, tier, score):
                            bi = k
                    r = wait_ids[c, bi]
                    if fbest == bi:
                        fbest = -1
                    elif fbest == n_wait[c] - 1:
                        fbest = bi
                    _wait_remove_at(wait_ids, n_wait, c, bi)
                    _end(status, end_state, finish, n_ended, c, r, E_REJECTED, t_now)
                    total += 1
                    continue
                if next_arr[c] < n and n_run[c] == 0 and n_wait[c] == 0:
                    now[c] = max(t_now, arrival[c, next_arr[c]])
                total += 1
                continue

            # Cost model: integer picoseconds, rounded up to ns.
            pre = 0
            dec = 0
            c2 = 0
            attn = 0
            kv = 0
            for k in range(ns):
                r = sched_r[c, k]
                new = sched_new[c, k]
                cb = sched_cb[c, k]
                if new == 1 and gen[c, r] > 0 and cb == prompt[c, r] + gen[c, r] - 1:
                    dec += 1
                    kv += cb
                else:
                    pre += new
                    c2 += new * new
                    attn += new * cb
            t_ps = (cfg[C_PS0] + cfg[C_PS_PREFILL] * pre + cfg[C_PS_C2] * c2 + cfg[C_PS_ATTN] * attn
                    + cfg[C_PS_DECODE] * dec + cfg[C_PS_KV] * kv + cfg[C_SWAP_PS_PER_BLOCK] * acc[2])
            end = t_now + (t_ps + 999) // 1000
            itc = it[c]

            epoch[c, EP_V_RUN] = n_run[c]   # the iteration as scheduled (a router's view, section 12)
            epoch[c, EP_V_FREE] = n_free[c]
            epoch[c, EP_V_ENDED] = n_ended[c]
            epoch[c, EP_BUSY] += end - t_now

            # Rule 7: apply the iteration; tokens are emitted at the iteration's end.
            for k in range(ns):
                r = sched_r[c, k]
                if first_sched[c, r] < 0:
                    first_sched[c, r] = t_now
                computed[c, r] += sched_new[c, k]
                if computed[c, r] == prompt[c, r] + gen[c, r]:
                    gen[c, r] += 1
                    emit_it[c, r] = itc
                    if gen[c, r] == 1:
                        first_token[c, r] = end
                        first_token_it[c, r] = itc
                    elif first_token_it[c, r] < 0:   # (rule 13: its first token here, token 2)
                        first_token_it[c, r] = itc
                        kv_first[c, r] = end
                    if gen[c, r] >= out_len[c, r]:
                        _end(status, end_state, finish, n_ended, c, r,
                             E_LENGTH_CAPPED if capped[c, r] else E_COMPLETED, end)
                        finish_it[c, r] = itc
                        if cfg[C_ASYNC] != 0:
                            # rule 10: stays in `running` (not schedulable, still preemptable, still
                            # counted against max_num_seqs) until the next iteration is scheduled
                            pend_ids[c, n_pend[c]] = r
                            n_pend[c] += 1
                        else:
                            if not _retire(run_ids, n_run, table, slot_of, held, n_cached, ref, bhash, fq_prev,
                                           fq_next, n_free, slot_free, n_slot_free, c, r, head, tail, hold_kv, hold_blk,
                                           hold_at, hold_ids, n_hold, hold_top):
                                return HOLD_FULL

            # per-iteration record
            m = n_iter_rec[c]
            if m < iter_rec.shape[1]:
                iter_rec[c, m, 0] = itc
                iter_rec[c, m, 1] = t_now
                iter_rec[c, m, 2] = end
                iter_rec[c, m, 3] = pre
                iter_rec[c, m, 4] = dec
                iter_rec[c, m, 5] = ns
                iter_rec[c, m, 6] = preempted
                iter_rec[c, m, 7] = cfg[C_USABLE] - n_free[c]
                iter_rec[c, m, 8] = n_run[c]
                iter_rec[c, m, 9] = n_wait[c]
                n_iter_rec[c] = m + 1
            now[c] = end
            it[c] = itc + 1
            total += 1
        if decide:
            if stop == STOP_CAP and _scored_ended(epoch, end_state, c):
                stop = STOP_ENDED
            epoch[c, EP_STOP] = stop
    return total


def run_copies(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, active, max_steps, until_ns,
               gtab=None, claim=None, mine=None):
    """Advance every active copy by up to ``max_steps`` iterations, stopping a copy once its clock
    reaches ``until_ns[c]`` or its iteration cap. Returns iterations run. ``cfg`` and ``fcfg`` hold one
    configuration row per copy ([C, N_CFG] and [C, N_FCFG], ``state.make_cfg_rows``). With
    ``cfg[:, C_DECIDE]`` (``EngineRun.advance_to_decision``) ``until_ns`` is unused: each copy runs
    to its next decision epoch (``A.epoch``; docs/design.md section 5) and ``A.epoch[c, EP_STOP]`` says why it stopped.

    ``theta[c]`` is copy c's policy parameter vector and ``shed_margin[c]`` its shed margin (< 0:
    no shedding). With an in-engine policy (``cfg[:, C_PID]``) the kernel writes ``tier``/``score``
    itself, from each iteration's start: for every waiting request at each stepped iteration, for the
    running ones only when a preemption is possible (the only time they are read), none inside a
    jump; FCFS and priority do not read them.
    ``mrl`` is the residual-life table; ``gtab`` the empirical-Gittins table built from it
    (``scoring.gittins_table``; None: built here, cached per table, when the policy needs it).

    Threads: calls running at once with the same ``active`` mask and one ``claim`` counter
    (``np.zeros(1, np.int64)``) share out its copies as they go (``next_copy``); each marks the
    copies it ran in its own ``mine`` (bool, one per copy). Without ``claim``, this call runs them all.

    The struct of arrays is unpacked here, in Python, so the compiled code sees plain arrays."""
    args = kernel_args(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, active, max_steps, until_ns,
                       gtab, claim, mine)
    return checked_total(run_copies_kernel(*args), args)


#: ``run_copies_kernel``'s parameters in order, each passed by name (``kernel_args``): the call's own
#: arguments, then fields of the struct of arrays (``EngineArrays``, read with ``getattr``), then the
#: empirical-Gittins table and the call's scratch (``_scratch``). ``tests/test_engine_args.py``
#: checks them against the kernel's signature and ``EngineArrays``.
KERNEL_CALL_ARGS = ("cfg_rows", "fcfg_rows", "theta", "shed_margin", "mrl", "nan_score", "tier", "score", "active",
                    "claim", "mine", "max_steps", "until_ns")
KERNEL_STATE_ARGS = (
    "n_req", "arrival", "prompt", "out_len", "prio", "capped", "t1", "t2", "est", "with_kv", "kv_src", "hold_kv",
    "chain_off", "chain_val", "uniq_base",
    "now", "it", "next_arr", "n_ended", "key_hi", "key_lo", "n_run", "n_wait", "n_free", "n_slot_free", "n_pend",
    "n_iter_rec", "status", "end_state", "computed", "gen", "qkey", "slot_of", "held", "n_cached", "first_sched",
    "first_token", "first_token_it", "finish", "finish_it", "n_preempt", "recomputed", "resumed", "run_ids",
    "wait_ids", "slot_free", "pend_ids", "table", "ref", "bhash", "hnext", "fq_prev", "fq_next", "hash_head",
    "sched_r", "sched_new", "sched_cb", "iter_rec", "jump_ids", "jump_off", "emit_it", "swapped", "swap_ids",
    "n_swap", "host_free", "epoch", "kv_ready", "kv_first", "link_free", "xfer_ids", "n_xfer", "hold_blk", "hold_at",
    "hold_ids", "n_hold", "hold_top")
KERNEL_SCRATCH_ARGS = ("gtab", "acc", "ev_blocks", "w_hits", "w_st")
KERNEL_ARGS = KERNEL_CALL_ARGS + KERNEL_STATE_ARGS + KERNEL_SCRATCH_ARGS
_ARG_CFG, _ARG_NAN_SCORE = KERNEL_ARGS.index("cfg_rows"), KERNEL_ARGS.index("nan_score")


def kernel_args(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, active, max_steps, until_ns,
                gtab=None, claim=None, mine=None) -> tuple:
    """``run_copies_kernel``'s arguments for a ``run_copies`` call (the struct of arrays unpacked by field
    name, ``KERNEL_ARGS``; the scratch allocated): for compiled callers that run the kernel
    themselves (``run_copies_kernel(*args)``), which then pass its result through ``checked_total``."""
    if claim is None:
        claim = np.zeros(1, np.int64)
    if mine is None:
        mine = np.zeros(active.shape[0], np.bool_)
    if gtab is None:
        gtab = _gittins_table_for(mrl) if int(cfg[0, C_PID]) == P_GITTINS and int(cfg[0, C_MODE]) == MODE_SCORE \
            else _NO_GTAB
    acc, ev_blocks, w_hits, w_st = _scratch(A)
    named = {"cfg_rows": cfg, "fcfg_rows": fcfg, "theta": theta, "shed_margin": shed_margin, "mrl": mrl,
             "nan_score": np.full(2, -1, np.int64), "tier": tier, "score": score, "active": active, "claim": claim,
             "mine": mine, "max_steps": max_steps, "until_ns": until_ns,
             "gtab": gtab, "acc": acc, "ev_blocks": ev_blocks, "w_hits": w_hits, "w_st": w_st}
    return tuple(named[n] if n in named else getattr(A, n) for n in KERNEL_ARGS)


def checked_total(total: int, args: tuple) -> int:
    """The kernel's result for ``kernel_args`` ``args``: iterations run, or a ``PolicyError`` for the
    NaN score it stopped at (total < 0)."""
    if total == HOLD_FULL:
        raise RuntimeError("a copy's hold store (hold_blk) is full: size it for the blocks held at once")
    if total < 0:
        from ..errors import PolicyError
        from .scoring import POLICY_NAMES
        pid, nan_score = int(args[_ARG_CFG][0, C_PID]), args[_ARG_NAN_SCORE]
        raise PolicyError(f"policy {POLICY_NAMES.get(pid, pid)!r} (id {pid}) produced a NaN score for copy "
                          f"{int(nan_score[0])}, request {int(nan_score[1])}")
    return int(total)


def _scratch(A):
    """One kernel call's scratch arrays (``acc``, ``ev_blocks``, ``w_hits``, ``w_st``), allocated
    here so that the kernel can borrow them: an allocated array's reference counting is two atomic
    operations per inlined helper call it is passed to (perf put ~7% of an env step there)."""
    R = A.wait_ids.shape[1]
    return (np.zeros(3, np.int64), np.empty(A.ref.shape[1], np.int64), np.empty(R, np.int64),
            np.empty((R, 8), np.float64))


_NO_GTAB = np.zeros((3, 1))
_GTAB_CACHE: dict = {}
_GTAB_LOCK = threading.Lock()


def _gittins_table_for(mrl) -> np.ndarray:
    """``scoring.gittins_table(mrl)``, cached by the table's bytes (a few recent tables; safe for
    rows simulated in threads)."""
    from ..errors import PolicyError
    from .scoring import gittins_table
    key = np.ascontiguousarray(mrl, np.float64).tobytes()
    with _GTAB_LOCK:
        tab = _GTAB_CACHE.get(key)
    if tab is None:
        try:
            tab = gittins_table(mrl)
        except ValueError as e:
            raise PolicyError(f"empirical-gittins: {e}") from None
        with _GTAB_LOCK:
            while len(_GTAB_CACHE) >= 8:
                _GTAB_CACHE.pop(next(iter(_GTAB_CACHE)))
            _GTAB_CACHE[key] = tab
    return tab


guard_stale_cache()  # every engine function defined so far (scoring's and this module's)
