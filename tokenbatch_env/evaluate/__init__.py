"""The benchmark (docs/design.md section 6): policies x traces x loads, common random numbers, every metric.

``run_benchmark(BenchConfig(...)) -> BenchReport`` is the library form of ``tokenbatch bench``.

How a benchmark runs
--------------------
* **Workload.** A suite split (``suite.traces(split)``, at most ``max_traces``), or windows cut
  from one real trace (``trace_file`` + ``windows`` scored requests per window, ``warmup`` /
  ``cooldown`` simulated but not scored). A unit of analysis (bootstrap unit) is a trace or a
  window; suite traces are independent (percentile bootstrap), windows of one trace are not
  (moving-block bootstrap, block ``metrics.default_block(n)``).
* **Load.** rho relative to ``lambda_sat`` (FCFS saturation throughput): the suite manifest's
  value for the profile if recorded (the shipped profile's: a profile differing from it is
  measured), else measured with ``measure_lambda_sat`` on up to 8 train traces (real trace: its
  first 8 windows, unscaled, whatever ``max_traces`` keeps); the report says which. A suite trace is
  rescaled with ``scale_to_rate(trace, rho * lambda_sat, nominal_rps=suite nominal rate)`` (the
  suite's convention: every trace keeps its own burstiness). A real trace is rescaled as a whole
  (its empirical rate becomes ``rho * lambda_sat``) and then cut, so every load scores the same
  requests.
* **Common random numbers.** One simulate call per policy row, every (load, unit) a copy of that
  batch; every deployable row gets the same length estimates (the suite's predictor, drawn once
  from the *unscaled* trace, so they are also the same at every load); ``srpt-oracle`` gets the
  true lengths and is labelled reference. The mean-residual-life table for requests without an
  estimate (the ``prior`` predictor) comes from the suite's train outputs (real trace: its own).
* **Metrics** (per row and load): see ``request_outcomes`` / ``unit_metrics`` / ``pooled_metrics``.
  Latency percentiles pool every scored request of every unit at that load (inverted-CDF
  percentiles, so requests without a first token / without completion count as +inf in the
  "all arrived" columns). A *cache-miss* request is one with an empty prefix chain in the trace
  (nothing it could ever hit in the prefix cache). Maximum wait = max over scheduled requests of
  ``first_scheduled - arrival`` (never-scheduled requests are counted separately).
* **Capacity at SLO** (``capacity=True``): per unit, the largest grid rho whose goodput >= target
  at every grid rho' <= rho, refined by ``capacity_steps`` bisection steps inside the bracketing
  grid cell; "not reached" when even the smallest grid load misses the target; a unit meeting
  the target at the largest grid load is censored there (reported as ">="). Suite value: the
  geometric mean of per-unit ratios to FCFS over the units where both reached the target, with
  a paired bootstrap CI (on the mean log ratio).

Tuning uses ``evaluate_index_params``: k parameter sets x T traces as k*T copies of one
simulate call (one theta row and one shed margin per copy).

Where each part lives
---------------------
``config`` (``BenchConfig``), ``rows`` (the leaderboard's rows, one simulate call per row),
``outcomes`` (``request_outcomes``, ``unit_metrics``, ``pooled_metrics``), ``evidence``
(``evidence_inputs``, ``evidence_id``), ``slo_capacity`` (capacity at SLO), ``batch`` (the batched
goodput of many parameter sets, for tuning), ``benchmark`` (``run_benchmark``, ``BenchReport``),
``cluster`` (cluster mode, ``replicas`` > 1: the workload at R replicas and each row's replica numbers;
docs/design.md section 12), ``definitions`` (``DEFINITIONS``). The workload (``Workload``, ``prepare_workload``) is
``tokenbatch_env.workload``, shared with the env; parameter files (``load_params_file``, ...) are
``tokenbatch_env.params``; percentiles (``pct``, ``pcts``) ``tokenbatch_env.metrics``: all
importable from here as well.
"""

from ..metrics import pct, pcts
from ..params import PARAMS_INFO_KEYS, SCHEDULE_KEY, load_params_file, load_schedule, load_weights
from ..util import canonical_json
from ..workload import LAMBDA_SAT_TRACES, Workload, WorkloadSpec, prepare_workload
from .batch import evaluate_index_params, evaluate_param_vectors, goodput_matrix
from .benchmark import BenchReport, run_benchmark
from .config import (BASELINE_ROWS, DEFAULT_LOADS, DEFAULT_POLICIES, PRIMARY_LOAD, PRIMARY_SPLIT, PRIMARY_SUITE,
                     SHED_SUFFIX, BenchConfig)
from .definitions import DEFINITIONS
from .evidence import evidence_id, evidence_inputs
from .outcomes import pooled_metrics, prompt_quintile_edges, request_outcomes, unit_metrics
from .rows import CONTROL_COMPARATORS, CONTROLLED, Row, build_rows, control_specs

__all__ = ["BASELINE_ROWS", "CONTROLLED", "CONTROL_COMPARATORS", "DEFAULT_LOADS", "DEFAULT_POLICIES", "DEFINITIONS",
           "LAMBDA_SAT_TRACES", "PARAMS_INFO_KEYS", "PRIMARY_LOAD", "PRIMARY_SPLIT", "PRIMARY_SUITE", "SCHEDULE_KEY",
           "SHED_SUFFIX", "BenchConfig", "BenchReport", "Row", "Workload", "WorkloadSpec", "build_rows",
           "canonical_json", "control_specs", "evaluate_index_params", "evaluate_param_vectors", "evidence_id",
           "evidence_inputs", "goodput_matrix", "load_params_file", "load_schedule", "load_weights", "pct", "pcts",
           "pooled_metrics", "prepare_workload", "prompt_quintile_edges", "request_outcomes", "run_benchmark",
           "unit_metrics"]
