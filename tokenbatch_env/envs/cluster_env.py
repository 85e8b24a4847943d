"""TokenBatchCluster-v0: routing every arrival of a cluster (docs/design.md section 12, "Routing env").

``TokenBatchClusterVectorEnv`` steps E clusters as one batch on ``engine.routing.RoutingRun`` (the
dynamics: each cluster waits at its pending arrival, the action routes it, the cluster runs to the
next); ``TokenBatchClusterEnv`` is the vector env with one cluster. The class docstring of
``TokenBatchClusterEnv`` is the MDP's specification.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from ..engine import cluster_kernel as CK
from ..errors import ConfigError
from .config import is_int, is_num

#: per replica: the router's view (section 12), normalised (``cluster_obs``), and its mask bit
REPLICA_FEATURES = ("running", "waiting", "free_kv", "queued_tokens", "outstanding", "in_flight_ms", "cached_share",
                    "routed_since", "routed_tokens_since", "predicted_ttft_ms", "allowed")
#: the pending request's features
REQUEST_FEATURES = ("prompt_tokens", "estimated_output", "ttft_slo_ms", "tpot_slo_ms")
#: the fixed normalisation: log1p(x) / scale for counts (requests), tokens and times (ms)
LOG_COUNT, LOG_TOKENS, LOG_MS = math.log1p(1024), math.log1p(1 << 20), math.log1p(1e5)
OBS_HIGH = 4.0


@dataclasses.dataclass(frozen=True)
class ClusterEnvConfig:
    """What defines a TokenBatchCluster-v0 environment (validated; ConfigError names the field).

    An episode is a window of a suite trace at cluster load ``rho`` (a number or a ``(low, high)``
    range drawn per episode; rho = admitted arrival rate / (``replicas`` x lambda_sat)): ``window`` x
    R scored requests with ``warmup`` x R before and ``cooldown`` x R after, every one routed by the
    agent, only the scored ones rewarded. Each replica runs ``policy`` (a deployable policy of the
    registry; ``shed_margin``: its common shed rule, None: none) on ``profile``, with the workload's
    length estimates and T_ref (``t_ref_ms``: a tuned parameters file's fixed T_ref); ``index``: the
    index's parameters when ``policy`` is ``index`` (IndexParams fields; None: its defaults);
    ``levers``: vLLM's flags on every replica (``{flag: value}`` of ``engine.levers.LEVERS``; a tuned
    row's, docs/design.md section 11). A masked action is ``base_router``'s choice."""

    suite: str = "seed-200"
    split: str = "train"
    profile: str = "stress-512"
    replicas: int = 4
    rho: Any = (0.8, 1.5)
    window: int = 64
    warmup: int = 16
    cooldown: int = 16
    policy: str = "fcfs"
    shed_margin: Optional[float] = None
    base_router: str = "round-robin"
    seed: Optional[int] = None
    max_traces: Optional[int] = None
    index: Any = None
    levers: Any = ()
    t_ref_ms: Optional[float] = None
    pd: Any = ()
    decode_router: str = "least-kv"
    kv_link: str = "nvlink"
    first_token_at: str = "prefill"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        from ..engine.levers import check_levers
        from ..policies import IndexParams, PolicyError
        set_("levers", check_levers(dict(self.levers) if isinstance(self.levers, (tuple, list)) else self.levers,
                                    "levers"))
        if self.index is not None:
            try:
                ip = IndexParams.from_dict(dict(self.index))
            except (PolicyError, TypeError, ValueError) as e:
                raise ConfigError(f"index: {e}") from None
            if self.policy != "index":
                raise ConfigError(f"index: the index's parameters go with policy 'index', not {self.policy!r}")
            set_("index", tuple(sorted(dataclasses.asdict(ip).items())))
        if self.t_ref_ms is not None and not (is_num(self.t_ref_ms) and 0 < float(self.t_ref_ms) < math.inf):
            raise ConfigError(f"t_ref_ms: None or a positive number of ms, got {self.t_ref_ms!r}")
        self._check_pd(set_)
        for f in ("suite", "split", "profile", "policy", "base_router"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ConfigError(f"{f}: must be a non-empty string, got {getattr(self, f)!r}")
        from ..engine.cluster import ROUTER_NAMES
        if self.base_router not in ROUTER_NAMES:
            raise ConfigError(f"base_router: unknown router {self.base_router!r}; valid: {', '.join(ROUTER_NAMES)}")
        from ..policies import POLICIES, check_shed_margin
        valid = sorted(k for k in POLICIES if k != "srpt-oracle")
        if self.policy not in valid:
            raise ConfigError(f"policy: a deployable policy ({', '.join(valid)}), got {self.policy!r}")
        if self.shed_margin is not None:
            if not is_num(self.shed_margin):
                raise ConfigError(f"shed_margin: None or a number in [0, 2], got {self.shed_margin!r}")
            from ..policies import PolicyError
            try:
                check_shed_margin(float(self.shed_margin))
            except PolicyError as e:
                raise ConfigError(f"shed_margin: {e}") from None
        rho = (self.rho, self.rho) if is_num(self.rho) else self.rho
        if not (isinstance(rho, (tuple, list)) and len(rho) == 2 and all(is_num(x) for x in rho)
                and 0 < float(rho[0]) <= float(rho[1]) < math.inf):
            raise ConfigError(f"rho: must be a positive number or a (low, high) pair, got {self.rho!r}")
        set_("rho", (float(rho[0]), float(rho[1])))
        from ..engine.flags import MAX_REPLICAS
        for f, lo, hi in (("replicas", 1, MAX_REPLICAS), ("window", 1, 1 << 20), ("warmup", 0, 1 << 20),
                          ("cooldown", 0, 1 << 20)):
            v = getattr(self, f)
            if not is_int(v) or not lo <= v <= hi:
                raise ConfigError(f"{f}: must be an integer in [{lo}, {hi}], got {v!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ConfigError(f"seed: must be None or an integer >= 0, got {self.seed!r}")
        if self.max_traces is not None and (not is_int(self.max_traces) or self.max_traces < 1):
            raise ConfigError(f"max_traces: must be None or an integer >= 1, got {self.max_traces!r}")

    def _check_pd(self, set_) -> None:
        """``pd``: () or (Rp, Rd), integers >= 1 adding up to ``replicas``; its decode router, link and
        first-token convention known (and left at their defaults without ``pd``)."""
        if not self.pd:
            if (self.decode_router, self.kv_link, self.first_token_at) != ("least-kv", "nvlink", "prefill"):
                raise ConfigError("decode_router, kv_link and first_token_at: settings of a P/D cluster (pd)")
            set_("pd", ())
            return
        from ..engine.disagg import check_first_token_at, check_pd_split
        set_("pd", check_pd_split(self.pd, self.replicas, self.decode_router, self.kv_link))
        check_first_token_at(self.first_token_at)

    @property
    def actions(self) -> int:
        """The action's range: the replicas, or a P/D cluster's prefill replicas."""
        return self.pd[0] if self.pd else self.replicas

    @property
    def episode_requests(self) -> int:
        return (self.window + self.warmup + self.cooldown) * self.replicas

    def engine(self):
        """Every replica's ``EngineConfig``: the defaults with ``levers`` set."""
        from ..engine.levers import with_levers
        from ..engine.state import EngineConfig
        return with_levers(EngineConfig(), self.levers)

    @property
    def index_params(self):
        """``index`` as ``policies.IndexParams`` (None: none given)."""
        from ..policies import IndexParams
        return IndexParams(**dict(self.index)) if self.index is not None else None

    def replica_policy(self, t_ref_ms: float):
        """Every replica's ``EnginePolicy`` (``t_ref_ms``: the workload's, unless ``self.t_ref_ms``)."""
        from ..policies import engine_policy
        return engine_policy(self.policy, params=self.index_params, shed_margin=self.shed_margin,
                             t_ref_ms=self.t_ref_ms if self.t_ref_ms is not None else t_ref_ms)


def obs_dim(replicas: int) -> int:
    return replicas * len(REPLICA_FEATURES) + len(REQUEST_FEATURES)


class TokenBatchClusterVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` clusters stepped as one batch (``TokenBatchClusterEnv`` states the MDP).
    ``autoreset_mode`` NEXT_STEP (default: the step after a cluster's episode ends starts its next
    one, its action ignored, reward 0) or SAME_STEP (the next episode starts in the step that ended
    one; ``infos["final_obs"]``, ``infos["final_info"]``: what SB3's adapter needs).
    ``action_masks()``: [num_envs, R] (MaskablePPO; ``copy=i``: cluster i's)."""

    metadata = {"render_modes": [], "autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int = 1, config: Optional[ClusterEnvConfig] = None, *,
                 autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP, **kwargs):
        from .config import autoreset_mode_of
        am = autoreset_mode_of(autoreset_mode)
        if am == gym.vector.AutoresetMode.DISABLED:
            raise ConfigError("autoreset_mode: NEXT_STEP or SAME_STEP (DISABLED is not supported)")
        self.autoreset_mode = am
        self.metadata = {**type(self).metadata, "autoreset_mode": am}
        if config is None:
            config = ClusterEnvConfig(**kwargs)
        elif kwargs:
            raise ConfigError("give a ClusterEnvConfig or its fields, not both")
        if not is_int(num_envs) or num_envs < 1:
            raise ConfigError(f"num_envs: must be an integer >= 1, got {num_envs!r}")
        from ..engine.profiles import load_profile
        from ..engine.routing import RoutingRun, routing_capacity
        from ..engine.simulate import resolve_copies
        from ..engine.state import EngineConfig
        from ..workload import WorkloadSpec, prepare_workload
        self.config = cfg = config
        E, R = int(num_envs), cfg.replicas
        self.num_envs = E
        # (the load is the workload's at the profile's flags, as the benchmark's; the replicas run at
        # the config's levers on top)
        profile = EngineConfig().resolve(load_profile(cfg.profile))
        self.workload = wl = prepare_workload(WorkloadSpec(suite=cfg.suite, split=cfg.split, replicas=R,
                                                           max_traces=cfg.max_traces), profile)
        need = cfg.episode_requests
        self._units = [u for u, t in enumerate(wl.units) if len(t) >= need]
        if not self._units:
            raise ConfigError(f"no trace of {cfg.suite}/{cfg.split} holds an episode of {need} requests "
                              f"((window + warmup + cooldown) x replicas); lower them")
        self._est = wl.estimates(False)
        engine = cfg.engine()
        _, resolved = resolve_copies([profile] * R, engine, R)
        self._rngs = [np.random.default_rng(None if cfg.seed is None else [cfg.seed, i]) for i in range(E)]
        first = [self._draw(e) for e in range(E)]
        kw = dict(base_router=cfg.base_router, residual_life=wl.residual_life, estimates=[x for _, x in first],
                  scored=[(w.scored_start, w.scored_stop) for w, _ in first])
        if cfg.pd:
            from ..engine.routing import PDRoutingRun
            self.run = PDRoutingRun([w.trace for w, _ in first], profile, cfg.replica_policy(wl.t_ref_ms), engine,
                                    prefill_replicas=cfg.pd[0], decode_replicas=cfg.pd[1],
                                    decode_router=cfg.decode_router, kv_link=cfg.kv_link,
                                    first_token_at=cfg.first_token_at, **kw)
        else:
            cap = routing_capacity([wl.units[u] for u in self._units], resolved, need)
            self.run = RoutingRun([w.trace for w, _ in first], profile, cfg.replica_policy(wl.t_ref_ms), engine,
                                  replicas=R, capacity=cap, **kw)
        self.single_observation_space = spaces.Box(0.0, OBS_HIGH, (obs_dim(cfg.actions),), np.float32)
        self.single_action_space = spaces.Discrete(cfg.actions)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, E)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, E)
        self._needs_reset = np.zeros(E, bool)
        self._ret = np.zeros(E, np.int64)

    # -------------------------------------------------------------- episodes
    def _draw(self, e: int) -> tuple:
        """Cluster e's next episode: (window, its estimates), from its own generator."""
        cfg, wl, rng = self.config, self.workload, self._rngs[e]
        u = self._units[int(rng.integers(len(self._units)))]
        lo, hi = cfg.rho
        rho = float(rng.uniform(lo, hi)) if hi > lo else lo
        R = cfg.replicas
        n = len(wl.units[u])
        start = int(rng.integers(cfg.warmup * R, n - (cfg.window + cfg.cooldown) * R + 1))
        w = wl.window_at(u, rho, start, cfg.window * R, cfg.warmup * R, cfg.cooldown * R)
        est = self._est[u][w.parent_start:w.parent_start + len(w.trace)]
        return w, est

    def _start(self, e: int) -> None:
        w, est = self._draw(e)
        self.run.load(e, w.trace, est, (w.scored_start, w.scored_stop))
        self._ret[e] = 0

    def reset(self, *, seed=None, options=None):
        E = self.num_envs
        if options:
            raise ConfigError(f"reset options: none are supported, got {options!r}")
        if seed is not None:
            seeds = [int(seed) + i for i in range(E)] if is_int(seed) else list(seed)
            if len(seeds) != E or not all(s is None or (is_int(s) and s >= 0) for s in seeds):
                raise ConfigError(f"seed: must be None, an integer >= 0 or {E} of them")
            for e, s in enumerate(seeds):
                if s is not None:   # (cluster e of a vector env seeded s + e = a single env seeded s + e)
                    self._rngs[e] = np.random.default_rng(s)
        for e in range(E):
            self._start(e)
        self._needs_reset[:] = False
        return self._obs(), {}

    # -------------------------------------------------------------- step
    def step(self, actions):
        E = self.num_envs
        a = np.asarray(actions)
        if a.dtype.kind == "f" and a.shape == (E,) and np.isfinite(a).all() and (a == np.round(a)).all():
            a = a.astype(np.int64)   # (whole numbers as floats: what SB3's adapter passes)
        if a.shape != (E,) or a.dtype.kind not in "iu":
            raise ConfigError(f"actions: expected {E} integers in [0, {self.config.actions}), got {actions!r}")
        starting = self._needs_reset.copy()
        run = self.run
        before = run.replaced.copy()
        acting = ~starting & ~run.done
        run.step(a.astype(np.int64), acting)
        rewards = run.credit(np.flatnonzero(acting)).astype(np.float64)
        self._ret += rewards.astype(np.int64)
        terminated = run.done & acting
        infos = {"replaced": (run.replaced - before) * acting}
        if terminated.any():
            scored = run.s1 - run.s0
            infos["episode_goodput"] = np.where(terminated, self._ret / np.maximum(scored, 1), np.nan)
            infos["_episode_goodput"] = terminated.copy()
        for e in np.flatnonzero(starting):
            self._start(e)
        if self.autoreset_mode == gym.vector.AutoresetMode.SAME_STEP and terminated.any():
            infos["final_obs"] = self._obs()
            infos["_final_obs"] = terminated.copy()
            infos["final_info"] = {k: v for k, v in infos.items() if k.endswith("episode_goodput")}
            infos["_final_info"] = terminated.copy()
            for e in np.flatnonzero(terminated):
                self._start(e)
        else:
            self._needs_reset = terminated.copy()
        return self._obs(), rewards, terminated, np.zeros(E, bool), infos

    def action_masks(self, copy: Optional[int] = None) -> np.ndarray:
        """[num_envs, R]: the replicas each cluster's pending arrival may go to (all, once its episode
        ended: the action is ignored); ``copy``: cluster ``copy``'s row alone."""
        m = self.run.mask.copy()
        m[self.run.done] = True
        return m if copy is None else m[copy]

    # -------------------------------------------------------------- observation
    def _obs(self) -> np.ndarray:
        return observe_cluster(self.run)


def observe_cluster(run) -> np.ndarray:
    """The observation of every cluster of ``run`` (an ``engine.routing.RoutingRun``) at its pending
    arrival, [E, 11 R + 4] (``TokenBatchClusterEnv``'s Observation Space; zeros once a cluster is
    done): the env's and the evaluator's (``control.run_routed``) one implementation."""
    R = run.replicas
    v = run.view.astype(np.float64)
    E = v.shape[0]
    f = np.empty((E, R, len(REPLICA_FEATURES)))
    f[..., 0] = np.log1p(v[..., CK.V_RUN]) / LOG_COUNT
    f[..., 1] = np.log1p(v[..., CK.V_WAIT]) / LOG_COUNT
    f[..., 2] = v[..., CK.V_FREE] / run.usable_blocks
    f[..., 3] = np.log1p(v[..., CK.V_QUEUED]) / LOG_TOKENS
    f[..., 4] = np.log1p(np.maximum(v[..., CK.V_OUT], 0)) / LOG_COUNT
    f[..., 5] = np.log1p(v[..., CK.V_REM] / 1e6) / LOG_MS
    i = np.minimum(run.pending, run.route.shape[1] - 1)
    rows = np.arange(E)
    prompt = run.g[1][rows, i].astype(np.float64)
    f[..., 6] = np.minimum(v[..., CK.V_HITS] * run.block_size / np.maximum(prompt, 1)[:, None], 1.0)
    f[..., 7] = np.log1p(v[..., CK.V_SINCE_N]) / LOG_COUNT
    f[..., 8] = np.log1p(v[..., CK.V_SINCE_TOK]) / LOG_TOKENS
    f[..., 9] = np.log1p(run.pred / 1e6) / LOG_MS
    f[..., 10] = run.mask
    est = run.g[7][rows, i]
    req = np.stack([np.log1p(prompt) / LOG_TOKENS, np.log1p(np.nan_to_num(est, nan=0.0)) / LOG_TOKENS,
                    np.log1p(run.g[5][rows, i] / 1e6) / LOG_MS, np.log1p(run.g[6][rows, i] / 1e6) / LOG_MS], 1)
    out = np.concatenate([f.reshape(E, -1), req], 1)
    out[run.done] = 0.0
    return np.clip(out, 0.0, OBS_HIGH).astype(np.float32)


def make_cluster_vector_env(num_envs: int = 1, **kwargs) -> TokenBatchClusterVectorEnv:
    """``gym.make_vec("TokenBatchCluster-v0", num_envs, vectorization_mode="vector_entry_point")``
    (``autoreset_mode`` and ``ClusterEnvConfig``'s fields)."""
    kwargs.pop("render_mode", None)
    return TokenBatchClusterVectorEnv(num_envs, **kwargs)


class TokenBatchClusterEnv(gym.Env):
    """Route every arrival of a cluster of R engine replicas (docs/design.md section 12).

    ## Description
    A cluster of ``replicas`` copies of the engine (vLLM V1's scheduler on ``profile``, each running
    ``policy``) replays a window of a suite trace at load rho. Each step routes one arrival: the
    agent sees the router's view of every replica at that arrival's instant and picks a replica.

    ## Action Space
    ``Discrete(R)``: the replica the pending arrival goes to. ``action_masks()`` gives the allowed
    replicas (those that serve the prompt, ``max_model_len`` > prompt, and have room for its row),
    for MaskablePPO; a masked action is replaced by ``base_router``'s choice and counted in
    ``info["replaced"]``. A P/D cluster (``pd`` = (Rp, Rd), docs/design.md section 13):
    ``Discrete(Rp)``, the prefill replica; each handoff goes to a decode replica by ``decode_router``,
    its KV over ``kv_link``.

    ## Observation Space
    ``Box(0, 4, (11 R + 4,), float32)``: per replica, the router's view of section 12 at the arrival's
    instant (its state at its last iteration boundary, the router's own counters): running, waiting,
    free KV blocks (share of the pool), queued prefill tokens, outstanding requests, the in-flight
    iteration's remaining time, the pending request's cached prefix (share of its prompt), requests and
    prompt tokens routed since the boundary, least-predicted-ttft's predicted TTFT, and whether it may
    take the request; then the request's prompt tokens, estimated output tokens, TTFT and TPOT SLOs.
    Counts, tokens and times (ms) as log1p(x) / log1p(1024), log1p(2^20) and log1p(1e5), clipped to [0, 4].
    A P/D cluster: the prefill replicas' views (11 Rp + 4).

    ## Rewards
    +1 per scored request that completes within both SLOs, at the step in which its end is seen (each
    cluster's requests are credited in arrival order as they end); warm-up and cool-down requests
    are routed but not rewarded. An episode's rewards sum to its scored requests met. A P/D
    cluster's are all given in its last step (a handed-off request's outcome is known on D), its
    first token counted where ``first_token_at`` says.

    ## Starting State
    A window of a random trace of ``suite``/``split`` (``window`` x R scored requests, ``warmup`` x R
    before, ``cooldown`` x R after) at rho drawn uniformly from ``rho``, the replicas empty; the first
    observation is at its first arrival.

    ## Episode End
    Terminated after its last arrival is routed and the replicas have run to the end (its final
    rewards in that step); no truncation.

    ## Arguments
    ``ClusterEnvConfig``'s fields: suite ("seed-200"), split ("train"), profile ("stress-512"),
    replicas (4), rho ((0.8, 1.5)), window (64), warmup (16), cooldown (16), policy ("fcfs"),
    shed_margin (None), base_router ("round-robin"), seed (None), max_traces (None), index (None),
    levers (()), t_ref_ms (None), pd (()), decode_router ("least-kv"), kv_link ("nvlink"),
    first_token_at ("prefill").

    ## Version History
    * v0: first version.
    """

    metadata = {"render_modes": []}

    def __init__(self, render_mode: Optional[str] = None, **kwargs):
        self._vec = TokenBatchClusterVectorEnv(1, **kwargs)
        self.config = self._vec.config
        self.observation_space = self._vec.single_observation_space
        self.action_space = self._vec.single_action_space
        self.render_mode = render_mode

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        obs, _ = self._vec.reset(seed=None if seed is None else [seed], options=options)
        return obs[0], {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ConfigError(f"action: must be an integer in [0, {self.config.actions}), got {action!r}")
        if self._vec.run.done[0]:
            raise ConfigError("step after the episode ended: call reset()")
        obs, r, term, trunc, infos = self._vec.step(np.array([int(action)]))
        self._vec._needs_reset[:] = False   # (no autoreset: the next reset starts the next episode)
        info = {k: v[0] for k, v in infos.items() if not k.startswith("_")}
        return obs[0], float(r[0]), bool(term[0]), bool(trunc[0]), info

    def action_masks(self) -> np.ndarray:
        return self._vec.action_masks()[0]
