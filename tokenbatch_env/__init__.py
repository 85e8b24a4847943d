"""TokenBatch: an open lab for LLM-serving request scheduling.

Importing this package is light: numpy and gymnasium only (no torch, stable-baselines3 or Optuna).
It registers the Gymnasium environments ``TokenBatch-v0``, ``TokenBatch-v1`` and ``TokenBatchCluster-v0``
(``tokenbatch_env.envs``, imported lazily by ``gym.make`` / ``gym.make_vec``).
"""

__version__ = "0.2.0.dev0"

from .errors import ConfigError, PolicyError, ProfileError, TokenBatchError, TraceError
from .traces import Trace

__all__ = ["__version__", "Trace", "TokenBatchError", "TraceError", "ConfigError", "ProfileError",
           "PolicyError"]


def _register_envs() -> None:
    try:
        from gymnasium.envs.registration import register, registry
    except ImportError:  # pragma: no cover - gymnasium is a runtime dependency
        return
    if "TokenBatch-v0" not in registry:
        register(id="TokenBatch-v0", entry_point="tokenbatch_env.envs:TokenBatchEnv",
                 vector_entry_point="tokenbatch_env.envs:make_vector_env")
    if "TokenBatch-v1" not in registry:   # v0 with the tpot-guard budget rule (docs/design.md section 11)
        register(id="TokenBatch-v1", entry_point="tokenbatch_env.envs:TokenBatchEnv",
                 vector_entry_point="tokenbatch_env.envs:make_vector_env", kwargs={"tpot_guard": True})
    if "TokenBatchCluster-v0" not in registry:   # routing a cluster's arrivals (docs/design.md section 12)
        register(id="TokenBatchCluster-v0", entry_point="tokenbatch_env.envs.cluster_env:TokenBatchClusterEnv",
                 vector_entry_point="tokenbatch_env.envs.cluster_env:make_cluster_vector_env")


_register_envs()
