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
