"""Small helpers with no dependency inside the package but the errors (the base layer,
docs/design.md section 1): the cores this process may use, the canonical JSON behind every
evidence id, and the parser of comma-separated load lists shared by the commands."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from .errors import ConfigError

__all__ = ["NATIVE", "available_cores", "canonical_json", "parse_loads", "split_native"]


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (non-Linux)
        return os.cpu_count() or 1


def canonical_json(obj) -> str:
    """``obj`` as JSON with sorted keys and no spaces (numpy scalars and arrays as numbers and
    lists; NaN refused): what the evidence ids hash (docs/design.md section 6)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_jsonable)


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


#: the load of a trace's own timestamps (``--loads native``, docs/design.md section 10)
NATIVE = "native"


def split_native(text: str) -> tuple:
    """(``native`` among the comma-separated loads, the other loads' text)."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    return NATIVE in items, ",".join(s for s in items if s != NATIVE)


def parse_loads(text: str, name: str = "loads") -> tuple:
    """A comma-separated list of rho values > 0 (``--NAME``), with one-line errors."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ConfigError(f"--{name}: need at least one rho > 0, e.g. 0.6,1.2")
    out = []
    for s in items:
        try:
            v = float(s)
        except ValueError:
            raise ConfigError(f"--{name}: {s!r} is not a number (rho values > 0, comma-separated)") from None
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"--{name}: rho must be a finite number > 0, got {s!r}")
        out.append(v)
    return tuple(out)
