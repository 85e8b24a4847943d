#!/usr/bin/env python
"""Tune the index, the baselines' shed margins and the comparators on a suite's TRAIN split (Optuna).

The Gittins-barrier index and, with the same budget, the baselines' shed margins and the comparators
weights+shed and index-scheduled; then the best parameters are evaluated once on the held-out TEST
split.

    python tuning/optuna_search.py                       # the newcomer's run (~35-45 s on 2 cores, compiled)
    python tuning/optuna_search.py --trials 200 --max-train-traces all --timeout 1800
    python tuning/optuna_search.py --workers 2 --storage runs/study.journal
    python tuning/optuna_search.py --storage postgresql://user@db:5432/optuna --study-name big
    python tuning/optuna_search.py --no-comparators      # skip weights+shed and index-scheduled

Comparators (docs/design.md section 8, on by default): weights+shed (8 linear weights in [-1, 1] + shed
margin, --trials trials) and index-scheduled (one index study per --eval-loads bucket,
ceil(trials / buckets) trials each: the index study's total budget).

Writes into --out: best_params.json (the evaluator's --params format: `tokenbatch bench --params`,
the env's residual base, the drop-in and the vLLM plug-in read it; its "meta", the T_ref and profile
tuned with, is the plug-in's), report.json / report.md /
optimization_history.png (tuning + the held-out leaderboard), test/ (the evaluator's own report:
report.json, report.md, goodput_vs_load.png, ttft_cdf.png) and run_meta.json (wall times, host).
The study lives in --storage (default: <out>/study.db, resumable: rerun the same command to resume;
a finished study is not searched again). See docs/design.md section 7 and tokenbatch_env/tuning.py.
Bad options: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message otherwise)
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="optuna_search.py", description=__doc__.split("\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    a = p.add_argument
    # values are parsed by us (not argparse types) so each bad value gives one precise line
    a("--suite", default="seed-200", help="suite name or spec .json (default seed-200)")
    a("--train-split", default="train", help="split the search sees (default train)")
    a("--test-split", default="test", help="held-out split evaluated once at the end (default test)")
    a("--profile", default="stress-512", help="engine profile (default stress-512)")
    a("--loads", default="1.2", help="tuning load(s) rho, comma-separated: the objective is the mean "
      "goodput over traces x loads (default 1.2, the primary endpoint's load)")
    a("--eval-loads", default="1.0,1.2,1.5", help="test-split loads for the leaderboard and goodput vs load "
      "(default 1.0,1.2,1.5)")
    a("--trials", "--n-trials", dest="trials", default="48",
      help="trials per study, a global cap across workers; the index, each baseline and weights+shed "
           "get this many, each index-scheduled bucket study ceil(trials / buckets) (default 48)")
    a("--k", default="8", help="trials evaluated per engine run (default 8)")
    a("--max-train-traces", default="40", help="use the first N train traces, or 'all' (default 40 of 120)")
    a("--max-test-traces", default="all", help="use the first N test traces, or 'all' (default all: the "
      "pre-registered test set)")
    a("--timeout", default=None, help="stop starting new trials after this many seconds of search")
    a("--sampler", default="tpe", help="tpe (seeded multivariate TPE, default), cmaes or random")
    a("--pruner", default="none", help="none (default) or median: report after each quarter of the copies")
    a("--seed", default="0", help="sampler seed (also the bootstrap seed of the test report; default 0)")
    a("--baselines", default="edf,sjf,llf", help="baselines whose +shed margin is tuned with the same "
      "budget (default edf,sjf,llf; also fcfs, priority; aging is not implemented)")
    a("--storage", default=None, help="SQLite file (*.db, one process, resumable), journal file "
      "(*.journal, several processes on one machine) or RDB URL (postgresql://..., mysql://...); "
      "default <out>/study.db (<out>/study.journal with --workers > 1)")
    a("--study-name", default=None, help="study name prefix (default <suite>-<profile>-rho<loads>); one "
      "study per tuned row: <name>.index+shed, <name>.edf+shed, ..., <name>.weights+shed, "
      "<name>.index@rho1.2, ...")
    a("--workers", default="1", help="local worker processes on one study (needs a journal or RDB "
      "storage; default 1)")
    a("--threads", default=None, help="engine threads per process (default: cores / workers)")
    a("--out", default="runs/tune", help="output directory (default runs/tune)")
    a("--bootstrap-b", default="10000", help="bootstrap resamples of the test report (default 10000)")
    a("--no-warm-start", action="store_true", help="do not enqueue the index's SJF/EDF/default members "
      "(margins 0, 0.5 for the baselines; SJF/EDF/LLF directions for weights+shed) as the first trials "
      "of a new study")
    a("--no-comparators", action="store_true", help="do not tune the docs/design.md section 8 comparators: "
      "weights+shed (study <name>.weights+shed, --trials trials) and index-scheduled (one index study "
      "per --eval-loads bucket, <name>.index@rho<x>, ceil(trials / buckets) trials each); on by default")
    a("--agent", action="append", default=[], metavar="PATH",
      help="a trained agent (agents/train_ppo.py output directory, e.g. runs/ppo/best) judged in the test "
           "report beside the tuned rows; repeatable (needs the rl extra)")
    a("--quiet", action="store_true", help="no progress bars, no summary")
    return p


def _int(text, name, lo, allow_all=False):
    from tokenbatch_env.errors import ConfigError
    if text is None:
        return None
    t = str(text).strip()
    if allow_all and t.lower() == "all":
        return None
    try:
        v = int(t)
    except ValueError:
        raise ConfigError(f"--{name}: must be an integer{' or all' if allow_all else ''}, got {text!r}") from None
    if v < lo:
        raise ConfigError(f"--{name}: must be >= {lo}, got {v}")
    return v


def _loads(text, name):
    from tokenbatch_env.bench_cli import parse_loads  # the evaluator's own parser

    return parse_loads(text, name)


def config_from_args(args):
    from tokenbatch_env.engine.profiles import load_profile
    from tokenbatch_env.errors import ConfigError
    from tokenbatch_env.tuning import TuneConfig

    load_profile(args.profile)  # unknown profile -> one line listing the valid ones
    timeout = None
    if args.timeout is not None:
        try:
            timeout = float(args.timeout)
        except ValueError:
            raise ConfigError(f"--timeout: must be a number of seconds, got {args.timeout!r}") from None
    baselines = tuple(s.strip() for s in str(args.baselines).split(",") if s.strip())
    return TuneConfig(
        suite=args.suite, train_split=args.train_split, test_split=args.test_split, profile=args.profile,
        loads=_loads(args.loads, "loads"), eval_loads=_loads(args.eval_loads, "eval-loads"),
        trials=_int(args.trials, "trials", 1), k=_int(args.k, "k", 1),
        max_train_traces=_int(args.max_train_traces, "max-train-traces", 1, True),
        max_test_traces=_int(args.max_test_traces, "max-test-traces", 1, True), timeout=timeout,
        sampler=args.sampler, pruner=args.pruner, seed=_int(args.seed, "seed", 0), baselines=baselines,
        storage=args.storage, study_name=args.study_name, out=args.out,
        workers=_int(args.workers, "workers", 1), threads=_int(args.threads, "threads", 1),
        bootstrap_b=_int(args.bootstrap_b, "bootstrap-b", 100), warm_start=not args.no_warm_start,
        progress=not args.quiet, comparators=not args.no_comparators, agents=tuple(args.agent))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import optuna  # noqa: F401
    except ImportError:
        sys.stderr.write("optuna_search.py: error: optuna is not installed: pip install -e '.[tune]'\n")
        return 2
    from tokenbatch_env.errors import TokenBatchError
    try:
        cfg = config_from_args(args)
        from tokenbatch_env.tuning import run_tuning
        res = run_tuning(cfg)
    except TokenBatchError as e:
        sys.stderr.write(f"optuna_search.py: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("optuna_search.py: interrupted; completed trials are kept in the study (rerun to "
                         "resume)\n")
        return 130
    if not args.quiet:
        sys.stdout.write(res["summary"])
        m = res["meta"]
        print(f"\nwrote {', '.join(str(p) for p in res['paths'][:5])} and {cfg.out}/test/  "
              f"(search {m['search_wall_s']:.1f} s, test evaluation {m['test_eval_wall_s']:.1f} s, "
              f"total {m['wall_time_s']:.1f} s)")
        print(f"evaluate again: tokenbatch bench --params {res['paths'][0]} --shed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
