"""SLA assignment for traces that carry no SLOs (docs/design.md section 2).

The rule, for a trace of n requests, an ``SlaSpec`` (an engine profile name and K classes) and a seed:

1. **Class.** Each request independently gets class k with probability ``weight_k / sum(weight)``,
   drawn from ``Generator(PCG64(SeedSequence([seed, 4])))`` (stream 4 = SLA classes, the same stream
   the generators use), so the same (trace, spec, seed) gives the same classes everywhere.
   ``class_id`` is the class's position in the spec's list.
2. **TTFT SLO (relative).** ``T1_i = round_half_up(s_k * TTFT_idle(prompt_i))`` in integer ns,
   where ``TTFT_idle(P) = profile.cost.idle_prefill_ns(P, profile.max_num_batched_tokens)`` is the
   time the idle engine of the named profile needs to prefill the whole prompt (no cache hits),
   chunked at the token budget B, and ``s_k`` (``ttft_scale``) is multiplied exactly from its decimal
   value (``repr(float(s))``), so the rounding is exact integer arithmetic.
3. **TPOT SLO (absolute).** ``T2_i = round(tpot_ms_k * 1e6)`` ns, one value per class.
4. **Priority.** ``priority_i = priority_k`` (lower is served first, as in vLLM).

The default spec (``DEFAULT_SLA``) is the lab's standard three classes on ``stress-512``:

| class       | weight | s (T1 = s * TTFT_idle) | T2     | priority |
|-------------|--------|------------------------|--------|----------|
| interactive | 1/3    | 2                      | 50 ms  | 0        |
| standard    | 1/3    | 5                      | 100 ms | 1        |
| batch       | 1/3    | 10                     | 200 ms | 2        |

SLOs depend on the profile through TTFT_idle, so a suite's SLOs are fixed for the profile named in
its spec; running the same trace on another profile keeps those SLOs (as a real deployment would).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError, TraceError
from .checks import check_keys, num
from .trace import MAX_SLO_NS, Trace

__all__ = ["SlaClass", "SlaSpec", "DEFAULT_SLA", "ttft_idle_ns", "slo_arrays", "draw_classes",
           "assign_arrays", "assign_slas", "STREAM_CLASSES"]

#: The random stream used for class draws (shared with ``generators``; never renumber).
STREAM_CLASSES = 4


@dataclasses.dataclass(frozen=True)
class SlaClass:
    name: str
    weight: float
    ttft_scale: float     # s: T1 = s * TTFT_idle(prompt)
    tpot_ms: float        # T2, absolute
    priority: int = 0     # lower = served first (vLLM)

    @property
    def tpot_ns(self) -> int:
        return int(round(self.tpot_ms * 1_000_000))


@dataclasses.dataclass(frozen=True)
class SlaSpec:
    profile: str = "stress-512"
    classes: tuple = ()

    @classmethod
    def from_dict(cls, d: Any, path: str = "sla") -> "SlaSpec":
        check_keys(d, path, ["classes"], ["profile"])
        profile = d.get("profile", "stress-512")
        if not isinstance(profile, str) or not profile:
            raise ConfigError(f"{path}.profile: must be a profile name, got {profile!r}")
        raw = d["classes"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{path}.classes: must be a non-empty list of classes")
        out = []
        for i, c in enumerate(raw):
            p = f"{path}.classes[{i}]"
            check_keys(c, p, ["weight", "ttft_scale", "tpot_ms"], ["name", "priority"])
            name = c.get("name", f"class{i}")
            if not isinstance(name, str) or not name:
                raise ConfigError(f"{p}.name: must be a non-empty string, got {name!r}")
            out.append(SlaClass(name, num(c, "weight", p, lo=0, lo_open=True, hi=1e9),
                                num(c, "ttft_scale", p, lo=0, lo_open=True, hi=1e6),
                                num(c, "tpot_ms", p, lo=0, lo_open=True, hi=86_400_000),
                                                num(c, "priority", p, lo=-1_000_000, hi=1_000_000, integer=True,
                                    default=0)))
        names = [c.name for c in out]
        if len(set(names)) != len(names):
            raise ConfigError(f"{path}.classes: class names must be unique, got {names}")
        spec = cls(profile, tuple(out))
        spec.load_profile(path)  # fail early on an unknown profile
        return spec

    def to_dict(self) -> dict:
        return {"profile": self.profile,
                "classes": [{"name": c.name, "weight": c.weight, "ttft_scale": c.ttft_scale,
                             "tpot_ms": c.tpot_ms, "priority": c.priority} for c in self.classes]}

    def load_profile(self, path: str = "sla"):
        from ..engine.profiles import load_profile
        from ..errors import ProfileError

        try:
            return load_profile(self.profile)
        except ProfileError as e:
            raise ConfigError(f"{path}.profile: {e}") from None


DEFAULT_SLA = SlaSpec("stress-512", (
    SlaClass("interactive", 1.0, 2.0, 50.0, 0),
    SlaClass("standard", 1.0, 5.0, 100.0, 1),
    SlaClass("batch", 1.0, 10.0, 200.0, 2),
))


def ttft_idle_ns(prompt_tokens, profile) -> np.ndarray:
    """Idle-engine TTFT (int64 ns) of each prompt on ``profile`` (a Profile or a profile name)."""
    if isinstance(profile, str):
        from ..engine.profiles import load_profile

        profile = load_profile(profile)
    return profile.cost.idle_prefill_ns(np.asarray(prompt_tokens, np.int64),
                                        profile.max_num_batched_tokens)


def _scale_exact(values: np.ndarray, s: float) -> np.ndarray:
    """round_half_up(values * s) with s taken at its decimal value, in exact integer arithmetic."""
    from .windows import scale_ints

    return scale_ints(values, Fraction(repr(float(s))))


def slo_arrays(prompt_tokens, class_id, spec: SlaSpec = DEFAULT_SLA, profile=None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ttft_slo_ns, tpot_slo_ns, priority) for given prompts and classes under ``spec``."""
    prompt = np.asarray(prompt_tokens, np.int64)
    cid = np.asarray(class_id, np.int64)
    k = len(spec.classes)
    if cid.size and (cid.min() < 0 or cid.max() >= k):
        raise ConfigError(f"class_id: must be in 0..{k - 1} for this SLA spec")
    idle = ttft_idle_ns(prompt, profile if profile is not None else spec.load_profile())
    t1 = np.zeros(prompt.size, np.int64)
    for j, c in enumerate(spec.classes):
        m = cid == j
        if m.any():
            t1[m] = _scale_exact(idle[m], c.ttft_scale)
    t1 = np.maximum(t1, 1)
    over = np.flatnonzero(t1 > MAX_SLO_NS)
    if over.size:   # (a prompt no engine serves in a day: say so, not a range error on a derived column)
        i = int(over[0])
        c = spec.classes[int(cid.reshape(-1)[i])]
        raise TraceError(f"request {i} (0-based) has a {int(prompt.reshape(-1)[i]):,}-token prompt: the SLA rule's "
                         f"TTFT SLO for it (class {c.name!r}: {c.ttft_scale:g} x its idle prefill time, "
                         f"{idle.reshape(-1)[i] / 1e9:.6g} s) exceeds a day ({over.size} such request(s)); "
                         f"drop or cap such prompts, lower the class's ttft_scale, or give the trace its own "
                         f"SLOs")
    t2 = np.array([c.tpot_ns for c in spec.classes], np.int64)[cid]
    prio = np.array([c.priority for c in spec.classes], np.int64)[cid]
    return t1, t2, prio


def draw_classes(rng: np.random.Generator, n: int, spec: SlaSpec = DEFAULT_SLA) -> np.ndarray:
    """n class ids drawn with the spec's weights (one uniform per request)."""
    w = np.array([c.weight for c in spec.classes], float)
    cdf = np.cumsum(w)
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"),
                      len(w) - 1).astype(np.int64)


def assign_arrays(prompt_tokens, spec: SlaSpec, rng: np.random.Generator, trace_name: Optional[str] = None):
    """(class_id, ttft_slo_ns, tpot_slo_ns, priority) for the prompts, classes drawn from ``rng``; the
    rule's errors name the trace ``trace_name``, if given."""
    prompt = np.asarray(prompt_tokens, np.int64)
    cid = draw_classes(rng, prompt.size, spec)
    try:
        t1, t2, prio = slo_arrays(prompt, cid, spec)
    except TraceError as e:
        if trace_name is None:
            raise
        raise TraceError(f"trace {trace_name!r}: {e}") from None
    return cid, t1, t2, prio


def assign_slas(trace: Trace, spec: Optional[SlaSpec | dict] = None, seed: int = 0, *,
                overwrite: bool = False) -> Trace:
    """A copy of ``trace`` with classes, SLOs and priorities assigned by the rule above.

    Raises ``ConfigError`` if the trace already has SLOs, unless ``overwrite=True``.
    """
    if spec is None:
        spec = DEFAULT_SLA
    elif isinstance(spec, dict):
        spec = SlaSpec.from_dict(spec)
    if trace.has_slos and not overwrite:
        raise ConfigError(f"trace {trace.name!r} already has SLOs; pass overwrite=True to replace them")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed: must be an integer >= 0, got {seed!r}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), STREAM_CLASSES])))
    cid, t1, t2, prio = assign_arrays(trace.prompt_tokens, spec, rng, trace.name)
    return trace.replace(ttft_slo_ns=t1, tpot_slo_ns=t2, priority=prio, class_id=cid)
