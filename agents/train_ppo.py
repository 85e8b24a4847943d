#!/usr/bin/env python
"""Train a PPO agent (stable-baselines3) on TokenBatch-v0 (or v1, --tpot-guard) as a challenger to the tuned index,
or with ``--env cluster`` a PPO or MaskablePPO router on TokenBatchCluster-v0.

The same as ``tokenbatch train`` (tokenbatch_env/agents/train.py; the options are TrainConfig's
fields) and ``tokenbatch train-router`` (tokenbatch_env/agents/train_router.py, RouterTrainConfig's):
see ``--help`` and ``--env cluster --help``. Messages are prefixed ``train_ppo.py:``.
"""

import sys

from tokenbatch_env.agents.env_choice import main

if __name__ == "__main__":
    sys.exit(main(prog="train_ppo.py", cmd="python agents/train_ppo.py"))
