"""Validation of JSON specs (generator, SLA rule, suite): one definition of each check, shared by
``generators``, ``sla`` and ``suites`` (docs/design.md section 2). Every failure is a ``ConfigError``
naming the field's path, e.g. ``generator.arrivals.rate_rps: must be > 0, got -1``."""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..errors import ConfigError

__all__ = ["check_keys", "num", "choice"]

_MISSING = object()


def check_keys(d: Any, path: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
    """``d`` itself, once it is a dict with every ``required`` key and no key outside ``required``
    and ``optional``."""
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise ConfigError(f"{path}: unknown field(s) {unknown}; valid: {sorted([*required, *optional])}")
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"{path}.{missing[0]}: required field is missing")
    return d


def num(d: dict, key: str, path: str, *, lo=None, hi=None, lo_open=False, hi_open=False,
        integer=False, default=_MISSING, allow_none=False):
    """``d[key]`` as a float (``integer``: an int; an integral float is accepted) within the bounds
    (``lo``/``hi``, exclusive with ``lo_open``/``hi_open``); ``default`` when absent (else required),
    None when None and ``allow_none``. Booleans are not numbers."""
    if key not in d:
        if default is _MISSING:
            raise ConfigError(f"{path}.{key}: required field is missing")
        return default
    v = d[key]
    where = f"{path}.{key}"
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: must be a number, got {v!r}")
    if integer:
        if isinstance(v, float):
            if not v.is_integer():
                raise ConfigError(f"{where}: must be an integer, got {v!r}")
            v = int(v)
    elif not math.isfinite(v):
        raise ConfigError(f"{where}: must be finite, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ConfigError(f"{where}: must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise ConfigError(f"{where}: must be {'<' if hi_open else '<='} {hi}, got {v!r}")
    return int(v) if integer else float(v)


def choice(d: dict, key: str, path: str, options: Sequence[str], default=_MISSING) -> str:
    """``d[key]``, one of ``options``; ``default`` when absent (else required)."""
    if key not in d:
        if default is _MISSING:
            raise ConfigError(f"{path}.{key}: required field is missing; valid: {list(options)}")
        return default
    v = d[key]
    if v not in options:
        raise ConfigError(f"{path}.{key}: must be one of {list(options)}, got {v!r}")
    return v
