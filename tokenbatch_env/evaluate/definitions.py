"""The metric definitions written into every report (``report.json``'s ``definitions``;
docs/design.md section 6)."""

DEFINITIONS = {
    "goodput": "met / arrived per unit (scored requests), macro mean over units; 95% percentile bootstrap CI",
    "paired": "mean of per-unit differences vs the baseline with its bootstrap CI; win rate counts ties 1/2",
    "latency_all": ("percentiles pool every scored request at the load; no first token (TTFT) or not completed "
                    "(TPOT, E2E) = +inf"),
    "latency_completed": "the same percentiles over completed requests only",
    "sla_respect": "met / completed (pooled)",
    "throughput": "per unit: completed output tokens and met requests per second over the unit's span; mean over units",
    "counts": "preemptions, recomputed tokens, shed, timed out, rejected, unfinished: totals over units",
    "cache_miss": "requests whose prefix chain is empty (nothing they could hit in the prefix cache)",
    "tpot_only_missed": ("completed requests with their first token within the TTFT SLO that missed the TPOT SLO "
                         "(pooled): the misses the iteration's size decides"),
    "levers": ("a row's tuned vLLM flags; its twin '<row> (profile flags)' (FCFS's and priority's: the plain row) "
               "runs the same parameters at the untuned flags (the profile's, with the command line's engine flags), "
               "and vs[twin] is the levers' paired gain"),
    "max_wait": "max over scheduled requests of first_scheduled - arrival; never-scheduled requests counted apart",
    "relative_goodput": "goodput / FCFS goodput - 1 at the same load (attainment ratio, not capacity)",
    "upper_bound": "bounds.upper_bound per unit (valid for any policy: a relaxation of the engine that ignores "
                   "its KV-cache limit, so loose on memory-bound profiles), mean over units",
    "gap_closed": "(policy - FCFS) / (UB - FCFS) on suite means, only where UB - FCFS >= 0.02",
    "capacity": "largest grid rho with goodput >= target at every grid rho' <= rho, bisected inside the cell; "
                "suite value = geometric mean of per-unit ratios to FCFS (paired CI)",
}
