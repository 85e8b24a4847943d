"""Stable-Baselines3 adapter: the native ``TokenBatchVectorEnv`` as an SB3 ``VecEnv``.

The one module that imports stable-baselines3, and only lazily (inside ``make_sb3_vec_env`` /
``sb3_vec_env_class``), so ``import tokenbatch_env.sb3`` stays light. No subprocesses: every copy
lives in the one engine batch. The adapter runs the env in SAME_STEP autoreset mode (what SB3
expects): a finished copy is reset inside the same ``step``; its last observation is in
``infos[i]["terminal_observation"]`` and ``infos[i]["TimeLimit.truncated"]`` is True when the episode
was truncated (step or iteration cap) rather than terminated. Episode metrics (``episode_goodput``,
...) are in that copy's info dict. Every array returned is a copy, never an internal buffer.

    from tokenbatch_env.sb3 import make_sb3_vec_env
    venv = make_sb3_vec_env(8, monitor=True, rho=(0.8, 1.5))   # any TokenBatchConfig field
    model = PPO("MlpPolicy", venv, policy_kwargs={"log_std_init": -1.5}, device="cpu")

``monitor=True`` wraps the env in SB3's ``VecMonitor``: without it (or a ``VecMonitor`` of your own)
SB3 records no episode and logs no ``rollout/ep_rew_mean``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

__all__ = ["make_sb3_vec_env", "native_env", "sb3_vec_env_class", "request_set_extractor_class", "load_agent",
           "EPISODE_INFO_KEYWORDS"]

_CLASS = None
_EXTRACTOR = None


_SCORERS: dict = {}

#: the routing agents' algorithms (``tokenbatch train-router --algo``)
ROUTER_ALGOS = ("ppo", "maskable-ppo")


def __getattr__(name):  # the lazily built classes, importable by name (so saved models unpickle)
    if name == "RequestSetExtractor":
        return request_set_extractor_class()
    if name in ("ReplicaScorerPolicy", "MaskableReplicaScorerPolicy"):
        return replica_scorer_policy_class(name.startswith("Maskable"))
    raise AttributeError(name)


def router_algo_class(algo: str):
    """The SB3 algorithm of a router agent: PPO or sb3-contrib's MaskablePPO."""
    if algo == "maskable-ppo":
        from sb3_contrib import MaskablePPO
        return MaskablePPO
    from stable_baselines3 import PPO
    return PPO


def replica_scorer_policy_class(maskable: bool = False):
    """``ReplicaScorerPolicy`` (``MaskableReplicaScorerPolicy`` for MaskablePPO): an actor-critic
    policy for TokenBatchCluster-v0 whose actor scores every replica with one shared MLP, so that
    it treats the replicas alike (permuting them permutes the action's probabilities). Replica c's
    score reads its 11 features, their mean over the replicas and the request's 4; the logits are the
    scores, less ``prior`` (learned, from its initial value) x the replica's outstanding feature:
    least-outstanding's preference, a start the actor refines. The critic is an MLP on the whole
    observation (``net_arch``'s ``vf``; the actor's ``pi`` must be empty: its input is the
    observation). ``replicas``: R; ``hidden``: the scorer's width."""
    if maskable in _SCORERS:
        return _SCORERS[maskable]
    import torch
    from torch import nn

    from .envs.cluster_env import REPLICA_FEATURES, REQUEST_FEATURES
    if maskable:
        from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy as Base
    else:
        from stable_baselines3.common.policies import ActorCriticPolicy as Base
    F, Q = len(REPLICA_FEATURES), len(REQUEST_FEATURES)

    OUT = REPLICA_FEATURES.index("outstanding")

    class ReplicaScores(nn.Module):
        def __init__(self, replicas: int, hidden: int, prior: float):
            super().__init__()
            self.R = int(replicas)
            self.net = nn.Sequential(nn.Linear(2 * F + Q, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                     nn.Linear(hidden, 1))
            self.prior = nn.Parameter(torch.tensor(float(prior)))

        def forward(self, x):
            rep = x[:, :self.R * F].reshape(-1, self.R, F)
            ctx = torch.cat([rep.mean(dim=1), x[:, self.R * F:]], dim=1).unsqueeze(1).expand(-1, self.R, -1)
            # (the prior: least-outstanding's preference, -prior x the replica's outstanding feature)
            return self.net(torch.cat([rep, ctx], dim=2)).squeeze(-1) - self.prior * rep[..., OUT]

    class Policy(Base):
        def __init__(self, *args, replicas: int = 4, hidden: int = 64, prior: float = 0.0, **kwargs):
            self.scorer_replicas, self.scorer_hidden, self.scorer_prior = int(replicas), int(hidden), float(prior)
            super().__init__(*args, **kwargs)

        def _build(self, lr_schedule) -> None:
            super()._build(lr_schedule)
            if self.mlp_extractor.latent_dim_pi != self.scorer_replicas * F + Q:
                raise ValueError(f"{type(self).__name__}: the actor's input must be the observation "
                                 f"({self.scorer_replicas * F + Q} features; net_arch pi=[]), got "
                                 f"{self.mlp_extractor.latent_dim_pi}")
            self.action_net = ReplicaScores(self.scorer_replicas, self.scorer_hidden, self.scorer_prior)
            self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

        def _get_constructor_parameters(self) -> dict:
            return {**super()._get_constructor_parameters(), "replicas": self.scorer_replicas,
                    "hidden": self.scorer_hidden, "prior": self.scorer_prior}

    name = "MaskableReplicaScorerPolicy" if maskable else "ReplicaScorerPolicy"
    Policy.__module__, Policy.__qualname__, Policy.__name__ = __name__, name, name
    _SCORERS[maskable] = Policy
    return Policy


def load_router_agent(model_path: str, algo: str, vecnormalize_path: Optional[str] = None,
                      observation_space=None, action_space=None):
    """A saved router agent (``tokenbatch train-router``) as ``predict(obs [E, D], masks [E, R]) ->
    replicas [E]`` (deterministic: the most probable replica; MaskablePPO's among the mask), with
    the saved observation normalisation. One torch thread."""
    import torch
    torch.set_num_threads(1)
    custom = {"policy_class": replica_scorer_policy_class(algo == "maskable-ppo")} \
        if _saved_policy_is_scorer(model_path) else {}
    model, norm = _load_saved(router_algo_class(algo), algo, model_path, vecnormalize_path, custom,
                              observation_space, action_space)
    return router_predictor(model, norm, algo == "maskable-ppo")


def router_predictor(model, norm, maskable: bool):
    """``predict(obs [E, D], masks [E, R]) -> replicas [E]`` of a router model: observations
    normalised by ``norm`` (a VecNormalize, or None), the most probable replica (MaskablePPO's among
    the mask). The saved agent's (``load_router_agent``) and the trainer's validation replays'."""
    def predict(obs, masks):
        x = np.asarray(obs, np.float32)
        if norm is not None:
            x = norm.normalize_obs(x)
        kw = {"action_masks": np.asarray(masks, bool)} if maskable else {}
        actions, _ = model.predict(x, deterministic=True, **kw)
        return np.asarray(actions, np.int64)

    return predict


def _saved_policy_is_scorer(model_path: str) -> bool:
    """Whether a saved model's policy class is a replica scorer (read from its zip's ``data``)."""
    import json
    import zipfile
    try:
        with zipfile.ZipFile(model_path) as z:
            data = json.loads(z.read("data"))
    except Exception:  # noqa: BLE001 - not ours to diagnose here: the load says what is wrong
        return False
    return "ReplicaScorerPolicy" in json.dumps(data.get("policy_class", ""))


def _unbatch_all(infos: dict, n: int, only: Optional[np.ndarray] = None) -> list:
    """Per copy, its entries of a gymnasium vector-info dict (keys with their ``_key`` mask set; nested
    dicts likewise; numpy scalars as Python ones, arrays copied): one pass per key over the copies
    it is set for (and, given the mask ``only``, that ``only`` selects; the others get ``{}``)."""
    out = [{} for _ in range(n)]
    for k, v in infos.items():
        if k.startswith("_") or k in ("final_obs", "final_info"):
            continue
        if isinstance(v, dict):
            for c, sub in enumerate(_unbatch_all(v, n, only)):
                if sub:
                    out[c][k] = sub
            continue
        mask = infos.get(f"_{k}")
        if only is not None:
            mask = only if mask is None else mask & only
        for c in (range(n) if mask is None else np.flatnonzero(mask).tolist()):
            x = v[c]
            out[c][k] = x.item() if isinstance(x, np.generic) else (x.copy() if isinstance(x, np.ndarray) else x)
    return out


def sb3_vec_env_class():
    """The adapter class (built on first use, so stable-baselines3 is imported only then)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from gymnasium.vector import AutoresetMode
    from stable_baselines3.common.vec_env import VecEnv

    from .envs import ActionError, as_numbers
    from .errors import ConfigError

    class TokenBatchSB3VecEnv(VecEnv):
        """SB3 ``VecEnv`` over a ``TokenBatchVectorEnv`` in SAME_STEP autoreset mode.

        ``get_attr``/``set_attr`` read and write attributes of the native vector env (shared by all
        copies, so the value is repeated per index); ``env_method`` calls a method of the native
        env once per index, passing ``copy=i`` to methods that take it (``episode_records``)."""

        def __init__(self, venv):
            if venv.autoreset_mode != AutoresetMode.SAME_STEP:
                raise ConfigError("the SB3 adapter needs autoreset_mode SAME_STEP, got "
                                  f"{venv.autoreset_mode}")
            self.venv = venv
            self._actions: Optional[np.ndarray] = None
            super().__init__(venv.num_envs, venv.single_observation_space, venv.single_action_space)

        # ---------------------------------------------------------------- core API
        def reset(self):
            seeds = list(self._seeds)
            obs, infos = self.venv.reset(seed=seeds if any(s is not None for s in seeds) else None)
            self.reset_infos = _unbatch_all(infos, self.num_envs)
            self._reset_seeds()
            self._reset_options()
            return np.array(obs, copy=True)

        def step_async(self, actions: np.ndarray) -> None:
            a = as_numbers(actions)   # (a new array: the caller's is never kept)
            shape = (self.num_envs, *self.action_space.shape)
            if a.size != math.prod(shape):
                raise ActionError(f"actions must have shape {shape}, got {a.shape}")
            self._actions = a.reshape(shape)

        def step_wait(self):
            if self._actions is None:
                raise ConfigError("step_wait() called without step_async()")
            # (the native step returns fresh arrays, not its buffers: no further copies needed)
            obs, rew, term, trunc, infos = self.venv.step(self._actions)
            self._actions = None
            dones = term | trunc
            out = _unbatch_all(infos, self.num_envs)
            ended = np.flatnonzero(dones).tolist()
            if ended:
                final = _unbatch_all(infos["final_info"], self.num_envs, dones)
                final_obs = infos["final_obs"]
                for c in ended:
                    d = out[c]
                    d.update(final[c])
                    d["terminal_observation"] = np.array(final_obs[c], copy=True)
                    d["TimeLimit.truncated"] = bool(trunc[c] and not term[c])
            return obs, rew.astype(np.float32), dones, out

        def close(self) -> None:
            self.venv.close()

        # ---------------------------------------------------------------- attributes & methods
        def get_attr(self, attr_name: str, indices=None) -> list:
            idx = list(self._get_indices(indices))
            val = getattr(self.venv, attr_name)
            return [val for _ in idx]

        def set_attr(self, attr_name: str, value: Any, indices=None) -> None:
            setattr(self.venv, attr_name, value)

        def env_method(self, method_name: str, *method_args, indices=None, **method_kwargs) -> list:
            import inspect
            fn = getattr(self.venv, method_name)
            takes_copy = "copy" in inspect.signature(fn).parameters
            return [fn(*method_args, **({"copy": i} if takes_copy else {}), **method_kwargs)
                    for i in self._get_indices(indices)]

        def env_is_wrapped(self, wrapper_class, indices=None) -> list:
            return [False for _ in self._get_indices(indices)]

        def get_images(self):
            return [None for _ in range(self.num_envs)]

    _CLASS = TokenBatchSB3VecEnv
    return _CLASS


#: a finished episode's metrics in its info dict, kept by ``monitor=True`` in SB3's episode buffer
EPISODE_INFO_KEYWORDS = ("episode_goodput", "episode_shed", "episode_ttft_p99_ms")


def make_sb3_vec_env(num_envs: int = 1, *, monitor: bool = False, **config):
    """An SB3 ``VecEnv`` of ``num_envs`` TokenBatch-v0 copies (config: ``TokenBatchConfig`` fields
    and ``threads``, the native env's engine threads; ``autoreset_mode`` is forced to SAME_STEP).

    ``monitor=True`` wraps it in SB3's ``VecMonitor`` (``info_keywords``: ``EPISODE_INFO_KEYWORDS``),
    which is what puts each finished episode's return and length (and these metrics) into the
    model's ``ep_info_buffer``, hence ``rollout/ep_rew_mean`` in SB3's logs. Without it (the
    default, for code that wraps the env itself) SB3 logs no episode reward at all. ``native_env``
    reaches the ``TokenBatchVectorEnv`` under either."""
    from gymnasium.vector import AutoresetMode

    from .envs import TokenBatchVectorEnv, autoreset_mode_of
    am = config.pop("autoreset_mode", AutoresetMode.SAME_STEP)
    if autoreset_mode_of(am) != AutoresetMode.SAME_STEP:
        from .errors import ConfigError
        raise ConfigError(f"autoreset_mode: the SB3 adapter needs SAME_STEP, got {am!r}")
    venv = sb3_vec_env_class()(TokenBatchVectorEnv(num_envs, autoreset_mode=AutoresetMode.SAME_STEP, **config))
    if monitor:
        from stable_baselines3.common.vec_env import VecMonitor
        return VecMonitor(venv, info_keywords=EPISODE_INFO_KEYWORDS)
    return venv


def make_sb3_cluster_vec_env(num_envs: int = 1, *, monitor: bool = False, **config):
    """An SB3 ``VecEnv`` of ``num_envs`` TokenBatchCluster-v0 clusters (``ClusterEnvConfig``'s fields),
    the same adapter in SAME_STEP mode; MaskablePPO reads the masks through ``env_method("action_masks")``.
    ``monitor=True``: SB3's ``VecMonitor`` with ``episode_goodput``."""
    from gymnasium.vector import AutoresetMode

    from .envs.cluster_env import TokenBatchClusterVectorEnv
    venv = sb3_vec_env_class()(TokenBatchClusterVectorEnv(num_envs, autoreset_mode=AutoresetMode.SAME_STEP, **config))
    if monitor:
        from stable_baselines3.common.vec_env import VecMonitor
        return VecMonitor(venv, info_keywords=("episode_goodput",))
    return venv


def native_env(venv):
    """The native vector env (``TokenBatchVectorEnv``, ``TokenBatchClusterVectorEnv``) under an SB3 vec
    env made by ``make_sb3_vec_env`` or ``make_sb3_cluster_vec_env`` (through any
    wrappers that keep the wrapped env as ``.venv``: VecMonitor, VecNormalize, ...); ValueError if
    there is none."""
    from .envs import TokenBatchVectorEnv
    from .envs.cluster_env import TokenBatchClusterVectorEnv
    v = venv
    while v is not None:
        if isinstance(v, (TokenBatchVectorEnv, TokenBatchClusterVectorEnv)):
            return v
        v = getattr(v, "venv", None)
    raise ValueError(f"no TokenBatchVectorEnv under {type(venv).__name__}")


def request_set_extractor_class():
    """``RequestSetExtractor``: a set-structured SB3 features extractor for TokenBatch-v0 and -v1
    observations. One encoder (shared weights) embeds each of the K observed waiting requests; a
    masked mean and a masked max pool them (order- and padding-invariant); the pooled vectors and
    the engine + queue summary (and v1's TPOT state) go through an MLP. ``features_extractor_kwargs``:
    ``k`` (the env's K), ``embed`` (per-request width, 32), ``features_dim`` (128); the version is
    told by the observation's size."""
    global _EXTRACTOR
    if _EXTRACTOR is not None:
        return _EXTRACTOR
    import torch
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
    from torch import nn

    from .envs import F, N_GLOBAL, obs_dim
    from .envs.observation import N_TPOT

    class RequestSetExtractor(BaseFeaturesExtractor):
        def __init__(self, observation_space, k: int = 8, embed: int = 32, features_dim: int = 128):
            super().__init__(observation_space, features_dim)
            self.k, self.g = int(k), N_GLOBAL
            size = observation_space.shape[0]
            if size not in (obs_dim(self.k), obs_dim(self.k, True)):
                raise ValueError(f"RequestSetExtractor(k={k}) does not fit observations of size {size} (expected "
                                 f"{obs_dim(self.k)}, or {obs_dim(self.k, True)} for TokenBatch-v1)")
            self.extra = N_TPOT if size == obs_dim(self.k, True) else 0   # v1's TPOT state, after the requests
            self.encoder = nn.Sequential(nn.Linear(F, embed), nn.Tanh(), nn.Linear(embed, embed), nn.Tanh())
            self.head = nn.Sequential(nn.Linear(self.g + self.extra + 2 * embed, features_dim), nn.Tanh())

        def forward(self, obs):
            g, k = self.g, self.k
            glob = obs[:, :g]
            req = obs[:, g:g + k * F].reshape(-1, k, F)
            valid = (obs[:, g + k * F:g + k * (F + 1)] > 0.5).unsqueeze(-1)
            e = self.encoder(req)
            n = valid.sum(dim=1).clamp(min=1)
            mean = (e * valid).sum(dim=1) / n
            mx = torch.where(valid, e, torch.full_like(e, -1.0)).max(dim=1).values   # tanh >= -1
            parts = [glob, mean, mx]
            if self.extra:
                parts.insert(1, obs[:, g + k * (F + 1):])
            return self.head(torch.cat(parts, dim=1))

    RequestSetExtractor.__module__ = __name__
    RequestSetExtractor.__qualname__ = "RequestSetExtractor"
    _EXTRACTOR = RequestSetExtractor
    return _EXTRACTOR


def load_agent(model_path: str, vecnormalize_path: Optional[str] = None, observation_space=None,
               action_space=None):
    """A saved PPO agent as ``predict(obs [n, D]) -> actions [n, A]`` (deterministic: the mean
    action), applying the saved observation normalisation (VecNormalize statistics) if given.
    One torch thread (several thrash on small machines)."""

    import torch
    from stable_baselines3 import PPO

    torch.set_num_threads(1)
    request_set_extractor_class()
    model, norm = _load_saved(PPO, "PPO", model_path, vecnormalize_path, {}, observation_space, action_space)

    def predict(obs):
        x = np.asarray(obs, np.float32)
        if norm is not None:
            x = norm.normalize_obs(x)
        actions, _ = model.predict(x, deterministic=True)
        return np.asarray(actions, np.float64)

    return predict


def _load_saved(cls, name: str, model_path: str, vecnormalize_path: Optional[str], custom: dict, observation_space,
                action_space) -> tuple:
    """(model, VecNormalize or None): ``cls.load`` of a saved agent on the CPU (``custom``: SB3's
    ``custom_objects``, with the spaces when given) and its observation statistics in evaluation mode;
    a file that does not load is one ``ConfigError`` naming it."""
    import pickle

    from .errors import ConfigError
    if observation_space is not None:
        custom = {**custom, "observation_space": observation_space, "action_space": action_space}
    try:
        model = cls.load(model_path, device="cpu", custom_objects=custom)
    except Exception as e:  # noqa: BLE001 - a corrupt zip, or weights of another env's spaces
        raise ConfigError(f"{model_path}: cannot load the {name} model ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
    norm = None
    if vecnormalize_path is not None:
        try:
            with open(vecnormalize_path, "rb") as f:
                norm = pickle.load(f)
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign pickle
            raise ConfigError(f"{vecnormalize_path}: cannot load the normalisation statistics "
                              f"({type(e).__name__}: {e})") from None
        norm.training = False
    return model, norm
