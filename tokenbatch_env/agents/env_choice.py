"""``--env tokenbatch|cluster`` of ``tokenbatch train`` and agents/train_ppo.py: which trainer runs
(TokenBatch-v0/v1's, ``agents.train``, or the router's on TokenBatchCluster-v0, ``agents.train_router``)."""

from __future__ import annotations

from ..errors import ConfigError

#: the envs a PPO agent trains on
ENV_CHOICES = ("tokenbatch", "cluster")


def split_env_choice(argv: list) -> tuple:
    """(the ``--env`` value or None, ``argv`` without it); an unknown value: ``ConfigError``."""
    rest, kind, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--env" and i + 1 < len(argv):
            kind, i = argv[i + 1], i + 2
            continue
        if a.startswith("--env="):
            kind, i = a.split("=", 1)[1], i + 1
            continue
        if a == "--env":
            raise ConfigError(f"--env: expected one of {', '.join(ENV_CHOICES)}")
        rest.append(a)
        i += 1
    if kind is not None and kind not in ENV_CHOICES:
        raise ConfigError(f"--env: one of {', '.join(ENV_CHOICES)}, got {kind!r}")
    return kind, rest
