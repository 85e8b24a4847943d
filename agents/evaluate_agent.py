#!/usr/bin/env python
"""Judge a trained agent on the TEST split with the evaluator that judges the baselines.

The same as ``tokenbatch evaluate-agent`` (tokenbatch_env/agents/evaluate.py; the options are
EvaluateAgentConfig's fields): see ``--help``. Messages are prefixed ``evaluate_agent.py:``.
"""

import sys

from tokenbatch_env.agents.evaluate import main

if __name__ == "__main__":
    sys.exit(main(prog="evaluate_agent.py", cmd="python agents/evaluate_agent.py"))
