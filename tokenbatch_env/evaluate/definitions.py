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
    "upper_bound": ("bounds.upper_bound per unit (valid for any policy: a relaxation of the engine, with the "
                    "work of each request and its unshared KV blocks held while it emits), mean over units"),
    "best_achieved": ("the best single deployable row (not a reference row) by suite-mean goodput, with its CI; "
                      "best_achieved_reference: the best row counting reference rows, when it differs"),
    "oracle_selector": ("per-window best of the deployable rows (an oracle selector: no single policy achieves it): "
                        "per unit the maximum goodput over those rows, mean over units with a goodput's bootstrap CI"),
    "gap_closed": ("(policy - FCFS) / (best achieved - FCFS) on suite means, only where best achieved - FCFS "
                   ">= 0.02 (gap_closed_printed); the upper bound and the oracle selector are printed beside it"),
    "capacity": "largest grid rho with goodput >= target at every grid rho' <= rho, bisected inside the cell; "
                "suite value = geometric mean of per-unit ratios to FCFS (paired CI)",
}
