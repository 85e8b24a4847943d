"""The synthetic workloads of the prefill/decode goal runs (docs/results.md, "Prefill/decode
disaggregation"): two traces and their SLO rules, written deterministically from ``--seed``.

* ``long.csv``: prompts uniform in [4096, 7680] tokens, outputs log-normal (median 200) in [16, 512];
  rule ``long-tpot30.json``: TTFT <= 3 x the idle prefill time on the plan's profile, TPOT <= 30 ms
  (``long-tpot20.json``, ``long-tpot15.json``: the same with TPOT <= 20 and 15 ms).
* ``short.csv``: prompts log-normal (median 300) in [16, 1500], outputs log-normal (median 200) in
  [16, 1024]; rule ``short-loose.json``: TTFT <= 5 x the idle prefill time, TPOT <= 100 ms.

Arrivals are Poisson at 1 request/s (``tokenbatch plan --rate`` sets the rate planned for).

    python tools/pd_workloads.py --out runs/pd-workloads
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

def _rule(name: str, cls: str, b: int, tpot_ms: int, note: str) -> dict:
    return {"name": name, "note": note, "classes": [{"name": cls, "when": "otherwise", "ttft": {"a_ms": 0, "b": b},
                                                     "tpot_ms": tpot_ms, "priority": 0}]}


RULES = {r["name"]: r for r in (
    _rule("long-tpot30", "long", 3, 30, "the P/D goal's long-prompt rule (tools/pd_workloads.py)"),
    _rule("long-tpot20", "long", 3, 20, "the long-prompt rule with TPOT <= 20 ms (tools/pd_workloads.py)"),
    _rule("long-tpot15", "long", 3, 15, "the long-prompt rule with TPOT <= 15 ms (tools/pd_workloads.py)"),
    _rule("short-loose", "short", 5, 100, "the P/D goal's short-prompt rule (tools/pd_workloads.py)"),
)}


def lognormal_int(rng, median: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(np.int64)


def workloads(n: int, seed: int) -> dict:
    from tokenbatch_env.traces import Trace
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("long", "short"):
        arrival = np.cumsum(rng.exponential(1e9, n)).astype(np.int64)
        if name == "long":
            prompt = rng.integers(4096, 7681, n)
            output = lognormal_int(rng, 200, 0.8, 16, 512, n)
        else:
            prompt = lognormal_int(rng, 300, 0.9, 16, 1500, n)
            output = lognormal_int(rng, 200, 0.8, 16, 1024, n)
        out[name] = Trace.build(arrival_ns=arrival - arrival[0], prompt_tokens=prompt, output_tokens=output,
                                name=f"pd-{name}", source=f"tools/pd_workloads.py --seed {seed}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("runs", "pd-workloads"), help="directory (default runs/pd-workloads)")
    ap.add_argument("--requests", type=int, default=4000, help="requests per trace (default 4000)")
    ap.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    from tokenbatch_env._io import atomic_path
    from tokenbatch_env.traces.io import save_trace
    os.makedirs(args.out, exist_ok=True)
    for name, t in workloads(args.requests, args.seed).items():
        save_trace(t, os.path.join(args.out, f"{name}.csv"))
    for name, rule in RULES.items():
        with atomic_path(os.path.join(args.out, f"{name}.json")) as tmp:
            with open(tmp, "w") as f:
                json.dump(rule, f, indent=1)
    print(f"wrote {args.out}/long.csv, short.csv, " + ", ".join(f"{n}.json" for n in RULES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
