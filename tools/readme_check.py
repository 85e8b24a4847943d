#!/usr/bin/env python
"""Run every command of README.md as a new user would, on tiny budgets.

    python tools/readme_check.py            # clone HEAD into a temp dir, fresh venv, run them all
    python tools/readme_check.py --list     # the commands and the tiny-budget flags each gets

A fresh clone of the committed tree (with ``../shared`` beside it when there is one), a fresh
virtual environment without the system's packages, the README's own install line (so only the
extras the README names are installed), then each command of the README's ``bash`` blocks in
order, from the clone's root, and the README's Python example. A command whose default budget is
long gets flags appended that make it tiny (``TINY`` below; argparse takes the last value of a flag,
so the README's own flags stay in the command line); the rest run exactly as written. Any command
exiting non-zero stops the check with its output (exit 1).

``tests/test_readme.py`` checks that every README command has a rule here (or is listed as run as
written), so the README and this check cannot drift apart.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: command prefix -> flags appended to make its budget tiny (the first matching prefix applies)
TINY = {
    "python tuning/optuna_search.py --trace": "--trials 2 --k 2 --bootstrap-b 100",
    "python tuning/optuna_search.py": "--trials 2 --k 2 --max-train-traces 2 --max-test-traces 2 "
                                      "--eval-loads 1.2 --bootstrap-b 100 --no-comparators",
    "tokenbatch tune": "--trials 2 --k 2 --max-train-traces 2 --max-test-traces 2 --eval-loads 1.2 "
                       "--bootstrap-b 100 --no-comparators --out runs/tune-cli",
    "tokenbatch train": "--timesteps 64 --n-envs 8 --n-steps 8 --batch-size 64 --n-epochs 1 "
                        "--eval-every 0 --eval-traces 2 --no-progress",
    "python agents/train_ppo.py": "--timesteps 64 --n-envs 8 --n-steps 8 --batch-size 64 --n-epochs 1 "
                                  "--eval-every 0 --eval-traces 2 --no-progress --out runs/ppo-script",
    "tokenbatch evaluate-agent": "--max-traces 2 --loads 1.2 --bootstrap-b 100 --no-progress",
    "python agents/evaluate_agent.py": "--max-traces 2 --loads 1.2 --bootstrap-b 100 --no-progress",
    "tokenbatch bench": "--max-traces 2 --bootstrap-b 100",
    # the whole suite already runs in CI's first step: here, that the command works on this install
    "python -m pytest": "-p no:cacheprovider -n 0 tests/test_readme.py tests/test_trace_core.py",
}
#: commands run exactly as written (prefixes)
AS_WRITTEN = ("pip install", "tokenbatch simulate", "tokenbatch traces", "tokenbatch profiles",
              "tokenbatch audit", "tokenbatch plan")


def readme_commands(text: str) -> list:
    """Shell commands of the README's ``bash`` blocks, in order: one per line (a trailing comment
    dropped, ``\\`` continuations joined), each ``&&`` chain split into its commands."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            out.extend(c.strip() for c in line.split("&&") if c.strip())
    return out


def python_blocks(text: str) -> list:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def rule(cmd: str):
    """(kind, extra flags) of a command: ("tiny", flags), ("as-written", ""), or (None, "")."""
    for prefix, flags in TINY.items():
        if cmd == prefix or cmd.startswith(prefix + " "):
            return "tiny", flags
    if any(cmd == p or cmd.startswith(p + " ") for p in AS_WRITTEN):
        return "as-written", ""
    return None, ""


def _run(cmd: str, cwd: Path, env: dict, log) -> None:
    t0 = time.time()
    print(f"$ {cmd}", flush=True)
    r = subprocess.run(cmd, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    log.write(f"$ {cmd}\n{r.stdout}\n")
    tail = "\n".join(r.stdout.rstrip().splitlines()[-3:])
    print(f"  exit {r.returncode} in {time.time() - t0:.0f} s" + (f"\n  {tail}" if tail else ""), flush=True)
    if r.returncode != 0:
        print(r.stdout[-6000:], file=sys.stderr)
        raise SystemExit(f"readme_check: `{cmd}` exited {r.returncode}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="readme_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="print the commands and their tiny flags, run nothing")
    ap.add_argument("--keep", action="store_true", help="keep the temporary clone and venv")
    args = ap.parse_args(argv)
    text = (ROOT / "README.md").read_text()
    cmds = readme_commands(text)
    missing = [c for c in cmds if rule(c)[0] is None]
    if missing:
        print("readme_check: no rule for: " + "; ".join(missing), file=sys.stderr)
        return 2
    if args.list:
        for c in cmds:
            kind, flags = rule(c)
            print(f"{c}  {flags}".rstrip() if kind == "tiny" else c)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="readme-check-"))
    try:
        clone = tmp / "main"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        shared = ROOT.parent / "shared"
        if shared.exists():
            os.symlink(shared, tmp / "shared")
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "NUMBA_"))}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                   PIP_DISABLE_PIP_VERSION_CHECK="1", TOKENBATCH_CACHE=str(tmp / "cache"))
        with open(tmp / "log.txt", "w") as log:
            for c in cmds:
                kind, flags = rule(c)
                _run(f"{c} {flags}".strip(), clone, env, log)
            for i, block in enumerate(python_blocks(text)):
                f = tmp / f"readme_example_{i}.py"
                f.write_text(block)
                _run(f"python {shlex.quote(str(f))}", clone, env, log)
        print(f"readme_check: {len(cmds)} commands and {len(python_blocks(text))} Python example(s) ran")
        return 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
