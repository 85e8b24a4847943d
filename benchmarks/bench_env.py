"""TokenBatch-v0 throughput benchmark (run by hand; not a unit test).

    python benchmarks/bench_env.py                  # 1,024 copies: (a)/(b) paired, 20 rounds; (c)
    python benchmarks/bench_env.py --sequential     # also (a) then (b) one after the other, 100 steps each
    python benchmarks/bench_env.py --copies 256 --paired 10
    python benchmarks/bench_env.py --rho 2 3 --interval-ms 20   # less simulation per step
    python benchmarks/bench_env.py --threads 1 --no-sync --no-adapter   # native env alone, one engine thread
    python benchmarks/bench_env.py --breakdown --no-sync --no-adapter   # where (a)'s time goes

Prints, see benchmarks/README.md ("Environment benchmark") for the definitions:
  (a) native ``TokenBatchVectorEnv`` env-steps/s (copies x steps / wall seconds), alone (--steps);
  (a)/(b) paired (the speed-up, with its verdict at 1,024 copies: target >= 30x, judged unrounded):
      (a) and (b), ``gymnasium.vector.SyncVectorEnv`` of ``TokenBatchEnv`` copies with the same config,
      seeds and actions (so the very same trajectories: checked by the rewards), alternated in
      --paired R rounds of --native-steps-per-round native and --sync-steps-per-round SyncVectorEnv
      steps, so that both see the same phases of the machine (this VM's speed drifts by tens of
      percent within seconds, and not alike for one interpreter thread and two engine threads): both
      rates, their ratio with a 95% bootstrap interval over the rounds (``ratio_ci``: how far one run's
      ratio moves with the phases it saw), and the ratio's median and range per round. Each round's first native
      step starts from caches the SyncVectorEnv steps filled, so short rounds lower (a): 5 native
      steps per round gave 9-18% less than 20 (session 15). --paired 0 (or --no-sync): off;
  --sequential: (b) measured after (a) (--steps each), and their ratio, as before session 21;
  --no-sync: no SyncVectorEnv at all (neither the paired measurement, unless --paired is given,
      nor the sequential (b));
  (c) the SB3 adapter (``tokenbatch_env.sb3``, SAME_STEP) over the native env vs the raw native env
      in SAME_STEP mode, stepped alternately (same seeds and actions): env-steps/s and the adapter's
      overhead (total time, and the median of the per-step time ratios);
  --breakdown: (a)'s wall time per copy-step split into the engine with the observations, rewards
      and episode metrics of the copies it advanced (``advance_to_decision``: each engine thread
      claims a batch of copies at a time, advances them, then observes and rewards them and computes
      the metrics of those whose episode ended; one thread first lays out the new episodes of the
      copies that ended in the previous step, timed too), the episode metrics' info arrays and the
      rest (the step's Python: action checks and mapping, infos).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

CONFIG = dict(suite="seed-200", split="train", profile="stress-512", rho=(0.8, 1.5))
#: keywords of the native env beyond the config (``--threads``)
ENV_KW: dict = {}


def _actions(n: int, steps: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (steps, n, 8)).astype(np.float32)


def _drive(step, acts, warm: int):
    for a in acts[:warm]:
        step(a)
    rewards = []
    t0 = time.perf_counter()
    for a in acts[warm:]:
        rewards.append(np.asarray(step(a)[1]).copy())
    return time.perf_counter() - t0, np.array(rewards)


def _measure(make, n: int, steps: int, warm: int) -> dict:
    """Build, reset and step an env (``make()``): build/reset times and env-steps/s after warm-up."""
    t0 = time.perf_counter()
    env = make()
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    env.reset(seed=0)
    reset = time.perf_counter() - t0
    wall, rew = _drive(env.step, _actions(n, warm + steps), warm)
    return {"build_s": build, "reset_s": reset, "wall_s": wall, "steps_per_s": n * steps / wall,
            "rewards": rew}


def bench_native(n: int, steps: int, warm: int) -> dict:
    from tokenbatch_env.envs import TokenBatchVectorEnv
    return _measure(lambda: TokenBatchVectorEnv(n, **CONFIG, **ENV_KW), n, steps, warm)


#: (object path in the native env, label, nested) of the parts ``--breakdown`` times; a nested part
#: runs inside the one before it (the resets: in an engine thread while the other advances the copies)
PARTS = (("core.run.advance_to_decision", "engine + observations + rewards + episode metrics, new episodes "
          "laid out meanwhile (advance_to_decision)", False),
         ("core.reset_copies", "of which, overlapping the engine in one thread: resets (windows laid out + "
          "their observations)", True),
         ("core.episode_infos", "episode metrics' info arrays (computed in the engine threads as episodes end)",
          False))


def bench_breakdown(n: int, steps: int, warm: int) -> dict:
    """(a) with the parts of ``PARTS`` timed (wall, per copy-step; the rest is the wall time outside
    the parts that are not nested)."""
    from tokenbatch_env.envs import TokenBatchVectorEnv
    env = TokenBatchVectorEnv(n, **CONFIG, **ENV_KW)
    env.reset(seed=0)
    spent = {label: 0.0 for _, label, _ in PARTS}

    def timed(fn, label):
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[label] += time.perf_counter() - t0
        return run

    acts = _actions(n, warm + steps)
    for a in acts[:warm]:
        env.step(a)
    for path, label, _ in PARTS:
        *owner, name = path.split(".")
        obj = env
        for o in owner:
            obj = getattr(obj, o)
        setattr(obj, name, timed(getattr(obj, name), label))
    t0 = time.perf_counter()
    for a in acts[warm:]:
        env.step(a)
    wall = time.perf_counter() - t0
    us = 1e6 / (n * steps)
    out = {label: v * us for label, v in spent.items()}
    out["rest (step's Python)"] = (wall - sum(spent[label] for _, label, nested in PARTS if not nested)) * us
    out["total"] = wall * us
    return out


def bench_sync(n: int, steps: int, warm: int) -> dict:
    import gymnasium as gym

    from tokenbatch_env.envs import TokenBatchEnv
    return _measure(lambda: gym.vector.SyncVectorEnv([lambda: TokenBatchEnv(**CONFIG) for _ in range(n)],
                                                     autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP),
                    n, steps, warm)


def bench_paired(n: int, rounds: int, native_steps: int, sync_steps: int, warm: int) -> dict:
    """(a) and (b) alternated in rounds (``native_steps`` native steps, then ``sync_steps``
    SyncVectorEnv steps), both envs built, reset and warmed up first: each sees the same phases of
    the machine, whose speed drifts by tens of percent over seconds on a shared VM, so their ratio
    is measured paired. Returns both rates over all rounds, the ratio per round, and whether the
    rewards agree on the steps both took."""
    import gymnasium as gym

    from tokenbatch_env.envs import TokenBatchEnv, TokenBatchVectorEnv
    nat = TokenBatchVectorEnv(n, **CONFIG, **ENV_KW)
    syn = gym.vector.SyncVectorEnv([lambda: TokenBatchEnv(**CONFIG) for _ in range(n)],
                                   autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    acts = _actions(n, warm + rounds * max(native_steps, sync_steps))
    rew = {}
    for name, env in (("native", nat), ("sync", syn)):
        env.reset(seed=0)
        rew[name] = [np.asarray(env.step(a)[1]).copy() for a in acts[:warm]]
    spent = {"native": [], "sync": []}
    for r in range(rounds):
        for name, env, k in (("native", nat, native_steps), ("sync", syn, sync_steps)):
            i = len(rew[name])
            t0 = time.perf_counter()
            for a in acts[i:i + k]:
                rew[name].append(np.asarray(env.step(a)[1]).copy())
            spent[name].append(time.perf_counter() - t0)
    m = min(len(rew["native"]), len(rew["sync"]))
    rate = {k: n * (native_steps if k == "native" else sync_steps) / np.array(v) for k, v in spent.items()}
    return {"native_sps": n * native_steps * rounds / sum(spent["native"]),
            "sync_sps": n * sync_steps * rounds / sum(spent["sync"]),
            "round_ratios": rate["native"] / rate["sync"],
            "ratio_ci": ratio_ci(spent["native"], spent["sync"], native_steps, sync_steps),
            "same_rewards": all(np.array_equal(a, b) for a, b in zip(rew["native"][:m], rew["sync"][:m]))}


def ratio_ci(native_s, sync_s, native_steps: int, sync_steps: int, level: float = 0.95, b: int = 2000,
             seed: int = 0) -> tuple:
    """A percentile bootstrap interval of the paired speed-up (native over SyncVectorEnv env-steps/s,
    each over all rounds) from the rounds' wall times, rounds resampled whole (a round's two sides saw
    the same phase of the machine): how far this one run's ratio could move with the phases it
    happened to see. Deterministic (``seed``)."""
    nat, syn = np.asarray(native_s, float), np.asarray(sync_s, float)
    idx = np.random.default_rng(seed).integers(0, nat.size, (b, nat.size))
    ratios = (native_steps / nat[idx].sum(1)) / (sync_steps / syn[idx].sum(1))
    return tuple(np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2]))


def bench_adapter(n: int, steps: int, warm: int) -> dict:
    """(c): the SB3 adapter and the raw native env in SAME_STEP, same seeds and actions, stepped
    alternately (one step each, in turn first), so that both see the same phases of the machine."""
    from tokenbatch_env.envs import TokenBatchVectorEnv
    from tokenbatch_env.sb3 import make_sb3_vec_env
    venv = make_sb3_vec_env(n, **CONFIG, **ENV_KW)
    venv.seed(0)
    venv.reset()
    raw = TokenBatchVectorEnv(n, autoreset_mode="SAME_STEP", **CONFIG, **ENV_KW)
    raw.reset(seed=0)

    def adapter_step(a):
        venv.step_async(a)
        return venv.step_wait()
    steppers = {"adapter": adapter_step, "raw": raw.step}
    spent = {k: [] for k in steppers}
    rew = {k: [] for k in steppers}
    for i, a in enumerate(_actions(n, warm + steps)):
        for k in (("adapter", "raw") if i % 2 else ("raw", "adapter")):
            t = time.perf_counter()
            r = steppers[k](a)[1]
            spent[k].append(time.perf_counter() - t)
            rew[k].append(np.asarray(r, np.float32).copy())
    t_ad, t_raw = (np.array(spent[k][warm:]) for k in ("adapter", "raw"))
    return {"adapter_sps": n * steps / t_ad.sum(), "raw_sps": n * steps / t_raw.sum(),
            "step_ratio_median": float(np.median(t_ad / t_raw)),
            "same_rewards": all(np.array_equal(x, y) for x, y in zip(rew["adapter"], rew["raw"]))}


#: the issue's speed target: native env-steps/s over SyncVectorEnv's, at TARGET_COPIES copies
TARGET, TARGET_COPIES = 30.0, 1024


def _versus_target(ratio: float, copies: int) -> str:
    """The speed-up, truncated to two decimals (rounding could show a miss as the target: 29.996x as
    30.00x), and, at the target's copies, its verdict, judged unrounded."""
    shown = f"{math.floor(ratio * 100) / 100:.2f}x"
    if copies != TARGET_COPIES:
        return f"{shown} (the target, >= {TARGET:g}x, is at {TARGET_COPIES:,} copies)"
    return f"{shown} (target >= {TARGET:g}x: {'met' if ratio >= TARGET else 'missed'})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=1024)
    ap.add_argument("--sync-copies", type=int, default=None, help="copies for the sequential (b) (default: --copies)")
    ap.add_argument("--steps", type=int, default=100,
                    help="timed steps of (a) alone, the sequential (b), --breakdown and (c) (not of the paired rounds)")
    ap.add_argument("--warm", type=int, default=10, help="untimed steps first, each env")
    ap.add_argument("--sequential", action="store_true",
                    help="also measure (b) after (a), --steps each, and their ratio (the method before session 21)")
    ap.add_argument("--no-sync", action="store_true",
                    help="no SyncVectorEnv: neither the paired measurement (unless --paired is given) nor the "
                         "sequential (b)")
    ap.add_argument("--no-adapter", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="also split (a)'s time per copy-step into parts")
    ap.add_argument("--paired", type=int, default=None, metavar="ROUNDS",
                    help="(a) and (b) alternated in ROUNDS rounds, the speed-up's measure (default 20, or 0 with "
                         "--no-sync; 0: off)")
    ap.add_argument("--native-steps-per-round", type=int, default=20, help="native steps per paired round")
    ap.add_argument("--sync-steps-per-round", type=int, default=4, help="SyncVectorEnv steps per paired round")
    ap.add_argument("--rho", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                    help="load range (default 0.8 1.5)")
    ap.add_argument("--interval-ms", type=float, default=None, help="decision_interval_ms (default 100)")
    ap.add_argument("--threads", type=int, default=None,
                    help="engine threads of the native env, (a) and (c) (default: the env's, the available "
                         "cores from 64 copies on); SyncVectorEnv's single envs use 1")
    a = ap.parse_args(argv)
    if a.paired is None:
        a.paired = 0 if a.no_sync else 20
    if a.paired < 0 or a.native_steps_per_round < 1 or a.sync_steps_per_round < 1:
        ap.error(f"--paired must be >= 0 (0: off), --native-steps-per-round and --sync-steps-per-round >= 1, "
                 f"got {a.paired}, {a.native_steps_per_round} and {a.sync_steps_per_round}")
    if a.steps < 1 or a.warm < 0 or a.copies < 1 or (a.sync_copies is not None and a.sync_copies < 1):
        ap.error(f"--copies, --sync-copies and --steps must be >= 1 and --warm >= 0, got {a.copies}, "
                 f"{a.sync_copies}, {a.steps} and {a.warm}")
    if a.threads is not None:
        ENV_KW["threads"] = a.threads
    if a.rho is not None:
        CONFIG["rho"] = tuple(a.rho)
    if a.interval_ms is not None:
        CONFIG["decision_interval_ms"] = a.interval_ms
    from tokenbatch_env.envs import default_threads
    print(f"config: {CONFIG}; engine threads (native env): {ENV_KW.get('threads', default_threads(a.copies))}")
    n, T, W = a.copies, a.steps, a.warm
    # compile/load the kernels and prepare the workload once, outside the timings
    bench_native(2, 3, 1)

    nat = bench_native(n, T, W)
    print(f"(a) native TokenBatchVectorEnv, {n} copies: {nat['steps_per_s']:,.0f} env-steps/s "
          f"({n * T:,} env-steps in {nat['wall_s']:.2f} s; build {nat['build_s']:.2f} s, "
          f"reset {nat['reset_s']:.2f} s)")
    if a.breakdown:
        parts = bench_breakdown(n, T, W)
        print(f"    (a) per copy-step, wall us ({n} copies): "
              + "; ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    if a.sequential and not a.no_sync:
        ns = a.sync_copies or n
        sy = bench_sync(ns, T, W)
        same = ns == n and np.array_equal(sy["rewards"], nat["rewards"])
        ref = nat if ns == n else bench_native(ns, T, W)
        print(f"(b) SyncVectorEnv of {ns} TokenBatchEnv: {sy['steps_per_s']:,.0f} env-steps/s "
              f"({ns * T:,} env-steps in {sy['wall_s']:.2f} s; build {sy['build_s']:.2f} s, "
              f"reset {sy['reset_s']:.2f} s); same rewards as (a): {same if ns == n else 'n/a'}")
        ratio = ref["steps_per_s"] / sy["steps_per_s"]
        print(f"    speed-up native / sync at {ns} copies: {_versus_target(ratio, ns)}")
    if a.paired:
        k = a.native_steps_per_round
        pr = bench_paired(n, a.paired, k, a.sync_steps_per_round, W)
        rr = pr["round_ratios"]
        print(f"(a)/(b) paired, {a.paired} rounds of {k} native and {a.sync_steps_per_round} SyncVectorEnv steps "
              f"({n} copies): native {pr['native_sps']:,.0f}, sync {pr['sync_sps']:,.0f} env-steps/s, speed-up "
              f"{_versus_target(pr['native_sps'] / pr['sync_sps'], n)} (95% bootstrap interval over the rounds "
              f"{pr['ratio_ci'][0]:.1f}-{pr['ratio_ci'][1]:.1f}x; rounds: median {np.median(rr):.1f}x, "
              f"{rr.min():.1f}-{rr.max():.1f}x); same rewards: {pr['same_rewards']}")
    if not a.no_adapter:
        ad = bench_adapter(n, T, W)
        print(f"(c) SB3 adapter, {n} copies, alternated step by step with the raw SAME_STEP env: "
              f"{ad['adapter_sps']:,.0f} vs {ad['raw_sps']:,.0f} env-steps/s: overhead "
              f"{100 * (ad['raw_sps'] / ad['adapter_sps'] - 1):+.1f}% (median per step "
              f"{100 * (ad['step_ratio_median'] - 1):+.1f}%) (same rewards: {ad['same_rewards']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
