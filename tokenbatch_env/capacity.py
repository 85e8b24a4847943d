"""Fluid capacity audit of a batching contract and a workload (docs/design.md section 9).

This is a closed-form, integer-only capacity model of one continuous-batching scheduler serving a
few request classes, with the semantics of ``../shared/seeds/capacity_model_spec.py.txt``: the
same records and field names, the same exact-type validation (a bool is not an int, a float is not
an int, a ``str`` subclass is not a ``str``), the same bounds, the same content ids (SHA-256 of the
record's canonical JSON without its own ``content_id``), the same arithmetic, violation names and
order, decisions and evidence id. A record built here and one built by the spec's code from the
same values get the same ``content_id`` (``tests/test_capacity.py`` checks this against the spec
itself).

It is a *fluid* model: utilizations are rates over capacities (in permille, rounded up), the queue
delay is an M/D/1-like ``iteration * rho / (1 - rho)``, the time to first token adds the slower of
chunked and partitioned prefill for the worst class. It does not run the simulator; the report's
``claim`` says so.

Records are frozen and re-validated where they are used (``audit_batching`` rebuilds both inputs),
so a record altered behind the dataclass's back (``object.__setattr__``) is detected: a changed
field no longer matches its ``content_id`` ("... digest mismatch"), a cleared or re-typed one is
"noncanonical or modified record", a deleted one is "malformed record".

Invalid input raises :class:`CapacityError` (a ``ValueError``). Its ``reason`` is the spec's
message verbatim; the full message adds which field and what is valid, on one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, ClassVar

from .errors import TokenBatchError

__all__ = [
    "CapacityError", "BatchingContract", "SchedulerProfile", "RequestClass", "BatchingWorkload",
    "BatchingReport", "audit_batching", "content_digest", "format_report", "illustrative_fixture",
    "load_contract", "load_workload", "record_to_json", "SCOPE_SIZE", "VIOLATIONS", "WITHIN_BOUND",
    "REJECT", "CLAIM", "SATURATED_QUEUE_DELAY_MS",
]

#: Every record carries a scope of exactly this many distinct identities.
SCOPE_SIZE = 8
#: Violation names, in the order a report lists them.
VIOLATIONS = (
    "admission-control-disabled",
    "active-sequence-capacity",
    "total-utilization",
    "prefill-utilization",
    "decode-utilization",
    "queue-delay",
    "time-to-first-token",
    "time-per-output-token",
    "starvation-bound",
    "kv-capacity",
)
WITHIN_BOUND = "CAPACITY_WITHIN_DECLARED_BOUND"
REJECT = "REJECT_CAPACITY"
CLAIM = "LOCAL_FLUID_CAPACITY_MODEL_NOT_QUEUEING_OR_DEVICE_BENCHMARK"
#: Queue delay reported when total utilization reaches 1000 permille (one day, the ms bound).
SATURATED_QUEUE_DELAY_MS = 86_400_000

_IDENTITY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,127}")
_SHA256_RE = re.compile(r"[a-f0-9]{64}")
_DAY_MS = 86_400_000
_MAX_CLASSES = 64

# The spec's messages (kept verbatim: they are CapacityError.reason).
_E_IDENTITY = "exact bounded identity required"
_E_INTEGER = "bounded non-boolean integer required"
_E_BOOL = "exact boolean required"
_E_SEQUENCE = "bounded tuple or list required"
_E_DUPLICATE = "duplicate identity"
_E_SHA256 = "exact lowercase SHA-256 required"
_E_CONTENT_TYPE = "content digest requires exact string"
_E_NOT_RECORD = "concrete frozen record required"
_E_MALFORMED = "malformed record"
_E_MODIFIED = "noncanonical or modified record"
_E_PREFILL_ZERO = "prefill partition cannot serve one token per iteration"
_E_CHUNK = "prefill chunk exceeds declared per-iteration service"
_E_OUTSIDE_SCOPE = "scheduler or request class outside workload scope"
_E_DUPLICATE_CLASS = "duplicate request class identity"
_E_OTHER_CONTRACT = "workload belongs to another batching contract"


class CapacityError(TokenBatchError, ValueError):
    """Invalid capacity-audit input. ``reason`` is the spec's message; ``where`` names the field
    (``Record.field``, prefixed by a file and JSON path when loaded from JSON); ``detail`` says
    what was given and what is valid."""

    def __init__(self, reason: str, *, where: str = "", detail: str = ""):
        self.reason, self.where, self.detail = reason, where, detail
        text = f"{where}: {reason}" if where else reason
        super().__init__(f"{text} ({detail})" if detail else text)

    def within(self, prefix: str) -> "CapacityError":
        """The same error, located inside ``prefix`` (a file or a JSON path)."""
        where = f"{prefix}: {self.where}" if self.where else prefix
        return CapacityError(self.reason, where=where, detail=self.detail)


# --- exact-type checks -------------------------------------------------------------------------

def _shown(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 48 else text[:45] + "..."
    return f"{text} (a bool)" if type(value) is bool else text


def _check_identity(where: str, value: Any) -> str:
    if type(value) is not str or not _IDENTITY_RE.fullmatch(value):
        raise CapacityError(_E_IDENTITY, where=where, detail=(
            f"got {_shown(value)}; valid: a str of 1-128 characters from A-Z a-z 0-9 _ . : / @ -, "
            f"starting with a letter or digit"))
    return value


def _check_int(where: str, value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CapacityError(_E_INTEGER, where=where,
                            detail=f"got {_shown(value)}; valid: an int in [{lo}, {hi}]")
    return value


def _check_bool(where: str, value: Any) -> bool:
    if type(value) is not bool:
        raise CapacityError(_E_BOOL, where=where,
                            detail=f"got {_shown(value)}; valid: true or false")
    return value


def _check_sequence(where: str, value: Any, lo: int, hi: int, what: str) -> tuple:
    if type(value) not in (tuple, list):
        raise CapacityError(_E_SEQUENCE, where=where,
                            detail=f"got {type(value).__name__}; valid: a list of {what}")
    if not lo <= len(value) <= hi:
        count = f"exactly {lo}" if lo == hi else f"{lo} to {hi}"
        raise CapacityError(_E_INTEGER, where=where,
                            detail=f"its length is {len(value)}; valid: {count} {what}")
    return tuple(value)


def _check_scope(where: str, value: Any) -> tuple:
    scope = _check_sequence(where, value, SCOPE_SIZE, SCOPE_SIZE, "distinct identities")
    for i, item in enumerate(scope):
        _check_identity(f"{where}[{i}]", item)
    if len(set(scope)) != len(scope):
        repeated = sorted({s for s in scope if scope.count(s) > 1})
        raise CapacityError(_E_DUPLICATE, where=where, detail=f"repeated: {', '.join(repeated)}")
    return scope


def _check_sha256(where: str, value: Any) -> str:
    if type(value) is not str or not _SHA256_RE.fullmatch(value):
        raise CapacityError(_E_SHA256, where=where,
                            detail=f"got {_shown(value)}; valid: 64 characters from 0-9 a-f")
    return value


def _ceil_div(numerator: int, denominator: int) -> int:
    _check_int("ceil_div numerator", numerator, 0, 10**30)
    _check_int("ceil_div denominator", denominator, 1, 10**30)
    return -(-numerator // denominator)


def content_digest(value: Any) -> str:
    """SHA-256 hex of canonical JSON: sorted keys, no whitespace, ASCII, no NaN/Infinity."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any) -> Any:
    """JSON form of a field value: records as their dicts, tuples as lists."""
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


# --- records -----------------------------------------------------------------------------------

class _Record:
    """Shared behaviour of the sealed records: validation, sealing, JSON form, re-validation.

    A subclass is a frozen dataclass whose last field is ``content_id: str = ""`` and which
    implements ``_validate`` (field checks in the spec's order, normalising via ``_set``).
    ``__post_init__`` then seals the record: a given non-empty ``content_id`` must equal the
    computed one, an empty one is filled in.
    """

    #: "batching contract" etc., for the digest-mismatch message.
    _KIND: ClassVar[str] = ""
    #: int field -> (lowest, highest)
    _BOUNDS: ClassVar[dict] = {}

    def __post_init__(self) -> None:
        self._validate()
        expected = self._seal()
        if self.content_id and self.content_id != expected:
            raise CapacityError(f"{self._KIND} digest mismatch", where=self._where("content_id"),
                                detail=f"declared {self.content_id!r}, computed {expected!r}")
        self._set("content_id", expected)

    def _validate(self) -> None:  # pragma: no cover - every record overrides it
        raise NotImplementedError

    def _where(self, field: str) -> str:
        return f"{type(self).__name__}.{field}"

    def _set(self, field: str, value: Any) -> None:
        object.__setattr__(self, field, value)

    def _check_bounded_ints(self, names) -> None:
        for name in names:
            lo, hi = self._BOUNDS[name]
            _check_int(self._where(name), getattr(self, name), lo, hi)

    def _seal(self) -> str:
        if type(self.content_id) is not str:
            raise CapacityError(_E_CONTENT_TYPE, where=self._where("content_id"),
                                detail=f"got {_shown(self.content_id)}; valid: a str")
        payload = self.to_dict()
        del payload["content_id"]
        return content_digest(payload)

    def to_dict(self) -> dict:
        """The record's fields by name, nested records as dicts (with their content ids)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def _revalidated(cls, record: Any, where: str):
        """Rebuild ``record`` from its fields and require the rebuild to equal it (tamper check)."""
        if type(record) is not cls:
            raise CapacityError(_E_NOT_RECORD, where=where,
                                detail=f"got {type(record).__name__}; valid: a {cls.__name__}")
        try:
            values = {f.name: getattr(record, f.name) for f in dataclasses.fields(cls)}
            rebuilt = cls(**values)
        except (AttributeError, TypeError) as e:
            raise CapacityError(_E_MALFORMED, where=where, detail=str(e)) from e
        if record != rebuilt or record.content_id != rebuilt.content_id:
            raise CapacityError(_E_MODIFIED, where=where,
                                detail="a field was altered after the record was sealed")
        return rebuilt

    @classmethod
    def _fields_from_dict(cls, data: Any) -> dict:
        if type(data) is not dict:
            raise CapacityError("expected a JSON object", where=cls.__name__,
                                detail=f"got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise CapacityError("unknown field", where=cls.__name__, detail=(
                f"{', '.join(map(repr, unknown))}; valid: {', '.join(names)}"))
        missing = [n for n in names if n != "content_id" and n not in data]
        if missing:
            raise CapacityError("missing field", where=cls.__name__,
                                detail=f"{', '.join(missing)} (only content_id is optional)")
        return dict(data)

    @classmethod
    def from_dict(cls, data: Any):
        """Build a record from its JSON form; ``content_id``, when present, is checked."""
        return cls(**cls._fields_from_dict(data))


@dataclasses.dataclass(frozen=True)
class BatchingContract(_Record):
    """What the operator promises: utilization, latency, starvation and KV-memory bounds."""

    scope: tuple
    max_total_utilization_permille: int
    max_prefill_utilization_permille: int
    max_decode_utilization_permille: int
    max_queue_delay_ms: int
    max_ttft_ms: int
    max_tpot_ms: int
    max_starvation_ms: int
    max_kv_bytes: int
    content_id: str = ""

    _KIND: ClassVar[str] = "batching contract"
    _BOUNDS: ClassVar[dict] = {
        "max_total_utilization_permille": (1, 999),
        "max_prefill_utilization_permille": (1, 999),
        "max_decode_utilization_permille": (1, 999),
        "max_queue_delay_ms": (1, _DAY_MS),
        "max_ttft_ms": (1, _DAY_MS),
        "max_tpot_ms": (1, _DAY_MS),
        "max_starvation_ms": (1, _DAY_MS),
        "max_kv_bytes": (1, 10**18),
    }

    def _validate(self) -> None:
        self._set("scope", _check_scope(self._where("scope"), self.scope))
        self._check_bounded_ints(self._BOUNDS)


@dataclasses.dataclass(frozen=True)
class SchedulerProfile(_Record):
    """The scheduler being audited: token throughput, its prefill/decode split, batch limits."""

    scope: tuple
    scheduler_id: str
    token_capacity_per_second: int
    prefill_share_permille: int
    max_active_sequences: int
    max_prefill_chunk_tokens: int
    iteration_time_ms: int
    max_consecutive_priority_iterations: int
    kv_bytes_per_token: int
    content_id: str = ""

    _KIND: ClassVar[str] = "scheduler profile"
    _BOUNDS: ClassVar[dict] = {
        "token_capacity_per_second": (1, 10**12),
        "prefill_share_permille": (1, 999),
        "max_active_sequences": (1, 1_000_000),
        "max_prefill_chunk_tokens": (1, 10_000_000),
        "iteration_time_ms": (1, _DAY_MS),
        "max_consecutive_priority_iterations": (1, 1_000_000),
        "kv_bytes_per_token": (1, 10**12),
    }

    @property
    def prefill_capacity(self) -> int:
        """Prefill tokens per second (the prefill share of the capacity, rounded down)."""
        return self.token_capacity_per_second * self.prefill_share_permille // 1_000

    @property
    def decode_capacity(self) -> int:
        """Decode tokens per second: the rest of the capacity (at least 1 for a valid profile)."""
        return self.token_capacity_per_second - self.prefill_capacity

    @property
    def prefill_tokens_per_iteration(self) -> int:
        return self.prefill_capacity * self.iteration_time_ms // 1_000

    def _validate(self) -> None:
        self._set("scope", _check_scope(self._where("scope"), self.scope))
        _check_identity(self._where("scheduler_id"), self.scheduler_id)
        self._check_bounded_ints(self._BOUNDS)
        per_iteration = self.prefill_tokens_per_iteration
        if per_iteration < 1:
            raise CapacityError(_E_PREFILL_ZERO, where=self._where("prefill_share_permille"),
                                detail=f"prefill capacity {self.prefill_capacity} tokens/s over "
                                       f"{self.iteration_time_ms} ms rounds down to 0 tokens")
        if self.max_prefill_chunk_tokens > per_iteration:
            raise CapacityError(_E_CHUNK, where=self._where("max_prefill_chunk_tokens"),
                                detail=f"got {self.max_prefill_chunk_tokens}; valid: at most "
                                       f"{per_iteration} tokens per {self.iteration_time_ms} ms "
                                       f"iteration")


@dataclasses.dataclass(frozen=True)
class RequestClass(_Record):
    """One class of traffic: its arrival rate (milli-requests/s), sizes and peak concurrency."""

    scope: tuple
    class_id: str
    priority: int
    arrival_millirps: int
    prompt_tokens: int
    output_tokens: int
    peak_concurrency: int
    content_id: str = ""

    _KIND: ClassVar[str] = "request class"
    _BOUNDS: ClassVar[dict] = {
        "priority": (1, 1_000),
        "arrival_millirps": (1, 10**12),
        "prompt_tokens": (1, 10_000_000),
        "output_tokens": (1, 10_000_000),
        "peak_concurrency": (1, 1_000_000),
    }

    def _validate(self) -> None:
        self._set("scope", _check_scope(self._where("scope"), self.scope))
        _check_identity(self._where("class_id"), self.class_id)
        self._check_bounded_ints(self._BOUNDS)


@dataclasses.dataclass(frozen=True)
class BatchingWorkload(_Record):
    """A scheduler profile and 1-64 request classes, bound to one contract by its content id."""

    scope: tuple
    contract_content_id: str
    scheduler: SchedulerProfile
    request_classes: tuple
    admission_control_enabled: bool
    content_id: str = ""

    _KIND: ClassVar[str] = "batching workload"

    def _validate(self) -> None:
        self._set("scope", _check_scope(self._where("scope"), self.scope))
        _check_sha256(self._where("contract_content_id"), self.contract_content_id)
        scheduler = SchedulerProfile._revalidated(self.scheduler, self._where("scheduler"))
        items = _check_sequence(self._where("request_classes"), self.request_classes, 1,
                                _MAX_CLASSES, "request classes")
        classes = tuple(RequestClass._revalidated(item, f"{self._where('request_classes')}[{i}]")
                        for i, item in enumerate(items))
        outside = [r.class_id for r in classes if r.scope != self.scope]
        if scheduler.scope != self.scope or outside:
            who = [f"scheduler {scheduler.scheduler_id!r}"] if scheduler.scope != self.scope else []
            who += [f"request class {c!r}" for c in outside]
            raise CapacityError(_E_OUTSIDE_SCOPE, where=self._where("scope"),
                                detail=f"{', '.join(who)} has a different scope")
        ids = [r.class_id for r in classes]
        if len(set(ids)) != len(ids):
            repeated = sorted({c for c in ids if ids.count(c) > 1})
            raise CapacityError(_E_DUPLICATE_CLASS, where=self._where("request_classes"),
                                detail=f"class_id repeated: {', '.join(repeated)}")
        _check_bool(self._where("admission_control_enabled"), self.admission_control_enabled)
        self._set("scheduler", scheduler)
        self._set("request_classes", classes)

    @classmethod
    def from_dict(cls, data: Any) -> "BatchingWorkload":
        """Build from JSON: ``scheduler`` is a scheduler-profile object, ``request_classes`` a list
        of request-class objects, each with its own scope (and optional content id)."""
        values = cls._fields_from_dict(data)
        try:
            values["scheduler"] = SchedulerProfile.from_dict(values["scheduler"])
        except CapacityError as e:
            raise e.within("scheduler") from None
        if type(values["request_classes"]) is list:
            classes = []
            for i, item in enumerate(values["request_classes"]):
                try:
                    classes.append(RequestClass.from_dict(item))
                except CapacityError as e:
                    raise e.within(f"request_classes[{i}]") from None
            values["request_classes"] = classes
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class BatchingReport:
    """The audit's result. ``violations`` are names from :data:`VIOLATIONS`, in that order."""

    decision: str
    violations: tuple
    total_utilization_permille: int
    prefill_utilization_permille: int
    decode_utilization_permille: int
    estimated_queue_delay_ms: int
    estimated_worst_ttft_ms: int
    estimated_tpot_ms: int
    declared_starvation_bound_ms: int
    peak_kv_bytes: int
    evidence_id: str
    claim: str = CLAIM

    @property
    def within_bound(self) -> bool:
        return self.decision == WITHIN_BOUND

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


# --- the audit ---------------------------------------------------------------------------------

def audit_batching(contract: BatchingContract, workload: BatchingWorkload) -> BatchingReport:
    """Audit ``workload`` against ``contract`` with the fluid model; no simulator is run.

    Both records are re-validated first (tampering raises :class:`CapacityError`), and the
    workload must name this contract (same scope and ``contract_content_id``).
    """
    contract = BatchingContract._revalidated(contract, "contract")
    workload = BatchingWorkload._revalidated(workload, "workload")
    if workload.scope != contract.scope or workload.contract_content_id != contract.content_id:
        raise CapacityError(_E_OTHER_CONTRACT, where="workload", detail=(
            f"it names contract {workload.contract_content_id[:12]}..., the contract is "
            f"{contract.content_id[:12]}..." if workload.contract_content_id != contract.content_id
            else "its scope differs from the contract's"))
    sched, classes = workload.scheduler, workload.request_classes

    # Demand in milli-tokens per second against capacities in tokens per second: the quotient is
    # utilization in permille, rounded up.
    prefill_capacity, decode_capacity = sched.prefill_capacity, sched.decode_capacity
    prefill_demand = sum(c.arrival_millirps * c.prompt_tokens for c in classes)
    decode_demand = sum(c.arrival_millirps * c.output_tokens for c in classes)
    total_util = _ceil_div(prefill_demand + decode_demand, sched.token_capacity_per_second)
    prefill_util = _ceil_div(prefill_demand, prefill_capacity)
    decode_util = _ceil_div(decode_demand, decode_capacity)

    # Queueing: one iteration scaled by rho / (1 - rho); saturated at or above 1000 permille.
    if total_util >= 1_000:
        queue_delay = SATURATED_QUEUE_DELAY_MS
    else:
        queue_delay = _ceil_div(sched.iteration_time_ms * total_util, 1_000 - total_util)

    # First token: queueing plus the worst class's prefill, bounded below both by whole chunks
    # (one chunk per iteration) and by the prefill partition's token rate.
    def prefill_ms(c: RequestClass) -> int:
        chunks = _ceil_div(c.prompt_tokens, sched.max_prefill_chunk_tokens)
        by_chunks = chunks * sched.iteration_time_ms
        by_rate = _ceil_div(c.prompt_tokens * 1_000, prefill_capacity)
        return max(by_chunks, by_rate)

    worst_ttft = queue_delay + max(prefill_ms(c) for c in classes)
    starvation_bound = (sched.max_consecutive_priority_iterations + 1) * sched.iteration_time_ms
    active = sum(c.peak_concurrency for c in classes)
    tpot = max(sched.iteration_time_ms, _ceil_div(active * 1_000, decode_capacity))
    peak_kv = sum(c.peak_concurrency * (c.prompt_tokens + c.output_tokens) for c in classes) \
        * sched.kv_bytes_per_token

    breached = {
        "admission-control-disabled": not workload.admission_control_enabled,
        "active-sequence-capacity": active > sched.max_active_sequences,
        "total-utilization": total_util > contract.max_total_utilization_permille,
        "prefill-utilization": prefill_util > contract.max_prefill_utilization_permille,
        "decode-utilization": decode_util > contract.max_decode_utilization_permille,
        "queue-delay": queue_delay > contract.max_queue_delay_ms,
        "time-to-first-token": worst_ttft > contract.max_ttft_ms,
        "time-per-output-token": tpot > contract.max_tpot_ms,
        "starvation-bound": starvation_bound > contract.max_starvation_ms,
        "kv-capacity": peak_kv > contract.max_kv_bytes,
    }
    violations = tuple(name for name in VIOLATIONS if breached[name])
    decision = REJECT if violations else WITHIN_BOUND
    evidence_id = content_digest({
        "contract": contract.content_id,
        "workload": workload.content_id,
        "decision": decision,
        "violations": list(violations),
        "utilization": [total_util, prefill_util, decode_util],
        "queue_delay_ms": queue_delay,
        "peak_kv_bytes": peak_kv,
    })
    return BatchingReport(
        decision=decision,
        violations=violations,
        total_utilization_permille=total_util,
        prefill_utilization_permille=prefill_util,
        decode_utilization_permille=decode_util,
        estimated_queue_delay_ms=queue_delay,
        estimated_worst_ttft_ms=worst_ttft,
        estimated_tpot_ms=tpot,
        declared_starvation_bound_ms=starvation_bound,
        peak_kv_bytes=peak_kv,
        evidence_id=evidence_id,
    )


def format_report(report: BatchingReport, contract: BatchingContract,
                  workload: BatchingWorkload) -> str:
    """The readable report: ``key=value`` lines, then the three ids (a ``violations=`` line
    follows the decision when there are any)."""
    lines = [f"decision={report.decision}"]
    if report.violations:
        lines.append(f"violations={','.join(report.violations)}")
    lines += [
        f"utilization_permille={report.total_utilization_permille};"
        f"prefill={report.prefill_utilization_permille};"
        f"decode={report.decode_utilization_permille}",
        f"queue_ms={report.estimated_queue_delay_ms};"
        f"worst_ttft_ms={report.estimated_worst_ttft_ms};"
        f"tpot_ms={report.estimated_tpot_ms}",
        f"peak_kv_bytes={report.peak_kv_bytes}",
        f"declared_starvation_bound_ms={report.declared_starvation_bound_ms}",
        f"{'contract content_id':<22}{contract.content_id}",
        f"{'workload content_id':<22}{workload.content_id}",
        f"{'evidence_id':<22}{report.evidence_id}",
        f"claim={report.claim}",
    ]
    return "\n".join(lines) + "\n"


def illustrative_fixture() -> tuple[BatchingContract, BatchingWorkload]:
    """The spec's illustrative (invented) contract and workload; within bound."""
    scope = ("batching-policy-v1", "traffic-mix-v1", "tokenizer-v3", "model-profile-v7",
             "scheduler-profile-v4", "kv-layout-v2", "latency-slo-v3", "fixture-v1")
    contract = BatchingContract(
        scope=scope, max_total_utilization_permille=800, max_prefill_utilization_permille=700,
        max_decode_utilization_permille=700, max_queue_delay_ms=50, max_ttft_ms=250,
        max_tpot_ms=30, max_starvation_ms=100, max_kv_bytes=10_000_000_000)
    scheduler = SchedulerProfile(
        scope=scope, scheduler_id="chunked-prefill-fair-v4", token_capacity_per_second=40_000,
        prefill_share_permille=600, max_active_sequences=64, max_prefill_chunk_tokens=480,
        iteration_time_ms=20, max_consecutive_priority_iterations=3, kv_bytes_per_token=131_072)
    classes = (
        RequestClass(scope=scope, class_id="interactive-short", priority=1, arrival_millirps=4_000,
                     prompt_tokens=1_000, output_tokens=200, peak_concurrency=24),
        RequestClass(scope=scope, class_id="interactive-long", priority=2, arrival_millirps=500,
                     prompt_tokens=4_000, output_tokens=800, peak_concurrency=8),
    )
    workload = BatchingWorkload(scope=scope, contract_content_id=contract.content_id,
                                scheduler=scheduler, request_classes=classes,
                                admission_control_enabled=True)
    return contract, workload


# --- JSON files --------------------------------------------------------------------------------

def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _read_json(path: str | os.PathLike) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise CapacityError("cannot read file", where=str(path),
                            detail=getattr(e, "strerror", None) or str(e)) from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise CapacityError("invalid JSON", where=str(path), detail=str(e)) from None


def load_contract(path: str | os.PathLike) -> BatchingContract:
    """Read a contract's JSON form (its fields by name; ``content_id`` optional, checked)."""
    data = _read_json(path)
    try:
        return BatchingContract.from_dict(data)
    except CapacityError as e:
        raise e.within(str(path)) from None


def load_workload(path: str | os.PathLike) -> BatchingWorkload:
    """Read a workload's JSON form (scheduler and request classes nested as objects)."""
    data = _read_json(path)
    try:
        return BatchingWorkload.from_dict(data)
    except CapacityError as e:
        raise e.within(str(path)) from None


def record_to_json(record: _Record | BatchingReport) -> str:
    """A record's JSON form (fields in declaration order, two-space indent, trailing newline)."""
    return json.dumps(record.to_dict(), indent=2) + "\n"
