"""The episodes of TokenBatch-v0 (docs/design.md section 5): a new episode's window laid out into a
copy's rows of the engine batch (``EpisodeTable``: the workload's units stacked as arrays, so that
``columns`` cuts a batch of windows with a few array operations; ``lay_out``: exactly the engine's
own ``build_arrays`` of those windows, spliced into the batch), and the episode metrics the engine
threads compute as episodes end (``episode_metrics``: the evaluator's definitions)."""

from __future__ import annotations

import numpy as np

from ..engine import kernel as K
from ..engine._jit import guard_stale_cache, njit
from ..engine.outcomes import request_outcome
from ..engine.state import capped_outputs, unique_block_bases
from ..traces import prefix
from ..traces.prefix import window_prefix_ids

#: the engine columns of a copy's scored requests kept at its episode end (for ``episode_records``:
#: ``simulate.record_rows`` reads these, and the SLOs); ``t2`` last (the env's, not the engine's)
RECORD_FIELDS = ("arrival", "prompt", "out_len", "first_sched", "first_token", "first_token_it", "finish",
                  "finish_it", "n_preempt", "recomputed", "swapped", "end_state", "t1", "t2")
#: ``episode_metrics``'s counts, in its column order
EPISODE_COUNTS = ("met", "completed", "shed", "timed_out", "rejected", "unfinished", "preemptions")


@njit
def episode_metrics(rows, epoch, trunc, s0, s1, i_p50, i_p99, counts, pcts, snap, slot, arrival, prompt, out_len,
                    first_sched, first_token, first_token_it, finish, finish_it, n_preempt, recomputed, swapped,
                    end_state, t1, t2, lo):
    """Episode metrics of the copies in the mask ``rows`` whose episode ended (``epoch``'s EP_STOP STOP_ENDED, or
    ``trunc``), over their scored requests [s0, s1), as the evaluator defines them (``request_outcome``;
    ``request_outcomes``'s columns: TTFT in ms, +inf without a first token; TPOT in ms, +inf unless
    completed; an unended request counts as unfinished; ``pcts``'s inverted-CDF rule, its indices
    ``i_p50``/``i_p99`` for s1 - s0 values given): ``counts[c]`` (``EPISODE_COUNTS``), ``pcts[c]`` = TTFT
    p50, p99, TPOT p99; ``snap[c, 1 - slot[c]]`` keeps the ``RECORD_FIELDS`` columns for the copy's records
    (the other slot keeps the last episode reported, until ``episode_infos`` flips ``slot``). Run by
    each engine thread on the copies it advanced (compiled: the serial NumPy version cost ~5% of a step
    at 1,024 copies); checked against the evaluator's functions in tests/test_envs.py. Copies below
    ``lo`` are not looked at."""
    w = s1 - s0
    ttft_ms = np.empty(w)
    tpot_ms = np.empty(w)
    for c in range(lo, rows.shape[0]):
        if not rows[c] or not (epoch[c, K.EP_STOP] == K.STOP_ENDED or trunc[c]):
            continue
        n_met = n_done = n_shed = n_to = n_rej = n_unf = n_pre = 0
        for j in range(s0, s1):
            es = end_state[c, j]
            ttft, tpot, met = request_outcome(es, first_token[c, j], arrival[c, j], finish[c, j], out_len[c, j],
                                              t1[c, j], t2[c, j], True)
            completed = es == K.E_COMPLETED
            n_met += met
            n_done += completed
            n_shed += es == K.E_SHED
            n_to += es == K.E_TIMED_OUT
            n_rej += es == K.E_REJECTED
            n_unf += es == K.E_UNFINISHED or es == K.E_NONE
            n_pre += n_preempt[c, j]
            ttft_ms[j - s0] = ttft / 1e6 if ttft >= 0 else np.inf
            tpot_ms[j - s0] = tpot / 1e6 if completed else np.inf
        counts[c, 0] = n_met
        counts[c, 1] = n_done
        counts[c, 2] = n_shed
        counts[c, 3] = n_to
        counts[c, 4] = n_rej
        counts[c, 5] = n_unf
        counts[c, 6] = n_pre
        ttft_ms.sort()   # (no NaN and no -0.0 among them: any sort gives pcts's order)
        tpot_ms.sort()
        pcts[c, 0] = ttft_ms[i_p50]
        pcts[c, 1] = ttft_ms[i_p99]
        pcts[c, 2] = tpot_ms[i_p99]
        k = 1 - slot[c]
        snap[c, k, 0] = arrival[c, s0:s1]
        snap[c, k, 1] = prompt[c, s0:s1]
        snap[c, k, 2] = out_len[c, s0:s1]
        snap[c, k, 3] = first_sched[c, s0:s1]
        snap[c, k, 4] = first_token[c, s0:s1]
        snap[c, k, 5] = first_token_it[c, s0:s1]
        snap[c, k, 6] = finish[c, s0:s1]
        snap[c, k, 7] = finish_it[c, s0:s1]
        snap[c, k, 8] = n_preempt[c, s0:s1]
        snap[c, k, 9] = recomputed[c, s0:s1]
        snap[c, k, 10] = swapped[c, s0:s1]
        snap[c, k, 11] = end_state[c, s0:s1]
        snap[c, k, 12] = t1[c, s0:s1]
        snap[c, k, 13] = t2[c, s0:s1]


_GROW_FILL = {"hash_head": -1, "chain_val": 0}


#: the engine fields a new episode's window sets (``EpisodeTable.columns``); ``lay_out_rows`` resets
#: every other field but ``table`` (never read above a request's held blocks) and ``hash_head`` (-1
#: except at the ids the copy's blocks hold: cleared there) to the fresh values of a batch as built
TRACE_FIELDS = ("n_req", "arrival", "prompt", "out_len", "prio", "capped", "t1", "t2", "est", "chain_off",
                "chain_val", "uniq_base", "now")


@njit
def lay_out_rows(A, F, rows, src, n_req, arrival, prompt, out_len, prio, capped, t1, t2, est, chain_off, chain_val,
                 uniq_base, now, extent):
    """New episodes into rows ``rows`` of ``A``: row ``src[i]`` of the window columns into row
    ``rows[i]``, every other field (but ``table``) from ``F``'s row 0; ``chain_val``: the window's
    own entries, then zeros up to the row's ``extent`` (nothing was written beyond that), which
    becomes the window's length: each row as ``build_arrays`` would leave it."""
    for i in range(rows.shape[0]):
        r = rows[i]
        s = src[i]
        for b in range(A.bhash.shape[1]):   # (before bhash is reset) the ids this row's blocks hold
            h = A.bhash[r, b]
            if h >= 0:
                A.hash_head[r, h] = -1
        A.it[r] = F.it[0]
        A.next_arr[r] = F.next_arr[0]
        A.n_ended[r] = F.n_ended[0]
        A.key_hi[r] = F.key_hi[0]
        A.key_lo[r] = F.key_lo[0]
        A.n_run[r] = F.n_run[0]
        A.n_wait[r] = F.n_wait[0]
        A.n_free[r] = F.n_free[0]
        A.n_slot_free[r] = F.n_slot_free[0]
        A.n_pend[r] = F.n_pend[0]
        A.n_iter_rec[r] = F.n_iter_rec[0]
        A.status[r] = F.status[0]
        A.end_state[r] = F.end_state[0]
        A.computed[r] = F.computed[0]
        A.gen[r] = F.gen[0]
        A.qkey[r] = F.qkey[0]
        A.slot_of[r] = F.slot_of[0]
        A.held[r] = F.held[0]
        A.n_cached[r] = F.n_cached[0]
        A.first_sched[r] = F.first_sched[0]
        A.first_token[r] = F.first_token[0]
        A.first_token_it[r] = F.first_token_it[0]
        A.finish[r] = F.finish[0]
        A.finish_it[r] = F.finish_it[0]
        A.n_preempt[r] = F.n_preempt[0]
        A.recomputed[r] = F.recomputed[0]
        A.resumed[r] = F.resumed[0]
        A.run_ids[r] = F.run_ids[0]
        A.wait_ids[r] = F.wait_ids[0]
        A.slot_free[r] = F.slot_free[0]
        A.pend_ids[r] = F.pend_ids[0]
        A.ref[r] = F.ref[0]
        A.bhash[r] = F.bhash[0]
        A.hnext[r] = F.hnext[0]
        A.fq_prev[r] = F.fq_prev[0]
        A.fq_next[r] = F.fq_next[0]
        A.sched_r[r] = F.sched_r[0]
        A.sched_new[r] = F.sched_new[0]
        A.sched_cb[r] = F.sched_cb[0]
        A.iter_rec[r] = F.iter_rec[0]
        A.jump_ids[r] = F.jump_ids[0]
        A.jump_off[r] = F.jump_off[0]
        A.emit_it[r] = F.emit_it[0]
        A.swapped[r] = F.swapped[0]
        A.swap_ids[r] = F.swap_ids[0]
        A.n_swap[r] = F.n_swap[0]
        A.host_free[r] = F.host_free[0]
        A.epoch[r] = F.epoch[0]
        A.kv_ready[r] = F.kv_ready[0]
        A.kv_first[r] = F.kv_first[0]
        A.link_free[r] = F.link_free[0]
        A.xfer_ids[r] = F.xfer_ids[0]
        A.n_xfer[r] = F.n_xfer[0]
        A.hold_blk[r] = F.hold_blk[0]
        A.hold_at[r] = F.hold_at[0]
        A.hold_ids[r] = F.hold_ids[0]
        A.n_hold[r] = F.n_hold[0]
        A.hold_top[r] = F.hold_top[0]
        A.n_req[r] = n_req[s]
        A.arrival[r] = arrival[s]
        A.prompt[r] = prompt[s]
        A.out_len[r] = out_len[s]
        A.prio[r] = prio[s]
        A.capped[r] = capped[s]
        A.t1[r] = t1[s]
        A.t2[r] = t2[s]
        A.est[r] = est[s]
        A.with_kv[r] = F.with_kv[0]   # (windows arrive without KV)
        A.kv_src[r] = F.kv_src[0]
        A.hold_kv[r] = F.hold_kv[0]
        A.chain_off[r] = chain_off[s]
        own = chain_off[s, chain_off.shape[1] - 1]
        A.chain_val[r, :own] = chain_val[s, :own]
        if extent[r] > own:
            A.chain_val[r, own:extent[r]] = 0
        extent[r] = own
        A.uniq_base[r] = uniq_base[s]
        A.now[r] = now[s]


def grow(A, widths: dict):
    """``A`` with its per-copy hash dimensions (``_GROW_FILL``) at least ``widths`` (name -> columns)
    wide, the new columns holding the fill value (the same arrays if wide enough)."""
    grown = {}
    for name, w in widths.items():
        a = getattr(A, name)
        if w > a.shape[1]:
            grown[name] = np.full((a.shape[0], w), _GROW_FILL[name], a.dtype)
            grown[name][:, :a.shape[1]] = a
    return A._replace(**grown) if grown else A


def lay_out(A, F, rows: np.ndarray, cols: dict, src: np.ndarray, extent: np.ndarray):
    """``lay_out_rows`` of the windows ``cols`` (``TRACE_FIELDS`` and ``ids``, each window's id space,
    as ``EpisodeTable.columns`` gives them; their rows ``src``) into rows ``rows`` of ``A``, growing
    the per-copy hash dimensions first if these windows need more (their new columns hold the fill
    value). ``F``: the fresh values (an ``EngineArrays`` of one row); ``extent``: per copy, the
    column of chain_val from which it holds zeros (updated). Returns the arrays (new if grown)."""
    rows, src = np.asarray(rows, np.int64), np.asarray(src, np.int64)
    A = grow(A, {"chain_val": int(cols["chain_off"][src, -1].max()), "hash_head": int(cols["ids"][src].max())})
    for name in TRACE_FIELDS:
        a, b = getattr(A, name), cols[name]
        if a.shape[1:] != b.shape[1:] and name != "chain_val":
            raise RuntimeError(f"engine array {name}: shape {b.shape[1:]} does not fit {a.shape[1:]}")
    lay_out_rows(A, F, rows, src, *(cols[f] for f in TRACE_FIELDS), extent)
    return A


class EpisodeTable:
    """The workload's units as stacked arrays, so that a batch of episode windows is laid out with a
    few array operations and no Trace objects: ``columns`` gives exactly ``build_arrays`` of the
    traces ``Workload.window_at`` cuts (checked field by field in tests/test_envs.py)."""

    def __init__(self, wl, estimates, profile, engine_config):
        from ..bounds import best_case_hits
        units = wl.units
        U, L = len(units), max(len(t) for t in units)
        i64 = np.int64

        def stack(col, dtype=i64, width=L):
            out = np.zeros((U, width), dtype)
            for u, t in enumerate(units):
                v = col(u, t)
                out[u, :len(v)] = v
            return out

        self.arrival = stack(lambda u, t: t.arrival_ns)
        self.prompt = stack(lambda u, t: t.prompt_tokens)
        self.output = stack(lambda u, t: t.output_tokens)
        self.prio = stack(lambda u, t: t.priority)
        self.t1 = stack(lambda u, t: t.ttft_slo_ns)      # suites always have SLOs (prepare_workload)
        self.t2 = stack(lambda u, t: t.tpot_slo_ns)
        self.est = stack(lambda u, t: estimates[u], np.float64)
        self.h_best = stack(lambda u, t: best_case_hits(t, profile.block_size, engine_config.prefix_caching))
        self.prefix_len = stack(lambda u, t: t.prefix_lengths)
        self.offsets = stack(lambda u, t: t.prefix_offsets, width=L + 1)
        ids = [t.prefix_ids() for t in units]   # each unit's dense prefix ids, stacked
        self.n_ids = np.array([m for m, _ in ids], np.int64)
        self.chain_ids = stack(lambda u, t: ids[u][1], width=max(1, max(len(v) for _, v in ids)))
        self.lens = np.array([len(t) for t in units], np.int64)
        self.profile, self.engine_config = profile, engine_config

    def max_widths(self, n: int) -> tuple:
        """Upper bounds, over every window of n requests of every unit, of the window's prefix-chain
        entries (``chain_val`` width) and id space (``hash_head`` width: its chain ids are at most
        its chain entries, and each request adds its whole sequence's blocks plus one, less its
        chain; ``unique_block_bases``), so that the engine arrays never need to grow."""
        bs = self.profile.block_size
        per_req = (self.prompt + self.output + bs - 1) // bs + 1   # (padding rows: 1; never inside a window)
        room = np.zeros((per_req.shape[0], per_req.shape[1] + 1), np.int64)
        np.cumsum(per_req, axis=1, out=room[:, 1:])
        H = W = 1
        for u in np.flatnonzero(self.lens >= n):
            m = int(self.lens[u]) - n + 1
            H = max(H, int((self.offsets[u, n:n + m] - self.offsets[u, :m]).max()))
            W = max(W, int((room[u, n:n + m] - room[u, :m]).max()))
        return H, W

    def columns(self, units: np.ndarray, lo: np.ndarray, n: int, factors) -> tuple:
        """(engine columns, t2, h_best) of the windows rows ``[lo, lo + n)`` of ``units``, times scaled
        by ``factors`` (one Fraction per window): for ``lay_out``, the fields a trace sets
        (``TRACE_FIELDS``) and ``ids``, each window's id space (``hash_head`` width)."""
        from ..traces.windows import scale_rows
        i64 = np.int64
        units, lo = np.ascontiguousarray(units, i64), np.ascontiguousarray(lo, i64)
        if units.ndim != 1 or lo.shape != units.shape or (lo < 0).any() or (lo + n > self.lens[units]).any():
            raise IndexError(f"windows of {n} requests at rows {lo.tolist()} do not fit units {units.tolist()}")
        (arrival, prompt, out_len, capped, prio, t1, est, off, chain_val, uniq_base, ids, t2,
         h_best) = _window_columns(units, lo, int(n),
                                   self.arrival, self.prompt, self.output, self.prio, self.t1, self.t2, self.est,
                                   self.h_best, self.prefix_len, self.offsets, self.n_ids, self.chain_ids,
                                   int(self.profile.max_model_len), int(self.profile.block_size),
                                   bool(self.engine_config.prefix_caching))
        arrival = scale_rows(arrival, factors)
        cols = dict(
            n_req=np.full(len(units), n, i64), arrival=arrival, prompt=prompt, out_len=out_len, prio=prio,
            capped=capped, t1=t1, t2=t2, est=est, chain_off=off, chain_val=chain_val, uniq_base=uniq_base,
            now=arrival[:, 0].copy(), ids=ids)
        return cols, t2, h_best


@njit
def _window_columns(units, lo, n, arrival_u, prompt_u, output_u, prio_u, t1_u, t2_u, est_u, h_best_u, prefix_len_u,
                    offsets_u, n_ids, chain_ids, max_model_len, bs, prefix_caching):
    """``EpisodeTable.columns`` before its time scaling, in one compiled pass (new episodes are laid
    out in one engine thread, in Python, while the others advance the copies): window e is rows
    ``[lo[e], lo[e] + n)`` of unit ``units[e]`` (the ``*_u`` arrays, one row per unit). Returns
    (unscaled arrival, prompt, out_len, capped, prio, t1, est, chain_off, chain_val, uniq_base, ids,
    t2, h_best)."""
    E = units.shape[0]
    i64 = np.int64
    arrival, prompt, output = np.empty((E, n), i64), np.empty((E, n), i64), np.empty((E, n), i64)
    prio, t1, t2, h_best = np.empty((E, n), i64), np.empty((E, n), i64), np.empty((E, n), i64), np.empty((E, n), i64)
    est = np.empty((E, n), np.float64)
    off = np.empty((E, n + 1), i64)
    start, count = np.empty(E, i64), np.empty(E, i64)
    width = 1
    for e in range(E):
        u, a = units[e], lo[e]
        for j in range(n):
            arrival[e, j] = arrival_u[u, a + j]
            prompt[e, j] = prompt_u[u, a + j]
            output[e, j] = output_u[u, a + j]
            prio[e, j] = prio_u[u, a + j]
            t1[e, j] = t1_u[u, a + j]
            t2[e, j] = t2_u[u, a + j]
            h_best[e, j] = h_best_u[u, a + j]
            est[e, j] = est_u[u, a + j]
        start[e] = offsets_u[u, a]
        for j in range(n + 1):
            off[e, j] = offsets_u[u, a + j] - start[e]
        count[e] = off[e, n]
        width = max(width, count[e])
    out_len, capped = capped_outputs(prompt, output, max_model_len)
    chain_val = np.zeros((E, width), i64)
    n_uniq = np.zeros(E, i64)   # the windows' dense prefix ids, as Trace.subset derives them
    window_prefix_ids(units, start, count, n_ids, chain_ids, chain_val, n_uniq)
    uniq_base = np.zeros((E, n), i64)
    ids = np.ones(E, i64)
    if prefix_caching and n > 0:
        for e in range(E):
            base, m = unique_block_bases(prompt[e], out_len[e], prefix_len_u[units[e], lo[e]:lo[e] + n], n_uniq[e], bs)
            uniq_base[e] = base
            ids[e] = max(m, 1)
    return arrival, prompt, out_len, capped, prio, t1, est, off, chain_val, uniq_base, ids, t2, h_best


# (last: every compiled function of this module is defined) ``episode_metrics`` links the outcome
# definition (``engine.outcomes``), ``lay_out_rows`` the engine's arrays, ``_window_columns`` the
# engine's and the traces' compiled helpers: flush this module's cached machine code when any of
# their sources changes
guard_stale_cache([episode_metrics, lay_out_rows, _window_columns], tag="envs.episodes",
                  extra_sources=[prefix.__file__])
