"""``tokenbatch fidelity``: replay a trace through vLLM's real scheduler and through the engine and
print how far they agree (share of requests identical per field) and the first divergences."""

from __future__ import annotations

import argparse
import os

from ..config_cli import LazyChoices
from ..errors import ConfigError


def _vllm_modes() -> tuple:
    from ..policies import vllm_modes
    return vllm_modes()


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (any format `tokenbatch traces` reads)")
    p.add_argument("--profile", default="linear", help="engine profile for budgets and clock (default linear)")
    p.add_argument("--num-blocks", type=int, default=None, help="total KV blocks incl. vLLM's null block 0")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="vLLM's long_prefill_token_threshold, both sides (default 0: off)")
    p.add_argument("--policy", choices=LazyChoices(_vllm_modes), default="fcfs")
    p.add_argument("--async", dest="async_scheduling", action="store_true",
                   help="vLLM's AsyncScheduler (and the engine's async_scheduling)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--show", type=int, default=10, help="divergences to print (default 10)")


def run(args) -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from ..traces.io import load_trace
    from . import vllm_harness as H
    why = H.vllm_import_error()
    if why is not None:
        raise ConfigError(f"vLLM is not importable ({why}); install the extra: pip install -e '.[vllm]' "
                          "(docs/fidelity.md)")
    trace, _ = load_trace(args.trace)
    c = H.compare(trace, args.profile, args.policy, num_blocks=args.num_blocks,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  prefix_caching=args.prefix_caching, async_scheduling=args.async_scheduling or None,
                  long_prefill_token_threshold=args.long_prefill_token_threshold)
    hc = c.vllm.config
    print(f"vLLM {c.vllm.vllm_version} {'AsyncScheduler' if hc.async_scheduling else 'Scheduler'} vs "
          f"engine, profile {args.profile}: {c.n} requests, policy {hc.policy}, "
          f"B={hc.max_num_batched_tokens}, max_num_seqs={hc.max_num_seqs}, num_blocks={hc.num_blocks}, "
          f"long_prefill_token_threshold={hc.long_prefill_token_threshold}, "
          f"prefix caching {'on' if hc.prefix_caching else 'off'}")
    print(f"iterations: vLLM {len(c.vllm.iterations['iteration'])}, engine "
          f"{len(c.engine_iterations['iteration'])}")
    print("agreement (share of requests identical):")
    for f, a in c.agreement.items():
        print(f"  {f:24s} {a:8.2%}")
    if c.identical:
        print("identical: every request agrees on every field")
        return 0
    k = c.first_divergent_iteration()
    if k is not None:
        print(f"first iteration whose contents differ: {k}")
    print(f"first divergences (request, field, vLLM, engine) of {len(c.divergences)}:")
    for d in c.divergences[:args.show]:
        print(f"  {d[0]:6d}  {d[1]:24s} {d[2]:>14d} {d[3]:>14d}")
    return 1
