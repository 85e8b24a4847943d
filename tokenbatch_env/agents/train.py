"""`tokenbatch train` (and agents/train_ppo.py, which calls ``main``): train a PPO agent
(stable-baselines3) on TokenBatch-v0 (or v1, ``--tpot-guard``) as a challenger to the tuned index.

``TrainConfig`` is the whole run (its fields are the command's options, ``config_cli``); ``train``
runs it. See ``EPILOG`` (the command's ``--help``) for what it writes and the note on discounting.
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

from ..config_cli import option
from ..envs.config import TokenBatchConfig

DESCRIPTION = ("Train a PPO agent (stable-baselines3) on TokenBatch-v0 (or v1, --tpot-guard) as a challenger to the "
               "tuned index.")

EPILOG = """\
    {cmd}                                  # index mode, MLP, small default budget
    {cmd} --policy set --timesteps 500000 --base-params runs/tune/best_params.json
    {cmd} --action-mode weights --out runs/ppo-weights
    {cmd} --no-shed-action                 # the shed margin stays theta*'s
    {cmd} --env cluster ...                # a router on TokenBatchCluster-v0 (its options: --env cluster --help)

The native vector env (one engine batch, no subprocesses) runs through the SB3 adapter
(tokenbatch_env.sb3) with VecMonitor and, by default, VecNormalize (observations only; saved with
the model). torch uses one thread; the env's engine uses every core from 64 envs on (its default
``threads``): rollouts and gradient epochs alternate, so they do not compete. Every --eval-every
timesteps the current policy (mean action) is replayed on the VALIDATION split by the evaluator's
controlled replay (tokenbatch_env.control.run_controlled: same
windows-free whole traces, loads and predictor as the leaderboard); the best goodput is kept in
<out>/best/ (model.zip, vecnormalize.pkl, config.json) and the final policy in <out>/final/.
TensorBoard logs in <out>/tb (goodput, shed, p99 TTFT, reward, entropy). <out>/train_metrics.json
records the validation curve, EDF+shed's and the base index's validation goodput, and the wall time
at which the agent first reached EDF+shed's goodput. Judge the result on TEST with
{evaluate}.

Discounting: gamma is per decision step, and the number of steps an episode takes depends on the
policy (epochs are skipped while fewer than 2 requests wait). With gamma 0.99 a policy that keeps
more requests waiting (a larger shed margin) takes more, shorter steps, so the same misses are
discounted more: measured on the default env, constant shed margin 0.5 vs 0 has the better
discounted return at gamma 0.99 (-25.7 vs -29.9) but the worse goodput (0.651 vs 0.665), and PPO
learned exactly that. At gamma 0.999 the order is right (-42.1 vs -41.2): the default.
"""

def _parse_loads(text, flag: str) -> tuple:
    from ..util import parse_loads
    return parse_loads(text, flag[2:])


def parse_rho(text, flag: str) -> tuple:
    """--rho: low,high (each episode draws rho uniformly), or one value for a constant load."""
    v = _parse_loads(text, flag)
    return (v[0], v[0]) if len(v) == 1 else v


#: The env's fields that are ``tokenbatch train`` options, with their help there (``config_cli``:
#: their defaults are ``TrainConfig``'s default env's, their checks ``TokenBatchConfig``'s own).
ENV_OPTIONS = {
    "suite": {"help": "suite name or spec .json; episodes are windows of its --split"},
    "split": {"help": "split whose windows are the episodes"},
    "profile": {"help": "engine profile (tokenbatch profiles list)"},
    "rho": {"help": "training loads low,high: each episode draws rho uniformly (one value: a constant load)",
            "parse": parse_rho, "type": tuple[float, ...]},
    "action_mode": {"help": "index (residual around theta*) or weights"},
    "base_params": {"help": "tuned parameters JSON (tokenbatch tune's best_params.json): theta* / w* and the "
                            "margins the actions are residuals around (default: IndexParams defaults)"},
    "window": {"help": "scored requests per episode window"},
    "warmup": {"help": "requests simulated before each window, not scored"},
    "cooldown": {"help": "requests simulated after each window, not scored"},
    "decision_interval_ms": {"help": "time between decision epochs (ms)"},
    "k": {"help": "waiting requests the observation shows"},
    "reward_mode": {"help": "the env's reward (TokenBatchConfig.reward_mode)"},
    "shed_action": {"help": "a shed-margin action (--no-shed-action: the margin stays theta*'s)"},
    "tpot_guard": {"help": "TokenBatch-v1: the engine runs the tpot-guard budget rule, whose u and B_min join the "
                           "action (around the base file's tuned +tpot-guard row, else u 0, B_min 1: off), and the "
                           "observation gains the TPOT state (docs/design.md section 11)"},
    "seed": {"help": "seed of PPO and the env"},
}


def _default_env():
    from ..envs.config import TokenBatchConfig
    return TokenBatchConfig(seed=0)


def check_ppo_settings(cfg, extra_ints=(), extra_finite=()) -> None:
    """A training config's PPO settings, each in the range where it means what it says (checked
    here, not by a traceback from torch after the first rollout, or not at all): counts >= 1
    (``extra_ints`` too), ``eval_every`` >= 0, the learning rate and clip range > 0, gamma and GAE
    lambda in [0, 1], the entropy coefficient (and ``extra_finite``) finite; a batch larger than the
    rollout refused. ``TrainConfig``'s and ``train_router.RouterTrainConfig``'s."""
    from ..errors import ConfigError
    for f in ("n_envs", "timesteps", "n_steps", "batch_size", "n_epochs", "eval_traces", *extra_ints):
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{f}: must be an integer >= 1, got {v!r}")
    if isinstance(cfg.eval_every, bool) or not isinstance(cfg.eval_every, int) or cfg.eval_every < 0:
        raise ConfigError(f"eval_every: must be an integer >= 0, got {cfg.eval_every!r}")
    for f, lo, hi, lo_open in (("learning_rate", 0.0, math.inf, True), ("gamma", 0.0, 1.0, False),
                               ("gae_lambda", 0.0, 1.0, False), ("clip_range", 0.0, math.inf, True),
                               ("ent_coef", -math.inf, math.inf, True),
                               *((f, -math.inf, math.inf, True) for f in extra_finite)):
        v = getattr(cfg, f)
        ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
              and (v > lo if lo_open else v >= lo) and v <= hi)
        if not ok:
            rng = "a finite number" if lo == -math.inf else (
                f"a number {'>' if lo_open else '>='} {lo:g}" + ("" if hi == math.inf else f" and <= {hi:g}"))
            raise ConfigError(f"{f}: must be {rng}, got {v!r}")
    if (cfg.n_envs * cfg.n_steps) % cfg.batch_size and cfg.batch_size > cfg.n_envs * cfg.n_steps:
        raise ConfigError(f"batch_size {cfg.batch_size} exceeds the rollout n_envs * n_steps = "
                          f"{cfg.n_envs * cfg.n_steps}")


@dataclasses.dataclass(frozen=True)
class PPOSettings:
    """The settings every training run has (``TrainConfig``'s, ``train_router.RouterTrainConfig``'s):
    the rollouts, PPO's numbers, the validation replays. Each field's ``help`` is its option's."""

    n_envs: int = option(256, "env copies (one engine batch)")
    timesteps: int = option(100_000, "training env-steps")
    n_steps: int = option(32, "rollout length per env: batch = n_envs * n_steps")
    batch_size: int = option(2048, "PPO minibatch size")
    n_epochs: int = option(4, "PPO epochs per rollout")
    learning_rate: float = option(3e-4, "Adam learning rate")
    gamma: float = option(0.999, "discount per decision step (see the note on discounting below)")
    gae_lambda: float = option(0.95, "GAE lambda")
    clip_range: float = option(0.2, "PPO clip range")
    ent_coef: float = option(0.0, "entropy coefficient")
    net_arch: tuple[int, ...] = option((64, 64), "hidden layer widths, comma-separated", min=1)
    normalize: bool = option(True, "VecNormalize the observations (saved with the model)")
    eval_every: int = option(25_000, "timesteps between validation replays (0 = only at the end)")
    val_split: str = option("validation", "split the validation replays judge the policy on")
    eval_traces: int = option(20, "validation traces replayed (the first N)")
    eval_loads: tuple[float, ...] = option((1.2,), "validation loads rho, comma-separated", parse=_parse_loads)
    progress: bool = option(True, "a progress bar on stderr")


@dataclasses.dataclass(frozen=True)
class TrainConfig(PPOSettings):
    """The whole training run (saved as config.json beside the model): the training env's
    ``TokenBatchConfig`` (``env``; the fields in ``ENV_OPTIONS`` are options) and PPO's settings
    (``PPOSettings``). Each field's ``help`` is its ``tokenbatch train`` / agents/train_ppo.py option's
    (``config_cli``)."""

    env: TokenBatchConfig = dataclasses.field(default_factory=_default_env, metadata={
        "options": ENV_OPTIONS, "group": "the training env (TokenBatchConfig)"})
    policy: str = option("mlp", "mlp (SB3 MlpPolicy) or set (RequestSetExtractor)")
    log_std_init: float = option(-1.5, "initial log std of the Gaussian policy")
    out: str = option("runs/ppo", "output directory")

    def __post_init__(self):
        from ..envs.config import TokenBatchConfig
        from ..errors import ConfigError
        if not isinstance(self.env, TokenBatchConfig):
            raise ConfigError(f"env: must be a TokenBatchConfig, got {type(self.env).__name__}")
        if self.env.seed is None:
            raise ConfigError("seed: training needs an integer seed (PPO's and the env's), got None")
        if self.policy not in ("mlp", "set"):
            raise ConfigError(f"policy: mlp or set, got {self.policy!r}")
        check_ppo_settings(self, extra_finite=("log_std_init",))
        if self.env.base_params is not None and not Path(self.env.base_params).is_file():
            raise ConfigError(f"base_params: file {self.env.base_params!r} not found")

    def env_kwargs(self) -> dict:
        """The training env's ``TokenBatchConfig`` fields that are options (also how evaluation
        rebuilds it: config.json's ``"env"``), ``base_params`` resolved (evaluation may run from
        another directory)."""
        out = {name: getattr(self.env, name) for name in ENV_OPTIONS}
        out["rho"] = list(out["rho"])
        if out["base_params"] is not None:
            out["base_params"] = str(Path(out["base_params"]).resolve())
        return out

    def saved_env(self) -> dict:
        """config.json's ``"env"``: ``env_kwargs``."""
        return self.env_kwargs()

    def base_file(self) -> Optional[str]:
        """The base parameters file (its digest is saved with the agent), resolved, or None."""
        return self.env_kwargs()["base_params"]

    def to_dict(self) -> dict:
        """The run as JSON values: PPO's settings and ``"env"`` (the env's options, as given)."""
        d = {f.name: list(v) if isinstance(v, tuple) else v
             for f in dataclasses.fields(self) if f.name != "env" for v in [getattr(self, f.name)]}
        return {"env": {name: list(v) if isinstance(v, tuple) else v
                        for name in ENV_OPTIONS for v in [getattr(self.env, name)]}, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """``to_dict``'s inverse (lists back to tuples)."""
        tup = lambda x: tuple(x) if isinstance(x, list) else x  # noqa: E731
        env = dataclasses.replace(_default_env(), **{k: tup(v) for k, v in d.get("env", {}).items()})
        return cls(env=env, **{k: tup(v) for k, v in d.items() if k != "env"})


# ------------------------------------------------------------------------------ CLI
def configure(p: argparse.ArgumentParser, cmd: str = "tokenbatch train",
              evaluate: str = "tokenbatch evaluate-agent --model runs/ppo/best") -> None:
    from ..config_cli import configure_command
    configure_command(p, TrainConfig, DESCRIPTION, EPILOG.format(cmd=cmd, evaluate=evaluate))


def build_parser(prog: str = "train_ppo.py", cmd: str = "python agents/train_ppo.py") -> argparse.ArgumentParser:
    """The standalone parser (agents/train_ppo.py)."""
    p = argparse.ArgumentParser(prog=prog)
    configure(p, cmd, "python agents/evaluate_agent.py --model runs/ppo/best")
    return p


def config_from_args(args) -> TrainConfig:
    from ..config_cli import config_from_args as from_args
    return from_args(TrainConfig, args)


def run(args, evaluate_cmd: str = "tokenbatch evaluate-agent") -> int:
    cfg = config_from_args(args)
    m = train(cfg)
    v = m["validation"]
    print(f"trained {m['timesteps']} env-steps in {m['train_wall_s']} s "
          f"({m['env_steps_per_s_end_to_end']} env-steps/s end to end)")
    print(f"validation goodput ({v['split']}, rho {v['loads']}, {v['traces']} traces): best agent "
          f"{v['best_agent']:.4f}  final {v['final_agent']:.4f}  base policy {v['base']:.4f}  "
          f"EDF+shed {v['edf+shed']:.4f}")
    reached = m["reached_edf_shed_at_wall_s"]
    print("reached EDF+shed's validation goodput " + (f"after {reached:.0f} s" if reached is not None else ": not yet"))
    print(f"saved: {Path(cfg.out) / 'best'} (best), {Path(cfg.out) / 'final'}; judge on TEST with "
          f"{evaluate_cmd} --model {Path(cfg.out) / 'best'}"
          + (f" --params {cfg.env.base_params}" if cfg.env.base_params else ""))
    return 0


def main(argv=None, prog: str = "train_ppo.py", cmd: str = "python agents/train_ppo.py") -> int:
    """The standalone entry of the TokenBatch-v0/v1 trainer: errors are one line prefixed with
    ``prog``, exit 2 (agents/train_ppo.py calls ``env_choice.main``, which also has ``--env cluster``)."""
    from ..config_cli import standalone_main
    return standalone_main(build_parser(prog, cmd), run, argv, prog, "python agents/evaluate_agent.py")


# ------------------------------------------------------------------------------ validation
class ValidationSplit:
    """The validation copies of a training run, as the benchmark lays them out: ``traces`` (every
    trace of ``split`` at every load), their length estimates ``est`` and scored masks, the workload
    ``wl``, the resolved ``profile`` and ``engine``; with ``replicas`` > 1 a cluster's workload
    (``evaluate.cluster.bench_workload``). ``met_share(res)``: the mean over the copies of met / scored
    of a replay of ``traces``. Both trainers' validation (``Validator``, ``train_router.RouterValidator``)."""

    def __init__(self, suite: str, split: str, profile: str, loads, max_traces: int, replicas: int = 1,
                 router: Optional[str] = None):
        from ..engine.profiles import load_profile
        from ..evaluate import BenchConfig
        from ..evaluate.cluster import bench_workload
        kw = {"replicas": replicas, "routers": (router,)} if replicas > 1 else {}
        bc = BenchConfig(suite=suite, split=split, profile=profile, loads=loads, max_traces=max_traces,
                         upper_bound=False, **kw)
        self.profile = bc.engine.resolve(load_profile(profile))
        self.engine = bc.engine
        self.wl = bench_workload(bc, self.profile)
        self.traces = [t for rho in loads for t in self.wl.at(rho)]
        self.est = self.wl.estimates() * len(loads)
        self.scored = list(self.wl.scored) * len(loads)

    def met_share(self, res) -> float:
        return float(sum(res.records(i)["met"][m].mean() for i, m in enumerate(self.scored)) / len(self.scored))


class Validator(ValidationSplit):
    """Replays the validation split under a predict function (mean actions) with the evaluator's
    controlled replay; goodput = mean over traces x loads of met / scored."""

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg.env.suite, cfg.val_split, cfg.env.profile, cfg.eval_loads, cfg.eval_traces)
        self.cfg = cfg

    def policy(self, name: str, margin, guard=None, **kw) -> float:
        """A static policy's validation goodput; ``guard``: with the tpot-guard rule at (u, B_min)."""
        from ..engine.simulate import simulate
        from ..policies import engine_policy
        pol = engine_policy(name, shed_margin=margin, t_ref_ms=self.wl.t_ref_ms, **kw)
        from ..engine.levers import with_guard
        engine = self.engine if guard is None else with_guard(self.engine, *guard)
        return self.met_share(simulate(self.traces, self.profile, pol, engine, estimates=self.est,
                                      residual_life=self.wl.residual_life))

    def agent(self, predict, core) -> float:
        from ..control import policy_spec, run_controlled
        mode = self.cfg.env.action_mode
        base = core.base_params if mode == "index" else core.base_weights
        spec = policy_spec("agent", mode, base, core.base_margin, self.cfg.env.k, self.cfg.env.decision_interval_ms,
                           lambda: predict, shed_action=self.cfg.env.shed_action, guard=core.base_guard)
        return self.met_share(run_controlled(self.traces, self.profile, self.engine, spec, estimates=self.est,
                                            residual_life=self.wl.residual_life, t_ref_ms=self.wl.t_ref_ms,
                                            lambda_sat=self.wl.lambda_sat))


def _references(cfg: TrainConfig, val: Validator, core) -> dict:
    """EDF+shed (its tuned margin if the base JSON has one, else 0) and the base policy (a = 0)."""
    from ..params import load_params_file
    margins = dict(load_params_file(cfg.env.base_params)[1]) if cfg.env.base_params else {}
    edf_margin = margins.get("edf", 0.0)
    out = {"edf+shed": val.policy("edf", edf_margin)}
    if cfg.env.action_mode == "index":   # (TokenBatch-v1: with the rule at the base's u and B_min)
        out["base"] = val.policy("index", core.base_margin, core.base_guard, params=core.base_params)
    else:
        out["base"] = val.policy("weights", core.base_margin, core.base_guard, weights=core.base_weights)
    return out


# ------------------------------------------------------------------------------ training
def save_agent(model, venv, cfg: TrainConfig, directory: Path, extra: Optional[dict] = None) -> None:
    """model.zip + vecnormalize.pkl (if any) + config.json, each written to a temp name then renamed;
    config.json last, with the SHA-256 of the other two (``files``), so that a set mixed by a kill
    between the renames (new weights, old statistics) is refused on load (``agents.load.agent_files``)."""
    from .._io import sha256_file, write_text_atomic, write_with
    directory.mkdir(parents=True, exist_ok=True)
    write_with(directory / "model.zip", lambda p: model.save(str(p)), suffix=".zip")
    norm, norm_file = _vecnormalize(venv), directory / "vecnormalize.pkl"
    if norm is not None:
        write_with(norm_file, lambda p: norm.save(str(p)))
    files = {"model.zip": sha256_file(directory / "model.zip"),
             "vecnormalize.pkl": sha256_file(norm_file) if norm is not None else None}
    # the base parameters' digest: the actions are residuals around them, so evaluation refuses a
    # changed file (``agents.load.agent_files``)
    base = cfg.base_file()
    doc = {"train": cfg.to_dict(), "env": cfg.saved_env(), **(extra or {}), "files": files,
           "base_params_sha256": None if base is None else sha256_file(base)}
    write_text_atomic(directory / "config.json", json.dumps(doc, indent=1, default=str) + "\n")
    if norm is None:
        norm_file.unlink(missing_ok=True)   # an earlier run's statistics in this directory


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


def progress_callback():
    """An SB3 callback drawing a tqdm progress bar on stderr (env-steps). SB3's own
    ``progress_bar=True`` needs ``rich`` besides tqdm (an ImportError without it); this one needs
    only tqdm, a dependency of the package. A callback draws no random numbers: training is the
    same with or without it."""
    from stable_baselines3.common.callbacks import BaseCallback
    from tqdm.auto import tqdm

    class TqdmProgress(BaseCallback):
        def _on_training_start(self) -> None:
            self.bar = tqdm(total=self.locals["total_timesteps"] - self.model.num_timesteps, desc="training",
                            unit="step", file=sys.stderr, dynamic_ncols=True)

        def _on_step(self) -> bool:
            self.bar.update(self.training_env.num_envs)
            return True

        def _on_training_end(self) -> None:
            self.bar.close()

    return TqdmProgress()


def learn_and_validate(model, venv, cfg, out: Path, evaluate_now, log_episode, t_start: float,
                       saved: Optional[dict] = None) -> tuple:
    """Both trainers' loop: ``model.learn`` for ``cfg.timesteps`` with a progress bar, each finished
    episode's info logged (``log_episode(logger, info)``), ``evaluate_now(step, logger)`` at 0 steps
    and every ``cfg.eval_every`` (0: none), then once more at the end and the final policy saved in
    <out>/final (``saved``: more for its config.json). Returns (the final validation goodput, the
    metrics' common part)."""
    from stable_baselines3.common.callbacks import BaseCallback
    state = {"next_eval": cfg.eval_every or None}

    class Callback(BaseCallback):
        def _on_training_start(self) -> None:
            if cfg.eval_every:
                evaluate_now(0, self.logger)

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                if "episode_goodput" in info:
                    log_episode(self.logger, info)
            if state["next_eval"] is not None and self.num_timesteps >= state["next_eval"]:
                evaluate_now(self.num_timesteps, self.logger)
                state["next_eval"] += cfg.eval_every
            return True

    callbacks = [Callback()] + ([progress_callback()] if cfg.progress else [])
    model.learn(total_timesteps=cfg.timesteps, callback=callbacks)
    train_s = time.time() - t_start
    final_g = evaluate_now(model.num_timesteps)
    save_agent(model, venv, cfg, out / "final", {"val_goodput": final_g, "timesteps": model.num_timesteps,
                                                 **(saved or {})})
    return final_g, {"config": cfg.to_dict(), "timesteps": model.num_timesteps,
                     "wall_s": round(time.time() - t_start, 1), "train_wall_s": round(train_s, 1),
                     "env_steps_per_s_end_to_end": round(model.num_timesteps / train_s, 1),
                     "validation": {"split": cfg.val_split, "loads": list(cfg.eval_loads), "traces": cfg.eval_traces}}


def train(cfg: TrainConfig) -> dict:
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecNormalize

    from .._io import check_writable
    from ..sb3 import make_sb3_vec_env, native_env, request_set_extractor_class

    torch.set_num_threads(1)
    out = Path(cfg.out)
    check_writable(out, "--out", directory=True)
    t_start = time.time()
    # VecMonitor (monitor=True, sb3.EPISODE_INFO_KEYWORDS kept in SB3's episode buffer); validates
    # the env's settings
    venv = make_sb3_vec_env(cfg.n_envs, monitor=True, **cfg.env_kwargs())
    out.mkdir(parents=True, exist_ok=True)
    core = native_env(venv).core
    if cfg.normalize:
        venv = VecNormalize(venv, norm_obs=True, norm_reward=False, gamma=cfg.gamma)
    policy_kwargs = {"log_std_init": cfg.log_std_init, "net_arch": list(cfg.net_arch)}
    if cfg.policy == "set":
        policy_kwargs.update(features_extractor_class=request_set_extractor_class(),
                             features_extractor_kwargs={"k": cfg.env.k})
    batch = min(cfg.batch_size, cfg.n_envs * cfg.n_steps)
    model = PPO("MlpPolicy", venv, n_steps=cfg.n_steps, batch_size=batch, n_epochs=cfg.n_epochs,
                learning_rate=cfg.learning_rate, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
                clip_range=cfg.clip_range, ent_coef=cfg.ent_coef, policy_kwargs=policy_kwargs,
                device="cpu", seed=cfg.env.seed, verbose=0, tensorboard_log=str(out / "tb"))
    val = Validator(cfg)
    refs = _references(cfg, val, core)
    curve = []
    state = {"best": -1.0, "reached_edf_s": None}

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

    def log_episode(logger, info) -> None:
        logger.record_mean("episode/goodput", info["episode_goodput"])
        logger.record_mean("episode/shed", info["episode_shed"])
        p99 = info["episode_ttft_p99_ms"]
        if np.isfinite(p99):
            logger.record_mean("episode/ttft_p99_ms", p99)

    # (at 0 steps the initial policy: mean action ~ 0, about the base)
    final_g, metrics = learn_and_validate(model, venv, cfg, out, evaluate_now, log_episode, t_start)
    metrics["validation"].update({"edf+shed": refs["edf+shed"], "base": refs["base"], "best_agent": state["best"],
                                  "final_agent": final_g, "curve": curve})
    metrics["reached_edf_shed_at_wall_s"] = state["reached_edf_s"]
    from .._io import write_text_atomic
    write_text_atomic(out / "train_metrics.json", json.dumps(metrics, indent=1) + "\n")
    venv.close()
    return metrics
