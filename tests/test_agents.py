"""PPO agents (agents/): a tiny training run end to end, save/load with normalisation statistics,
evaluation through the evaluator, determinism, and the set-structured features extractor."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")   # training logs to TensorBoard

ROOT = Path(__file__).resolve().parents[1]
from tokenbatch_env.agents import evaluate as evaluate_agent  # noqa: E402  (agents/evaluate_agent.py's main)
from tokenbatch_env.agents import train as train_ppo  # noqa: E402  (agents/train_ppo.py's main)

TINY = ["--n-envs", "8", "--timesteps", "512", "--n-steps", "32", "--batch-size", "128", "--n-epochs", "2",
        "--eval-every", "256", "--eval-traces", "2", "--window", "32", "--warmup", "8", "--cooldown", "8",
        "--no-progress"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo")
    assert train_ppo.main(TINY + ["--out", str(out)]) == 0
    return out


def test_tiny_training_writes_models_config_and_metrics(trained):
    for d in ("best", "final"):
        assert {"model.zip", "vecnormalize.pkl", "config.json"} <= {p.name for p in (trained / d).iterdir()}
    cfg = json.loads((trained / "final" / "config.json").read_text())
    assert cfg["train"]["timesteps"] == 512 and cfg["env"]["window"] == 32
    m = json.loads((trained / "train_metrics.json").read_text())
    v = m["validation"]
    assert m["timesteps"] >= 512 and len(v["curve"]) >= 2
    assert 0 <= v["best_agent"] <= 1 and 0 <= v["edf+shed"] <= 1
    assert v["best_agent"] == max(c["val_goodput"] for c in v["curve"])
    assert list((trained / "tb").iterdir())   # TensorBoard event files


def test_save_load_round_trip_keeps_normalisation(trained):
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecNormalize

    from tokenbatch_env.sb3 import load_agent, make_sb3_vec_env
    d = trained / "final"
    predict = load_agent(str(d / "model.zip"), str(d / "vecnormalize.pkl"))
    venv = VecNormalize.load(str(d / "vecnormalize.pkl"), make_sb3_vec_env(2, window=32, warmup=8, cooldown=8))
    assert venv.obs_rms.count > 8          # statistics were saved, not a fresh normaliser
    model = PPO.load(str(d / "model.zip"), device="cpu")
    obs = np.random.default_rng(0).uniform(-1, 1, (5, venv.observation_space.shape[0])).astype(np.float32)
    venv.training = False
    want = model.predict(venv.normalize_obs(obs), deterministic=True)[0]
    assert np.allclose(predict(obs), want)
    raw = model.predict(obs, deterministic=True)[0]
    assert not np.allclose(raw, want)      # the normalisation matters, so the check can fail


def test_checkpoint_is_refused_when_its_files_are_not_the_saved_set(trained, tmp_path):
    """config.json (written last) holds the SHA-256 of model.zip and vecnormalize.pkl: a set mixed by a
    kill between the renames (new weights, old statistics) is a clear error, not a silent mismatch."""
    import shutil

    from tokenbatch_env._io import sha256_file
    from tokenbatch_env.agents.load import agent_spec
    from tokenbatch_env.errors import ConfigError
    final, best = trained / "final", trained / "best"
    files = json.loads((final / "config.json").read_text())["files"]
    assert files == {"model.zip": sha256_file(final / "model.zip"),
                     "vecnormalize.pkl": sha256_file(final / "vecnormalize.pkl")}
    assert not [p.name for p in final.iterdir() if p.name.endswith(".tmp")]   # no temp file left behind
    ev = dict(agent_spec(str(final)).evidence)
    assert ev["model_sha256"] == files["model.zip"] and ev["vecnormalize_sha256"] == files["vecnormalize.pkl"]
    mixed = tmp_path / "mixed"
    shutil.copytree(final, mixed)
    shutil.copy(best / "vecnormalize.pkl", mixed / "vecnormalize.pkl")   # another save's statistics
    if sha256_file(mixed / "vecnormalize.pkl") != files["vecnormalize.pkl"]:
        with pytest.raises(ConfigError, match="not the set config.json was saved with"):
            agent_spec(str(mixed))
    (mixed / "vecnormalize.pkl").unlink()                               # statistics missing
    with pytest.raises(ConfigError, match="not the set config.json was saved with"):
        agent_spec(str(mixed))
    shutil.copy(final / "vecnormalize.pkl", mixed / "vecnormalize.pkl")
    (mixed / "model.zip").write_bytes(b"PK not this model")              # weights of another save
    with pytest.raises(ConfigError, match="not the set config.json was saved with"):
        agent_spec(str(mixed))
    # saved without normalisation: a statistics file in the directory is not the agent's own
    plain = tmp_path / "plain"
    shutil.copytree(final, plain)
    doc = json.loads((plain / "config.json").read_text())
    doc["files"]["vecnormalize.pkl"] = None
    (plain / "config.json").write_text(json.dumps(doc))
    assert dict(agent_spec(str(plain)).evidence)["vecnormalize_sha256"] is None


def test_evaluate_agent_through_the_evaluator_is_deterministic(trained, tmp_path):
    args = ["--model", str(trained / "best"), "--max-traces", "2", "--loads", "1.2", "--bootstrap-b", "200",
            "--no-progress"]
    assert evaluate_agent.main(args + ["--out", str(tmp_path / "a")]) == 0
    assert evaluate_agent.main(args + ["--out", str(tmp_path / "b")]) == 0
    a = (tmp_path / "a" / "report.json").read_bytes()
    assert a == (tmp_path / "b" / "report.json").read_bytes()
    data = json.loads(a)
    labels = [r["label"] for r in data["loads"][0]["rows"]]
    assert "ppo:best" in labels and "index+shed" in labels and "edf+shed" in labels
    vs = json.loads((tmp_path / "a" / "agent_vs.json").read_text())["rows"]
    assert {r["vs"] for r in vs} >= {"edf+shed", "index+shed"}
    assert (tmp_path / "a" / "agent_vs.md").read_text().startswith("# Agent vs comparators")


def test_evaluate_agent_warns_when_judged_on_its_training_split(trained, tmp_path, capsys):
    assert evaluate_agent.main(["--model", str(trained / "best"), "--split", "train", "--max-traces", "2",
                                "--loads", "1.2", "--bootstrap-b", "100", "--no-progress",
                                "--out", str(tmp_path / "t")]) == 0
    assert ("evaluate_agent.py: warning: ppo:best was trained on seed-200/train, the split it is judged on: "
            "not held out") in capsys.readouterr().err


def test_evaluate_agent_refuses_a_blocked_report_file_before_the_runs(trained, tmp_path, capsys, monkeypatch):
    from tokenbatch_env import evaluate
    monkeypatch.setattr(evaluate, "run_benchmark", lambda cfg: pytest.fail("ran before the check"))
    (tmp_path / "o" / "report.md").mkdir(parents=True)
    assert evaluate_agent.main(["--model", str(trained / "best"), "--out", str(tmp_path / "o")]) == 2
    assert "--out " in (err := capsys.readouterr().err) and "report.md: cannot write: a directory is in the way" in err


def test_evaluate_agent_pools_several_agents(trained, tmp_path):
    """--pool: the agents' mean goodput per trace as one more agent, paired with the report's own
    bootstrap (one agent pooled alone gives exactly the evaluator's paired numbers)."""
    out = tmp_path / "pool"
    assert evaluate_agent.main(["--model", str(trained / "best"), "--model", str(trained / "final"), "--pool",
                                "--max-traces", "3", "--loads", "1.2", "--bootstrap-b", "200", "--no-progress",
                                "--out", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    rows = json.loads((out / "agent_vs.json").read_text())["rows"]
    labels = sorted({r["agent"] for r in rows if not r["agent"].startswith(evaluate_agent.POOLED)})
    assert len(labels) == 2
    pooled = [r for r in rows if r["agent"] == f"{evaluate_agent.POOLED} (2)"]
    assert {r["vs"] for r in pooled} >= {"edf+shed", "index+shed"}
    by = {r["label"]: r for r in data["loads"][0]["rows"]}
    mean = np.mean([by[lab]["goodput_per_unit"] for lab in labels], axis=0)
    for r in pooled:
        assert r["diff"] == pytest.approx(float(np.mean(mean - np.asarray(by[r["vs"]]["goodput_per_unit"]))))
        assert r["ci"][0] <= r["diff"] <= r["ci"][1]
    for lab in labels:   # one agent "pooled" alone: the evaluator's own paired difference, CI and win rate
        own = {(r["rho"], r["vs"]): r for r in evaluate_agent.agent_rows(data, [lab])}
        for r in evaluate_agent.pooled_rows(data, [lab]):
            o = own[(r["rho"], r["vs"])]
            # (the report stores its numbers rounded to 1e-6)
            assert (r["diff"], *r["ci"], r["win_rate"]) == pytest.approx((o["diff"], *o["ci"], o["win_rate"]),
                                                                         abs=1e-6)


def test_evaluate_agent_bad_model_is_a_clear_error(tmp_path, capsys):
    assert evaluate_agent.main(["--model", str(tmp_path)]) == 2
    assert "no model file" in capsys.readouterr().err
    assert evaluate_agent.main(["--model", str(tmp_path), "--pool"]) == 2   # (was silently ignored)
    assert "--pool pools several --model agents" in capsys.readouterr().err


def test_train_bad_config_is_a_clear_error(capsys, tmp_path):
    assert train_ppo.main(["--policy", "transformer"]) == 2
    assert "policy" in capsys.readouterr().err
    # PPO's numbers are checked up front (NaN rates crashed torch mid-run; gamma 1.5 trained), and an
    # error, there or in the env's settings, leaves no output directory behind
    out = tmp_path / "run"
    for argv, msg in ((["--learning-rate", "nan"], "learning_rate: must be a number > 0, got nan"),
                      (["--gamma", "1.5"], "gamma: must be a number >= 0 and <= 1, got 1.5"),
                      (["--gae-lambda", "2"], "gae_lambda: must be a number >= 0 and <= 1"),
                      (["--clip-range", "-1"], "clip_range: must be a number > 0"),
                      (["--ent-coef", "nan"], "ent_coef: must be a finite number"),
                      (["--log-std-init", "inf"], "log_std_init: must be a finite number"),
                      (["--suite", "nope"], "unknown suite 'nope'")):
        assert train_ppo.main(argv + ["--out", str(out), "--timesteps", "64"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("train_ppo.py: error: ") and msg in err, err
        assert not out.exists()
    (tmp_path / "f").write_text("x")
    assert train_ppo.main(["--out", str(tmp_path / "f"), "--timesteps", "64"]) == 2
    assert "--out " in capsys.readouterr().err


def test_tuning_checks_agents_and_its_output_before_the_search(tmp_path):
    """``--agent`` directories are checked when the config is made (a missing model.zip was found
    only after the whole search), and an early error leaves no ``out`` directory."""
    from tokenbatch_env import tuning as T
    from tokenbatch_env.errors import ConfigError, OutputError
    with pytest.raises(ConfigError, match=r"agents: .*: no model file .*model\.zip"):
        T.TuneConfig(agents=(str(tmp_path),), out=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="unknown suite 'nope'"):
        T.run_tuning(T.TuneConfig(suite="nope", out=str(tmp_path / "o"), progress=False))
    assert not (tmp_path / "o").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="out: .*/f: cannot write: a file is in the way"):
        T.run_tuning(T.TuneConfig(out=str(tmp_path / "f"), progress=False))


def test_agent_labels_are_distinct():
    from tokenbatch_env.agents.load import agent_labels
    from tokenbatch_env.errors import ConfigError
    assert agent_labels(["runs/a/best"]) == ["ppo:best"]
    assert agent_labels(["runs/a/best", "runs/b/final"]) == ["ppo:best", "ppo:final"]
    assert agent_labels(["runs/a/best", "runs/b/best"]) == ["ppo:a/best", "ppo:b/best"]
    with pytest.raises(ConfigError, match="the same agent given twice"):
        agent_labels(["runs/a/best", "runs/a/best/model.zip"])


def test_agent_warnings():
    from tokenbatch_env.agents.load import agent_warnings
    kw = {"suite": "seed-200", "split": "train", "profile": "stress-512"}
    assert agent_warnings(kw, "ppo:a", "seed-200", "test", "stress-512") == []
    assert agent_warnings(dict(kw, split="test"), "ppo:a", "seed-200", "test", "stress-512") == [
        "ppo:a was trained on seed-200/test, the split it is judged on: not held out"]
    assert agent_warnings(kw, "ppo:a", "seed-200", "test", "linear") == [
        "ppo:a was trained with profile 'stress-512' and is judged with 'linear'"]


def test_base_params_are_pinned_and_model_errors_are_clear(tmp_path):
    """An agent trained around a params file records it resolved, with its digest: evaluation from
    another directory finds it, and a changed file is refused (its actions are residuals around it)
    and enters the evidence; a model that cannot be loaded is a ConfigError, not a traceback; two
    ``<run>/best`` agents get distinct labels when the tuning config is made."""
    import os
    import shutil

    from tokenbatch_env import tuning as T
    from tokenbatch_env._io import sha256_file
    from tokenbatch_env.agents.load import agent_spec
    from tokenbatch_env.errors import ConfigError
    bp = tmp_path / "bp.json"
    bp.write_text(json.dumps({"index": {"kappa": 2.0}, "shed_margin": 0.5}))
    out = tmp_path / "run"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:   # a relative path, as a user types it
        assert train_ppo.main(TINY + ["--timesteps", "256", "--eval-every", "256", "--base-params", "bp.json",
                                      "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    doc = json.loads((out / "final" / "config.json").read_text())
    assert doc["env"]["base_params"] == str(bp.resolve()) and doc["base_params_sha256"] == sha256_file(bp)
    spec = agent_spec(str(out / "final"))
    assert dict(spec.evidence)["base_params_sha256"] == sha256_file(bp)
    spec.make(100.0)   # (loads)
    bp.write_text(json.dumps({"index": {"kappa": 3.0}, "shed_margin": 0.5}))
    with pytest.raises(ConfigError, match="base parameters .* changed since the training"):
        agent_spec(str(out / "final"))
    with pytest.raises(ConfigError, match="changed since the training"):
        T.TuneConfig(agents=(str(out / "final"),), out=str(tmp_path / "o"))
    bp.write_text(json.dumps({"index": {"kappa": 2.0}, "shed_margin": 0.5}))
    bad = tmp_path / "bad"
    shutil.copytree(out / "final", bad)
    (bad / "model.zip").write_bytes(b"not a zip")
    d = json.loads((bad / "config.json").read_text())
    d["files"]["model.zip"] = sha256_file(bad / "model.zip")
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"model\.zip: cannot load the PPO model"):
        agent_spec(str(bad)).make(100.0)
    other = tmp_path / "other" / "final"
    shutil.copytree(out / "final", other)
    c = T.TuneConfig(agents=(str(out / "final"), str(other)), out=str(tmp_path / "o"))
    assert len(c.agents) == 2


def test_set_extractor_is_permutation_and_padding_invariant():
    from tokenbatch_env.envs import F, N_ENGINE, NQ, TokenBatchVectorEnv
    from tokenbatch_env.sb3 import request_set_extractor_class

    env = TokenBatchVectorEnv(1, window=32, warmup=8, cooldown=8, k=4)
    ext = request_set_extractor_class()(env.single_observation_space, k=4)
    g = N_ENGINE + 2 * NQ + 2
    rng = np.random.default_rng(1)
    obs = rng.uniform(-1, 1, (1, g + 4 * (F + 1))).astype(np.float32)
    obs[0, g + 4 * F:] = [1, 1, 1, 0]       # three valid requests, one padding slot
    perm = obs.copy()
    req = obs[0, g:g + 4 * F].reshape(4, F)
    perm[0, g:g + 4 * F] = req[[2, 0, 1, 3]].ravel()
    pad = obs.copy()
    pad[0, g + 3 * F:g + 4 * F] = 9.0      # garbage in the invalid slot
    with torch.no_grad():
        a, b, c = (ext(torch.as_tensor(x)) for x in (obs, perm, pad))
        assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)
        other = obs.copy()
        other[0, g] += 1.0                  # a valid request's feature does matter
        assert not torch.allclose(a, ext(torch.as_tensor(other)))
    with pytest.raises(ValueError, match="does not fit"):
        request_set_extractor_class()(env.single_observation_space, k=5)


@pytest.mark.parametrize("extra", [["--policy", "set"], ["--action-mode", "weights"], ["--no-shed-action"]])
def test_set_policy_and_weights_mode_train(tmp_path, extra):
    out = tmp_path / "run"
    assert train_ppo.main(TINY + ["--timesteps", "256", "--eval-every", "0", "--out", str(out)] + extra) == 0
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["train"]["policy"] == ("set" if "set" in extra else "mlp")
    from tokenbatch_env.agents.load import agent_spec
    spec = agent_spec(str(out / "final"))
    assert spec.action_mode == cfg["env"]["action_mode"]
    ctrl = spec.make(1000.0)
    from tokenbatch_env.envs import TokenBatchVectorEnv
    env = TokenBatchVectorEnv(3, **{k: v for k, v in cfg["env"].items() if k not in ("rho",)})
    obs, _ = env.reset(seed=0)
    theta, margin = ctrl(obs)
    assert theta.shape == (3, 9) and np.isfinite(theta).all() and margin.shape == (3,)
    assert cfg["env"]["shed_action"] == ("--no-shed-action" not in extra)
    if "--no-shed-action" in extra:   # the agent acts on 7 dimensions; the margin is the base one
        assert spec.make(1000.0) and env.single_action_space.shape == (7,)
        assert (margin == env.core.base_margin).all()


def test_scripts_run_from_the_command_line(trained):
    out = subprocess.run([sys.executable, str(ROOT / "agents" / "train_ppo.py"), "--help"], capture_output=True,
                         text=True, check=True)
    assert "--action-mode" in out.stdout and "--base-params" in out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "agents" / "evaluate_agent.py"), "--help"],
                         capture_output=True, text=True, check=True)
    assert "--model" in out.stdout


def test_tuning_report_includes_an_agent(trained, tmp_path):
    out = tmp_path / "tune"
    r = subprocess.run([sys.executable, str(ROOT / "tuning" / "optuna_search.py"), "--trials", "2", "--k", "2",
                        "--max-train-traces", "2", "--max-test-traces", "2", "--eval-loads", "1.2",
                        "--bootstrap-b", "100", "--no-comparators", "--baselines", "edf", "--quiet",
                        "--agent", str(trained / "best"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    test = json.loads((out / "test" / "report.json").read_text())
    row = {x["label"]: x for x in test["loads"][0]["rows"]}["ppo:best"]
    assert "index+shed" in row["vs"] and 0 <= row["goodput"]["mean"] <= 1
    assert "ppo:best" in (out / "report.md").read_text()
    bad = subprocess.run([sys.executable, str(ROOT / "tuning" / "optuna_search.py"), "--agent",
                          str(tmp_path / "nope"), "--out", str(tmp_path / "x"), "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "agents" in bad.stderr


def test_training_is_deterministic_for_a_seed(tmp_path):
    from stable_baselines3 import PPO
    params = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert train_ppo.main(TINY + ["--timesteps", "256", "--eval-every", "0", "--out", str(out)]) == 0
        params.append(PPO.load(str(out / "final" / "model.zip"), device="cpu").policy.state_dict())
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])


def test_training_needs_no_rich_for_its_progress_bar(tmp_path, monkeypatch, capsys):
    """SB3's progress_bar=True raises ImportError without rich; the trainer draws its own tqdm bar, so
    training with the progress bar on runs without rich (simulated missing: its import fails)."""
    import stable_baselines3.common.callbacks as cb
    monkeypatch.setitem(sys.modules, "rich", None)          # `import rich` raises ImportError
    monkeypatch.setattr(cb, "tqdm", None)                    # as SB3 leaves it when rich is missing
    with pytest.raises(ImportError, match="rich"):
        cb.ProgressBarCallback()                             # (the simulation is the crash's cause)
    argv = [a for a in TINY if a != "--no-progress"]
    assert train_ppo.main(argv + ["--timesteps", "256", "--eval-every", "0", "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "training: 100%" in err and "256/256" in err, err[-500:]


def test_evaluate_agent_takes_a_plain_model_zip_with_its_env_config(trained, tmp_path, capsys):
    """A model.zip without config.json: the error says what to give (--env-config, --vecnormalize);
    given them, it is judged exactly as the same agent given by its training directory."""
    import shutil
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(trained / "final" / "model.zip", plain / "model.zip")
    shutil.copy(trained / "final" / "vecnormalize.pkl", tmp_path / "stats.pkl")
    assert evaluate_agent.main(["--model", str(plain / "model.zip")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evaluate_agent.py: error: --model ") and "no config.json" in err
    assert "--env-config FILE.json" in err and "--vecnormalize FILE" in err and err.count("\n") == 1
    env = json.loads((trained / "final" / "config.json").read_text())["env"]
    (tmp_path / "env.json").write_text(json.dumps({k: v for k, v in env.items() if k != "seed"}))
    common = ["--max-traces", "2", "--loads", "1.2", "--bootstrap-b", "100", "--no-progress"]
    assert evaluate_agent.main(["--model", str(trained / "final"), *common, "--out", str(tmp_path / "dir")]) == 0
    assert evaluate_agent.main(["--model", str(plain / "model.zip"), "--env-config", str(tmp_path / "env.json"),
                                "--vecnormalize", str(tmp_path / "stats.pkl"), *common,
                                "--out", str(tmp_path / "zip")]) == 0
    capsys.readouterr()
    rows = {}
    for name, label in (("dir", "ppo:final"), ("zip", "ppo:plain")):
        data = json.loads((tmp_path / name / "report.json").read_text())
        rows[name] = {r["label"]: r for r in data["loads"][0]["rows"]}[label]
    assert rows["zip"]["goodput_per_unit"] == rows["dir"]["goodput_per_unit"]
    for argv, msg in ((["--vecnormalize", str(tmp_path / "stats.pkl")], "--vecnormalize goes with --env-config"),
                      (["--env-config", str(tmp_path / "nope.json")], "--env-config"),
                      (["--env-config", str(tmp_path / "bad.json")], "unknown TokenBatchConfig field(s) windw")):
        (tmp_path / "bad.json").write_text(json.dumps({"windw": 3}))
        capsys.readouterr()
        assert evaluate_agent.main(["--model", str(plain / "model.zip"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("evaluate_agent.py: error: ") and msg in err and err.count("\n") == 1, err


def test_training_wraps_the_env_in_vecmonitor_with_the_episode_metrics(trained):
    """train uses make_sb3_vec_env(monitor=True): SB3's episode buffer got the episodes' rewards and
    metrics (their means are in the TensorBoard logs as rollout/ep_rew_mean)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    runs = sorted((trained / "tb").iterdir())
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    assert "rollout/ep_rew_mean" in acc.Tags()["scalars"]


def test_tokenbatch_train_and_evaluate_agent_commands(trained, tmp_path, capsys):
    """`tokenbatch train` / `tokenbatch evaluate-agent` run the same code as the scripts, their
    messages naming the tokenbatch commands."""
    from tokenbatch_env import cli
    out = tmp_path / "run"
    assert cli.main(["train", *TINY, "--timesteps", "256", "--eval-every", "0", "--out", str(out)]) == 0
    assert f"judge on TEST with tokenbatch evaluate-agent --model {out / 'best'}" in capsys.readouterr().out
    assert {"model.zip", "vecnormalize.pkl", "config.json"} <= {p.name for p in (out / "final").iterdir()}
    assert cli.main(["evaluate-agent", "--model", str(trained / "best"), "--split", "train", "--max-traces", "2",
                     "--loads", "1.2", "--bootstrap-b", "100", "--no-progress", "--out", str(tmp_path / "e")]) == 0
    cap = capsys.readouterr()
    assert "tokenbatch: warning: ppo:best was trained on seed-200/train" in cap.err
    assert f"wrote {tmp_path / 'e'}/" in cap.out and (tmp_path / "e" / "agent_vs.json").is_file()


def test_v1_agent_trains_and_its_controller_sets_the_budget(tmp_path):
    """``--tpot-guard`` trains on TokenBatch-v1 (the set extractor takes its TPOT state); the saved agent's
    controller returns (theta, margin, (u, B_min)) within the rule's ranges around the base (0, 1)."""
    from tokenbatch_env.agents.load import agent_spec
    from tokenbatch_env.envs import TokenBatchVectorEnv
    out = tmp_path / "run"
    assert train_ppo.main(TINY + ["--timesteps", "256", "--eval-every", "256", "--out", str(out), "--tpot-guard",
                                  "--policy", "set"]) == 0
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["env"]["tpot_guard"] is True
    spec = agent_spec(str(out / "final"))
    assert spec.guard == (0.0, 1.0)
    env = TokenBatchVectorEnv(3, **{k: v for k, v in cfg["env"].items() if k != "rho"})
    obs, _ = env.reset(seed=0)
    theta, margin, (u, b) = spec.make(1000.0)(obs)
    assert theta.shape == (3, 9) and margin.shape == (3,)
    assert ((-0.5 <= u) & (u <= 2.0)).all() and ((0.0 <= b) & (b <= 1.0)).all()


def test_evaluate_agent_says_which_tuned_flags_it_does_not_apply(trained, tmp_path, capsys):
    """Every row of evaluate_agent runs at the profile's flags, as the agent does: a parameters file's
    tuned flags are named on stderr as not applied."""
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"index": {}, "shed_margin": 0.0,
                             "levers": {"index+shed": {"max_num_batched_tokens": 512}}}))
    assert evaluate_agent.main(["--model", str(trained / "best"), "--params", str(p), "--max-traces", "2",
                                "--loads", "1.2", "--bootstrap-b", "200", "--out", str(tmp_path / "e"),
                                "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "tuned vLLM flags of index+shed" in err and "not applied" in err
