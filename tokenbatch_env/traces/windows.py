"""Time scaling and scored windows (docs/design.md sections 2 and 5).

**Time scaling.** ``time_scale(trace, factor)`` multiplies every arrival time by ``factor`` (> 1 is
slower traffic, < 1 faster), about ``origin`` (default t = 0, so scaling commutes exactly with
``Trace.subset``). The arithmetic is exact: ``factor`` is taken as a rational number (an ``int``,
``Fraction``, decimal string, or a ``float`` at its exact binary value) and each arrival becomes
``origin + floor((t - origin) * factor + 1/2)`` (round half up) computed with integers, so equal
timestamps stay equal, order is kept, and the result is the same on every machine.

``scale_to_rate(trace, rate_rps, nominal_rps=None)`` rescales so the trace's rate becomes
``rate_rps``: ``factor = nominal_rps / rate_rps`` (both exact rationals). Suites store traces at a
known nominal rate (``Suite.nominal_rate_rps``) and pass it, so every trace of a suite is scaled by
the same factor; without it the trace's empirical rate ``(n - 1) / (t_last - t_first)`` is used.

**Windows.** A ``Window`` is a sub-trace (``Trace.subset``, absolute arrival times kept) of
``warmup`` requests, then the scored requests, then ``cooldown`` requests; only the scored ones
count in metrics. ``cut_windows`` tiles a trace so that every request of the scored region is scored
in exactly one window:

* ``edges="full"`` (default): the scored region is ``[warmup, n - cooldown)``, so every window has
  its full warm-up and cool-down (the first ``warmup`` and last ``cooldown`` requests are never
  scored);
* ``edges="clip"``: the scored region is the whole trace ``[0, n)``; warm-up / cool-down are cut
  short at the trace's ends.

The last window may hold fewer than ``size`` scored requests unless ``drop_partial=True``.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Optional

import numpy as np

from ..errors import ConfigError
from .trace import Trace

__all__ = ["as_fraction", "scale_ints", "scale_rows", "time_scale", "empirical_rate_rps", "scale_to_rate",
           "Window", "window_at", "cut_windows"]


def as_fraction(x, name: str = "factor") -> Fraction:
    """``x`` as an exact positive rational (float: its exact binary value; str: its decimal value)."""
    if isinstance(x, bool):
        raise ConfigError(f"{name}: must be a positive number, got {x!r}")
    try:
        if isinstance(x, (np.integer, np.floating)):
            x = x.item()
        f = Fraction(x)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        raise ConfigError(f"{name}: must be a positive finite number, got {x!r}") from None
    if f <= 0:
        raise ConfigError(f"{name}: must be > 0, got {x!r}")
    return f


_U64 = 2**64


def _wrapped_params(vmin: int, vmax: int, f: Fraction) -> Optional[tuple]:
    """``(float(f), 2p mod 2**64, q)`` for ``_scale_wrapped`` if its bounds hold for values in
    ``[vmin, vmax]``, else None."""
    p, q = f.numerator, f.denominator
    if q >= 2**61 or vmin < 0:
        return None
    try:
        ff = p / q   # float(f), without Fraction's dispatch
    except OverflowError:
        return None
    if not (ff > 0.0 and vmax * ff < 2.0**49):   # margin below 2**50 for the float rounding of the bound
        return None
    return ff, 2 * p % _U64, q


def _scale_wrapped(v: np.ndarray, ff, p2, q) -> np.ndarray:
    """``floor(v * f + 1/2)`` from ``_wrapped_params`` (scalars, or arrays broadcasting against
    ``v``: one factor per row)."""
    x = v * ff
    x += 0.5
    r0 = np.floor(x, out=x).astype(np.int64)              # >= 0
    e = v.view(np.uint64) * np.asarray(p2, np.uint64)     # uint64 arithmetic wraps modulo 2**64
    e += np.asarray(q, np.uint64)
    q2 = 2 * np.asarray(q, np.int64)
    e -= r0.view(np.uint64) * q2.astype(np.uint64)
    e = e.view(np.int64)
    r0 += e >= q2
    r0 -= e < 0
    return r0


def _scale_ints_wrapped(v: np.ndarray, f: Fraction) -> Optional[np.ndarray]:
    """``floor(v * f + 1/2)`` of non-negative int64 ``v`` without big integers, or None when the
    bounds below do not hold (the caller then uses Python integers).

    With ``f = p/q`` and the true value ``T = (2vp + q) / (2q)``: a float64 estimate ``r0`` of
    ``floor(T)`` is within 1 of it while ``v * f < 2**50`` (relative error of ``v * float(f)`` at
    most 3 * 2**-53, so an absolute error below 3/8, plus at most 1/8 from adding 1/2). The residual
    ``e = 2vp + q - 2q r0`` then lies in ``[-2q, 4q)``, inside int64 when ``q < 2**61``, so its value
    computed modulo 2**64 (uint64 arithmetic wraps) is exact, and ``0 <= e < 2q`` decides
    ``r0 = floor(T)`` exactly: one correction step gives the exact result."""
    params = None if v.size == 0 else _wrapped_params(int(v.min()), int(v.max()), f)
    return None if params is None else _scale_wrapped(v, *params)


def scale_rows(values: np.ndarray, factors) -> np.ndarray:
    """``scale_ints(values[i], factors[i])`` for each row of a 2-D int64 array, exactly, with one
    set of array operations for the rows where the wrapped method's bounds hold."""
    v = np.asarray(values, np.int64)
    fs = [f if type(f) is Fraction and f.numerator > 0 else as_fraction(f) for f in factors]
    if v.shape[1] == 0:
        return v.copy()
    params = [_wrapped_params(lo, hi, f) for lo, hi, f in zip(v.min(axis=1).tolist(), v.max(axis=1).tolist(), fs)]
    ok = np.array([p is not None for p in params], bool)
    out = np.empty_like(v)
    if ok.any():
        ff, p2, q = (np.array([p[i] for p in params if p is not None], dt)
                     for i, dt in enumerate((np.float64, np.uint64, np.uint64)))
        out[ok] = _scale_wrapped(v[ok], ff[:, None], p2[:, None], q[:, None])
    for i in np.flatnonzero(~ok):
        out[i] = scale_ints(v[i], fs[i])
    return out


def scale_ints(values, factor) -> np.ndarray:
    """``floor(v * factor + 1/2)`` for each non-negative int64 ``v``, exactly (int64 result)."""
    f = as_fraction(factor)
    p, q = f.numerator, f.denominator
    v = np.asarray(values, np.int64)
    if v.size == 0:
        return v.astype(np.int64)
    if int(v.max()) < 2**62 // (2 * p) and q < 2**61:
        return (2 * v * p + q) // (2 * q)
    r = _scale_ints_wrapped(v, f)
    if r is not None:
        return r
    try:
        return np.array([(2 * x * p + q) // (2 * q) for x in v.tolist()], dtype=np.int64)
    except OverflowError:
        raise ConfigError(f"factor: {factor!r} scales the values beyond int64") from None


def time_scale(trace: Trace, factor, *, origin: Optional[int] = 0) -> Trace:
    """``trace`` with arrival times multiplied by ``factor`` about ``origin`` (see module doc).

    ``origin=None`` scales about the trace's first arrival (keeps its start time).
    """
    f = as_fraction(factor)
    a = trace.arrival_ns
    if origin is None:
        origin = int(a[0]) if len(a) else 0
    origin = int(origin)
    if len(a) and int(a[0]) < origin:
        raise ConfigError(f"origin: must be <= the first arrival ({int(a[0])} ns), got {origin}")
    scaled = origin + scale_ints(a - origin, f)
    return trace._with_arrivals(scaled)  # the other columns are the (validated) trace's


def empirical_rate_rps(trace: Trace) -> float:
    """(n - 1) / (t_last - t_first) in requests per second."""
    a = trace.arrival_ns
    if len(a) < 2 or a[-1] == a[0]:
        raise ConfigError(f"trace {trace.name!r}: needs >= 2 distinct arrival times to have a rate")
    return (len(a) - 1) * 1e9 / float(a[-1] - a[0])


def scale_to_rate(trace: Trace, rate_rps, *, nominal_rps=None, origin: Optional[int] = 0) -> Trace:
    """Rescale so the arrival rate becomes ``rate_rps``: ``factor = nominal_rps / rate_rps``."""
    target = as_fraction(rate_rps, "rate_rps")
    nominal = (as_fraction(empirical_rate_rps(trace), "nominal_rps") if nominal_rps is None
               else as_fraction(nominal_rps, "nominal_rps"))
    return time_scale(trace, nominal / target, origin=origin)


@dataclasses.dataclass(frozen=True)
class Window:
    """A sub-trace with its scored rows ``trace[scored_start:scored_stop]``.

    ``parent_start`` is the index in the parent trace of the sub-trace's row 0, so parent row
    ``parent_start + i`` is sub-trace row ``i``.
    """

    trace: Trace
    scored_start: int
    scored_stop: int
    parent_start: int

    @property
    def scored(self) -> slice:
        return slice(self.scored_start, self.scored_stop)

    @property
    def num_scored(self) -> int:
        return self.scored_stop - self.scored_start

    @property
    def warmup(self) -> int:
        return self.scored_start

    @property
    def cooldown(self) -> int:
        return len(self.trace) - self.scored_stop

    @property
    def parent_scored(self) -> range:
        """Parent-trace indices of the scored requests."""
        return range(self.parent_start + self.scored_start, self.parent_start + self.scored_stop)

    def scored_mask(self) -> np.ndarray:
        m = np.zeros(len(self.trace), bool)
        m[self.scored] = True
        return m


def _nonneg_int(x, name: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) < lo:
        raise ConfigError(f"{name}: must be an integer >= {lo}, got {x!r}")
    return int(x)


def window_at(trace: Trace, start: int, size: int, warmup: int = 0, cooldown: int = 0) -> Window:
    """The window scoring parent rows ``[start, start + size)`` (clipped to the trace) with up to
    ``warmup`` rows before and ``cooldown`` rows after."""
    n = len(trace)
    start = _nonneg_int(start, "start")
    size = _nonneg_int(size, "size", 1)
    warmup = _nonneg_int(warmup, "warmup")
    cooldown = _nonneg_int(cooldown, "cooldown")
    if start >= n:
        raise ConfigError(f"start: must be < the trace's {n} requests, got {start}")
    stop = min(start + size, n)
    lo, hi = max(0, start - warmup), min(n, stop + cooldown)
    sub = trace.subset(slice(lo, hi))
    return Window(sub, start - lo, stop - lo, lo)


def cut_windows(trace: Trace, size: int, warmup: int = 0, cooldown: int = 0, *, edges: str = "full",
                drop_partial: bool = False) -> list[Window]:
    """Tile the trace's scored region with windows of ``size`` scored requests (see module doc)."""
    n = len(trace)
    size = _nonneg_int(size, "size", 1)
    warmup = _nonneg_int(warmup, "warmup")
    cooldown = _nonneg_int(cooldown, "cooldown")
    if edges == "full":
        lo, hi = warmup, n - cooldown
    elif edges == "clip":
        lo, hi = 0, n
    else:
        raise ConfigError(f"edges: must be 'full' or 'clip', got {edges!r}")
    out = []
    for s in range(lo, max(lo, hi), size):
        if drop_partial and s + size > hi:
            break
        w = window_at(trace, s, min(size, hi - s), warmup, cooldown)
        out.append(w)
    return out
