"""`tokenbatch train-router` (and ``agents/train_ppo.py --env cluster``): train a PPO or MaskablePPO
router on TokenBatchCluster-v0 (docs/design.md section 12, "Routing env") as a challenger to the
tuned routers.

``RouterTrainConfig`` is the whole run (its fields are the command's options, ``config_cli``);
``train_router`` runs it. See ``EPILOG`` (the command's ``--help``) for what it writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

from ..config_cli import option
from ..envs.cluster_env import ClusterEnvConfig
from .train import PPOSettings, ValidationSplit, parse_rho as _parse_rho

DESCRIPTION = ("Train a PPO or MaskablePPO router (stable-baselines3, sb3-contrib) on TokenBatchCluster-v0 as a "
               "challenger to the tuned routers.")

EPILOG = """\
    {cmd}                                   # 4 replicas of stress-512, MaskablePPO, 100,000 steps
    {cmd} --suite azure-conv-like --profile llama3-8b-h100 --replicas 8 --rho 1.2 \\
        --params runs/tune-router/best_params.json --replica-row "round-robin x index+shed" \\
        --timesteps 2000000 --seed 0 --out runs/router-s0

Every replica runs the replica policy: --replica-policy and --shed-margin, or with --params (a
``tokenbatch tune --replicas R`` best_params.json) the tuned row --replica-row names (its policy,
shed margin, index parameters and vLLM flags, and the file's T_ref), as the comparators do. The
native vector env (one engine batch) runs through the SB3 adapter (tokenbatch_env.sb3) with
VecMonitor and, by default, VecNormalize (observations only; saved with the model). The network
(--net) is the replica scorer (one MLP scores every replica from its features, their mean and the
request's: it treats the replicas alike) or an MLP on the whole observation. PPO's masked choices are
the base router's (counted); MaskablePPO samples only allowed replicas. Every --eval-every timesteps
the current policy (its most probable replica) routes the VALIDATION split's windows by the
evaluator's own replay (tokenbatch_env.control.run_routed); the best is kept in <out>/best/
(model.zip, vecnormalize.pkl, config.json) and the final policy in <out>/final/.
<out>/train_metrics.json has the validation curve and the base router's validation goodput;
TensorBoard logs go to <out>/tb. Judge on TEST against every router with {evaluate} --model
<out>/best --params FILE.

Discounting: gamma is per routing decision, and a request's reward comes as it ends, hundreds of
decisions after it was routed; at gamma 0.99 the policy sees almost none of it (a 300,000-step pilot
on azure-conv-like collapsed from 0.78 to 0.44 validation goodput). The default is 0.999.
"""


def _parse_split(text, flag: str) -> tuple:
    from ..config_cli import parse_split
    return parse_split(text, flag)


#: the routing env's fields that are options (``config_cli``; their checks are ``ClusterEnvConfig``'s)
ENV_OPTIONS = {
    "suite": {"help": "suite name or spec .json; episodes are windows of its --split"},
    "split": {"help": "split whose windows are the episodes"},
    "profile": {"help": "engine profile of every replica (tokenbatch profiles list)"},
    "replicas": {"help": "replicas R per cluster (the action: one of R)"},
    "rho": {"help": "training cluster loads low,high (drawn per episode), or one value", "parse": _parse_rho,
            "type": tuple[float, ...]},
    "window": {"help": "scored requests per replica per episode (W x R scored)"},
    "warmup": {"help": "requests per replica routed before the window, not scored"},
    "cooldown": {"help": "requests per replica routed after the window, not scored"},
    "policy": {"help": "the replicas' policy (without --params)", "flags": ("--replica-policy",)},
    "shed_margin": {"help": "its shed margin (without --params; default none: no shedding)", "none": "none"},
    "base_router": {"help": "the router whose choice replaces a masked action"},
    "pd": {"help": "a P/D cluster: Rp prefill + Rd decode replicas (Rp + Rd = --replicas); the agent routes to the "
                   "prefill replicas (docs/design.md section 13)", "parse": _parse_split, "type": str,
           "metavar": "Rp:Rd"},
    "decode_router": {"help": "with --pd: the router of the handoffs to the decode replicas"},
    "kv_link": {"help": "with --pd: the KV link (nvlink, rdma, none)"},
    "first_token_at": {"help": "with --pd: where a request's first token counts (prefill, decode)"},
    "seed": {"help": "seed of PPO and the env"},
}


def _default_env():
    return ClusterEnvConfig(seed=0)


#: config.json's ``env["kind"]`` of a router agent
ROUTER_KIND = "cluster"


@dataclasses.dataclass(frozen=True)
class RouterTrainConfig(PPOSettings):
    """The whole router training run (saved as config.json beside the model): the routing env's
    ``ClusterEnvConfig`` (``env``; the fields in ``ENV_OPTIONS`` are options, the rest set by
    ``params`` and ``replica_row``), the algorithm and the settings of ``PPOSettings`` (rollouts of
    64 decisions per cluster, minibatches of 4,096 here)."""

    n_steps: int = option(64, "rollout length per env: batch = n_envs * n_steps")
    batch_size: int = option(4096, "PPO minibatch size")
    env: ClusterEnvConfig = dataclasses.field(default_factory=_default_env, metadata={
        "options": ENV_OPTIONS, "group": "the routing env (ClusterEnvConfig)"})
    params: Optional[str] = option(None, "tuned parameters JSON of a cluster tuning run (tokenbatch tune "
                                   "--replicas R): the replicas run its row --replica-row", metavar="FILE")
    replica_row: Optional[str] = option(None, "with --params: the tuned row every replica runs, e.g. "
                                        "'round-robin x index+shed'", metavar="ROW")
    algo: str = option("maskable-ppo", "ppo or maskable-ppo (sb3-contrib)")
    net: str = option("scorer", "scorer (one MLP scores each replica) or mlp (SB3 MlpPolicy)")
    hidden: int = option(64, "the scorer's width", min=1)
    prior: float = option(3.0, "the scorer's initial weight on least-outstanding's preference (learned; 0: none)")
    out: str = option("runs/router", "output directory")

    def __post_init__(self):
        from ..errors import ConfigError
        if not isinstance(self.env, ClusterEnvConfig):
            raise ConfigError(f"env: must be a ClusterEnvConfig, got {type(self.env).__name__}")
        if self.env.seed is None:
            raise ConfigError("seed: training needs an integer seed (the algorithm's and the env's), got None")
        from ..sb3 import ROUTER_ALGOS
        if self.algo not in ROUTER_ALGOS:
            raise ConfigError(f"algo: one of {', '.join(ROUTER_ALGOS)}, got {self.algo!r}")
        if self.env.replicas < 2:
            raise ConfigError(f"replicas: a router chooses among at least 2 replicas, got {self.env.replicas}")
        if self.net not in ("scorer", "mlp"):
            raise ConfigError(f"net: scorer or mlp, got {self.net!r}")
        from .train import check_ppo_settings
        check_ppo_settings(self, extra_ints=("hidden",), extra_finite=("prior",))
        if (self.params is None) != (self.replica_row is None):
            raise ConfigError("--params and --replica-row go together (the tuned row every replica runs)")
        if self.params is not None:
            if self.env.policy != ClusterEnvConfig.policy or self.env.shed_margin is not None:
                raise ConfigError("--replica-policy and --shed-margin: the replica row of --params sets them")
            object.__setattr__(self, "env", replica_env(self.env, self.params, self.replica_row))

    def to_dict(self) -> dict:
        """The run as JSON values: the settings and ``"env"`` (every ClusterEnvConfig field, resolved)."""
        d = {f.name: list(v) if isinstance(v, tuple) else v
             for f in dataclasses.fields(self) if f.name != "env" for v in [getattr(self, f.name)]}
        return {"env": env_dict(self.env), **d}

    def saved_env(self) -> dict:
        """config.json's ``"env"``: every ``ClusterEnvConfig`` field (``env_dict``) and ``"kind":
        "cluster"`` (what ``agents.load`` tells a router by)."""
        return {"kind": ROUTER_KIND, **env_dict(self.env)}

    def base_file(self) -> Optional[str]:
        """The parameters file the replica row came from (its digest is saved with the agent)."""
        return None if self.params is None else str(Path(self.params).resolve())


def env_dict(env: ClusterEnvConfig) -> dict:
    """A ``ClusterEnvConfig`` as JSON values (``ClusterEnvConfig(**env_dict(c)) == c``)."""
    d = dataclasses.asdict(env)
    d["rho"] = list(env.rho)
    d["levers"] = dict(env.levers)
    d["index"] = None if env.index is None else dict(env.index)
    d["pd"] = list(env.pd)
    return d


def replica_env(env: ClusterEnvConfig, params: str, row: str) -> ClusterEnvConfig:
    """``env`` with every replica running the tuned row ``row`` (``"<router> x <row>"``) of the cluster
    tuning file ``params``: its policy, shed margin, index parameters and levers, and the file's T_ref."""
    from ..errors import ConfigError
    from ..evaluate.config import SHED_SUFFIX
    from ..params import load_params_file, load_routed
    routed = load_routed(params)
    if routed is None:
        raise ConfigError(f"--params {params}: not a cluster tuning file (no 'cluster' rows; tokenbatch tune "
                          "--replicas R writes one)")
    rows = dict(routed["routed"])
    if row not in rows:
        raise ConfigError(f"--replica-row {row!r}: not a row of {params}; its rows: {', '.join(sorted(rows))}")
    if routed["replicas"] != env.replicas:
        raise ConfigError(f"--replica-row {row!r} was tuned on {routed['replicas']} replicas: give --replicas "
                          f"{routed['replicas']} (now {env.replicas})")
    rr = rows[row]
    plain = row.partition(" x ")[2]
    if not plain.endswith(SHED_SUFFIX):
        raise ConfigError(f"--replica-row {row!r}: a tuned +shed row (index+shed, <baseline>+shed) is a replica "
                          "policy; the tuned-flags rows are not yet")
    policy = plain.removesuffix(SHED_SUFFIX)
    index_params, _ = load_params_file(params)
    index = rr.index_params if rr.index_params is not None else (index_params if policy == "index" else None)
    doc = json.loads(Path(params).read_text())
    t_ref = (doc.get("meta") or {}).get("t_ref_ms") if (doc.get("meta") or {}).get("t_ref_mode") == "fixed" else None
    return dataclasses.replace(env, policy=policy, shed_margin=float(rr.shed_margin),
                               index=None if index is None else dataclasses.asdict(index),
                               levers=dict(rr.levers), t_ref_ms=t_ref)


# ------------------------------------------------------------------------------ CLI
def configure(p: argparse.ArgumentParser, cmd: str = "tokenbatch train-router",
              evaluate: str = "tokenbatch evaluate-agent") -> None:
    from ..config_cli import configure_command
    configure_command(p, RouterTrainConfig, DESCRIPTION, EPILOG.format(cmd=cmd, evaluate=evaluate))


def build_parser(prog: str = "train_ppo.py", cmd: str = "python agents/train_ppo.py --env cluster"):
    p = argparse.ArgumentParser(prog=prog)
    configure(p, cmd, "python agents/evaluate_agent.py")
    return p


def run(args, evaluate_cmd: str = "tokenbatch evaluate-agent") -> int:
    from ..config_cli import config_from_args
    cfg = config_from_args(RouterTrainConfig, args)
    m = train_router(cfg)
    v = m["validation"]
    print(f"trained {m['timesteps']} routing decisions in {m['train_wall_s']} s "
          f"({m['env_steps_per_s_end_to_end']} env-steps/s end to end)")
    print(f"validation goodput ({v['split']}, rho {v['loads']}, {v['traces']} traces): best agent "
          f"{v['best_agent']:.4f}  final {v['final_agent']:.4f}  {cfg.env.base_router} {v['base_router']:.4f}")
    print(f"saved: {Path(cfg.out) / 'best'} (best), {Path(cfg.out) / 'final'}; judge on TEST with "
          f"{evaluate_cmd} --model {Path(cfg.out) / 'best'}" + (f" --params {cfg.params}" if cfg.params else ""))
    return 0


def main(argv=None, prog: str = "train_ppo.py", cmd: str = "python agents/train_ppo.py --env cluster") -> int:
    from ..config_cli import standalone_main
    return standalone_main(build_parser(prog, cmd), run, argv, prog, "python agents/evaluate_agent.py")


# ------------------------------------------------------------------------------ validation
class RouterValidator(ValidationSplit):
    """Routes the validation split's copies (every load) with a predict function through the
    evaluator's replay (``control.run_routed``); goodput = mean over copies of met / scored."""

    def __init__(self, cfg: RouterTrainConfig):
        env = cfg.env
        super().__init__(env.suite, cfg.val_split, env.profile, cfg.eval_loads, cfg.eval_traces, env.replicas,
                         env.base_router)
        self.env = env

    def goodput(self, predict) -> float:
        from ..control import RouterAgent, run_routed
        env = self.env
        return self.met_share(run_routed(self.traces, self.profile, env.replica_policy(self.wl.t_ref_ms),
                                         env.engine(), RouterAgent("agent", env, lambda: predict),
                                         estimates=self.est, residual_life=self.wl.residual_life))


def base_router_predict(obs, masks):
    """The base router's choice for every cluster (action -1)."""
    import numpy as np
    return np.full(len(obs), -1, np.int64)


# ------------------------------------------------------------------------------ training
def train_router(cfg: RouterTrainConfig) -> dict:
    import torch
    from stable_baselines3.common.vec_env import VecNormalize

    from .._io import check_writable, write_text_atomic
    from ..sb3 import make_sb3_cluster_vec_env, replica_scorer_policy_class, router_algo_class, router_predictor
    from .train import learn_and_validate, save_agent

    torch.set_num_threads(1)
    out = Path(cfg.out)
    check_writable(out, "--out", directory=True)
    t_start = time.time()
    venv = make_sb3_cluster_vec_env(cfg.n_envs, monitor=True, **dataclasses.asdict(cfg.env))
    out.mkdir(parents=True, exist_ok=True)
    if cfg.normalize:
        venv = VecNormalize(venv, norm_obs=True, norm_reward=False, gamma=cfg.gamma)
    maskable = cfg.algo == "maskable-ppo"
    if cfg.net == "scorer":
        policy = replica_scorer_policy_class(maskable)
        policy_kwargs = {"net_arch": {"pi": [], "vf": list(cfg.net_arch)}, "replicas": cfg.env.actions,
                         "hidden": cfg.hidden, "prior": cfg.prior}
    else:
        policy, policy_kwargs = "MlpPolicy", {"net_arch": list(cfg.net_arch)}
    model = router_algo_class(cfg.algo)(
        policy, venv, n_steps=cfg.n_steps, batch_size=min(cfg.batch_size, cfg.n_envs * cfg.n_steps),
        n_epochs=cfg.n_epochs, learning_rate=cfg.learning_rate, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
        clip_range=cfg.clip_range, ent_coef=cfg.ent_coef, policy_kwargs=policy_kwargs, device="cpu",
        seed=cfg.env.seed, verbose=0, tensorboard_log=str(out / "tb"))
    val = RouterValidator(cfg)
    base_g = val.goodput(base_router_predict)
    curve = []
    state = {"best": -1.0}

    predict_now = router_predictor(model, venv if cfg.normalize else None, maskable)

    def evaluate_now(step: int, logger=None) -> float:
        g = val.goodput(predict_now)
        curve.append({"timesteps": step, "wall_s": round(time.time() - t_start, 1), "val_goodput": g})
        if logger is not None:
            logger.record("val/goodput", g)
            logger.record("val/base_router_goodput", base_g)
        if g > state["best"]:
            state["best"] = g
            save_agent(model, venv, cfg, out / "best", {"val_goodput": g, "timesteps": step, "algo": cfg.algo})
        return g

    def log_episode(logger, info) -> None:
        logger.record_mean("episode/goodput", info["episode_goodput"])

    final_g, metrics = learn_and_validate(model, venv, cfg, out, evaluate_now, log_episode, t_start,
                                          {"algo": cfg.algo})
    metrics["validation"].update({"base_router": base_g, "best_agent": state["best"], "final_agent": final_g,
                                  "curve": curve})
    write_text_atomic(out / "train_metrics.json", json.dumps(metrics, indent=1) + "\n")
    venv.close()
    return metrics
