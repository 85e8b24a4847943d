"""SLA assignment for traces that carry no SLOs (docs/design.md section 2): the generators' ``sla``
section and the Python API kept from before SLO rules were data; the arithmetic is ``slo_rules``'s
(``SlaSpec.to_rule``), so both give the same columns bit for bit.

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
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError
from .checks import check_keys, num
from .slo_rules import STREAM_CLASSES, SloClass, SloRule, apply_slo_rule, class_slos, draw_shares, ttft_idle_ns
from .trace import Trace

__all__ = ["SlaClass", "SlaSpec", "DEFAULT_SLA", "ttft_idle_ns", "slo_arrays", "draw_classes",
           "assign_arrays", "assign_slas", "STREAM_CLASSES"]

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

    def to_rule(self) -> SloRule:
        """The spec as an ``SloRule`` (``slo_rules``): its weights are the shares, normalized by the
        draw, so the classes and columns are the spec's own bit for bit (for ``assign_slas``, not
        for saving: a rule file's shares sum to 1)."""
        return SloRule("sla-spec", tuple(SloClass(c.name, 0.0, c.ttft_scale, c.tpot_ms, c.priority, c.weight)
                                         for c in self.classes), self.profile)

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


def slo_arrays(prompt_tokens, class_id, spec: SlaSpec = DEFAULT_SLA, profile=None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ttft_slo_ns, tpot_slo_ns, priority) for given prompts and classes under ``spec`` (on
    ``profile`` instead of the spec's, if given)."""
    cid = np.asarray(class_id, np.int64)
    k = len(spec.classes)
    if cid.size and (cid.min() < 0 or cid.max() >= k):
        raise ConfigError(f"class_id: must be in 0..{k - 1} for this SLA spec")
    return class_slos(prompt_tokens, cid, spec.to_rule(),
                      profile if profile is not None else spec.load_profile())


def draw_classes(rng: np.random.Generator, n: int, spec: SlaSpec = DEFAULT_SLA) -> np.ndarray:
    """n class ids drawn with the spec's weights (one uniform per request)."""
    return draw_shares(rng, n, [c.weight for c in spec.classes])


def assign_arrays(prompt_tokens, spec: SlaSpec, rng: np.random.Generator, trace_name: Optional[str] = None):
    """(class_id, ttft_slo_ns, tpot_slo_ns, priority) for the prompts, classes drawn from ``rng``; the
    rule's errors name the trace ``trace_name``, if given."""
    prompt = np.asarray(prompt_tokens, np.int64)
    cid = draw_classes(rng, prompt.size, spec)
    t1, t2, prio = class_slos(prompt, cid, spec.to_rule(), spec.load_profile(), trace_name=trace_name)
    return cid, t1, t2, prio


def assign_slas(trace: Trace, spec: Optional[SlaSpec | dict] = None, seed: int = 0, *,
                overwrite: bool = False) -> Trace:
    """A copy of ``trace`` with classes, SLOs and priorities (all of them) assigned by the rule above:
    ``apply_slo_rule`` with the spec as an explicit rule (the classes of ``draw_classes``, bit for bit).

    Raises ``ConfigError`` if the trace already has SLOs, unless ``overwrite=True``.
    """
    if spec is None:
        spec = DEFAULT_SLA
    elif isinstance(spec, dict):
        spec = SlaSpec.from_dict(spec)
    if trace.has_slos and not overwrite:
        raise ConfigError(f"trace {trace.name!r} already has SLOs; pass overwrite=True to replace them")
    return apply_slo_rule(trace, spec.to_rule(), seed=seed, explicit=True)[0]
