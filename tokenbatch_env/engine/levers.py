"""The iteration-size levers a tuned row may choose (docs/design.md section 11): vLLM's three flags
and the tpot-guard rule's u and B_min, their validation, and the row labels that carry them. Kept
apart from the engine's state so that the command line and the parameters files read them without
the compiled engine."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError

#: vLLM's iteration-size flags, the levers a tuned row may choose (docs/design.md section 11)
LEVERS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold")
#: the tpot-guard rule's parameters u and B_min (``EngineConfig`` fields) with their ranges: the
#: levers of a ``<row>+tpot-guard`` row (docs/design.md section 11)
GUARD_LEVERS = {"budget_u": (-0.5, 2.0), "budget_bmin": (0.0, 1.0)}
#: the label suffix of FCFS's and priority's rows with tuned levers ("what an engineer can do today
#: with vLLM's own flags")
FLAGS_SUFFIX = " (tuned vLLM flags)"
#: the label suffix of a levered row's twin run at the profile's flags
PROFILE_FLAGS_SUFFIX = " (profile flags)"
#: the label suffix of a row run with the tpot-guard budget rule (``<policy>[+shed][+tpot-guard]``)
GUARD_SUFFIX = "+tpot-guard"
#: where a P/D row's label adds its split (``evaluate.rows.pd_label``: ``<row> [P/D Rp:Rd, ...]``)
PD_LABEL = " [P/D "


def without_guard(label: str) -> str:
    """The label of the row ``label`` (a ``+tpot-guard`` row's, P/D or not) without the rule."""
    head, sep, tail = label.partition(PD_LABEL)
    return head.removesuffix(GUARD_SUFFIX) + sep + tail


#: the smallest token budget and max_num_seqs a lever may choose, and the smallest threshold
LEVER_MIN_BUDGET, LEVER_MIN_SEQS, LEVER_MIN_THRESHOLD = 64, 8, 16


def lever_space(profile, flags: bool = True, guard: bool = False) -> dict:
    """A row's lever ranges ``{lever: [lo, hi, reference]}`` on ``profile`` (docs/design.md section
    11): vLLM's flags (with ``flags``), bounded by the profile's B_max and max_num_seqs, the reference
    the profile's own setting (threshold: off); with ``guard`` also the tpot-guard rule's u and B_min
    in their ranges, the reference the rule's defaults (0, 0)."""
    space = {}
    if flags:
        b_max = profile.budget_max
        space = {"max_num_batched_tokens": [min(LEVER_MIN_BUDGET, b_max), b_max, profile.max_num_batched_tokens],
                 "max_num_seqs": [min(LEVER_MIN_SEQS, profile.max_num_seqs), profile.max_num_seqs,
                                  profile.max_num_seqs],
                 "long_prefill_token_threshold": [min(LEVER_MIN_THRESHOLD, b_max), b_max, 0]}
    if guard:
        space.update({k: [lo, hi, 0.0] for k, (lo, hi) in GUARD_LEVERS.items()})
    return space


def suggest_levers(trial, space: dict) -> dict:
    """vLLM's three iteration-size flags (docs/design.md section 11), log-uniform integers in the
    row's ``space`` (``lever_space``), and a +tpot-guard row's u and B_min, uniform, drawn by
    ``trial`` (an optuna trial, or anything with its ``suggest_int`` and ``suggest_float``). As vLLM
    requires, max_num_seqs <= the budget (the drawn value is capped at it); a threshold at or above
    the budget changes nothing and is written as off (0)."""
    lv = {k: trial.suggest_float(k, lo, hi) if k in GUARD_LEVERS else trial.suggest_int(k, lo, hi, log=True)
          for k, (lo, hi, _) in space.items()}
    if "max_num_batched_tokens" not in lv:
        return lv
    B = lv["max_num_batched_tokens"]
    lv["max_num_seqs"] = min(lv["max_num_seqs"], B)
    if lv["long_prefill_token_threshold"] >= B:
        lv["long_prefill_token_threshold"] = 0
    return lv


def check_levers(levers, what: str, guard: bool = False) -> tuple:
    """``{lever: value}`` -> its sorted items, validated: known levers, integers (>= 1; a threshold
    >= 0, 0 = off); with ``guard`` (a ``+tpot-guard`` row) also u and B_min, numbers in their
    ranges. A bad entry is one line naming ``what`` and the lever."""
    valid = LEVERS + (tuple(GUARD_LEVERS) if guard else ())
    if not isinstance(levers, dict):
        raise ConfigError(f"{what}: expected an object of levers ({', '.join(valid)}), got {levers!r}")
    out = []
    for k, v in sorted(levers.items()):
        if k in GUARD_LEVERS and guard:
            lo, hi = GUARD_LEVERS[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"{what}: {k} must be a number in [{lo:g}, {hi:g}], got {v!r}")
            out.append((k, float(v)))
            continue
        if k not in LEVERS:
            hint = f" ({k} is a lever of {GUARD_SUFFIX} rows)" if k in GUARD_LEVERS else ""
            raise ConfigError(f"{what}: unknown lever {k!r}{hint}; valid: {', '.join(valid)}")
        lo = 0 if k == "long_prefill_token_threshold" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{what}: {k} must be an integer >= {lo}, got {v!r}")
        out.append((k, int(v)))
    return tuple(out)


def with_guard(config, u: float, bmin: float):
    """``config`` (an ``EngineConfig``) with the tpot-guard rule at ``u`` and ``bmin`` (B_min)."""
    return with_levers(config, {"budget_u": u, "budget_bmin": bmin})


def with_levers(config, levers):
    """``config`` (an ``EngineConfig``) with a row's levers (``{lever: value}`` or its items) set; u
    or B_min turn the tpot-guard rule on."""
    levers = dict(levers or ())
    if any(k in GUARD_LEVERS for k in levers):
        levers["budget_rule"] = "tpot-guard"
    return dataclasses.replace(config, **levers) if levers else config
