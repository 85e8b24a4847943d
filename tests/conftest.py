"""Shared fixtures. Tests that read ../shared skip on a user's clone (no ../shared) and fail in CI,
where .ci/run sets TOKENBATCH_REQUIRE_SHARED=1. Likewise tests that need an optional extra (rl, tune,
vllm) skip without it, the reason naming the extra, and fail under TOKENBATCH_REQUIRE_EXTRAS=1 (CI,
which installs them all)."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("TOKENBATCH_SHARED", ROOT.parent / "shared"))


def shared_path(*parts: str) -> Path:
    """Path inside ../shared, or skip (fail under TOKENBATCH_REQUIRE_SHARED=1) when absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        msg = (f"{p} not found: the real traces and calibration data live in ../shared beside the "
               f"checkout (set TOKENBATCH_SHARED to point elsewhere)")
        if os.environ.get("TOKENBATCH_REQUIRE_SHARED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return p


@pytest.fixture
def shared():
    return shared_path


def heavy_modules_loaded(module: str, heavy=("torch", "stable_baselines3", "optuna")) -> list:
    """Which of ``heavy`` a fresh interpreter has loaded after ``import module`` (should be none)."""
    import subprocess
    import sys

    code = f"import sys, {module}; print(','.join(m for m in {tuple(heavy)!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    return [m for m in out.stdout.strip().split(",") if m]


# The optional modules tests import, and the extra (pyproject.toml) that installs each.
EXTRAS = {"torch": "rl", "stable_baselines3": "rl", "sb3_contrib": "rl", "tensorboard": "rl", "rich": "rl",
          "optuna": "tune", "cmaes": "tune", "psycopg2": "tune", "vllm": "vllm"}


def _require_extras() -> bool:
    return os.environ.get("TOKENBATCH_REQUIRE_EXTRAS") == "1"


def _missing_extra_message(module: str, error) -> str:
    extra = EXTRAS[module.split(".")[0]]
    return (f"{module} not importable ({error}): needs the {extra!r} extra, pip install -e '.[{extra}]'"
            + (" (see docs/fidelity.md)" if extra == "vllm" else ""))


def require_extra(module: str):
    """Import ``module`` (one of an extra's, see ``EXTRAS``) and return it, or skip the test (or the
    module, at module level) with the extra's name; under TOKENBATCH_REQUIRE_EXTRAS=1 fail instead.

    Args:
        module: the module to import, e.g. ``"stable_baselines3"`` or ``"optuna.samplers"``.

    Returns:
        The imported module.
    """
    __tracebackhide__ = True   # (the skip reported at the caller's line)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        msg = _missing_extra_message(module, e)
    if _require_extras():
        pytest.fail(f"TOKENBATCH_REQUIRE_EXTRAS=1 but {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)


# pytest.importorskip's own reason, for the test files that call it directly on an extra's module:
# the hooks below name the extra in the skip, or turn the skip into a failure under
# TOKENBATCH_REQUIRE_EXTRAS=1 (so that CI cannot pass with an extra silently missing).
_IMPORTORSKIP = re.compile(r"could not import '([\w.]+)': (.*)", re.S)


def _extra_skip(report) -> None:
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    path, lineno, reason = report.longrepr
    m = _IMPORTORSKIP.search(reason)
    if m is None or m.group(1).split(".")[0] not in EXTRAS:
        return
    msg = _missing_extra_message(m.group(1), m.group(2))
    if _require_extras():
        report.outcome = "failed"
        report.longrepr = f"{path}:{lineno}: TOKENBATCH_REQUIRE_EXTRAS=1 but {msg}"
    else:
        report.longrepr = (path, lineno, f"Skipped: {msg}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _extra_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _extra_skip(outcome.get_result())
