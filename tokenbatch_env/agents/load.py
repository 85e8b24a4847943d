"""Trained PPO agents as controllers (docs/design.md section 8): the files of a ``tokenbatch train``
run (or a model.zip with its env's settings) checked without loading anything (``agent_files``),
the leaderboard's labels (``agent_labels``), what a user should know before trusting a row
(``agent_warnings``), and ``agent_spec``: an agent as a ``control.ControlSpec`` row that the
evaluator replays like any controller. The model itself is loaded lazily, through
``tokenbatch_env.sb3`` (torch and stable-baselines3, the ``rl`` extra), when the row runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from .._io import sha256_file
from ..control import ControlSpec, policy_spec
from ..errors import ConfigError

__all__ = ["agent_files", "agent_labels", "agent_spec", "agent_warnings", "is_router_agent", "router_agent"]


def agent_files(model_path: str, option: str = "--model", env_config: Optional[str] = None,
                vecnormalize: Optional[str] = None) -> tuple:
    """The files of a trained PPO agent (``tokenbatch train`` / agents/train_ppo.py output:
    ``<dir>/model.zip``, ``config.json`` and optionally ``vecnormalize.pkl``), checked without
    loading anything (a clear error naming ``option``, the flag that gave the path): (model,
    vecnormalize or None, the env config's keywords, the digests of the model, the statistics and the
    base parameters' file).

    A model saved otherwise (any SB3 PPO ``model.zip`` trained on TokenBatch-v0 through
    ``tokenbatch_env.sb3``) has no config.json: ``env_config`` then names a JSON file with the env's
    ``TokenBatchConfig`` fields (or a train config.json, whose ``"env"`` is read), used instead of
    the one beside the model, and ``vecnormalize`` its ``VecNormalize.save`` statistics, if any."""
    p = Path(model_path)
    d = p.parent if p.suffix == ".zip" else p
    model = p if p.suffix == ".zip" else d / "model.zip"
    if not model.is_file():
        raise ConfigError(f"{option} {model_path}: no model file {model}")
    if env_config is not None:
        return _plain_agent_files(model, env_config, vecnormalize)
    if vecnormalize is not None:
        raise ConfigError("--vecnormalize goes with --env-config (an agent directory's statistics are its "
                          "vecnormalize.pkl)")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        hint = ("; for a model.zip saved otherwise, give the env's settings with --env-config FILE.json "
                "(and its VecNormalize statistics with --vecnormalize FILE)") if option == "--model" else ""
        raise ConfigError(f"{option} {model_path}: no config.json beside the model (written by tokenbatch train "
                          f"/ train_ppo.py){hint}")
    try:
        train = json.loads(cfg_file.read_text())
        env_kw = dict(train["env"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{cfg_file}: not a train_ppo.py config ({e})") from None
    norm = d / "vecnormalize.pkl"
    norm = norm if norm.is_file() else None
    model_sha, norm_sha = sha256_file(model), sha256_file(norm) if norm else None
    files = train.get("files")
    if isinstance(files, dict):   # (checkpoints from before the digests have none: loaded as they are)
        if files.get("vecnormalize.pkl") is None:
            norm, norm_sha = None, None      # trained without normalisation: a stray file is not its own
        if model_sha != files.get("model.zip") or norm_sha != files.get("vecnormalize.pkl"):
            raise ConfigError(f"{option} {model_path}: the files in {d} are not the set config.json was saved "
                              "with (model.zip or vecnormalize.pkl missing or from another save; was the "
                              "training killed while saving?): use another checkpoint or train again")
    base, base_sha = env_kw.get("base_params"), None
    if base is not None:
        if not Path(base).is_file():
            raise ConfigError(f"{option} {model_path}: the agent's base parameters {base!r} (base_params in "
                              f"{cfg_file}) are not found")
        base_sha = sha256_file(base)
        want = train.get("base_params_sha256")   # (agents saved before the digest have none)
        if want is not None and base_sha != want:
            raise ConfigError(f"{option} {model_path}: its base parameters {base} changed since the training "
                              f"(the actions are residuals around them): restore the file or train again")
    return model, norm, env_kw, model_sha, norm_sha, base_sha


def _plain_agent_files(model: Path, env_config: str, vecnormalize: Optional[str]) -> tuple:
    """``agent_files`` for a model.zip with its env settings in ``env_config`` (--env-config)."""
    from ..envs import TokenBatchConfig
    try:
        doc = json.loads(Path(env_config).read_text())
    except OSError as e:
        raise ConfigError(f"--env-config {env_config}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--env-config {env_config}: not JSON ({e})") from None
    train = doc if isinstance(doc, dict) and isinstance(doc.get("env"), dict) else {}
    env_kw = train.get("env", doc)
    if not isinstance(env_kw, dict):
        raise ConfigError(f"--env-config {env_config}: must be a JSON object of TokenBatchConfig fields "
                          '(e.g. {"suite": "seed-200", "window": 128, "action_mode": "index"})')
    valid = [f.name for f in dataclasses.fields(TokenBatchConfig)]
    bad = sorted(k for k in env_kw if k not in valid)
    if bad:
        raise ConfigError(f"--env-config {env_config}: unknown TokenBatchConfig field(s) {', '.join(bad)}; "
                          f"valid: {', '.join(valid)}")
    # the fields the evaluation reads (its default suite and profile, the warnings) are filled in
    env_kw = {f: getattr(TokenBatchConfig, f) for f in ("suite", "split", "profile")} | env_kw
    norm = None
    if vecnormalize is not None:
        norm = Path(vecnormalize)
        if not norm.is_file():
            raise ConfigError(f"--vecnormalize {vecnormalize}: no such file")
    base, base_sha = env_kw.get("base_params"), None
    if base is not None:
        if not Path(base).is_file():
            raise ConfigError(f"--env-config {env_config}: base_params {base!r} not found")
        base_sha = sha256_file(base)
        want = train.get("base_params_sha256")
        if want is not None and base_sha != want:
            raise ConfigError(f"--env-config {env_config}: the base parameters {base} changed since the training "
                              "(the actions are residuals around them): restore the file or train again")
    return model, norm, env_kw, sha256_file(model), sha256_file(norm) if norm else None, base_sha


def agent_warnings(env_kw: dict, label: str, suite: str, split: str, profile: str) -> list:
    """What a user should know before trusting an agent's row (not errors: the comparison still runs):
    the agent trained on the split it is judged on (not held out), or on another suite or profile."""
    out = []
    if env_kw.get("suite") == suite and env_kw.get("split") == split:
        out.append(f"{label} was trained on {suite}/{split}, the split it is judged on: not held out")
    for what, judged in (("suite", suite), ("profile", profile)):
        if env_kw.get(what) not in (None, judged):
            out.append(f"{label} was trained with {what} {env_kw.get(what)!r} and is judged with {judged!r}")
    return out


def agent_labels(paths, prefixes=None) -> list:
    """Leaderboard labels of agents given by path: ``ppo:<dir>``, or ``ppo:<parent>/<dir>`` for all
    when two would share one (``<run>/best`` of two runs); ``prefixes``: each agent's instead of
    ``ppo:``; ``ConfigError`` for the same agent twice."""
    dirs = [(Path(p).parent if Path(p).suffix == ".zip" else Path(p)).resolve() for p in paths]
    pre = list(prefixes) if prefixes is not None else ["ppo:"] * len(dirs)
    if len(set(dirs)) < len(dirs):
        raise ConfigError(f"agents: the same agent given twice: {[str(p) for p in paths]}")
    labels = [f"{x}{d.name}" for x, d in zip(pre, dirs)]
    if len(set(labels)) < len(labels):
        labels = [f"{x}{d.parent.name}/{d.name}" for x, d in zip(pre, dirs)]
    if len(set(labels)) < len(labels):
        labels = [f"{x}{d}" for x, d in zip(pre, dirs)]
    return labels


def agent_spec(model_path: str, label: Optional[str] = None, option: str = "--model",
               env_config: Optional[str] = None, vecnormalize: Optional[str] = None) -> ControlSpec:
    """A trained PPO agent (``agent_files``; ``env_config`` and ``vecnormalize`` for a model.zip
    without config.json) as a deterministic controller (mean action). Needs torch and
    stable-baselines3 (the ``rl`` extra); loaded lazily through ``tokenbatch_env.sb3``."""
    from ..envs import TokenBatchConfig

    model, norm, env_kw, model_sha, norm_sha, base_sha = agent_files(model_path, option, env_config, vecnormalize)
    d = model.parent
    env_cfg = TokenBatchConfig(**{k: v for k, v in env_kw.items() if k in
                                  {f.name for f in dataclasses.fields(TokenBatchConfig)}})
    from ..envs import TokenBatchVectorEnv
    probe = TokenBatchVectorEnv(1, env_cfg)       # theta*, the base margin, spaces
    core = probe.core
    base_margin, mode = core.base_margin, env_cfg.action_mode
    base = core.base_params if mode == "index" else core.base_weights
    obs_space, act_space = probe.single_observation_space, probe.single_action_space
    probe.close()
    digests = (("model_sha256", model_sha),
               ("vecnormalize_sha256", norm_sha),
               ("base_params_sha256", base_sha),
               ("env", json.dumps(env_kw, sort_keys=True, default=str)))

    def load():
        from ..sb3 import load_agent
        return load_agent(str(model), None if norm is None else str(norm), obs_space, act_space)

    return policy_spec(label or f"ppo:{d.name}", mode, base, base_margin, env_cfg.k, env_cfg.decision_interval_ms,
                       load, digests, shed_action=env_cfg.shed_action, guard=core.base_guard)


# ------------------------------------------------------------------------------ routers
def is_router_agent(model_path: str) -> bool:
    """Whether ``model_path`` (an agent directory or a model.zip in one) is a router
    (``tokenbatch train-router``: config.json's ``env["kind"]`` is ``"cluster"``)."""
    p = Path(model_path)
    cfg_file = (p.parent if p.suffix == ".zip" else p) / "config.json"
    try:
        env = json.loads(cfg_file.read_text()).get("env")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(env, dict) and env.get("kind") == "cluster"


def router_agent(model_path: str, label: Optional[str] = None, option: str = "--model"):
    """A trained router (``tokenbatch train-router``'s directory) as a ``control.RouterAgent``: its
    files checked as ``agent_files`` checks them, its env (``envs.ClusterEnvConfig``) rebuilt from
    config.json, the model loaded lazily (``sb3.load_router_agent``) when its row runs."""
    from ..control import RouterAgent
    from ..envs.cluster_env import OBS_HIGH, ClusterEnvConfig, obs_dim

    model, norm, env_kw, model_sha, norm_sha, _ = agent_files(model_path, option)
    doc = json.loads((model.parent / "config.json").read_text())
    algo = doc.get("algo")
    from ..sb3 import ROUTER_ALGOS
    if algo not in ROUTER_ALGOS:
        raise ConfigError(f"{option} {model_path}: config.json names no router algorithm ({', '.join(ROUTER_ALGOS)}), "
                          f"got {algo!r}")
    fields = {f.name for f in dataclasses.fields(ClusterEnvConfig)}
    env = ClusterEnvConfig(**{k: tuple(v) if k in ("rho", "pd") else v for k, v in env_kw.items() if k in fields})
    import gymnasium as gym
    import numpy as np
    obs_space = gym.spaces.Box(0.0, OBS_HIGH, (obs_dim(env.actions),), np.float32)
    act_space = gym.spaces.Discrete(env.actions)

    def make():
        from ..sb3 import load_router_agent
        return load_router_agent(str(model), algo, None if norm is None else str(norm), obs_space, act_space)

    evidence = (("model_sha256", model_sha), ("vecnormalize_sha256", norm_sha), ("algo", algo))
    return RouterAgent(label or f"{algo}:{model.parent.name}", env, make, evidence)
