"""The configuration of TokenBatch-v0 (docs/design.md section 5): ``TokenBatchConfig``, one frozen
dataclass validated on construction (``ConfigError`` names the field), and the checks it shares with
the envs (``is_int``, ``is_num``, ``autoreset_mode_of``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
from gymnasium.vector import AutoresetMode

from ..errors import ConfigError
from .actions import ACTION_MODES, action_names
from .rewards import REWARD_MODES


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def is_num(x) -> bool:
    """A real number (Python or numpy int or float), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def autoreset_mode_of(value) -> AutoresetMode:
    """``value`` as a ``gymnasium.vector.AutoresetMode`` (the member, or its name or value in any
    case, ``-`` for ``_``), else ``ConfigError``."""
    am = value
    if isinstance(am, str):
        by_name = {m.name.lower(): m for m in AutoresetMode} | {m.value.lower(): m for m in AutoresetMode}
        am = by_name.get(am.lower().replace("-", "_"), am)
    if not isinstance(am, AutoresetMode):
        raise ConfigError(f"autoreset_mode: must be one of {[m.name for m in AutoresetMode]} "
                          f"(gymnasium.vector.AutoresetMode), got {value!r}")
    return am


#: bounds of the counts and the decision interval (the engine's clocks and counters are int64)
_MAX_COUNT = 2 ** 62
_MAX_INTERVAL_MS = 1e9


@dataclasses.dataclass(frozen=True)
class TokenBatchConfig:
    """Everything that defines a TokenBatch-v0 environment (validated; ConfigError names the field).

    ``rho``: a number or ``(low, high)``; each episode draws rho uniformly from it.
    ``predictor``: None = the suite's; else a kind (``"oracle"``, ``"noisy"``, ``"prior"``) or a dict
    ``{kind, sigma, seed}``. ``base_params``: a tuned-parameters JSON (the evaluator's ``--params``
    format) giving theta*; else ``IndexParams()`` defaults and ``shed_margin``. ``shed_margin``:
    the base shed margin when the JSON gives none (None or inf = no shedding; the shed action
    dimension is then ignored). ``shed_action``: False drops the shed-margin dimension from the
    action, which then stays at the base margin. ``max_steps``: decision-step cap per episode (truncation);
    ``max_iterations``: engine iteration cap per episode (truncation). ``tpot_guard`` (TokenBatch-v1):
    the engine runs the tpot-guard budget rule, the action gains its u and B_min, the observation
    the TPOT state (docs/design.md section 11)."""

    suite: str = "seed-200"
    split: str = "train"
    profile: str = "stress-512"
    rho: Any = (0.8, 1.5)
    window: int = 128
    warmup: int = 32
    cooldown: int = 32
    decision_interval_ms: float = 100.0
    k: int = 8
    action_mode: str = "index"
    predictor: Any = None
    reward_mode: str = "certain_miss"
    autoreset_mode: Any = AutoresetMode.NEXT_STEP
    seed: Optional[int] = None
    base_params: Optional[str] = None
    shed_margin: Optional[float] = 0.0
    clip_actions: bool = False
    shed_action: bool = True
    max_steps: int = 20_000
    max_iterations: int = 2_000_000
    tpot_guard: bool = False

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for f in ("suite", "split", "profile"):
            if not isinstance(getattr(self, f), str) or not getattr(self, f):
                raise ConfigError(f"{f}: must be a non-empty string, got {getattr(self, f)!r}")
        rho = self.rho
        if is_num(rho):
            rho = (rho, rho)
        if not (isinstance(rho, (tuple, list)) and len(rho) == 2 and all(is_num(x) for x in rho)):
            raise ConfigError(f"rho: must be a positive number or a (low, high) pair, got {self.rho!r}")
        lo, hi = float(rho[0]), float(rho[1])
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
            raise ConfigError(f"rho: need 0 < low <= high (finite), got {self.rho!r}")
        set_("rho", (lo, hi))
        for f, low in (("window", 1), ("warmup", 0), ("cooldown", 0), ("k", 1), ("max_steps", 1),
                       ("max_iterations", 1)):
            v = getattr(self, f)
            if not is_int(v) or v < low:
                raise ConfigError(f"{f}: must be an integer >= {low}, got {v!r}")
            if v > _MAX_COUNT:   # (the engine counts in int64)
                raise ConfigError(f"{f}: must be at most 2**62, got {v!r}")
            set_(f, int(v))
        d = self.decision_interval_ms
        if (not is_num(d) or not math.isfinite(float(d)) or float(d) <= 0 or float(d) * 1e6 < 1
                or float(d) > _MAX_INTERVAL_MS):
            raise ConfigError(f"decision_interval_ms: must be a finite number in [1e-6, {_MAX_INTERVAL_MS:g}] "
                              f"(ms), got {d!r}")
        set_("decision_interval_ms", float(d))
        if self.action_mode not in ACTION_MODES:
            raise ConfigError(f"action_mode: must be one of {ACTION_MODES}, got {self.action_mode!r}")
        if self.reward_mode not in REWARD_MODES:
            raise ConfigError(f"reward_mode: must be one of {REWARD_MODES}, got {self.reward_mode!r}")
        set_("autoreset_mode", autoreset_mode_of(self.autoreset_mode))
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise ConfigError(f"seed: must be None or an integer >= 0, got {self.seed!r}")
        if self.base_params is not None and not isinstance(self.base_params, str):
            raise ConfigError(f"base_params: must be None or a path to a parameters JSON, got {self.base_params!r}")
        m = self.shed_margin
        if m is not None:
            if not is_num(m) or math.isnan(float(m)) or not (0 <= float(m) <= 2 or float(m) == math.inf):
                raise ConfigError(f"shed_margin: must be None, inf or a number in [0, 2], got {m!r}")
            set_("shed_margin", None if math.isinf(float(m)) else float(m))
        for f in ("clip_actions", "shed_action", "tpot_guard"):
            if not isinstance(getattr(self, f), (bool, np.bool_)):
                raise ConfigError(f"{f}: must be a bool, got {getattr(self, f)!r}")
            set_(f, bool(getattr(self, f)))
        if self.predictor is not None:
            from ..predictors import KINDS, PredictorSpec
            if not isinstance(self.predictor, (str, dict, PredictorSpec)):
                raise ConfigError(f"predictor: must be None, a kind ({', '.join(KINDS)}) or a dict with kind, "
                                  f"sigma and seed, got {self.predictor!r}")
            try:
                set_("predictor", PredictorSpec.from_dict(self.predictor))
            except (TypeError, ValueError) as e:
                raise ConfigError(f"predictor: {e}") from None

    @property
    def n_req(self) -> int:
        return self.warmup + self.window + self.cooldown

    @property
    def action_names(self) -> tuple:
        return action_names(self.action_mode, self.tpot_guard, self.shed_action)
