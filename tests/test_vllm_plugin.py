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
    ({"policy": "fcfs"}, "unknown policy"),
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
    """Async: the same features per step. (The harness's clock moves when a step is scheduled, so
    its t_ms is the next step's period there; on a server it is the step's own.)"""
    from tokenbatch_env.engine import fit
    path = tmp_path / "steps.csv"
    v, s = _logged_replay(path, "mix", 0, async_scheduling=True)
    rows = fit.read_samples(path)
    n = len(rows["t_ms"])
    assert s.tokenbatch_stats["logged_steps"] == n >= len(v.iterations["iteration"]) - 1 > 20
    assert (rows["P"] == v.iterations["prefill_tokens"][:n]).all()
    assert (rows["D"] == v.iterations["decodes"][:n]).all()
    assert (rows["t_ms"] > 0).all()


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
