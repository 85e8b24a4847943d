"""``--env tokenbatch|cluster`` of ``tokenbatch train`` and agents/train_ppo.py: which trainer runs
(TokenBatch-v0/v1's, ``agents.train``, or the router's on TokenBatchCluster-v0, ``agents.train_router``)."""

from __future__ import annotations

import sys

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


def main(argv=None, prog: str = "train_ppo.py", cmd: str = "python agents/train_ppo.py") -> int:
    """agents/train_ppo.py: ``--env cluster`` trains a router (``train_router.main``), otherwise
    TokenBatch-v0/v1's trainer (``train.main``); errors are one line prefixed with ``prog``, exit 2."""
    try:
        kind, argv = split_env_choice(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        return 2
    if kind == "cluster":
        from . import train_router
        return train_router.main(argv, prog, f"{cmd} --env cluster")
    from . import train
    return train.main(argv, prog, cmd)
