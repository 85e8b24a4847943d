"""TokenBatchCluster-v0 with Stable-Baselines3 (docs/design.md section 12, "Routing env"): the SAME_STEP
adapter (terminal observations, episode goodput), the masks MaskablePPO reads, PPO and MaskablePPO
learning a few steps."""

from __future__ import annotations

import numpy as np

from conftest import require_extra

SMALL = dict(replicas=3, window=8, warmup=2, cooldown=2, max_traces=3)


def test_adapter_same_step_and_masks():
    require_extra("stable_baselines3")
    from tokenbatch_env.sb3 import make_sb3_cluster_vec_env, native_env
    venv = make_sb3_cluster_vec_env(2, **SMALL)
    venv.seed(4)
    obs = venv.reset()
    assert obs.shape == (2, 3 * 11 + 4)
    masks = np.stack(venv.env_method("action_masks"))
    assert masks.shape == (2, 3) and masks.dtype == bool
    total, ended = np.zeros(2), []
    for _ in range(200):
        obs, r, done, infos = venv.step(np.zeros(2, np.int64))
        total += r
        for e in np.flatnonzero(done):
            ended.append(e)
            assert infos[e]["terminal_observation"].shape == (3 * 11 + 4,)
            n_scored = native_env(venv).run.s1[e] - native_env(venv).run.s0[e]
            assert infos[e]["episode_goodput"] == total[e] / (SMALL["window"] * 3)
            assert n_scored == SMALL["window"] * 3
            total[e] = 0
            assert obs[e].any()   # the next episode's first arrival, in the same step
    assert ended


def test_ppo_and_maskable_ppo_learn_a_few_steps():
    require_extra("stable_baselines3")
    sb3c = require_extra("sb3_contrib")
    torch = require_extra("torch")
    torch.set_num_threads(1)
    from stable_baselines3 import PPO

    from tokenbatch_env.sb3 import make_sb3_cluster_vec_env
    for algo in (PPO, sb3c.MaskablePPO):
        venv = make_sb3_cluster_vec_env(4, monitor=True, **SMALL)
        model = algo("MlpPolicy", venv, n_steps=32, batch_size=64, n_epochs=1, seed=0, device="cpu")
        model.learn(256)
        if algo is sb3c.MaskablePPO:
            from sb3_contrib.common.maskable.utils import get_action_masks
            assert get_action_masks(venv).shape == (4, 3)
