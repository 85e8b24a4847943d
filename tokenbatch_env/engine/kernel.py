"""The engine's step: one vLLM V1 scheduling iteration for every copy (DESIGN.md section 3).

This module is the one implementation of the dynamics. It is written in the subset of Python that
numba compiles; with ``NUMBA_DISABLE_JIT=1`` the very same functions run interpreted (the reference
path, compared with the compiled one in a lockstep test). Everything is integer arithmetic; the clock is int64 ns.

Numbers in comments refer to DESIGN.md section 3's rules.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

try:  # numba is a runtime dependency; the interpreted path keeps working without it
    from numba import njit as _numba_njit

    def njit(fn):
        return _numba_njit(cache=True, nogil=True)(fn)

    def helper(fn):
        """Small helpers are inlined at numba-IR level: passing the struct of arrays to a separate
        function costs a reference-count round trip per array per call (measured 3x slower)."""
        return _numba_njit(cache=True, nogil=True, inline="always")(fn)
except ImportError:  # pragma: no cover
    def njit(fn):
        fn.py_func = fn
        return fn

    helper = njit

# ---------------------------------------------------------------------------------- constants
# request status
FUTURE, WAITING, RUNNING, ENDED = 0, 1, 2, 3
# end states (DESIGN.md section 3, "Outcomes")
E_NONE, E_COMPLETED, E_SHED, E_TIMED_OUT, E_LENGTH_CAPPED, E_REJECTED, E_UNFINISHED = 0, 1, 2, 3, 4, 5, 6
END_STATE_NAMES = ("none", "completed", "shed", "timed_out", "length_capped", "rejected", "unfinished")
# policy modes for ordering
MODE_FCFS, MODE_PRIORITY, MODE_SCORE = 0, 1, 2

# cfg vector indices
(C_BUDGET, C_MAX_SEQS, C_BS, C_USABLE, C_WATERMARK, C_MAX_LEN, C_PREFIX, C_ASYNC, C_MODE,
 C_MAX_WAIT, C_TIMEOUT_RUNNING, C_SKIP_HOL, C_MAX_ITERS,
 C_PS0, C_PS_PREFILL, C_PS_C2, C_PS_ATTN, C_PS_DECODE, C_PS_KV, C_RESUME_FIRST, N_CFG) = range(21)

# per-iteration record columns (DESIGN.md section 3, "per-iteration records")
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


# ---------------------------------------------------------------------------------- block pool
@helper
def _fq_remove(A, c, b):
    p = A.fq_prev[c, b]
    n = A.fq_next[c, b]
    A.fq_next[c, p] = n
    A.fq_prev[c, n] = p
    A.fq_prev[c, b] = -1
    A.fq_next[c, b] = -1
    A.n_free[c] -= 1


@helper
def _fq_append(A, c, b, head, tail):
    p = A.fq_prev[c, tail]
    A.fq_next[c, p] = b
    A.fq_prev[c, b] = p
    A.fq_next[c, b] = tail
    A.fq_prev[c, tail] = b
    A.n_free[c] += 1


@helper
def _fq_prepend(A, c, b, head):
    n = A.fq_next[c, head]
    A.fq_next[c, head] = b
    A.fq_prev[c, b] = head
    A.fq_next[c, b] = n
    A.fq_prev[c, n] = b
    A.n_free[c] += 1


@helper
def _uncache(A, c, b):
    """Remove block b from the hash map (it is about to be reused)."""
    h = A.bhash[c, b]
    if h < 0:
        return
    cur = A.hash_head[c, h]
    if cur == b:
        A.hash_head[c, h] = A.hnext[c, b]
    else:
        while cur >= 0:
            nxt = A.hnext[c, cur]
            if nxt == b:
                A.hnext[c, cur] = A.hnext[c, b]
                break
            cur = nxt
    A.hnext[c, b] = -1
    A.bhash[c, b] = -1


@helper
def _alloc(A, c, r, k, head):
    """Pop k blocks from the free queue's front (evicting cached ones lazily) into r's table."""
    s = A.slot_of[c, r]
    for _ in range(k):
        b = A.fq_next[c, head]
        _fq_remove(A, c, b)
        _uncache(A, c, b)
        A.ref[c, b] = 1
        A.table[c, s, A.held[c, r]] = b
        A.held[c, r] += 1


@helper
def _block_hash_id(A, c, r, j):
    lo = A.chain_off[c, r]
    n = A.chain_off[c, r + 1] - lo
    if j < n:
        return A.chain_val[c, lo + j]
    return A.uniq_base[c, r] + (j - n)


@helper
def _cache_blocks(A, c, r, upto_tokens, bs):
    """Hash r's full blocks up to ``upto_tokens`` into the prefix cache (vLLM caches on allocation)."""
    full = upto_tokens // bs
    s = A.slot_of[c, r]
    j = A.n_cached[c, r]
    while j < full:
        b = A.table[c, s, j]
        if A.bhash[c, b] < 0:
            h = _block_hash_id(A, c, r, j)
            A.bhash[c, b] = h
            # append to the hash's block list (the first inserted is returned on lookup)
            cur = A.hash_head[c, h]
            if cur < 0:
                A.hash_head[c, h] = b
            else:
                while A.hnext[c, cur] >= 0:
                    cur = A.hnext[c, cur]
                A.hnext[c, cur] = b
            A.hnext[c, b] = -1
        j += 1
    if full > A.n_cached[c, r]:
        A.n_cached[c, r] = full


@helper
def _free_request_blocks(A, c, r, head, tail):
    """Release r's blocks in reverse order (tail evicted first); hashless ones go to the front."""
    s = A.slot_of[c, r]
    for j in range(A.held[c, r] - 1, -1, -1):
        b = A.table[c, s, j]
        A.ref[c, b] -= 1
        if A.ref[c, b] == 0:
            if A.bhash[c, b] < 0:
                _fq_prepend(A, c, b, head)
            else:
                _fq_append(A, c, b, head, tail)
    A.held[c, r] = 0
    A.n_cached[c, r] = 0
    A.slot_free[c, A.n_slot_free[c]] = s
    A.n_slot_free[c] += 1
    A.slot_of[c, r] = -1


@helper
def _take_slot(A, c, r):
    A.n_slot_free[c] -= 1
    A.slot_of[c, r] = A.slot_free[c, A.n_slot_free[c]]
    A.held[c, r] = 0
    A.n_cached[c, r] = 0


@helper
def _prefix_hits(A, c, r, num_tokens, bs):
    """Cached leading blocks of r: a contiguous chain from block 0, capped at num_tokens - 1."""
    max_blocks = (num_tokens - 1) // bs
    k = 0
    while k < max_blocks:
        if A.hash_head[c, _block_hash_id(A, c, r, k)] < 0:
            break
        k += 1
    return k


# ---------------------------------------------------------------------------------- ordering
@helper
def _order_key(A, c, r, mode, tier, score):
    """(tier, score): higher is served first. FCFS and priority are vLLM's own orders."""
    if mode == MODE_FCFS:
        return 0, -float(A.qkey[c, r])
    if mode == MODE_PRIORITY:
        return 0, -float(A.prio[c, r])
    return int(tier[c, r]), float(score[c, r])


@helper
def _better(A, c, r1, r2, mode, tier, score):
    """True if r1 is served before r2: tier desc, score desc, arrival asc, id asc."""
    t1, s1 = _order_key(A, c, r1, mode, tier, score)
    t2, s2 = _order_key(A, c, r2, mode, tier, score)
    if t1 != t2:
        return t1 > t2
    if s1 != s2:
        return s1 > s2
    a1 = A.arrival[c, r1]
    a2 = A.arrival[c, r2]
    if a1 != a2:
        return a1 < a2
    return r1 < r2


# ---------------------------------------------------------------------------------- list helpers
@helper
def _run_remove_at(A, c, i):
    n = A.n_run[c]
    for k in range(i, n - 1):
        A.run_ids[c, k] = A.run_ids[c, k + 1]
    A.n_run[c] = n - 1


@helper
def _wait_add(A, c, r):
    A.wait_ids[c, A.n_wait[c]] = r
    A.n_wait[c] += 1
    A.status[c, r] = WAITING


@helper
def _wait_remove_at(A, c, i):
    n = A.n_wait[c] - 1
    A.wait_ids[c, i] = A.wait_ids[c, n]
    A.n_wait[c] = n


@helper
def _end(A, c, r, state, t):
    A.status[c, r] = ENDED
    A.end_state[c, r] = state
    A.finish[c, r] = t
    A.n_ended[c] += 1


# ---------------------------------------------------------------------------------- one iteration
@njit
def _iterate_copy(A, c, cfg, tier, score, shed):
    """Advance copy c by one engine iteration. Returns 1 if an iteration ran, 0 if the copy is done."""
    n = A.n_req[c]
    if A.n_ended[c] >= n:
        return 0
    bs = cfg[C_BS]
    mode = cfg[C_MODE]
    nb = A.ref.shape[1]
    head = nb
    tail = nb + 1
    prefix_on = cfg[C_PREFIX] != 0

    # Idle engine: jump the clock to the next arrival.
    if A.n_run[c] == 0 and A.n_wait[c] == 0 and A.n_pend[c] == 0:
        if A.next_arr[c] < n and A.arrival[c, A.next_arr[c]] > A.now[c]:
            A.now[c] = A.arrival[c, A.next_arr[c]]
    now = A.now[c]

    # Rule 1: arrivals visible iff arrival <= iteration start. Rule 8: too-long prompts rejected.
    while A.next_arr[c] < n and A.arrival[c, A.next_arr[c]] <= now:
        r = A.next_arr[c]
        A.next_arr[c] += 1
        if A.prompt[c, r] >= cfg[C_MAX_LEN]:
            _end(A, c, r, E_REJECTED, A.arrival[c, r])
            continue
        A.qkey[c, r] = A.key_hi[c]
        A.key_hi[c] += 1
        _wait_add(A, c, r)

    # Rule 12: client time-outs; the shed mechanism (the caller's mask).
    i = 0
    while i < A.n_wait[c]:
        r = A.wait_ids[c, i]
        gone = False
        if shed[c, r]:
            _end(A, c, r, E_SHED, now)
            gone = True
        elif cfg[C_MAX_WAIT] >= 0 and A.gen[c, r] == 0 and now >= A.arrival[c, r] + cfg[C_MAX_WAIT]:
            _end(A, c, r, E_TIMED_OUT, now)
            gone = True
        if gone:
            _wait_remove_at(A, c, i)
        else:
            i += 1
    if cfg[C_MAX_WAIT] >= 0 and cfg[C_TIMEOUT_RUNNING] != 0:
        i = 0
        while i < A.n_run[c]:
            r = A.run_ids[c, i]
            if A.gen[c, r] == 0 and now >= A.arrival[c, r] + cfg[C_MAX_WAIT]:
                _run_remove_at(A, c, i)
                _free_request_blocks(A, c, r, head, tail)
                _end(A, c, r, E_TIMED_OUT, now)
            else:
                i += 1

    if A.n_ended[c] >= n:
        return 0
    if A.n_run[c] == 0 and A.n_wait[c] == 0 and A.n_pend[c] == 0:
        return 1  # everything visible ended; the next call jumps to the next arrival

    budget = cfg[C_BUDGET]
    ns = 0
    preempted = 0

    # Rule 2: RUNNING first, in admission order.
    idx = 0
    stop_running = False
    while idx < A.n_run[c] and budget > 0 and not stop_running:
        r = A.run_ids[c, idx]
        num_tokens = A.prompt[c, r] + A.gen[c, r]
        new = num_tokens - A.computed[c, r]
        if new > budget:
            new = budget
        if new <= 0:
            idx += 1
            continue
        scheduled = False
        while True:
            # Rule 3: lazy block claims; a request holds ceil(computed / bs) blocks.
            need = (A.computed[c, r] + new + bs - 1) // bs - A.held[c, r]
            if need <= A.n_free[c]:
                if need > 0:
                    _alloc(A, c, r, need, head)
                if prefix_on:
                    _cache_blocks(A, c, r, A.computed[c, r] + new, bs)
                scheduled = True
                break
            # Rule 4: preempt a victim and retry.
            if mode == MODE_FCFS:
                vi = A.n_run[c] - 1
            else:
                vi = 0
                for k in range(1, A.n_run[c]):
                    if _better(A, c, A.run_ids[c, vi], A.run_ids[c, k], mode, tier, score):
                        vi = k
            v = A.run_ids[c, vi]
            _run_remove_at(A, c, vi)
            if vi < idx:
                idx -= 1
            # give back an already scheduled victim's tokens and budget
            for k in range(ns):
                if A.sched_r[c, k] == v:
                    budget += A.sched_new[c, k]
                    for q in range(k, ns - 1):
                        A.sched_r[c, q] = A.sched_r[c, q + 1]
                        A.sched_new[c, q] = A.sched_new[c, q + 1]
                        A.sched_cb[c, q] = A.sched_cb[c, q + 1]
                    ns -= 1
                    break
            A.recomputed[c, v] += A.computed[c, v]
            _free_request_blocks(A, c, v, head, tail)
            A.computed[c, v] = 0
            A.n_preempt[c, v] += 1
            A.resumed[c, v] = True
            A.qkey[c, v] = A.key_lo[c]
            A.key_lo[c] -= 1
            _wait_add(A, c, v)
            preempted += 1
            if v == r:
                if mode == MODE_FCFS:
                    stop_running = True
                break
        if scheduled:
            A.sched_r[c, ns] = r
            A.sched_new[c, ns] = new
            A.sched_cb[c, ns] = A.computed[c, r]
            ns += 1
            budget -= new
            idx += 1

    # Rules 5-6: admission, only if nothing was preempted in this iteration.
    if preempted == 0:
        while A.n_wait[c] > 0 and budget > 0 and A.n_run[c] < cfg[C_MAX_SEQS]:
            # the best waiting request in queue order (resume_first pins preempted ones first)
            bi = -1
            for k in range(A.n_wait[c]):
                rk = A.wait_ids[c, k]
                if bi < 0:
                    bi = k
                    continue
                rb = A.wait_ids[c, bi]
                if cfg[C_RESUME_FIRST] != 0 and A.resumed[c, rk] != A.resumed[c, rb]:
                    if A.resumed[c, rk]:
                        bi = k
                    continue
                if _better(A, c, rk, rb, mode, tier, score):
                    bi = k
            r = A.wait_ids[c, bi]
            num_tokens = A.prompt[c, r] + A.gen[c, r]
            hits = _prefix_hits(A, c, r, num_tokens, bs) if prefix_on else 0
            s = A.table.shape[1]
            # hits that sit in the free queue count against free slots
            evictable = 0
            for j in range(hits):
                b = A.hash_head[c, _block_hash_id(A, c, r, j)]
                if A.ref[c, b] == 0:
                    evictable += 1
            full_blocks = (num_tokens + bs - 1) // bs
            if full_blocks - hits + evictable + cfg[C_WATERMARK] > A.n_free[c]:
                break  # head-of-line blocking (rule 6)
            new = num_tokens - hits * bs
            if new > budget:
                new = budget
            _wait_remove_at(A, c, bi)
            _take_slot(A, c, r)
            sl = A.slot_of[c, r]
            for j in range(hits):  # touch the hit blocks
                b = A.hash_head[c, _block_hash_id(A, c, r, j)]
                if A.ref[c, b] == 0:
                    _fq_remove(A, c, b)
                A.ref[c, b] += 1
                A.table[c, sl, j] = b
            A.held[c, r] = hits
            A.n_cached[c, r] = hits
            A.computed[c, r] = hits * bs
            need = (hits * bs + new + bs - 1) // bs - hits
            if need > 0:
                _alloc(A, c, r, need, head)
            if prefix_on:
                _cache_blocks(A, c, r, hits * bs + new, bs)
            A.status[c, r] = RUNNING
            A.resumed[c, r] = False
            A.run_ids[c, A.n_run[c]] = r
            A.n_run[c] += 1
            A.sched_r[c, ns] = r
            A.sched_new[c, ns] = new
            A.sched_cb[c, ns] = hits * bs
            ns += 1
            budget -= new
            if s < 0:  # pragma: no cover (keeps numba from pruning s)
                break

    # async scheduling (rule 10): blocks of requests that finished last iteration free now
    pending = A.n_pend[c]
    for k in range(pending):
        _free_request_blocks(A, c, A.pend_ids[c, k], head, tail)
    A.n_pend[c] = 0

    if ns == 0:
        # Nothing could run. With nothing running or pending, the head request can never fit
        # (its whole sequence plus the watermark exceeds the empty pool): reject it.
        if A.n_run[c] == 0 and A.n_wait[c] > 0 and preempted == 0 and pending == 0:
            bi = 0
            for k in range(1, A.n_wait[c]):
                if _better(A, c, A.wait_ids[c, k], A.wait_ids[c, bi], mode, tier, score):
                    bi = k
            r = A.wait_ids[c, bi]
            _wait_remove_at(A, c, bi)
            _end(A, c, r, E_REJECTED, now)
            return 1
        if A.next_arr[c] < n and A.n_run[c] == 0:
            A.now[c] = max(now, A.arrival[c, A.next_arr[c]])
        return 1

    # Cost model: integer picoseconds, rounded up to ns.
    pre = 0
    dec = 0
    c2 = 0
    attn = 0
    kv = 0
    for k in range(ns):
        r = A.sched_r[c, k]
        new = A.sched_new[c, k]
        cb = A.sched_cb[c, k]
        if new == 1 and A.gen[c, r] > 0 and cb == A.prompt[c, r] + A.gen[c, r] - 1:
            dec += 1
            kv += cb
        else:
            pre += new
            c2 += new * new
            attn += new * cb
    t_ps = (cfg[C_PS0] + cfg[C_PS_PREFILL] * pre + cfg[C_PS_C2] * c2 + cfg[C_PS_ATTN] * attn
            + cfg[C_PS_DECODE] * dec + cfg[C_PS_KV] * kv)
    end = now + (t_ps + 999) // 1000
    it = A.it[c]

    # Rule 7: apply the iteration; tokens are emitted at the iteration's end.
    for k in range(ns):
        r = A.sched_r[c, k]
        if A.first_sched[c, r] < 0:
            A.first_sched[c, r] = now
        A.computed[c, r] += A.sched_new[c, k]
        if A.computed[c, r] == A.prompt[c, r] + A.gen[c, r]:
            A.gen[c, r] += 1
            if A.gen[c, r] == 1:
                A.first_token[c, r] = end
                A.first_token_it[c, r] = it
            if A.gen[c, r] >= A.out_len[c, r]:
                for q in range(A.n_run[c]):
                    if A.run_ids[c, q] == r:
                        _run_remove_at(A, c, q)
                        break
                _end(A, c, r, E_LENGTH_CAPPED if A.capped[c, r] else E_COMPLETED, end)
                A.finish_it[c, r] = it
                if cfg[C_ASYNC] != 0:
                    A.pend_ids[c, A.n_pend[c]] = r
                    A.n_pend[c] += 1
                else:
                    _free_request_blocks(A, c, r, head, tail)

    # per-iteration record
    m = A.n_iter_rec[c]
    if m < A.iter_rec.shape[1]:
        A.iter_rec[c, m, 0] = it
        A.iter_rec[c, m, 1] = now
        A.iter_rec[c, m, 2] = end
        A.iter_rec[c, m, 3] = pre
        A.iter_rec[c, m, 4] = dec
        A.iter_rec[c, m, 5] = ns
        A.iter_rec[c, m, 6] = preempted
        A.iter_rec[c, m, 7] = cfg[C_USABLE] - A.n_free[c]
        A.iter_rec[c, m, 8] = A.n_run[c]
        A.iter_rec[c, m, 9] = A.n_wait[c]
        A.n_iter_rec[c] = m + 1
    A.now[c] = end
    A.it[c] = it + 1
    return 1


@njit
def run_copies(A, cfg, tier, score, shed, active, max_steps, until_ns):
    """Advance every active copy by up to ``max_steps`` iterations, stopping a copy once its clock
    reaches ``until_ns[c]`` (a decision epoch) or its iteration cap. Returns iterations run."""
    total = 0
    for c in range(A.now.shape[0]):
        if not active[c]:
            continue
        for _ in range(max_steps):
            if A.now[c] >= until_ns[c] or A.it[c] >= cfg[C_MAX_ITERS]:
                break
            if _iterate_copy(A, c, cfg, tier, score, shed) == 0:
                break
            total += 1
    return total

