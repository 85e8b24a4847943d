"""vLLM's engine flags on the command line (docs/design.md section 10), shared by `tokenbatch simulate`
and `tokenbatch bench`: each overrides the profile's setting (``EngineConfig``) and enters the
evidence id. Parsed here, so that a bad value is one line naming its flag."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError

#: the most replicas a cluster run holds (each is a whole engine's state); simulate, bench, tune and
#: plan refuse more with one line
MAX_REPLICAS = 4096

#: vLLM's engine flags (docs/design.md section 10): (flag, ``EngineConfig`` field, least value)
ENGINE_FLAGS = (("--num-blocks", "num_blocks", 2), ("--block-size", "block_size", 1),
                ("--max-num-seqs", "max_num_seqs", 1), ("--max-num-batched-tokens", "max_num_batched_tokens", 1),
                ("--max-model-len", "max_model_len", 1),
                ("--long-prefill-token-threshold", "long_prefill_token_threshold", 0))
ENGINE_HELP = {
    "--num-blocks": "KV-cache blocks, block 0 included (vLLM's --num-gpu-blocks-override)",
    "--block-size": "tokens per KV-cache block (vLLM's --block-size); without --num-blocks the pool keeps "
                    "the profile's token capacity",
    "--max-num-seqs": "running requests at most (vLLM's --max-num-seqs)",
    "--max-num-batched-tokens": "token budget B per iteration (vLLM's --max-num-batched-tokens)",
    "--max-model-len": "context limit (vLLM's --max-model-len)",
    "--long-prefill-token-threshold": "new tokens of one request per iteration at most, when more than one "
                                      "request runs or waits (vLLM's flag; 0: off)",
}


def engine_overrides(args) -> dict:
    """The ``EngineConfig`` fields the engine flags set; a bad value is one line naming its flag."""
    kw = {}
    for flag, field, lo in ENGINE_FLAGS:
        text = getattr(args, field)
        if text is None:
            continue
        try:
            v = int(str(text).strip())
        except ValueError:
            raise ConfigError(f"{flag}: must be an integer, got {text!r}") from None
        if v < lo:
            raise ConfigError(f"{flag}: must be an integer >= {lo}, got {v}")
        kw[field] = v
    if args.no_prefix_caching:
        kw["prefix_caching"] = False
    if args.async_scheduling is not None:
        kw["async_scheduling"] = bool(args.async_scheduling)
    return kw


def add_engine_flags(p) -> None:
    """The flags, in an argument group of the parser ``p``."""
    g = p.add_argument_group("engine settings (default: the profile's)")
    for flag, _, _ in ENGINE_FLAGS:
        g.add_argument(flag, default=None, metavar="N", help=ENGINE_HELP[flag])
    g.add_argument("--no-prefix-caching", action="store_true", help="vLLM's --no-enable-prefix-caching")
    a = g.add_mutually_exclusive_group()
    a.add_argument("--async", dest="async_scheduling", action="store_true", default=None,
                   help="vLLM's --async-scheduling (default: the profile's)")
    a.add_argument("--sync", dest="async_scheduling", action="store_false", help="synchronous scheduling")


def add_budget_flags(p, bench: bool = False) -> None:
    """The budget rule's flags (docs/design.md section 11, beyond vLLM), in an argument group. On
    ``bench`` the rule adds a ``<row>+tpot-guard`` row beside every row."""
    g = p.add_argument_group("iteration budget (beyond vLLM)")
    g.add_argument("--budget-rule", default=None, choices=("none", "tpot-guard"),
                   help="token budget of each iteration: none (B, vLLM's) or tpot-guard (lowered so that the "
                        "running requests keep their TPOT SLOs)"
                        + ("; on bench, adds a <row>+tpot-guard row beside every policy row" if bench else ""))
    g.add_argument("--budget-u", default=None, metavar="U",
                   help="tpot-guard's slack factor u in [-0.5, 2] (default 0): the iteration may last (1 + u) times "
                        "the tightest TPOT credit; a smaller u lowers the budget more")
    g.add_argument("--budget-bmin", default=None, metavar="F",
                   help="tpot-guard's floor B_min in [0, 1], a share of B (default 0; 1 = never lowered)")


def budget_overrides(args) -> dict:
    """The ``EngineConfig`` fields of the budget flags; a bad value is one line naming its flag."""
    rule = getattr(args, "budget_rule", None)
    kw = {}
    for flag, field in (("--budget-u", "budget_u"), ("--budget-bmin", "budget_bmin")):
        text = getattr(args, field, None)
        if text is None:
            continue
        if rule != "tpot-guard":
            raise ConfigError(f"{flag}: requires --budget-rule tpot-guard")
        try:
            kw[field] = float(str(text).strip())
        except ValueError:
            raise ConfigError(f"{flag}: must be a number, got {text!r}") from None
    if rule == "tpot-guard":
        kw["budget_rule"] = rule
    from .state import EngineConfig
    try:
        EngineConfig(**kw)
    except ConfigError as e:
        field, _, rest = str(e).partition(" ")
        raise ConfigError(f"--{field.replace('_', '-')}: {rest}") from None
    return kw


def engine_config(args, base=None):
    """``base`` (default ``EngineConfig()``) with the flags given in ``args``."""
    from .state import EngineConfig
    return dataclasses.replace(base or EngineConfig(), **engine_overrides(args))


def resolve_with_flags(config, profile, args):
    """``config.resolve(profile)``; an error (a combination, e.g. a block size beyond the KV pool)
    names the flags given."""
    from ..errors import ProfileError
    given = " ".join(f"{f} {getattr(args, fld)}" for f, fld, _ in ENGINE_FLAGS if getattr(args, fld, None) is not None)
    try:
        out = config.resolve(profile)
    except (ConfigError, ProfileError) as e:
        raise ConfigError(f"{given}: {e}" if given else str(e)) from None
    if given and out.max_num_batched_tokens < out.max_num_seqs:   # (vLLM refuses to start)
        raise ConfigError(f"{given}: max_num_batched_tokens {out.max_num_batched_tokens} is below max_num_seqs "
                          f"{out.max_num_seqs}; vLLM requires max_num_batched_tokens >= max_num_seqs (give "
                          "--max-num-seqs too)")
    return out
