"""Shared fixtures. Tests that read ../shared skip on a user's clone (no ../shared) and fail in CI,
where .ci/run sets TOKENBATCH_REQUIRE_SHARED=1."""

from __future__ import annotations

import os
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
