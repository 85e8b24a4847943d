"""Bit-identity check of TokenBatch-v0 trajectories between two checkouts (or settings).

    PYTHONPATH=/path/to/old python tools/env_identity.py dump old.pkl
    PYTHONPATH=/path/to/new python tools/env_identity.py dump new.pkl [--env-kw threads=2]
    python tools/env_identity.py compare old.pkl new.pkl

``dump`` steps ``TokenBatchVectorEnv`` through a few configurations (default, zero actions,
SAME_STEP with a wide load range, weights/met with a step cap) with seeded random actions and
pickles every observation, reward, terminated/truncated flag, info dict and the last episode records
of each copy; ``compare`` checks that two dumps are equal to the bit (floats by their bytes).
"""

from __future__ import annotations

import argparse
import pickle

import numpy as np

CASES = [
    ("default-random", dict(), 64, 300, "random"),
    ("default-zero", dict(), 64, 300, "zero"),
    ("same-step", dict(autoreset_mode="SAME_STEP", rho=(0.5, 2.5)), 48, 200, "random"),
    ("weights-met", dict(action_mode="weights", reward_mode="met", rho=1.3, window=64, warmup=8, cooldown=8,
                         decision_interval_ms=37.5, max_steps=40), 40, 200, "random"),
]


def _canon(x):
    if isinstance(x, dict):
        return {k: _canon(v) for k, v in sorted(x.items())}
    if isinstance(x, np.ndarray) and x.dtype == object:
        return [_canon(v) for v in x]
    return x


def dump(path: str, env_kw: dict) -> None:
    from tokenbatch_env.envs import TokenBatchVectorEnv
    res = {}
    for name, cfg, n, steps, amode in CASES:
        env = TokenBatchVectorEnv(num_envs=n, **cfg, **env_kw)
        rng = np.random.default_rng(1)
        traj = [_canon(env.reset(seed=7))]
        ended = 0
        for _ in range(steps):
            shape = (n, env.core.action_dim)
            a = rng.uniform(-1, 1, shape) if amode == "random" else np.zeros(shape)
            obs, r, te, tr, info = env.step(a)
            traj.append((obs, r, te, tr, _canon(info)))
            ended += int((te | tr).sum())
        traj.append([env.episode_records(c) for c in range(n)])
        env.close()
        res[name] = traj
        print(f"{name}: {n} copies x {steps} steps, {ended} episodes ended")
    from tokenbatch_env._io import write_with
    write_with(path, lambda p: p.write_bytes(pickle.dumps(res)))


def _eq(x, y, path: str) -> None:
    if type(x) is not type(y):
        raise AssertionError(f"{path}: type {type(x).__name__} vs {type(y).__name__}")
    if isinstance(x, dict):
        if x.keys() != y.keys():
            raise AssertionError(f"{path}: keys differ: {sorted(set(x) ^ set(y))}")
        for k in x:
            _eq(x[k], y[k], f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        if len(x) != len(y):
            raise AssertionError(f"{path}: lengths {len(x)} vs {len(y)}")
        for i, (u, v) in enumerate(zip(x, y)):
            _eq(u, v, f"{path}[{i}]")
    elif isinstance(x, np.ndarray):
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            raise AssertionError(f"{path}: arrays differ ({x.dtype}{x.shape} vs {y.dtype}{y.shape})")
    elif isinstance(x, float):
        if np.float64(x).tobytes() != np.float64(y).tobytes():
            raise AssertionError(f"{path}: {x!r} vs {y!r}")
    elif x != y:
        raise AssertionError(f"{path}: {x!r} vs {y!r}")


def compare(a_path: str, b_path: str) -> None:
    with open(a_path, "rb") as f:
        a = pickle.load(f)
    with open(b_path, "rb") as f:
        b = pickle.load(f)
    _eq(a, b, "dump")
    print(f"IDENTICAL: {len(a)} cases, {sum(len(v) for v in a.values())} entries (observations, rewards, "
          f"terminated, truncated, infos, episode records)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--env-kw", nargs="*", default=[], metavar="KEY=INT",
                   help="extra integer keywords for TokenBatchVectorEnv (e.g. threads=2)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    a = ap.parse_args(argv)
    if a.cmd == "dump":
        dump(a.out, {k: int(v) for k, v in (kv.split("=", 1) for kv in a.env_kw)})
    else:
        compare(a.a, a.b)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
