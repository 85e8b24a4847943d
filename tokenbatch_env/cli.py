"""The `tokenbatch` command line.

Each command lives beside its domain code and is imported only when used, so `tokenbatch traces info`
never pays for the engine's compilation.

A command module provides ``configure(parser)`` and ``run(args) -> int``. Any ``TokenBatchError``
is printed as one line and exits 2; no traceback for bad input.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys

from .errors import TokenBatchError

#: name -> (module, one-line help)
COMMANDS = {
    "traces": ("tokenbatch_env.traces.cli", "inspect, convert and generate traces"),
    "profiles": ("tokenbatch_env.engine.profiles_cli", "list, show and fit engine profiles"),
    "simulate": ("tokenbatch_env.engine.simulate_cli", "replay a trace through the engine"),
    "audit": ("tokenbatch_env.capacity_cli", "fluid capacity audit of a contract and workload"),
    "fidelity": ("tokenbatch_env.integrations.fidelity_cli",
                 "compare the engine with vLLM's real scheduler on a trace (needs the vllm extra)"),
    "bench": ("tokenbatch_env.bench_cli", "benchmark policies x traces x loads with CIs (docs/design.md section 6)"),
    "plan": ("tokenbatch_env.plan_cli",
             "how many replicas (GPUs) a deployment needs, per router x policy (docs/design.md section 12)"),
    "tune": ("tokenbatch_env.tune_cli",
             "tune the index, shed margins, comparators and vLLM flags with Optuna (needs the tune extra)"),
    "train": ("tokenbatch_env.agents.train", "train a PPO agent on TokenBatch-v0 (needs the rl extra; --env cluster: "
                                             "train-router)"),
    "train-router": ("tokenbatch_env.agents.train_router",
                     "train a PPO or MaskablePPO router on TokenBatchCluster-v0 (needs the rl extra)"),
    "evaluate-agent": ("tokenbatch_env.agents.evaluate",
                       "judge a trained agent on the test split with the evaluator (needs the rl extra)"),
}


_EXIT_FREEZE = False


def _freeze_at_exit() -> None:
    """At the interpreter's exit, first freeze what is alive (``gc.freeze``), so that the collector's
    passes at shutdown skip it: 0.13 s of a warm `tokenbatch simulate`'s 0.67 s went to them (numba's
    typing and lowering registries, ~100,000 objects; benchmarks/bench_startup.py). The other exit
    handlers still run; the process's memory is freed as it ends. Registered once per process."""
    global _EXIT_FREEZE
    if not _EXIT_FREEZE:
        atexit.register(gc.freeze)
        _EXIT_FREEZE = True


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="tokenbatch", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"tokenbatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            mod = importlib.import_module(module)
            mod.configure(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    _freeze_at_exit()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        if command == "train":   # (``train --env cluster`` is ``train-router``, as agents/train_ppo.py's)
            from .agents.env_choice import split_env_choice
            at = argv.index("train")
            kind, rest = split_env_choice(argv[at + 1:])
            if kind == "cluster":
                argv, command = argv[:at] + ["train-router"] + rest, "train-router"
            elif kind is not None:
                argv = argv[:at + 1] + rest
        parser = build_parser(command if command in COMMANDS else None)
        args = parser.parse_args(argv)
        if getattr(args, "_run", None) is None:
            parser.print_help()
            return 0 if command is None else 2
        rc = int(args._run(args) or 0)
        sys.stdout.flush()   # (a closed pipe raises here, not at the interpreter's exit)
        return rc
    except TokenBatchError as e:
        print(f"tokenbatch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tokenbatch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (``tokenbatch ... | head``): stop quietly, as Python's docs
        # advise (stdout to devnull, so the interpreter's last flush does not raise again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
