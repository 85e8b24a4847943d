"""The vLLM plug-in (``tokenbatch_env.integrations.vllm``): TokenBatch policies inside vLLM's real
scheduler must give the schedule our engine gives with the same policy (first-token iteration,
finish iteration, preemptions and shedding, request by request), sync and async.

Needs the ``vllm`` extra (docs/fidelity.md); skipped with the reason when vLLM is not importable.
Agreement figures and the known divergence: docs/vllm_plugin.md.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_helpers import H, VLLM_MARKS  # (sets VLLM_TARGET_DEVICE first)

pytestmark = VLLM_MARKS

from test_fidelity import budgets, gen  # noqa: E402

from tokenbatch_env.policies import IndexParams, engine_policy  # noqa: E402
from tokenbatch_env.predictors import PredictorSpec, estimates  # noqa: E402
from tokenbatch_env.traces.trace import Trace  # noqa: E402

PLUGIN = "tokenbatch_env.integrations.vllm"
KINDS = ("mix", "burst", "long", "hol", "prefix")
T_REF_MS = 300.0
PARAMS = IndexParams(kappa=1.0, slope=2.0, gamma=20.0, theta=0.5, beta=5.0, w_prefix=1.0, a_edf=0.5)


def slo_trace(seed: int, kind: str, distinct: bool = True) -> Trace:
    """``test_fidelity.gen`` plus per-request SLOs (TTFT 20-600 ms: some are lost, some shed)."""
    t = gen(seed, kind, distinct=distinct)
    rng = np.random.default_rng(seed + 100)
    n = len(t)
    return Trace.build(arrival_ns=t.arrival_ns, prompt_tokens=t.prompt_tokens,
                       output_tokens=t.output_tokens,
                       ttft_slo_ns=rng.integers(20, 600, n) * 1_000_000,
                       tpot_slo_ns=rng.integers(20, 200, n) * 1_000_000, priority=t.priority,
                       prefix_offsets=t.prefix_offsets, prefix_hashes=t.prefix_hashes)


def extra_args(tr: Trace, est: np.ndarray) -> list:
    return [{"tokenbatch_ttft_slo_ms": float(tr.ttft_slo_ns[i]) / 1e6,
             "tokenbatch_tpot_slo_ms": float(tr.tpot_slo_ns[i]) / 1e6,
             "tokenbatch_est_output_tokens": float(est[i])} for i in range(len(tr))]


@pytest.fixture(scope="module")
def params_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tb") / "tuned.json"
    p.write_text(json.dumps({"index": PARAMS.__dict__, "shed_margin": 0.5,
                             "edf": {"shed_margin": 0.5}, "meta": {"t_ref_ms": T_REF_MS}}))
    return str(p)


def plugin_compare(seed, kind, policy, shed, async_scheduling, params_file, *, prefix_caching=True,
                   distinct=True):
    tr = slo_trace(seed, kind, distinct)
    est = estimates(tr, PredictorSpec("noisy", 0.5, seed))
    cfg = {"policy": policy, "shed": "off" if shed is None else shed, "profile": "linear",
           "t_ref_ms": T_REF_MS, "policy_file": params_file}
    ep = engine_policy(policy, params=PARAMS if policy == "index" else None, shed_margin=shed,
                       t_ref_ms=T_REF_MS)
    cls = f"{PLUGIN}.{'TokenBatchAsyncScheduler' if async_scheduling else 'TokenBatchScheduler'}"
    return H.compare(tr, "linear", "priority", engine_policy=ep, estimates=est, scheduler_cls=cls,
                     scheduler_kwargs={"tokenbatch_config": cfg}, extra_args=extra_args(tr, est),
                     prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                     **budgets(seed))


def assert_identical(c: H.Comparison):
    if c.divergences:
        pytest.fail(f"{len(c.divergences)} divergences, first: {c.divergences[:6]}; first differing "
                    f"iteration {c.first_divergent_iteration()}; agreement {c.agreement}")


# ----------------------------------------------------------------------------- differential
@pytest.mark.parametrize("shed", [None, 0.5], ids=["noshed", "shed"])
@pytest.mark.parametrize("policy", ["index", "edf", "sjf", "llf"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_sync_plugin_matches_engine(seed, kind, policy, shed, params_file):
    assert_identical(plugin_compare(seed, kind, policy, shed, False, params_file))


@pytest.mark.parametrize("shed", [None, 0.5], ids=["noshed", "shed"])
@pytest.mark.parametrize("policy", ["index", "edf", "sjf", "llf"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_async_plugin_matches_engine(seed, kind, policy, shed, params_file):
    # P1 (docs/vllm_plugin.md) was the engine's D6 (docs/fidelity.md), fixed: these cases pin it
    assert_identical(plugin_compare(seed, kind, policy, shed, True, params_file))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", KINDS)
def test_plugin_matches_engine_without_prefix_caching_and_with_ties(kind, async_scheduling, params_file):
    for policy in ("index", "edf"):
        assert_identical(plugin_compare(3, kind, policy, 0.5, async_scheduling, params_file,
                                        prefix_caching=False, distinct=False))


def test_plugin_scenarios_preempt_and_shed(params_file):
    """The differential cases really exercise preemption (vLLM's victim rule) and the shed rule."""
    pre = shed = 0
    for seed in range(3):
        for kind in KINDS:
            c = plugin_compare(seed, kind, "index", 0.5, False, params_file)
            pre += int(c.vllm.records["preemptions"].sum())
            shed += int(c.vllm.records["shed"].sum())
    assert pre > 20 and shed > 20


# ----------------------------------------------------------------------------- loading, config
def _make(cls_path, tokenbatch_config=None, async_scheduling=False, additional_config=None):
    hc = H.HarnessConfig(max_num_batched_tokens=64, max_num_seqs=4, num_blocks=20,
                         async_scheduling=async_scheduling, policy="fcfs")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        H._write_model_dir(d, hc.max_model_len)
        kw = {} if tokenbatch_config is None else {"tokenbatch_config": tokenbatch_config}
        if additional_config is not None:
            # as `--additional-config '{"tokenbatch": {...}}'`: patch the VllmConfig it is built with
            from vllm.config import VllmConfig
            orig = VllmConfig.__init__

            def init(self, *a, **k):
                k.setdefault("additional_config", additional_config)
                orig(self, *a, **k)
            VllmConfig.__init__ = init
            try:
                return H.make_scheduler(hc, d, cls_path, kw)[0]
            finally:
                VllmConfig.__init__ = orig
        return H.make_scheduler(hc, d, cls_path, kw)[0]


@pytest.mark.parametrize("name,async_", [("TokenBatchScheduler", False),
                                         ("TokenBatchAsyncScheduler", True)])
def test_loads_by_dotted_path_like_scheduler_cls(name, async_, params_file, monkeypatch):
    """vLLM resolves ``--scheduler-cls`` through ``SchedulerConfig.get_scheduler_cls``; the harness
    uses the same call. Settings come from the environment; the policy becomes vLLM's priority."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.request_queue import PriorityRequestQueue, SchedulingPolicy
    from vllm.v1.core.sched.scheduler import Scheduler
    monkeypatch.setenv("TOKENBATCH_POLICY", "index")
    monkeypatch.setenv("TOKENBATCH_POLICY_FILE", params_file)
    monkeypatch.setenv("TOKENBATCH_SHED", "on")
    monkeypatch.setenv("TOKENBATCH_PROFILE", "linear")
    s = _make(f"{PLUGIN}.{name}", async_scheduling=async_)
    assert type(s).__name__ == name
    assert isinstance(s, AsyncScheduler if async_ else Scheduler)
    assert s.policy == SchedulingPolicy.PRIORITY and isinstance(s.waiting, PriorityRequestQueue)
    cfg = s.tokenbatch
    assert (cfg.policy, cfg.shed_margin, cfg.t_ref_ms, cfg.profile) == ("index", 0.5, T_REF_MS, "linear")
    assert cfg.index_params == PARAMS


def test_additional_config_and_precedence(params_file, monkeypatch):
    monkeypatch.setenv("TOKENBATCH_POLICY", "sjf")
    s = _make(f"{PLUGIN}.TokenBatchScheduler",
              additional_config={"tokenbatch": {"policy": "edf", "shed": "0.25", "profile": "linear"}})
    assert (s.tokenbatch.policy, s.tokenbatch.shed_margin) == ("edf", 0.25)
    s = _make(f"{PLUGIN}.TokenBatchScheduler", {"policy": "llf", "profile": "linear"},
              additional_config={"tokenbatch": {"policy": "edf"}})
    assert s.tokenbatch.policy == "llf"


@pytest.mark.parametrize("content,match", [
    ("{not json", "invalid JSON"),
    ('{"index": {"kappa": 99}}', "kappa"),
    ('{"index": {"nonsense": 1}}', "unknown index parameter"),
    ('{"bogus_key": 1}', "unknown key"),
    ('{"shed_margin": 7}', "shed_margin"),
    ('[1, 2]', "JSON object"),
    ('{"meta": {"profile": "my-gpu.json"}}', r"meta\.profile: profile file 'my-gpu\.json' not found"),
])
def test_bad_policy_file_fails_at_startup(content, match, tmp_path, monkeypatch):
    from tokenbatch_env.integrations.vllm import TokenBatchPluginError
    p = tmp_path / "bad.json"
    p.write_text(content)
    monkeypatch.setenv("TOKENBATCH_POLICY_FILE", str(p))
    with pytest.raises(TokenBatchPluginError, match=match) as ei:
        _make(f"{PLUGIN}.TokenBatchAsyncScheduler", async_scheduling=True)
    assert "TOKENBATCH_POLICY_FILE" in str(ei.value) and str(p) in str(ei.value)


@pytest.mark.parametrize("cfg,match", [
    ({"policy_file": "/nonexistent/tuned.json"}, "not found"),
    ({"policy": "fcfs"}, "vLLM's own --scheduling-policy"),
    ({"policy": "lottery"}, "unknown policy"),
    ({"shed": "sometimes"}, "shed must be"),
    ({"shed": 5}, "shed must be"),
    ({"t_ref_ms": -1}, "t_ref_ms"),
    ({"profile": "no-such-profile"}, "profile"),
    ({"default_ttft_slo_ms": "abc"}, "default_ttft_slo_ms"),
    ({"colour": "blue"}, "unknown setting"),
])
def test_bad_settings_fail_at_startup(cfg, match):
    from tokenbatch_env.integrations.vllm import TokenBatchPluginError
    with pytest.raises(TokenBatchPluginError, match=match):
        _make(f"{PLUGIN}.TokenBatchScheduler", cfg)


def test_bad_extra_args_fall_back_to_defaults_and_are_counted(params_file):
    tr = slo_trace(0, "mix")
    est = estimates(tr, PredictorSpec("noisy", 0.5, 0))
    xa = extra_args(tr, est)
    xa[3] = {"tokenbatch_ttft_slo_ms": "soon"}
    xa[5] = {"tokenbatch_est_output_tokens": -4}
    holder = {}
    from tokenbatch_env.integrations.vllm import TokenBatchScheduler

    class Spy(TokenBatchScheduler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            holder["s"] = self
    H.replay(tr, "linear", "priority", scheduler_cls=Spy,
             scheduler_kwargs={"tokenbatch_config": {"policy": "edf", "profile": "linear"}},
             extra_args=xa, **budgets(0))
    assert holder["s"].tokenbatch_stats["bad_extra_args"] == 2


def test_shed_requests_are_reported_as_aborted(params_file):
    """Shedding goes through vLLM's finish path: FINISHED_ABORTED, an output with finish reason
    ``abort`` to the client, counted in ``tokenbatch_stats``."""
    from vllm.v1.engine import FinishReason
    from tokenbatch_env.integrations.vllm import TokenBatchScheduler
    seen = {}

    class Spy(TokenBatchScheduler):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            seen["s"] = self

        def update_from_output(self, so, mro):
            outs = super().update_from_output(so, mro)
            for eco in outs.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        seen.setdefault("reasons", {})[o.request_id] = o.finish_reason
            return outs
    tr = slo_trace(2, "burst")
    est = estimates(tr, PredictorSpec("noisy", 0.5, 2))
    v = H.replay(tr, "linear", "priority", scheduler_cls=Spy,
                 scheduler_kwargs={"tokenbatch_config": {"policy": "edf", "shed": "0", "profile": "linear"}},
                 extra_args=extra_args(tr, est), **budgets(2))
    s = seen["s"]
    shed_ids = set(s.tokenbatch_shed)
    assert len(shed_ids) == s.tokenbatch_stats["shed"] == int(v.records["shed"].sum()) > 0
    assert all(seen["reasons"][r] == FinishReason.ABORT for r in shed_ids)
    assert all(seen["reasons"][r] == FinishReason.LENGTH for r in seen["reasons"] if r not in shed_ids)


def test_priority_is_the_exact_rank(params_file):
    """After ranking, priorities are 0..n-1 in (tier desc, score desc, arrival, id) order."""
    from tokenbatch_env.integrations.vllm import TokenBatchScheduler
    snaps = []

    class Spy(TokenBatchScheduler):
        def _tb_rank(self):
            super()._tb_rank()
            reqs = list(self.waiting) + list(self.running)
            snaps.append([(r.priority, self.tokenbatch_last[r.request_id], r.arrival_time, r.request_id)
                          for r in reqs])
    tr = slo_trace(1, "burst")
    est = estimates(tr, PredictorSpec("noisy", 0.5, 1))
    H.replay(tr, "linear", "priority", scheduler_cls=Spy,
             scheduler_kwargs={"tokenbatch_config": {"policy": "index", "policy_file": params_file,
                                                     "profile": "linear"}},
             extra_args=extra_args(tr, est), **budgets(1))
    assert snaps
    for snap in snaps:
        snap.sort()
        assert [p for p, *_ in snap] == list(range(len(snap)))
        keys = [(-ts[0], -ts[1], a, r) for _, ts, a, r in snap]
        assert keys == sorted(keys)


# ----------------------------------------------------------------------------- log_steps
def _costed_profile():
    """stress-512's costs (every term non-zero), without the watermark the harness does not model."""
    import dataclasses
    from tokenbatch_env.engine.profiles import load_profile
    return dataclasses.replace(load_profile("stress-512"), watermark_blocks=0)


def _logged_replay(path, kind, seed, async_scheduling=False):
    """A replay whose iteration times are ``_costed_profile``'s (the harness's clock), logged to ``path``."""
    cls = f"{PLUGIN}.{'TokenBatchAsyncScheduler' if async_scheduling else 'TokenBatchScheduler'}"
    holder = {}
    import importlib
    base = getattr(importlib.import_module(PLUGIN), cls.rsplit(".", 1)[1])

    class Spy(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            holder["s"] = self
    v = H.replay(gen(seed, kind), _costed_profile(), "priority", scheduler_cls=Spy, async_scheduling=async_scheduling,
                 scheduler_kwargs={"tokenbatch_config": {"policy": "edf", "profile": "linear",
                                                         "log_steps": str(path)}}, **budgets(seed))
    return v, holder["s"]


def test_log_steps_rows_are_the_engine_cost_features_and_fit_back(tmp_path, capsys):
    """Sync replays (the harness clock advances by the profile's iteration time): one row per
    iteration, P and D as the harness counted them, and every t_ms exactly the cost model applied
    to the row's features -- so K, sum_c2 and sum_kv_c are the ones the engine prices. Two replays
    append to one file (one header). ``profiles fit --samples`` then recovers the profile."""
    from tokenbatch_env.cli import main
    from tokenbatch_env.engine import fit
    from tokenbatch_env.engine.profiles import load_profile
    path = tmp_path / "steps.csv"
    iters = []
    for kind, seed in (("long", 0), ("prefix", 1)):
        v, s = _logged_replay(path, kind, seed)
        iters.append(v.iterations)
        assert s.tokenbatch_stats["logged_steps"] == len(v.iterations["iteration"])
    text = path.read_text()
    assert text.count("kind,") == 1 and text.splitlines()[0] == ",".join(fit.SAMPLES_COLUMNS)
    rows = fit.read_samples(path)
    it = {k: np.concatenate([i[k] for i in iters]) for k in ("prefill_tokens", "decodes", "start_ns", "end_ns")}
    assert len(rows["t_ms"]) == len(it["decodes"]) > 100
    assert (rows["P"] == it["prefill_tokens"]).all() and (rows["D"] == it["decodes"]).all()
    assert (rows["sum_kv_c"] > 0).any() and (rows["K"] > 0).any()     # prefix hits, chunks, decodes
    cost = _costed_profile().cost
    pred = cost.iteration_ns(rows["P"], rows["sum_c2"], rows["sum_kv_c"], rows["D"], rows["K"])
    assert (pred == it["end_ns"] - it["start_ns"]).all()
    assert (np.round(rows["t_ms"] * 1e6).astype(np.int64) == pred).all()
    assert (rows["kind"] == np.where(rows["D"] == 0, 0, np.where(rows["P"] == 0, 1, 2))).all()
    # the round trip: the plug-in's file is what `profiles fit --samples` reads
    out = tmp_path / "mine.json"
    assert main(["profiles", "fit", "--samples", str(path), "--name", "my-cpu", "--num-blocks", "48",
                 "--max-model-len", "752", "--no-async-scheduling", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    p = load_profile(str(out))
    assert p.provenance == "fitted (user)" and max(p.mape_pct.values()) < 0.01
    for t in ("c0", "c_prefill", "c_c2", "c_attn", "c_decode", "c_kv"):
        assert getattr(p.cost, t) == pytest.approx(getattr(cost, t), rel=1e-3)


def test_log_steps_async_features_match_the_replay(tmp_path):
    """Async: the same features per step, and each step's own time (the harness's clock reads, in
    ``update_from_output``, the end of the step whose output it is, as on a server)."""
    from tokenbatch_env.engine import fit
    path = tmp_path / "steps.csv"
    v, s = _logged_replay(path, "mix", 0, async_scheduling=True)
    rows = fit.read_samples(path)
    n = len(rows["t_ms"])
    assert s.tokenbatch_stats["logged_steps"] == n >= len(v.iterations["iteration"]) - 1 > 20
    assert (rows["P"] == v.iterations["prefill_tokens"][:n]).all()
    assert (rows["D"] == v.iterations["decodes"][:n]).all()
    its = v.iterations
    assert (np.round(rows["t_ms"] * 1e6).astype(np.int64) == (its["end_ns"] - its["start_ns"])[:n]).all()


def test_log_steps_bad_paths_fail_at_startup(tmp_path):
    from tokenbatch_env.integrations.vllm import TokenBatchPluginError
    with pytest.raises(TokenBatchPluginError, match="log_steps.*cannot write"):
        _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear", "log_steps": str(tmp_path)})
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(TokenBatchPluginError, match=r"log_steps: .*other\.csv exists and is not a samples file"):
        _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear", "log_steps": str(other)})
    assert other.read_text() == "a,b\n1,2\n"
    off = _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear"})
    assert off.tokenbatch.log_steps is None and "logged_steps" not in off.tokenbatch_stats


def test_log_steps_startup_writes_the_header_and_logs_the_fit_command(tmp_path, caplog, monkeypatch):
    import logging
    from tokenbatch_env.engine import fit
    path = tmp_path / "steps.csv"
    monkeypatch.setenv("TOKENBATCH_LOG_STEPS", str(path))    # as every setting: also from the environment
    with caplog.at_level(logging.INFO, logger=PLUGIN):
        s = _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear"})
    assert s.tokenbatch.log_steps == str(path) and s.tokenbatch_stats["logged_steps"] == 0
    assert path.read_text() == ",".join(fit.SAMPLES_COLUMNS) + "\n"
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert (f"fit with: tokenbatch profiles fit --samples {path} --name NAME --num-blocks 20 "
            "--max-model-len") in msg and "--max-num-batched-tokens 64 --max-num-seqs 4 --no-async-scheduling" in msg
    _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear"})   # appends: still one header
    assert path.read_text().count("kind,") == 1


def test_policy_file_levers_are_named_at_startup(tmp_path, caplog):
    """A policy file whose row was tuned with vLLM flags (docs/design.md section 11): the plug-in
    cannot set them itself, so it names them in one warning at startup; none for a row without."""
    import logging
    p = tmp_path / "tuned.json"
    p.write_text(json.dumps({"index": {}, "shed_margin": 0.3,
                             "levers": {"index+shed": {"max_num_batched_tokens": 512, "max_num_seqs": 64}}}))
    with caplog.at_level(logging.WARNING, logger=PLUGIN):
        _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear", "policy_file": str(p), "shed": "on"})
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "--max-num-batched-tokens 512 --max-num-seqs 64" in msg and "index+shed" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=PLUGIN):
        _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear", "policy_file": str(p)})   # shed off: "index"
    assert "vLLM flags" not in " ".join(r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- tpot-guard budget rule
#: (u, B_min) per trace kind: the rule's defaults, its most aggressive u, a floor, a generous u
GUARD_LEVERS = {"mix": (0.0, 0.0), "burst": (-0.5, 0.0), "long": (1.0, 0.25), "hol": (2.0, 0.0),
                "prefix": (0.3, 0.1)}


def _costed_guard_profile(seed, kind):
    """``linear`` (no c_c2, c_attn, c_kv) or ``stress-512`` (every term: p_t's quadratic root, the
    computed-before of partial prefills and of the waiting head's cached prefix, the decodes'
    contexts), alternating over the cases; with TPOT SLOs (us) that bind on it."""
    if (seed + len(kind)) % 2 == 0:
        return "stress-512", _costed_profile(), (7_000, 25_000)
    return "linear", "linear", (4_000, 15_000)


def guard_trace(seed, kind, t2_us):
    """``slo_trace`` with tight TPOT SLOs (``t2_us``: a range in us, near the decodes' own time)."""
    t = slo_trace(seed, kind)
    rng = np.random.default_rng(seed + 200)
    return Trace.build(arrival_ns=t.arrival_ns, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
                       ttft_slo_ns=t.ttft_slo_ns, tpot_slo_ns=rng.integers(*t2_us, len(t)) * 1000,
                       priority=t.priority, prefix_offsets=t.prefix_offsets, prefix_hashes=t.prefix_hashes)


def guard_compare(seed, kind, policy, async_scheduling, params_file, *, u=0.0, bmin=0.0, shed=None,
                  prefix_caching=True, default_tpot_ms=None, cfg_extra=None, engine_params=None):
    """The plug-in with ``budget_rule=tpot-guard`` against the engine with ``EngineConfig(budget_rule=
    "tpot-guard", budget_u=u, budget_bmin=bmin)``, and the engine's run without the rule.
    ``default_tpot_ms``: every request's TPOT SLO, given by the plug-in's ``default_tpot_slo_ms``
    instead of ``extra_args``. ``cfg_extra``: more plug-in settings (replacing u and B_min if given)."""
    name, prof, t2_us = _costed_guard_profile(seed, kind)
    tr = guard_trace(seed, kind, t2_us)
    if default_tpot_ms is not None:
        tr = Trace.build(arrival_ns=tr.arrival_ns, prompt_tokens=tr.prompt_tokens, output_tokens=tr.output_tokens,
                         ttft_slo_ns=tr.ttft_slo_ns, tpot_slo_ns=np.full(len(tr), int(default_tpot_ms * 1e6)),
                         priority=tr.priority, prefix_offsets=tr.prefix_offsets, prefix_hashes=tr.prefix_hashes)
    est = estimates(tr, PredictorSpec("noisy", 0.5, seed))
    xa = extra_args(tr, est)
    cfg = {"policy": policy, "shed": "off" if shed is None else shed, "profile": name, "t_ref_ms": T_REF_MS,
           "budget_rule": "tpot-guard", "budget_u": u, "budget_bmin": bmin}
    if default_tpot_ms is not None:
        for x in xa:
            del x["tokenbatch_tpot_slo_ms"]
        cfg["default_tpot_slo_ms"] = default_tpot_ms
    if policy not in ("fcfs", "priority"):
        cfg["policy_file"] = params_file
        ep = engine_policy(policy, params=(engine_params or PARAMS) if policy == "index" else None,
                           shed_margin=shed, t_ref_ms=T_REF_MS)
        vllm_policy, est_arg = "priority", est
    else:
        ep, vllm_policy, est_arg = None, policy, None
    cfg.update(cfg_extra or {})
    cls = f"{PLUGIN}.{'TokenBatchAsyncScheduler' if async_scheduling else 'TokenBatchScheduler'}"
    kw = dict(prefix_caching=prefix_caching, async_scheduling=async_scheduling, **budgets(seed))
    c = H.compare(tr, prof, vllm_policy, engine_policy=ep, estimates=est_arg, scheduler_cls=cls,
                  scheduler_kwargs={"tokenbatch_config": cfg}, extra_args=xa,
                  engine_config={"budget_rule": "tpot-guard", "budget_u": u, "budget_bmin": bmin}, **kw)
    off = H.engine_run(tr, prof, vllm_policy, engine_policy=ep, estimates=est_arg, **kw).records(0)
    return c, off


def _rule_changed(c: H.Comparison, off: dict) -> bool:
    """The rule's run differs from the one without it (the engine's: vLLM without the rule is the
    engine without it, ``test_sync_plugin_matches_engine``)."""
    return any((np.asarray(c.engine_records[f]) != np.asarray(off[f])).any()
               for f in ("first_token_ns", "finish_ns", "preemptions"))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["index", "fcfs", "edf", "priority"])
@pytest.mark.parametrize("seed", range(3))
def test_tpot_guard_plugin_matches_engine(seed, policy, async_scheduling, params_file):
    """budget_rule=tpot-guard: the plug-in's B_t and vLLM's schedule with it give the engine's run,
    request by request, over every kind at several (u, B_min); the index and EDF also shed."""
    changed = 0
    for kind in KINDS:
        u, bmin = GUARD_LEVERS[kind]
        shed = 0.5 if policy in ("index", "edf") and kind in ("burst", "prefix") else None
        c, off = guard_compare(seed, kind, policy, async_scheduling, params_file, u=u, bmin=bmin, shed=shed)
        assert_identical(c)
        changed += _rule_changed(c, off)
    assert changed >= 2   # the SLOs bind: the rule changes the schedule (else this test proves nothing)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tpot_guard_plugin_default_tpot_slo_and_no_prefix_caching(async_scheduling, params_file):
    """A request without ``tokenbatch_tpot_slo_ms`` takes ``default_tpot_slo_ms``; without prefix
    caching the waiting head holds no cached tokens."""
    changed = 0
    for policy, kind in (("index", "mix"), ("fcfs", "long"), ("edf", "prefix"), ("fcfs", "burst")):
        c, off = guard_compare(4, kind, policy, async_scheduling, params_file, default_tpot_ms=9.0)
        assert_identical(c)
        changed += _rule_changed(c, off)
        c, off = guard_compare(5, kind, policy, async_scheduling, params_file, u=0.5, prefix_caching=False)
        assert_identical(c)
        changed += _rule_changed(c, off)
    assert changed >= 4


GUARD_PARAMS = IndexParams(kappa=2.0, slope=1.0, gamma=10.0, theta=0.3, beta=3.0, w_prefix=0.5, a_edf=1.0)


@pytest.fixture(scope="module")
def guard_params_file(tmp_path_factory):
    """A tuning file with ``+tpot-guard`` twins: their own index parameters and shed margin under
    ``"tpot-guard"``, their u and B_min (and one flag) under ``"levers"``."""
    p = tmp_path_factory.mktemp("tbg") / "tuned_guard.json"
    p.write_text(json.dumps({
        "index": PARAMS.__dict__, "shed_margin": 0.5, "edf": {"shed_margin": 0.5},
        "tpot-guard": {"index": GUARD_PARAMS.__dict__, "shed_margin": 0.25},
        "levers": {"index+shed+tpot-guard": {"budget_u": 0.6, "budget_bmin": 0.15, "max_num_seqs": 4},
                   "fcfs+tpot-guard": {"budget_u": -0.25}},
        "meta": {"t_ref_ms": T_REF_MS}}))
    return str(p)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tpot_guard_plugin_takes_the_twins_parameters_from_the_policy_file(async_scheduling, guard_params_file):
    """With the rule on, ``shed=on`` and a file holding the ``index+shed+tpot-guard`` twin, the
    plug-in runs the twin's index parameters, shed margin, u and B_min: the engine's run with them."""
    for seed, kind in ((0, "burst"), (1, "prefix"), (2, "mix")):
        c, off = guard_compare(seed, kind, "index", async_scheduling, guard_params_file, u=0.6, bmin=0.15,
                               shed=0.25, engine_params=GUARD_PARAMS,
                               cfg_extra={"policy_file": guard_params_file, "shed": "on",
                                          "budget_u": None, "budget_bmin": None})
        assert_identical(c)


def test_tpot_guard_settings_from_the_policy_file(guard_params_file, caplog):
    import logging
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue, SchedulingPolicy
    base = {"profile": "linear", "policy_file": guard_params_file}
    with caplog.at_level(logging.INFO, logger=PLUGIN):
        s = _make(f"{PLUGIN}.TokenBatchScheduler", {**base, "shed": "on", "budget_rule": "tpot-guard"})
    cfg = s.tokenbatch
    assert (cfg.budget_rule, cfg.budget_u, cfg.budget_bmin, cfg.shed_margin) == ("tpot-guard", 0.6, 0.15, 0.25)
    assert cfg.index_params == GUARD_PARAMS and cfg.default_tpot_slo_ms is None
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "budget rule tpot-guard (u 0.6, B_min 0.15" in msg
    assert "index+shed+tpot-guard's parameters" in msg and "--max-num-seqs 4" in msg
    # explicit settings win; without the rule the file's plain rows hold
    s = _make(f"{PLUGIN}.TokenBatchScheduler", {**base, "shed": "on", "budget_rule": "tpot-guard",
                                                "budget_u": "1.5", "budget_bmin": 0})
    assert (s.tokenbatch.budget_u, s.tokenbatch.budget_bmin) == (1.5, 0.0)
    s = _make(f"{PLUGIN}.TokenBatchScheduler", {**base, "shed": "on"})
    cfg = s.tokenbatch
    assert (cfg.budget_rule, cfg.shed_margin, cfg.index_params) == ("none", 0.5, PARAMS)
    assert "tpot-guard" not in cfg.label and s.tokenbatch_last_budget == 64
    # fcfs with the rule: vLLM's own FCFS queue (no ranking), u from the file's fcfs+tpot-guard row
    s = _make(f"{PLUGIN}.TokenBatchScheduler", {**base, "policy": "fcfs", "budget_rule": "tpot-guard"})
    assert s.policy == SchedulingPolicy.FCFS and isinstance(s.waiting, FCFSRequestQueue)
    assert (s.tokenbatch.budget_u, s.tokenbatch.budget_bmin, s.tokenbatch.ranked) == (-0.25, 0.0, False)
    s = _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear", "policy": "priority",
                                                "budget_rule": "tpot-guard"})
    assert s.policy == SchedulingPolicy.PRIORITY and s.tokenbatch.label == "priority+tpot-guard"


def test_tpot_guard_settings_from_environment_and_additional_config(monkeypatch):
    monkeypatch.setenv("TOKENBATCH_BUDGET_RULE", "tpot-guard")
    monkeypatch.setenv("TOKENBATCH_BUDGET_U", "0.5")
    monkeypatch.setenv("TOKENBATCH_DEFAULT_TPOT_SLO_MS", "40")
    s = _make(f"{PLUGIN}.TokenBatchAsyncScheduler", async_scheduling=True,
              additional_config={"tokenbatch": {"policy": "edf", "profile": "linear", "budget_bmin": 0.5}})
    cfg = s.tokenbatch
    assert (cfg.policy, cfg.budget_rule, cfg.budget_u, cfg.budget_bmin, cfg.default_tpot_slo_ms) == \
        ("edf", "tpot-guard", 0.5, 0.5, 40.0)
    monkeypatch.setenv("TOKENBATCH_DEFAULT_TPOT_SLO_MS", "none")
    monkeypatch.setenv("TOKENBATCH_BUDGET_RULE", "none")
    monkeypatch.delenv("TOKENBATCH_BUDGET_U")
    s = _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear"})
    assert (s.tokenbatch.budget_rule, s.tokenbatch.default_tpot_slo_ms) == ("none", None)


@pytest.mark.parametrize("cfg,match", [
    ({"budget_rule": "slo-guard"}, r"budget_rule.*unknown budget_rule 'slo-guard'"),
    ({"budget_rule": "tpot-guard", "budget_u": 3},
     r"tokenbatch_config\.budget_u: budget_u must be a number in \[-0\.5, 2\]"),
    ({"budget_rule": "tpot-guard", "budget_u": -0.6}, r"budget_u must be a number in"),
    ({"budget_rule": "tpot-guard", "budget_u": "fast"}, r"budget_u must be a number in"),
    ({"budget_rule": "tpot-guard", "budget_u": True}, r"budget_u must be a number in"),
    ({"budget_rule": "tpot-guard", "budget_bmin": 1.5}, r"budget_bmin must be a number in \[0, 1\]"),
    ({"budget_rule": "tpot-guard", "budget_bmin": "nan"}, r"budget_bmin must be a number in"),
    ({"budget_u": 0.5}, r"tokenbatch_config\.budget_u: budget_u is a parameter of budget_rule tpot-guard"),
    ({"budget_rule": "none", "budget_bmin": 0.5}, r"budget_bmin is a parameter of budget_rule tpot-guard"),
    ({"default_tpot_slo_ms": 0}, r"default_tpot_slo_ms: expected a finite number > 0"),
    ({"default_tpot_slo_ms": "soon"}, r"default_tpot_slo_ms: expected a number"),
    ({"policy": "fcfs", "budget_rule": "tpot-guard", "shed": "0.5"}, r"shed.*needs a TokenBatch policy"),
    ({"policy": "priority"}, r"only with budget_rule tpot-guard"),
])
def test_bad_tpot_guard_settings_fail_at_startup(cfg, match):
    from tokenbatch_env.integrations.vllm import TokenBatchPluginError
    with pytest.raises(TokenBatchPluginError, match=match):
        _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear", **cfg})


def test_bad_tpot_guard_setting_from_the_environment_names_the_variable(monkeypatch):
    from tokenbatch_env.integrations.vllm import TokenBatchPluginError
    monkeypatch.setenv("TOKENBATCH_BUDGET_RULE", "tpot-guard")
    monkeypatch.setenv("TOKENBATCH_BUDGET_BMIN", "2")
    with pytest.raises(TokenBatchPluginError, match="environment variable TOKENBATCH_BUDGET_BMIN"):
        _make(f"{PLUGIN}.TokenBatchScheduler", {"profile": "linear"})


def test_tpot_guard_lowers_vllm_budget_only_for_the_step():
    """vLLM's per-step token budget (``max_num_scheduled_tokens``) is B_t during ``schedule()`` and
    B again afterwards; the lowered steps are counted."""
    from tokenbatch_env.integrations.vllm import TokenBatchScheduler
    seen = []

    class Spy(TokenBatchScheduler):
        def _update_after_schedule(self, so):
            seen.append((self.max_num_scheduled_tokens, self.tokenbatch_last_budget, so.total_num_scheduled_tokens))
            super()._update_after_schedule(so)
    name, prof, t2_us = _costed_guard_profile(0, "long")
    tr = guard_trace(0, "long", t2_us)
    holder = {}

    class Keep(Spy):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            holder["s"] = self
    H.replay(tr, prof, "fcfs", scheduler_cls=Keep, extra_args=extra_args(tr, np.ones(len(tr))),
             scheduler_kwargs={"tokenbatch_config": {"policy": "fcfs", "profile": name, "budget_rule": "tpot-guard"}},
             **budgets(0))
    s = holder["s"]
    B = s._tb_budget
    assert s.max_num_scheduled_tokens == B
    assert all(during == bt and tot <= bt for during, bt, tot in seen)
    lowered = sum(bt < B for _, bt, _ in seen)
    assert lowered == s.tokenbatch_stats["budget_lowered"] > 0
