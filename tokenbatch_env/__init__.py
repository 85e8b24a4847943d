"""TokenBatch: an open lab for LLM-serving request scheduling.

Importing this package is light: numpy only (no torch, stable-baselines3 or Optuna).
"""

__version__ = "0.1.0"

from .errors import ConfigError, PolicyError, ProfileError, TokenBatchError, TraceError  # noqa: E402
from .traces import Trace  # noqa: E402

__all__ = ["__version__", "Trace", "TokenBatchError", "TraceError", "ConfigError", "ProfileError",
           "PolicyError"]
