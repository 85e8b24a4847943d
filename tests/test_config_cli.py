"""Options generated from config dataclasses (tokenbatch_env/config_cli.py) and the commands built so:
`tokenbatch tune`, `tokenbatch train`, `tokenbatch evaluate-agent` and their scripts
(tuning/optuna_search.py, agents/train_ppo.py, agents/evaluate_agent.py). The tiny `tokenbatch tune`
run that must match the script's report.json is in tests/test_tuning.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from tokenbatch_env import cli
from tokenbatch_env.agents.evaluate import EvaluateAgentConfig
from tokenbatch_env.agents.train import TrainConfig
from tokenbatch_env.config_cli import (add_config_arguments, config_flags, config_from_args, config_to_argv,
                                       field_flags, option, parser_flags)
from tokenbatch_env.envs import TokenBatchConfig
from tokenbatch_env.errors import ConfigError
from tokenbatch_env.tuning import TuneConfig

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"tune": TuneConfig, "train": TrainConfig, "evaluate-agent": EvaluateAgentConfig}


def _parse(cls, argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p, cls)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ the generic module
@dataclasses.dataclass(frozen=True)
class Toy:
    name: str = option("a", "a name")
    count: int = option(3, "how many", min=1)
    first: Optional[int] = option(5, "first N, or all", min=1, none="all")
    limit: Optional[float] = option(None, "seconds", what="a number of seconds")
    rates: tuple[float, ...] = option((0.5, 1.0), "rates")
    sizes: tuple[int, ...] = option((64,), "widths", min=1)
    tags: tuple[str, ...] = option(("x",), "tags", allow_empty=True)
    paths: tuple[str, ...] = option((), "a path; repeatable", flags=("--path",), append=True, metavar="P")
    fast: bool = option(True, "go fast")
    quiet_mode: bool = option(False, "be quiet", flags=("--quiet", "-q"), sets=True)
    warm: bool = option(True, "no warm start", flags=("--no-warm",), sets=False)
    n_trials: int = option(8, "trials", flags=("--trials", "--n-trials"))


def test_generated_options_parse_each_kind():
    assert config_from_args(Toy, _parse(Toy, [])) == Toy()
    got = config_from_args(Toy, _parse(Toy, [
        "--name", "b", "--count", "7", "--first", "all", "--limit", "2.5", "--rates", "1, 2,", "--sizes", "8,16",
        "--tags", "", "--path", "p1", "--path", "p,2", "--no-fast", "-q", "--no-warm", "--n-trials", "4"]))
    assert got == Toy(name="b", count=7, first=None, limit=2.5, rates=(1.0, 2.0), sizes=(8, 16), tags=(),
                      paths=("p1", "p,2"), fast=False, quiet_mode=True, warm=False, n_trials=4)
    assert field_flags(dataclasses.fields(Toy)[-1]) == ("--trials", "--n-trials")


@pytest.mark.parametrize("argv, msg", [
    (["--count", "x"], "--count: must be an integer, got 'x'"),
    (["--count", "0"], "--count: must be >= 1, got 0"),
    (["--first", "many"], "--first: must be an integer or all, got 'many'"),
    (["--limit", "soon"], "--limit: must be a number of seconds, got 'soon'"),
    (["--rates", "1,a"], "--rates: 'a' is not a number (comma-separated values)"),
    (["--rates", ","], "--rates: need at least one value (comma-separated)"),
    (["--sizes", "8,0"], "--sizes: must be >= 1, got 0"),
    (["--trials", "1.5"], "--trials: must be an integer, got '1.5'"),
])
def test_bad_value_is_one_line_naming_the_flag(argv, msg):
    with pytest.raises(ConfigError) as e:
        config_from_args(Toy, _parse(Toy, argv))
    assert str(e.value) == msg


def test_help_shows_defaults_and_to_argv_round_trips():
    p = argparse.ArgumentParser(prog="toy")
    add_config_arguments(p, Toy)
    h = p.format_help()
    for text in ("how many (default 3)", "first N, or all (default 5)", "rates (default 0.5,1.0)",
                 "go fast (default --fast)", "--trials N_TRIALS, --n-trials N_TRIALS", "--path P"):
        assert text in " ".join(h.split()), text
    cfg = Toy(name="z", count=2, first=None, limit=0.1, rates=(0.25,), paths=("a", "b"), fast=False,
              quiet_mode=True, warm=False, n_trials=9, tags=())
    assert config_from_args(Toy, p.parse_args(config_to_argv(cfg))) == cfg
    assert config_to_argv(Toy()) == []
    with pytest.raises(ValueError, match="no option spells it"):
        config_to_argv(_Unspellable(threads=5))
    assert config_to_argv(_Unspellable()) == []   # (its default, as the config resolves it)


@dataclasses.dataclass(frozen=True)
class _Unspellable:
    threads: Optional[int] = option(4, "threads")   # None has no spelling (no ``none`` word)

    def __post_init__(self):
        if self.threads == 5:
            object.__setattr__(self, "threads", None)


# ------------------------------------------------------------------------------ the three commands
def _help(command, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_every_config_field(command, capsys):
    out = _help(command, capsys)
    assert out.startswith(f"usage: tokenbatch {command} ")
    flags = config_flags(COMMANDS[command])
    assert len(flags) >= len(dataclasses.fields(COMMANDS[command]))
    for name, spellings in flags.items():
        for flag in spellings:
            assert flag in out, (command, name, flag)


def test_top_level_help_lists_the_commands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)


def _round_trip(cls, cfg):
    p = argparse.ArgumentParser()
    add_config_arguments(p, cls)
    argv = config_to_argv(cfg)
    assert config_from_args(cls, p.parse_args(argv)) == cfg, argv
    return argv


def test_tune_config_round_trips():
    assert config_from_args(TuneConfig, _parse(TuneConfig, [])) == TuneConfig()
    cfg = TuneConfig(suite="seed-200", train_split="validation", test_split="train", profile="linear",
                     loads=(1.0, 1.5), eval_loads=(1.2,), trials=7, k=3, max_train_traces=None, max_test_traces=5,
                     timeout=12.5, sampler="random", pruner="median", seed=4, baselines=("edf",),
                     storage="runs/x.journal", study_name="s", out="o", workers=2, threads=1, bootstrap_b=200,
                     warm_start=False, progress=False, comparators=False)
    argv = _round_trip(TuneConfig, cfg)
    assert "--no-warm-start" in argv and "--quiet" in argv and "--no-comparators" in argv
    assert argv[argv.index("--max-train-traces") + 1] == "all"
    assert _round_trip(TuneConfig, TuneConfig(baselines=())) == ["--baselines", ""]


def test_train_config_round_trips(tmp_path):
    assert config_from_args(TrainConfig, _parse(TrainConfig, [])) == TrainConfig()
    bp = tmp_path / "bp.json"
    bp.write_text("{}")
    env = TokenBatchConfig(suite="seed-200", split="validation", profile="linear", rho=(1.0, 1.0),
                           action_mode="weights", base_params=str(bp), window=16, warmup=0, cooldown=4,
                           decision_interval_ms=50.5, k=4, reward_mode="met", shed_action=False, seed=3)
    cfg = TrainConfig(env=env, val_split="test", policy="set", n_envs=3,
                      timesteps=99, n_steps=5, batch_size=15, n_epochs=1, learning_rate=1e-5, gamma=0.9,
                      gae_lambda=0.5, clip_range=0.1, ent_coef=0.01, log_std_init=-2.0, net_arch=(8, 4, 2),
                      normalize=False, eval_every=0, eval_traces=1, eval_loads=(1.0, 2.0), out="o",
                      progress=False)
    argv = _round_trip(TrainConfig, cfg)
    assert "--no-shed-action" in argv and "--no-normalize" in argv and "--no-progress" in argv
    # one --rho value: a constant load, as agents/train_ppo.py always read it
    assert config_from_args(TrainConfig, _parse(TrainConfig, ["--rho", "1.2"])).env.rho == (1.2, 1.2)
    # an env field that is no option cannot be spelled
    with pytest.raises(ValueError, match="env.max_steps"):
        config_to_argv(TrainConfig(env=dataclasses.replace(env, max_steps=5)))


def test_evaluate_agent_config_round_trips():
    cfg = EvaluateAgentConfig(model=("runs/a/best", "b.zip"), env_config="env.json", vecnormalize="v.pkl",
                              params="p.json", suite="seed-200", split="validation", loads=(1.5,), max_traces=2,
                              bootstrap_b=100, seed=1, out="o", pool=True, progress=False)
    argv = _round_trip(EvaluateAgentConfig, cfg)
    assert argv[:4] == ["--model", "runs/a/best", "--model", "b.zip"] and "--pool" in argv
    assert config_from_args(EvaluateAgentConfig, _parse(EvaluateAgentConfig, ["--model", "m"])) == \
        EvaluateAgentConfig(model=("m",))


@pytest.mark.parametrize("argv, msg", [
    (["tune", "--k", "x"], "tokenbatch: error: --k: must be an integer, got 'x'"),
    (["tune", "--max-test-traces", "0"], "tokenbatch: error: --max-test-traces: must be >= 1, got 0"),
    (["train", "--timesteps", "lots"], "tokenbatch: error: --timesteps: must be an integer, got 'lots'"),
    (["train", "--rho", "0.8,x"], "tokenbatch: error: --rho: 'x' is not a number (rho values > 0, comma-separated)"),
    (["train", "--net-arch", "64,"], None),   # (a trailing comma is fine: this one is valid)
    (["evaluate-agent", "--model", "m", "--max-traces", "some"],
     "tokenbatch: error: --max-traces: must be an integer or all, got 'some'"),
    (["evaluate-agent", "--model", "m", "--bootstrap-b", "5"],
     "tokenbatch: error: --bootstrap-b: must be >= 100, got 5"),
])
def test_commands_bad_value_one_line_exit_2(argv, msg, capsys, monkeypatch):
    if msg is None:   # parsed fine: stop before any work
        from tokenbatch_env.agents import train
        monkeypatch.setattr(train, "train", lambda cfg: (_ for _ in ()).throw(ConfigError(f"ok {cfg.net_arch}")))
        msg = "tokenbatch: error: ok (64,)"
    assert cli.main([*argv, "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert err == msg + "\n", err


# ------------------------------------------------------------------------------ the scripts
#: every flag of each script's --help before the commands were generated (evaluate_agent.py: plus
#: --env-config and --vecnormalize, for a model.zip without config.json)
SCRIPT_FLAGS = {
    "tuning/optuna_search.py": (
        "tokenbatch_env.tune_cli",
        "-h --help --suite --train-split --test-split --profile --loads --eval-loads --trials --n-trials --k "
        "--max-train-traces --max-test-traces --timeout --sampler --pruner --seed --baselines --storage "
        "--study-name --workers --threads --out --bootstrap-b --no-warm-start --no-comparators --agent --quiet "
        "--trace --format --windows --warmup --cooldown --rate-scale --val-top --slo-rule --no-levers --budget-rule "
        "--replicas --routers --metrics-staleness-ms"),
    "agents/train_ppo.py": (
        "tokenbatch_env.agents.train",
        "-h --help --suite --split --val-split --profile --rho --action-mode --policy --base-params --window "
        "--warmup --cooldown --decision-interval-ms --k --reward-mode --shed-action --no-shed-action --n-envs "
        "--timesteps --n-steps --batch-size --n-epochs --learning-rate --gamma --gae-lambda --clip-range "
        "--ent-coef --log-std-init --net-arch --normalize --no-normalize --eval-every --eval-traces --eval-loads "
        "--seed --out --progress --no-progress --tpot-guard --no-tpot-guard"),
    "agents/evaluate_agent.py": (
        "tokenbatch_env.agents.evaluate",
        "-h --help --model --params --suite --split --loads --max-traces --bootstrap-b --seed --out --pool "
        "--no-progress --env-config --vecnormalize --routers"),
}


@pytest.mark.parametrize("script", list(SCRIPT_FLAGS))
def test_scripts_accept_the_same_flags(script):
    import importlib
    module, flags = SCRIPT_FLAGS[script]
    parser = importlib.import_module(module).build_parser()
    assert parser_flags(parser) == set(flags.split())
    prog = Path(script).name
    assert parser.prog == prog
    r = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {prog} ")
    assert all(f in r.stdout for f in flags.split() if f.startswith("--"))


def test_scripts_error_lines_keep_their_prog(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tuning" / "optuna_search.py"), "--k", "x", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "optuna_search.py: error: --k: must be an integer, got 'x'\n"
    r = subprocess.run([sys.executable, str(ROOT / "tuning" / "optuna_search.py"), "--nope"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "optuna_search.py: error: unrecognized arguments: --nope (see --help)\n"
    r = subprocess.run([sys.executable, str(ROOT / "agents" / "train_ppo.py"), "--timesteps", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == "train_ppo.py: error: --timesteps: must be an integer, got 'x'\n"
    (tmp_path / "model.zip").write_bytes(b"")   # a model.zip without config.json: what to give is said
    r = subprocess.run([sys.executable, str(ROOT / "agents" / "evaluate_agent.py"), "--model", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("evaluate_agent.py: error: --model ")
    assert "--env-config" in r.stderr


def test_command_modules_import_light():
    from conftest import heavy_modules_loaded
    for m in ("tokenbatch_env.tune_cli", "tokenbatch_env.agents.train", "tokenbatch_env.agents.evaluate",
              "tokenbatch_env.config_cli"):
        assert heavy_modules_loaded(m) == [], m


def test_config_json_of_a_run_gives_its_options_back():
    """A training run's config.json ("train") rebuilds the same TrainConfig through the options."""
    cfg = TrainConfig(env=TokenBatchConfig(rho=(1.0, 1.5), seed=0), net_arch=(32,), timesteps=64)
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert _round_trip(TrainConfig, again) == ["--timesteps", "64", "--net-arch", "32", "--rho", "1.0,1.5"]
