#!/usr/bin/env python
"""PPO speed on TokenBatch-v0 (run by hand; figures in docs/benchmarks.md).

    python benchmarks/bench_ppo.py                          # 1,024 envs, MlpPolicy and the set policy
    python benchmarks/bench_ppo.py --n-envs 256 --iterations 2 --policies mlp

For each policy network: SB3 PPO (device cpu, one torch thread) on the native vector env through
the adapter (VecMonitor + VecNormalize, as agents/train_ppo.py), after one warm-up iteration:
- rollout env-steps/s: env-steps collected / wall time inside ``collect_rollouts`` (env + policy
  forward + buffer);
- end-to-end env-steps/s: env-steps / wall time of ``learn`` (rollouts + n_epochs of gradient steps);
- the share of the env alone (``TokenBatchVectorEnv.step``) in the rollout time.
Default: index mode, n_steps 32, batch 8,192, n_epochs 4, default env config (seed-200/train,
stress-512, rho U(0.8, 1.5), W=128, 100 ms epochs).
"""

from __future__ import annotations

import argparse
import time


def run(policy: str, n_envs: int, n_steps: int, batch: int, n_epochs: int, iterations: int) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    from tokenbatch_env.sb3 import make_sb3_vec_env, request_set_extractor_class

    torch.set_num_threads(1)
    raw = make_sb3_vec_env(n_envs, seed=0)
    native = raw.venv
    env_time = [0.0]
    step = native.step

    def timed_step(a):
        t = time.perf_counter()
        out = step(a)
        env_time[0] += time.perf_counter() - t
        return out
    native.step = timed_step
    venv = VecNormalize(VecMonitor(raw), norm_obs=True, norm_reward=False)
    kw = {"log_std_init": -1.5, "net_arch": [64, 64]}
    if policy == "set":
        kw.update(features_extractor_class=request_set_extractor_class(), features_extractor_kwargs={"k": 8})
    model = PPO("MlpPolicy", venv, n_steps=n_steps, batch_size=batch, n_epochs=n_epochs, policy_kwargs=kw,
                device="cpu", seed=0, verbose=0)
    model.set_logger(Logger(folder=None, output_formats=[]))   # no log files (SB3 would make a /tmp dir)
    per_iter = n_envs * n_steps

    class Clock(BaseCallback):
        def __init__(self):
            super().__init__()
            self.rollout = 0.0
            self._t = 0.0

        def _on_rollout_start(self):
            self._t = time.perf_counter()

        def _on_rollout_end(self):
            self.rollout += time.perf_counter() - self._t

        def _on_step(self):
            return True

    model.learn(per_iter)                      # warm-up (compilation, first resets)
    clock = Clock()
    env_time[0] = 0.0
    t = time.perf_counter()
    model.learn(per_iter * iterations, callback=clock, reset_num_timesteps=False)
    wall = time.perf_counter() - t
    steps = per_iter * iterations
    return {"policy": policy, "n_envs": n_envs, "steps": steps, "rollout_sps": steps / clock.rollout,
            "end_to_end_sps": steps / wall, "env_share": env_time[0] / clock.rollout, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-envs", type=int, default=1024)
    p.add_argument("--n-steps", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--n-epochs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=2, help="timed PPO iterations (rollout + update)")
    p.add_argument("--policies", default="mlp,set")
    a = p.parse_args()
    print(f"PPO on TokenBatch-v0: {a.n_envs} envs, n_steps {a.n_steps}, batch {a.batch_size}, "
          f"n_epochs {a.n_epochs}, {a.iterations} timed iterations")
    for pol in a.policies.split(","):
        r = run(pol, a.n_envs, a.n_steps, a.batch_size, a.n_epochs, a.iterations)
        print(f"{pol:4s} rollout {r['rollout_sps']:9,.0f} env-steps/s (env alone {100 * r['env_share']:.0f}% of it)"
              f"   end to end {r['end_to_end_sps']:9,.0f} env-steps/s   ({r['steps']:,} steps in {r['wall_s']:.1f} s)")


if __name__ == "__main__":
    main()
