"""The batched core of TokenBatch-v0 (docs/design.md section 5): ``Core``, N copies of the MDP as one
engine batch, driving one ``engine.simulate.EngineRun`` over all copies. The engine runs each copy to
its next decision epoch (``EngineRun.advance_to_decision``); each engine thread then observes and
rewards the copies it advanced, and computes the metrics of the episodes that ended, while their
rows are still in its caches (``advance_observe``). New episodes are drawn from each copy's own
generator, cut from the workload's units (``episodes.EpisodeTable``) and laid out into the batch
(``episodes.lay_out``). The workload (suite traces, lambda_sat, the residual-life table, T_ref, the
predictor and its estimates, time scaling to rho) is ``workload.prepare_workload``'s, the
evaluator's own, so agents and baselines see the same windows."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

from .. import bounds
from ..engine import kernel as K
from ..engine._jit import fetch_add, guard_stale_cache, njit
from ..errors import ConfigError, TraceError
from . import episodes, observation, rewards
from .actions import map_actions, map_guard_actions
from .config import TokenBatchConfig, is_int
from .episodes import EPISODE_COUNTS, RECORD_FIELDS, EpisodeTable, episode_metrics, grow, lay_out
from .observation import obs_dim, obs_scales, observe, observe_args, observe_kernel
from .rewards import REGISTRY, rewards_kernel

#: prepared workloads (suite traces, lambda_sat, residual life, estimates), shared read-only by every
#: env of a process: (suite, split, profile, engine config, predictor) -> (Workload, estimates)
_WORKLOADS: dict = {}


#: copies an engine thread claims at a time in ``advance_observe`` (then observes and rewards them)
_CHUNK = 32


@njit
def advance_observe(kargs, act, claim, chunk, priv, stopped, epoch, max_ep_steps, steps, trunc, obs_args,
                    rew_args, met_args):
    """One engine thread's share of an env step: claim ``_CHUNK`` copies of ``act`` at a time from the
    counter ``claim`` (shared by the threads), run the kernel on them (``kargs``: ``K.kernel_args``
    with ``chunk`` as its mask and ``priv`` as its claim counter), then ``_after_stop`` on them while
    their rows are still in the caches: every thread's share of that work follows the copies it
    claims. Returns the kernel's total (negative: it stopped at a NaN score)."""
    n = act.shape[0]
    total = 0
    while True:
        lo = fetch_add(claim, 0, _CHUNK)
        if lo >= n:
            break
        hi = min(lo + _CHUNK, n)
        some = False
        for c in range(lo, hi):
            chunk[c] = act[c]
            if act[c]:
                some = True
        if not some:
            continue
        priv[0] = lo
        t = K.run_copies_kernel(*kargs)
        if t < 0:
            for c in range(lo, hi):
                chunk[c] = False
            return t
        total += t
        _after_stop(lo, hi, chunk, stopped, epoch, max_ep_steps, steps, trunc, obs_args, rew_args, met_args)
    return total


@njit
def _after_stop(lo, hi, ran, stopped, epoch, max_ep_steps, steps, trunc, obs_args, rew_args, met_args):
    """The env's work on the copies in [lo, hi) of the mask ``ran`` (cleared here) that the engine
    advanced and that stopped (``epoch``'s EP_STOP): count the step, its truncation (the engine's iteration
    cap, or ``max_ep_steps`` steps), and write their observations, rewards and, if an episode ended,
    episode metrics (``obs_args``/``rew_args``/``met_args``: the arguments of ``observe_kernel``/
    ``rewards_kernel``/``episode_metrics`` after their masks). ``stopped``: scratch, all False."""
    n_stop = 0
    any_end = False
    for c in range(lo, hi):
        s = epoch[c, K.EP_STOP]
        st = ran[c] and s != K.STOP_NONE
        ran[c] = False
        stopped[c] = st
        if st:
            n_stop += 1
            steps[c] += 1
            ended = s == K.STOP_ENDED
            tr = not ended and (s == K.STOP_CAP or steps[c] >= max_ep_steps)
            trunc[c] = tr
            if ended or tr:
                any_end = True
    if n_stop > 0:
        m = stopped[:hi]
        observe_kernel(m, *obs_args, lo)
        rewards_kernel(m, trunc, *rew_args, lo)
        if any_end:
            episode_metrics(m, epoch, trunc, *met_args, lo)
        for c in range(lo, hi):
            stopped[c] = False


#: copies per thread below which observations outside a step (new episodes; a few us per copy) are not split
_MIN_GROUP = 128
#: live copies per new episode from which a step lays out the new episodes while the engine runs (a
#: layout costs ~10 copy-steps of engine work at the default config)
_OVERLAP_LIVE_PER_RESET = 16


class Core:
    """N copies of the MDP as one batch (all arrays [N, ...])."""

    def __init__(self, config: TokenBatchConfig, num_envs: int, threads: int = 1, prepare_ahead: bool = False):
        """``prepare_ahead`` (SAME_STEP): each copy's next episode is drawn and cut while the engine
        runs (``prepare_ahead``), so that a reset after the engine call only lays it out."""
        from ..engine.profiles import load_profile
        from ..engine.simulate import EngineRun
        from ..engine.state import EngineConfig
        from ..params import load_params_file, load_weights
        from ..policies import IndexParams, LinearWeights
        from ..workload import WorkloadSpec, prepare_workload

        if not is_int(num_envs) or num_envs < 1:
            raise ConfigError(f"num_envs: must be an integer >= 1, got {num_envs!r}")
        self.config = cfg = config
        self.n = N = int(num_envs)
        self.engine_config = EngineConfig(max_iterations=cfg.max_iterations)
        from ..errors import ProfileError
        from ..traces.suites import load_suite
        try:
            profile = self.engine_config.resolve(load_profile(cfg.profile))
        except (ProfileError, KeyError, FileNotFoundError) as e:
            raise ConfigError(f"profile: {e}") from None
        self.profile = profile
        try:
            suite = load_suite(cfg.suite)
        except ConfigError as e:
            raise ConfigError(f"suite: {e}") from None
        if cfg.split not in suite.splits:
            raise ConfigError(f"split: must be one of {suite.splits} for suite {cfg.suite!r}, got {cfg.split!r}")
        from ..engine import COMPILE_SECONDS, compile_notice
        # (one line, once, before numba compiles the engine or this env's step)
        compile_notice([("the env's step", [advance_observe], COMPILE_SECONDS["env"])])
        key = (cfg.suite, cfg.split, cfg.profile, self.engine_config, cfg.predictor)
        if key not in _WORKLOADS:
            try:
                wl = prepare_workload(WorkloadSpec(suite=cfg.suite, split=cfg.split, engine=self.engine_config),
                                      profile)
            except ConfigError as e:
                raise ConfigError(f"suite/split: {e}") from None
            if cfg.predictor is not None:
                wl = dataclasses.replace(wl, predictor=cfg.predictor)
            est = wl.estimates()
            _WORKLOADS[key] = (wl, est, EpisodeTable(wl, est, profile, self.engine_config))
        wl, self.estimates, self.episodes = _WORKLOADS[key]
        self.workload = wl
        lens = [len(t) for t in wl.units]
        usable = [i for i, n in enumerate(lens) if n >= cfg.n_req]
        if not usable:
            raise ConfigError(f"window: warmup + window + cooldown = {cfg.n_req} requests, but the longest "
                              f"trace of {cfg.suite}/{cfg.split} has {max(lens)}")
        self.units = usable
        # base parameters theta* and shed margin
        weights = LinearWeights()
        if cfg.base_params is not None:
            params, margins = load_params_file(cfg.base_params, "base_params")
            weights = load_weights(cfg.base_params, "base_params") or weights
            margin = dict(margins).get("index" if cfg.action_mode == "index" else "weights", cfg.shed_margin)
            margin = None if margin is None or math.isinf(margin) else float(margin)
        else:
            params, margin = IndexParams(), cfg.shed_margin
        self.base_guard = None
        if cfg.tpot_guard:   # v1: the rule's base (u*, B_min*) and, tuned with it, the index's parameters
            params, margin, self.base_guard = guard_base(cfg, params, margin)
        self.base_params, self.base_margin, self.base_weights = params, margin, weights
        self.theta_star = (params if cfg.action_mode == "index" else weights).theta_vector(wl.t_ref_ms)
        self.action_names = cfg.action_names
        # engine (v1: with the rule at the base u and B_min; the workload is prepared without it)
        run_config = self.engine_config
        if self.base_guard is not None:
            from ..engine.levers import with_guard
            run_config = with_guard(run_config, *self.base_guard)
        wl.check_load(cfg.rho[0], "rho", usable)   # (the lowest load: if it fits, every draw does)
        w0 = wl.window_at(usable[0], cfg.rho[0], cfg.warmup, cfg.window, cfg.warmup, cfg.cooldown)
        from ..policies import engine_policy
        pol = engine_policy(cfg.action_mode, params=params, weights=weights, shed_margin=margin,
                            t_ref_ms=wl.t_ref_ms)
        est0 = self.estimates[usable[0]][w0.parent_start:w0.parent_start + len(w0.trace)]
        self.run = EngineRun([w0.trace] * N, profile, pol, run_config,
                             estimates=[est0] * N, residual_life=wl.residual_life, threads=threads)
        self.pol = pol
        # the fresh engine state of a copy, as built (the fields a new episode resets that its trace
        # does not set; the block table is never reset)
        self.fresh = K.EngineArrays(*(a[:1].copy() for a in self.run.arrays))
        # the per-copy hash dimensions sized once for any window (no growth, i.e. no copy of the
        # whole arrays, at resets); ``cv_extent``: each chain_val row holds zeros from there on
        # (hash_head rows are -1 except at the ids the copy's blocks hold: resets clear just those)
        self.cv_extent = np.full(N, self.run.arrays.chain_val.shape[1], np.int64)
        self.run.arrays = grow(self.run.arrays, dict(zip(("chain_val", "hash_head"),
                                                          self.episodes.max_widths(cfg.n_req))))
        # constants for observations and certain-miss detection
        self.k = cfg.k
        self.tpot = bool(cfg.tpot_guard)
        self.obs_dim = obs_dim(cfg.k, self.tpot)
        ps = profile.cost.ps
        # the shortest iteration that can emit a token: one decode, or a 1-token (re)compute chunk
        self.t_min_ns = int((int(ps[0]) + min(int(ps[4]), int(ps[1]) + int(ps[2])) + 999) // 1000)
        self.ps_cost = np.ascontiguousarray(np.asarray(ps[:4], np.int64))
        self.ocfg = obs_scales(wl.t_ref_ms, wl.lambda_sat)
        self.dt_ns = max(1, int(round(cfg.decision_interval_ms * 1e6)))
        R = cfg.n_req
        self.s0, self.s1 = cfg.warmup, cfg.warmup + cfg.window
        # per-copy episode state
        self.rngs = [np.random.default_rng(None if cfg.seed is None else cfg.seed + i) for i in range(N)]
        # prepared next episodes (``prepare_ahead``): field -> [N, ...]; which copies have one; a copy
        # whose drawn episode could not be cut -> its error (raised at its reset)
        self._prep: Optional[dict] = {} if prepare_ahead else None
        self._ready = np.zeros(N, bool)
        self._prep_error: dict = {}
        self.obs = np.zeros((N, self.obs_dim), np.float32)
        self.t2 = np.zeros((N, R), np.int64)
        self.h_best = np.zeros((N, R), np.int64)   # best-case prefix hits (bounds.best_case_hits)
        self.certain = np.zeros((N, cfg.window), bool)
        self.met_seen = np.zeros((N, cfg.window), bool)
        self.open_lo = np.zeros(N, np.int64)   # scored requests settled for the rewards (a prefix)
        self.steps = np.zeros(N, np.int64)
        self.ep_return = np.zeros(N)
        self.rho = np.zeros(N)
        self.trace_index = np.zeros(N, np.int64)
        self.window_start = np.zeros(N, np.int64)
        # episode metrics and record columns, written by the engine threads as episodes end
        # (``episode_metrics``); ``has_records``: the copy has finished an episode
        from ..metrics import pct_index
        self.ep_counts = np.zeros((N, len(EPISODE_COUNTS)), np.int64)
        self.ep_pcts = np.zeros((N, 3))
        # two slots per copy: the last episode reported (``ep_slot``) and one being written, so that a
        # step that raises after the threads wrote (a layout's error) leaves the reported one
        self.ep_snap = np.zeros((N, 2, len(RECORD_FIELDS), cfg.window), np.int64)
        self.ep_slot = np.zeros(N, np.int64)
        self.ep_pct_index = (pct_index(cfg.window, 50), pct_index(cfg.window, 99))
        self.has_records = np.zeros(N, bool)
        self.params_theta = np.tile(self.theta_star, (N, 1))
        self.params_margin = np.full(N, -1.0 if margin is None else margin)

    # -------------------------------------------------------------- actions
    @property
    def action_dim(self) -> int:
        return len(self.action_names)

    def map_actions(self, a: np.ndarray):
        """[n, A] actions -> (theta, shed margin)."""
        return map_actions(a, self.config.action_mode, self.theta_star, self.base_margin, self.config.shed_action)

    def map_guard(self, a: np.ndarray):
        """[n, A] actions -> v1's (u, B_min) (None in v0)."""
        return None if self.base_guard is None else map_guard_actions(a, self.config.action_mode, self.base_guard)

    # -------------------------------------------------------------- episodes
    def seed_copies(self, rows: Sequence[int], seeds: Sequence[Optional[int]]) -> None:
        """Seed each copy of ``rows`` with its seed (None: keep the copy's generator); the seeds are
        checked by the caller (``TokenBatchVectorEnv.reset``), every one before any copy is seeded."""
        for c, s in zip(rows, seeds):
            if s is not None:
                self.rngs[c] = np.random.default_rng(int(s))
                if self._prep is not None:   # its prepared episode came from the old generator
                    self._ready[c] = False
                    self._prep_error.pop(int(c), None)

    def _draw(self, rows: np.ndarray) -> tuple:
        """Each copy's next episode (suite trace, window start, rho and its exact time factor), drawn
        from the copy's own generator, as (copies drawn, units, starts, rhos, factors). A copy whose
        scaled trace is out of range raises its error here, or, preparing ahead, is left out with
        the error kept for its reset (``_prep_error``)."""
        cfg, wl = self.config, self.workload
        units, starts, rhos, factors, kept = [], [], [], [], []
        for c in rows.tolist():
            rng = self.rngs[c]
            u = self.units[int(rng.integers(len(self.units)))]
            n = len(wl.units[u])
            start = int(rng.integers(cfg.warmup, n - cfg.cooldown - cfg.window + 1))
            lo, hi = cfg.rho
            rho = float(lo if lo == hi else rng.uniform(lo, hi))
            f = wl.scale_factor(rho)
            try:
                if not wl.scaled_in_range(u, f):   # (itself raises for factors beyond int64)
                    wl.window_at(u, rho, start, cfg.window, cfg.warmup, cfg.cooldown)   # raises its error
            except (ConfigError, TraceError) as e:   # (the trace's range checks raise TraceError)
                if self._prep is None:
                    raise
                self._prep_error[c] = e   # raised when the copy is reset, as without preparation
                continue
            units.append(u)
            starts.append(start)
            rhos.append(rho)
            factors.append(f)
            kept.append(c)
        return (np.array(kept, np.int64), np.array(units, np.int64), np.array(starts, np.int64),
                np.array(rhos, np.float64), factors)

    def prepare_ahead(self, limit: int) -> None:
        """(SAME_STEP) Draw and cut the next episodes of up to ``limit`` copies that have none ready:
        the expensive half of a reset, done while the engine runs (``step``'s ``meanwhile``) rather
        than after it. A copy's generator serves only its episodes, in order, so drawing one episode
        ahead gives the same episodes (a new seed discards it)."""
        todo = np.flatnonzero(~self._ready)
        if self._prep_error:
            todo = todo[~np.isin(todo, list(self._prep_error))]
        self._prepare(todo[:limit])

    def _prepare(self, rows: np.ndarray) -> None:
        """``_draw`` and ``columns`` of these copies' next episodes into ``_prep`` (one row per copy)."""
        if rows.size == 0:
            return
        rows, units, starts, rhos, factors = self._draw(rows)
        if rows.size == 0:
            return
        cfg = self.config
        cols, t2, h_best = self.episodes.columns(units, starts - cfg.warmup, cfg.n_req, factors)
        P = self._prep
        if not P:   # allocated on first use (chain_val as wide as any window's)
            for k, v in cols.items():
                width = self.run.arrays.chain_val.shape[1:] if k == "chain_val" else v.shape[1:]
                P[k] = np.zeros((self.n, *width), v.dtype)
            P.update(t2=np.zeros_like(self.t2), h_best=np.zeros_like(self.h_best), unit=np.zeros(self.n, np.int64),
                     start=np.zeros(self.n, np.int64), rho=np.zeros(self.n))
        for k, v in cols.items():
            if k == "chain_val":
                P[k][rows, :v.shape[1]] = v   # (lay_out copies each row's entries, not the zeros past them)
            else:
                P[k][rows] = v
        P["t2"][rows], P["h_best"][rows] = t2, h_best
        P["unit"][rows], P["start"][rows], P["rho"][rows] = units, starts, rhos
        self._ready[rows] = True

    def _take_prepared(self, rows: np.ndarray) -> tuple:
        """What ``_draw`` and ``columns`` would give for these copies' next episodes, from ``_prep``
        (prepared now where not ready): (units, starts, rhos, columns, t2, h_best), the columns
        those of ``_prep`` itself, its rows ``rows``."""
        def raise_kept():
            for c in rows.tolist():
                if c in self._prep_error:
                    raise self._prep_error.pop(c)
        raise_kept()
        self._prepare(rows[~self._ready[rows]])
        raise_kept()
        P = self._prep
        self._ready[rows] = False
        return P["unit"][rows], P["start"][rows], P["rho"][rows], P, P["t2"][rows], P["h_best"][rows]

    def reset_copies(self, rows: np.ndarray) -> None:
        """Draw a new episode (trace, window, rho) for each copy in ``rows`` and lay it out."""
        cfg = self.config
        rows = np.asarray(rows, np.int64)
        if rows.size == 0:
            return
        if self._prep is not None:
            units, starts, rhos, cols, t2, h_best = self._take_prepared(rows)
            src = rows
        else:
            _, units, starts, rhos, factors = self._draw(rows)
            cols, t2, h_best = self.episodes.columns(units, starts - cfg.warmup, cfg.n_req, factors)
            src = np.arange(rows.size)
        self.rho[rows], self.trace_index[rows], self.window_start[rows] = rhos, units, starts
        self.t2[rows], self.h_best[rows] = t2, h_best
        self.run.arrays = lay_out(self.run.arrays, self.fresh, rows, cols, src, self.cv_extent)
        self.run.tier[rows] = 0
        self.run.score[rows] = 0.0
        self.run.start_epochs(rows, interval_ns=self.dt_ns, scored=(self.s0, self.s1),
                              shed_on=self.base_margin is not None)
        self.certain[rows] = False
        self.met_seen[rows] = False
        self.open_lo[rows] = 0
        self.steps[rows] = 0
        self.ep_return[rows] = 0.0
        mask = np.zeros(self.n, bool)
        mask[rows] = True
        self.observe(mask)

    def observe(self, mask: np.ndarray) -> None:
        self.run.map_groups(lambda g: observe(self.run, g, self.obs, self.k, self.ocfg, self.tpot), mask,
                            min_group=_MIN_GROUP)

    def step(self, live: np.ndarray, theta: np.ndarray, margin: np.ndarray, reset_rows=None, guard=None):
        """Apply the (held) parameters of the ``live`` copies and advance each to its next decision
        epoch (skipping epochs that need no decision) or the end of its episode; the engine threads
        observe and reward the copies as they advance them (``advance_observe``: a batch of copies
        at a time, in one pass over the threads). ``reset_rows`` (copies not live): new episodes
        laid out meanwhile by an engine thread before it joins the others (``reset_copies``, serial
        Python, so the other cores advance the live copies in the meantime; every write is to those
        rows alone). ``guard`` (v1): the live copies' (u, B_min), held like the parameters."""
        run = self.run
        self.params_theta[live] = theta
        self.params_margin[live] = margin
        run.set_policy_params(self.params_theta, self.params_margin)
        if guard is not None:
            run.set_guard(live, *guard)
        reward = np.zeros(self.n)
        trunc = np.zeros(self.n, bool)
        # (whole: a column view's layout would differ for one copy, and compile twice, ~1 min)
        epoch = run.arrays.epoch   # EP_STOP: read once each copy has stopped
        rew_args, met_args = self._reward_args(reward), self._metric_args()

        def kernel(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, active, max_steps, until_ns, claim, mine):
            chunk, priv, stopped = np.zeros_like(active), np.zeros(1, np.int64), np.zeros_like(active)
            kargs = K.kernel_args(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, chunk, max_steps,
                                  until_ns, claim=priv, mine=mine)
            total = advance_observe(kargs, active, claim, chunk, priv, stopped, epoch, self.config.max_steps,
                                     self.steps, trunc, observe_args(run, self.obs, self.k, self.ocfg, self.tpot),
                                     rew_args, met_args)
            return K.checked_total(total, kargs)

        def after(ran):   # the same work for copies advanced otherwise (the tests' reference epochs)
            _after_stop(0, self.n, ran.copy(), np.zeros_like(ran), epoch, self.config.max_steps, self.steps,
                        trunc, observe_args(run, self.obs, self.k, self.ocfg, self.tpot), rew_args, met_args)
        kernel.after = after

        meanwhile = None
        if reset_rows is not None and len(reset_rows):   # NEXT_STEP
            assert not live[reset_rows].any()

            def meanwhile():
                arrays = run.arrays
                self.reset_copies(reset_rows)
                # the hash widths are sized for any window at construction, so a reset never
                # replaces the arrays the engine threads are writing
                assert run.arrays is arrays
            if np.count_nonzero(live) < _OVERLAP_LIVE_PER_RESET * len(reset_rows):
                # too little engine work to hide the layout (serial Python, holding the GIL that an
                # engine thread done early would wait for): lay out first, as without threads
                meanwhile()
                meanwhile = None
        elif self._prep is not None:   # SAME_STEP (whose resets follow the engine call)
            # the next episodes of the copies reset lately, drawn and cut while the engine runs (as
            # many as the live copies can hide; the rest when they are reset)
            n_live = int(np.count_nonzero(live))
            limit = n_live // _OVERLAP_LIVE_PER_RESET if _OVERLAP_LIVE_PER_RESET > 0 else n_live
            if limit and not self._ready.all():
                meanwhile = lambda: self.prepare_ahead(limit)   # noqa: E731
        stop = run.advance_to_decision(live, meanwhile=meanwhile, kernel=kernel)
        term = live & (stop == K.STOP_ENDED)
        self.ep_return[live] += reward[live]
        return reward, term, trunc

    def _reward_args(self, out: np.ndarray) -> tuple:
        """``rewards_kernel``'s arguments after its mask and ``trunc``, the rewards into ``out``."""
        A = self.run.arrays
        return (self.s0, self.s1, self.t_min_ns, REGISTRY[self.config.reward_mode].count_met, A.now, A.end_state,
                A.first_token, A.finish, A.arrival, A.t1, self.t2, A.out_len, A.gen, A.capped, self.certain,
                self.met_seen, out, A.prompt, A.computed, A.n_preempt, self.h_best, self.ps_cost,
                self.run.profile.max_num_batched_tokens, self.open_lo)

    def _metric_args(self) -> tuple:
        """``episode_metrics``'s arguments after its mask, ``epoch`` and ``trunc``."""
        A = self.run.arrays
        return (self.s0, self.s1, *self.ep_pct_index, self.ep_counts, self.ep_pcts, self.ep_snap, self.ep_slot,
                *(getattr(A, f) for f in RECORD_FIELDS[:-1]), self.t2)

    def episode_infos(self, ended: np.ndarray, trunc: np.ndarray) -> dict:
        """Episode metrics of the copies ``ended`` (their scored requests), one array per key over
        them: the evaluator's definitions, computed by the engine threads as the episodes ended
        (``episode_metrics``), and the episode's return, length, load and simulated time."""
        A = self.run.arrays
        counts, pcts = self.ep_counts[ended], self.ep_pcts[ended]
        self.has_records[ended] = True
        self.ep_slot[ended] ^= 1   # their records, written in the other slot, are now the reported ones
        info = {f"episode_{k}": counts[:, i] for i, k in enumerate(EPISODE_COUNTS)}
        return {
            "episode_goodput": counts[:, 0] / (self.s1 - self.s0), **info,
            "episode_ttft_p50_ms": pcts[:, 0], "episode_ttft_p99_ms": pcts[:, 1], "episode_tpot_p99_ms": pcts[:, 2],
            "episode_return": self.ep_return[ended].astype(np.float64), "episode_length": self.steps[ended].copy(),
            "episode_rho": self.rho[ended].copy(), "episode_truncated": trunc[ended].astype(bool),
            "episode_sim_s": (A.now[ended] - A.epoch[ended, K.EP_T0]).astype(np.float64) / 1e9,
        }

    def episode_records(self, c: int) -> Optional[dict]:
        """The records (``simulate.record_rows``) of copy c's last finished episode's scored requests,
        from the columns kept at its end; a request that never ended is unfinished."""
        from types import SimpleNamespace

        from ..engine.simulate import record_rows
        if not self.has_records[c]:
            return None
        s0, s1 = self.s0, self.s1
        cols = {}
        for f, v in zip(RECORD_FIELDS, self.ep_snap[c, self.ep_slot[c]]):
            cols[f] = np.zeros((1, s1), np.int64)
            cols[f][0, s0:] = v
        rec = record_rows(SimpleNamespace(**cols), np.zeros(1, np.int64), s0, s1, cols["t1"][:, s0:],
                          cols["t2"][:, s0:])
        rec = {k: v[0] for k, v in rec.items()}
        es = rec["end_state"]
        es[es == K.E_NONE] = K.E_UNFINISHED
        return rec

    def reset_infos(self, rows: np.ndarray) -> dict:
        return {"rho": self.rho[rows].astype(np.float64), "trace_index": self.trace_index[rows].astype(np.int64),
                "window_start": self.window_start[rows].astype(np.int64)}


def guard_base(cfg: TokenBatchConfig, params, margin) -> tuple:
    """v1's base (docs/design.md section 11): the index's parameters and shed margin tuned with the
    rule (a ``base_params`` file's ``"tpot-guard"`` part; what it leaves out: ``params``, ``margin``,
    as the evaluator's +tpot-guard row) and (u*,
    B_min*), the row's tuned levers (``"<mode>+shed+tpot-guard"``), else (0, 1): the rule never
    lowers the budget, so that a = 0 runs the base policy as v0 does."""
    from ..engine.levers import GUARD_SUFFIX
    from ..params import load_guard_params, load_levers
    u, bmin = 0.0, 1.0
    if cfg.base_params is not None:
        tuned = load_guard_params(cfg.base_params, "base_params")   # (what it leaves out: the row's own)
        if tuned is not None and cfg.action_mode == "index":
            if tuned[0] is not None:
                params = tuned[0]
            m = dict(tuned[1]).get("index", margin)
            margin = None if m is None or math.isinf(m) else float(m)
        lv = dict(dict(load_levers(cfg.base_params, "base_params")).get(f"{cfg.action_mode}+shed{GUARD_SUFFIX}", ()))
        u, bmin = lv.get("budget_u", u), lv.get("budget_bmin", bmin)
    return params, margin, (float(u), float(bmin))


# (last: every compiled function of this module is defined) ``advance_observe`` links the engine's
# kernel and this package's observation, reward and episode-metric kernels (whose own modules guard
# them the same way): flush its cached machine code when any of their sources changes.
guard_stale_cache([advance_observe, _after_stop], tag="envs.core",
                  extra_sources=[bounds.__file__, observation.__file__, rewards.__file__, episodes.__file__])
