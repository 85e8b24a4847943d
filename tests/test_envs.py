"""TokenBatch-v0: registration, check_env, lockstep single vs vector, seeding, the a = 0 equivalence
with the evaluator's index policy, rewards, observations, autoreset modes and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenbatch_env  # (registers TokenBatch-v0)
from tokenbatch_env.engine import scoring as S
from tokenbatch_env.envs import (ACTION_NAMES, ActionError, TokenBatchConfig, TokenBatchEnv,
                                 TokenBatchVectorEnv, obs_layout)
from tokenbatch_env.errors import ConfigError

SMALL = dict(window=24, warmup=8, cooldown=8)


def _unbatch(infos: dict, c: int = 0) -> dict:
    out = {}
    for k, v in infos.items():
        if k.startswith("_"):
            continue
        if isinstance(v, dict):
            out[k] = _unbatch(v, c)
        elif infos[f"_{k}"][c]:
            out[k] = v[c].item() if isinstance(v[c], np.generic) else v[c]
    return out


def _same_info(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not _same_info(x, y):
                return False
        elif not (x == y or (isinstance(x, float) and np.isnan(x) and np.isnan(y))):
            return False
    return True


# ---------------------------------------------------------------------------- registration
def test_import_stays_light():
    from conftest import heavy_modules_loaded
    assert heavy_modules_loaded("tokenbatch_env") == []


def test_make_without_prior_import():
    code = ("import gymnasium as gym; e = gym.make('tokenbatch_env:TokenBatch-v0', window=16); "
            "o, i = e.reset(seed=0); print(o.shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(106,)"


@pytest.mark.slow
def test_works_from_an_installed_wheel(tmp_path):
    """The env from a wheel, not the checkout: a wheel built from a copy of the sources holds every
    file of the package (suites and profiles are package data), and, installed elsewhere and run
    from there, ``gym.make``/``make_vec`` build every suite and profile and step (interpreted,
    ``NUMBA_DISABLE_JIT``: a new install path would recompile every kernel)."""
    import shutil
    import zipfile
    from pathlib import Path
    st = pytest.importorskip("setuptools", reason="building the wheel offline (--no-build-isolation) needs setuptools")
    if tuple(int(x) for x in st.__version__.split(".")[:2]) < (70, 1):   # (older ones need the wheel package)
        pytest.importorskip("wheel", reason="setuptools < 70.1 builds wheels only with the wheel package")
    root = Path(tokenbatch_env.__file__).resolve().parents[1]
    src = tmp_path / "src"
    shutil.copytree(root / "tokenbatch_env", src / "tokenbatch_env", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip[:3], "wheel", *pip[3:], "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                    str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("tokenbatch_env-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    # the package's files: those git tracks, in a checkout (a stray local file is not the package's)
    tracked = subprocess.run(["git", "-C", str(root), "ls-files", "--", "tokenbatch_env"], capture_output=True,
                             text=True)
    files = ({f for f in tracked.stdout.split() if (src / f).is_file()} if tracked.returncode == 0 and tracked.stdout
             else {p.relative_to(src).as_posix() for p in (src / "tokenbatch_env").rglob("*")
                   if p.is_file() and p.suffix != ".pyc"})
    assert any(f.endswith(".json") for f in files)
    assert sorted(files - packaged) == []
    site = tmp_path / "site"
    subprocess.run([*pip[:3], "install", *pip[3:], "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    code = ("import gymnasium as gym, numpy as np, tokenbatch_env\n"
            "from tokenbatch_env.traces.suites import list_suites\n"
            "from tokenbatch_env.engine.profiles import list_profiles, load_profile\n"
            "print(tokenbatch_env.__file__)\n"
            "kw = dict(window=8, warmup=2, cooldown=2)\n"
            "for s in list_suites():\n"
            "    e = gym.make('tokenbatch_env:TokenBatch-v0', suite=s, **kw); e.reset(seed=0)\n"
            "    e.step(np.zeros(8, np.float32)); print('suite', s)\n"
            "for p in list_profiles():\n"
            "    print('profile', load_profile(p).name)\n"
            "gym.make('TokenBatch-v0', profile='llama3-8b-h100', **kw).reset(seed=0)\n"
            "v = gym.make_vec('TokenBatch-v0', num_envs=2, vectorization_mode='vector_entry_point', **kw)\n"
            "v.reset(seed=0); print('vec', v.step(np.zeros((2, 8), np.float32))[0].shape)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": str(site), "NUMBA_DISABLE_JIT": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert Path(lines[0]).resolve().is_relative_to(site.resolve())
    from tokenbatch_env.engine.profiles import list_profiles
    from tokenbatch_env.traces.suites import list_suites
    assert len(list_suites()) >= 4 and len(list_profiles()) >= 4
    assert lines[1:] == ([f"suite {s}" for s in list_suites()] + [f"profile {p}" for p in list_profiles()]
                         + ["vec (2, 106)"])


def test_make_and_make_vec():
    env = gym.make("TokenBatch-v0", **SMALL)
    assert isinstance(env.unwrapped, TokenBatchEnv)
    assert env.observation_space.shape == (len(obs_layout(8)),)
    venv = gym.make_vec("TokenBatch-v0", num_envs=3, vectorization_mode="vector_entry_point",
                        max_episode_steps=7, k=4, autoreset_mode=AutoresetMode.SAME_STEP, **SMALL)
    assert isinstance(venv, TokenBatchVectorEnv)
    assert venv.num_envs == 3 and venv.config.max_steps == 7
    assert venv.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert venv.single_observation_space.shape == (len(obs_layout(4)),)
    assert venv.action_space.shape == (3, len(ACTION_NAMES))


def test_gymnasium_check_env():
    from gymnasium.utils.env_checker import check_env
    env = gym.make("TokenBatch-v0", **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)


# ---------------------------------------------------------------------------- lockstep & seeding
def test_lockstep_make_vs_make_vec():
    single = gym.make("TokenBatch-v0", rho=(0.8, 1.8), **SMALL)
    vec = gym.make_vec("TokenBatch-v0", num_envs=1, vectorization_mode="vector_entry_point",
                       rho=(0.8, 1.8), **SMALL)
    o1, i1 = single.reset(seed=11)
    o2, i2 = vec.reset(seed=11)
    assert np.array_equal(o1, o2[0]) and _same_info(i1, _unbatch(i2))
    rng = np.random.default_rng(0)
    episodes, reset_next = 0, False
    for _ in range(1500):
        a = rng.uniform(-1, 1, len(ACTION_NAMES)).astype(np.float32)
        o2, r2, te2, tr2, inf2 = vec.step(a[None])
        if reset_next:   # NEXT_STEP: the vector env resets now, the single env was reset by hand
            o1, i1 = single.reset()
            assert np.array_equal(o1, o2[0]) and _same_info(i1, _unbatch(inf2))
            assert r2[0] == 0 and not te2[0] and not tr2[0]
            reset_next = False
            continue
        o1, r1, te1, tr1, inf1 = single.step(a)
        assert np.array_equal(o1, o2[0])
        assert r1 == r2[0] and te1 == te2[0] and tr1 == tr2[0]
        assert _same_info(inf1, _unbatch(inf2))
        if te1 or tr1:
            episodes += 1
            reset_next = True
    assert episodes >= 3


def test_seeding_reproducible_and_copy_seeds():
    def rollout(seed, n=3, steps=60):
        env = TokenBatchVectorEnv(n, rho=(0.8, 1.8), **SMALL)
        obs, info = env.reset(seed=seed)
        rng = np.random.default_rng(1)
        trace = [obs]
        for _ in range(steps):
            obs, r, te, tr, _ = env.step(rng.uniform(-1, 1, (n, len(ACTION_NAMES))))
            trace += [obs, r, te, tr]
        return info, trace

    ia, a = rollout(5)
    ib, b = rollout(5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    ic, _ = rollout(6)
    assert not np.array_equal(ia["rho"], ic["rho"])
    # copy i of a vector env seeded s is the single env seeded s + i (SyncVectorEnv's convention)
    for i in range(3):
        _, info1 = TokenBatchEnv(rho=(0.8, 1.8), **SMALL).reset(seed=5 + i)
        assert info1 == _unbatch(ia, i)


def test_config_seed_used_without_reset_seed():
    a = TokenBatchVectorEnv(2, seed=3, **SMALL).reset()[1]
    b = TokenBatchVectorEnv(2, seed=3, **SMALL).reset()[1]
    assert np.array_equal(a["rho"], b["rho"]) and np.array_equal(a["window_start"], b["window_start"])


# ---------------------------------------------------------------------------- a = 0 == the evaluator's index
@pytest.mark.parametrize("mode,shed", [("index", 0.0), ("index", None), ("weights", 0.0), ("weights", None)])
def test_zero_action_reproduces_evaluator_policy(mode, shed, tmp_path):
    """a = 0 replays the evaluator's policy with the base parameters (theta* / w*), request by request,
    in each copy's first and later episodes (laid out into rows that held an earlier episode)."""
    from tokenbatch_env.engine.simulate import simulate
    from tokenbatch_env.evaluate import pct, pcts, request_outcomes, unit_metrics
    from tokenbatch_env.policies import IndexParams, LinearWeights, engine_policy
    from tokenbatch_env.traces.windows import window_at

    N, EPISODES = 4, 3
    weights = LinearWeights({"log_s": -1.0, "slack": -0.5, "first_token_out": 0.2})
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"weights": {"w": weights.to_dict()["w"]}}))
    env = TokenBatchVectorEnv(N, rho=(0.9, 1.8), window=64, warmup=16, cooldown=16, shed_margin=shed,
                              action_mode=mode, base_params=str(base) if mode == "weights" else None)
    _, info = env.reset(seed=3)
    window = {c: (int(info["trace_index"][c]), float(info["rho"][c]), int(info["window_start"][c]))
              for c in range(N)}
    episodes = []   # (copy, window, records, goodput)
    done = np.zeros(N, np.int64)
    for _ in range(20000):
        _, _, te, tr, inf = env.step(np.zeros((N, env.core.action_dim)))
        for c in np.flatnonzero(inf.get("_rho", np.zeros(N, bool))):   # NEXT_STEP: a new episode began
            window[c] = (int(inf["trace_index"][c]), float(inf["rho"][c]), int(inf["window_start"][c]))
        for c in np.flatnonzero(te | tr):
            assert te[c]
            if done[c] < EPISODES:
                episodes.append((c, window[c], env.episode_records(int(c)),
                                 {k: inf[k][c] for k in inf if k.startswith("episode_")}))
            done[c] += 1
        if (done >= EPISODES).all():
            break
    assert (done >= EPISODES).all()
    core, cfg = env.core, env.config
    wl = core.workload
    pol = engine_policy(mode, params=IndexParams(), weights=weights, shed_margin=shed, t_ref_ms=wl.t_ref_ms)
    traces, ests, wins = [], [], []
    for _, (u, rho, start), _, _ in episodes:
        w = window_at(wl.unit_at(u, rho), start, cfg.window, cfg.warmup, cfg.cooldown)
        wins.append(w)
        traces.append(w.trace)
        ests.append(core.estimates[u][w.parent_start:w.parent_start + len(w.trace)])
    res = simulate(traces, cfg.profile, pol, core.engine_config, estimates=ests,
                   residual_life=wl.residual_life)
    for i, (c, _, env_rec, info) in enumerate(episodes):
        rec = res.records(i)
        assert np.array_equal(rec["met"][wins[i].scored], env_rec["met"]), (c, i)
        assert np.array_equal(rec["first_token_ns"][wins[i].scored], env_rec["first_token_ns"])
        assert np.array_equal(rec["finish_ns"][wins[i].scored], env_rec["finish_ns"])
        assert info["episode_goodput"] == rec["met"][wins[i].scored].mean()
        # every episode metric is the evaluator's, from the evaluator's own records
        o = request_outcomes(rec, traces[i], wins[i].scored_mask())
        m = unit_metrics(o)
        for k in ("met", "completed", "shed", "timed_out", "rejected", "unfinished", "preemptions"):
            assert info[f"episode_{k}"] == m[k], k
        assert [info["episode_ttft_p50_ms"], info["episode_ttft_p99_ms"]] == pcts(o["ttft_ms"], (50, 99))
        assert info["episode_tpot_p99_ms"] == pct(o["tpot_ms"], 99)



@pytest.mark.parametrize("kw", [dict(), dict(shed_margin=None, rho=(1.5, 3.0)),
                                dict(max_episode_steps=6, rho=(1.0, 2.5)),
                                dict(autoreset_mode="SAME_STEP", max_episode_steps=12, rho=(0.5, 2.5))])
def test_episode_metrics_are_the_evaluators_of_the_episode_records(kw):
    """The episode metrics the engine threads compute as episodes end (``episodes.episode_metrics``) equal the
    evaluator's functions (``request_outcomes``, ``unit_metrics``'s counts, ``pcts``) on the episode's
    records, under random actions, shedding or none, truncation (unfinished requests) and both autoreset
    modes; and the records hold each copy's episode until its next one ends."""
    from tokenbatch_env.evaluate import pct, pcts, request_outcomes, unit_metrics
    N = 6
    env = TokenBatchVectorEnv(N, threads=2, **SMALL, **kw)
    env.reset(seed=11)
    rng = np.random.default_rng(5)
    seen = {"trunc": 0, "term": 0, "unfinished": 0, "shed": 0}
    for _ in range(400):
        _, _, te, tr, inf = env.step(rng.uniform(-1, 1, (N, env.core.action_dim)))
        inf = inf.get("final_info", inf)
        for c in np.flatnonzero(te | tr):
            rec = env.episode_records(int(c))
            assert rec["met"].shape == (env.config.window,)
            assert np.array_equal(rec["request"], np.arange(env.core.s0, env.core.s1))
            o = request_outcomes(rec, None)
            m = unit_metrics(o)
            for k in ("met", "completed", "shed", "timed_out", "rejected", "unfinished", "preemptions"):
                assert inf[f"episode_{k}"][c] == m[k], k
            assert inf["episode_goodput"][c] == m["goodput"]
            assert [inf["episode_ttft_p50_ms"][c], inf["episode_ttft_p99_ms"][c]] == pcts(o["ttft_ms"], (50, 99))
            assert inf["episode_tpot_p99_ms"][c] == pct(o["tpot_ms"], 99)
            assert inf["episode_truncated"][c] == tr[c]
            seen["trunc"] += tr[c]
            seen["term"] += te[c]
            seen["unfinished"] += m["unfinished"] > 0
            seen["shed"] += m["shed"] > 0
    assert seen["term"] > 0
    if "max_episode_steps" in kw:
        assert seen["trunc"] > 0 and seen["unfinished"] > 0
    if kw.get("rho") == (1.5, 3.0):
        assert seen["shed"] == 0
    elif not kw:
        assert seen["shed"] > 0
    assert TokenBatchVectorEnv(1, **SMALL).episode_records(0) is None   # no episode ended yet



def test_failed_step_keeps_each_copys_last_reported_episode_records(monkeypatch):
    """A step that raises after the engine threads computed the metrics of the episodes ending in it
    (here: a new episode's layout, overlapping the engine, failing) leaves ``episode_records`` at each
    copy's last reported episode, as before the metrics moved into the threads."""
    from tokenbatch_env.engine import kernel as K
    from tokenbatch_env.workload import Workload
    N = 40
    env = TokenBatchVectorEnv(N, threads=2, rho=(1.5, 2.5), **SMALL)
    env.reset(seed=1)
    rng = np.random.default_rng(0)
    reported, armed = {}, [False]
    in_range = Workload.scaled_in_range

    def window_at(self, *a, **k):
        raise ConfigError("window out of range (test)")
    monkeypatch.setattr(Workload, "scaled_in_range", lambda self, u, f: not armed[0] and in_range(self, u, f))
    monkeypatch.setattr(Workload, "window_at", window_at)
    with pytest.raises(ConfigError, match="out of range"):
        for t in range(2000):
            _, _, te, tr, _ = env.step(rng.uniform(-1, 1, (N, env.core.action_dim)))
            done = np.flatnonzero(te | tr)
            for c in done:
                reported[int(c)] = env.episode_records(int(c))
            if t > 30 and 0 < done.size * 16 <= N:   # (laid out while the engine runs, next step)
                armed[0] = True
    ended_again = [c for c in np.flatnonzero(env.core.run.arrays.epoch[:, K.EP_STOP] == K.STOP_ENDED)
                   if int(c) in reported]
    assert ended_again   # copies whose metrics the threads computed in the failed step
    for c, rec in reported.items():
        assert _same_tree(env.episode_records(c), rec), c


@pytest.mark.parametrize("suite, profile", [("seed-200", "stress-512"), ("mooncake-like", "llama3-8b-h100")])
def test_episode_layout_is_build_arrays_of_the_window(suite, profile):
    """A batch of new episodes laid out from the stacked units (``episodes.EpisodeTable.columns`` laid out by
    ``episodes.lay_out`` into rows that held other episodes) equals ``build_arrays`` of the traces
    ``Workload.window_at`` cuts, field by field (the block table aside: it is never read above a
    request's held blocks)."""
    from tokenbatch_env.engine.state import build_arrays
    from tokenbatch_env.envs.episodes import lay_out
    env = TokenBatchVectorEnv(6, suite=suite, profile=profile, rho=(0.5, 2.0), window=64, warmup=16,
                              cooldown=16, seed=5)
    env.reset()
    for _ in range(30):   # rows now hold running episodes (and grown hash widths)
        env.step(np.zeros((6, env.core.action_dim)))
    core, cfg = env.core, env.config
    wl = core.workload
    rng = np.random.default_rng(0)
    rows = np.array([0, 2, 3, 5])
    units = rng.choice(core.units, rows.size)
    lens = np.array([len(wl.units[u]) for u in units])
    starts = np.array([cfg.warmup, *(rng.integers(cfg.warmup, n - cfg.cooldown - cfg.window + 1)
                                     for n in lens[1:-1]), lens[-1] - cfg.cooldown - cfg.window])
    rhos = [0.5, 1.0, 1.37, 2.0]
    wins = [wl.window_at(int(u), r, int(s), cfg.window, cfg.warmup, cfg.cooldown)
            for u, r, s in zip(units, rhos, starts)]
    ref = build_arrays([w.trace for w in wins], core.run.profile, core.engine_config,
                       [core.estimates[u][w.parent_start:w.parent_start + len(w.trace)] for u, w in zip(units, wins)],
                       block_table=False)
    cols, t2, h_best = core.episodes.columns(units, starts - cfg.warmup, cfg.n_req,
                                             [wl.scale_factor(r) for r in rhos])
    # window j into row rows[j], given in another order (the prepared path reads rows of its columns)
    order = np.array([3, 1, 0, 2])
    A = lay_out(core.run.arrays, core.fresh, rows[order], cols, order, core.cv_extent)
    for f in ref._fields:
        if f == "table":
            continue
        got, want = getattr(A, f)[rows], getattr(ref, f)
        pad = got.shape[1] - want.shape[1] if want.ndim == 2 else 0
        if pad > 0:   # the batch's hash widths may be wider than these windows need
            want = np.concatenate([want, np.full((want.shape[0], pad), {"hash_head": -1}.get(f, 0), want.dtype)], 1)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=f == "est"), f
    assert np.array_equal(t2, np.stack([w.trace.tpot_slo_ns for w in wins]))


def test_layout_resets_every_engine_field():
    """``episodes.lay_out_rows`` names its fields one by one (compiled code): every field of the engine's
    struct of arrays is either a window column, reset from the fresh row, or one of the two that a
    reset deliberately leaves (the block table; hash_head, cleared at the ids its blocks held)."""
    import inspect
    import re
    from tokenbatch_env.engine.kernel import EngineArrays
    from tokenbatch_env.envs.episodes import TRACE_FIELDS, lay_out_rows
    src = inspect.getsource(lay_out_rows.py_func)
    fresh = set(re.findall(r"A\.(\w+)\[r\] = F\.\1\[0\]", src))
    trace = set(re.findall(r"A\.(\w+)\[r(?:, :own)?\] = \1\[s", src))
    assert trace == set(TRACE_FIELDS) and not fresh & trace
    assert fresh | trace | {"table", "hash_head"} == set(EngineArrays._fields)


@pytest.mark.parametrize("mode", ["NEXT_STEP", "SAME_STEP"])
@pytest.mark.parametrize("threads", [1, 2])
def test_new_episodes_are_laid_out_as_built(threads, mode, monkeypatch):
    """NEXT_STEP: the copies that ended are given new episodes in the next step (laid out while the
    engine advances the others, ``core.Core.step(reset_rows=)``); SAME_STEP: in the same step, after
    the engine call, from episodes prepared meanwhile (whose rows in ``_prep`` are reused). Either
    way, after that step their rows hold exactly ``build_arrays`` of the windows their reset infos
    name (block table and epochs aside; chain_val's padding included)."""
    from tokenbatch_env.engine.state import build_arrays
    from tokenbatch_env.envs import core as E
    monkeypatch.setattr(E, "_OVERLAP_LIVE_PER_RESET", 0)
    n = 16
    env = TokenBatchVectorEnv(n, rho=(1.5, 2.5), window=32, warmup=8, cooldown=8, seed=4, threads=threads,
                              autoreset_mode=mode)
    env.reset()
    core, cfg = env.core, env.config
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        _, _, _, _, info = env.step(rng.uniform(-1, 1, (n, core.action_dim)))
        if "_rho" not in info:
            continue
        rows = np.flatnonzero(info["_rho"])
        wins = [core.workload.window_at(int(info["trace_index"][c]), float(info["rho"][c]),
                                        int(info["window_start"][c]), cfg.window, cfg.warmup, cfg.cooldown)
                for c in rows]
        ref = build_arrays([w.trace for w in wins], core.run.profile, core.engine_config,
                           [core.estimates[int(info["trace_index"][c])][w.parent_start:w.parent_start + len(w.trace)]
                            for c, w in zip(rows, wins)], block_table=False)
        A = core.run.arrays
        for f in ref._fields:
            if f in ("table", "epoch"):
                continue
            got, want = getattr(A, f)[rows], getattr(ref, f)
            pad = got.shape[1] - want.shape[1] if want.ndim == 2 else 0
            if pad > 0:
                want = np.concatenate([want, np.full((want.shape[0], pad), {"hash_head": -1}.get(f, 0), want.dtype)], 1)
            assert np.array_equal(got, want, equal_nan=f == "est"), f
        checked += rows.size
    assert checked >= n


# ---------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("mode", ["certain_miss", "met"])
def test_episode_reward_sums(mode):
    N = 3
    env = TokenBatchVectorEnv(N, rho=(1.0, 2.0), reward_mode=mode, **SMALL)
    env.reset(seed=2)
    rng = np.random.default_rng(3)
    ret = np.zeros(N)
    checked = 0
    for _ in range(3000):
        _, r, te, tr, inf = env.step(rng.uniform(-1, 1, (N, len(ACTION_NAMES))))
        ret += r
        for c in np.flatnonzero(te | tr):
            met = inf["episode_met"][c]
            expect = -(env.config.window - met) if mode == "certain_miss" else met
            assert ret[c] == expect == inf["episode_return"][c]
            ret[c] = 0
            checked += 1
        ret[env._needs_reset] = 0   # the reset step's reward is 0 anyway
        if checked >= 6:
            break
    assert checked >= 6


@pytest.mark.parametrize("shed", [None, 0.5])
def test_unreachable_ttft_counts_before_the_deadline_and_is_never_met(shed):
    """A lost TTFT is a certain miss as soon as it is unreachable on an idle engine (not at its
    deadline, not when shed); such a request is never met (the rule is exact)."""
    N = 4
    env = TokenBatchVectorEnv(N, rho=(1.6, 2.4), shed_margin=shed, **SMALL)
    env.reset(seed=4)
    core = env.core
    early, flagged, done = 0, {}, 0
    for _ in range(4000):
        before = core.certain.copy()
        _, _, te, tr, inf = env.step(np.zeros((N, len(ACTION_NAMES))))
        A = core.run.arrays
        new = core.certain & ~before
        for c in np.flatnonzero(~(te | tr)):
            for j in np.flatnonzero(new[c]):
                r = core.s0 + j
                if A.end_state[c, r] == 0 and A.first_token[c, r] < 0 and \
                        A.now[c] <= A.arrival[c, r] + A.t1[c, r]:
                    early += 1
                    flagged.setdefault(c, set()).add(j)
        for c in np.flatnonzero(te | tr):
            rec = env.episode_records(int(c))
            for j in flagged.pop(c, set()):
                assert not rec["met"][j]
            done += 1
        if done >= 8:
            break
    assert early > 0 and done >= 8


def _rewards_by_definition(core, live, trunc, certain, met_seen, count_met):
    """The step rewards of ``TokenBatchEnv`` ("Rewards") in plain Python, every scored request
    rescanned from the first (no settled prefix, no skipped requests): (rewards, certain, met_seen)
    from the marks before the step. The rule itself is ``rewards.rewards_kernel``' (the same bound for an
    unreachable TTFT), the bookkeeping is not."""
    from tokenbatch_env.bounds import min_prefill_exceeds
    from tokenbatch_env.engine import kernel as K
    A, s0, s1, t_min, ps = core.run.arrays, core.s0, core.s1, core.t_min_ns, core.ps_cost
    budget = core.run.profile.max_num_batched_tokens
    out, certain, met_seen = np.zeros(len(live)), certain.copy(), met_seen.copy()
    for c in np.flatnonzero(live):
        t, n = int(A.now[c]), 0
        for j in range(s0, s1):
            arr, es, ft = int(A.arrival[c, j]), int(A.end_state[c, j]), int(A.first_token[c, j])
            o = int(A.out_len[c, j])
            if arr > t and not trunc[c]:
                break
            t1, t2, k = int(A.t1[c, j]), int(core.t2[c, j]), j - s0
            ended = es != K.E_NONE
            met = (es == K.E_COMPLETED and ft - arr <= t1
                   and (o <= 1 or int(A.finish[c, j]) - ft <= t2 * max(o - 1, 1)))
            ttft_lost = ft < 0 and arr <= t and t > arr + t1
            if ft < 0 and arr <= t and not ended and not ttft_lost:
                n_tok = int(A.prompt[c, j])
                h = max(int(core.h_best[c, j]), int(A.computed[c, j]))
                if A.n_preempt[c, j] > 0:
                    h = n_tok - 1
                h = min(max(h, 0), n_tok - 1)
                ttft_lost = bool(min_prefill_exceeds(n_tok, h, ps[0], ps[1], ps[2], ps[3], budget, arr + t1 - t))
            tpot_lost = ft >= 0 and not ended and o > 1 and t + (o - int(A.gen[c, j])) * t_min - ft > t2 * (o - 1)
            lost = ((ended and not met) or ttft_lost or tpot_lost or (bool(A.capped[c, j]) and arr <= t)
                    or (trunc[c] and not ended))
            if count_met:
                n += int(met and not met_seen[c, k])
            else:
                n -= int(lost and not certain[c, k])
            certain[c, k] |= lost
            met_seen[c, k] |= met
        out[c] = n
    return out, certain, met_seen


@pytest.mark.parametrize("mode", ["certain_miss", "met"])
def test_rewards_skip_only_settled_requests(mode):
    """The reward pass skips each copy's settled prefix and, behind an open request, the settled
    requests (a certain miss, or a met one): rescanning every scored request by the rule, from the
    marks before each step, gives the same rewards and marks."""
    N = 6
    env = TokenBatchVectorEnv(N, rho=(0.8, 2.4), reward_mode=mode, max_episode_steps=60, **SMALL)
    env.reset(seed=11)
    core = env.core
    rng = np.random.default_rng(0)
    skipped = behind = 0
    for _ in range(300):
        before = (core.certain.copy(), core.met_seen.copy())
        skipped += int(core.open_lo.sum())
        past = np.arange(core.certain.shape[1]) >= core.open_lo[:, None]   # marked requests behind an open one
        behind += int(((before[0] | before[1]) & past).sum())
        live = ~env._needs_reset
        _, r, _, tr, _ = env.step(rng.uniform(-0.3, 0.3, (N, len(ACTION_NAMES))))
        out, certain, met_seen = _rewards_by_definition(core, live, tr, *before, mode == "met")
        assert np.array_equal(out[live], r[live])
        assert np.array_equal(certain[live], core.certain[live]) and np.array_equal(met_seen[live], core.met_seen[live])
    assert skipped > 0 and behind > 0


def test_truncation_counts_open_requests():
    env = TokenBatchVectorEnv(1, max_episode_steps=3, rho=2.0, **SMALL)
    env.reset(seed=0)
    total = 0.0
    for _ in range(3):
        _, r, te, tr, inf = env.step(np.zeros((1, len(ACTION_NAMES))))
        total += r[0]
        if te[0]:
            pytest.skip("episode ended before the step cap")
    assert tr[0] and not te[0]
    assert inf["episode_truncated"][0] and inf["episode_length"][0] == 3
    assert total == -(env.config.window - inf["episode_met"][0])
    assert inf["episode_unfinished"][0] > 0


# ---------------------------------------------------------------------------- observations
_OBS_ENV = {}


def _obs_env():
    if "e" not in _OBS_ENV:
        _OBS_ENV["e"] = TokenBatchVectorEnv(2, rho=(0.5, 3.0), k=4, **SMALL)
    return _OBS_ENV["e"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1),
       actions=st.lists(st.lists(st.floats(-1, 1, allow_nan=False), min_size=8, max_size=8),
                        min_size=1, max_size=40))
def test_observations_always_finite(seed, actions):
    env = _obs_env()
    obs, _ = env.reset(seed=seed)
    assert np.isfinite(obs).all() and env.observation_space.contains(obs)
    for a in actions:
        obs, r, _, _, _ = env.step(np.array([a, a[::-1]], np.float64))
        assert obs.dtype == np.float32 and np.isfinite(obs).all()
        assert env.observation_space.contains(obs) and np.isfinite(r).all()


def test_observation_not_internal_buffer():
    env = TokenBatchVectorEnv(1, **SMALL)
    obs, _ = env.reset(seed=0)
    obs[:] = 99
    assert not (env.core.obs == 99).any()


# ---------------------------------------------------------------------------- actions
#: theta's column of each index action, restated here (the env's own table is ``envs.actions._THETA_COL``)
_INDEX_COLS = {"kappa": S.I_KAPPA, "slope": S.I_SLOPE, "gamma": S.I_GAMMA, "theta": S.I_THETA,
               "beta": S.I_BETA, "w_prefix": S.I_W_PREFIX, "a_edf": S.I_A_EDF}


def test_zero_action_is_theta_star_and_ranges():
    from tokenbatch_env.policies import INDEX_RANGES, IndexParams
    env = TokenBatchVectorEnv(1, shed_margin=0.5, **SMALL)
    core = env.core
    ts = IndexParams().theta_vector(core.workload.t_ref_ms)
    theta, margin = core.map_actions(np.zeros((1, 8)))
    assert np.array_equal(theta[0], ts) and margin[0] == 0.5
    for a in (-1.0, 1.0, 0.37):
        theta, margin = core.map_actions(np.full((1, 8), a))
        for name, (lo, hi, _) in INDEX_RANGES.items():
            assert lo <= theta[0, _INDEX_COLS[name]] <= hi
        assert 0 <= margin[0] <= 2
    theta, _ = core.map_actions(np.array([[0, 1, 0, 0, 0, 0, 0, 0]], float))
    assert theta[0, S.I_SLOPE] == pytest.approx(min(100.0, 1.0 * 1e4))
    off = TokenBatchVectorEnv(1, shed_margin=None, **SMALL).core
    assert (off.map_actions(np.ones((1, 8)))[1] < 0).all()   # shedding stays off


def test_map_actions_equals_the_per_parameter_formulas_to_the_bit():
    """The mapping, done for all parameters at once, gives each entry exactly as the documented
    formula of its own parameter (the env's docstring): linear base + a (hi - lo), log
    base exp(a ln(hi/lo)), log1p expm1(ln(1 + base) + a ln(1 + hi)), clipped, a = 0 -> base; so one
    copy and 1,024 copies, and the earlier column-by-column code, agree bit for bit."""
    import math

    from tokenbatch_env.envs import map_actions
    from tokenbatch_env.policies import INDEX_RANGES, SHED_RANGE
    bits = lambda v: np.asarray(v, np.float64).view(np.int64)   # noqa: E731
    rng = np.random.default_rng(7)
    for n in (1, 3, 1024):
        a = rng.uniform(-1, 1, (n, 8))
        for v, p in ((0.0, 0.15), (1.0, 0.05), (-1.0, 0.05), (-0.0, 0.05), (1e-300, 0.03)):
            a[rng.random((n, 8)) < p] = v
        ts = rng.uniform(0, 20, S.N_THETA)
        for name, (lo, hi, _) in INDEX_RANGES.items():   # bases inside their ranges, at a bound, beyond
            ts[_INDEX_COLS[name]] = rng.choice([rng.uniform(lo, hi), lo, hi, 2 * hi])
        for margin, shed in ((0.4, True), (2.0, True), (0.0, True), (3.0, True), (None, True), (0.4, False)):
            act = a if shed else a[:, :-1]
            theta, out = map_actions(act, "index", ts, margin, shed)
            for j, name in enumerate(ACTION_NAMES[:-1]):
                lo, hi, scale = INDEX_RANGES[name]
                x, base = act[:, j], ts[_INDEX_COLS[name]]
                v = (base * np.exp(x * math.log(hi / lo)) if scale == "log" else
                     np.expm1(np.log1p(base) + x * math.log1p(hi)) if scale == "log1p" else base + x * (hi - lo))
                want = np.where(x == 0.0, base, np.clip(v, lo, hi))
                assert np.array_equal(bits(theta[:, _INDEX_COLS[name]]), bits(want)), (n, name, margin, shed)
            lo, hi = SHED_RANGE
            x = act[:, -1] if shed else np.zeros(n)
            want = (np.full(n, -1.0) if margin is None else
                    np.where(x == 0.0, margin, np.clip(margin + x * (hi - lo), lo, hi)))
            assert np.array_equal(bits(out), bits(want)), (n, margin, shed)
            untouched = [c for c in range(S.N_THETA) if c not in _INDEX_COLS.values()]
            assert np.array_equal(theta[:, untouched], np.tile(ts[untouched], (n, 1)))
            one = np.concatenate([map_actions(act[i:i + 1], "index", ts, margin, shed)[0] for i in range(n)])
            assert np.array_equal(bits(one), bits(theta))
    w = rng.uniform(-1, 1, (4, S.N_WEIGHTS + 1))   # the weights mode: w* + a on the weights alone
    theta, _ = map_actions(w, "weights", ts, 0.4)
    assert np.array_equal(theta[:, :S.N_WEIGHTS], ts[:S.N_WEIGHTS] + w[:, :S.N_WEIGHTS])
    assert np.array_equal(theta[:, S.N_WEIGHTS:], np.tile(ts[S.N_WEIGHTS:], (4, 1)))


def test_base_params_json(tmp_path):
    p = tmp_path / "best.json"
    p.write_text(json.dumps({"index": {"kappa": 2.0, "slope": 3.0, "a_edf": 1.5}, "shed_margin": 0.25}))
    env = TokenBatchVectorEnv(1, base_params=str(p), **SMALL)
    ts = env.core.theta_star
    assert ts[S.I_KAPPA] == 2.0 and ts[S.I_SLOPE] == 3.0 and ts[S.I_A_EDF] == 1.5
    assert env.core.base_margin == 0.25
    with pytest.raises(ConfigError):
        TokenBatchVectorEnv(1, base_params=str(tmp_path / "missing.json"), **SMALL)


def test_bad_actions():
    env = TokenBatchEnv(**SMALL)
    env.reset(seed=0)
    a = np.zeros(8)
    for bad, msg in ((np.full(8, np.nan), "NaN"), (np.full(8, np.inf), "outside"),
                     (np.full(8, 1.5), "outside"), (np.zeros(7), "shape")):
        with pytest.raises(ActionError, match=msg):
            env.step(bad)
    env.step(a)
    clipped = TokenBatchEnv(clip_actions=True, window=96, warmup=8, cooldown=8)
    clipped.reset(seed=0)
    clipped.step(np.full(8, 5.0))
    clipped.step(np.full(8, -np.inf))
    with pytest.raises(ActionError, match="NaN"):
        clipped.step(np.full(8, np.nan))
    venv = TokenBatchVectorEnv(2, **SMALL)
    venv.reset(seed=0)
    with pytest.raises(ActionError, match="shape"):
        venv.step(np.zeros(8))


@pytest.mark.parametrize("kw, field", [
    (dict(suite="nope"), "suite"), (dict(split="nope"), "split"), (dict(profile="nope"), "profile"),
    (dict(rho=(2.0, 1.0)), "rho"), (dict(rho="x"), "rho"), (dict(window=0), "window"),
    (dict(window=10_000), "window"), (dict(warmup=-1), "warmup"), (dict(k=0), "k"),
    (dict(decision_interval_ms=0), "decision_interval_ms"), (dict(action_mode="x"), "action_mode"),
    (dict(reward_mode="x"), "reward_mode"),
    (dict(autoreset_mode="x"), "autoreset_mode"), (dict(seed=-1), "seed"),
    (dict(shed_margin=3.0), "shed_margin"), (dict(predictor="psychic"), "predictor"),
    (dict(clip_actions="yes"), "clip_actions"), (dict(max_steps=0), "max_steps"),
    (dict(not_a_field=1), "valid config fields"),
    (dict(rho=(1e-12, 1.0)), "rho: a load of 1e-12 is too low for seed-200"),
    (dict(rho=5e-324), "rho: a load of 5e-324 is too low for seed-200"),   # (its time factor overflows a float)
    (dict(decision_interval_ms=1e13), r"decision_interval_ms: must be a finite number in \[1e-6, 1e\+09\]"),
    (dict(max_iterations=10 ** 30), "max_iterations: must be at most 2"),
    (dict(max_steps=2 ** 63), "max_steps: must be at most 2"),
    (dict(predictor=3), "predictor: must be None, a kind"),
    (dict(base_params="/nonexistent/best.json"), "base_params: file '/nonexistent/best.json' not found"),
])
def test_bad_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        TokenBatchEnv(**kw)


def test_bad_config_objects_and_directories(tmp_path):
    """A config that is not a TokenBatchConfig, unknown keywords beside one, and a directory given as
    base_params: ConfigErrors that name what is wrong."""
    with pytest.raises(ConfigError, match="config: must be a TokenBatchConfig .* got dict"):
        TokenBatchVectorEnv(2, config={"window": 16})
    with pytest.raises(ConfigError, match="unexpected keyword argument 'foo'; valid config fields: suite"):
        TokenBatchVectorEnv(2, config=TokenBatchConfig(**SMALL), foo=1)
    with pytest.raises(ConfigError, match=f"base_params: '{tmp_path}' is a directory, not a parameters JSON"):
        TokenBatchVectorEnv(1, base_params=str(tmp_path), **SMALL)


def test_bad_seeds_name_the_copy_and_seed_nothing():
    """A bad seed (a float, a string, a negative one in a list) is refused before any copy is
    seeded: the copies' generators go on as if the call had not been made."""
    venv = TokenBatchVectorEnv(3, **SMALL)
    venv.reset(seed=0)
    for bad, msg in ((1.5, "seed: must be None, an integer or a sequence of 3"), ("3", "got '3'"),
                     ([5, -1, 7], r"seed: must be an integer >= 0 or None, got -1 \(copy 1\)"),
                     ([5, 2.5, None], "got 2.5")):
        with pytest.raises(ConfigError, match=msg):
            venv.reset(seed=bad)
    ref = TokenBatchVectorEnv(3, **SMALL)
    ref.reset(seed=0)
    o1, i1 = venv.reset()
    o2, i2 = ref.reset()
    assert np.array_equal(o1, o2) and np.array_equal(i1["window_start"], i2["window_start"])
    assert np.array_equal(i1["trace_index"], i2["trace_index"]) and np.array_equal(i1["rho"], i2["rho"])


def test_actions_must_be_real_numbers():
    """Strings (even numeric ones), objects and complex numbers are refused, not parsed or cut to
    their real part; bools and integers are numbers."""
    env = TokenBatchEnv(**SMALL)
    env.reset(seed=0)
    for bad in ("abc", {"a": 1}, np.array(["0.5"] * 8), np.zeros(8, complex), [0.0] * 7 + [None]):
        with pytest.raises(ActionError, match="actions must be real numbers"):
            env.step(bad)
    venv = TokenBatchVectorEnv(2, **SMALL)
    venv.reset(seed=0)
    with pytest.raises(ActionError, match="actions must be numbers, got list"):
        venv.step([[0.0] * 8, [0.0] * 7])
    with pytest.raises(ActionError, match=r"action 2\.0 at copy 1, dimension 3 \(theta\) is outside"):
        venv.step(np.array([[0.0] * 8, [0, 0, 0, 2, 0, 0, 0, 0]]))
    for ok in (np.zeros(8, bool), np.zeros(8, int), [0] * 8):
        env.reset(seed=0)
        env.step(ok)


def test_single_env_reset_options():
    env = TokenBatchEnv(**SMALL)
    env.reset(seed=0, options={"reset_mask": np.ones(1, bool)})   # (a vector env's option: ignored)
    for bad in ({"foo": 1}, "reset_mask"):
        with pytest.raises(ConfigError, match="reset options: none are supported"):
            env.reset(options=bad)


def test_config_accepts_names():
    c = TokenBatchConfig(autoreset_mode="same_step", rho=1.2, predictor="oracle")
    assert c.autoreset_mode == AutoresetMode.SAME_STEP and c.rho == (1.2, 1.2)
    assert c.predictor.kind == "oracle"


# ---------------------------------------------------------------------------- autoreset modes
def _run_until_done(env, n, limit=3000):
    for _ in range(limit):
        out = env.step(np.zeros((n, len(ACTION_NAMES))))
        if (out[2] | out[3]).any():
            return out
    raise AssertionError("no episode ended")


def test_same_step_autoreset():
    env = TokenBatchVectorEnv(2, autoreset_mode="SAME_STEP", **SMALL)
    env.reset(seed=1)
    obs, r, te, tr, inf = _run_until_done(env, 2)
    c = int(np.flatnonzero(te | tr)[0])
    assert inf["_final_obs"][c] and inf["final_obs"][c].shape == obs[c].shape
    assert inf["final_info"]["_episode_goodput"][c]
    assert not np.array_equal(inf["final_obs"][c], obs[c])       # obs is the new episode's
    assert inf["_rho"][c]                                         # reset info of the new episode
    env.step(np.zeros((2, len(ACTION_NAMES))))                    # continues without reset


def test_disabled_autoreset_needs_reset_mask():
    env = TokenBatchVectorEnv(2, autoreset_mode=AutoresetMode.DISABLED, **SMALL)
    assert env.metadata["autoreset_mode"] == AutoresetMode.DISABLED
    env.reset(seed=1)
    _, _, te, tr, _ = _run_until_done(env, 2)
    with pytest.raises(ConfigError, match="reset_mask"):
        env.step(np.zeros((2, len(ACTION_NAMES))))
    obs, info = env.reset(options={"reset_mask": te | tr})
    assert info["_rho"].tolist() == (te | tr).tolist()
    env.step(np.zeros((2, len(ACTION_NAMES))))


def test_next_step_autoreset():
    env = TokenBatchVectorEnv(2, **SMALL)
    assert env.metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    env.reset(seed=1)
    _, _, te, tr, _ = _run_until_done(env, 2)
    done = te | tr
    obs, r, te2, tr2, inf = env.step(np.zeros((2, len(ACTION_NAMES))))
    assert (r[done] == 0).all() and not (te2[done] | tr2[done]).any()
    assert inf["_rho"].tolist() == done.tolist()


def test_single_env_step_after_end_errors():
    env = TokenBatchEnv(**SMALL)
    env.reset(seed=0)
    for _ in range(3000):
        _, _, te, tr, info = env.step(np.zeros(8))
        if te or tr:
            break
    assert "episode_goodput" in info and 0 <= info["episode_goodput"] <= 1
    with pytest.raises(ConfigError):
        env.step(np.zeros(8))


def _advance_epoch_by_epoch(core, live, meanwhile=None, kernel=None):
    """docs/design.md section 5's epochs outside the engine: ``EngineRun.advance`` to each epoch in turn,
    stopping at the episode's end, the iteration cap, or a needed decision, read off the
    observation (>= 2 waiting, or shedding on and a waiting request with its TTFT lost); then the
    env's per-copy work (``kernel.after``: steps, observations, rewards) on the copies that
    stopped, as the env's kernel does for the copies it advances (``meanwhile`` first)."""
    from tokenbatch_env.engine import kernel as K
    if meanwhile is not None:
        meanwhile()
    run, A, cfg = core.run, core.run.arrays, core.config
    t0, dt = A.epoch[:, K.EP_T0], core.dt_ns
    lost = obs_layout(cfg.k).index("queue_lost_frac")
    stop = np.full(core.n, K.STOP_NONE)
    pending = live.copy()
    while pending.any():
        run.advance(np.where(pending, t0 + ((A.now - t0) // dt + 1) * dt, A.now), active=pending)
        ended = (A.end_state[:, core.s0:core.s1] != K.E_NONE).all(axis=1)
        capped = ~ended & (A.it >= cfg.max_iterations)
        core.observe(pending)
        need = (A.n_wait >= 2) | ((core.base_margin is not None) & (core.obs[:, lost] > 0))
        stop[pending & ended] = K.STOP_ENDED
        stop[pending & capped] = K.STOP_CAP
        stop[pending & ~ended & ~capped & need] = K.STOP_DECIDE
        pending &= stop == K.STOP_NONE
    A.epoch[:, K.EP_STOP] = stop
    if kernel is not None and live.any():
        kernel.after(live.copy())
    return stop


@pytest.mark.parametrize("kw", [dict(), dict(decision_interval_ms=20.0, shed_margin=None),
                                dict(rho=(1.5, 3.0), max_iterations=400)])
def test_engine_epochs_match_epoch_by_epoch_reference(kw):
    """The engine's own decision epochs (``EngineRun.advance_to_decision``: epochs that need no
    decision skipped inside the kernel, jumps across them) give the MDP of stepping epoch by epoch."""
    kw = {"rho": (0.8, 2.0), **SMALL, **kw}
    envs = [TokenBatchVectorEnv(3, **kw) for _ in range(2)]
    ref = envs[1].core
    ref.run.advance_to_decision = lambda live, meanwhile=None, kernel=None: _advance_epoch_by_epoch(
        ref, live, meanwhile, kernel)
    outs = [e.reset(seed=9)[0] for e in envs]
    assert np.array_equal(*outs)
    rng = np.random.default_rng(4)
    ended = 0
    for _ in range(600):
        a = rng.uniform(-1, 1, (3, len(ACTION_NAMES)))
        r0, r1 = envs[0].step(a), envs[1].step(a)
        for x, y in zip(r0[:4], r1[:4]):
            assert np.array_equal(x, y)
        assert _same_info(_unbatch(r0[4], 0), _unbatch(r1[4], 0))
        ended += int((r0[2] | r0[3]).sum())
    assert ended >= 3
    assert np.array_equal(envs[0].core.run.arrays.it, envs[1].core.run.arrays.it)


def test_advance_to_decision_needs_epochs():
    from engine_helpers import tiny_trace

    from tokenbatch_env.engine import kernel as K
    from tokenbatch_env.engine.simulate import EngineRun
    from tokenbatch_env.engine.state import EngineConfig
    run = EngineRun([tiny_trace([0, 0, 0, 50], [300, 300, 300, 40], [20, 20, 20, 5])] * 2, "linear",
                    config=EngineConfig(max_num_batched_tokens=256))
    with pytest.raises(ConfigError, match="start_epochs"):
        run.advance_to_decision()
    with pytest.raises(ConfigError, match="scored"):
        run.start_epochs(interval_ns=10**6, scored=(2, 9), shed_on=False)
    run.start_epochs(interval_ns=10**6, scored=(0, 1), shed_on=False)
    stop = run.advance_to_decision(np.array([True, False]))
    assert stop.tolist() == [K.STOP_DECIDE, K.STOP_NONE]      # 3 arrivals at t=0: >= 2 wait
    A = run.arrays
    assert A.it[1] == 0 and A.n_wait[0] >= 2 and A.now[0] >= 10**6
    while stop[0] == K.STOP_DECIDE:
        stop = run.advance_to_decision(np.array([True, False]))
    assert stop[0] == K.STOP_ENDED and A.end_state[0, 0] != K.E_NONE



@pytest.mark.parametrize("threads, chunk_steps", [(1, 20_000), (2, 20_000), (2, 3)])
def test_advance_to_decision_kernel_runs_each_copy_once_per_call(threads, chunk_steps):
    """A ``kernel`` given to ``advance_to_decision`` replaces ``K.run_copies``: in each round, the
    engine threads' calls share one claim counter and each copy still to advance is run by exactly
    one of them (its own ``mine``), never an inactive one; every active copy ends the call stopped,
    also when copies take several rounds (``chunk_steps``) and over several threads."""
    import threading

    from tokenbatch_env.engine import kernel as K
    from tokenbatch_env.engine.simulate import EngineRun
    env = TokenBatchVectorEnv(8, **SMALL, seed=2)
    env.reset()
    traces = [env.core.workload.units[u] for u in env.core.units[:8]]
    from tokenbatch_env.policies import engine_policy
    run = EngineRun(traces, "stress-512", engine_policy("edf", shed_margin=0.0), threads=threads)
    run.start_epochs(interval_ns=50 * 10**6, shed_on=True)
    active = np.array([True, True, False, True, True, True, False, True])
    lock = threading.Lock()
    for _ in range(5):
        calls: list = []

        def kernel(*args, claim, mine):   # (called within this iteration, by advance_to_decision)
            total = K.run_copies(*args, claim=claim, mine=mine)
            with lock:   # (claim kept: ids stay unique)
                calls.append((claim, args[8].copy(), mine.copy()))  # noqa: B023
            return total
        stop = run.advance_to_decision(active, chunk_steps=chunk_steps, kernel=kernel)
        rounds: dict = {}
        for claim, act, mine in calls:
            rounds.setdefault(id(claim), []).append((act, mine))
        assert all(1 <= len(v) <= threads for v in rounds.values())
        assert any(np.array_equal(v[0][0], active) for v in rounds.values())   # the first round: all
        assert not any((v[0][0] & ~active).any() for v in rounds.values())
        for v in rounds.values():
            runs = np.sum([mine for _, mine in v], axis=0)
            assert np.array_equal(runs, v[0][0].astype(np.int64))   # each copy of the round once
        assert (stop[active] != K.STOP_NONE).all() and (stop[~active] == K.STOP_NONE).all()


@pytest.mark.parametrize("mode", ["index", "weights"])
def test_without_the_shed_action_the_margin_stays_at_the_base(mode):
    """``shed_action=False``: the action loses its last (shed margin) dimension and the env steps
    exactly as the full action with that dimension at 0 (the base margin); check_env passes; a full
    width action is refused with the names of the dimensions."""
    from gymnasium.utils.env_checker import check_env
    kw = dict(rho=(1.0, 2.0), action_mode=mode, **SMALL)
    full, short = TokenBatchVectorEnv(4, **kw), TokenBatchVectorEnv(4, shed_action=False, **kw)
    d = full.core.action_dim
    assert short.core.action_dim == d - 1 and short.single_action_space.shape == (d - 1,)
    assert "shed_margin" not in short.core.action_names
    assert _same_tree(full.reset(seed=2), short.reset(seed=2))
    rng = np.random.default_rng(1)
    for _ in range(60):
        a = rng.uniform(-1, 1, (4, d))
        a[:, -1] = 0.0
        assert _same_tree(full.step(a), short.step(a[:, :-1]))
    theta, margin = short.core.map_actions(np.zeros((2, d - 1)))
    assert np.array_equal(theta, np.tile(short.core.theta_star, (2, 1))) and (margin == short.core.base_margin).all()
    with pytest.raises(ActionError, match="kappa|w_"):
        short.step(np.zeros((4, d)))
    envs = [gym.make(f"TokenBatch-v{v}", shed_action=False, action_mode=mode, **SMALL).unwrapped for v in (0, 1)]
    for env in envs:   # (made outside: v0's make warns that v1 exists, by Gymnasium's convention)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(env)
    with pytest.raises(ConfigError, match="shed_action"):
        TokenBatchVectorEnv(1, shed_action="no", **SMALL)


# ---------------------------------------------------------------------------- weights action mode
def test_weights_mode_spaces_check_env_and_mapping(tmp_path):
    from gymnasium.utils.env_checker import check_env
    from tokenbatch_env.envs import WEIGHT_ACTION_NAMES

    env = gym.make("TokenBatch-v0", action_mode="weights", **SMALL)
    assert env.action_space.shape == (len(WEIGHT_ACTION_NAMES),) == (S.N_WEIGHTS + 1,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    core = env.unwrapped.core
    a = np.zeros((1, 9))
    theta, margin = core.map_actions(a)
    assert np.array_equal(theta[0], core.theta_star) and theta[0, S.N_WEIGHTS] == core.workload.t_ref_ms
    assert core.theta_star[0] == -1.0 and not core.theta_star[1:S.N_WEIGHTS].any()  # default: SJF's order
    a[0, :S.N_WEIGHTS] = np.linspace(-1, 1, S.N_WEIGHTS)
    a[0, -1] = 0.5
    theta, margin = core.map_actions(a)
    assert np.allclose(theta[0, :S.N_WEIGHTS], core.theta_star[:S.N_WEIGHTS] + a[0, :S.N_WEIGHTS])
    assert margin[0] == 1.0   # 0.0 + 0.5 * 2
    with pytest.raises(ActionError, match="w_z"):
        env.unwrapped.step(np.r_[0.0, np.nan, np.zeros(7)])
    p = tmp_path / "w.json"
    p.write_text(json.dumps({"weights": {"w": {"to_deadline": -1.0}, "shed_margin": 0.5}}))
    venv = TokenBatchVectorEnv(1, action_mode="weights", base_params=str(p), **SMALL)
    assert venv.core.theta_star[5] == -1.0 and venv.core.base_margin == 0.5
    p.write_text(json.dumps({"weights": {"w": {"nope": 1.0}}}))
    with pytest.raises(Exception, match="nope"):
        TokenBatchVectorEnv(1, action_mode="weights", base_params=str(p), **SMALL)


# ---------------------------------------------------------------------------- engine threads
def _same_tree(a, b) -> bool:
    """Equal to the bit: arrays by dtype, shape and bytes, floats by their bytes, dicts recursively."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        if a.dtype == object:
            return a.shape == b.shape and all(_same_tree(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return a == b


@pytest.mark.parametrize("threads, mode, overlap", [(2, "NEXT_STEP", 0), (2, "NEXT_STEP", 10**9),
                                                    (3, "SAME_STEP", 0), (7, "NEXT_STEP", 0)])
def test_threads_do_not_change_results(threads, mode, overlap, monkeypatch):
    """Lockstep over a rollout with many episode ends: 1 thread vs ``threads`` (more threads than
    copies too), observations, rewards, flags, infos (final observations included) and records.
    Observations and rewards are split too (their minimum group size lowered to 1 copy); NEXT_STEP's
    new episodes laid out while the engine runs (``overlap`` 0) or before it (a large threshold)."""
    from tokenbatch_env.envs import core as E
    monkeypatch.setattr(E, "_MIN_GROUP", 1)
    monkeypatch.setattr(E, "_OVERLAP_LIVE_PER_RESET", overlap)
    n = 6 if threads == 7 else 12
    kw = dict(rho=(0.8, 2.0), autoreset_mode=mode, **SMALL)
    one = TokenBatchVectorEnv(n, threads=1, **kw)
    many = TokenBatchVectorEnv(n, threads=threads, **kw)
    assert (one.threads, many.threads) == (1, threads)
    assert _same_tree(one.reset(seed=3), many.reset(seed=3))
    rng = np.random.default_rng(4)
    ended = 0
    for _ in range(250):
        a = rng.uniform(-1, 1, (n, len(ACTION_NAMES)))
        s1, s2 = one.step(a), many.step(a)
        assert _same_tree(s1, s2)
        ended += int((s1[2] | s1[3]).sum())
    assert ended >= n
    for c in range(n):
        assert _same_tree(one.episode_records(c), many.episode_records(c))
    many.close()
    assert _same_tree(one.step(a), many.step(a))   # usable after close (threads restart)


@pytest.mark.parametrize("threads", [1, 2])
def test_same_step_prepared_episodes_equal_drawn_at_reset(threads, monkeypatch):
    """SAME_STEP draws and cuts each copy's next episode ahead, while the engine runs
    (``core.Core.prepare_ahead``): lockstep against the same env drawing each episode at its reset, over
    a rollout with many episode ends, a full reseed and a partial one (seeded copies' prepared
    episodes discarded, the others' kept). The prepared path is checked to be the one taken."""
    from tokenbatch_env.envs import core as E
    from tokenbatch_env.envs import env as V
    n = 12
    kw = dict(rho=(0.8, 2.0), autoreset_mode="SAME_STEP", threads=threads, **SMALL)
    monkeypatch.setattr(V, "_PREPARE_AHEAD", False)
    ref = TokenBatchVectorEnv(n, **kw)
    monkeypatch.setattr(V, "_PREPARE_AHEAD", True)
    monkeypatch.setattr(E, "_OVERLAP_LIVE_PER_RESET", 2)   # up to n / 2 copies prepared per step
    env = TokenBatchVectorEnv(n, **kw)
    assert ref.core._prep is None and env.core._prep is not None
    took = []
    take = env.core._take_prepared
    env.core._take_prepared = lambda rows: (took.append(int(env.core._ready[rows].sum())), take(rows))[1]
    assert _same_tree(ref.reset(seed=3), env.reset(seed=3))
    rng = np.random.default_rng(4)
    ended = 0
    for i in range(300):
        if i == 100:
            assert _same_tree(ref.reset(seed=11), env.reset(seed=11))
        if i == 200:
            mask = np.arange(n) % 3 == 0
            seeds = [None if c % 2 else 50 + c for c in range(n)]   # some reset copies keep their generator
            kw = dict(seed=seeds, options={"reset_mask": mask})
            assert _same_tree(ref.reset(**kw), env.reset(**kw))
        a = rng.uniform(-1, 1, (n, len(ACTION_NAMES)))
        s1, s2 = ref.step(a), env.step(a)
        assert _same_tree(s1, s2)
        ended += int((s1[2] | s1[3]).sum())
    assert ended >= 3 * n
    assert sum(took) >= ended // 2   # most new episodes were prepared ahead


@pytest.mark.parametrize("error", ["ConfigError", "TraceError"])
def test_same_step_prepared_episode_error_raises_at_its_reset(monkeypatch, error):
    """A drawn episode that cannot be cut (its scaled trace out of range: a TraceError from the trace's
    checks) raises at the reset of its copy, the same step as when drawn there, not when it was
    prepared ahead."""
    from tokenbatch_env import errors
    from tokenbatch_env.envs import core as E
    from tokenbatch_env.envs import env as V
    from tokenbatch_env.workload import Workload
    n = 8
    kw = dict(rho=(1.5, 2.5), autoreset_mode="SAME_STEP", threads=2, **SMALL)
    monkeypatch.setattr(E, "_OVERLAP_LIVE_PER_RESET", 1)
    envs = []
    for prep in (False, True):
        monkeypatch.setattr(V, "_PREPARE_AHEAD", prep)
        envs.append(TokenBatchVectorEnv(n, **kw))
    for env in envs:
        env.reset(seed=5)
    bad = envs[0].core.units[0]

    def window_at(self, *a, **k):
        raise getattr(errors, error)("window out of range (test)")
    monkeypatch.setattr(Workload, "scaled_in_range", lambda self, u, f: u != bad)
    monkeypatch.setattr(Workload, "window_at", window_at)
    raised, deferred = [], 0
    for env in envs:
        rng = np.random.default_rng(1)
        steps = 0
        with pytest.raises(getattr(errors, error), match="out of range"):
            for steps in range(1, 400):  # noqa: B007 - the step that raised, read below
                env.step(rng.uniform(-1, 1, (n, len(ACTION_NAMES))))
                if env.core._prep is not None:
                    deferred += len(env.core._prep_error)   # drawn ahead, kept for the copy's reset
        raised.append(steps)
    assert raised[0] == raised[1] > 1 and deferred > 0


def test_engine_run_threads_identical_and_validated():
    from tokenbatch_env.engine.simulate import EngineRun
    from tokenbatch_env.traces.suites import load_suite
    traces = load_suite("seed-200").traces("train")[:5]
    runs = [EngineRun(traces, "stress-512", "fcfs", threads=t) for t in (1, 2, 4)]
    for r in runs:
        r.advance(until_ns=3_000_000_000, active=np.array([True, False, True, True, True]))
        r.advance(chunk_steps=300)
    for r in runs[1:]:
        a, b = runs[0].result().arrays, r.result().arrays
        assert all(getattr(a, f).tobytes() == getattr(b, f).tobytes() for f in a._fields)
        r.close()
    for bad in (0, -1, 1.5, "2", True, None):
        with pytest.raises(ConfigError, match="threads"):
            EngineRun(traces[:1], "stress-512", "fcfs", threads=bad)


def test_fetch_add_is_atomic():
    """``_jit.fetch_add`` (how engine threads claim copies) loses no increment between threads,
    compiled; interpreted it returns the old value too."""
    import threading

    from tokenbatch_env.engine._jit import fetch_add, njit

    @njit
    def claim_many(a, n):
        last = -1
        for _ in range(n):
            old = fetch_add(a, 0, 3)
            if old <= last:   # each thread sees the counter only grow
                return False
            last = old
        return True

    a = np.zeros(1, np.int64)
    ok = []
    ts = [threading.Thread(target=lambda: ok.append(claim_many(a, 200_000))) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert a[0] == 2 * 3 * 200_000 and ok == [True, True]
    b = np.array([5], np.int64)
    assert fetch_add(b, 0, 2) == 5 and b[0] == 7   # from Python: the locked interpreted version


def test_next_copy_shares_each_active_copy_out_once():
    """``kernel.next_copy``: alone, a thread takes the active copies in order; claimers interleaving
    their claims (simulated in turn here) take disjoint sets that cover the active copies, each in
    chunks of ``CLAIM_CHUNK`` consecutive copies."""
    from tokenbatch_env.engine import kernel as K
    rng = np.random.default_rng(1)
    for n in (1, 7, K.CLAIM_CHUNK, 5 * K.CLAIM_CHUNK + 3):
        active = rng.random(n) < 0.7
        claim = np.zeros(1, np.int64)
        c, end, seq = *K.next_copy(active, claim, -1, 0), []
        while c < n:
            seq.append(c)
            c, end = K.next_copy(active, claim, c, end)
        assert seq == np.flatnonzero(active).tolist()
        claim[0] = 0   # three claimers taking turns
        state, got = [(-1, 0)] * 3, [[], [], []]
        live = [0, 1, 2]
        while live:
            for t in list(live):
                c, end = K.next_copy(active, claim, *state[t])
                if c >= n:
                    live.remove(t)
                    continue
                state[t] = (c, end)
                got[t].append(c)
        assert sorted(sum(got, [])) == np.flatnonzero(active).tolist()
        chunks = [{c // K.CLAIM_CHUNK for c in g} for g in got]   # whole chunks, one claimer each
        assert all(g == sorted(g) for g in got) and sum(map(len, chunks)) == len(set().union(*chunks))


def test_engine_threads_share_out_the_copies():
    """Two kernel calls started together on one claim counter (as ``EngineRun`` runs them) run each
    active copy exactly once between them (their ``mine`` masks: disjoint, covering the active
    copies, both non-empty with this much work), with the results of one call running them all."""
    import threading

    from tokenbatch_env.engine import kernel as K
    from tokenbatch_env.engine.simulate import EngineRun
    from tokenbatch_env.traces.suites import load_suite
    units = load_suite("seed-200").traces("train")
    n = 8 * K.CLAIM_CHUNK
    traces = [units[i % len(units)] for i in range(n)]
    active = np.random.default_rng(2).random(n) < 0.8
    runs = [EngineRun(traces, "stress-512", "fcfs") for _ in range(2)]
    ref = runs[0]
    ref.advance(until_ns=np.full(n, 40 * 10**9), active=active)
    run, A = runs[1], runs[1].arrays
    until = np.full(n, 40 * 10**9, np.int64)
    claim, start = np.zeros(1, np.int64), threading.Barrier(2)
    mines = [np.zeros(n, bool), np.zeros(n, bool)]

    def go(i):
        start.wait()
        K.run_copies(A, run.cfg, run.fcfg, run.theta, run.shed_margin, run.mrl, run.tier, run.score,
                     active, 50_000_000, until, claim=claim, mine=mines[i])
    ts = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not (mines[0] & mines[1]).any() and ((mines[0] | mines[1]) == active).all()
    assert mines[0].any() and mines[1].any()
    assert all(getattr(A, f).tobytes() == getattr(ref.arrays, f).tobytes() for f in A._fields)


def test_map_groups_meanwhile():
    """``EngineRun.map_groups(meanwhile=...)`` (how new episodes are laid out while the engine runs):
    ``meanwhile`` runs once, in the pool thread, before that thread's group; a nested call from it
    runs inline (never waiting on its own pool); with one thread it runs first; its error raises."""
    import threading

    from tokenbatch_env.engine.simulate import EngineRun
    from tokenbatch_env.traces.suites import load_suite
    traces = load_suite("seed-200").traces("train")[:4]
    act = np.ones(4, bool)
    for threads in (1, 2):
        run = EngineRun(traces, "stress-512", "fcfs", threads=threads)
        events = []

        # (fn and meanwhile are called within this iteration, by map_groups below)
        def fn(g):
            events.append(("fn", threading.current_thread().name))  # noqa: B023
            return int(g.sum())

        def meanwhile():
            nested = run.map_groups(lambda g: threading.current_thread().name, act)  # noqa: B023
            events.append(("meanwhile", threading.current_thread().name, nested))  # noqa: B023
        assert run.map_groups(fn, act, split=False, meanwhile=meanwhile) == [4] * threads
        main = threading.current_thread().name
        mw = [e for e in events if e[0] == "meanwhile"]
        assert len(mw) == 1 and len(events) == threads + 1
        if threads == 1:
            assert events[0] == ("meanwhile", main, [main]) and events[1] == ("fn", main)
        else:
            pool = mw[0][1]
            assert pool != main and mw[0][2] == [pool]
            assert events.index(mw[0]) < events.index(("fn", pool)) and ("fn", main) in events

        def bad():
            raise ValueError("layout failed")
        with pytest.raises(ValueError, match="layout failed"):
            run.map_groups(fn, act, split=False, meanwhile=bad)
        run.close()


@pytest.mark.parametrize("bad", [0, -2, 2.0, "4", True])
def test_bad_threads(bad):
    with pytest.raises(ConfigError, match="threads"):
        TokenBatchVectorEnv(2, threads=bad, **SMALL)


def test_threads_default_and_entry_points(monkeypatch):
    from tokenbatch_env import envs as E
    monkeypatch.setattr("tokenbatch_env.util.available_cores", lambda: 3)
    assert E.default_threads(1) == 1 and E.default_threads(63) == 1 and E.default_threads(64) == 3
    assert TokenBatchVectorEnv(2, **SMALL).threads == 1
    assert TokenBatchEnv(**SMALL).core.run.threads == 1
    venv = gym.make_vec("TokenBatch-v0", num_envs=2, vectorization_mode="vector_entry_point", threads=2, **SMALL)
    assert venv.threads == 2 and venv.core.run.threads == 2
    assert "threads" not in {f.name for f in __import__("dataclasses").fields(TokenBatchConfig)}


def test_observation_sorts_equal_numbas_sorts_to_the_bit():
    """The observation's allocation-free sorts (``observation._sort_small``, ``observation._argsort_stable``) give what
    numba's ``np.sort`` and ``np.argsort(kind="mergesort")`` give, to the bit: -0.0 and 0.0 keep
    numba's order, NaN sorts last, ties keep their order; on both sides of the size threshold."""
    from numba import njit

    from tokenbatch_env.envs.observation import _argsort_stable, _sort_small

    @njit
    def ref(x):
        return np.sort(x), np.argsort(x, kind="mergesort")

    rng = np.random.default_rng(7)
    for t in range(400):
        n = int(rng.integers(0, 40))
        x = rng.choice([-1.5, -0.0, 0.0, 0.5, 2.0, np.inf, -np.inf], n) if t % 2 else rng.normal(size=n)
        if t % 5 == 0 and n:
            x[rng.integers(n)] = np.nan
        want_sort, want_order = ref(x)
        got_sort, got_order = np.full(n, 9.0), np.full(n, -1, np.int64)
        _sort_small(x, got_sort)
        _argsort_stable(x, got_order)
        assert got_sort.tobytes() == want_sort.tobytes(), (t, x)
        assert np.array_equal(got_order, want_order), (t, x)


def test_episode_columns_refuse_windows_outside_their_unit():
    """``episodes.EpisodeTable.columns`` gathers in compiled code (no bounds checks): a window past its unit's
    last row, or before its first, is an IndexError naming the rows, not a read of other memory."""
    env = TokenBatchVectorEnv(2, window=32, warmup=8, cooldown=8, seed=3)
    T, n = env.core.episodes, env.core.config.n_req
    u = int(env.core.units[0])
    f = [env.core.workload.scale_factor(1.0)]
    T.columns(np.array([u]), np.array([int(T.lens[u]) - n]), n, f)   # the last window fits
    for lo in (int(T.lens[u]) - n + 1, -1):
        with pytest.raises(IndexError, match=f"rows \\[{lo}\\]"):
            T.columns(np.array([u]), np.array([lo]), n, f)


def test_hash_widths_sized_once_and_stale_entries_cleared():
    """The env sizes the per-copy hash dimensions once (``episodes.EpisodeTable.max_widths``: an upper bound
    of every window's widths, so resets never grow, i.e. copy, the arrays) and a reset clears only
    up to the larger of the old and new episode's widths: every chain_val row still holds the fill
    value past its episode's width, exactly as ``build_arrays`` would leave it, and every hash_head
    row is -1 except at the ids the copy's cached blocks hold (a reset clears just those)."""
    env = TokenBatchVectorEnv(8, rho=(0.5, 2.5), window=32, warmup=8, cooldown=8, seed=3)
    core = env.core
    env.reset()
    A0 = core.run.arrays
    H, W = core.episodes.max_widths(core.config.n_req)
    assert A0.chain_val.shape[1] >= H and A0.hash_head.shape[1] >= W
    wl, rng = core.workload, np.random.default_rng(0)
    for _ in range(200):   # the bound holds for any window
        u = int(rng.choice(core.units))
        lo = int(rng.integers(0, len(wl.units[u]) - core.config.n_req + 1))
        cols, _, _ = core.episodes.columns(np.array([u]), np.array([lo]), core.config.n_req,
                                           [wl.scale_factor(1.0)])
        assert cols["chain_val"].shape[1] <= H and cols["ids"].max() <= W
    resets = 0
    for _ in range(120):
        _, _, term, trunc, _ = env.step(np.zeros((8, core.action_dim)))
        resets += int((term | trunc).sum())
        A = core.run.arrays
        assert A.hash_head is A0.hash_head and A.chain_val is A0.chain_val   # never regrown
        for c in range(8):
            # hash_head: -1 except at the ids the copy's blocks hold (each pointing at such a block)
            set_ids = np.flatnonzero(A.hash_head[c] != -1)
            assert set(set_ids.tolist()) == set(A.bhash[c][A.bhash[c] >= 0].tolist())
            assert (A.bhash[c, A.hash_head[c, set_ids]] == set_ids).all()
            assert (A.chain_val[c, core.cv_extent[c]:] == 0).all() and core.cv_extent[c] == A.chain_off[c, -1]
    assert resets > 8
