"""What users script against stays put: the public Python API under its names and parameters,
``report.json``'s field names (additions only), and the commands' ``--help`` and error lines."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "api"

#: module -> {name: parameter names (None: a class, or not a function)}
PUBLIC = {
    "tokenbatch_env": {"Trace": None, "TokenBatchError": None, "TraceError": None, "ConfigError": None,
                       "ProfileError": None, "PolicyError": None},
    "tokenbatch_env.traces": {"Trace": None, "block_hash": None},
    "tokenbatch_env.traces.io": {"load_trace": None, "save_trace": None},
    "tokenbatch_env.traces.sla": {"ttft_idle_ns": ("prompt_tokens", "profile")},
    "tokenbatch_env.engine.profiles": {"load_profile": None},
    "tokenbatch_env.engine.simulate": {"simulate": None, "EngineRun": None},
    "tokenbatch_env.metrics": {"paired_difference": None, "win_rate": None},
    "tokenbatch_env.integrations.vllm_harness": {"engine_run": None},
    "tokenbatch_env.policies": {"IndexParams": None, "engine_policy": None, "score_request_priority": None},
    "tokenbatch_env.envs": {"TokenBatchEnv": None, "TokenBatchVectorEnv": None, "TokenBatchConfig": None},
    "tokenbatch_env.evaluate": {"BenchConfig": None, "run_benchmark": ("config",)},
}


def test_public_names_importable():
    import importlib
    for mod, names in PUBLIC.items():
        m = importlib.import_module(mod)
        for name, params in names.items():
            assert hasattr(m, name), f"{mod}.{name} is gone"
            if params is not None:
                assert tuple(inspect.signature(getattr(m, name)).parameters) == params, f"{mod}.{name}"


def test_trace_methods():
    from tokenbatch_env import Trace
    assert callable(Trace.replace)
    assert isinstance(inspect.getattr_static(Trace, "digest"), (property, type(Trace.replace))) or \
        hasattr(Trace, "digest")


def key_paths(x, prefix: str = "") -> set:
    """Every key path of a JSON document (list elements merged as ``[]``)."""
    out = set()
    if isinstance(x, dict):
        for k, v in x.items():
            p = f"{prefix}.{k}" if prefix else k
            out.add(p)
            out |= key_paths(v, p)
    elif isinstance(x, list):
        for v in x:
            out |= key_paths(v, prefix + "[]")
    return out


def test_key_paths():
    assert key_paths({"a": [{"b": 1}, {"c": 2}], "d": 3}) == {"a", "a[].b", "a[].c", "d"}


def test_report_json_keeps_its_fields(tmp_path):
    """A bench report has every field path the pinned report had (new ones may be added)."""
    from tokenbatch_env import cli
    fx = json.loads((FIXTURES / "report_fields.json").read_text())
    out = tmp_path / "bench"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main([*fx["bench"]["argv"], "--max-traces", "3", "--bootstrap-b", "200", "--out", str(out)])
    assert rc == 0
    have = key_paths(json.loads((out / "report.json").read_text()))
    missing = sorted(set(fx["bench"]["paths"]) - have)
    assert missing == []


def test_tuning_report_keeps_its_fields():
    """The tuning report's top-level fields are written by one function: pinned by name."""
    import ast
    fx = json.loads((FIXTURES / "report_fields.json").read_text())
    src = inspect.getsource(__import__("tokenbatch_env.tuning", fromlist=["x"]))
    keys = {n.value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert set(fx["tune_top_level"]) <= keys


SNAP = json.loads((FIXTURES / "cli_snapshot.json").read_text())


@pytest.mark.skipif("%d.%d" % sys.version_info[:2] != SNAP["python"],
                    reason=f"argparse's help layout is pinned on Python {SNAP['python']}")
@pytest.mark.parametrize("case", sorted(SNAP["cases"]))
def test_cli_help_and_errors_unchanged(case, monkeypatch):
    from tokenbatch_env import cli
    monkeypatch.setenv("COLUMNS", str(SNAP["columns"]))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            rc = cli.main(case.split(" "))
        except SystemExit as ex:
            rc = ex.code
    want = SNAP["cases"][case]
    assert rc == want["rc"]
    assert e.getvalue() == want["stderr"]
    if case.endswith("--help"):
        assert o.getvalue() == want["stdout"]
