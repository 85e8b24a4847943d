"""SLO rules as data: the SLOs and priority each request of a trace gets (docs/design.md section 2).

A rule is a JSON object (presets in ``tokenbatch_env/data/slo_rules/``, or any file)::

    {"name": "default-3class", "reference_profile": "stress-512",
     "classes": [{"name": "interactive", "share": 0.3333333333333333,
                  "ttft": {"a_ms": 0, "b": 2}, "tpot_ms": 50, "priority": 0}, ...]}

Optional top-level fields: ``reference_profile``, ``source``, ``note``, ``mlperf`` (``benchmark``,
``scenario``, ``ttft_p99_ms``, ``tpot_p99_ms``: the p99 limits a report judges the run by).

**SLOs of class k.** ``T1 = a_ms + b x idle_prefill_ref(prompt)`` in integer ns: ``a_ms`` and ``b``
are taken at their decimal values and the sum rounded half up in exact integer arithmetic (at least
1 ns); ``idle_prefill_ref`` is ``ttft_idle_ns`` on the reference profile (the rule's
``reference_profile``, else the evaluated profile the caller passes) at its own token budget B,
no cache hits. ``T2 = tpot_ms`` (``round(tpot_ms * 1e6)`` ns). ``priority``: lower first (vLLM).

**Which class.** Every class of a rule has a ``share`` or every class has a ``when``, never both:

- ``share`` (summing to 1 within 1e-9): one uniform ``u`` per request from
  ``Generator(PCG64(SeedSequence([seed, 4])))`` (stream 4, as the generators), class = the first
  whose cumulative share exceeds ``u x total``: ``sla.assign_slas``'s draw, so ``default-3class``
  gives its columns bit for bit.
- ``when``: the first class whose predicate holds for the request. A predicate is
  ``{"column": C, "op": OP, "value": V}`` with C a trace column (``COLUMNS``), OP one of
  ``== != < <= > >=`` (V a number) or ``in`` (V a list of numbers); ``{"all": [P, ...]}``,
  ``{"any": [P, ...]}``, ``{"not": P}``; or the string ``"otherwise"`` (every request; last class
  only). A request matching no class, or a predicate on a column the trace lacks, is an error.

**Never overwrite.** ``apply_slo_rule`` fills the SLO columns only of a trace without SLOs
(``has_slos``) and ``priority`` only of one without a priority of its own (``has_priority``),
unless the rule is given explicitly; it returns one line saying what it did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from ..errors import ConfigError, TraceError
from ..util import canonical_json
from .checks import check_keys, num
from .trace import MAX_SLO_NS, Trace

__all__ = ["COLUMNS", "OPS", "OTHERWISE", "STREAM_CLASSES", "DEFAULT_RULE", "Predicate", "SloClass",
           "MlperfLimits", "SloRule", "load_slo_rule", "list_slo_rules", "apply_slo_rule", "class_ids",
           "class_slos", "draw_shares", "ttft_idle_ns"]

#: The random stream of class draws (shared with ``generators``; never renumber).
STREAM_CLASSES = 4
#: The rule applied when none is named (the three classes on stress-512 of every suite).
DEFAULT_RULE = "default-3class"
#: Trace columns a predicate may test.
COLUMNS = ("arrival_ns", "prompt_tokens", "output_tokens", "ttft_slo_ns", "tpot_slo_ns", "priority",
           "class_id")
_COMPARE = {"==": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater,
            ">=": np.greater_equal}
OPS = (*_COMPARE, "in")
OTHERWISE = "otherwise"
_DAY_MS = 86_400_000
_INT64 = (-(2**63), 2**63 - 1)


# --------------------------------------------------------------------------------- predicates
def _number(v: Any, where: str):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: must be a number, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}: must be finite, got {v!r}")
    if isinstance(v, int) and not _INT64[0] <= v <= _INT64[1]:
        raise ConfigError(f"{where}: out of the int64 range, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class Predicate:
    """A ``when`` condition: ``kind`` is ``cmp`` (``column op value``), ``all``, ``any``, ``not``
    (over ``parts``) or ``otherwise``."""

    kind: str
    column: Optional[str] = None
    op: Optional[str] = None
    value: Any = None          # a number, or a tuple of numbers for "in"
    parts: tuple = ()

    @classmethod
    def from_dict(cls, d: Any, path: str, top: bool = True) -> "Predicate":
        if d == OTHERWISE and top:
            return cls(OTHERWISE)
        if isinstance(d, str):
            raise ConfigError(f"{path}: must be a predicate object" + (f" or {OTHERWISE!r}" if top else "")
                              + f", got {d!r}")
        if isinstance(d, dict) and len(d) == 1 and next(iter(d)) in ("all", "any", "not"):
            (kind, sub), = d.items()
            if kind == "not":
                return cls("not", parts=(cls.from_dict(sub, f"{path}.not", False),))
            if not isinstance(sub, list) or not sub:
                raise ConfigError(f"{path}.{kind}: must be a non-empty list of predicates")
            return cls(kind, parts=tuple(cls.from_dict(p, f"{path}.{kind}[{i}]", False) for i, p in enumerate(sub)))
        check_keys(d, path, ["column", "op", "value"])
        col, op, v = d["column"], d["op"], d["value"]
        if col not in COLUMNS:
            raise ConfigError(f"{path}.column: unknown column {col!r}; valid: {list(COLUMNS)}")
        if op not in OPS:
            raise ConfigError(f"{path}.op: must be one of {list(OPS)}, got {op!r}")
        if op == "in":
            if not isinstance(v, list) or not v:
                raise ConfigError(f"{path}.value: 'in' needs a non-empty list of numbers, got {v!r}")
            v = tuple(_number(x, f"{path}.value[{i}]") for i, x in enumerate(v))
        else:
            v = _number(v, f"{path}.value")
        return cls("cmp", col, op, v)

    def to_dict(self) -> Any:
        if self.kind == OTHERWISE:
            return OTHERWISE
        if self.kind == "cmp":
            return {"column": self.column, "op": self.op,
                    "value": list(self.value) if self.op == "in" else self.value}
        if self.kind == "not":
            return {"not": self.parts[0].to_dict()}
        return {self.kind: [p.to_dict() for p in self.parts]}

    def columns(self) -> set:
        """The trace columns it reads."""
        return {self.column} if self.kind == "cmp" else set().union(*(p.columns() for p in self.parts))

    def mask(self, cols: dict, n: int) -> np.ndarray:
        """Which of the ``n`` requests (columns ``cols``) it holds for."""
        if self.kind == OTHERWISE:
            return np.ones(n, bool)
        if self.kind == "cmp":
            a = cols[self.column]
            if self.op == "in":
                return np.isin(a, np.array(self.value))
            return np.asarray(_COMPARE[self.op](a, self.value), bool)
        masks = [p.mask(cols, n) for p in self.parts]
        if self.kind == "not":
            return ~masks[0]
        return np.logical_and.reduce(masks) if self.kind == "all" else np.logical_or.reduce(masks)


# --------------------------------------------------------------------------------- rules
def _exact_ns(ms: float) -> int:
    """``ms`` (at its decimal value) in ns, rounded half up: exact, no float on the way."""
    f = Fraction(repr(float(ms))) * 10**6
    return int((2 * f.numerator + f.denominator) // (2 * f.denominator))


@dataclasses.dataclass(frozen=True)
class SloClass:
    """One class: ``T1 = a_ms + b x idle_prefill_ref(prompt)``, ``T2 = tpot_ms``, ``priority``;
    chosen by ``share`` or by ``when``."""

    name: str
    a_ms: float
    b: float
    tpot_ms: float
    priority: int = 0
    share: Optional[float] = None
    when: Optional[Predicate] = None

    @property
    def a_ns(self) -> int:
        return _exact_ns(self.a_ms)

    @property
    def tpot_ns(self) -> int:
        return int(round(self.tpot_ms * 1_000_000))

    def to_dict(self) -> dict:
        d = {"name": self.name}
        if self.share is not None:
            d["share"] = self.share
        else:
            d["when"] = self.when.to_dict()
        d.update({"ttft": {"a_ms": self.a_ms, "b": self.b}, "tpot_ms": self.tpot_ms, "priority": self.priority})
        return d


@dataclasses.dataclass(frozen=True)
class MlperfLimits:
    """MLPerf's per-run p99 limits a preset stands for (``mlperf.conf``), for reports' own verdict."""

    benchmark: str
    scenario: str
    ttft_p99_ms: float
    tpot_p99_ms: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SloRule:
    """A parsed rule (see the module docstring). ``where`` (the file or preset it came from) names
    it in errors; it is not part of the rule's content or ``digest``."""

    name: str
    classes: tuple
    reference_profile: Optional[str] = None
    source: Optional[str] = None
    note: Optional[str] = None
    mlperf: Optional[MlperfLimits] = None
    where: str = dataclasses.field(default="", compare=False)

    @property
    def by_shares(self) -> bool:
        return self.classes[0].share is not None

    @property
    def needs_profile(self) -> bool:
        """Whether T1 depends on a profile (some class has b > 0)."""
        return any(c.b > 0 for c in self.classes)

    @property
    def is_mlperf(self) -> bool:
        return self.mlperf is not None

    @property
    def p99_limits(self) -> Optional[dict]:
        """``{"ttft_ms", "tpot_ms"}``: MLPerf's p99 limits over a run, for an MLPerf preset; else None."""
        if self.mlperf is None:
            return None
        return {"ttft_ms": self.mlperf.ttft_p99_ms, "tpot_ms": self.mlperf.tpot_p99_ms}

    @property
    def digest(self) -> str:
        """SHA-256 of the rule's canonical JSON (``to_dict``): its identity in evidence ids."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()

    def to_dict(self) -> dict:
        d: dict = {"name": self.name}
        for k in ("reference_profile", "source", "note"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.mlperf is not None:
            d["mlperf"] = self.mlperf.to_dict()
        d["classes"] = [c.to_dict() for c in self.classes]
        return d

    @classmethod
    def from_dict(cls, d: Any, where: Optional[str] = None) -> "SloRule":
        """Validate ``d``; every error is one ``ConfigError`` line naming ``where`` (the file) and the
        field."""
        try:
            return cls._parse(d, where or "")
        except ConfigError as e:
            raise ConfigError(f"{where or 'SLO rule'}: {e}") from None

    @classmethod
    def _parse(cls, d: Any, where: str) -> "SloRule":
        p = "rule"
        check_keys(d, p, ["name", "classes"], ["reference_profile", "source", "note", "mlperf"])
        name = d["name"]
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{p}.name: must be a non-empty string, got {name!r}")
        texts = {}
        for k in ("reference_profile", "source", "note"):
            v = d.get(k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ConfigError(f"{p}.{k}: must be a non-empty string, got {v!r}")
            texts[k] = v
        if texts["reference_profile"] is not None:
            from ..engine.profiles import load_profile
            from ..errors import ProfileError
            try:
                load_profile(texts["reference_profile"])   # fail early on an unknown profile
            except ProfileError as e:
                raise ConfigError(f"{p}.reference_profile: {e}") from None
        raw = d["classes"]
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"{p}.classes: must be a non-empty list of classes")
        classes = []
        for i, c in enumerate(raw):
            q = f"{p}.classes[{i}]"
            check_keys(c, q, ["name", "ttft", "tpot_ms"], ["priority", "share", "when"])
            cname = c["name"]
            if not isinstance(cname, str) or not cname:
                raise ConfigError(f"{q}.name: must be a non-empty string, got {cname!r}")
            t = check_keys(c["ttft"], f"{q}.ttft", [], ["a_ms", "b"])
            a_ms = num(t, "a_ms", f"{q}.ttft", lo=0, hi=_DAY_MS, default=0.0)
            b = num(t, "b", f"{q}.ttft", lo=0, hi=1e6, default=0.0)
            if a_ms == 0 and b == 0:
                raise ConfigError(f"{q}.ttft: a_ms and b are both 0 (a TTFT SLO of 0): give a_ms > 0 or b > 0")
            tpot = num(c, "tpot_ms", q, lo=0, lo_open=True, hi=_DAY_MS)
            if int(round(tpot * 1_000_000)) < 1:
                raise ConfigError(f"{q}.tpot_ms: below 1 ns, got {tpot!r}")
            prio = num(c, "priority", q, lo=-1_000_000, hi=1_000_000, integer=True, default=0)
            has_share, has_when = "share" in c, "when" in c
            if has_share == has_when:
                raise ConfigError(f"{q}: give exactly one of 'share' (classes drawn by shares) and 'when' "
                                  f"(classes chosen by predicates)")
            if i and has_share != (classes[0].share is not None):
                raise ConfigError(f"{q}: has {'share' if has_share else 'when'} but classes[0] has "
                                  f"{'when' if has_share else 'share'}: a rule chooses classes by shares or "
                                  f"by predicates, never both")
            share = num(c, "share", q, lo=0, lo_open=True, hi=1) if has_share else None
            when = Predicate.from_dict(c["when"], f"{q}.when") if has_when else None
            if i and classes[-1].when is not None and classes[-1].when.kind == OTHERWISE:
                raise ConfigError(f"{q}: unreachable: classes[{i - 1}] is {OTHERWISE!r} (it matches every request)")
            classes.append(SloClass(cname, a_ms, b, tpot, prio, share, when))
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise ConfigError(f"{p}.classes: class names must be unique, got {names}")
        if classes[0].share is not None:
            total = math.fsum(c.share for c in classes)
            if abs(total - 1.0) > 1e-9:
                raise ConfigError(f"{p}.classes: shares sum to {total!r}, not 1 (tolerance 1e-9)")
        mlperf = None
        if d.get("mlperf") is not None:
            m = check_keys(d["mlperf"], f"{p}.mlperf", ["benchmark", "scenario", "ttft_p99_ms", "tpot_p99_ms"])
            for k in ("benchmark", "scenario"):
                if not isinstance(m[k], str) or not m[k]:
                    raise ConfigError(f"{p}.mlperf.{k}: must be a non-empty string, got {m[k]!r}")
            mlperf = MlperfLimits(m["benchmark"], m["scenario"],
                                  num(m, "ttft_p99_ms", f"{p}.mlperf", lo=0, lo_open=True, hi=_DAY_MS),
                                  num(m, "tpot_p99_ms", f"{p}.mlperf", lo=0, lo_open=True, hi=_DAY_MS))
            for i, c in enumerate(classes):   # (per-request SLOs = the run's p99 limits, or the verdict misleads)
                if (c.a_ms, c.b, c.tpot_ms) != (mlperf.ttft_p99_ms, 0.0, mlperf.tpot_p99_ms):
                    raise ConfigError(f"{p}.classes[{i}]: an MLPerf rule's classes have ttft a_ms = ttft_p99_ms, "
                                      f"b = 0 and tpot_ms = tpot_p99_ms")
        return cls(name, tuple(classes), texts["reference_profile"], texts["source"], texts["note"], mlperf,
                   where)


# --------------------------------------------------------------------------------- loading
def _data_dir():
    return resources.files("tokenbatch_env") / "data" / "slo_rules"


def list_slo_rules() -> list[str]:
    """The shipped presets' names."""
    return sorted(p.name[:-5] for p in _data_dir().iterdir() if p.name.endswith(".json"))


def load_slo_rule(name_or_path: Union[str, Path]) -> SloRule:
    """A shipped preset by name, or a JSON file by path (a ``.json`` name or one with a ``/``)."""
    s = str(name_or_path)
    if isinstance(name_or_path, Path) or s.endswith(".json") or "/" in s:
        path = Path(s)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"SLO rule file {s}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"SLO rule file {s}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        return _parse_text(text, s)
    return _load_preset(s)


@lru_cache(maxsize=None)
def _load_preset(name: str) -> SloRule:
    res = _data_dir() / f"{name}.json"
    if not res.is_file():
        raise ConfigError(f"unknown SLO rule {name!r}; valid: {', '.join(list_slo_rules())} or a .json file")
    return _parse_text(res.read_text(encoding="utf-8"), f"SLO rule {name!r}")


def _parse_text(text: str, where: str) -> SloRule:
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where}: invalid JSON: {e}") from None
    return SloRule.from_dict(d, where)


# --------------------------------------------------------------------------------- applying
def ttft_idle_ns(prompt_tokens, profile) -> np.ndarray:
    """Idle-engine TTFT (int64 ns) of each prompt on ``profile`` (a Profile or a profile name)."""
    if isinstance(profile, str):
        from ..engine.profiles import load_profile

        profile = load_profile(profile)
    return profile.cost.idle_prefill_ns(np.asarray(prompt_tokens, np.int64),
                                        profile.max_num_batched_tokens)


def draw_shares(rng: np.random.Generator, n: int, shares) -> np.ndarray:
    """n class ids drawn with ``shares`` (one uniform per request; normalized by their total)."""
    w = np.array(shares, float)
    cdf = np.cumsum(w)
    return np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"),
                      len(w) - 1).astype(np.int64)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed: must be an integer >= 0, got {seed!r}")
    return int(seed)


def _where(rule: SloRule) -> str:
    return rule.where or f"SLO rule {rule.name!r}"


def class_ids(trace: Trace, rule: SloRule, seed: int = 0) -> np.ndarray:
    """Each request's class under ``rule``: drawn by shares from ``seed``, or the first class whose
    predicate holds (errors name the rule, the class and the request)."""
    n = len(trace)
    if rule.by_shares:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([_check_seed(seed), STREAM_CLASSES])))
        return draw_shares(rng, n, [c.share for c in rule.classes])
    cols = {}
    for k, c in enumerate(rule.classes):
        for col in sorted(c.when.columns()):
            lacks = ("SLOs" if col in ("ttft_slo_ns", "tpot_slo_ns") and not trace.has_slos else
                     "priority column" if col == "priority" and not trace.has_priority else None)
            if lacks:
                raise ConfigError(f"{_where(rule)}: rule.classes[{k}].when: column {col!r} is missing from trace "
                                  f"{trace.name!r} (it has no {lacks})")
            cols[col] = getattr(trace, col)
    cid = np.full(n, -1, np.int64)
    for k, c in enumerate(rule.classes):
        free = cid < 0
        if not free.any():
            break
        cid[free & c.when.mask(cols, n)] = k
    miss = np.flatnonzero(cid < 0)
    if miss.size:
        i = int(miss[0])
        shown = ", ".join(f"{col}={int(getattr(trace, col)[i])}" for col in COLUMNS if col in cols)
        raise ConfigError(f"{_where(rule)}: trace {trace.name!r}: request {i} (0-based; {shown}) matches no class "
                          f"({miss.size} such request(s)); end the rule with a class whose \"when\" is "
                          f"{OTHERWISE!r}")
    return cid


def class_slos(prompt_tokens, class_id, rule: SloRule, reference=None, *,
               trace_name: Optional[str] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ttft_slo_ns, tpot_slo_ns, priority) of requests with these prompts and classes; ``reference``
    (a Profile or name) is the profile of ``idle_prefill_ref``, needed when some class has b > 0."""
    from .windows import scale_ints

    prompt = np.asarray(prompt_tokens, np.int64).reshape(-1)
    cid = np.asarray(class_id, np.int64).reshape(-1)
    t1 = np.zeros(prompt.size, np.int64)
    idle = None
    if rule.needs_profile and prompt.size:
        if reference is None:
            raise ConfigError(f"{_where(rule)}: the rule has no reference_profile and no evaluated profile was "
                              f"given (its T1 = a_ms + b x the idle prefill time on a profile)")
        idle = ttft_idle_ns(prompt, reference)
    for j, c in enumerate(rule.classes):
        m = cid == j
        if m.any():
            t1[m] = c.a_ns + (scale_ints(idle[m], Fraction(repr(float(c.b)))) if c.b > 0 else 0)
    t1 = np.maximum(t1, 1)
    over = np.flatnonzero(t1 > MAX_SLO_NS)
    if over.size:   # (a prompt no engine serves in a day: say so, not a range error on a derived column)
        i = int(over[0])
        c = rule.classes[int(cid[i])]
        a = f"{c.a_ms:g} ms + " if c.a_ms else ""
        msg = (f"request {i} (0-based) has a {int(prompt[i]):,}-token prompt: the SLO rule's TTFT SLO for it "
               f"(class {c.name!r}: {a}{c.b:g} x its idle prefill time, {idle[i] / 1e9:.6g} s) exceeds a day "
               f"({over.size} such request(s)); drop or cap such prompts, lower the class's factor b (an SLA "
               f"spec's ttft_scale), or give the trace its own SLOs")
        raise TraceError(msg if trace_name is None else f"trace {trace_name!r}: {msg}")
    t2 = np.array([c.tpot_ns for c in rule.classes], np.int64)[cid]
    prio = np.array([c.priority for c in rule.classes], np.int64)[cid]
    return t1, t2, prio


def apply_slo_rule(trace: Trace, rule: Union[SloRule, str, Path], *, seed: int = 0, profile=None,
                   explicit: bool = False) -> tuple[Trace, str]:
    """``trace`` with the columns it lacks filled by ``rule``, and one line saying what applied.

    Args:
        trace: the trace; its own SLOs (``has_slos``) and priority (``has_priority``) are kept.
        rule: an ``SloRule``, or a preset name or file for ``load_slo_rule``.
        seed: the class draw's seed (rules by shares).
        profile: the evaluated profile (a Profile or name): the reference when the rule names none.
        explicit: the user named the rule: it sets every column, the trace's own replaced.

    Returns:
        ``(trace, note)``; the SLO columns and ``class_id`` are set together, ``priority`` alone.
    """
    if not isinstance(rule, SloRule):
        rule = load_slo_rule(rule)
    seed = _check_seed(seed)
    fill_slos = explicit or not trace.has_slos
    fill_prio = explicit or not trace.has_priority
    label = f"rule {rule.name}" + (f" (seed {seed})" if rule.by_shares else "")
    if not (fill_slos or fill_prio):
        return trace, f"kept the trace's own SLOs and priority; rule {rule.name} not applied"
    cid = class_ids(trace, rule, seed)
    changes = {}
    if fill_slos:
        reference = rule.reference_profile if rule.reference_profile is not None else profile
        t1, t2, prio = class_slos(trace.prompt_tokens, cid, rule, reference, trace_name=trace.name)
        changes.update(ttft_slo_ns=t1, tpot_slo_ns=t2, class_id=cid)
    else:
        prio = np.array([c.priority for c in rule.classes], np.int64)[cid]
    if fill_prio:
        changes["priority"] = prio
    what = {(True, True): "SLOs and priorities", (True, False): "SLOs", (False, True): "priorities"}[
        (fill_slos, fill_prio)]
    if explicit:
        had = [x for x, h in (("SLOs", trace.has_slos), ("priority", trace.has_priority)) if h]
        note = f"{what} from {label}, given explicitly: " + (
            f"the trace's own {' and '.join(had)} replaced" if had else "the trace has none")
    else:
        kept = [] if fill_slos else ["SLOs"]
        kept += [] if fill_prio else ["priority"]
        note = f"{what} from {label}: the trace has none" + (f"; kept the trace's own {kept[0]}" if kept else "")
    return trace.replace(**changes), note
