"""Router agents (docs/design.md section 12, "Routing env"): ``agents/train_ppo.py --env cluster``
(PPO and MaskablePPO) end to end, the replica row of a cluster tuning file, the replica scorer's
symmetry, and the evaluator's router-agent rows (``control.run_routed``): a router agent that always
defers to its base router is that router's row, unit for unit."""

import json

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("sb3_contrib")
torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")

from tokenbatch_env.agents import env_choice as train_ppo  # noqa: E402  (agents/train_ppo.py's main)
from tokenbatch_env.agents import evaluate as evaluate_agent  # noqa: E402

TINY = ["--env", "cluster", "--replicas", "2", "--window", "8", "--warmup", "2", "--cooldown", "2", "--n-envs", "4",
        "--timesteps", "256", "--n-steps", "32", "--batch-size", "64", "--n-epochs", "1", "--eval-every", "128",
        "--eval-traces", "2", "--no-progress"]


def cluster_params(tmp_path, replicas=2):
    """A cluster tuning file (the format ``tokenbatch tune --replicas R`` writes) with two rows."""
    doc = {"index": {"kappa": 2.0}, "shed_margin": 0.3, "edf": {"shed_margin": 0.4},
           "meta": {"t_ref_mode": "fixed", "t_ref_ms": 321.0},
           "cluster": {"replicas": replicas, "routers": ["round-robin", "prefix-affinity"], "rows": {
               "round-robin x edf+shed": {"shed_margin": 0.25, "levers": {"max_num_batched_tokens": 256,
                                                                           "max_num_seqs": 64}},
               "prefix-affinity x edf+shed": {"shed_margin": 0.5, "levers": {"max_num_batched_tokens": 384},
                                              "router": {"alpha": 1.5, "beta": 4.0}}}}}
    p = tmp_path / "best_params.json"
    p.write_text(json.dumps(doc))
    return p


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    params = cluster_params(tmp)
    outs = {}
    for algo in ("maskable-ppo", "ppo"):
        out = tmp / algo
        assert train_ppo.main(TINY + ["--algo", algo, "--params", str(params), "--replica-row",
                                      "round-robin x edf+shed", "--out", str(out)]) == 0
        outs[algo] = out
    return outs, params


def test_training_writes_both_checkpoints_with_the_replica_row(trained):
    outs, params = trained
    for algo, out in outs.items():
        for which in ("best", "final"):
            doc = json.loads((out / which / "config.json").read_text())
            assert doc["algo"] == algo and (out / which / "model.zip").is_file()
            env = doc["env"]
            assert env["kind"] == "cluster" and env["replicas"] == 2
            # every replica runs the tuned row: its policy, margin and levers, and the file's T_ref
            assert (env["policy"], env["shed_margin"], env["t_ref_ms"]) == ("edf", 0.25, 321.0)
            assert env["levers"] == {"max_num_batched_tokens": 256, "max_num_seqs": 64}
        m = json.loads((out / "train_metrics.json").read_text())
        assert m["timesteps"] >= 256 and [c["timesteps"] for c in m["validation"]["curve"]][0] == 0
        assert m["validation"]["best_agent"] == max(c["val_goodput"] for c in m["validation"]["curve"])


def test_validation_goodput_is_the_evaluators_replay_of_the_saved_agent(trained):
    """The best checkpoint's recorded validation goodput is reproduced by loading it and replaying
    the validation split through ``control.run_routed``."""
    from tokenbatch_env.agents.load import router_agent
    from tokenbatch_env.agents.train_router import RouterTrainConfig, RouterValidator
    outs, _ = trained
    for out in outs.values():
        doc = json.loads((out / "best" / "config.json").read_text())
        agent = router_agent(str(out / "best"))
        cfg = RouterTrainConfig(env=agent.env, eval_traces=2, out=str(out))
        assert RouterValidator(cfg).goodput(agent.make()) == doc["val_goodput"]


def test_a_router_agent_deferring_to_its_base_router_is_that_routers_row():
    """The benchmark's router-agent row with every action -1 (the base router's choice) equals the
    base router's own row unit for unit; the row is paired against every router's."""
    from tokenbatch_env.agents.train_router import base_router_predict
    from tokenbatch_env.control import RouterAgent
    from tokenbatch_env.envs.cluster_env import ClusterEnvConfig
    from tokenbatch_env.evaluate import BenchConfig, run_benchmark
    for base in ("round-robin", "least-outstanding"):
        env = ClusterEnvConfig(replicas=3, policy="sjf", shed_margin=0.5, base_router=base)
        agent = RouterAgent("defer", env, lambda: base_router_predict)
        cfg = BenchConfig(policies=("sjf",), shed=True, loads=(1.2,), max_traces=3, upper_bound=False, replicas=3,
                          routers=("round-robin", "least-outstanding", "jsq"), shed_margins=(("sjf", 0.5),),
                          bootstrap_b=100, router_agents=(agent,))
        rows = {r["label"]: r for r in run_benchmark(cfg).data["loads"][0]["rows"]}
        mine = rows["defer x sjf+shed"]
        assert mine["goodput_per_unit"] == rows[f"{base} x sjf+shed"]["goodput_per_unit"]
        assert set(mine["vs"]) >= {"round-robin x sjf+shed", "least-outstanding x sjf+shed", "jsq x sjf+shed"}
        assert mine["cluster"]["replaced_share"] == 1.0   # (every decision deferred)


def test_evaluate_agent_judges_router_agents_against_every_router(trained, tmp_path):
    outs, params = trained
    args = ["--model", str(outs["maskable-ppo"] / "best"), "--model", str(outs["ppo"] / "best"), "--pool",
            "--params", str(params), "--routers", "round-robin,prefix-affinity,jsq", "--loads", "1.2",
            "--max-traces", "2", "--bootstrap-b", "100", "--no-progress"]
    assert evaluate_agent.main(args + ["--out", str(tmp_path / "a")]) == 0
    assert evaluate_agent.main(args + ["--out", str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "report.json").read_bytes() == (tmp_path / "b" / "report.json").read_bytes()
    rep = json.loads((tmp_path / "a" / "report.json").read_text())
    rows = {r["label"]: r for r in rep["loads"][0]["rows"]}
    # every comparator runs the agents' replica row (margin and levers), prefix-affinity its tuned alpha, beta
    for r in ("round-robin", "prefix-affinity", "jsq"):
        assert rows[f"{r} x edf+shed"]["shed_margin"] == 0.25
        assert rows[f"{r} x edf+shed"]["levers"] == {"max_num_batched_tokens": 256, "max_num_seqs": 64}
    pa = next(p for p in rep["evidence_inputs"]["policies"] if p["label"] == "prefix-affinity x edf+shed")
    assert pa["router_params"] == {"alpha": 1.5, "beta": 4.0}
    vs = json.loads((tmp_path / "a" / "router_vs.json").read_text())["rows"]
    assert {(v["agent"], v["vs"]) for v in vs} == {
        (a, f"{r} x edf+shed") for a in ("maskable-ppo:best x edf+shed", "ppo:best x edf+shed",
                                         "mean of agents (2)")
        for r in ("round-robin", "prefix-affinity", "jsq")}
    pooled = [v for v in vs if v["agent"].startswith("mean")]
    mean = np.mean([rows[f"{a} x edf+shed"]["goodput_per_unit"] for a in ("maskable-ppo:best", "ppo:best")], axis=0)
    assert pooled[0]["agent_goodput"] == pytest.approx(float(mean.mean()))


def test_evaluate_agent_refuses_mixed_agent_kinds_and_routers_for_schedulers(trained, tmp_path, capsys):
    outs, _ = trained
    plain = tmp_path / "plain"
    assert train_ppo.main(["--n-envs", "4", "--timesteps", "64", "--n-steps", "16", "--batch-size", "64",
                           "--eval-every", "0", "--eval-traces", "1", "--window", "16", "--warmup", "4",
                           "--cooldown", "4", "--no-progress", "--out", str(plain)]) == 0
    capsys.readouterr()
    assert evaluate_agent.main(["--model", str(outs["ppo"] / "best"), "--model", str(plain / "best")]) == 2
    assert "judged apart" in capsys.readouterr().err
    assert evaluate_agent.main(["--model", str(plain / "best"), "--routers", "jsq"]) == 2
    assert "--routers: for router agents" in capsys.readouterr().err


def test_bad_router_training_input_is_one_line(tmp_path, capsys):
    params = cluster_params(tmp_path)
    cases = [(["--algo", "a2c"], "algo: one of ppo, maskable-ppo"),
             (["--params", str(params)], "--params and --replica-row go together"),
             (["--params", str(params), "--replica-row", "jsq x edf+shed"], "not a row of"),
             (["--params", str(params), "--replica-row", "round-robin x edf+shed", "--replicas", "3"],
              "tuned on 2 replicas: give --replicas 2"),
             (["--params", str(params), "--replica-row", "round-robin x edf+shed", "--replica-policy", "sjf"],
              "the replica row of --params sets them"),
             (["--net", "transformer"], "net: scorer or mlp")]
    for argv, msg in cases:
        assert train_ppo.main(["--env", "cluster", *argv, "--out", str(tmp_path / "o")]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, (argv, err)
    assert train_ppo.main(["--env", "graph"]) == 2
    assert "--env: one of tokenbatch, cluster" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_tokenbatch_train_env_cluster_is_train_router(capsys):
    import subprocess
    import sys
    from pathlib import Path

    from tokenbatch_env import cli
    with pytest.raises(SystemExit):
        cli.main(["train", "--env", "cluster", "--help"])
    out = capsys.readouterr().out
    assert "--replica-row" in out and "--algo" in out and "usage: tokenbatch train-router" in out
    script = Path(__file__).resolve().parents[1] / "agents" / "train_ppo.py"
    r = subprocess.run([sys.executable, str(script), "--env", "cluster", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: train_ppo.py ") and "--replica-row" in r.stdout
    r = subprocess.run([sys.executable, str(script), "--env", "cluster", "--algo", "x"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "train_ppo.py: error: algo: one of ppo, maskable-ppo, got 'x'\n"


def test_replica_scorer_treats_the_replicas_alike():
    """Permuting the replicas' features permutes the scorer's logits (and nothing else moves)."""
    torch.set_num_threads(1)
    import gymnasium as gym

    from tokenbatch_env.envs.cluster_env import obs_dim
    from tokenbatch_env.sb3 import replica_scorer_policy_class
    R = 4
    for maskable in (False, True):
        pol = replica_scorer_policy_class(maskable)(
            gym.spaces.Box(0, 4, (obs_dim(R),), np.float32), gym.spaces.Discrete(R), lambda _: 1e-3,
            net_arch={"pi": [], "vf": [16]}, replicas=R, hidden=8, prior=2.0)
        x = torch.rand(5, obs_dim(R))
        perm = [2, 0, 3, 1]
        xp = torch.cat([x[:, :R * 11].reshape(5, R, 11)[:, perm].reshape(5, -1), x[:, R * 11:]], 1)
        with torch.no_grad():
            a, b = pol.action_net(x), pol.action_net(xp)
        assert torch.allclose(a[:, perm], b, atol=1e-6)
        assert float(pol.action_net.prior.detach()) == 2.0


def test_a_pd_router_trains_and_is_judged_on_its_split(tmp_path):
    """``--pd Rp:Rd``: the agent routes to the prefill replicas; evaluate-agent judges it against the
    same split behind every router."""
    out = tmp_path / "pd"
    assert train_ppo.main(["--env", "cluster", "--replicas", "3", "--pd", "2:1", "--first-token-at", "decode",
                           "--replica-policy", "sjf", "--shed-margin", "0.5", "--window", "8", "--warmup", "2",
                           "--cooldown", "2", "--n-envs", "4", "--timesteps", "128", "--n-steps", "32",
                           "--batch-size", "64", "--n-epochs", "1", "--eval-every", "0", "--eval-traces", "2",
                           "--no-progress", "--out", str(out)]) == 0
    env = json.loads((out / "best" / "config.json").read_text())["env"]
    assert (env["pd"], env["first_token_at"]) == ([2, 1], "decode")
    assert evaluate_agent.main(["--model", str(out / "best"), "--routers", "round-robin,jsq", "--loads", "1.2",
                                "--max-traces", "2", "--bootstrap-b", "100", "--no-progress",
                                "--out", str(tmp_path / "ev")]) == 0
    vs = json.loads((tmp_path / "ev" / "router_vs.json").read_text())["rows"]
    label = "sjf+shed [P/D 2:1, first token at decode]"
    assert {(v["agent"], v["vs"]) for v in vs} == {(f"maskable-ppo:best x {label}", f"{r} x {label}")
                                                   for r in ("round-robin", "jsq")}
