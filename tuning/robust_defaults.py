#!/usr/bin/env python
"""Tune the robust defaults: the index's parameters used when none are given, over a mixture of
deployments, on train splits only (docs/design.md section 10; the library is tokenbatch_env/robust.py).

    python tuning/robust_defaults.py                 # writes runs/robust/
    python tuning/robust_defaults.py --install       # ... and tokenbatch_env/data/params/robust-defaults.json
"""

import sys

from tokenbatch_env.robust import main

if __name__ == "__main__":
    sys.exit(main())
