"""Reproduce the agreement table of docs/fidelity.md: 30 generated traces (seeds 0-5 x 5 kinds) per
configuration, through vLLM 0.33's real scheduler and the engine.

    python tools/fidelity_sweep.py            # needs the vllm extra (docs/fidelity.md); ~3 min
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_fidelity import H, KINDS, budgets, gen

from tokenbatch_env.policies import vllm_modes

#: the threshold of the second half of the table: below most prompts and the budgets (64-256)
THRESHOLD = 24


def main() -> int:
    total = same = 0
    print("| configuration | arrival ties allowed | distinct arrivals |\n| --- | --- | --- |")
    for thr in (0, THRESHOLD):
        for asy in (False, True):
            for pol in vllm_modes():
                cells = []
                for pc in (True, False):
                    for distinct in (False, True):
                        ok = 0
                        for seed in range(6):
                            for kind in KINDS:
                                c = H.compare(gen(seed, kind, distinct=distinct), "linear", pol,
                                              prefix_caching=pc, async_scheduling=asy,
                                              long_prefill_token_threshold=thr, **budgets(seed))
                                ok += not c.divergences
                        cells.append(f"{ok}/30")
                        total += 30
                        same += ok
                what = f", long_prefill_token_threshold {thr}" if thr else ""
                print(f"| {'async' if asy else 'sync'} {pol}{what}, prefix caching on / off | "
                      f"{cells[0]}, {cells[2]} | {cells[1]}, {cells[3]} |")
    print(f"\n{same} of {total} traces identical")
    return 0 if same == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
