"""Reproduce the plug-in agreement figures of docs/vllm_plugin.md: TokenBatch policies inside vLLM's
real scheduler (the plug-in) against the same policies in the engine, on 1,920 generated traces
(seeds 0-5 x 5 kinds x index/edf/sjf/llf x shed on/off x sync/async x prefix caching on/off x
tied/distinct arrivals); with ``--tpot-guard``, the tpot-guard budget rule on both sides on 720
(seeds 0-5 x 5 kinds x index/edf/sjf/llf/fcfs/priority x sync/async x prefix caching on/off, (u,
B_min) cycling over ``GUARD_SETTINGS``, shedding at margin 0.5 in every other score-policy case),
also counting the runs the rule changed.

    python tools/plugin_sweep.py               # needs the vllm extra; several minutes
    python tools/plugin_sweep.py --tpot-guard  # about a minute and a half
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_vllm_plugin import KINDS, PARAMS, T_REF_MS, plugin_compare

#: (u, B_min) of the --tpot-guard sweep, in turn
GUARD_SETTINGS = ((0.0, 0.0), (-0.5, 0.0), (1.0, 0.25), (2.0, 0.0), (0.3, 0.1), (0.5, 0.5))


def guard_sweep(params: str) -> int:
    from test_vllm_plugin import _rule_changed, guard_compare
    rows, i = {}, 0
    for asy in (False, True):
        for pc in (True, False):
            ok = n = changed = 0
            for seed in range(6):
                for kind in KINDS:
                    for pol in ("index", "edf", "sjf", "llf", "fcfs", "priority"):
                        u, bmin = GUARD_SETTINGS[i % len(GUARD_SETTINGS)]
                        shed = 0.5 if pol not in ("fcfs", "priority") and i % 2 == 0 else None
                        i += 1
                        c, off = guard_compare(seed, kind, pol, asy, params, u=u, bmin=bmin, shed=shed,
                                               prefix_caching=pc)
                        ok += not c.divergences
                        changed += _rule_changed(c, off)
                        n += 1
            rows[(asy, pc)] = (ok, n, changed)
            print(f"{'async' if asy else 'sync'}, prefix caching {'on' if pc else 'off'}: {ok}/{n} identical, "
                  f"{changed} changed by the rule", flush=True)
    ok, n, changed = (sum(v[j] for v in rows.values()) for j in range(3))
    print(f"all: {ok}/{n} identical, {changed} changed by the rule")
    return 0 if ok == n else 1


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        params = Path(d) / "tuned.json"
        params.write_text(json.dumps({"index": PARAMS.__dict__, "shed_margin": 0.5,
                                      "edf": {"shed_margin": 0.5}, "meta": {"t_ref_ms": T_REF_MS}}))
        if "--tpot-guard" in sys.argv[1:]:
            return guard_sweep(str(params))
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
