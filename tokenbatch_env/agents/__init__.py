"""PPO agents (the rl extra: torch, stable-baselines3): ``train`` (``tokenbatch train``, also
agents/train_ppo.py) trains one on TokenBatch-v0 through the SB3 adapter (``tokenbatch_env.sb3``);
``evaluate`` (``tokenbatch evaluate-agent``, also agents/evaluate_agent.py) judges it on the test split
with the evaluator that judges the baselines; ``load`` turns a trained agent's files into a controller
row of that evaluator (``agent_spec``; also used by ``tokenbatch tune --agent``). torch and
stable-baselines3 are imported only inside the functions that need them, so importing these modules
(and their ``--help``) stays light.
"""
