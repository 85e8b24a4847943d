"""Parameter files: the ``--params`` JSON that ``tokenbatch tune`` writes (``best_params.json``) and
the evaluator, the env (``base_params``), the agents and the vLLM plug-in read (docs/design.md
sections 6 and 7).

    {"index": {IndexParams fields}, "shed_margin": x,        # the index and its +shed margin
     "<policy>": {"shed_margin": y},                          # another policy's +shed margin
     "weights": {"w": {feature: weight}, "shed_margin": z},   # the weights policy
     "index-scheduled": IndexSchedule.to_dict(),              # the index-scheduled comparator
     "meta": {...}, "tuned": {...}, ...}                      # informational (PARAMS_INFO_KEYS)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import ConfigError, PolicyError

__all__ = ["PARAMS_INFO_KEYS", "SCHEDULE_KEY", "load_params_file", "load_schedule", "load_weights"]

#: informational keys tolerated in a --params file
PARAMS_INFO_KEYS = ("meta", "provenance", "source", "tuned", "comment")
#: the params-file key of the ``index-scheduled`` comparator (``policies.IndexSchedule.to_dict``)
SCHEDULE_KEY = "index-scheduled"


def load_params_file(path: str, what: str = "--params") -> tuple:
    """A ``--params`` file: ``{"index": {IndexParams fields}, "shed_margin": x, "<policy>":
    {"shed_margin": y}, ...}`` -> (IndexParams, ((policy, margin), ...)). ``shed_margin`` at top
    level is the index's; other policies' margins default to 0.0. ``what``: the option or field
    that gave the path, named in errors."""
    from .policies import BASELINES, IndexParams, check_shed_margin

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: {path!r} is a directory, not a parameters JSON" if p.is_dir()
                          else f"{what}: file {path!r} not found")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object")
    valid = ["index", "shed_margin", *[b for b in BASELINES if b != "index"], SCHEDULE_KEY, *PARAMS_INFO_KEYS]
    unknown = sorted(k for k in d if k not in valid and not k.startswith("_"))
    if unknown:
        raise ConfigError(f"{what} {path}: unknown key(s) {unknown}; valid: {', '.join(valid)}")
    idx = d.get("index", {})
    if not isinstance(idx, dict):
        raise ConfigError(f"{what} {path}: 'index' must be an object of IndexParams fields")
    try:
        params = IndexParams.from_dict(idx)
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{what} {path}: {e}") from None
    margins = {}

    def margin(v, who):
        if v is None or v == "inf":   # (null, like inf: no shedding)
            v = math.inf
        try:
            check_shed_margin(v)
        except PolicyError as e:
            raise PolicyError(f"{what} {path}: {who}: {e}") from None
        return float(v)

    if "shed_margin" in d:
        margins["index"] = margin(d["shed_margin"], "shed_margin")
    for b in BASELINES:
        if b == "index" or b not in d:
            continue
        v = d[b]
        allowed = {"shed_margin", "w"} if b == "weights" else {"shed_margin"}
        if not isinstance(v, dict) or set(v) - allowed:
            raise ConfigError(f"{what} {path}: {b!r} must be {{\"shed_margin\": x}}"
                              + (" with optional \"w\": {feature: weight}" if b == "weights" else ""))
        if "shed_margin" in v:
            margins[b] = margin(v["shed_margin"], f"{b}.shed_margin")
    return params, tuple(sorted(margins.items()))


def load_schedule(path: str, what: str = "--params"):
    """The ``index-scheduled`` schedule in a ``--params`` file, or None when it has none."""
    from .policies import IndexSchedule
    load_params_file(path, what)
    d = json.loads(Path(path).read_text())
    if SCHEDULE_KEY not in d:
        return None
    try:
        return IndexSchedule.from_dict(d[SCHEDULE_KEY])
    except (PolicyError, TypeError, ValueError) as e:
        raise PolicyError(f"{what} {path}: {SCHEDULE_KEY}: {e}") from None


def load_weights(path: str, what: str = "--params"):
    """The ``weights`` policy's tuned weights in a ``--params`` file (``{"weights": {"w": ...}}``),
    or None when the file has none (validated by ``load_params_file`` first)."""
    from .policies import LinearWeights
    load_params_file(path, what)
    v = json.loads(Path(path).read_text()).get("weights", {})
    if "w" not in v:
        return None
    try:
        return LinearWeights.from_dict(v["w"])
    except PolicyError as e:
        raise PolicyError(f"{what} {path}: weights.w: {e}") from None
