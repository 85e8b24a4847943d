"""``tokenbatch profiles``: list, show and fit engine profiles.

    tokenbatch profiles list
    tokenbatch profiles show llama2-7b-a100        # or a path to a profile JSON
    tokenbatch profiles fit --out tokenbatch_env/data/profiles/
    tokenbatch profiles fit --samples steps.csv --name my-gpu --num-blocks 29000 --max-model-len 8192
"""

from __future__ import annotations

import argparse
import json

from .cost_model import TERMS
from .profiles import MAX_MAPE_PCT, Profile, list_profiles, load_profile

#: What ``show`` tabulates.
SHOW_PROMPTS = (128, 512, 2048)
SHOW_BATCHES = (1, 32, 128)
SHOW_CONTEXTS = (512, 2048)


def configure(parser: argparse.ArgumentParser) -> None:
    from . import fit

    sub = parser.add_subparsers(dest="profiles_command", metavar="SUBCOMMAND")
    sub.add_parser("list", help="shipped profiles: provenance, blocks, budgets, fit error")
    p = sub.add_parser("show", help="every field of a profile, with example iteration times")
    p.add_argument("name", help="a shipped profile name or a path to a profile JSON")
    p.add_argument("--json", action="store_true", help="print the profile as JSON only")
    f = sub.add_parser("fit", help="fit llama2-7b-a100 (and derive the H100 profiles) from "
                                   "../shared/calibration; or, with --samples FILE.csv --name N, a "
                                   "profile of your own deployment",
                       description=fit.__doc__.split("\n\n")[0])
    fit.configure(f)


def run(args) -> int:
    cmd = getattr(args, "profiles_command", None)
    if cmd == "show":
        return _show(load_profile(args.name), as_json=args.json)
    if cmd == "fit":
        from . import fit
        return fit.run(args)
    return _list()


def fit_error(p: Profile) -> str:
    if not p.mape_pct:
        return "n/a (not fitted)" if p.provenance != "fitted" else "n/a"
    worst = max(p.mape_pct, key=p.mape_pct.get)
    return f"{p.mape_pct[worst]:.1f}% ({worst})"


def _list() -> int:
    rows = [("name", "provenance", "blocks", "B/max_seqs", "fit error (worst kind)")]
    for name in list_profiles():
        p = load_profile(name)
        rows.append((p.name, p.provenance, str(p.num_blocks),
                     f"{p.max_num_batched_tokens}/{p.max_num_seqs}", fit_error(p)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _ms(ns) -> str:
    return f"{int(ns) / 1e6:.3f} ms"


def _show(p: Profile, *, as_json: bool = False) -> int:
    if as_json:
        print(json.dumps(p.to_dict(), indent=1, ensure_ascii=False))
        return 0
    c = p.cost
    print(f"{p.name}  [{p.provenance}]")
    if p.description:
        print(f"  {p.description}")
    print("cost (ms): " + ", ".join(f"{n}={getattr(c, n):.6g}" for n in TERMS))
    print("  t = c0 + c_prefill*P + c_c2*sum(chunk^2) + c_attn*sum(chunk*computed_before)"
          " + c_decode*D + c_kv*sum(decode_context)")
    for f in ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
              "max_model_len_limit", "watermark_blocks", "async_scheduling", "kv_bytes_per_token",
              "pcie_gb_per_s"):
        print(f"{f}: {getattr(p, f)}")
    print(f"usable_blocks: {p.usable_blocks} ({p.usable_blocks * p.block_size} tokens)")
    print(f"max_model_len: {p.max_model_len}")
    print(f"b_max: {p.budget_max} (the largest token budget a lever may choose"
          + ("; default: max_num_batched_tokens)" if p.b_max is None else ")"))
    if p.mape_pct:
        print("fit error (mean abs %): " + ", ".join(f"{k} {v:.2f}%" for k, v in p.mape_pct.items())
              + f" (gate {MAX_MAPE_PCT:g}%)")
    else:
        print("fit error: n/a (profile not fitted)")
    if p.source:
        print("source:")
        for k, v in p.source.items():
            print(f"  {k}: {json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v}")
    B = p.max_num_batched_tokens
    ttft = c.idle_prefill_ns(list(SHOW_PROMPTS), B)
    print(f"idle TTFT (prefill alone, chunks of B={B}):")
    for n, t in zip(SHOW_PROMPTS, ttft):
        print(f"  prompt {n:5d}: {_ms(t)}")
    print("decode iteration time (decodes only, every sequence at the given context):")
    print("  batch  " + "  ".join(f"ctx {k:5d}".rjust(12) for k in SHOW_CONTEXTS))
    for b in SHOW_BATCHES:
        ts = [c.iteration_ns(0, 0, 0, b, b * k) for k in SHOW_CONTEXTS]
        print(f"  {b:5d}  " + "  ".join(_ms(t).rjust(12) for t in ts))
    return 0
