"""Controllers: policies whose parameters change at decision epochs (docs/design.md sections 5 and 8).

A controller sees the env's observation (``envs.TokenBatchEnv``) at each decision epoch and
returns the engine's parameter vectors. ``run_controlled`` replays traces under a controller with
the env's epoch rules, so the evaluator judges an agent or ``index-scheduled`` on exactly the
traces, loads and random streams of the static baselines. One engine, one epoch driver
(``EngineRun.advance_to_decision``), one observation code path (``envs.observe``), one action map
(``envs.map_actions``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ._io import sha256_file
from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ControlSpec:
    """A controller row of the leaderboard. ``make(t_ref_ms)`` builds the controller: a callable
    ``obs [m, D] -> (theta [m, N_THETA], shed margin [m], -1 = off)``. ``action_mode`` names the
    in-engine policy the parameters are for (``index`` or ``weights``); ``base`` is its parameters
    before the first decision (IndexParams or LinearWeights) and ``base_margin`` the shed margin
    (None = off). ``evidence``: what identifies the controller (enters the evidence id)."""

    label: str
    action_mode: str
    base: Any
    base_margin: Optional[float]
    k: int
    decision_interval_ms: float
    make: Callable = dataclasses.field(compare=False, repr=False)
    evidence: tuple = ()


def run_controlled(traces, profile, config, spec: ControlSpec, *, estimates=None, residual_life=None,
                   t_ref_ms: float, lambda_sat: float):
    """Replay ``traces`` (one engine copy each, stepped together) under ``spec``'s controller with the
    env's epoch rules: the controller decides at the start and then at every epoch boundary
    (``decision_interval_ms`` after the start, first iteration boundary at or after it) where a
    decision is needed (>= 2 waiting, or a sheddable request); parameters are held in between.
    Returns the ``SimResult`` of the whole replay."""
    from .engine.simulate import EngineRun
    from .envs import obs_dim, obs_scales, observe
    from .policies import engine_policy

    ctrl = spec.make(t_ref_ms)
    kw = {"params": spec.base} if spec.action_mode == "index" else {"weights": spec.base}
    pol = engine_policy(spec.action_mode, shed_margin=spec.base_margin, t_ref_ms=t_ref_ms, **kw)
    run = EngineRun(traces, profile, pol, config, estimates=estimates, residual_life=residual_life)
    N = run.n_copies
    run.start_epochs(interval_ns=max(1, int(round(spec.decision_interval_ms * 1e6))),
                     shed_on=spec.base_margin is not None)
    ocfg = obs_scales(t_ref_ms, lambda_sat)
    obs = np.zeros((N, obs_dim(spec.k)), np.float32)
    theta, margin = run.theta.copy(), run.shed_margin.copy()
    ask = np.ones(N, bool)
    observe(run, ask, obs, spec.k, ocfg)
    while True:
        ask &= ~run.done
        if ask.any():
            th, m = ctrl(obs[ask].copy())
            theta[ask], margin[ask] = th, m
            run.set_policy_params(theta, margin)
        ask = ~run.done
        if not ask.any():
            return run.result()
        run.advance_to_decision(ask)   # every request is scored: a copy stops at a decision or its end
        observe(run, ask, obs, spec.k, ocfg)


# ------------------------------------------------------------------------------ index-scheduled
def schedule_spec(schedule, *, k: int = 8, decision_interval_ms: float = 100.0) -> ControlSpec:
    """``index-scheduled``: at each decision, the bucket of the observed arrival rate (the
    observation's ``arrival_rate`` entry, arrivals in the last 10 s / lambda_sat) picks its tuned
    index and shed margin (``policies.IndexSchedule``)."""
    from .envs import OBS_LAYOUT

    col = OBS_LAYOUT.index("arrival_rate_rho")

    def make(t_ref_ms):
        thetas = np.stack([p.theta_vector(t_ref_ms) for p in schedule.params])
        margins = np.array([-1.0 if m is None else m for m in schedule.margins])

        def ctrl(obs):
            b = schedule.bucket(obs[:, col])
            return thetas[b], margins[b]
        return ctrl

    mid = len(schedule.params) // 2
    return ControlSpec("index-scheduled", "index", schedule.params[mid], schedule.margins[mid], k,
                       decision_interval_ms, make,
                       (("index-scheduled", json.dumps(schedule.to_dict(), sort_keys=True)),))


# ------------------------------------------------------------------------------ trained agents
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
    from .envs import TokenBatchConfig
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


def agent_labels(paths) -> list:
    """Leaderboard labels of agents given by path: ``ppo:<dir>``, or ``ppo:<parent>/<dir>`` for all
    when two would share one (``<run>/best`` of two runs); ``ConfigError`` for the same agent twice."""
    dirs = [(Path(p).parent if Path(p).suffix == ".zip" else Path(p)).resolve() for p in paths]
    if len(set(dirs)) < len(dirs):
        raise ConfigError(f"agents: the same agent given twice: {[str(p) for p in paths]}")
    labels = [f"ppo:{d.name}" for d in dirs]
    if len(set(labels)) < len(labels):
        labels = [f"ppo:{d.parent.name}/{d.name}" for d in dirs]
    if len(set(labels)) < len(labels):
        labels = [f"ppo:{d}" for d in dirs]
    return labels


def agent_spec(model_path: str, label: Optional[str] = None, option: str = "--model",
               env_config: Optional[str] = None, vecnormalize: Optional[str] = None) -> ControlSpec:
    """A trained PPO agent (``agent_files``; ``env_config`` and ``vecnormalize`` for a model.zip
    without config.json) as a deterministic controller (mean action). Needs torch and
    stable-baselines3 (the ``rl`` extra); loaded lazily through ``tokenbatch_env.sb3``."""
    from .envs import TokenBatchConfig

    model, norm, env_kw, model_sha, norm_sha, base_sha = agent_files(model_path, option, env_config, vecnormalize)
    d = model.parent
    env_cfg = TokenBatchConfig(**{k: v for k, v in env_kw.items() if k in
                                  {f.name for f in dataclasses.fields(TokenBatchConfig)}})
    from .envs import TokenBatchVectorEnv
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
        from .sb3 import load_agent
        return load_agent(str(model), None if norm is None else str(norm), obs_space, act_space)

    return policy_spec(label or f"ppo:{d.name}", mode, base, base_margin, env_cfg.k, env_cfg.decision_interval_ms,
                       load, digests, shed_action=env_cfg.shed_action)


def policy_spec(label: str, mode: str, base, base_margin, k: int, decision_interval_ms: float,
                load_predict: Callable, evidence: tuple = (), shed_action: bool = True) -> ControlSpec:
    """A controller from an action policy: ``load_predict()`` gives ``predict(obs) -> actions`` in
    the env's action space (``mode``; without the shed-margin column unless ``shed_action``), mapped
    around ``base`` like the env does (``envs.map_actions``)."""
    def make(t_ref_ms):
        from .envs import map_actions
        ts = base.theta_vector(t_ref_ms)
        predict = load_predict()
        return lambda obs: map_actions(np.clip(predict(obs), -1.0, 1.0), mode, ts, base_margin, shed_action)

    return ControlSpec(label, mode, base, base_margin, k, decision_interval_ms, make, evidence)
