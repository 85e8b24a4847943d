"""The SB3 adapter over the native vector env: API, terminal observations, seeding, copies, PPO smoke."""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
torch = pytest.importorskip("torch")

from tokenbatch_env.envs import ACTION_NAMES, TokenBatchEnv  # noqa: E402
from tokenbatch_env.errors import ConfigError  # noqa: E402
from tokenbatch_env.sb3 import make_sb3_vec_env  # noqa: E402

SMALL = dict(window=24, warmup=8, cooldown=8)
A = len(ACTION_NAMES)


def test_sb3_module_imports_sb3_lazily():
    from conftest import heavy_modules_loaded
    assert heavy_modules_loaded("tokenbatch_env.sb3", ("torch", "stable_baselines3")) == []


def test_sb3_check_env_single():
    from stable_baselines3.common.env_checker import check_env
    check_env(TokenBatchEnv(**SMALL), warn=True)


def test_adapter_terminal_observation_and_truncation():
    venv = make_sb3_vec_env(3, max_steps=4, rho=2.0, **SMALL)
    venv.seed(0)
    obs = venv.reset()
    assert obs.shape == (3, venv.observation_space.shape[0]) and len(venv.reset_infos) == 3
    assert "rho" in venv.reset_infos[0]
    seen = 0
    for _ in range(12):
        obs, rew, dones, infos = venv.step(np.zeros((3, A), np.float32))
        assert rew.dtype == np.float32 and dones.dtype == bool and len(infos) == 3
        for c in np.flatnonzero(dones):
            info = infos[c]
            assert info["terminal_observation"].shape == obs[c].shape
            assert info["TimeLimit.truncated"] == info["episode_truncated"]
            assert "episode_goodput" in info and "rho" in info    # final metrics + new episode
            seen += 1
        for c in np.flatnonzero(~dones):
            assert "terminal_observation" not in infos[c]
    assert seen >= 3


def test_adapter_seeding_and_copies():
    def run(seed):
        v = make_sb3_vec_env(2, **SMALL)
        v.seed(seed)
        out = [v.reset()]
        rng = np.random.default_rng(0)
        for _ in range(30):
            o, r, d, _ = v.step(rng.uniform(-1, 1, (2, A)).astype(np.float32))
            out += [o, r, d]
        return out

    a, b = run(4), run(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    v = make_sb3_vec_env(2, **SMALL)
    obs = v.reset()
    obs[:] = 123.0                                         # never an internal buffer
    assert not (v.venv.core.obs == 123.0).any()
    o2, r2, d2, _ = v.step(np.zeros((2, A), np.float32))
    o2[:] = 5.0
    assert not (v.venv.core.obs == 5.0).any()


def test_adapter_passes_threads_through():
    """``threads`` reaches the native env; the trajectories (and terminal observations) are the same."""
    def run(threads):
        v = make_sb3_vec_env(4, threads=threads, rho=2.0, **SMALL)
        assert v.venv.threads == threads
        v.seed(1)
        out = [v.reset()]
        rng = np.random.default_rng(2)
        for _ in range(40):
            o, r, d, infos = v.step(rng.uniform(-1, 1, (4, A)).astype(np.float32))
            out += [o, r, d] + [i["terminal_observation"] for i in infos if "terminal_observation" in i]
        v.close()
        return out

    a, b = run(1), run(2)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_adapter_attr_methods():
    v = make_sb3_vec_env(3, **SMALL)
    v.reset()
    assert v.get_attr("render_mode") == [None, None, None]
    assert v.get_attr("num_envs", [0, 2]) == [3, 3]
    v.set_attr("tag", "x")
    assert v.get_attr("tag", 1) == ["x"]
    assert v.env_is_wrapped(object) == [False, False, False]
    assert v.env_method("episode_records", indices=[0, 1]) == [None, None]
    assert v.env_method("close", indices=0) == [None]
    with pytest.raises(ConfigError):
        make_sb3_vec_env(2, autoreset_mode="NEXT_STEP", **SMALL)
    with pytest.raises(ConfigError, match="autoreset_mode: must be one of"):
        make_sb3_vec_env(2, autoreset_mode="sometimes", **SMALL)


def test_adapter_actions_checked_and_spellings():
    """The adapter takes SAME_STEP in every spelling the config takes, and refuses actions of the
    wrong size or kind with ActionError (not NumPy's reshape error)."""
    from tokenbatch_env.envs import ActionError
    v = make_sb3_vec_env(3, autoreset_mode="same-step", **SMALL)
    v.reset()
    for bad, msg in ((np.zeros((3, 7)), r"actions must have shape \(3, 8\), got \(3, 7\)"),
                     (np.array([["x"] * 8] * 3), "actions must be real numbers")):
        with pytest.raises(ActionError, match=msg):
            v.step_async(bad)
    a = np.zeros((3, 8))
    v.step_async(a)
    a[:] = 0.5   # (the adapter keeps its own copy)
    assert not v._actions.any()
    v.step_wait()


@pytest.mark.slow
def test_ppo_smoke():
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import VecMonitor
    torch.set_num_threads(1)
    venv = VecMonitor(make_sb3_vec_env(4, **SMALL))
    model = PPO("MlpPolicy", venv, n_steps=256, batch_size=256, n_epochs=2, device="cpu", seed=0,
                policy_kwargs=dict(net_arch=[16], log_std_init=-1.5))
    model.set_logger(Logger(folder=None, output_formats=[]))   # (else SB3 makes a /tmp/SB3-* dir per run)
    model.learn(total_timesteps=3000)
    assert model.num_timesteps >= 3000
    obs = venv.reset()
    act, _ = model.predict(obs, deterministic=True)
    assert act.shape == (4, A) and np.isfinite(act).all()


def _split_one(infos: dict, c: int) -> dict:
    """Reference: copy c's entries of a vector-info dict, one key at a time (what the adapter's
    one-pass ``_unbatch_all`` must give each copy)."""
    out = {}
    for k, v in infos.items():
        if k.startswith("_") or k in ("final_obs", "final_info"):
            continue
        mask = infos.get(f"_{k}")
        if isinstance(v, dict):
            sub = _split_one(v, c)
            if sub:
                out[k] = sub
        elif mask is None or mask[c]:
            x = v[c]
            out[k] = x.item() if isinstance(x, np.generic) else (x.copy() if isinstance(x, np.ndarray) else x)
    return out


def test_unbatch_all_equals_per_copy_unbatch():
    """The adapter's one-pass info split gives each copy exactly its own entries (same keys, same
    order, same values), on steps with and without episode ends and resets; with the mask ``only``
    (the adapter passes the copies that ended) the copies outside it get ``{}``."""
    from tokenbatch_env.envs import TokenBatchVectorEnv
    from tokenbatch_env.sb3 import _unbatch_all
    n = 6
    env = TokenBatchVectorEnv(n, autoreset_mode="SAME_STEP", rho=(1.5, 2.5), **SMALL)
    _, infos = env.reset(seed=1)
    rng = np.random.default_rng(0)
    seen_end = dropped = 0
    for _ in range(400):
        for part in (infos, infos.get("final_info", {})):
            fast = _unbatch_all(part, n)
            sel = rng.random(n) < 0.5
            only = _unbatch_all(part, n, sel)
            for c in range(n):
                slow = _split_one(part, c)
                assert list(fast[c]) == list(slow) and repr(fast[c]) == repr(slow)
                assert repr(only[c]) == (repr(slow) if sel[c] else "{}")
                dropped += bool(slow) and not sel[c]
        _, _, te, tr, infos = env.step(rng.uniform(-1, 1, (n, len(ACTION_NAMES))))
        seen_end += int((te | tr).sum())
    assert dropped > 5
    assert seen_end > 5


def test_monitor_puts_episode_rewards_in_sb3s_buffer():
    """make_sb3_vec_env(monitor=True) wraps VecMonitor with the episode metrics: a tiny PPO run's
    ep_info_buffer holds the episodes (return, length, goodput, shed, p99 TTFT); without it SB3 sees
    no episode at all (what the docstring warns about). native_env reaches the native env under
    either, and under VecNormalize."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    from tokenbatch_env.envs import TokenBatchVectorEnv
    from tokenbatch_env.sb3 import EPISODE_INFO_KEYWORDS, native_env
    torch.set_num_threads(1)
    buffers = {}
    for monitor in (True, False):
        venv = make_sb3_vec_env(2, monitor=monitor, **SMALL, seed=0)
        assert isinstance(venv, VecMonitor) == monitor
        assert isinstance(native_env(VecNormalize(venv)), TokenBatchVectorEnv)
        model = PPO("MlpPolicy", venv, n_steps=16, batch_size=32, n_epochs=1, device="cpu", seed=0,
                    policy_kwargs=dict(net_arch=[8]))
        model.set_logger(Logger(folder=None, output_formats=[]))
        model.learn(total_timesteps=32)
        buffers[monitor] = list(model.ep_info_buffer)
        venv.close()
    assert buffers[False] == []
    assert buffers[True] and all({"r", "l", *EPISODE_INFO_KEYWORDS} <= set(e) for e in buffers[True])
    assert all(0 <= e["episode_goodput"] <= 1 for e in buffers[True])
    with pytest.raises(ValueError, match="no TokenBatchVectorEnv"):
        native_env(object())
