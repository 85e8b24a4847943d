"""The Gymnasium environments: ``TokenBatchVectorEnv`` (N engine copies stepped as one batch) and
``TokenBatchEnv`` (the vector env with one copy). docs/design.md section 5 is the MDP; the class
docstring of ``TokenBatchEnv`` states it in Gymnasium's sections.

There is one implementation of the dynamics: ``core.Core`` drives one ``engine.simulate.EngineRun``
over all copies, and the engine itself runs each copy to its next decision epoch
(``EngineRun.advance_to_decision``); the copies that start new episodes get their windows laid out
together from the suite's units stacked as arrays (``episodes.EpisodeTable``: exactly the engine's
own ``build_arrays`` of those windows) and spliced into the batch; episode metrics are computed for
all the copies that ended at once. Workload preparation (suite traces, lambda_sat, the residual-life
table, T_ref, the predictor and its estimates, time scaling to rho) is ``workload.prepare_workload``
/ ``Workload``, the evaluator's own, so agents and baselines see the same windows.

The modules, lowest first: ``config`` (``TokenBatchConfig`` and its validation), ``actions`` (the
action modes, ``map_actions``), ``observation`` (``OBS_LAYOUT``, ``observe``, the normalisation
constants), ``rewards`` (the reward modes' ``REGISTRY``), ``episodes`` (new episodes laid out into
the batch, episode metrics), ``core`` (the batched core) and ``env`` (the two env classes). Every
public name is importable from here.
"""

from __future__ import annotations

from .actions import (ACTION_MODES, ACTION_NAMES, WEIGHT_ACTION_NAMES, ActionError, as_numbers,
                      map_actions)
from .config import TokenBatchConfig, autoreset_mode_of
from .core import Core
from .env import THREADS_MIN_COPIES, TokenBatchEnv, TokenBatchVectorEnv, default_threads, make_vector_env
from .episodes import EPISODE_COUNTS, RECORD_FIELDS, TRACE_FIELDS, EpisodeTable
from .observation import (F, LOG_QUEUE_SCALE, LOG_REQ_TOKENS_SCALE, LOG_S_SCALE, LOG_TOKENS_SCALE, N_ENGINE,
                          N_GLOBAL, NQ, OBS_CLIP, OBS_LAYOUT, QUANTILES, RATE_WINDOW_S, REQ_FEATURES, Z_SCALE,
                          obs_dim, obs_layout, obs_scales, observe)
from .rewards import REGISTRY as REWARD_REGISTRY
from .rewards import REWARD_MODES, RewardMode

__all__ = ["TokenBatchConfig", "TokenBatchEnv", "TokenBatchVectorEnv", "ActionError", "OBS_LAYOUT",
           "ACTION_NAMES", "WEIGHT_ACTION_NAMES", "make_vector_env",
           # (beside the env's own names: what the controlled replay, the SB3 adapter and tests use)
           "ACTION_MODES", "REWARD_MODES", "REWARD_REGISTRY", "RewardMode", "as_numbers", "map_actions",
           "autoreset_mode_of", "Core", "THREADS_MIN_COPIES", "default_threads", "EPISODE_COUNTS", "RECORD_FIELDS",
           "TRACE_FIELDS", "EpisodeTable", "F", "LOG_QUEUE_SCALE", "LOG_REQ_TOKENS_SCALE", "LOG_S_SCALE",
           "LOG_TOKENS_SCALE", "N_ENGINE", "N_GLOBAL", "NQ", "OBS_CLIP", "QUANTILES", "RATE_WINDOW_S",
           "REQ_FEATURES", "Z_SCALE", "obs_dim", "obs_layout", "obs_scales", "observe"]
