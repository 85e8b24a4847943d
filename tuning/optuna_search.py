#!/usr/bin/env python
"""Tune the index, the baselines' shed margins and the comparators on a suite's TRAIN split (Optuna).

The same as ``tokenbatch tune`` (tokenbatch_env/tune_cli.py; the options are TuneConfig's fields in
tokenbatch_env/tuning.py): see ``--help``. Messages are prefixed ``optuna_search.py:``.
"""

import sys

from tokenbatch_env.tune_cli import main

if __name__ == "__main__":
    sys.exit(main(prog="optuna_search.py", cmd="python tuning/optuna_search.py"))
