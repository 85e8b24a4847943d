"""Capacity audit (docs/design.md section 9): golden fixture, validation, content ids, violations, CLI.

The spec (../shared/seeds/capacity_model_spec.py.txt) lost its line breaks. ``_reconstruct``
restores them from its token stream, only here, so the spec's own code can be executed and
compared with ours: same content ids, same reports, same error reasons, on hypothesis-drawn
records. The reconstruction is checked to keep every token and to reproduce the spec's printout.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import keyword
import sys
import tokenize
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import shared_path
from tokenbatch_env import cli
from tokenbatch_env.capacity import (
    CLAIM, REJECT, SATURATED_QUEUE_DELAY_MS, SCOPE_SIZE, VIOLATIONS, WITHIN_BOUND,
    BatchingContract, BatchingReport, BatchingWorkload, CapacityError, RequestClass,
    SchedulerProfile, audit_batching, content_digest, format_report, illustrative_fixture,
    load_contract, load_workload, record_to_json,
)
from tokenbatch_env.errors import TokenBatchError

FIXTURES = Path(__file__).parent / "fixtures" / "capacity"
GOLDEN = """\
decision=CAPACITY_WITHIN_DECLARED_BOUND
utilization_permille=180;prefill=250;decode=75
queue_ms=5;worst_ttft_ms=185;tpot_ms=20
peak_kv_bytes=8808038400
declared_starvation_bound_ms=80
contract content_id   ea1d51e1f58b34200ed21dd13b2af015839f4fb74bc68dd79625be99d099e8f7
workload content_id   c0195ea0ebee89324d851b03d56bea70bbf037417ba1710bccb085e2881c79e2
evidence_id           246cc9775c168f411bbb9d086acd2695c0e5425526602981995cd5670b30b6dd
"""
CONTRACT_ID = "ea1d51e1f58b34200ed21dd13b2af015839f4fb74bc68dd79625be99d099e8f7"
WORKLOAD_ID = "c0195ea0ebee89324d851b03d56bea70bbf037417ba1710bccb085e2881c79e2"
EVIDENCE_ID = "246cc9775c168f411bbb9d086acd2695c0e5425526602981995cd5670b30b6dd"
HYP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- reconstructing the spec (test-only) -------------------------------------------------------

_LAYOUT = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
           tokenize.COMMENT)
_COMPOUND = {"if", "elif", "else", "for", "while", "try", "except", "finally", "with", "def",
             "class"}
_ALWAYS_NEW = {"def", "class", "@", "return", "raise", "try", "elif", "except", "finally", "while",
               "with", "assert", "pass", "del", "global", "nonlocal", "break", "continue"}


def _tokens(text: str) -> list:
    return [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in _LAYOUT]


def _ends_expression(tok) -> bool:
    if tok.type == tokenize.NAME and keyword.iskeyword(tok.string):
        return tok.string in ("True", "False", "None")
    return tok.type in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING) or tok.string in ")]}"


def _split_statements(toks: list) -> list:
    """Logical statements; a compound header (up to its block colon) is a statement of its own."""
    stmts, cur, depth, open_ifs = [], [], 0, 0
    for i, t in enumerate(toks):
        s = t.string
        if depth == 0 and cur:
            prev, new = cur[-1], False
            if s in _ALWAYS_NEW:
                new = True
            elif s == "import":  # a second import, unless it completes `from x import`
                new = not (cur[0].string == "from" and all(x.string != "import" for x in cur))
            elif s == "from":  # `raise X from e` continues the raise
                new = cur[0].string not in ("raise", "yield")
            elif s == "if":  # a statement `if` reaches its colon before any `else`
                if _ends_expression(prev):
                    d = 0
                    for u in toks[i + 1:]:
                        d += (u.string in "([{") - (u.string in ")]}")
                        if d == 0 and u.string in (":", "else"):
                            new = u.string == ":"
                            break
                open_ifs += not new
            elif s == "else":
                new = open_ifs == 0
                open_ifs -= not new
            elif s == "for":
                new = True  # comprehensions' `for` sit inside brackets
            elif t.type in (tokenize.NAME, tokenize.NUMBER, tokenize.STRING) and \
                    _ends_expression(prev) and not keyword.iskeyword(s):
                new = not (t.type == tokenize.STRING and prev.type == tokenize.STRING)
            if new:
                stmts.append(cur)
                cur, open_ifs = [], 0
        cur.append(t)
        depth += (s in "([{") - (s in ")]}") if t.type == tokenize.OP else 0
        if t.type == tokenize.OP and s == ":" and depth == 0 and cur[0].string in _COMPOUND:
            stmts.append(cur)
            cur, open_ifs = [], 0
        elif cur[0].string == "@" and depth == 0 and i + 1 < len(toks) and \
                toks[i + 1].string in ("def", "class", "@"):
            stmts.append(cur)
            cur, open_ifs = [], 0
    if cur:
        stmts.append(cur)
    return stmts


def _reconstruct(text: str) -> str:
    """Restore line breaks and indentation of the spec: bodies of if/for/else/try/except hold one
    statement; a ``def f(self`` is a method of the class above; every other def, class, decorator
    and the ``__name__`` guard are top level."""
    lines, level, one_statement_bodies = [], 0, []
    for st_ in _split_statements(_tokens(text)):
        head = st_[0].string
        is_method = head == "def" and len(st_) > 3 and st_[3].string == "self"
        if head in ("@", "class") or (head == "def" and not is_method) or \
                (head == "if" and st_[1].string == "__name__"):
            level, one_statement_bodies = 0, []
        elif is_method:
            level, one_statement_bodies = 1, []
        code = tokenize.untokenize([(x.type, x.string) for x in st_]).strip()
        lines.append("    " * level + code)
        if head == "@":
            continue
        if head in _COMPOUND and st_[-1].string == ":":
            if head not in ("def", "class"):
                one_statement_bodies.append(level)
            level += 1
            continue
        while one_statement_bodies and level == one_statement_bodies[-1] + 1:
            level = one_statement_bodies.pop()
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    text = shared_path("seeds", "capacity_model_spec.py.txt").read_text(encoding="utf-8")
    source = _reconstruct(text)
    assert [(t.type, t.string) for t in _tokens(source)] == \
        [(t.type, t.string) for t in _tokens(text)], "reconstruction lost or changed tokens"
    path = tmp_path_factory.mktemp("spec") / "capacity_spec_reconstructed.py"
    path.write_text(source, encoding="utf-8")
    name = "_tokenbatch_capacity_spec"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def _spec_records(spec, contract: BatchingContract, workload: BatchingWorkload):
    """The same records built by the spec's classes."""
    def fields_of(r):
        return {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "content_id"}
    s_contract = spec.BatchingContract(**fields_of(contract))
    values = fields_of(workload)
    values["scheduler"] = spec.SchedulerProfile(**fields_of(workload.scheduler))
    values["request_classes"] = tuple(spec.RequestClass(**fields_of(c))
                                      for c in workload.request_classes)
    return s_contract, spec.BatchingWorkload(**values)


def _outcome(build, ours: bool):
    """("ok", content_id) or ("error", reason); our errors must be CapacityError."""
    try:
        record = build()
    except ValueError as e:
        if ours:
            assert isinstance(e, CapacityError), repr(e)
            assert "\n" not in str(e)
            return ("error", e.reason)
        return ("error", str(e))
    return ("ok", record.content_id)


# --- the golden fixture ------------------------------------------------------------------------

def test_golden_illustrative_fixture():
    contract, workload = illustrative_fixture()
    report = audit_batching(contract, workload)
    assert format_report(report, contract, workload) == GOLDEN + f"claim={CLAIM}\n"
    assert (contract.content_id, workload.content_id, report.evidence_id) == \
        (CONTRACT_ID, WORKLOAD_ID, EVIDENCE_ID)
    assert report.decision == WITHIN_BOUND and report.within_bound and report.violations == ()
    assert report.claim == CLAIM


def test_spec_reconstruction_reproduces_its_own_printout(spec):
    out = io.StringIO()
    with redirect_stdout(out):
        spec.main()
    assert out.getvalue() == (
        "example=illustrative_only\n" + "".join(GOLDEN.splitlines(True)[:4])
        + f"claim={CLAIM}\n")


def test_spec_and_ours_agree_on_the_illustrative_fixture(spec):
    s_contract, s_workload = spec.illustrative_fixture()
    contract, workload = illustrative_fixture()
    assert (s_contract.content_id, s_workload.content_id) == (CONTRACT_ID, WORKLOAD_ID)
    assert s_workload.scheduler.content_id == workload.scheduler.content_id
    assert [c.content_id for c in s_workload.request_classes] == \
        [c.content_id for c in workload.request_classes]
    assert dataclasses.asdict(spec.audit_batching(s_contract, s_workload)) == \
        dataclasses.asdict(audit_batching(contract, workload))
    assert [f.name for f in dataclasses.fields(BatchingReport)] == \
        [f.name for f in dataclasses.fields(spec.BatchingReport)]
    for ours, theirs in ((BatchingContract, spec.BatchingContract),
                         (SchedulerProfile, spec.SchedulerProfile),
                         (RequestClass, spec.RequestClass),
                         (BatchingWorkload, spec.BatchingWorkload)):
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]


def test_fixture_files_are_the_illustrative_records():
    contract, workload = illustrative_fixture()
    assert (FIXTURES / "illustrative_contract.json").read_text() == record_to_json(contract)
    assert (FIXTURES / "illustrative_workload.json").read_text() == record_to_json(workload)
    loaded_c = load_contract(FIXTURES / "illustrative_contract.json")
    loaded_w = load_workload(FIXTURES / "illustrative_workload.json")
    assert (loaded_c, loaded_w) == (contract, workload)
    assert (loaded_c.content_id, loaded_w.content_id) == (CONTRACT_ID, WORKLOAD_ID)
    rejected = load_workload(FIXTURES / "admission_disabled_workload.json")
    assert audit_batching(loaded_c, rejected).violations == ("admission-control-disabled",)


def test_content_id_is_sha256_of_canonical_json():
    contract, _ = illustrative_fixture()
    payload = contract.to_dict()
    del payload["content_id"]
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    import hashlib
    assert contract.content_id == hashlib.sha256(canonical.encode()).hexdigest()
    assert content_digest(payload) == contract.content_id
    with pytest.raises(ValueError):
        content_digest({"x": float("nan")})


# --- validation --------------------------------------------------------------------------------

def _contract_kwargs(**changes):
    contract, _ = illustrative_fixture()
    values = {f.name: getattr(contract, f.name) for f in dataclasses.fields(contract)}
    values.pop("content_id")
    values.update(changes)
    return values


def _scheduler_kwargs(**changes):
    _, workload = illustrative_fixture()
    s = workload.scheduler
    values = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    values.pop("content_id")
    values.update(changes)
    return values


def _class_kwargs(i=0, **changes):
    _, workload = illustrative_fixture()
    c = workload.request_classes[i]
    values = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    values.pop("content_id")
    values.update(changes)
    return values


def _workload_kwargs(**changes):
    _, w = illustrative_fixture()
    values = dict(scope=w.scope, contract_content_id=w.contract_content_id, scheduler=w.scheduler,
                  request_classes=w.request_classes,
                  admission_control_enabled=w.admission_control_enabled)
    values.update(changes)
    return values


SCOPE = illustrative_fixture()[0].scope
OTHER_SCOPE = SCOPE[:-1] + ("fixture-v2",)
DAY = 86_400_000
#: The spec's bounds, written out independently of the implementation's tables.
INT_BOUNDS = {
    BatchingContract: {
        "max_total_utilization_permille": (1, 999), "max_prefill_utilization_permille": (1, 999),
        "max_decode_utilization_permille": (1, 999), "max_queue_delay_ms": (1, DAY),
        "max_ttft_ms": (1, DAY), "max_tpot_ms": (1, DAY), "max_starvation_ms": (1, DAY),
        "max_kv_bytes": (1, 10**18)},
    SchedulerProfile: {
        "token_capacity_per_second": (1, 10**12), "prefill_share_permille": (1, 999),
        "max_active_sequences": (1, 1_000_000), "max_prefill_chunk_tokens": (1, 10_000_000),
        "iteration_time_ms": (1, DAY), "max_consecutive_priority_iterations": (1, 1_000_000),
        "kv_bytes_per_token": (1, 10**12)},
    RequestClass: {
        "priority": (1, 1_000), "arrival_millirps": (1, 10**12), "prompt_tokens": (1, 10_000_000),
        "output_tokens": (1, 10_000_000), "peak_concurrency": (1, 1_000_000)},
}
KWARGS = {BatchingContract: _contract_kwargs, SchedulerProfile: _scheduler_kwargs,
          RequestClass: _class_kwargs}
_INT = "bounded non-boolean integer required"


def _int_cases():
    for cls, bounds in INT_BOUNDS.items():
        for name, (lo, hi) in bounds.items():
            for bad in (True, False, float(lo), 1.5, str(lo), None, lo - 1, hi + 1):
                yield pytest.param(cls, name, bad, id=f"{cls.__name__}.{name}={bad!r}")


@pytest.mark.parametrize("cls, name, bad", list(_int_cases()))
def test_integer_fields_are_exact_and_bounded(cls, name, bad):
    with pytest.raises(CapacityError) as info:
        cls(**KWARGS[cls](**{name: bad}))
    assert info.value.reason == _INT
    assert info.value.where == f"{cls.__name__}.{name}"
    lo, hi = INT_BOUNDS[cls][name]
    assert f"[{lo}, {hi}]" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("cls", [BatchingContract, SchedulerProfile, RequestClass])
def test_integer_bounds_are_inclusive(cls):
    # A roomy scheduler (5e11 prefill tokens per iteration, chunk 1), so an extreme value of one
    # field meets the chunk rule whenever it can; when it cannot, the integer check must still
    # have passed (the error is the prefill rule, not the bound).
    roomy = dict(token_capacity_per_second=10**12, prefill_share_permille=500,
                 iteration_time_ms=1_000, max_prefill_chunk_tokens=1) if cls is SchedulerProfile else {}
    for name, (lo, hi) in INT_BOUNDS[cls].items():
        for good in (lo, hi):
            try:
                cls(**KWARGS[cls](**{**roomy, name: good}))
            except CapacityError as e:
                assert cls is SchedulerProfile and e.reason != _INT, (name, good, e)
    int_fields = {f.name for f in dataclasses.fields(cls)} - {"scope", "content_id",
                                                              "scheduler_id", "class_id"}
    assert set(INT_BOUNDS[cls]) == int_fields


class _Str(str):
    pass


BAD_IDENTITIES = ["", "-leading-dash", "has space", "x" * 129, "ünïcode", "tab\t", 7, None,
                  _Str("subclass"), b"bytes"]


@pytest.mark.parametrize("bad", BAD_IDENTITIES, ids=repr)
@pytest.mark.parametrize("cls, field", [(SchedulerProfile, "scheduler_id"),
                                        (RequestClass, "class_id")])
def test_identities(cls, field, bad):
    with pytest.raises(CapacityError, match="exact bounded identity required") as info:
        cls(**KWARGS[cls](**{field: bad}))
    assert info.value.reason == "exact bounded identity required"


def test_identity_accepts_the_whole_alphabet_and_128_chars():
    RequestClass(**_class_kwargs(class_id="A0_.:/@-z" + "9" * 119))  # 128 characters


@pytest.mark.parametrize("bad, reason", [
    ("abcdefgh", "bounded tuple or list required"),
    (set(SCOPE), "bounded tuple or list required"),
    (iter(SCOPE), "bounded tuple or list required"),
    (SCOPE[:7], _INT),
    (SCOPE + ("ninth",), _INT),
    ((), _INT),
    (SCOPE[:7] + (SCOPE[0],), "duplicate identity"),
    (SCOPE[:7] + ("bad id",), "exact bounded identity required"),
    (SCOPE[:7] + (8,), "exact bounded identity required"),
], ids=["str", "set", "iterator", "seven", "nine", "empty", "duplicate", "bad-item", "int-item"])
@pytest.mark.parametrize("cls", [BatchingContract, SchedulerProfile, RequestClass])
def test_scope_is_eight_distinct_identities(cls, bad, reason):
    with pytest.raises(CapacityError) as info:
        cls(**KWARGS[cls](scope=bad))
    assert info.value.reason == reason
    assert info.value.where.startswith(f"{cls.__name__}.scope")


def test_scope_list_is_normalised_to_tuple():
    contract = BatchingContract(**_contract_kwargs(scope=list(SCOPE)))
    assert contract.scope == SCOPE and type(contract.scope) is tuple
    assert contract.content_id == CONTRACT_ID
    assert SCOPE_SIZE == 8


def test_prefill_partition_must_serve_a_token_per_iteration():
    # 1000 tokens/s * 1 permille = 1 token/s; over 20 ms that rounds down to 0 tokens.
    with pytest.raises(CapacityError) as info:
        SchedulerProfile(**_scheduler_kwargs(token_capacity_per_second=1_000,
                                             prefill_share_permille=1, max_prefill_chunk_tokens=1))
    assert info.value.reason == "prefill partition cannot serve one token per iteration"


def test_prefill_chunk_at_most_the_per_iteration_service():
    # 40000 * 600 / 1000 = 24000 tokens/s; 20 ms -> 480 tokens per iteration.
    assert SchedulerProfile(**_scheduler_kwargs(max_prefill_chunk_tokens=480))
    assert SchedulerProfile(**_scheduler_kwargs()).prefill_tokens_per_iteration == 480
    with pytest.raises(CapacityError) as info:
        SchedulerProfile(**_scheduler_kwargs(max_prefill_chunk_tokens=481))
    assert info.value.reason == "prefill chunk exceeds declared per-iteration service"
    assert "at most 480" in str(info.value)


@pytest.mark.parametrize("bad", [None, 0, b"x" * 64, CONTRACT_ID.upper(), CONTRACT_ID[:-1],
                                 CONTRACT_ID + "0", "g" * 64, _Str(CONTRACT_ID)], ids=repr)
def test_contract_content_id_must_be_lowercase_sha256(bad):
    with pytest.raises(CapacityError) as info:
        BatchingWorkload(**_workload_kwargs(contract_content_id=bad))
    assert info.value.reason == "exact lowercase SHA-256 required"


@pytest.mark.parametrize("bad", [1, 0, "true", None, 1.0], ids=repr)
def test_admission_control_is_an_exact_bool(bad):
    with pytest.raises(CapacityError) as info:
        BatchingWorkload(**_workload_kwargs(admission_control_enabled=bad))
    assert info.value.reason == "exact boolean required"


def test_workload_nested_records_must_be_records(spec):
    sched = SchedulerProfile(**_scheduler_kwargs())
    classes = illustrative_fixture()[1].request_classes
    for changes in ({"scheduler": _scheduler_kwargs()},
                    {"scheduler": spec.SchedulerProfile(**_scheduler_kwargs())},
                    {"scheduler": classes[0]},
                    {"request_classes": (classes[0], _class_kwargs(1))},
                    {"request_classes": (sched,)}):
        with pytest.raises(CapacityError) as info:
            BatchingWorkload(**_workload_kwargs(**changes))
        assert info.value.reason == "concrete frozen record required"


class _Contract(BatchingContract):
    pass


def test_subclass_is_not_a_record():
    with pytest.raises(CapacityError, match="concrete frozen record required"):
        audit_batching(_Contract(**_contract_kwargs()), illustrative_fixture()[1])


@pytest.mark.parametrize("bad, reason", [
    ((), _INT),
    (tuple(RequestClass(**_class_kwargs(class_id=f"c{i}")) for i in range(65)), _INT),
    ({"a": 1}, "bounded tuple or list required"),
    (None, "bounded tuple or list required"),
], ids=["none", "sixty-five", "dict", "None"])
def test_request_classes_count(bad, reason):
    with pytest.raises(CapacityError) as info:
        BatchingWorkload(**_workload_kwargs(request_classes=bad))
    assert info.value.reason == reason


def test_request_classes_up_to_64():
    classes = tuple(RequestClass(**_class_kwargs(class_id=f"c{i}", arrival_millirps=1))
                    for i in range(64))
    assert len(BatchingWorkload(**_workload_kwargs(request_classes=classes)).request_classes) == 64


def test_duplicate_class_ids():
    a = RequestClass(**_class_kwargs(0))
    b = RequestClass(**_class_kwargs(1, class_id=a.class_id))
    with pytest.raises(CapacityError) as info:
        BatchingWorkload(**_workload_kwargs(request_classes=(a, b)))
    assert info.value.reason == "duplicate request class identity"
    assert "interactive-short" in str(info.value)


@pytest.mark.parametrize("where", ["scheduler", "class"])
def test_scope_mismatch_inside_workload(where):
    changes = ({"scheduler": SchedulerProfile(**_scheduler_kwargs(scope=OTHER_SCOPE))}
               if where == "scheduler" else
               {"request_classes": (RequestClass(**_class_kwargs(0)),
                                    RequestClass(**_class_kwargs(1, scope=OTHER_SCOPE)))})
    with pytest.raises(CapacityError) as info:
        BatchingWorkload(**_workload_kwargs(**changes))
    assert info.value.reason == "scheduler or request class outside workload scope"


def test_workload_must_name_its_contract():
    contract, workload = illustrative_fixture()
    other = BatchingContract(**_contract_kwargs(max_ttft_ms=251))
    with pytest.raises(CapacityError) as info:
        audit_batching(other, workload)
    assert info.value.reason == "workload belongs to another batching contract"
    # same contract id but a workload in another scope
    elsewhere = BatchingWorkload(**_workload_kwargs(
        scope=OTHER_SCOPE, scheduler=SchedulerProfile(**_scheduler_kwargs(scope=OTHER_SCOPE)),
        request_classes=(RequestClass(**_class_kwargs(scope=OTHER_SCOPE)),)))
    with pytest.raises(CapacityError) as info:
        audit_batching(contract, elsewhere)
    assert info.value.reason == "workload belongs to another batching contract"


@pytest.mark.parametrize("cls, kind", [(BatchingContract, "batching contract"),
                                       (SchedulerProfile, "scheduler profile"),
                                       (RequestClass, "request class"),
                                       (BatchingWorkload, "batching workload")])
def test_declared_content_id_is_checked(cls, kind):
    kwargs = _workload_kwargs() if cls is BatchingWorkload else KWARGS[cls]()
    good = cls(**kwargs).content_id
    assert cls(**kwargs, content_id=good).content_id == good
    for bad in ("0" * 64, good.upper(), "not-a-digest"):
        with pytest.raises(CapacityError) as info:
            cls(**kwargs, content_id=bad)
        assert info.value.reason == f"{kind} digest mismatch"
    for bad in (None, 0, b"", _Str(good)):
        with pytest.raises(CapacityError) as info:
            cls(**kwargs, content_id=bad)
        assert info.value.reason == "content digest requires exact string"


def test_error_is_a_project_error_and_a_value_error():
    with pytest.raises(CapacityError) as info:
        BatchingContract(**_contract_kwargs(max_ttft_ms=0))
    assert isinstance(info.value, TokenBatchError) and isinstance(info.value, ValueError)
    assert str(info.value) == ("BatchingContract.max_ttft_ms: bounded non-boolean integer required "
                               "(got 0; valid: an int in [1, 86400000])")


# --- tampering ---------------------------------------------------------------------------------

def _tamper_set(attr, value):
    def op(record):
        object.__setattr__(record, attr, value(record) if callable(value) else value)
    return op


def _tamper_nested(attr, value):
    def op(workload):
        object.__setattr__(workload.scheduler, attr, value)
    return op


def _tamper_delete(attr):
    def op(record):
        object.__delattr__(record, attr)
    return op


TAMPERS = {
    "contract-field": ("contract", _tamper_set("max_ttft_ms", 10**6),
                       "batching contract digest mismatch"),
    "contract-cleared-id": ("contract", _tamper_set("content_id", ""),
                            "noncanonical or modified record"),
    "contract-other-id": ("contract", _tamper_set("content_id", "0" * 64),
                          "batching contract digest mismatch"),
    "contract-id-not-str": ("contract", _tamper_set("content_id", None),
                            "content digest requires exact string"),
    "contract-scope-list": ("contract", _tamper_set("scope", lambda r: list(r.scope)),
                            "noncanonical or modified record"),
    "contract-bool-field": ("contract", _tamper_set("max_tpot_ms", True), _INT),
    "contract-deleted": ("contract", _tamper_delete("max_kv_bytes"), "malformed record"),
    "workload-field": ("workload", _tamper_set("admission_control_enabled", False),
                       "batching workload digest mismatch"),
    "workload-classes-list": ("workload", _tamper_set("request_classes",
                                                      lambda r: list(r.request_classes)),
                              "noncanonical or modified record"),
    "workload-nested-scheduler": ("workload", _tamper_nested("iteration_time_ms", 40),
                                  "scheduler profile digest mismatch"),
    "workload-deleted": ("workload", _tamper_delete("scheduler"), "malformed record"),
}


@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampering_is_detected_like_the_spec(spec, name):
    target, op, reason = TAMPERS[name]
    reasons = []
    for module in (None, spec):
        contract, workload = (module or sys.modules[__name__]).illustrative_fixture()
        op(contract if target == "contract" else workload)
        with pytest.raises(ValueError) as info:
            (module.audit_batching if module else audit_batching)(contract, workload)
        if module is None:
            assert isinstance(info.value, CapacityError)
        reasons.append(getattr(info.value, "reason", str(info.value)))
    assert reasons == [reason, reason]


def test_records_are_frozen():
    contract, _ = illustrative_fixture()
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.max_ttft_ms = 1


# --- differential against the spec (hypothesis) ------------------------------------------------

IDENT = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,10}", fullmatch=True)
BAD = st.one_of(st.booleans(), st.floats(allow_nan=False), st.text(max_size=4), st.none(),
                st.integers(min_value=-3, max_value=10**19), st.lists(st.integers(), max_size=2),
                st.just(_Str("x")))
POOL_SCOPE = st.sampled_from([SCOPE, OTHER_SCOPE])
RARELY = st.sampled_from([False] * 7 + [True])  # shrinks to False; integers(0, n) == 0 over-fires


def _valid_ints(bounds: dict) -> dict:
    """In-range ints, often exactly at a bound."""
    return {name: st.one_of(st.sampled_from([lo, hi]), st.integers(lo, hi))
            for name, (lo, hi) in bounds.items()}


@st.composite
def scheduler_kwargs(draw, scope=POOL_SCOPE):
    values = {"scope": draw(scope), "scheduler_id": draw(IDENT)}
    values.update({n: draw(s) for n, s in _valid_ints(INT_BOUNDS[SchedulerProfile]).items()})
    values["token_capacity_per_second"] = draw(st.one_of(st.integers(1, 10**12),
                                                         st.integers(1, 100_000)))
    values["iteration_time_ms"] = draw(st.one_of(st.integers(1, 200), st.integers(1, 86_400_000)))
    per_iteration = (values["token_capacity_per_second"] * values["prefill_share_permille"]
                     // 1000 * values["iteration_time_ms"] // 1000)
    if per_iteration >= 1 and not draw(RARELY):
        values["max_prefill_chunk_tokens"] = draw(st.integers(1, min(per_iteration, 10_000_000)))
    return values


@st.composite
def class_kwargs(draw, scope=POOL_SCOPE, class_id=IDENT):
    values = {"scope": draw(scope), "class_id": draw(class_id)}
    values.update({n: draw(s) for n, s in _valid_ints(INT_BOUNDS[RequestClass]).items()})
    values["arrival_millirps"] = draw(st.one_of(st.integers(1, 10**12), st.integers(1, 20_000)))
    values["prompt_tokens"] = draw(st.one_of(st.integers(1, 10**7), st.integers(1, 5_000)))
    values["output_tokens"] = draw(st.one_of(st.integers(1, 10**7), st.integers(1, 2_000)))
    values["peak_concurrency"] = draw(st.one_of(st.integers(1, 10**6), st.integers(1, 64)))
    return values


@st.composite
def contract_kwargs(draw, scope=POOL_SCOPE):
    values = {"scope": draw(scope)}
    values.update({n: draw(s) for n, s in _valid_ints(INT_BOUNDS[BatchingContract]).items()})
    return values


@st.composite
def corrupted(draw, base):
    """``base`` kwargs, sometimes with one field replaced by an arbitrary (usually bad) value."""
    values = draw(base)
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(values)))
        values[name] = draw(BAD if name != "scope" else st.one_of(
            BAD, st.lists(IDENT, min_size=7, max_size=9)))
    if draw(RARELY):
        values["content_id"] = draw(st.one_of(BAD, st.just("0" * 64)))
    return values


@HYP
@given(st.data())
def test_records_match_the_spec(spec, data):
    cls_name = data.draw(st.sampled_from(["BatchingContract", "SchedulerProfile", "RequestClass"]))
    base = {"BatchingContract": contract_kwargs(), "SchedulerProfile": scheduler_kwargs(),
            "RequestClass": class_kwargs()}[cls_name]
    values = data.draw(corrupted(base))
    ours = _outcome(lambda: globals()[cls_name](**values), True)
    theirs = _outcome(lambda: getattr(spec, cls_name)(**values), False)
    assert ours == theirs
    if ours[0] == "ok":  # a declared correct id is accepted by both
        assert _outcome(lambda: globals()[cls_name](**{**values, "content_id": ours[1]}), True) == ours


@st.composite
def realistic_scheduler(draw, scope):
    values = draw(scheduler_kwargs(scope=scope))
    values.update(token_capacity_per_second=draw(st.integers(20_000, 200_000)),
                  prefill_share_permille=draw(st.integers(100, 900)),
                  iteration_time_ms=draw(st.integers(5, 100)),
                  max_active_sequences=draw(st.integers(1, 256)),
                  max_consecutive_priority_iterations=draw(st.integers(1, 10)),
                  kv_bytes_per_token=draw(st.integers(1, 10**6)))
    per_iteration = (values["token_capacity_per_second"] * values["prefill_share_permille"]
                     // 1000 * values["iteration_time_ms"] // 1000)
    values["max_prefill_chunk_tokens"] = draw(st.integers(1, per_iteration))
    return values


@st.composite
def realistic_class(draw, scope, class_id):
    return {**draw(class_kwargs(scope=scope, class_id=class_id)),
            "arrival_millirps": draw(st.integers(1, 2_000)),
            "prompt_tokens": draw(st.integers(1, 4_000)), "output_tokens": draw(st.integers(1, 1_000)),
            "peak_concurrency": draw(st.integers(1, 32))}


@st.composite
def realistic_contract(draw, scope):
    return {**draw(contract_kwargs(scope=scope)),
            **{n: draw(st.integers(300, 999)) for n in INT_BOUNDS[BatchingContract]
               if "permille" in n},
            **{n: draw(st.integers(50, 20_000)) for n in INT_BOUNDS[BatchingContract]
               if n.endswith("_ms")},
            "max_kv_bytes": draw(st.integers(10**9, 10**13))}


@st.composite
def workload_case(draw):
    """Mostly realistic, valid workloads (both decisions occur); sometimes wide ranges, another
    scope, repeated class ids or a non-bool admission flag."""
    scope = draw(st.sampled_from([SCOPE, OTHER_SCOPE]))
    wide, other_scope, repeated_ids, bad_flag = (draw(RARELY) for _ in range(4))
    near = POOL_SCOPE if other_scope else st.just(scope)
    ids = st.sampled_from("abc") if repeated_ids else st.uuids().map(str)
    sched = draw(scheduler_kwargs(scope=near) if wide else realistic_scheduler(near))
    classes = draw(st.lists(class_kwargs(scope=near, class_id=ids) if wide
                            else realistic_class(near, ids), min_size=1, max_size=4))
    contract = draw(contract_kwargs(st.just(scope)) if wide else realistic_contract(st.just(scope)))
    admission = draw(BAD) if bad_flag else not draw(RARELY)
    return scope, contract, sched, classes, admission


def _build_case(module, case, ours):
    scope, contract_kw, sched_kw, classes_kw, admission = case
    contract = module.BatchingContract(**contract_kw)
    workload = module.BatchingWorkload(
        scope=scope, contract_content_id=contract.content_id,
        scheduler=module.SchedulerProfile(**sched_kw),
        request_classes=tuple(module.RequestClass(**c) for c in classes_kw),
        admission_control_enabled=admission)
    return contract, workload


@HYP
@given(workload_case())
def test_workloads_and_audits_match_the_spec(spec, case):
    import tokenbatch_env.capacity as ours_module
    results = []
    for module, ours in ((ours_module, True), (spec, False)):
        def run(module=module, ours=ours):
            contract, workload = _build_case(module, case, ours)
            report = module.audit_batching(contract, workload)
            return (workload.content_id, dataclasses.asdict(report))
        try:
            results.append(("ok", run()))
        except ValueError as e:
            if ours:
                assert isinstance(e, CapacityError)
            results.append(("error", e.reason if ours else str(e)))
    assert results[0] == results[1]


# --- content ids -------------------------------------------------------------------------------

def _replace_one(data, values: dict, cls, valid: dict) -> tuple[str, object]:
    name = data.draw(st.sampled_from(sorted(valid)))
    new = data.draw(valid[name].filter(lambda v: v != values[name]))
    return name, new


@HYP
@given(st.data())
def test_content_id_stable_and_changed_by_any_field(data):
    cls = data.draw(st.sampled_from([BatchingContract, SchedulerProfile, RequestClass]))
    base = {BatchingContract: contract_kwargs(), SchedulerProfile: scheduler_kwargs(),
            RequestClass: class_kwargs()}[cls]
    values = data.draw(base)
    try:
        record = cls(**values)
    except CapacityError:
        assume(False)
    assert cls(**values).content_id == record.content_id  # stable
    assert cls.from_dict(json.loads(record_to_json(record))) == record  # JSON round trip
    valid = {"scope": st.lists(IDENT, min_size=8, max_size=8, unique=True).map(tuple),
             **_valid_ints(INT_BOUNDS[cls])}
    valid.update({n: IDENT for n in ("scheduler_id", "class_id") if n in values})
    name, new = _replace_one(data, values, cls, valid)
    try:
        changed = cls(**{**values, name: new})
    except CapacityError:
        assume(False)
    assert changed.content_id != record.content_id


def test_workload_content_id_covers_nested_records_and_order():
    contract, w = illustrative_fixture()
    a, b = w.request_classes
    variants = {
        "same": BatchingWorkload(**_workload_kwargs()),
        "order": BatchingWorkload(**_workload_kwargs(request_classes=(b, a))),
        "one": BatchingWorkload(**_workload_kwargs(request_classes=(a,))),
        "admission": BatchingWorkload(**_workload_kwargs(admission_control_enabled=False)),
        "sched": BatchingWorkload(**_workload_kwargs(
            scheduler=SchedulerProfile(**_scheduler_kwargs(kv_bytes_per_token=131_073)))),
        "class": BatchingWorkload(**_workload_kwargs(
            request_classes=(a, RequestClass(**_class_kwargs(1, priority=3))))),
        "contract": BatchingWorkload(**_workload_kwargs(contract_content_id="0" * 64)),
    }
    ids = {k: v.content_id for k, v in variants.items()}
    assert ids["same"] == WORKLOAD_ID
    assert len(set(ids.values())) == len(ids)
    assert BatchingWorkload.from_dict(json.loads(record_to_json(w))) == w


# --- violations --------------------------------------------------------------------------------

# Each tightens one bound of the illustrative fixture to one below its measured value (or turns
# admission control off), so exactly that violation fires.
ONE_VIOLATION = {
    "admission-control-disabled": ({}, {"admission_control_enabled": False}),
    "active-sequence-capacity": ({}, {"scheduler": "max_active_sequences=31"}),
    "total-utilization": ({"max_total_utilization_permille": 179}, {}),
    "prefill-utilization": ({"max_prefill_utilization_permille": 249}, {}),
    "decode-utilization": ({"max_decode_utilization_permille": 74}, {}),
    "queue-delay": ({"max_queue_delay_ms": 4}, {}),
    "time-to-first-token": ({"max_ttft_ms": 184}, {}),
    "time-per-output-token": ({"max_tpot_ms": 19}, {}),
    "starvation-bound": ({"max_starvation_ms": 79}, {}),
    "kv-capacity": ({"max_kv_bytes": 8_808_038_399}, {}),
}


def _audit_with(contract_changes: dict, workload_changes: dict):
    contract = BatchingContract(**_contract_kwargs(**contract_changes))
    changes = dict(workload_changes)
    if "scheduler" in changes:
        field, value = changes.pop("scheduler").split("=")
        changes["scheduler"] = SchedulerProfile(**_scheduler_kwargs(**{field: int(value)}))
    workload = BatchingWorkload(**_workload_kwargs(contract_content_id=contract.content_id,
                                                   **changes))
    return audit_batching(contract, workload)


def test_violation_names_are_the_spec_order():
    assert list(ONE_VIOLATION) == list(VIOLATIONS)


@pytest.mark.parametrize("name", VIOLATIONS)
def test_each_violation_alone(name):
    report = _audit_with(*ONE_VIOLATION[name])
    assert report.violations == (name,)
    assert report.decision == REJECT and not report.within_bound


@pytest.mark.parametrize("name", [n for n in VIOLATIONS if ONE_VIOLATION[n][0]])
def test_bounds_are_inclusive(name):
    (field, value), = ONE_VIOLATION[name][0].items()
    assert _audit_with({field: value + 1}, {}).decision == WITHIN_BOUND


@HYP
@given(st.sets(st.sampled_from(VIOLATIONS), min_size=1))
def test_several_violations_keep_the_spec_order(names):
    contract_changes, workload_changes = {}, {}
    for name in names:
        contract_changes.update(ONE_VIOLATION[name][0])
        workload_changes.update(ONE_VIOLATION[name][1])
    report = _audit_with(contract_changes, workload_changes)
    assert report.violations == tuple(n for n in VIOLATIONS if n in names)


def test_evidence_id_covers_decision_and_violations():
    ids = {_audit_with(*ONE_VIOLATION[n]).evidence_id for n in VIOLATIONS}
    assert len(ids) == len(VIOLATIONS) and EVIDENCE_ID not in ids


def test_saturated_queue():
    # 10 req/s * 6000 tokens = 60000 tokens/s > 40000: utilization 1500 permille.
    report = _audit_with({}, {"request_classes": (RequestClass(**_class_kwargs(
        0, arrival_millirps=10_000, prompt_tokens=5_000, output_tokens=1_000)),)})
    assert report.total_utilization_permille == 1500
    assert report.estimated_queue_delay_ms == SATURATED_QUEUE_DELAY_MS
    assert report.violations[:1] == ("total-utilization",)
    assert "queue-delay" in report.violations and "time-to-first-token" in report.violations


def test_saturated_at_exactly_1000_permille():
    # 10 req/s * 4000 tokens = 40000 tokens/s = the whole capacity.
    report = _audit_with({}, {"request_classes": (RequestClass(**_class_kwargs(
        0, arrival_millirps=10_000, prompt_tokens=3_000, output_tokens=1_000)),)})
    assert report.total_utilization_permille == 1000
    assert report.estimated_queue_delay_ms == SATURATED_QUEUE_DELAY_MS
    # one permille below saturation: 999 -> ceil(20 * 999 / 1) ms
    report = _audit_with({}, {"request_classes": (RequestClass(**_class_kwargs(
        0, arrival_millirps=9_990, prompt_tokens=3_000, output_tokens=1_000)),)})
    assert report.total_utilization_permille == 999
    assert report.estimated_queue_delay_ms == 19_980


def test_illustrative_arithmetic_by_hand():
    # demand: 4 rps * 1200 + 0.5 rps * 4800 = 7200 tokens/s of 40000 -> 180 permille
    # prefill: 4*1000 + 0.5*4000 = 6000 of 24000 -> 250; decode: 4*200 + 0.5*800 = 1200 of 16000 -> 75
    # queue: ceil(20 * 180 / 820) = 5; prefill of 4000 tokens: max(ceil(4000/480)*20, 4000/24) = 180
    # tpot: max(20, ceil(32 * 1000 / 16000)) = 20; starvation (3 + 1) * 20 = 80
    # kv: (24 * 1200 + 8 * 4800) * 131072 = 8808038400
    r = audit_batching(*illustrative_fixture())
    assert (r.total_utilization_permille, r.prefill_utilization_permille,
            r.decode_utilization_permille) == (180, 250, 75)
    assert (r.estimated_queue_delay_ms, r.estimated_worst_ttft_ms, r.estimated_tpot_ms,
            r.declared_starvation_bound_ms, r.peak_kv_bytes) == (5, 185, 20, 80, 8_808_038_400)


# --- JSON files and the CLI --------------------------------------------------------------------

def _run(capsys, *argv):
    code = cli.main(["audit", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _write(tmp_path, name, data) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def _fixture_json(name):
    return json.loads((FIXTURES / name).read_text())


CONTRACT_JSON = FIXTURES / "illustrative_contract.json"
WORKLOAD_JSON = FIXTURES / "illustrative_workload.json"


def test_cli_within_bound_text(capsys):
    code, out, err = _run(capsys, CONTRACT_JSON, WORKLOAD_JSON)
    assert code == 0 and err == ""
    assert out == GOLDEN + f"claim={CLAIM}\n"


def test_cli_json_shape(capsys):
    code, out, _ = _run(capsys, CONTRACT_JSON, WORKLOAD_JSON, "--json")
    assert code == 0
    report = json.loads(out)
    assert list(report) == [f.name for f in dataclasses.fields(BatchingReport)]
    assert report["violations"] == [] and report["evidence_id"] == EVIDENCE_ID
    assert report == audit_batching(*illustrative_fixture()).to_dict()


def test_cli_rejected(capsys):
    code, out, _ = _run(capsys, CONTRACT_JSON, FIXTURES / "admission_disabled_workload.json")
    assert code == 1
    assert out.splitlines()[:2] == ["decision=REJECT_CAPACITY",
                                    "violations=admission-control-disabled"]
    code, out, _ = _run(capsys, CONTRACT_JSON, FIXTURES / "admission_disabled_workload.json",
                        "--json")
    assert code == 1 and json.loads(out)["violations"] == ["admission-control-disabled"]


def test_cli_content_ids_are_optional(capsys, tmp_path):
    contract, workload = _fixture_json("illustrative_contract.json"), \
        _fixture_json("illustrative_workload.json")
    del contract["content_id"], workload["content_id"], workload["scheduler"]["content_id"]
    for c in workload["request_classes"]:
        del c["content_id"]
    code, out, _ = _run(capsys, _write(tmp_path, "c.json", contract),
                        _write(tmp_path, "w.json", workload))
    assert code == 0 and out == GOLDEN + f"claim={CLAIM}\n"


def _edit(name, fn):
    data = _fixture_json(name)
    fn(data)
    return data


INVALID_FILES = {
    "contract-tampered": ("contract", lambda d: d.update(max_ttft_ms=500),
                          "batching contract digest mismatch"),
    "contract-float": ("contract", lambda d: d.update(max_ttft_ms=250.0, content_id=""), _INT),
    "contract-bool": ("contract", lambda d: d.update(max_tpot_ms=True, content_id=""), _INT),
    "contract-unknown": ("contract", lambda d: d.update(extra=1), "unknown field"),
    "contract-missing": ("contract", lambda d: d.pop("max_kv_bytes"), "missing field"),
    "contract-empty": ("contract", lambda d: d.clear(), "missing field"),
    "contract-scope-seven": ("contract", lambda d: d["scope"].pop(), _INT),
    "workload-tampered-class": ("workload",
                                lambda d: d["request_classes"][1].update(priority=9),
                                "request class digest mismatch"),
    "workload-tampered": ("workload", lambda d: d.update(admission_control_enabled=False),
                          "batching workload digest mismatch"),
    "workload-chunk": ("workload", lambda d: (d["scheduler"].update(
        max_prefill_chunk_tokens=481, content_id=""), d.update(content_id="")),
        "prefill chunk exceeds declared per-iteration service"),
    "workload-scheduler-not-object": ("workload", lambda d: d.update(scheduler=[1]),
                                      "expected a JSON object"),
    "workload-class-not-object": ("workload", lambda d: d["request_classes"].append(3),
                                  "expected a JSON object"),
    "workload-classes-not-list": ("workload", lambda d: d.update(request_classes={}),
                                  "bounded tuple or list required"),
    "workload-other-contract": ("workload", lambda d: d.update(
        contract_content_id="0" * 64, content_id=""), "workload belongs to another batching contract"),
    "workload-admission-int": ("workload", lambda d: d.update(
        admission_control_enabled=1, content_id=""), "exact boolean required"),
}


@pytest.mark.parametrize("case", list(INVALID_FILES))
def test_cli_invalid_input_exits_2_with_one_line(capsys, tmp_path, case):
    which, edit, reason = INVALID_FILES[case]
    contract_path, workload_path = CONTRACT_JSON, WORKLOAD_JSON
    if which == "contract":
        contract_path = _write(tmp_path, "c.json", _edit("illustrative_contract.json", edit))
    else:
        workload_path = _write(tmp_path, "w.json", _edit("illustrative_workload.json", edit))
    code, out, err = _run(capsys, contract_path, workload_path)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("tokenbatch: error: ") and reason in err
    if case != "workload-other-contract":
        assert str(contract_path if which == "contract" else workload_path) in err


@pytest.mark.parametrize("text, reason", [
    ("{", "invalid JSON"),
    ('{"max_ttft_ms": 1, "max_ttft_ms": 2}', "duplicate key"),
    ('{"max_ttft_ms": NaN}', "NaN is not valid JSON"),
    ("[]", "expected a JSON object"),
], ids=["truncated", "duplicate-key", "nan", "array"])
def test_cli_bad_json(capsys, tmp_path, text, reason):
    code, _, err = _run(capsys, _write(tmp_path, "c.json", text), WORKLOAD_JSON)
    assert code == 2 and reason in err and err.count("\n") == 1


def test_cli_missing_file(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path / "absent.json", WORKLOAD_JSON)
    assert code == 2 and "cannot read file" in err and "absent.json" in err


@pytest.mark.parametrize("argv, message", [
    ((), "needs CONTRACT and WORKLOAD"),
    ((CONTRACT_JSON,), "needs CONTRACT and WORKLOAD"),
    (("--trace", "t.csv", "--profile", "linear"), "cannot read file"),
    (("--trace", "t.csv"), "--trace needs --profile"),
    ((CONTRACT_JSON, "--trace", "t.csv", "--profile", "linear"), "not both"),
    ((CONTRACT_JSON, WORKLOAD_JSON, "--profile", "linear"), "go with --trace"),
    ((CONTRACT_JSON, WORKLOAD_JSON, "--contract", "c.json"), "go with --trace"),
], ids=["none", "one", "trace", "trace-no-profile", "trace-and-files", "profile-alone",
        "contract-option-alone"])
def test_cli_argument_combinations(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_cli_trace_hook_parses_its_options():
    parser = cli.build_parser("audit")
    args = parser.parse_args(["audit", "--trace", "t.csv", "--profile", "linear", "--contract",
                              "c.json", "--json"])
    assert (args.trace, args.profile, args.trace_contract, args.json) == \
        ("t.csv", "linear", "c.json", True)
    assert args.contract_file is None and args.workload_file is None


def test_priority_iterations_needs_trace_mode(tmp_path, capsys):
    from tokenbatch_env.cli import main
    fx = Path(__file__).parent / "fixtures" / "capacity"
    code = main(["audit", str(fx / "illustrative_contract.json"), str(fx / "illustrative_workload.json"),
                 "--priority-iterations", "3"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "--priority-iterations go with --trace" in err and len(err.splitlines()) == 1
