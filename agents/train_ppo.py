#!/usr/bin/env python
"""Train a PPO agent (stable-baselines3) on TokenBatch-v0 as a challenger to the tuned index.

    python agents/train_ppo.py                                  # index mode, MLP, small default budget
    python agents/train_ppo.py --policy set --timesteps 500000 --base-params runs/tune/best_params.json
    python agents/train_ppo.py --action-mode weights --out runs/ppo-weights
    python agents/train_ppo.py --no-shed-action                 # the shed margin stays theta*'s

The native vector env (one engine batch, no subprocesses) runs through the SB3 adapter
(tokenbatch_env.sb3) with VecMonitor and, by default, VecNormalize (observations only; saved with
the model). torch uses one thread; the env's engine uses every core from 64 envs on (its default
``threads``): rollouts and gradient epochs alternate, so they do not compete. Every --eval-every timesteps the current policy (mean action) is replayed on the
VALIDATION split by the evaluator's controlled replay (tokenbatch_env.control.run_controlled: same
windows-free whole traces, loads and predictor as the leaderboard); the best goodput is kept in
<out>/best/ (model.zip, vecnormalize.pkl, config.json) and the final policy in <out>/final/.
TensorBoard logs in <out>/tb (goodput, shed, p99 TTFT, reward, entropy). <out>/train_metrics.json
records the validation curve, EDF+shed's and the base index's validation goodput, and the wall time
at which the agent first reached EDF+shed's goodput. Judge the result on TEST with
agents/evaluate_agent.py.

Discounting: gamma is per decision step, and the number of steps an episode takes depends on the
policy (epochs are skipped while fewer than 2 requests wait). With gamma 0.99 a policy that keeps
more requests waiting (a larger shed margin) takes more, shorter steps, so the same misses are
discounted more: measured on the default env, constant shed margin 0.5 vs 0 has the better
discounted return at gamma 0.99 (-25.7 vs -29.9) but the worse goodput (0.651 vs 0.665), and PPO
learned exactly that. At gamma 0.999 the order is right (-42.1 vs -41.2): the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The whole training run (saved as config.json beside the model)."""

    suite: str = "seed-200"
    split: str = "train"                 # episodes are windows of this split
    val_split: str = "validation"        # the validation callback replays this split
    profile: str = "stress-512"
    rho: tuple = (0.8, 1.5)              # training loads: each episode draws rho uniformly
    action_mode: str = "index"           # index (residual around theta*) | weights
    policy: str = "mlp"                  # mlp (SB3 MlpPolicy) | set (RequestSetExtractor)
    base_params: Optional[str] = None    # tuned JSON (tuning/optuna_search.py): theta* / w*, margins
    window: int = 128
    warmup: int = 32
    cooldown: int = 32
    decision_interval_ms: float = 100.0
    k: int = 8
    reward_mode: str = "certain_miss"
    shed_action: bool = True             # False: no shed-margin action (the margin stays theta*'s)
    n_envs: int = 256
    timesteps: int = 100_000
    n_steps: int = 32                    # rollout length per env: batch = n_envs * n_steps
    batch_size: int = 2048
    n_epochs: int = 4
    learning_rate: float = 3e-4
    gamma: float = 0.999                 # per decision step; see the note in the module docstring
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.0
    log_std_init: float = -1.5
    net_arch: tuple = (64, 64)
    normalize: bool = True               # VecNormalize (observations)
    eval_every: int = 25_000             # timesteps between validation replays (0 = only at the end)
    eval_traces: int = 20                # validation traces replayed (first N)
    eval_loads: tuple = (1.2,)
    seed: int = 0
    out: str = "runs/ppo"
    progress: bool = True

    def __post_init__(self):
        from tokenbatch_env.errors import ConfigError
        if self.action_mode not in ("index", "weights"):
            raise ConfigError(f"action_mode: index or weights, got {self.action_mode!r}")
        if self.policy not in ("mlp", "set"):
            raise ConfigError(f"policy: mlp or set, got {self.policy!r}")
        for f in ("n_envs", "timesteps", "n_steps", "batch_size", "n_epochs", "eval_traces", "k", "window"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{f}: must be an integer >= 1, got {v!r}")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ConfigError(f"eval_every: must be an integer >= 0, got {self.eval_every!r}")
        # PPO's numbers, each in the range where it means what it says (checked here, not by a
        # traceback from torch after the first rollout, or not at all)
        for f, lo, hi, lo_open in (("learning_rate", 0.0, math.inf, True), ("gamma", 0.0, 1.0, False),
                                   ("gae_lambda", 0.0, 1.0, False), ("clip_range", 0.0, math.inf, True),
                                   ("ent_coef", -math.inf, math.inf, True),
                                   ("log_std_init", -math.inf, math.inf, True)):
            v = getattr(self, f)
            ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
                  and (v > lo if lo_open else v >= lo) and v <= hi)
            if not ok:
                rng = "a finite number" if lo == -math.inf else (
                    f"a number {'>' if lo_open else '>='} {lo:g}" + ("" if hi == math.inf else f" and <= {hi:g}"))
                raise ConfigError(f"{f}: must be {rng}, got {v!r}")
        if (self.n_envs * self.n_steps) % self.batch_size and self.batch_size > self.n_envs * self.n_steps:
            raise ConfigError(f"batch_size {self.batch_size} exceeds the rollout n_envs * n_steps = "
                              f"{self.n_envs * self.n_steps}")
        if self.base_params is not None and not Path(self.base_params).is_file():
            raise ConfigError(f"base_params: file {self.base_params!r} not found")

    def env_kwargs(self) -> dict:
        """TokenBatchConfig fields of the training env (also how evaluation rebuilds it)."""
        return {"suite": self.suite, "split": self.split, "profile": self.profile, "rho": list(self.rho),
                "window": self.window, "warmup": self.warmup, "cooldown": self.cooldown,
                "decision_interval_ms": self.decision_interval_ms, "k": self.k,
                "action_mode": self.action_mode, "reward_mode": self.reward_mode,
                # (resolved: evaluation may run from another directory)
                "base_params": None if self.base_params is None else str(Path(self.base_params).resolve()),
                "seed": self.seed, "shed_action": self.shed_action}


# ------------------------------------------------------------------------------ CLI
def _parse_tuple(text, cast, name):
    from tokenbatch_env.errors import ConfigError
    try:
        vals = tuple(cast(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--{name}: expected comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ConfigError(f"--{name}: need at least one value")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_ppo.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            p.add_argument(flag, dest=f.name, default=None, help=f"(default {shown})")
    return p


def config_from_args(args) -> TrainConfig:
    from tokenbatch_env.errors import ConfigError
    kw = {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name)
        if v is None or isinstance(f.default, bool):
            if v is not None:
                kw[f.name] = v
            continue
        d = f.default
        try:
            if isinstance(d, tuple):
                kw[f.name] = _parse_tuple(v, float if isinstance(d[0], float) else int, f.name.replace("_", "-"))
            elif isinstance(d, int):
                kw[f.name] = int(v)
            elif isinstance(d, float):
                kw[f.name] = float(v)
            else:
                kw[f.name] = v
        except ValueError:
            raise ConfigError(f"--{f.name.replace('_', '-')}: bad value {v!r}") from None
    if "rho" in kw and len(kw["rho"]) == 1:
        kw["rho"] = (kw["rho"][0], kw["rho"][0])
    return TrainConfig(**kw)


# ------------------------------------------------------------------------------ validation
class Validator:
    """Replays the validation split under a predict function (mean actions) with the evaluator's
    controlled replay; goodput = mean over traces x loads of met / scored."""

    def __init__(self, cfg: TrainConfig):
        from tokenbatch_env.engine.profiles import load_profile
        from tokenbatch_env.evaluate import BenchConfig, prepare_workload

        self.cfg = cfg
        bc = BenchConfig(suite=cfg.suite, split=cfg.val_split, profile=cfg.profile, loads=cfg.eval_loads,
                         max_traces=cfg.eval_traces, upper_bound=False)
        self.profile = bc.engine.resolve(load_profile(cfg.profile))
        self.engine = bc.engine
        self.wl = prepare_workload(bc, self.profile)
        self.traces = [t for rho in cfg.eval_loads for t in self.wl.at(rho)]
        self.est = self.wl.estimates() * len(cfg.eval_loads)
        self.scored = list(self.wl.scored) * len(cfg.eval_loads)

    def _goodput(self, res) -> float:
        return float(sum(res.records(i)["met"][m].mean() for i, m in enumerate(self.scored)) / len(self.scored))

    def policy(self, name: str, margin, **kw) -> float:
        from tokenbatch_env.engine.simulate import simulate
        from tokenbatch_env.policies import engine_policy
        pol = engine_policy(name, shed_margin=margin, t_ref_ms=self.wl.t_ref_ms, **kw)
        return self._goodput(simulate(self.traces, self.profile, pol, self.engine, estimates=self.est,
                                      residual_life=self.wl.residual_life))

    def agent(self, predict, core) -> float:
        from tokenbatch_env.control import policy_spec, run_controlled
        mode = self.cfg.action_mode
        base = core.base_params if mode == "index" else core.base_weights
        spec = policy_spec("agent", mode, base, core.base_margin, self.cfg.k, self.cfg.decision_interval_ms,
                           lambda: predict, shed_action=self.cfg.shed_action)
        return self._goodput(run_controlled(self.traces, self.profile, self.engine, spec, estimates=self.est,
                                            residual_life=self.wl.residual_life, t_ref_ms=self.wl.t_ref_ms,
                                            lambda_sat=self.wl.lambda_sat))


def _references(cfg: TrainConfig, val: Validator, core) -> dict:
    """EDF+shed (its tuned margin if the base JSON has one, else 0) and the base policy (a = 0)."""
    from tokenbatch_env.evaluate import load_params_file
    margins = dict(load_params_file(cfg.base_params)[1]) if cfg.base_params else {}
    edf_margin = margins.get("edf", 0.0)
    out = {"edf+shed": val.policy("edf", edf_margin)}
    if cfg.action_mode == "index":
        out["base"] = val.policy("index", core.base_margin, params=core.base_params)
    else:
        out["base"] = val.policy("weights", core.base_margin, weights=core.base_weights)
    return out


# ------------------------------------------------------------------------------ training
def save_agent(model, venv, cfg: TrainConfig, directory: Path, extra: Optional[dict] = None) -> None:
    """model.zip + vecnormalize.pkl (if any) + config.json, each written to a temp name then renamed;
    config.json last, with the SHA-256 of the other two (``files``), so that a set mixed by a kill
    between the renames (new weights, old statistics) is refused on load (``control.agent_spec``)."""
    from tokenbatch_env._io import sha256_file, write_text_atomic, write_with
    directory.mkdir(parents=True, exist_ok=True)
    write_with(directory / "model.zip", lambda p: model.save(str(p)), suffix=".zip")
    norm, norm_file = _vecnormalize(venv), directory / "vecnormalize.pkl"
    if norm is not None:
        write_with(norm_file, lambda p: norm.save(str(p)))
    files = {"model.zip": sha256_file(directory / "model.zip"),
             "vecnormalize.pkl": sha256_file(norm_file) if norm is not None else None}
    # the base parameters' digest: the actions are residuals around them, so evaluation refuses a
    # changed file (``control.agent_files``)
    base = cfg.env_kwargs()["base_params"]
    doc = {"train": _jsonable(dataclasses.asdict(cfg)), "env": cfg.env_kwargs(), **(extra or {}), "files": files,
           "base_params_sha256": None if base is None else sha256_file(base)}
    write_text_atomic(directory / "config.json", json.dumps(doc, indent=1, default=str) + "\n")
    if norm is None:
        norm_file.unlink(missing_ok=True)   # an earlier run's statistics in this directory


def _jsonable(d):
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _vecnormalize(venv):
    from stable_baselines3.common.vec_env import VecNormalize
    while venv is not None:
        if isinstance(venv, VecNormalize):
            return venv
        venv = getattr(venv, "venv", None)
    return None


def make_predict(model, venv):
    """The current policy's mean action on raw observations (normalised like training)."""
    import numpy as np
    norm = _vecnormalize(venv)

    def predict(obs):
        x = np.asarray(obs, np.float32)
        if norm is not None:
            x = norm.normalize_obs(x)
        return model.predict(x, deterministic=True)[0]
    return predict


def train(cfg: TrainConfig) -> dict:
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    from tokenbatch_env.sb3 import make_sb3_vec_env, request_set_extractor_class

    from tokenbatch_env._io import check_writable

    torch.set_num_threads(1)
    out = Path(cfg.out)
    check_writable(out, "--out", directory=True)
    t_start = time.time()
    raw = make_sb3_vec_env(cfg.n_envs, **cfg.env_kwargs())   # (validates the env's settings)
    out.mkdir(parents=True, exist_ok=True)
    core = raw.venv.core
    venv = VecMonitor(raw, info_keywords=("episode_goodput", "episode_shed", "episode_ttft_p99_ms"))
    if cfg.normalize:
        venv = VecNormalize(venv, norm_obs=True, norm_reward=False, gamma=cfg.gamma)
    policy_kwargs = {"log_std_init": cfg.log_std_init, "net_arch": list(cfg.net_arch)}
    if cfg.policy == "set":
        policy_kwargs.update(features_extractor_class=request_set_extractor_class(),
                             features_extractor_kwargs={"k": cfg.k})
    batch = min(cfg.batch_size, cfg.n_envs * cfg.n_steps)
    model = PPO("MlpPolicy", venv, n_steps=cfg.n_steps, batch_size=batch, n_epochs=cfg.n_epochs,
                learning_rate=cfg.learning_rate, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
                clip_range=cfg.clip_range, ent_coef=cfg.ent_coef, policy_kwargs=policy_kwargs,
                device="cpu", seed=cfg.seed, verbose=0, tensorboard_log=str(out / "tb"))
    val = Validator(cfg)
    refs = _references(cfg, val, core)
    curve = []
    state = {"best": -1.0, "reached_edf_s": None, "next_eval": cfg.eval_every or None}

    def evaluate_now(step: int, logger=None) -> float:
        g = val.agent(make_predict(model, venv), core)
        wall = time.time() - t_start
        curve.append({"timesteps": step, "wall_s": round(wall, 1), "val_goodput": g})
        if logger is not None:
            logger.record("val/goodput", g)
            logger.record("val/edf_shed_goodput", refs["edf+shed"])
        if g > state["best"]:
            state["best"] = g
            save_agent(model, venv, cfg, out / "best", {"val_goodput": g, "timesteps": step})
        if state["reached_edf_s"] is None and g >= refs["edf+shed"]:
            state["reached_edf_s"] = wall
        return g

    class Callback(BaseCallback):
        def _on_training_start(self) -> None:
            if cfg.eval_every:
                evaluate_now(0, self.logger)   # the initial policy (mean action ~ 0: about the base)

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                if "episode_goodput" in info:
                    self.logger.record_mean("episode/goodput", info["episode_goodput"])
                    self.logger.record_mean("episode/shed", info["episode_shed"])
                    p99 = info["episode_ttft_p99_ms"]
                    if np.isfinite(p99):
                        self.logger.record_mean("episode/ttft_p99_ms", p99)
            if state["next_eval"] is not None and self.num_timesteps >= state["next_eval"]:
                evaluate_now(self.num_timesteps, self.logger)
                state["next_eval"] += cfg.eval_every
            return True

    model.learn(total_timesteps=cfg.timesteps, callback=Callback(), progress_bar=cfg.progress)
    train_s = time.time() - t_start
    final_g = evaluate_now(model.num_timesteps)
    save_agent(model, venv, cfg, out / "final", {"val_goodput": final_g, "timesteps": model.num_timesteps})
    metrics = {"config": _jsonable(dataclasses.asdict(cfg)), "timesteps": model.num_timesteps,
               "wall_s": round(time.time() - t_start, 1), "train_wall_s": round(train_s, 1),
               "env_steps_per_s_end_to_end": round(model.num_timesteps / train_s, 1),
               "validation": {"split": cfg.val_split, "loads": list(cfg.eval_loads), "traces": cfg.eval_traces,
                              "edf+shed": refs["edf+shed"], "base": refs["base"],
                              "best_agent": state["best"], "final_agent": final_g, "curve": curve},
               "reached_edf_shed_at_wall_s": state["reached_edf_s"]}
    from tokenbatch_env._io import write_text_atomic
    write_text_atomic(out / "train_metrics.json", json.dumps(metrics, indent=1) + "\n")
    venv.close()
    return metrics


def main(argv=None) -> int:
    from tokenbatch_env.errors import TokenBatchError
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        m = train(cfg)
    except TokenBatchError as e:
        print(f"train_ppo.py: error: {e}", file=sys.stderr)
        return 2
    v = m["validation"]
    print(f"trained {m['timesteps']} env-steps in {m['train_wall_s']} s "
          f"({m['env_steps_per_s_end_to_end']} env-steps/s end to end)")
    print(f"validation goodput ({v['split']}, rho {v['loads']}, {v['traces']} traces): best agent "
          f"{v['best_agent']:.4f}  final {v['final_agent']:.4f}  base policy {v['base']:.4f}  "
          f"EDF+shed {v['edf+shed']:.4f}")
    reached = m["reached_edf_shed_at_wall_s"]
    print("reached EDF+shed's validation goodput " + (f"after {reached:.0f} s" if reached is not None else ": not yet"))
    print(f"saved: {Path(cfg.out) / 'best'} (best), {Path(cfg.out) / 'final'}; judge on TEST with "
          f"python agents/evaluate_agent.py --model {Path(cfg.out) / 'best'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
