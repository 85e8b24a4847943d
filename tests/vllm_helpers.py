"""Shared set-up of the tests that drive vLLM's real scheduler: skip with the reason when vllm is not
importable; fail instead under TOKENBATCH_REQUIRE_VLLM=1 or TOKENBATCH_REQUIRE_EXTRAS=1 (as CI sets)."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before anything imports vllm

from tokenbatch_env.integrations import vllm_harness as H

_REASON = H.vllm_import_error()
for _flag in ("TOKENBATCH_REQUIRE_VLLM", "TOKENBATCH_REQUIRE_EXTRAS"):
    if _REASON is not None and os.environ.get(_flag) == "1":
        raise RuntimeError(f"{_flag}=1 but vllm is not importable: {_REASON}")

VLLM_MARKS = [pytest.mark.vllm,
              pytest.mark.skipif(_REASON is not None,
                                 reason=f"vllm not importable ({_REASON}): needs the 'vllm' extra, "
                                        "pip install -e '.[vllm]' (see docs/fidelity.md)")]
