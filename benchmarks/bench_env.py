"""TokenBatch-v0 throughput benchmark (run by hand; not a unit test).

    python benchmarks/bench_env.py                  # 1,024 copies: (a)/(b) paired, 20 rounds; (c)
    python benchmarks/bench_env.py --sequential     # also (a) then (b) one after the other, 100 steps each
    python benchmarks/bench_env.py --copies 256 --paired 10
    python benchmarks/bench_env.py --rho 2 3 --interval-ms 20   # less simulation per step
    python benchmarks/bench_env.py --threads 1 --no-sync --no-adapter   # native env alone, one engine thread
    python benchmarks/bench_env.py --breakdown --no-sync --no-adapter   # where (a)'s time goes
    python benchmarks/bench_env.py --ceiling --no-sync --no-adapter     # (d): the speed-up the engine allows
    python benchmarks/bench_env.py --v1 --cluster --no-sync --no-adapter # (e) TokenBatchCluster-v0 beside v1
    python benchmarks/bench_env.py --cluster --cluster-pd 4:4 --cluster-copies 256 --no-sync --no-adapter --copies 8

Prints, see docs/benchmarks.md ("Environment benchmark") for the definitions:
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
      steps per round gave 9-18% less than 20. --paired 0 (or --no-sync): off;
  --sequential: (b) measured after (a) (--steps each), and their ratio (the earlier, unpaired method);
  --no-sync: no SyncVectorEnv at all (neither the paired measurement, unless --paired is given,
      nor the sequential (b));
  (c) the SB3 adapter (``tokenbatch_env.sb3``, SAME_STEP) over the native env vs the raw native env
      in SAME_STEP mode, stepped alternately (same seeds and actions): env-steps/s and the adapter's
      overhead (total time, and the median of the per-step time ratios);
  (d) --ceiling [ROUNDS]: the native env at its threads, the native env with one engine thread and
      SyncVectorEnv, alternated in ROUNDS rounds (default 10) of --native-steps-per-round steps each
      on the same actions: a SyncVectorEnv env-step, a native copy-step (its serial Python, its
      resets, its threads' kernel time), and ``k1``, the compiled work per copy-step with one thread
      (the kernel calls: engine, observations, rewards, episode metrics: what batching cannot remove,
      and what the single env does too); the ceiling threads x SyncVectorEnv / k1 (the speed-up if
      all else were free and the threads shared k1 perfectly), the rest the target allows, and the
      k1 it needs with the rest as measured (``ceiling_model``);
  --breakdown: (a)'s wall time per copy-step split into the engine with the observations, rewards
      and episode metrics of the copies it advanced (``advance_to_decision``: each engine thread
      claims a batch of copies at a time, advances them, then observes and rewards them and computes
      the metrics of those whose episode ended; one thread first lays out the new episodes of the
      copies that ended in the previous step, timed too), the episode metrics' info arrays and the
      rest (the step's Python: action checks and mapping, infos);
  (e) --cluster: the native ``TokenBatchClusterVectorEnv`` (TokenBatchCluster-v0, docs/design.md
      section 12): --cluster-copies clusters of 8 replicas of llama3-8b-h100, azure-conv-like at rho
      1.2 (episodes of (32 + 8 + 8) x 8 arrivals), uniformly random actions: env-steps/s (one step =
      one arrival routed in every cluster) after --warm steps; target >= 50k at 1,024 clusters.
"""

from __future__ import annotations

import argparse
import math
import threading
import time

import numpy as np

CONFIG = dict(suite="seed-200", split="train", profile="stress-512", rho=(0.8, 1.5))
#: keywords of the native env beyond the config (``--threads``)
ENV_KW: dict = {}

#: the issue's speed target: native env-steps/s over SyncVectorEnv's, at TARGET_COPIES copies
TARGET, TARGET_COPIES = 30.0, 1024
#: (e): TokenBatchCluster-v0's configuration and target (env-steps/s at 1,024 clusters)
CLUSTER_CONFIG = dict(suite="azure-conv-like", profile="llama3-8b-h100", replicas=8, rho=1.2, window=32, warmup=8,
                      cooldown=8)
CLUSTER_TARGET = 50_000


def _actions(n: int, steps: int, seed: int = 0) -> np.ndarray:
    from tokenbatch_env.envs import TokenBatchConfig
    d = len(TokenBatchConfig(**CONFIG).action_names)
    return np.random.default_rng(seed).uniform(-1, 1, (steps, n, d)).astype(np.float32)


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


def bench_cluster_env(n: int, steps: int, warm: int, pd: tuple = ()) -> dict:
    """(e): the native TokenBatchCluster-v0 vector env, random actions; ``pd``: a P/D split of the
    same replicas (the actions: prefill replicas)."""
    from tokenbatch_env.envs.cluster_env import TokenBatchClusterVectorEnv
    t0 = time.perf_counter()
    env = TokenBatchClusterVectorEnv(n, **CLUSTER_CONFIG, pd=pd)
    build = time.perf_counter() - t0
    env.reset(seed=0)
    acts = np.random.default_rng(0).integers(0, env.config.actions, (warm + steps, n))
    wall, rew = _drive(env.step, acts, warm)
    return {"build_s": build, "wall_s": wall, "steps_per_s": n * steps / wall, "reward_sum": float(rew.sum())}


#: (object path in the native env, label, nested) of the parts ``--breakdown`` times; a nested part
#: runs inside the one before it (the resets: in an engine thread while the other advances the copies)
PARTS = (("core.run.advance_to_decision", "engine + observations + rewards + episode metrics, new episodes "
          "laid out meanwhile (advance_to_decision)", False),
         ("core.reset_copies", "of which, overlapping the engine in one thread: resets (windows laid out + "
          "their observations)", True),
         ("core.episode_infos", "episode metrics' info arrays (computed in the engine threads as episodes end)",
          False))


_SPENT_LOCK = threading.Lock()


def _timed(fn, spent: dict, key: str):
    """``fn`` that adds its wall seconds to ``spent[key]`` (under a lock: the engine threads' calls
    end concurrently)."""
    def run(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            dt = time.perf_counter() - t0
            with _SPENT_LOCK:
                spent[key] += dt
    return run


def bench_breakdown(n: int, steps: int, warm: int) -> dict:
    """(a) with the parts of ``PARTS`` timed (wall, per copy-step; the rest is the wall time outside
    the parts that are not nested)."""
    from tokenbatch_env.envs import TokenBatchVectorEnv
    env = TokenBatchVectorEnv(n, **CONFIG, **ENV_KW)
    env.reset(seed=0)
    spent = {label: 0.0 for _, label, _ in PARTS}
    acts = _actions(n, warm + steps)
    for a in acts[:warm]:
        env.step(a)
    for path, label, _ in PARTS:
        *owner, name = path.split(".")
        obj = env
        for o in owner:
            obj = getattr(obj, o)
        setattr(obj, name, _timed(getattr(obj, name), spent, label))
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
    for _ in range(rounds):
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


def _timed_parts(env) -> dict:
    """Wrap the native env's engine call (``advance_to_decision``), its resets (``reset_copies``, run
    inside it in an engine thread) and its kernel calls (the functions ``map_groups`` runs with
    ``split=False``: each engine thread's kernel, observations, rewards and episode metrics; summed
    over the threads) to add up their wall seconds: returns the running totals."""
    spent = {"advance": 0.0, "resets": 0.0, "kernel": 0.0}
    run = env.core.run
    run.advance_to_decision = _timed(run.advance_to_decision, spent, "advance")
    env.core.reset_copies = _timed(env.core.reset_copies, spent, "resets")
    map_groups = run.map_groups

    def timed_map_groups(fn, act, *args, split=True, **kw):
        return map_groups(fn if split else _timed(fn, spent, "kernel"), act, *args, split=split, **kw)
    run.map_groups = timed_map_groups
    return spent


def ceiling_model(k1: float, sync: float, native: float, native_kernel: float, threads: int,
                  target: float = TARGET) -> dict:
    """What the measured parts allow (all in us per env-step, i.e. per copy-step):

    - ``k1``: the compiled work per copy-step with one engine thread (engine, observations, rewards,
      episode metrics: the native env's kernel calls), which batching cannot remove; the single env
      does the same work in its own kernel call each step;
    - ``sync``: a SyncVectorEnv env-step; ``native``: a native copy-step with ``threads`` threads,
      whose kernel calls took ``native_kernel`` (added up over the threads).

    ``ceiling`` = threads * sync / k1: the speed-up if everything but that work cost nothing and the
    threads shared it perfectly. ``share`` = native_kernel / k1: what sharing it costs. ``rest`` =
    native - native_kernel / threads: the rest of a native copy-step (serial Python, the resets'
    share, the threads' uneven ends). ``rest_allowed``: the rest at which ``target`` x is met with k1
    and ``share`` as measured. ``k_needed``: the k1 that meets ``target`` x with ``rest``, ``share`` and
    the single env's other work (sync - k1) held, i.e. native = k share / threads + rest and
    sync = sync - k1 + k: (sync - k1 - target rest) / (target share / threads - 1); <= 0: not even
    with free compiled work; None when target share <= threads (the model's ratio then rises with k)."""
    share = native_kernel / k1
    rest = native - native_kernel / threads
    denom = target * share / threads - 1
    return {"ceiling": threads * sync / k1, "share": share, "rest": rest, "budget": sync / target,
            "rest_allowed": sync / target - k1 * share / threads,
            "k_needed": None if denom <= 0 else (sync - k1 - target * rest) / denom}


def bench_ceiling(n: int, rounds: int, steps: int, warm: int) -> dict:
    """(d): the native env at its threads, the native env with one engine thread (its kernel calls:
    the compiled work per copy-step, ``k1``) and SyncVectorEnv, alternated in rounds of ``steps``
    steps each (same seeds and actions: the same trajectories, checked by the rewards, each env timed
    on the same steps) so that all three see the same phases of the machine; then ``ceiling_model``
    of their totals. (Resets laid out before an engine call rather than during it, rare at many
    copies, count in both the serial Python and the resets.)"""
    import gymnasium as gym

    from tokenbatch_env.envs import TokenBatchEnv, TokenBatchVectorEnv, default_threads
    threads = ENV_KW.get("threads", default_threads(n))
    envs = {"native": TokenBatchVectorEnv(n, **CONFIG, **ENV_KW),
            "one thread": TokenBatchVectorEnv(n, **CONFIG, **{**ENV_KW, "threads": 1}),
            "sync": gym.vector.SyncVectorEnv([lambda: TokenBatchEnv(**CONFIG) for _ in range(n)],
                                             autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)}
    acts = _actions(n, warm + rounds * steps)
    rew = {}
    for name, env in envs.items():
        env.reset(seed=0)
        rew[name] = [np.asarray(env.step(a)[1]).copy() for a in acts[:warm]]
    parts = {name: _timed_parts(envs[name]) for name in ("native", "one thread")}
    spent = dict.fromkeys(envs, 0.0)
    for r in range(rounds):
        for name, env in envs.items():
            t0 = time.perf_counter()
            for a in acts[warm + r * steps:warm + (r + 1) * steps]:
                rew[name].append(np.asarray(env.step(a)[1]).copy())
            spent[name] += time.perf_counter() - t0
    us = {name: 1e6 * spent[name] / (n * rounds * steps) for name in envs}
    per = {name: {k: 1e6 * v / (n * rounds * steps) for k, v in p.items()} for name, p in parts.items()}
    k1 = per["one thread"]["kernel"]
    same = all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(*rew.values()))
    return {"threads": threads, "k1": k1, "sync_us": us["sync"], "native_us": us["native"],
            "one_thread_us": us["one thread"], "native_resets_us": per["native"]["resets"],
            "native_serial_us": us["native"] - per["native"]["advance"], "native_kernel_us": per["native"]["kernel"],
            "speedup": us["sync"] / us["native"], "same_rewards": same,
            **ceiling_model(k1, us["sync"], us["native"], per["native"]["kernel"], threads)}


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
                    help="also measure (b) after (a), --steps each, and their ratio (the earlier, unpaired method)")
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
    ap.add_argument("--ceiling", type=int, nargs="?", const=10, default=None, metavar="ROUNDS",
                    help="(d): the native env at its threads, with one engine thread, and SyncVectorEnv alternated "
                         "in ROUNDS rounds (default 10) of --native-steps-per-round steps each: the compiled work "
                         "per copy-step and the speed-up it allows")
    ap.add_argument("--v1", action="store_true",
                    help="TokenBatch-v1 (tpot_guard: the budget rule, its action dimensions and TPOT state)")
    ap.add_argument("--cluster", action="store_true", help="(e): also TokenBatchCluster-v0 (--cluster-copies)")
    ap.add_argument("--cluster-copies", type=int, default=1024, help="(e): clusters (default 1024)")
    ap.add_argument("--cluster-pd", default=None, metavar="Rp:Rd",
                    help="(e): the clusters split prefill:decode (TokenBatchCluster-v0 with pd; no target)")
    ap.add_argument("--threads", type=int, default=None,
                    help="engine threads of the native env, (a) and (c) (default: the env's, the available "
                         "cores from 64 copies on); SyncVectorEnv's single envs use 1")
    a = ap.parse_args(argv)
    if a.paired is None:
        a.paired = 0 if a.no_sync else 20
    if a.paired < 0 or a.native_steps_per_round < 1 or a.sync_steps_per_round < 1:
        ap.error(f"--paired must be >= 0 (0: off), --native-steps-per-round and --sync-steps-per-round >= 1, "
                 f"got {a.paired}, {a.native_steps_per_round} and {a.sync_steps_per_round}")
    if a.ceiling is not None and a.ceiling < 1:
        ap.error(f"--ceiling must be >= 1 round, got {a.ceiling}")
    if a.steps < 1 or a.warm < 0 or a.copies < 1 or (a.sync_copies is not None and a.sync_copies < 1):
        ap.error(f"--copies, --sync-copies and --steps must be >= 1 and --warm >= 0, got {a.copies}, "
                 f"{a.sync_copies}, {a.steps} and {a.warm}")
    if a.threads is not None:
        ENV_KW["threads"] = a.threads
    if a.rho is not None:
        CONFIG["rho"] = tuple(a.rho)
    if a.interval_ms is not None:
        CONFIG["decision_interval_ms"] = a.interval_ms
    if a.v1:
        CONFIG["tpot_guard"] = True
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
    if a.ceiling:
        k = a.native_steps_per_round
        c = bench_ceiling(n, a.ceiling, k, W)
        th = c["threads"]
        ths = f"{th} thread{'s' if th != 1 else ''}"
        need = c["k_needed"]
        if need is None:
            verdict = f"the model does not apply ({TARGET:g}x x share <= {ths})"
        elif need <= 0:
            verdict = f"no k1 meets {TARGET:g}x with the rest as measured"
        else:
            verdict = (f"with the rest, the share and the single env's other work ({c['sync_us'] - c['k1']:.1f} us) "
                       f"as measured, {TARGET:g}x needs k1 <= {need:.2f} us ({100 * (need / c['k1'] - 1):+.0f}%)")
        print(f"(d) ceiling, {a.ceiling} rounds of {k} steps of each env ({n} copies), us per env-step: "
              f"SyncVectorEnv {c['sync_us']:.1f}; native at {ths} {c['native_us']:.2f} (serial Python "
              f"{c['native_serial_us']:.2f}, resets in one thread {c['native_resets_us']:.2f}, its threads' kernels "
              f"{c['native_kernel_us']:.2f} = {c['share']:.2f} k1; speed-up {c['speedup']:.1f}x), at one thread "
              f"{c['one_thread_us']:.2f}, of which the compiled work k1 {c['k1']:.2f} (the kernel calls: engine, "
              f"observations, rewards, episode metrics). Ceiling {th} x SyncVectorEnv / k1 = {c['ceiling']:.1f}x "
              f"(all else free, {ths} sharing k1 perfectly). {TARGET:g}x allows {c['budget']:.2f} us per native "
              f"copy-step: the kernels' {c['native_kernel_us'] / th:.2f} + the rest {c['rest']:.2f} now, i.e. the "
              f"rest at most {c['rest_allowed']:.2f}; {verdict}; same rewards: {c['same_rewards']}")
    if a.cluster:
        from tokenbatch_env.config_cli import parse_split
        pd = parse_split(a.cluster_pd, "--cluster-pd") if a.cluster_pd else ()
        bench_cluster_env(2, 3, 1, pd)   # (compile/load and the workload, outside the timing)
        cl = bench_cluster_env(a.cluster_copies, T, W, pd)
        sps = cl["steps_per_s"]
        what = f"P/D {pd[0]}:{pd[1]}" if pd else f"{CLUSTER_CONFIG['replicas']} replicas"
        verdict = "no target (P/D)" if pd else (f"target >= {CLUSTER_TARGET:,} at 1,024: "
                                                f"{'met' if sps >= CLUSTER_TARGET else 'not met'}")
        print(f"(e) native TokenBatchCluster-v0, {a.cluster_copies} clusters of {what} "
              f"({CLUSTER_CONFIG['suite']}, rho {CLUSTER_CONFIG['rho']}, {CLUSTER_CONFIG['profile']}): {sps:,.0f} "
              f"env-steps/s ({a.cluster_copies * T:,} in {cl['wall_s']:.2f} s; build {cl['build_s']:.1f} s); {verdict}")
    if not a.no_adapter:
        ad = bench_adapter(n, T, W)
        print(f"(c) SB3 adapter, {n} copies, alternated step by step with the raw SAME_STEP env: "
              f"{ad['adapter_sps']:,.0f} vs {ad['raw_sps']:,.0f} env-steps/s: overhead "
              f"{100 * (ad['raw_sps'] / ad['adapter_sps'] - 1):+.1f}% (median per step "
              f"{100 * (ad['step_ratio_median'] - 1):+.1f}%) (same rewards: {ad['same_rewards']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
