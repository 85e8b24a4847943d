"""Reproduce the plug-in agreement figure of docs/vllm_plugin.md: TokenBatch policies inside vLLM's
real scheduler (the plug-in) against the same policies in the engine, on 1,920 generated traces
(seeds 0-5 x 5 kinds x index/edf/sjf/llf x shed on/off x sync/async x prefix caching on/off x
tied/distinct arrivals).

    python tools/plugin_sweep.py            # needs the vllm extra; several minutes
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_vllm_plugin import KINDS, PARAMS, T_REF_MS, plugin_compare


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        params = Path(d) / "tuned.json"
        params.write_text(json.dumps({"index": PARAMS.__dict__, "shed_margin": 0.5,
                                      "edf": {"shed_margin": 0.5}, "meta": {"t_ref_ms": T_REF_MS}}))
        rows = {}
        for asy in (False, True):
            for pc in (True, False):
                ok = n = 0
                for seed in range(6):
                    for kind in KINDS:
                        for pol in ("index", "edf", "sjf", "llf"):
                            for shed in (None, 0.5):
                                for distinct in (True, False):
                                    c = plugin_compare(seed, kind, pol, shed, asy, str(params),
                                                       prefix_caching=pc, distinct=distinct)
                                    ok += not c.divergences
                                    n += 1
                rows[(asy, pc)] = (ok, n)
                print(f"{'async' if asy else 'sync'}, prefix caching {'on' if pc else 'off'}: {ok}/{n}",
                      flush=True)
    ok = sum(v[0] for v in rows.values())
    n = sum(v[1] for v in rows.values())
    print(f"all: {ok}/{n}")
    return 0 if ok == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
