"""The Gymnasium environments: ``TokenBatchVectorEnv`` (N engine copies stepped as one batch) and
``TokenBatchEnv`` (the vector env with one copy). docs/design.md section 5 is the MDP; the class
docstring of ``TokenBatchEnv`` states it in Gymnasium's sections.

There is one implementation of the dynamics: ``_Core`` drives one ``engine.simulate.EngineRun``
over all copies, and the engine itself runs each copy to its next decision epoch
(``EngineRun.advance_to_decision``); the copies that start new episodes get their windows laid out
together from the suite's units stacked as arrays (``_EpisodeTable``: exactly the engine's own
``build_arrays`` of those windows) and spliced into the batch; episode metrics are computed for all
the copies that ended at once. Workload preparation (suite traces,
lambda_sat, the residual-life table, T_ref, the predictor and its estimates, time scaling to rho)
is the evaluator's ``prepare_workload`` / ``Workload``, so agents and baselines see the same
windows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence, Union

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from .engine import kernel as K
from .engine import scoring as S
from .bounds import min_prefill_exceeds
from .engine._jit import borrow, fetch_add, njit, prefetch
from .engine.outcomes import request_outcome
from .engine.state import capped_outputs, unique_block_bases, window_prefix_ids
from .errors import ConfigError, TokenBatchError, TraceError

__all__ = ["TokenBatchConfig", "TokenBatchEnv", "TokenBatchVectorEnv", "ActionError", "OBS_LAYOUT",
           "ACTION_NAMES", "WEIGHT_ACTION_NAMES", "make_vector_env"]


class ActionError(TokenBatchError, ValueError):
    """An action is malformed, NaN/inf, or outside [-1, 1] (without ``clip_actions``)."""


ACTION_MODES = ("index", "weights")
REWARD_MODES = ("certain_miss", "met")
#: index-mode action dimensions, in order: the seven index coefficients, then the shed margin
ACTION_NAMES = ("kappa", "slope", "gamma", "theta", "beta", "w_prefix", "a_edf", "shed_margin")
#: action dimensions of the ``weights`` mode: one weight per linear-score feature, then the shed margin
WEIGHT_ACTION_NAMES = tuple(f"w_{f}" for f in S.LINEAR_FEATURES) + ("shed_margin",)
_THETA_COL = {"kappa": S.I_KAPPA, "slope": S.I_SLOPE, "gamma": S.I_GAMMA, "theta": S.I_THETA,
              "beta": S.I_BETA, "w_prefix": S.I_W_PREFIX, "a_edf": S.I_A_EDF}

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


def obs_layout(k: int) -> list:
    """Names of the observation entries, in order (see ``TokenBatchEnv``'s docstring)."""
    names = ["kv_free_frac", "running_frac", "log_queue_len", "log_queued_tokens", "arrival_rate_rho",
             "budget_demand"]
    names += [f"z_q{int(q * 100)}" for q in QUANTILES] + [f"log_s_q{int(q * 100)}" for q in QUANTILES]
    names += ["queue_empty", "queue_lost_frac"]
    for j in range(k):
        names += [f"req{j}_{f}" for f in REQ_FEATURES]
    names += [f"req{j}_valid" for j in range(k)]
    return names


OBS_LAYOUT = obs_layout(8)
#: entries before the K request rows: engine state and queue summary
N_GLOBAL = N_ENGINE + 2 * NQ + 2


def obs_dim(k: int) -> int:
    """Length of the observation with K observed requests (``len(obs_layout(k))``)."""
    return N_GLOBAL + k * (F + 1)


# ------------------------------------------------------------------ config
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def autoreset_mode_of(value) -> AutoresetMode:
    """``value`` as a ``gymnasium.vector.AutoresetMode`` (the member, or its name or value in any
    case, ``-`` for ``_``), else ``ConfigError``."""
    am = value
    if isinstance(am, str):
        by_name = {m.name.lower(): m for m in AutoresetMode} | {m.value.lower(): m for m in AutoresetMode}
        am = by_name.get(am.lower().replace("-", "_"), am)
    if not isinstance(am, AutoresetMode):
        raise ConfigError(f"autoreset_mode: must be one of {[m.name for m in AutoresetMode]} "
                          f"(gymnasium.vector.AutoresetMode), got {value!r}")
    return am


#: bounds of the counts and the decision interval (the engine's clocks and counters are int64)
_MAX_COUNT = 2 ** 62
_MAX_INTERVAL_MS = 1e9


@dataclasses.dataclass(frozen=True)
class TokenBatchConfig:
    """Everything that defines a TokenBatch-v0 environment (validated; ConfigError names the field).

    ``rho``: a number or ``(low, high)``; each episode draws rho uniformly from it.
    ``predictor``: None = the suite's; else a kind (``"oracle"``, ``"noisy"``, ``"prior"``) or a dict
    ``{kind, sigma, seed}``. ``base_params``: a tuned-parameters JSON (the evaluator's ``--params``
    format) giving theta*; else ``IndexParams()`` defaults and ``shed_margin``. ``shed_margin``:
    the base shed margin when the JSON gives none (None or inf = no shedding; the shed action
    dimension is then ignored). ``shed_action``: False drops the shed-margin dimension from the
    action, which then stays at the base margin. ``max_steps``: decision-step cap per episode (truncation);
    ``max_iterations``: engine iteration cap per episode (truncation)."""

    suite: str = "seed-200"
    split: str = "train"
    profile: str = "stress-512"
    rho: Any = (0.8, 1.5)
    window: int = 128
    warmup: int = 32
    cooldown: int = 32
    decision_interval_ms: float = 100.0
    k: int = 8
    action_mode: str = "index"
    predictor: Any = None
    reward_mode: str = "certain_miss"
    autoreset_mode: Any = AutoresetMode.NEXT_STEP
    seed: Optional[int] = None
    base_params: Optional[str] = None
    shed_margin: Optional[float] = 0.0
    clip_actions: bool = False
    shed_action: bool = True
    max_steps: int = 20_000
    max_iterations: int = 2_000_000

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for f in ("suite", "split", "profile"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ConfigError(f"{f}: must be a non-empty string, got {getattr(self, f)!r}")
        rho = self.rho
        if _is_num(rho):
            rho = (rho, rho)
        if not (isinstance(rho, (tuple, list)) and len(rho) == 2 and all(_is_num(x) for x in rho)):
            raise ConfigError(f"rho: must be a positive number or a (low, high) pair, got {self.rho!r}")
        lo, hi = float(rho[0]), float(rho[1])
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
            raise ConfigError(f"rho: need 0 < low <= high (finite), got {self.rho!r}")
        set_("rho", (lo, hi))
        for f, low in (("window", 1), ("warmup", 0), ("cooldown", 0), ("k", 1), ("max_steps", 1),
                       ("max_iterations", 1)):
            v = getattr(self, f)
            if not _is_int(v) or v < low:
                raise ConfigError(f"{f}: must be an integer >= {low}, got {v!r}")
            if v > _MAX_COUNT:   # (the engine counts in int64)
                raise ConfigError(f"{f}: must be at most 2**62, got {v!r}")
            set_(f, int(v))
        d = self.decision_interval_ms
        if (not _is_num(d) or not math.isfinite(float(d)) or float(d) <= 0 or float(d) * 1e6 < 1
                or float(d) > _MAX_INTERVAL_MS):
            raise ConfigError(f"decision_interval_ms: must be a finite number in [1e-6, {_MAX_INTERVAL_MS:g}] "
                              f"(ms), got {d!r}")
        set_("decision_interval_ms", float(d))
        if self.action_mode not in ACTION_MODES:
            raise ConfigError(f"action_mode: must be one of {ACTION_MODES}, got {self.action_mode!r}")
        if self.reward_mode not in REWARD_MODES:
            raise ConfigError(f"reward_mode: must be one of {REWARD_MODES}, got {self.reward_mode!r}")
        set_("autoreset_mode", autoreset_mode_of(self.autoreset_mode))
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ConfigError(f"seed: must be None or an integer >= 0, got {self.seed!r}")
        if self.base_params is not None and not isinstance(self.base_params, str):
            raise ConfigError(f"base_params: must be None or a path to a parameters JSON, got {self.base_params!r}")
        m = self.shed_margin
        if m is not None:
            if not _is_num(m) or math.isnan(float(m)) or not (0 <= float(m) <= 2 or float(m) == math.inf):
                raise ConfigError(f"shed_margin: must be None, inf or a number in [0, 2], got {m!r}")
            set_("shed_margin", None if math.isinf(float(m)) else float(m))
        for f in ("clip_actions", "shed_action"):
            if not isinstance(getattr(self, f), (bool, np.bool_)):
                raise ConfigError(f"{f}: must be a bool, got {getattr(self, f)!r}")
            set_(f, bool(getattr(self, f)))
        if self.predictor is not None:
            from .predictors import KINDS, PredictorSpec
            if not isinstance(self.predictor, (str, dict, PredictorSpec)):
                raise ConfigError(f"predictor: must be None, a kind ({', '.join(KINDS)}) or a dict with kind, "
                                  f"sigma and seed, got {self.predictor!r}")
            try:
                set_("predictor", PredictorSpec.from_dict(self.predictor))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"predictor: {e}") from None

    @property
    def n_req(self) -> int:
        return self.warmup + self.window + self.cooldown

    @property
    def action_names(self) -> tuple:
        names = ACTION_NAMES if self.action_mode == "index" else WEIGHT_ACTION_NAMES
        return names if self.shed_action else names[:-1]


# ------------------------------------------------------------------ observation kernel
_N_REQ_FEATS = 10  # features per observed request (``_observe``)
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
def _observe(active, kq, mrl, cfg, fcfg, ocfg, out, now, n_wait, n_run, n_free, next_arr, wait_ids, run_ids,
             prompt, gen, computed, arrival, t1, est, hash_head, chain_off, chain_val, uniq_base, epoch,
             zs_buf, ls_buf, zsort, lsort, order, feats, lo):
    """Observation rows of the ``active`` copies (see ``TokenBatchEnv``). The per-request entries are
    the engine's own index inputs (``kernel.request_inputs``); ``cfg``/``fcfg`` are the engine's,
    ``ocfg`` = [t_ref_ms, lambda_sat, rate_window_ns]; the episode start is ``epoch[c, EP_T0]``.
    The last six are scratch (``observe`` allocates them, so that they are borrowed too); copies
    below ``lo`` are not looked at."""
    # borrowed views (``engine._jit.borrow``): no reference counting per helper call
    zs_buf = borrow(zs_buf)
    ls_buf = borrow(ls_buf)
    zsort = borrow(zsort)
    lsort = borrow(lsort)
    order = borrow(order)
    feats = borrow(feats)
    active = borrow(active)
    mrl = borrow(mrl)
    cfg = borrow(cfg)
    fcfg = borrow(fcfg)
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
    bs = cfg[K.C_BS]
    bsh = K._block_shift(bs)
    budget = cfg[K.C_BUDGET]
    usable = float(cfg[K.C_USABLE])
    max_seqs = float(cfg[K.C_MAX_SEQS])
    prefix_on = cfg[K.C_PREFIX] != 0
    ps = cfg[K.C_PS0:K.C_PS0 + 4]
    u_p = fcfg[K.F_U_P]
    u_d = fcfg[K.F_U_D]
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
                hits = K._prefix_hits(hash_head, chain_off, chain_val, uniq_base, c, r, prompt[c, r] + gen[c, r], bs,
                                      bsh)
            cached, p_left, blocks, first_out, to_deadline, slack, d_left, s_ms = K.request_inputs(
                True, hits, prompt[c, r], gen[c, r], 0, 0, arrival[c, r] + t1[c, r] - t_now, est[c, r], mrl, bs,
                budget, ps, u_p, u_d, bsh)
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
        for f in range(row.shape[0]):
            v = row[f]
            if v != v:
                row[f] = 0.0
            elif v > 10.0:
                row[f] = 10.0
            elif v < -10.0:
                row[f] = -10.0


@njit
def _rewards(live, trunc, s0, s1, t_min, count_met, now, end_state, first_token, finish, arrival, t1, t2,
             out_len, gen, capped, certain, met_seen, out, prompt, computed, n_preempt, h_best, ps, budget,
             open_lo, lo):
    """Step rewards of the ``live`` copies (see ``TokenBatchEnv``, "Rewards"): scored requests [s0, s1)
    whose miss became certain (or, ``count_met``, that were met) since the last step; ``certain`` and
    ``met_seen`` ([N, s1 - s0]) remember what was counted. A request whose miss is certain, or that
    ended, is settled (nothing it does can count again): ``open_lo[c]`` skips the settled prefix, the
    scan passes over the settled requests behind an open one, and it stops at the first request not
    yet arrived (nothing about it can count before truncation). Copies below ``lo`` are not looked at."""
    # borrowed views (``engine._jit.borrow``): no reference counting per helper call
    live = borrow(live)
    trunc = borrow(trunc)
    now = borrow(now)
    end_state = borrow(end_state)
    first_token = borrow(first_token)
    finish = borrow(finish)
    arrival = borrow(arrival)
    t1 = borrow(t1)
    t2 = borrow(t2)
    out_len = borrow(out_len)
    gen = borrow(gen)
    capped = borrow(capped)
    certain = borrow(certain)
    met_seen = borrow(met_seen)
    out = borrow(out)
    prompt = borrow(prompt)
    computed = borrow(computed)
    n_preempt = borrow(n_preempt)
    h_best = borrow(h_best)
    ps = borrow(ps)
    open_lo = borrow(open_lo)
    n_copies = live.shape[0]
    c_next = 0
    for c in range(lo, n_copies):
        if not live[c]:
            continue
        if c_next <= c:   # prefetch the next copy's scored rows still open
            c_next = K.next_active(live, c)
            if c_next < n_copies and s0 + open_lo[c_next] < s1:
                lo = s0 + open_lo[c_next]
                hi = lo + 32 if lo + 32 < s1 else s1
                for j in range(lo, hi, 8):
                    prefetch(arrival, c_next, j)
                    prefetch(first_token, c_next, j)
                    prefetch(out_len, c_next, j)
                    prefetch(t1, c_next, j)
                    prefetch(t2, c_next, j)
                    prefetch(finish, c_next, j)
                    prefetch(gen, c_next, j)
                    prefetch(prompt, c_next, j)
                    prefetch(computed, c_next, j)
                    prefetch(n_preempt, c_next, j)
                    prefetch(h_best, c_next, j)
                prefetch(end_state, c_next, lo)
                prefetch(capped, c_next, lo)
                prefetch(certain, c_next, lo - s0)
                prefetch(met_seen, c_next, lo - s0)
        t = now[c]
        n = 0
        settled = True   # every request before j is settled
        for j in range(s0 + open_lo[c], s1):
            arr = arrival[c, j]
            if arr > t and not trunc[c]:
                break
            k = j - s0
            if certain[c, k] or met_seen[c, k]:
                # settled (a certain miss can never be met; a met request has ended): skipped, as the
                # scan would find nothing new (it stays behind an open request until that settles)
                if settled:
                    open_lo[c] = k + 1
                continue
            # (from here on the request is unmarked: neither certain nor met_seen)
            es = end_state[c, j]
            ft = first_token[c, j]
            o = out_len[c, j]
            ended = es != K.E_NONE
            met = (es == K.E_COMPLETED and ft - arr <= t1[c, j]
                   and (o <= 1 or finish[c, j] - ft <= t2[c, j] * (o - 1 if o > 1 else 1)))
            ttft_lost = ft < 0 and arr <= t and t > arr + t1[c, j]
            if ft < 0 and arr <= t and not ended and not ttft_lost:
                # TTFT unreachable: even an idle engine, with every cacheable prefix block cached,
                # could not emit the first token by arrival + T1 (the analogue of tpot_lost)
                n_tok = prompt[c, j]
                h = h_best[c, j] if h_best[c, j] > computed[c, j] else computed[c, j]
                if n_preempt[c, j] > 0:   # it may re-hit its own cached blocks: all but one token
                    h = n_tok - 1
                if h > n_tok - 1:
                    h = n_tok - 1
                if h < 0:
                    h = 0
                ttft_lost = min_prefill_exceeds(n_tok, h, ps[0], ps[1], ps[2], ps[3], budget, arr + t1[c, j] - t)
            tpot_lost = (ft >= 0 and not ended and o > 1
                         and t + (o - gen[c, j]) * t_min - ft > t2[c, j] * (o - 1))
            lost = ((ended and not met) or ttft_lost or tpot_lost or (capped[c, j] and arr <= t)
                    or (trunc[c] and not ended))
            if count_met:
                if met:
                    n += 1
            elif lost:
                n -= 1
            certain[c, k] = lost
            met_seen[c, k] = met
            if settled:
                if ended or lost:
                    open_lo[c] = k + 1
                else:
                    settled = False
        out[c] = n


#: the engine columns of a copy's scored requests kept at its episode end (for ``episode_records``:
#: ``simulate.record_rows`` reads these, and the SLOs); ``t2`` last (the env's, not the engine's)
_RECORD_FIELDS = ("arrival", "prompt", "out_len", "first_sched", "first_token", "first_token_it", "finish",
                  "finish_it", "n_preempt", "recomputed", "swapped", "end_state", "t1", "t2")
#: ``_episode_metrics``'s counts, in its column order
_EPISODE_COUNTS = ("met", "completed", "shed", "timed_out", "rejected", "unfinished", "preemptions")


@njit
def _episode_metrics(rows, epoch, trunc, s0, s1, i_p50, i_p99, counts, pcts, snap, slot, arrival, prompt, out_len,
                     first_sched, first_token, first_token_it, finish, finish_it, n_preempt, recomputed, swapped,
                     end_state, t1, t2, lo):
    """Episode metrics of the copies in the mask ``rows`` whose episode ended (``epoch``'s EP_STOP STOP_ENDED, or
    ``trunc``), over their scored requests [s0, s1), as the evaluator defines them (``request_outcome``;
    ``request_outcomes``'s columns: TTFT in ms, +inf without a first token; TPOT in ms, +inf unless
    completed; an unended request counts as unfinished; ``pcts``'s inverted-CDF rule, its indices
    ``i_p50``/``i_p99`` for s1 - s0 values given): ``counts[c]`` (``_EPISODE_COUNTS``), ``pcts[c]`` = TTFT
    p50, p99, TPOT p99; ``snap[c, 1 - slot[c]]`` keeps the ``_RECORD_FIELDS`` columns for the copy's records
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


#: copies an engine thread claims at a time in ``_advance_observe`` (then observes and rewards them)
_CHUNK = 32


@njit
def _advance_observe(kargs, act, claim, chunk, priv, stopped, epoch, max_ep_steps, steps, trunc, obs_args,
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
        t = K._run_copies(*kargs)
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
    episode metrics (``obs_args``/``rew_args``/``met_args``: the arguments of ``_observe``/``_rewards``/
    ``_episode_metrics`` after their masks). ``stopped``: scratch, all False."""
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
        _observe(m, *obs_args, lo)
        _rewards(m, trunc, *rew_args, lo)
        if any_end:
            _episode_metrics(m, epoch, trunc, *met_args, lo)
        for c in range(lo, hi):
            stopped[c] = False


def _guard_stale_cache() -> None:
    """``_observe`` links engine code (``request_inputs``), ``_episode_metrics`` the outcome definition
    (``engine.outcomes``), ``_lay_out_rows`` the engine's arrays: flush this module's cached machine
    code when any engine source changes (the engine's own guard, one implementation)."""
    from .engine._jit import guard_stale_cache

    from . import bounds
    guard_stale_cache([_lt, _sort_small, _argsort_stable, _observe, _rewards, _episode_metrics, _after_stop,
                       _advance_observe, _lay_out_rows, _window_columns],
                      tag="envs", extra_sources=[bounds.__file__])



# ------------------------------------------------------------------ shared with the evaluator
def obs_scales(t_ref_ms: float, lambda_sat: float) -> np.ndarray:
    """The observation's normalisation constants beyond the engine's (``observe``'s ``ocfg``)."""
    return np.array([t_ref_ms, lambda_sat, RATE_WINDOW_S * 1e9])


def observe(run, mask, obs, k: int, ocfg) -> None:
    """Observation rows of the ``mask`` copies of an ``EngineRun`` (episode start: ``start_epochs``)."""
    _observe(mask, *_observe_args(run, obs, k, ocfg), 0)


def _observe_args(run, obs, k: int, ocfg) -> tuple:
    """``_observe``'s arguments after its mask (with fresh scratch: one set per thread)."""
    A = run.arrays
    return (k, run.mrl, run.cfg, run.fcfg, ocfg, obs, A.now, A.n_wait, A.n_run, A.n_free, A.next_arr, A.wait_ids,
            A.run_ids, A.prompt, A.gen, A.computed, A.arrival, A.t1, A.est, A.hash_head, A.chain_off, A.chain_val,
            A.uniq_base, A.epoch, *_observe_scratch(A.wait_ids.shape[1]))


def _observe_scratch(R: int):
    """``_observe``'s scratch for queues of up to R requests (z, ln S and their sorted copies, an
    order, the per-request features)."""
    return (np.empty(R), np.empty(R), np.empty(R), np.empty(R), np.empty(R, np.int64),
            np.empty((R, _N_REQ_FEATS)))


class _IndexPlan(NamedTuple):
    """The ``index`` mode's mapping by parameter (in action order): theta columns, bounds; the
    linear ones with their spans, the log and log1p ones with their log factors. Read-only."""

    cols: np.ndarray
    lin: np.ndarray
    span: np.ndarray
    logs: tuple
    log1ps: tuple
    lo: np.ndarray
    hi: np.ndarray


@functools.lru_cache(maxsize=None)
def _index_plan() -> _IndexPlan:
    from .policies import INDEX_RANGES
    names = ACTION_NAMES[:-1]
    ranges = [INDEX_RANGES[n] for n in names]
    unknown = [n for n, (_, _, sc) in zip(names, ranges) if sc not in ("linear", "log", "log1p")]
    if unknown:
        raise ValueError(f"index ranges of unknown scale: {unknown}")
    lin = [j for j, (_, _, sc) in enumerate(ranges) if sc == "linear"]
    plan = _IndexPlan(
        cols=np.array([_THETA_COL[n] for n in names]), lin=np.array(lin),
        span=np.array([ranges[j][1] - ranges[j][0] for j in lin]),
        logs=tuple((j, math.log(hi / lo)) for j, (lo, hi, sc) in enumerate(ranges) if sc == "log"),
        log1ps=tuple((j, math.log1p(hi)) for j, (lo, hi, sc) in enumerate(ranges) if sc == "log1p"),
        lo=np.array([r[0] for r in ranges]), hi=np.array([r[1] for r in ranges]))
    for v in plan:
        if isinstance(v, np.ndarray):
            v.setflags(write=False)
    return plan


def map_actions(a: np.ndarray, mode: str, theta_star: np.ndarray, base_margin: Optional[float],
                shed_action: bool = True):
    """[n, A] actions in [-1, 1] -> (theta [n, N_THETA], shed margin [n]); a = 0 gives theta*.
    ``index``: per-parameter residuals (see ``TokenBatchEnv``); ``weights``: w = w* + a (only the
    direction w/|w| matters to the score). Margin -1 = shedding off. Without ``shed_action`` the
    actions have no last (margin) column and the margin is the base one. The parameters are
    mapped together, in a few numpy calls: at one copy (the single env) numpy's per-call cost is
    nearly the whole cost (docs/benchmarks.md)."""
    from .policies import SHED_RANGE
    a = np.asarray(a, np.float64)
    theta_star = np.asarray(theta_star)
    theta = np.tile(theta_star, (a.shape[0], 1))
    if mode == "weights":
        theta[:, :S.N_WEIGHTS] += a[:, :S.N_WEIGHTS]
    else:
        plan = _index_plan()
        cols, lin = plan.cols, plan.lin
        base = theta_star[cols]
        # Each entry as its parameter's own formula gives it, to the bit: one row per parameter
        # (the log and log1p ones pass exp/expm1 a fresh contiguous array, as column by column
        # did), the rest exact arithmetic in the same order. np.minimum/np.maximum equal np.clip
        # here but for a -0.0 inside the bounds, which needs a zero action (taken from ``base``
        # below) or a span under 1 (none is).
        xt = np.ascontiguousarray(a[:, :cols.size].T)
        v = np.empty(xt.shape)
        v[lin] = base[lin, None] + xt[lin] * plan.span[:, None]
        for j, f in plan.logs:
            v[j] = base[j] * np.exp(xt[j] * f)
        for j, f in plan.log1ps:
            v[j] = np.expm1(np.log1p(base[j]) + xt[j] * f)
        clipped = np.minimum(np.maximum(v, plan.lo[:, None]), plan.hi[:, None])
        theta[:, cols] = np.where(xt == 0.0, base[:, None], clipped).T
    x = a[:, -1] if shed_action else np.zeros(a.shape[0])
    if base_margin is None:
        return theta, np.full(x.shape[0], -1.0)
    lo, hi = SHED_RANGE
    return theta, np.where(x == 0.0, base_margin, np.minimum(np.maximum(base_margin + x * (hi - lo), lo), hi))



# ------------------------------------------------------------------ the batched core
_GROW_FILL = {"hash_head": -1, "chain_val": 0}
#: prepared workloads (suite traces, lambda_sat, residual life, estimates), shared read-only by every
#: env of a process: (suite, split, profile, engine config, predictor) -> (Workload, estimates)
_WORKLOADS: dict = {}


#: the engine fields a new episode's window sets (``_EpisodeTable.columns``); ``_lay_out_rows`` resets
#: every other field but ``table`` (never read above a request's held blocks) and ``hash_head`` (-1
#: except at the ids the copy's blocks hold: cleared there) to the fresh values of a batch as built
TRACE_FIELDS = ("n_req", "arrival", "prompt", "out_len", "prio", "capped", "t1", "est", "chain_off", "chain_val",
                "uniq_base", "now")


@njit
def _lay_out_rows(A, F, rows, src, n_req, arrival, prompt, out_len, prio, capped, t1, est, chain_off, chain_val,
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
        A.n_req[r] = n_req[s]
        A.arrival[r] = arrival[s]
        A.prompt[r] = prompt[s]
        A.out_len[r] = out_len[s]
        A.prio[r] = prio[s]
        A.capped[r] = capped[s]
        A.t1[r] = t1[s]
        A.est[r] = est[s]
        A.chain_off[r] = chain_off[s]
        own = chain_off[s, chain_off.shape[1] - 1]
        A.chain_val[r, :own] = chain_val[s, :own]
        if extent[r] > own:
            A.chain_val[r, own:extent[r]] = 0
        extent[r] = own
        A.uniq_base[r] = uniq_base[s]
        A.now[r] = now[s]


def _grow(A, widths: dict):
    """``A`` with its per-copy hash dimensions (``_GROW_FILL``) at least ``widths`` (name -> columns)
    wide, the new columns holding the fill value (the same arrays if wide enough)."""
    grown = {}
    for name, w in widths.items():
        a = getattr(A, name)
        if w > a.shape[1]:
            grown[name] = np.full((a.shape[0], w), _GROW_FILL[name], a.dtype)
            grown[name][:, :a.shape[1]] = a
    return A._replace(**grown) if grown else A


def _lay_out(A, F, rows: np.ndarray, cols: dict, src: np.ndarray, extent: np.ndarray):
    """``_lay_out_rows`` of the windows ``cols`` (``TRACE_FIELDS`` and ``ids``, each window's id space,
    as ``_EpisodeTable.columns`` gives them; their rows ``src``) into rows ``rows`` of ``A``, growing
    the per-copy hash dimensions first if these windows need more (their new columns hold the fill
    value). ``F``: the fresh values (an ``EngineArrays`` of one row); ``extent``: per copy, the
    column of chain_val from which it holds zeros (updated). Returns the arrays (new if grown)."""
    rows, src = np.asarray(rows, np.int64), np.asarray(src, np.int64)
    A = _grow(A, {"chain_val": int(cols["chain_off"][src, -1].max()), "hash_head": int(cols["ids"][src].max())})
    for name in TRACE_FIELDS:
        a, b = getattr(A, name), cols[name]
        if a.shape[1:] != b.shape[1:] and name != "chain_val":
            raise RuntimeError(f"engine array {name}: shape {b.shape[1:]} does not fit {a.shape[1:]}")
    _lay_out_rows(A, F, rows, src, *(cols[f] for f in TRACE_FIELDS), extent)
    return A


class _EpisodeTable:
    """The workload's units as stacked arrays, so that a batch of episode windows is laid out with a
    few array operations and no Trace objects: ``columns`` gives exactly ``build_arrays`` of the
    traces ``Workload.window_at`` cuts (checked field by field in tests/test_envs.py)."""

    def __init__(self, wl, estimates, profile, engine_config):
        from .bounds import best_case_hits
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
        by ``factors`` (one Fraction per window): for ``_lay_out``, the fields a trace sets
        (``TRACE_FIELDS``) and ``ids``, each window's id space (``hash_head`` width)."""
        from .traces.windows import scale_rows
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
            capped=capped, t1=t1, est=est, chain_off=off, chain_val=chain_val, uniq_base=uniq_base,
            now=arrival[:, 0].copy(), ids=ids)
        return cols, t2, h_best


@njit
def _window_columns(units, lo, n, arrival_u, prompt_u, output_u, prio_u, t1_u, t2_u, est_u, h_best_u, prefix_len_u,
                    offsets_u, n_ids, chain_ids, max_model_len, bs, prefix_caching):
    """``_EpisodeTable.columns`` before its time scaling, in one compiled pass (new episodes are laid
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


#: copies per thread below which observations outside a step (new episodes; a few us per copy) are not split
_MIN_GROUP = 128
#: live copies per new episode from which a step lays out the new episodes while the engine runs (a
#: layout costs ~10 copy-steps of engine work at the default config)
_OVERLAP_LIVE_PER_RESET = 16
#: SAME_STEP: draw and cut each copy's next episode ahead, while the engine runs (``_Core.prepare_ahead``)
_PREPARE_AHEAD = True


class _Core:
    """N copies of the MDP as one batch (all arrays [N, ...])."""

    def __init__(self, config: TokenBatchConfig, num_envs: int, threads: int = 1, prepare_ahead: bool = False):
        """``prepare_ahead`` (SAME_STEP): each copy's next episode is drawn and cut while the engine
        runs (``prepare_ahead``), so that a reset after the engine call only lays it out."""
        from .engine.profiles import load_profile
        from .engine.simulate import EngineRun
        from .engine.state import EngineConfig
        from .evaluate import BenchConfig, load_params_file, load_weights, prepare_workload
        from .policies import IndexParams, LinearWeights

        if not _is_int(num_envs) or num_envs < 1:
            raise ConfigError(f"num_envs: must be an integer >= 1, got {num_envs!r}")
        self.config = cfg = config
        self.n = N = int(num_envs)
        self.engine_config = EngineConfig(max_iterations=cfg.max_iterations)
        from .errors import ProfileError
        from .traces.suites import load_suite
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
        from .engine import compile_notice
        compile_notice(env=True)   # (one line, once, before numba compiles the engine or this env's step)
        key = (cfg.suite, cfg.split, cfg.profile, self.engine_config, cfg.predictor)
        if key not in _WORKLOADS:
            try:
                wl = prepare_workload(BenchConfig(suite=cfg.suite, split=cfg.split, profile=cfg.profile,
                                                  engine=self.engine_config, upper_bound=False), profile)
            except ConfigError as e:
                raise ConfigError(f"suite/split: {e}") from None
            if cfg.predictor is not None:
                wl = dataclasses.replace(wl, predictor=cfg.predictor)
            est = wl.estimates()
            _WORKLOADS[key] = (wl, est, _EpisodeTable(wl, est, profile, self.engine_config))
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
        self.base_params, self.base_margin, self.base_weights = params, margin, weights
        self.theta_star = (params if cfg.action_mode == "index" else weights).theta_vector(wl.t_ref_ms)
        self.action_names = cfg.action_names
        # engine
        wl.check_load(cfg.rho[0], "rho", usable)   # (the lowest load: if it fits, every draw does)
        w0 = wl.window_at(usable[0], cfg.rho[0], cfg.warmup, cfg.window, cfg.warmup, cfg.cooldown)
        from .policies import engine_policy
        pol = engine_policy(cfg.action_mode, params=params, weights=weights, shed_margin=margin,
                            t_ref_ms=wl.t_ref_ms)
        est0 = self.estimates[usable[0]][w0.parent_start:w0.parent_start + len(w0.trace)]
        self.run = EngineRun([w0.trace] * N, profile, pol, self.engine_config,
                             estimates=[est0] * N, residual_life=wl.residual_life, threads=threads)
        self.pol = pol
        # the fresh engine state of a copy, as built (the fields a new episode resets that its trace
        # does not set; the block table is never reset)
        self.fresh = K.EngineArrays(*(a[:1].copy() for a in self.run.arrays))
        # the per-copy hash dimensions sized once for any window (no growth, i.e. no copy of the
        # whole arrays, at resets); ``cv_extent``: each chain_val row holds zeros from there on
        # (hash_head rows are -1 except at the ids the copy's blocks hold: resets clear just those)
        self.cv_extent = np.full(N, self.run.arrays.chain_val.shape[1], np.int64)
        self.run.arrays = _grow(self.run.arrays, dict(zip(("chain_val", "hash_head"),
                                                          self.episodes.max_widths(cfg.n_req))))
        # constants for observations and certain-miss detection
        self.k = cfg.k
        self.obs_dim = obs_dim(cfg.k)
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
        # (``_episode_metrics``); ``has_records``: the copy has finished an episode
        from .evaluate import _pct_index
        self.ep_counts = np.zeros((N, len(_EPISODE_COUNTS)), np.int64)
        self.ep_pcts = np.zeros((N, 3))
        # two slots per copy: the last episode reported (``ep_slot``) and one being written, so that a
        # step that raises after the threads wrote (a layout's error) leaves the reported one
        self.ep_snap = np.zeros((N, 2, len(_RECORD_FIELDS), cfg.window), np.int64)
        self.ep_slot = np.zeros(N, np.int64)
        self.ep_pct_index = (_pct_index(cfg.window, 50), _pct_index(cfg.window, 99))
        self.has_records = np.zeros(N, bool)
        self.params_theta = np.tile(self.theta_star, (N, 1))
        self.params_margin = np.full(N, -1.0 if margin is None else margin)

    # -------------------------------------------------------------- actions
    @property
    def action_dim(self) -> int:
        return len(self.action_names)

    def map_actions(self, a: np.ndarray):
        return map_actions(a, self.config.action_mode, self.theta_star, self.base_margin, self.config.shed_action)

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
                P[k][rows, :v.shape[1]] = v   # (_lay_out copies each row's entries, not the zeros past them)
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
        self.run.arrays = _lay_out(self.run.arrays, self.fresh, rows, cols, src, self.cv_extent)
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
        self.run.map_groups(lambda g: observe(self.run, g, self.obs, self.k, self.ocfg), mask,
                            min_group=_MIN_GROUP)

    def step(self, live: np.ndarray, theta: np.ndarray, margin: np.ndarray, reset_rows=None):
        """Apply the (held) parameters of the ``live`` copies and advance each to its next decision
        epoch (skipping epochs that need no decision) or the end of its episode; the engine threads
        observe and reward the copies as they advance them (``_advance_observe``: a batch of copies
        at a time, in one pass over the threads). ``reset_rows`` (copies not live): new episodes
        laid out meanwhile by an engine thread before it joins the others (``reset_copies``, serial
        Python, so the other cores advance the live copies in the meantime; every write is to those
        rows alone)."""
        run = self.run
        self.params_theta[live] = theta
        self.params_margin[live] = margin
        run.set_policy_params(self.params_theta, self.params_margin)
        reward = np.zeros(self.n)
        trunc = np.zeros(self.n, bool)
        # (whole: a column view's layout would differ for one copy, and compile twice, ~1 min)
        epoch = run.arrays.epoch   # EP_STOP: read once each copy has stopped
        rew_args, met_args = self._reward_args(reward), self._metric_args()

        def kernel(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, shed, active, max_steps, until_ns,
                   claim, mine):
            chunk, priv, stopped = np.zeros_like(active), np.zeros(1, np.int64), np.zeros_like(active)
            kargs = K.kernel_args(A, cfg, fcfg, theta, shed_margin, mrl, tier, score, shed, chunk, max_steps,
                                  until_ns, claim=priv, mine=mine)
            total = _advance_observe(kargs, active, claim, chunk, priv, stopped, epoch, self.config.max_steps,
                                     self.steps, trunc, _observe_args(run, self.obs, self.k, self.ocfg), rew_args,
                                     met_args)
            return K.checked_total(total, kargs)

        def after(ran):   # the same work for copies advanced otherwise (the tests' reference epochs)
            _after_stop(0, self.n, ran.copy(), np.zeros_like(ran), epoch, self.config.max_steps, self.steps,
                        trunc, _observe_args(run, self.obs, self.k, self.ocfg), rew_args, met_args)
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
        """``_rewards``'s arguments after its mask and ``trunc``, the rewards into ``out``."""
        A = self.run.arrays
        return (self.s0, self.s1, self.t_min_ns, self.config.reward_mode == "met", A.now, A.end_state,
                A.first_token, A.finish, A.arrival, A.t1, self.t2, A.out_len, A.gen, A.capped, self.certain,
                self.met_seen, out, A.prompt, A.computed, A.n_preempt, self.h_best, self.ps_cost,
                self.run.profile.max_num_batched_tokens, self.open_lo)

    def _metric_args(self) -> tuple:
        """``_episode_metrics``'s arguments after its mask, ``epoch`` and ``trunc``."""
        A = self.run.arrays
        return (self.s0, self.s1, *self.ep_pct_index, self.ep_counts, self.ep_pcts, self.ep_snap, self.ep_slot,
                *(getattr(A, f) for f in _RECORD_FIELDS[:-1]), self.t2)

    def episode_infos(self, ended: np.ndarray, trunc: np.ndarray) -> dict:
        """Episode metrics of the copies ``ended`` (their scored requests), one array per key over
        them: the evaluator's definitions, computed by the engine threads as the episodes ended
        (``_episode_metrics``), and the episode's return, length, load and simulated time."""
        A = self.run.arrays
        counts, pcts = self.ep_counts[ended], self.ep_pcts[ended]
        self.has_records[ended] = True
        self.ep_slot[ended] ^= 1   # their records, written in the other slot, are now the reported ones
        info = {f"episode_{k}": counts[:, i] for i, k in enumerate(_EPISODE_COUNTS)}
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

        from .engine.simulate import record_rows
        if not self.has_records[c]:
            return None
        s0, s1 = self.s0, self.s1
        cols = {}
        for f, v in zip(_RECORD_FIELDS, self.ep_snap[c, self.ep_slot[c]]):
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


# ------------------------------------------------------------------ the vector env
def _as_numbers(actions) -> np.ndarray:
    """``actions`` as a new float64 array, or ``ActionError`` if they are not real numbers (strings,
    complex numbers and objects are refused, not parsed or truncated)."""
    try:
        arr = np.asarray(actions)
    except (TypeError, ValueError):   # (ragged sequences)
        raise ActionError(f"actions must be numbers, got {type(actions).__name__}") from None
    if arr.dtype.kind not in "biuf":
        raise ActionError(f"actions must be real numbers, got {type(actions).__name__} of dtype {arr.dtype}")
    return np.array(arr, dtype=np.float64)


def _add(infos: dict, info: dict, rows: np.ndarray, n: int) -> None:
    """Gymnasium's vector info convention: ``info[key]`` an array over copies, ``info['_key']`` its
    mask; ``info`` holds one array per key over the copies ``rows``."""
    for key, v in info.items():
        if key not in infos:
            infos[key] = np.zeros(n, v.dtype)
        infos[key][rows] = v
        infos.setdefault(f"_{key}", np.zeros(n, bool))[rows] = True


#: copies from which the vector env uses every available core by default
THREADS_MIN_COPIES = 64


def default_threads(num_envs: int) -> int:
    """The vector env's default engine threads: the available cores from ``THREADS_MIN_COPIES``
    copies on, else 1 (smaller batches do not pay for the hand-off)."""
    if num_envs < THREADS_MIN_COPIES:
        return 1
    from .tuning import available_cores
    return max(1, available_cores())


class TokenBatchVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` copies of TokenBatch-v0 stepped as one engine batch (see ``TokenBatchEnv`` for
    the MDP). ``autoreset_mode`` (config) is NEXT_STEP, SAME_STEP or DISABLED and is recorded in
    ``self.metadata``; with DISABLED, reset finished copies with ``reset(options={"reset_mask": m})``.
    Episode metrics appear in ``info`` (arrays over copies with ``_key`` masks) at episode end.

    ``threads`` (keyword, not part of the MDP config): the engine advances the copies on this many
    threads at once, which share them out as they go (the compiled kernel releases the GIL); results
    are identical for any value. Default (None): the available cores from 64 copies on, else 1.

    New episodes are laid out while the engine runs where the mode allows: NEXT_STEP lays out the
    episodes of the copies that ended in the previous step; SAME_STEP draws and cuts each copy's next
    episode ahead (one more row per copy of the window's columns), so that only its layout follows
    the engine. Either way the episodes are those each copy's generator gives, in order."""

    metadata = {"render_modes": [], "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int = 1, config: Optional[TokenBatchConfig] = None, *,
                 max_episode_steps: Optional[int] = None, render_mode: Optional[str] = None,
                 threads: Optional[int] = None, **kwargs):
        if config is not None and not isinstance(config, TokenBatchConfig):
            raise ConfigError(f"config: must be a TokenBatchConfig (or pass its fields as keywords), got "
                              f"{type(config).__name__}")
        if max_episode_steps is not None:
            kwargs.setdefault("max_steps", max_episode_steps)
        try:
            config = TokenBatchConfig(**kwargs) if config is None else dataclasses.replace(config, **kwargs)
        except TypeError as e:
            valid = [f.name for f in dataclasses.fields(TokenBatchConfig)]
            raise ConfigError(f"{e}; valid config fields: {', '.join(valid)}") from None
        if render_mode is not None:
            raise ConfigError(f"render_mode: TokenBatch has no renderer; got {render_mode!r}")
        self.render_mode = None
        if threads is not None and (not _is_int(threads) or threads < 1):
            raise ConfigError(f"threads: must be None (automatic) or an integer >= 1, got {threads!r}")
        self.config = config
        self.threads = (default_threads(num_envs) if _is_int(num_envs) else 1) if threads is None else int(threads)
        self.core = _Core(config, num_envs, self.threads,
                          prepare_ahead=_PREPARE_AHEAD and config.autoreset_mode == AutoresetMode.SAME_STEP)
        self.num_envs = self.core.n
        self.metadata = {**type(self).metadata, "autoreset_mode": config.autoreset_mode}
        self.autoreset_mode = config.autoreset_mode
        d = self.core.obs_dim
        self.single_observation_space = spaces.Box(-OBS_CLIP, OBS_CLIP, (d,), np.float32)
        self.single_action_space = spaces.Box(-1.0, 1.0, (self.core.action_dim,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self._needs_reset = np.zeros(self.num_envs, bool)
        self._done = np.ones(self.num_envs, bool)   # copies without a live episode
        self._seeded = False
        self.obs_names = obs_layout(config.k)

    # -------------------------------------------------------------- reset
    def reset(self, *, seed: Union[None, int, Sequence[Optional[int]]] = None,
              options: Optional[dict] = None):
        n = self.num_envs
        mask = np.ones(n, bool)
        if options is not None:
            if not isinstance(options, dict) or set(options) - {"reset_mask"}:
                raise ConfigError(f"reset options: only {{'reset_mask': bool array [{n}]}} is supported, "
                                  f"got {options!r}")
            if "reset_mask" in options:
                mask = np.asarray(options["reset_mask"])
                if mask.shape != (n,) or mask.dtype != np.bool_:
                    raise ConfigError(f"reset_mask: must be a bool array of shape ({n},)")
        rows = np.flatnonzero(mask)
        if seed is not None:
            if _is_int(seed):
                seeds = [int(seed) + i for i in range(n)]
            elif isinstance(seed, (str, bytes)) or not isinstance(seed, (Sequence, np.ndarray)):
                raise ConfigError(f"seed: must be None, an integer or a sequence of {n} (integers or None), "
                                  f"got {seed!r}")
            else:
                seeds = list(seed)
                if len(seeds) != n:
                    raise ConfigError(f"seed: expected an int or {n} seeds, got {len(seeds)}")
            # every seed checked before any copy is seeded (a bad one leaves all generators as they were)
            for c, s in enumerate(seeds):
                if s is not None and (not _is_int(s) or s < 0):
                    raise ConfigError(f"seed: must be an integer >= 0 or None, got {s!r}"
                                      + (f" (copy {c})" if n > 1 else ""))
            self.core.seed_copies(rows, [seeds[c] for c in rows])
        self.core.reset_copies(rows)
        self._needs_reset[rows] = False
        self._done[rows] = False
        infos: dict = {}
        if rows.size:
            _add(infos, self.core.reset_infos(rows), rows, n)
        return self.core.obs.copy(), infos

    # -------------------------------------------------------------- step
    def _check_actions(self, actions) -> np.ndarray:
        n, d = self.num_envs, self.core.action_dim
        a = _as_numbers(actions)
        if a.shape != (n, d):
            raise ActionError(f"actions must have shape ({n}, {d}) (copies x {', '.join(self.core.action_names)}), "
                              f"got {a.shape}")
        if np.isnan(a).any():
            c, j = np.argwhere(np.isnan(a))[0]
            raise ActionError(f"action is NaN at copy {c}, dimension {j} ({self.core.action_names[j]})")
        bad = ~np.isfinite(a) | (np.abs(a) > 1.0)
        if bad.any():
            if not self.config.clip_actions:
                c, j = np.argwhere(bad)[0]
                raise ActionError(f"action {float(a[c, j])!r} at copy {c}, dimension {j} "
                                  f"({self.core.action_names[j]}) is outside [-1, 1]; pass clip_actions=True to "
                                  f"clip instead")
            a = np.clip(a, -1.0, 1.0)
        return a

    def step(self, actions):
        n, core = self.num_envs, self.core
        a = self._check_actions(actions)
        mode = self.autoreset_mode
        reset_now = self._needs_reset.copy() if mode == AutoresetMode.NEXT_STEP else np.zeros(n, bool)
        if mode == AutoresetMode.DISABLED and self._done.any():
            raise ConfigError(f"copies {np.flatnonzero(self._done)[:10].tolist()} have no live episode: with "
                              f"autoreset_mode DISABLED call reset(options={{'reset_mask': mask}}) first")
        if mode != AutoresetMode.DISABLED and self._done.all() and not self._needs_reset.any():
            raise ConfigError("call reset() before step()")
        live = ~reset_now & ~self._done
        theta, margin = core.map_actions(a[live])
        rows = np.flatnonzero(reset_now)   # (NEXT_STEP) laid out while the engine advances the live copies
        reward, term, trunc = core.step(live, theta, margin, reset_rows=rows)
        infos: dict = {}
        ended = np.flatnonzero(term | trunc)
        if ended.size:
            _add(infos, core.episode_infos(ended, trunc), ended, n)
        if rows.size:
            _add(infos, core.reset_infos(rows), rows, n)
            self._done[reset_now] = False
        if mode == AutoresetMode.SAME_STEP and ended.size:
            final_obs = np.full(n, None, dtype=object)
            for c in ended.tolist():
                final_obs[c] = core.obs[c].copy()
            done = term | trunc
            infos = {"final_obs": final_obs, "_final_obs": done,
                     "final_info": infos, "_final_info": done.copy()}
            core.reset_copies(ended)
            _add(infos, core.reset_infos(ended), ended, n)
        elif mode == AutoresetMode.NEXT_STEP:
            self._needs_reset = term | trunc
            self._done |= term | trunc
        else:
            self._done |= term | trunc
        return core.obs.copy(), reward, term, trunc, infos

    # -------------------------------------------------------------- helpers
    def episode_records(self, copy: int = 0) -> Optional[dict]:
        """The scored requests' records of copy ``copy``'s last finished episode (met, ttft_ns, ...)."""
        return self.core.episode_records(copy)

    @property
    def base_theta(self) -> np.ndarray:
        """theta* as the engine's parameter vector (``engine.scoring`` layout) and its shed margin."""
        return self.core.theta_star.copy()

    def close(self, **kwargs):
        self.core.run.close()   # the engine's worker threads, if any (restarted if stepped again)


def make_vector_env(num_envs: int = 1, **kwargs) -> TokenBatchVectorEnv:
    """The vector entry point of TokenBatch-v0 (accepts ``max_episode_steps``, ``threads`` and every
    config field)."""
    return TokenBatchVectorEnv(num_envs=num_envs, **kwargs)


# ------------------------------------------------------------------ the single env
class TokenBatchEnv(gym.Env):
    """TokenBatch-v0: order the requests of a simulated LLM-serving engine to maximise goodput.

    ## Description
    One engine (continuous batching, chunked prefill, paged KV cache, preemption, prefix caching;
    vLLM V1 semantics, docs/design.md section 3) serves an episode: a window of ``window`` scored
    requests cut from a suite trace (``suite``/``split``), with ``warmup`` requests before and
    ``cooldown`` after that are simulated but not scored, at a load rho drawn uniformly from
    ``rho`` (the trace is time-scaled to ``rho * lambda_sat``, the suite's FCFS saturation rate for
    ``profile``; the same scaling as the evaluator). The agent controls the Gittins-barrier index
    that orders waiting requests (and picks preemption victims), plus the shed margin. A request
    is *met* when it completes with TTFT <= T1 and TPOT <= T2. This env is the vector env
    ``TokenBatchVectorEnv`` with one copy: the dynamics exist once.

    ## Action Space
    ``index`` mode (default): ``Box(-1, 1, (8,), float32)``, a residual around the base vector
    theta* (``base_params`` JSON, else ``IndexParams()`` defaults with ``shed_margin``), in order
    kappa, slope, gamma, theta, beta, w_prefix, a_edf, shed_margin. Log-scale parameters (slope):
    ``theta = theta* * exp(a * ln(hi/lo))``; log1p-scale (gamma):
    ``expm1(log1p(theta*) + a * log1p(hi))``; linear ones (kappa, theta, beta, w_prefix, a_edf,
    shed_margin): ``theta* + a * (hi - lo)``; every result clipped to its range (policies.INDEX_RANGES,
    shed margin [0, 2]); ``a = 0`` gives theta* exactly. With no base shed margin (None/inf) the
    last dimension is ignored. The action is held until the next decision epoch. NaN, inf or values
    outside [-1, 1] raise ``ActionError`` unless ``clip_actions=True`` (which clips inf and
    out-of-range values; NaN always raises). ``weights`` mode: ``Box(-1, 1, (9,), float32)``, the
    weights of a linear score ``(w/|w|) . f`` over ``engine.scoring.LINEAR_FEATURES`` (ln(S/T_ref),
    z/10, queue_key/key_hi, prefix ratio, blocks needed/usable, (deadline - now)/T_ref, slack/T_ref,
    first token out), ``w = w* + a`` around the base weights (the ``weights`` entry of
    ``base_params``, else -e0: SJF's order), then the shed margin as above. The family contains
    sjf (-e0), edf (-e5), llf (-e6) and the FCFS queue order (-e2). ``shed_action=False``: either
    mode without its last (shed margin) dimension, ``(7,)`` or ``(8,)``; the margin stays at the base.

    ## Observation Space
    ``Box(-10, 10, (18 + 11*K,), float32)``, K = ``k`` (default 8, so 106 entries), never NaN/inf
    (every entry is clipped to [-10, 10]); ``obs_layout(K)`` names them. Engine state (6): free KV
    fraction; running / max_num_seqs; ln(1 + waiting) / ln(1025); ln(1 + queued prefill tokens) /
    ln(1 + 1e6); arrival-rate estimate (arrivals in the last 10 s of simulated time, over at
    least 0.1 s, / lambda_sat, so ~rho); budget demand (running requests' next-iteration tokens /
    B, capped at 1). Queue summary (12): quantiles 0/25/50/75/100 % of z/10 and of ln(S/T_ref)/4
    over the waiting requests, 0 with ``queue_empty`` = 1 when nothing waits; fraction of waiting
    requests whose TTFT is already lost (slack < 0). Then the K waiting requests with the lowest z
    (ties: earlier position in the sort), 10 features each: z/10, ln(S/T_ref)/4,
    ln(1+prefill left)/ln(1+1e5), ln(1+estimated decode left)/ln(1+1e5), prefix-cache hit ratio,
    blocks needed / usable blocks, waited / T1, (deadline - now) / T_ref, ln(T1 / T_ref), first
    token out (0/1); missing rows are 0; then K validity bits. z, S, slack, prefill left, blocks
    needed and the estimates are the index's inputs (docs/design.md section 4) with the suite's
    predictor.

    ## Rewards
    ``certain_miss`` (default): minus the number of scored requests whose miss became certain
    during the step: ended without being met (shed, timed out, rejected, length capped, late),
    no first token by arrival + T1, TTFT unreachable even on an idle engine with every cacheable
    prefix block cached (``bounds.min_prefill_ps2``: the minimum prefill time over all chunkings of
    the tokens not yet computed), or TPOT unreachable even if every remaining token came one
    minimum-length iteration (c0 + c_decode) apart; at truncation every open scored request counts.
    (The TTFT-unreachable rule makes a lost request count when it is lost, not at its deadline or
    when it is shed, so delaying shedding earns no discounted reward.)
    Over an episode the rewards sum to -(window - met). ``met``: +1 per scored request completed
    within both SLOs. Both have the same optimal policy; ``certain_miss`` signals earlier. One step
    spans at least ``decision_interval_ms`` of simulated time; a discount gamma per step of 0.99
    is a ~10 s horizon at the default 100 ms epochs (0.999 for ~100 s). Caution: the number of steps
    depends on the policy (skipped epochs), so a small gamma favours policies that keep more
    requests waiting (more, shorter steps discount the same misses more); agents/train_ppo.py uses
    0.999 (measured in its docstring).

    ## Starting State
    ``reset`` draws (trace, window start, rho) from the copy's generator and returns the
    observation at the first arrival of the window, before any iteration (an empty engine).

    ## Episode End
    Decision epochs fall every ``decision_interval_ms`` of simulated time after the episode start,
    at the first iteration boundary at or after each; an epoch is skipped (the engine runs on with
    the held action, rewards accumulate) while fewer than 2 requests wait and nothing is sheddable
    (no waiting request with negative slack, shedding on). Terminated: every scored request has
    ended. Truncated: ``max_steps`` decision steps or ``max_iterations`` engine iterations; the open
    scored requests count as not met. (Cap the steps with ``max_steps``: ``gym.make``'s
    ``max_episode_steps`` adds Gymnasium's ``TimeLimit`` wrapper, which truncates from outside, so
    the open requests do not count and no episode metrics appear; the vector entry point's
    ``max_episode_steps`` is ``max_steps``.) At episode end ``info`` carries ``episode_goodput``,
    ``episode_met``, ``episode_shed``, ``episode_timed_out``, ``episode_unfinished``,
    ``episode_ttft_p99_ms`` and ``episode_tpot_p99_ms`` (percentiles over the scored requests, a request
    without a first token counting as +inf TTFT and one not completed as +inf TPOT), ``episode_return``,
    ``episode_length``, ``episode_rho`` and more; ``reset`` info gives ``rho``, ``trace_index``
    and ``window_start``.

    ## Arguments
    ``gym.make("TokenBatch-v0", **config)`` with the fields of ``TokenBatchConfig``: suite
    ("seed-200"), split ("train"), profile ("stress-512"), rho ((0.8, 1.5)), window (128),
    warmup (32), cooldown (32), decision_interval_ms (100), k (8), action_mode ("index"),
    predictor (None = the suite's), reward_mode ("certain_miss"), autoreset_mode (NEXT_STEP; used
    by the vector env), seed (None), base_params (None), shed_margin (0.0), clip_actions (False),
    shed_action (True), max_steps (20000), max_iterations (2000000). ``gym.make_vec("TokenBatch-v0", num_envs=N,
    vectorization_mode="vector_entry_point", **config)`` gives ``TokenBatchVectorEnv`` (which also
    takes ``threads``, engine threads: same results for any value). Seeding:
    ``reset(seed=s)`` seeds copy i with s + i (like ``SyncVectorEnv``); ``seed`` in the config is
    used for copies never seeded by ``reset``.

    ## Version History
    * v0: initial version (``index`` and ``weights`` action modes; ``certain_miss`` counts a TTFT
      as lost once unreachable on an idle engine). Later added, defaults unchanged: ``shed_action``.
    """

    metadata = {"render_modes": []}

    def __init__(self, render_mode: Optional[str] = None, **kwargs):
        if render_mode is not None:
            raise ConfigError(f"render_mode: TokenBatch has no renderer; got {render_mode!r}")
        self.render_mode = None
        kwargs = dict(kwargs)
        kwargs.setdefault("threads", 1)   # one copy: nothing to split
        self._vec = TokenBatchVectorEnv(1, **kwargs)
        self.config = self._vec.config
        self._vec.autoreset_mode = AutoresetMode.DISABLED
        self.observation_space = self._vec.single_observation_space
        self.action_space = self._vec.single_action_space
        self.obs_names = self._vec.obs_names

    @staticmethod
    def _unbatch(infos: dict) -> dict:
        out = {}
        for k, v in infos.items():
            if k.startswith("_"):
                continue
            if isinstance(v, dict):
                out[k] = TokenBatchEnv._unbatch(v)
            elif infos.get(f"_{k}", np.ones(1, bool))[0]:
                out[k] = v[0].item() if isinstance(v[0], np.generic) else v[0]
        return out

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        if options is not None and (not isinstance(options, dict) or set(options) - {"reset_mask"}):
            raise ConfigError(f"reset options: none are supported (a vector env's 'reset_mask' is accepted and "
                              f"ignored), got {options!r}")
        obs, infos = self._vec.reset(seed=None if seed is None else [seed])
        return obs[0], self._unbatch(infos)

    def step(self, action):
        a = _as_numbers(action)
        if a.shape != (self._vec.core.action_dim,):
            raise ActionError(f"action must have shape ({self._vec.core.action_dim},) "
                              f"({', '.join(self._vec.core.action_names)}), got {np.shape(a)}")
        self._vec._check_actions(a[None, :])
        if self._vec._done[0]:
            raise ConfigError("the episode has ended (or reset() was never called): call reset() first")
        obs, r, term, trunc, infos = self._vec.step(a[None, :])
        return obs[0], float(r[0]), bool(term[0]), bool(trunc[0]), self._unbatch(infos)

    def episode_records(self) -> Optional[dict]:
        return self._vec.episode_records(0)

    @property
    def core(self):
        return self._vec.core

    def close(self):
        self._vec.close()


_guard_stale_cache()   # (last: every compiled function of this module is defined)
