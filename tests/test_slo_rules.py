"""SLO rules as data (docs/design.md section 2): the presets, sla.py's rule bit for bit, predicates,
bad rules as one line, the never-overwrite rule, ``has_priority`` through readers and writers, and
``tokenbatch simulate``'s --slo-rule and engine flags."""

from __future__ import annotations

import csv
import hashlib
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_path

from tokenbatch_env.cli import main
from tokenbatch_env.engine.simulate import simulate
from tokenbatch_env.engine.state import EngineConfig
from tokenbatch_env.errors import ConfigError, TraceError
from tokenbatch_env.traces import io as tio
from tokenbatch_env.traces.generators import generate_trace
from tokenbatch_env.traces.sla import DEFAULT_SLA, SlaClass, SlaSpec, assign_slas
from tokenbatch_env.traces.slo_rules import (COLUMNS, SloRule, apply_slo_rule, draw_shares, list_slo_rules,
                                             load_slo_rule, ttft_idle_ns)
from tokenbatch_env.traces.suites import load_suite
from tokenbatch_env.traces.trace import Trace
from tokenbatch_env.traces.windows import scale_ints, scale_to_rate
from tokenbatch_env.util import canonical_json

FIX = Path(__file__).parent / "fixtures"
MLPERF = {"mlperf-llama3_1-8b": (2000, 100), "mlperf-llama3_1-8b-interactive": (500, 30),
          "mlperf-llama2-70b": (2000, 200), "mlperf-llama2-70b-interactive": (450, 40)}
GEN = {"name": "g", "num_requests": 300, "arrivals": {"process": "poisson", "rate_rps": 5.0},
       "lengths": {"dist": "lognormal", "prompt": {"mu": 6.0, "sigma": 1.0}, "output": {"mu": 4.0, "sigma": 1.0},
                   "corr": 0.3, "max_model_len": 4096}}


def _old_assign_slas(trace: Trace, spec: SlaSpec, seed: int) -> dict:
    """The rule as sla.py computed it before rules were data (the reference for bit-identity)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 4])))
    w = np.array([c.weight for c in spec.classes], float)
    cdf = np.cumsum(w)
    cid = np.minimum(np.searchsorted(cdf, rng.random(len(trace)) * cdf[-1], side="right"), len(w) - 1)
    idle = ttft_idle_ns(trace.prompt_tokens, spec.profile)
    t1 = np.zeros(len(trace), np.int64)
    for j, c in enumerate(spec.classes):
        m = cid == j
        t1[m] = scale_ints(idle[m], Fraction(repr(float(c.ttft_scale))))
    return {"ttft_slo_ns": np.maximum(t1, 1), "class_id": cid,
            "tpot_slo_ns": np.array([c.tpot_ns for c in spec.classes], np.int64)[cid],
            "priority": np.array([c.priority for c in spec.classes], np.int64)[cid]}


def _same_columns(a: Trace, want: dict) -> None:
    for k, v in want.items():
        assert np.array_equal(getattr(a, k), v), k


def _bare(n=40, seed=0, **kw) -> Trace:
    rng = np.random.default_rng(seed)
    return Trace.build(arrival_ns=np.sort(rng.integers(0, 10**10, n)), prompt_tokens=rng.integers(1, 5000, n),
                       output_tokens=rng.integers(1, 300, n), name="bare", **kw)


# ------------------------------------------------------------------------------------ sla.py's rule
@pytest.mark.parametrize("seed", [0, 1, 5, 123456789])
def test_default_3class_is_assign_slas_bit_for_bit_on_generated_traces(seed):
    t = generate_trace(GEN, seed)
    assert not t.has_slos and not t.has_priority
    via_rule, note = apply_slo_rule(t, "default-3class", seed=seed)
    old = assign_slas(t, seed=seed)
    assert via_rule.digest == old.digest
    _same_columns(via_rule, _old_assign_slas(t, DEFAULT_SLA, seed))
    _same_columns(old, _old_assign_slas(t, DEFAULT_SLA, seed))
    assert note == f"SLOs and priorities from rule default-3class (seed {seed}): the trace has none"


@pytest.mark.parametrize("path", [("azure_llm_2023", "AzureLLMInferenceTrace_code.csv"),
                                  ("azure_llm_2023", "AzureLLMInferenceTrace_conv.csv"),
                                  ("mooncake_fast25", "conversation_trace.jsonl")])
def test_default_3class_is_assign_slas_bit_for_bit_on_real_traces(path):
    t, _ = tio.load_trace(shared_path("traces", *path))
    assert not t.has_slos and not t.has_priority
    for seed in (0, 3):
        want = _old_assign_slas(t, DEFAULT_SLA, seed)
        _same_columns(apply_slo_rule(t, "default-3class", seed=seed)[0], want)
        _same_columns(assign_slas(t, seed=seed), want)


def test_assign_slas_keeps_any_specs_draw():
    """A spec with unequal weights: the rule code keeps the spec's own arithmetic (weights as given)."""
    spec = SlaSpec("stress-512", (SlaClass("a", 5.0, 1.5, 20.0, 3), SlaClass("b", 3.0, 7.25, 80.0, 1),
                                  SlaClass("c", 2.0, 0.4, 300.0, 2)))
    t = generate_trace(GEN, 9)
    _same_columns(assign_slas(t, spec, seed=4), _old_assign_slas(t, spec, 4))


def test_thirds_draw_equals_the_weights_draw_at_every_boundary():
    """default-3class's shares are the double nearest 1/3 (cumulative 1/3, 2/3, 1.0); DEFAULT_SLA's
    weights are 1, 1, 1 (cumulative 1, 2, 3, compared with 3u). Both are monotone in u = k / 2**53, so
    they agree for every u when they agree on both sides of each boundary."""
    thirds, ones = [1 / 3] * 3, [1.0] * 3
    assert np.cumsum(thirds).tolist() == [1 / 3, 2 / 3, 1.0]

    class Fixed:
        def __init__(self, u):
            self.u = np.array(u)

        def random(self, n):
            return self.u

    ks = np.array([0, 1, 3002399751580329, 3002399751580330, 3002399751580331, 3002399751580332,
                   6004799503160659, 6004799503160660, 6004799503160661, 6004799503160662, 2**53 - 1])
    u = ks / 2.0**53
    a, b = draw_shares(Fixed(u), len(u), thirds), draw_shares(Fixed(u), len(u), ones)
    assert a.tolist() == b.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    rng = np.random.default_rng(0)
    u = rng.random(200_000)
    assert np.array_equal(draw_shares(Fixed(u), len(u), thirds), draw_shares(Fixed(u), len(u), ones))


# ------------------------------------------------------------------------------------ presets
def test_presets_are_shipped_and_say_where_they_come_from():
    assert set(list_slo_rules()) >= {"default-3class", *MLPERF}
    d3 = load_slo_rule("default-3class")
    assert d3.reference_profile == "stress-512" and d3.by_shares and not d3.is_mlperf and d3.p99_limits is None
    assert [(c.share, c.a_ms, c.b, c.tpot_ms, c.priority) for c in d3.classes] == [
        (1 / 3, 0.0, s.ttft_scale, s.tpot_ms, s.priority) for s in DEFAULT_SLA.classes]
    for name, (ttft, tpot) in MLPERF.items():
        r = load_slo_rule(name)
        raw = json.loads((Path(__file__).parents[1] / "tokenbatch_env" / "data" / "slo_rules" / f"{name}.json")
                         .read_text())
        assert r.name == raw["name"] == name
        assert "mlperf.conf" in r.source and f"ttft_latency = {ttft}" in r.source
        assert "p99" in r.note and "per request" in r.note
        assert r.is_mlperf and r.p99_limits == {"ttft_ms": ttft, "tpot_ms": tpot}
        assert [(c.a_ms, c.b, c.tpot_ms) for c in r.classes] == [(ttft, 0.0, tpot)]


@pytest.mark.parametrize("name", sorted(MLPERF))
def test_mlperf_presets_give_absolute_slos_without_a_profile(name):
    ttft, tpot = MLPERF[name]
    t = _bare()
    out, note = apply_slo_rule(t, name, seed=3)   # (b = 0: no profile needed, seed irrelevant)
    assert set(out.ttft_slo_ns.tolist()) == {ttft * 10**6} and set(out.tpot_slo_ns.tolist()) == {tpot * 10**6}
    assert note == f"SLOs and priorities from rule {name}: the trace has none"


def test_digest_is_the_canonical_json_and_to_dict_round_trips():
    for name in list_slo_rules():
        r = load_slo_rule(name)
        assert r.digest == hashlib.sha256(canonical_json(r.to_dict()).encode()).hexdigest()
        again = SloRule.from_dict(json.loads(json.dumps(r.to_dict())))
        assert again == r and again.digest == r.digest
    d = load_slo_rule("default-3class").to_dict()
    d["classes"][2]["tpot_ms"] = 201
    assert SloRule.from_dict(d).digest != load_slo_rule("default-3class").digest


# ------------------------------------------------------------------------------------ T1 arithmetic
def test_ttft_is_a_plus_b_times_idle_exactly_on_the_reference_profile():
    rule = SloRule.from_dict({"name": "r", "classes": [
        {"name": "x", "share": 1.0, "ttft": {"a_ms": 1.5, "b": 2.5}, "tpot_ms": 0.1, "priority": 4}]})
    t = _bare()
    out, _ = apply_slo_rule(t, rule, profile="stress-512")
    idle = ttft_idle_ns(t.prompt_tokens, "stress-512")
    assert out.ttft_slo_ns.tolist() == [1_500_000 + (5 * int(x) + 1) // 2 for x in idle]
    assert set(out.tpot_slo_ns.tolist()) == {100_000} and set(out.priority.tolist()) == {4}
    other, _ = apply_slo_rule(t, rule, profile="llama2-7b-a100")   # (no reference_profile: the evaluated one)
    assert not np.array_equal(other.ttft_slo_ns, out.ttft_slo_ns)
    pinned = SloRule.from_dict(dict(rule.to_dict(), reference_profile="stress-512"))
    assert np.array_equal(apply_slo_rule(t, pinned, profile="llama2-7b-a100")[0].ttft_slo_ns, out.ttft_slo_ns)
    with pytest.raises(ConfigError, match="no reference_profile and no evaluated profile"):
        apply_slo_rule(t, rule)


def test_a_slo_beyond_a_day_names_the_trace_request_and_class():
    t = Trace.build(arrival_ns=[0, 1, 2], prompt_tokens=[100, 5_000_000, 200], output_tokens=[5, 5, 5], name="big")
    rule = SloRule.from_dict({"name": "slow", "reference_profile": "stress-512", "classes": [
        {"name": "slow", "when": "otherwise", "ttft": {"b": 10}, "tpot_ms": 100}]})
    with pytest.raises(TraceError, match=r"^trace 'big': request 1 \(0-based\) has a 5,000,000-token prompt.*'slow'"):
        apply_slo_rule(t, rule)


# ------------------------------------------------------------------------------------ predicates
def _pred_rule(*whens, tail=True):
    classes = [{"name": f"c{i}", "when": w, "ttft": {"a_ms": 100 * (i + 1)}, "tpot_ms": 10 * (i + 1), "priority": i}
               for i, w in enumerate(whens)]
    if tail:
        classes.append({"name": "rest", "when": "otherwise", "ttft": {"a_ms": 9000}, "tpot_ms": 90, "priority": 9})
    return SloRule.from_dict({"name": "p", "classes": classes})


def test_predicates_first_match_wins_and_every_op():
    t = Trace.build(arrival_ns=[0, 1, 2, 3, 4, 5], prompt_tokens=[10, 5000, 4096, 300, 7, 8],
                    output_tokens=[1, 2, 3, 400, 5, 6], name="p")
    rule = _pred_rule({"column": "prompt_tokens", "op": ">=", "value": 4096},
                      {"column": "output_tokens", "op": ">", "value": 100},
                      {"column": "prompt_tokens", "op": "in", "value": [7, 8]},
                      {"column": "prompt_tokens", "op": ">=", "value": 1})   # (also matches rows 1, 2)
    out, note = apply_slo_rule(t, rule, seed=5)
    assert out.class_id.tolist() == [3, 0, 0, 1, 2, 2]
    assert out.priority.tolist() == [3, 0, 0, 1, 2, 2]
    assert out.ttft_slo_ns.tolist() == [400e6, 100e6, 100e6, 200e6, 300e6, 300e6]
    assert note == "SLOs and priorities from rule p: the trace has none"   # (no seed: no draw)
    cases = [("==", 300, [0, 0, 0, 1, 0, 0]), ("!=", 300, [1, 1, 1, 0, 1, 1]), ("<", 300, [1, 0, 0, 0, 1, 1]),
             ("<=", 300, [1, 0, 0, 1, 1, 1]), (">", 300, [0, 1, 1, 0, 0, 0]), (">=", 300, [0, 1, 1, 1, 0, 0]),
             ("in", [10, 4096], [1, 0, 1, 0, 0, 0])]
    for op, value, match in cases:
        cid = apply_slo_rule(t, _pred_rule({"column": "prompt_tokens", "op": op, "value": value}))[0].class_id
        assert (cid == 0).astype(int).tolist() == match, op
    combo = _pred_rule({"all": [{"column": "prompt_tokens", "op": "<", "value": 100},
                                {"not": {"column": "arrival_ns", "op": "==", "value": 5}}]},
                       {"any": [{"column": "class_id", "op": "==", "value": 7},
                                {"column": "output_tokens", "op": "in", "value": [400, 6]}]})
    assert apply_slo_rule(t, combo)[0].class_id.tolist() == [0, 2, 2, 1, 0, 1]


def test_a_request_matching_no_class_is_named():
    t = Trace.build(arrival_ns=[0, 1, 2], prompt_tokens=[10, 5000, 20], output_tokens=[1, 2, 3], name="p")
    rule = _pred_rule({"column": "prompt_tokens", "op": "<", "value": 100}, tail=False)
    with pytest.raises(ConfigError, match=r"^SLO rule 'p': trace 'p': request 1 \(0-based; prompt_tokens=5000\) "
                                          r"matches no class \(1 such request\(s\)\)"):
        apply_slo_rule(t, rule)


def test_a_predicate_on_a_column_the_trace_lacks_is_an_error():
    t = _bare()
    for col, lacks in (("ttft_slo_ns", "no SLOs"), ("priority", "no priority column")):
        rule = _pred_rule({"column": col, "op": ">", "value": 0})
        with pytest.raises(ConfigError, match=rf"classes\[0\]\.when: column '{col}' is missing from trace 'bare' "
                                              rf"\(it has {lacks}\)"):
            apply_slo_rule(t, rule)
    own = _bare(priority=np.arange(40) % 2)
    rule = _pred_rule({"column": "priority", "op": "==", "value": 1})
    out, note = apply_slo_rule(own, rule)
    assert np.array_equal(out.class_id, np.where(own.priority == 1, 0, 1))
    assert np.array_equal(out.priority, own.priority)   # (kept: the trace has its own)
    assert note == "SLOs from rule p: the trace has none; kept the trace's own priority"


# ------------------------------------------------------------------------------------ bad rules
def _good():
    return {"name": "r", "classes": [
        {"name": "a", "share": 0.5, "ttft": {"a_ms": 0, "b": 2}, "tpot_ms": 50, "priority": 0},
        {"name": "b", "share": 0.5, "ttft": {"a_ms": 100, "b": 0}, "tpot_ms": 100, "priority": 1}]}


def _edit(fn):
    d = _good()
    fn(d)
    return d


def _whens(when):
    d = _good()
    for c in d["classes"]:
        del c["share"]
        c["when"] = when
    return d


BAD = [
    ("unknown top-level key", _edit(lambda d: d.update(colour="red")), r"rule: unknown field\(s\) \['colour'\]"),
    ("unknown class key", _edit(lambda d: d["classes"][1].update(weight=1)),
     r"rule\.classes\[1\]: unknown field\(s\) \['weight'\]"),
    ("unknown ttft key", _edit(lambda d: d["classes"][0]["ttft"].update(c=1)),
     r"rule\.classes\[0\]\.ttft: unknown field\(s\) \['c'\]"),
    ("negative a_ms", _edit(lambda d: d["classes"][1]["ttft"].update(a_ms=-1)),
     r"rule\.classes\[1\]\.ttft\.a_ms: must be >= 0, got -1"),
    ("negative b", _edit(lambda d: d["classes"][0]["ttft"].update(b=-0.5)),
     r"rule\.classes\[0\]\.ttft\.b: must be >= 0, got -0\.5"),
    ("a = b = 0", _edit(lambda d: d["classes"][0].update(ttft={"a_ms": 0, "b": 0})),
     r"rule\.classes\[0\]\.ttft: a_ms and b are both 0"),
    ("tpot 0", _edit(lambda d: d["classes"][0].update(tpot_ms=0)), r"rule\.classes\[0\]\.tpot_ms: must be > 0, got 0"),
    ("tpot negative", _edit(lambda d: d["classes"][1].update(tpot_ms=-3)),
     r"rule\.classes\[1\]\.tpot_ms: must be > 0, got -3"),
    ("shares not 1", _edit(lambda d: d["classes"][1].update(share=0.4)),
     r"rule\.classes: shares sum to 0\.9, not 1 \(tolerance 1e-9\)"),
    ("shares and predicates", _edit(lambda d: (d["classes"][1].pop("share"), d["classes"][1].update(when="otherwise"))),
     r"rule\.classes\[1\]: has when but classes\[0\] has share: .*never both"),
    ("both in a class", _edit(lambda d: d["classes"][0].update(when="otherwise")),
     r"rule\.classes\[0\]: give exactly one of 'share'"),
    ("unknown column", _whens({"column": "colour", "op": "==", "value": 1}),
     r"rule\.classes\[0\]\.when\.column: unknown column 'colour'"),
    ("unknown op", _whens({"column": "priority", "op": "~", "value": 1}),
     r"rule\.classes\[0\]\.when\.op: must be one of"),
    ("unreachable", _whens("otherwise"), r"rule\.classes\[1\]: unreachable: classes\[0\] is 'otherwise'"),
    ("duplicate names", _edit(lambda d: d["classes"][1].update(name="a")),
     r"rule\.classes: class names must be unique"),
    ("unknown profile", _edit(lambda d: d.update(reference_profile="nope")),
     r"rule\.reference_profile: unknown profile"),
    ("no classes", _edit(lambda d: d.update(classes=[])), r"rule\.classes: must be a non-empty list"),
]


@pytest.mark.parametrize("what,d,msg", BAD, ids=[b[0] for b in BAD])
def test_a_bad_rule_is_one_line_naming_file_and_field(what, d, msg, tmp_path):
    SloRule.from_dict(_good())
    path = tmp_path / "rule.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        load_slo_rule(str(path))
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}: ")
    assert __import__("re").search(msg, text), text


def test_rule_files_and_names(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown SLO rule 'nope'; valid: default-3class"):
        load_slo_rule("nope")
    with pytest.raises(ConfigError, match=r"SLO rule file .*missing\.json: no such file"):
        load_slo_rule(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match=rf"^{bad}: invalid JSON"):
        load_slo_rule(bad)
    good = tmp_path / "mine.json"
    good.write_text(json.dumps(_good()))
    assert load_slo_rule(good) == SloRule.from_dict(_good()) and load_slo_rule(good).where == str(good)


# ------------------------------------------------------------------------------------ never overwrite
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("slos,prio", [(False, False), (True, False), (False, True), (True, True)])
def test_a_rule_fills_only_what_the_trace_lacks_unless_explicit(slos, prio, explicit):
    kw = {}
    if slos:
        kw.update(ttft_slo_ns=np.full(40, 7_000_000), tpot_slo_ns=np.full(40, 3_000_000), class_id=np.full(40, 5))
    if prio:
        kw.update(priority=np.arange(40) % 7 - 3)
    t = _bare(**kw)
    assert (t.has_slos, t.has_priority) == (slos, prio)
    out, note = apply_slo_rule(t, "default-3class", seed=2, explicit=explicit)
    rule_cols = _old_assign_slas(t, DEFAULT_SLA, 2)
    fill_slos, fill_prio = explicit or not slos, explicit or not prio
    for col in ("ttft_slo_ns", "tpot_slo_ns", "class_id"):
        assert np.array_equal(getattr(out, col), rule_cols[col] if fill_slos else getattr(t, col)), col
    assert np.array_equal(out.priority, rule_cols["priority"] if fill_prio else t.priority)
    assert out.has_slos and out.has_priority == (prio or fill_prio)
    if not (fill_slos or fill_prio):
        assert out is t and note == "kept the trace's own SLOs and priority; rule default-3class not applied"
    elif explicit:
        had = " and ".join(x for x, h in (("SLOs", slos), ("priority", prio)) if h)
        assert note == ("SLOs and priorities from rule default-3class (seed 2), given explicitly: "
                        + (f"the trace's own {had} replaced" if had else "the trace has none"))
    else:
        assert note.startswith({(True, True): "SLOs and priorities", (True, False): "SLOs from",
                                (False, True): "priorities from"}[fill_slos, fill_prio])


# ------------------------------------------------------------------------------------ has_priority
def test_readers_record_whether_the_file_had_a_priority_column():
    assert tio.load_csv(FIX / "canonical_ok.csv").has_priority
    assert not tio.load_csv(FIX / "canonical_minimal.csv").has_priority
    for name in ("azure_ok.csv", "mooncake_ok.jsonl", "burstgpt_ok.csv"):
        t, _ = tio.load_trace(FIX / name)
        assert not t.has_priority and not t.has_slos, name


def test_has_priority_survives_derivations_and_files_without_touching_digests(tmp_path):
    t = _bare()
    zeros = _bare(priority=np.zeros(40, np.int64))
    assert not t.has_priority and zeros.has_priority and t.digest == zeros.digest
    derived = [t.subset(slice(3, 20)), t.subset(np.array([1, 5, 9])), t.subset(slice(0, 30, 2)), t.replace(name="x"),
               scale_to_rate(t, 3.0), t.replace(block_size=32),
               t.replace(ttft_slo_ns=np.ones(40), tpot_slo_ns=np.ones(40))]
    assert not any(d.has_priority for d in derived)
    assert t.replace(priority=np.ones(40)).has_priority and not zeros.replace(priority=None).has_priority
    assert Trace.build(**{f: getattr(t, f) for f in ("arrival_ns", "prompt_tokens", "output_tokens")},
                       priority=t.priority, has_priority=False).digest == t.digest
    with pytest.raises(TraceError, match="has_priority must be a bool"):
        t.replace(has_priority="yes")
    for trace in (t, zeros):
        for suffix in (".npz", ".csv"):
            path = tmp_path / f"{trace.has_priority}{suffix}"
            tio.save_trace(trace, path)
            back, _ = tio.load_trace(path)
            assert back.digest == trace.digest and back.has_priority == trace.has_priority, path
    with np.load(tmp_path / "False.npz") as z:
        assert "priority" not in z.files
    with np.load(tmp_path / "True.npz") as z:
        assert "priority" in z.files
    assert (tmp_path / "True.csv").read_text().splitlines()[1] == ",".join(tio.CANONICAL_COLUMNS)
    assert "priority" not in (tmp_path / "False.csv").read_text().splitlines()[1]


def test_suite_traces_keep_their_manifest_digests_and_priorities():
    suite = load_suite("seed-200")
    fresh, cached = suite.trace("test", 0, use_cache=False), suite.trace("test", 0)
    assert fresh.digest == cached.digest == suite.digests("test")[0]
    assert fresh.has_priority and cached.has_priority and fresh.has_slos


# ------------------------------------------------------------------------------------ simulate CLI
def _own_priority_file(tmp_path) -> tuple[Path, Trace]:
    """A canonical CSV with its own priority column (not the default rule's classes) and no SLOs."""
    base = scale_to_rate(load_suite("seed-200").trace("test", 0).subset(slice(0, 120)), 8.0)
    prio = np.random.default_rng(11).integers(-2, 3, len(base))
    t = Trace.build(arrival_ns=base.arrival_ns, prompt_tokens=base.prompt_tokens, output_tokens=base.output_tokens,
                    priority=prio, prefix_offsets=base.prefix_offsets, prefix_hashes=base.prefix_hashes,
                    block_size=base.block_size, name="own")
    path = tmp_path / "own.csv"
    tio.save_csv(t, path)
    return path, t


def _records_csv(path):
    rows = list(csv.DictReader(open(path, newline="")))
    return {k: [r[k] for r in rows] for k in rows[0]}


def test_simulate_cli_keeps_the_trace_own_priority_and_schedules_as_the_api(tmp_path, capsys):
    path, t = _own_priority_file(tmp_path)
    out = tmp_path / "out.csv"
    assert main(["simulate", "--trace", str(path), "--policy", "priority", "--records", str(out)]) == 0
    text = capsys.readouterr().out
    assert "slo rule  SLOs from rule default-3class (seed 0): the trace has none; kept the trace's own priority" in text
    loaded, _ = tio.load_trace(path)
    assert loaded.has_priority and not loaded.has_slos
    want = simulate(loaded, "stress-512", "priority").records(0)
    got = _records_csv(out)
    assert list(got) == [*want, "priority"]
    for k, v in want.items():
        if k in ("met", "end_state"):   # (met: the API run has no SLOs to meet)
            continue
        assert [float(s) if v.dtype.kind == "f" else int(s) for s in got[k]] == v.tolist(), k
    assert [int(s) for s in got["priority"]] == t.priority.tolist()
    # the test can tell: the default rule's priorities schedule this file differently
    replaced = simulate(assign_slas(loaded, seed=0), "stress-512", "priority").records(0)
    assert not np.array_equal(replaced["first_token_ns"], want["first_token_ns"])


def test_simulate_cli_slo_rule_given_replaces_the_priority(tmp_path, capsys):
    path, t = _own_priority_file(tmp_path)
    out = tmp_path / "out.csv"
    assert main(["simulate", "--trace", str(path), "--policy", "priority", "--records", str(out),
                 "--slo-rule", "default-3class", "--sla-seed", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["slo_rule"] == "default-3class" and d["slo_rule_digest"] == load_slo_rule("default-3class").digest
    assert d["slo_note"] == ("SLOs and priorities from rule default-3class (seed 4), given explicitly: "
                             "the trace's own priority replaced")
    assert [int(s) for s in _records_csv(out)["priority"]] == _old_assign_slas(t, DEFAULT_SLA, 4)["priority"].tolist()
    rule = tmp_path / "r.json"
    rule.write_text(json.dumps({"name": "mine", "classes": [
        {"name": "all", "when": "otherwise", "ttft": {"a_ms": 5000}, "tpot_ms": 500, "priority": 7}]}))
    assert main(["simulate", "--trace", str(path), "--slo-rule", str(rule), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["slo_rule"] == "mine" and d["slo_note"].startswith("SLOs and priorities from rule mine, given explicitly")
    assert main(["simulate", "--trace", str(path), "--slo-rule", "nope"]) == 2
    assert capsys.readouterr().err.startswith("tokenbatch: error: unknown SLO rule 'nope'")


def test_simulate_cli_engine_flags_map_to_engine_config(tmp_path, capsys):
    path = tmp_path / "t.csv"
    base = scale_to_rate(load_suite("seed-200").trace("test", 0).subset(slice(0, 80)), 8.0)
    t = Trace.build(arrival_ns=base.arrival_ns, prompt_tokens=np.minimum(base.prompt_tokens, 900),
                    output_tokens=base.output_tokens, ttft_slo_ns=base.ttft_slo_ns, tpot_slo_ns=base.tpot_slo_ns,
                    priority=base.priority, class_id=base.class_id, name="flags")   # (no chains)
    tio.save_csv(t, path)
    out = tmp_path / "out.csv"
    argv = ["--num-blocks", "64", "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
            "--max-model-len", "1000", "--no-prefix-caching", "--sync"]
    assert main(["simulate", "--trace", str(path), "--records", str(out), "--json", *argv]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["engine"] == {"max_num_batched_tokens": 256, "max_num_seqs": 8, "num_blocks": 64, "block_size": 32,
                           "max_model_len": 1000, "prefix_caching": False, "async_scheduling": False,
                           "long_prefill_token_threshold": 0}
    assert d["slo_note"] == "kept the trace's own SLOs and priority; rule default-3class not applied"
    config = EngineConfig(num_blocks=64, block_size=32, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1000,
                          prefix_caching=False, async_scheduling=False)
    want = simulate(t.replace(block_size=32), "stress-512", "fcfs", config).records(0)
    assert [int(s) for s in _records_csv(out)["finish_ns"]] == want["finish_ns"].tolist()
    assert main(["simulate", "--trace", str(path), "--json", "--async"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"]["async_scheduling"] is True


@pytest.mark.parametrize("argv,msg", [
    (["--num-blocks", "x"], "--num-blocks: must be an integer, got 'x'"),
    (["--num-blocks", "1"], "--num-blocks: must be an integer >= 2, got 1"),
    (["--block-size", "0"], "--block-size: must be an integer >= 1, got 0"),
    (["--max-num-seqs", "-4"], "--max-num-seqs: must be an integer >= 1, got -4"),
    (["--max-num-batched-tokens", "1.5"], "--max-num-batched-tokens: must be an integer, got '1.5'"),
    (["--max-model-len", "0"], "--max-model-len: must be an integer >= 1, got 0"),
    (["--block-size", "1000000"], "--block-size 1000000: block_size 1000000: larger than the profile's whole KV pool"),
    (["--block-size", "24"], "--block-size 24: trace 'own' stores its prefix chains at block size 16"),
])
def test_simulate_cli_bad_engine_flags_are_one_line_naming_the_flag(argv, msg, tmp_path, capsys):
    path, _ = _own_priority_file(tmp_path)
    assert main(["simulate", "--trace", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenbatch: error: {msg}") and err.count("\n") == 1, err


def test_simulate_cli_async_and_sync_exclude_each_other(tmp_path, capsys):
    path, _ = _own_priority_file(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", str(path), "--async", "--sync"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_columns_are_the_traces():
    t = _bare()
    assert all(getattr(t, c).shape == (len(t),) for c in COLUMNS if c not in ("ttft_slo_ns", "tpot_slo_ns"))
