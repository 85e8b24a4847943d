"""The Gymnasium environments (docs/design.md section 5): ``TokenBatchVectorEnv`` (N engine copies
stepped as one batch, ``core.Core``) and ``TokenBatchEnv`` (the vector env with one copy), whose
class docstring is the MDP's specification in Gymnasium's sections."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from ..errors import ConfigError
from .actions import ActionError, as_numbers
from .config import TokenBatchConfig, is_int
from .core import Core
from .observation import OBS_CLIP, obs_layout
from .rewards import rewards_doc


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
#: SAME_STEP: draw and cut each copy's next episode ahead, while the engine runs (``Core.prepare_ahead``)
_PREPARE_AHEAD = True


def default_threads(num_envs: int) -> int:
    """The vector env's default engine threads: the available cores from ``THREADS_MIN_COPIES``
    copies on, else 1 (smaller batches do not pay for the hand-off)."""
    if num_envs < THREADS_MIN_COPIES:
        return 1
    from ..util import available_cores
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
        if threads is not None and (not is_int(threads) or threads < 1):
            raise ConfigError(f"threads: must be None (automatic) or an integer >= 1, got {threads!r}")
        self.config = config
        self.threads = (default_threads(num_envs) if is_int(num_envs) else 1) if threads is None else int(threads)
        self.core = Core(config, num_envs, self.threads,
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
        self.obs_names = obs_layout(config.k, config.tpot_guard)

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
            if is_int(seed):
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
                if s is not None and (not is_int(s) or s < 0):
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
        a = as_numbers(actions)
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
        reward, term, trunc = core.step(live, theta, margin, reset_rows=rows, guard=core.map_guard(a[live]))
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
    """TokenBatch-v0 and -v1: order the requests of a simulated LLM-serving engine (and, in v1, size
    its iterations) to maximise goodput.

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
    v1 (``tpot_guard=True``, ``gym.make("TokenBatch-v1")``): the engine runs the tpot-guard budget rule
    (docs/design.md section 11) and two dimensions come before the shed margin, ``budget_u`` and
    ``budget_bmin``: ``u = u* + 2.5 a`` clipped to [-0.5, 2] and ``B_min = B_min* + a`` clipped to
    [0, 1], around the base (u*, B_min*): the ``budget_u`` and ``budget_bmin`` levers of the
    ``"<mode>+shed+tpot-guard"`` row of ``base_params`` (its static vLLM flags are not applied: the env
    runs at the profile's; the file's ``"tpot-guard"`` part gives the index's theta* and margin), else
    (0, 1), with which the rule never lowers the budget and a = 0 runs v0's episodes. So ``(10,)`` in
    ``index`` mode, ``(11,)`` in ``weights`` mode (one fewer without the shed action).

    ## Observation Space
    ``Box(-10, 10, (18 + 11*K,), float32)``, K = ``k`` (default 8, so 106 entries), never NaN/inf (every
    entry is clipped to [-10, 10]); ``obs_layout(K)`` (v1: ``obs_layout(K, tpot=True)``) and
    ``env.unwrapped.obs_names`` name them (``env.unwrapped.core.action_names`` the action's dimensions).
    Engine state (6): free KV fraction; running / max_num_seqs; ln(1 + waiting) / ln(1025); ln(1 +
    queued prefill tokens) / ln(1 + 1e6); arrival-rate estimate (arrivals in the last 10 s of simulated
    time, over at least 0.1 s, / lambda_sat, so ~rho); budget demand (running requests' next-iteration
    tokens / B, capped at 1). Queue summary (12): quantiles 0/25/50/75/100 % of z/10 and of
    ln(S/T_ref)/4 over the waiting requests, 0 with ``queue_empty`` = 1 when nothing waits; fraction of
    waiting requests whose TTFT is already lost (slack < 0). Then the K waiting requests with the lowest
    z (ties: earlier position in the sort), 10 features each: z/10, ln(S/T_ref)/4, ln(1+prefill
    left)/ln(1+1e5), ln(1+estimated decode left)/ln(1+1e5), prefix-cache hit ratio, blocks needed /
    usable blocks, waited / T1, (deadline - now) / T_ref, ln(T1 / T_ref), first token out (0/1); missing
    rows are 0; then K validity bits. z, S, slack, prefill left, blocks needed and the estimates are the
    index's inputs (docs/design.md section 4) with the suite's predictor. v1 appends the TPOT state (9;
    the rule's own quantities, ``observation.TPOT_FEATURES``): decoding requests / max_num_seqs; tau_dec
    (the decodes' iteration time) / the smallest T2 of the running requests past their first token (0 if
    none has a TPOT SLO); quantiles 0/25/50/75/100 % of the guarded requests' credits c_i / T2_i as
    sign(x) ln(1 + |x|) / ln(101), 0 with ``guarded_empty`` = 1 when none is guarded;
    ``tpot_behind_frac``, the share of running requests behind their TPOT SLO (credit < 0: even a token
    emitted now would leave their mean time per output token above T2; later, faster tokens may still
    make it; the observable part of "TPOT lost", which needs the unknown output length). ``Box(-10, 10,
    (27 + 11*K,))``.

    ## Rewards
    [the reward modes: ``rewards.REGISTRY``, as ``rewards.rewards_doc`` states them]
    Both have the same optimal policy; ``certain_miss`` signals earlier. One step
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
    shed_action (True), max_steps (20000), max_iterations (2000000), tpot_guard (False; True in
    TokenBatch-v1). ``gym.make_vec("TokenBatch-v0", num_envs=N,
    vectorization_mode="vector_entry_point", **config)`` gives ``TokenBatchVectorEnv`` (which also
    takes ``threads``, engine threads: same results for any value). Seeding:
    ``reset(seed=s)`` seeds copy i with s + i (like ``SyncVectorEnv``); ``seed`` in the config is
    used for copies never seeded by ``reset``.

    ## Version History
    * v1: the tpot-guard budget rule with its u and B_min as action dimensions and the TPOT state in
      the observation (``tpot_guard=True``); everything else as v0, which stays registered.
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
        a = as_numbers(action)
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


if TokenBatchEnv.__doc__ is not None:   # (None under python -OO) the reward modes, from their registry
    TokenBatchEnv.__doc__ = TokenBatchEnv.__doc__.replace(
        "    [the reward modes: ``rewards.REGISTRY``, as ``rewards.rewards_doc`` states them]\n", rewards_doc("    "))
