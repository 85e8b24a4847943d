"""`tokenbatch tune` (and tuning/optuna_search.py, which calls ``main``): tune the index, the
baselines' shed margins and the comparators on a suite's TRAIN split with Optuna, then evaluate the
best parameters once on the held-out TEST split (docs/design.md section 7; the library is
``tokenbatch_env.tuning``). The options are generated from ``tuning.TuneConfig``'s fields
(``config_cli``). Bad options: one line on stderr, exit 2. Needs the tune extra (optuna).
"""

from __future__ import annotations

import argparse
import sys

from .errors import ConfigError

DESCRIPTION = ("Tune the index, the baselines' shed margins and the comparators on a suite's TRAIN split "
               "(Optuna).")

EPILOG = """\
The Gittins-barrier index and, with the same budget, the baselines' shed margins and the comparators
weights+shed and index-scheduled; every row but index-scheduled also tunes vLLM's iteration-size flags
(--no-levers: none does), and FCFS and priority tune only them; then the best parameters are
evaluated once on the held-out TEST split.

    {cmd}                       # the newcomer's run (~35-45 s on 2 cores, compiled)
    {cmd} --trials 200 --max-train-traces all --timeout 1800
    {cmd} --workers 2 --storage runs/study.journal
    {cmd} --storage postgresql://user@db:5432/optuna --study-name big
    {cmd} --no-comparators      # skip weights+shed and index-scheduled
    {cmd} --replicas 4 --routers round-robin,least-outstanding,prefix-affinity
                                # every row behind each router of a 4-replica cluster

Clusters (--replicas R > 1, docs/design.md section 12): each row is tuned behind each router as
'<router> x <row>', a study each with the same trial budget; prefix-affinity's alpha and beta join its
rows' search space. best_params.json's "cluster" part holds every routed row's values (`tokenbatch
bench --params FILE --replicas R` reads it); its top level is the first router's rows'.

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

Reproducibility: an uninterrupted one-worker study with a fixed --seed gives byte-identical
report.json and best_params.json on every rerun. A study resumed after a kill (or a --timeout), or
searched by several workers, may end with other numbers than an uninterrupted one: the sampler
resumes from the trials that were told, not from the point where the run stopped. A run that
resumes a study with trials in it says so in one line on stderr.
Bad options: one line on stderr, exit 2.
"""

INTERRUPTED = "interrupted; completed trials are kept in the study (rerun to resume)"
NO_OPTUNA = "optuna is not installed: pip install -e '.[tune]'"


def configure(p: argparse.ArgumentParser, cmd: str = "tokenbatch tune") -> None:
    from .config_cli import configure_command
    from .tuning import TuneConfig

    configure_command(p, TuneConfig, DESCRIPTION, EPILOG.format(cmd=cmd))


def build_parser(prog: str = "optuna_search.py", cmd: str = "python tuning/optuna_search.py"):
    """The standalone parser (tuning/optuna_search.py): usage errors are one line, exit 2."""
    from .config_cli import one_line_errors
    p = one_line_errors()(prog=prog)
    configure(p, cmd)
    return p


def config_from_args(args):
    """``TuneConfig`` from the parsed options (the profile is checked first: an unknown one gives
    one line listing the valid ones)."""
    from .config_cli import config_from_args as from_args
    from .engine.profiles import load_profile
    from .tuning import TuneConfig

    load_profile(args.profile if args.profile is not None else TuneConfig.profile)
    return from_args(TuneConfig, args)


def run(args, prog: str = "tokenbatch") -> int:
    """Search, evaluate on the test split, write ``--out``, print the summary (unless --quiet)."""
    cfg = config_from_args(args)   # (bad options are named even without optuna)
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError(NO_OPTUNA) from None
    from .engine import compile_notice
    from .tuning import run_tuning

    compile_notice()   # before the progress bars, which would sit at 0 during a first compile
    try:
        res = run_tuning(cfg)
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: {INTERRUPTED}\n")
        return 130
    if cfg.progress:
        sys.stdout.write(res["summary"])
        m = res["meta"]
        print(f"\nwrote {', '.join(str(p) for p in res['paths'][:5])} and {cfg.out}/test/  "
              f"(search {m['search_wall_s']:.1f} s, test evaluation {m['test_eval_wall_s']:.1f} s, "
              f"total {m['wall_time_s']:.1f} s)")
        from .tuning import test_policies
        extra = (f" --policies {','.join(test_policies(cfg))}"
                 + (f" --max-traces {cfg.max_test_traces}" if cfg.max_test_traces is not None else "")
                 + (f" --bootstrap-b {cfg.bootstrap_b}" if cfg.bootstrap_b != 10_000 else "")
                 + (f" --bootstrap-seed {cfg.seed}" if cfg.seed != 0 else ""))
        where = (f" --suite {cfg.suite} --split {cfg.test_split} --profile {cfg.profile} --loads "
                 f"{','.join(f'{x:g}' for x in cfg.eval_loads)}" if cfg.trace is None else (
            f" --trace {cfg.trace} --split test --windows {cfg.windows} --warmup {cfg.warmup} --cooldown "
            f"{cfg.cooldown} --profile {cfg.profile} --loads {','.join(str(x) for x in cfg.eval_loads)}"
            + (f" --rate-scale {cfg.rate_scale:g}" if cfg.rate_scale != 1.0 else "")
            + (f" --slo-rule {cfg.slo_rule}" if cfg.slo_rule else "")))
        if cfg.trace is None and cfg.slo_rule:
            where += f" --slo-rule {cfg.slo_rule}"
        if cfg.cluster:
            where += (f" --replicas {cfg.replicas} --routers {','.join(cfg.routers)}"
                      + (f" --metrics-staleness-ms {cfg.metrics_staleness_ms:g}" if cfg.metrics_staleness_ms else ""))
        print(f"evaluate again: tokenbatch bench{where}{extra} --params {res['paths'][0]} --shed"
              + ("  (the test report's rows but index-scheduled)" if cfg.comparators else ""))
    return 0


def main(argv=None, prog: str = "optuna_search.py", cmd: str = "python tuning/optuna_search.py") -> int:
    """The standalone entry (tuning/optuna_search.py): its messages are prefixed with ``prog``."""
    from .config_cli import standalone_main
    return standalone_main(build_parser(prog, cmd), run, argv, prog, prog)
