"""TokenBatch policies inside vLLM's own scheduler (vLLM 0.33 V1): a ``--scheduler-cls`` plug-in.

``TokenBatchAsyncScheduler`` (subclass of vLLM's ``AsyncScheduler``, the GPU default) and
``TokenBatchScheduler`` (subclass of the synchronous ``Scheduler``) run vLLM's ``priority`` policy.
Before every ``schedule()`` they compute the TokenBatch (tier, score) of every waiting and running
request exactly as the engine does at the start of an iteration (docs/design.md section 4; the same
compiled formulas of ``tokenbatch_env.engine.scoring``; prefix-cache hits of waiting requests from
vLLM's own ``kv_cache_manager.get_computed_blocks``), set each request's integer ``priority`` to its
exact rank (tier desc, score desc, arrival asc, request id asc) and re-heapify the waiting queue. vLLM's
own admission (heap order) and victim choice (``max(running, key=(priority, arrival))``) then follow
the TokenBatch order. The common shed rule aborts a waiting request through the scheduler's own
finish path (``finish_requests(..., RequestStatus.FINISHED_ABORTED)``); the client receives a finished
output with finish reason ``abort``, and the count is in ``scheduler.tokenbatch_stats``.

Use::

    TOKENBATCH_POLICY=index TOKENBATCH_POLICY_FILE=tuned.json TOKENBATCH_PROFILE=llama3-8b-h100 \\
    vllm serve MODEL --scheduler-cls tokenbatch_env.integrations.vllm.TokenBatchAsyncScheduler

Settings (each from the constructor's ``tokenbatch_config``, else ``--additional-config
'{"tokenbatch": {...}}'``, else the environment variable ``TOKENBATCH_<KEY upper-case>``):

====================== ====================================================================
``policy``             index (default), edf, sjf, llf, srpt-oracle
``policy_file``        the tuning JSON (``tokenbatch_env.params.load_params_file`` format)
``shed``               off (default), on (the file's margin for the policy, 0 if absent),
                       or a margin: a number in [0, 2] (``0`` is margin 0, not off) or inf
``profile``            engine cost profile pricing the work (default: the file's ``meta.profile``,
                       else llama2-7b-a100)
``t_ref_ms``           the index's T_ref (default: the file's ``meta.t_ref_ms``, else 1000)
``default_ttft_slo_ms`` TTFT SLO of a request without ``tokenbatch_ttft_slo_ms`` (default 1000)
``default_est_output_tokens`` output estimate of a request without one (default: none; the
                       remaining decode is then 1 token, the engine's rule without a table)
``log_steps``          a CSV file: append one row per engine step that ran tokens, in the
                       samples format of ``tokenbatch profiles fit --samples`` (default: off)
``budget_rule``        none (default: every step's token budget is vLLM's) or tpot-guard
                       (docs/design.md section 11: the step's budget B_t from the decoding
                       requests' TPOT credits; with it, ``policy`` may also be fcfs or priority:
                       vLLM's own order, unranked, only the budget applied)
``budget_u``           tpot-guard's u, in [-0.5, 2] (default: the policy file's levers for the
                       row ``<policy>[+shed]+tpot-guard``, else 0)
``budget_bmin``        tpot-guard's B_min, in [0, 1] (default: as u, else 0)
``default_tpot_slo_ms`` TPOT SLO of a request without ``tokenbatch_tpot_slo_ms`` (default: none,
                       such a request is not guarded)
====================== ====================================================================

Per request (``SamplingParams.extra_args``; the OpenAI server's ``vllm_xargs``):
``tokenbatch_ttft_slo_ms``, ``tokenbatch_tpot_slo_ms`` (not used by the scores; the tpot-guard
rule's T2), and ``tokenbatch_est_output_tokens``. Every setting is read and validated when the
scheduler is built: a bad file or value fails vLLM's start-up with a ``TokenBatchPluginError``
naming it.

``budget_rule=tpot-guard`` (docs/design.md section 11, exactly as the engine's ``kernel.guard_slack``
and ``kernel.guard_budget``): before every ``schedule()``, after the ranking, the plug-in computes
B_t from the running requests (D decodes, their contexts, the guarded ones' credits ``T2 g - e``:
g their tokens, the one in flight under async scheduling included, e the time since their first
token, recorded by ``update_from_output``; a first token still in flight has e = 0, the engine's
clock) and runs vLLM's ``schedule()`` unchanged with ``max_num_scheduled_tokens = B_t`` (vLLM's
per-step token budget; restored afterwards). With a policy file whose ``"tpot-guard"`` part holds
tuned parameters, the index and the shed margins take them while the rule is on.

``log_steps`` (docs/design.md section 3, "A profile for your deployment") turns a real server into
calibration data for its own profile. A row's features come from the step's ``SchedulerOutput``,
classified as the engine's cost model does (a one-token step of a request past its prefill is a
decode at its context, anything else a prefill chunk at its computed-before); its ``t_ms`` is the
wall time (``time.perf_counter_ns``) from the later of the previous ``update_from_output`` and this
step's ``schedule()`` to the end of this step's ``update_from_output``: the time the engine took per
step, overlap with the next step's scheduling included, idle time excluded. vLLM gives the
scheduler no GPU timestamps; this is the honest measure the scheduler sees (with async scheduling
it is the step-to-step period, which is what the engine's iteration time models). One file per
engine process; the start-up log gives the ``tokenbatch profiles fit`` command with this engine's
limits. Speculative decoding is not modelled: its multi-token decode steps count as chunks.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import math
import os
import shlex
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import PriorityRequestQueue, SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from ..engine import scoring as _s
# the tpot-guard rule's own names and p_t (one implementation: the kernel's, called from Python)
from ..engine.kernel import BUDGET_RULES, NO_TPOT_SLO_NS, guard_chunk
from ..errors import ConfigError
from ..policies import policy_names, vllm_modes

logger = logging.getLogger(__name__)

#: SamplingParams.extra_args keys read per request
EXTRA_TTFT_SLO_MS = "tokenbatch_ttft_slo_ms"
EXTRA_TPOT_SLO_MS = "tokenbatch_tpot_slo_ms"
EXTRA_EST_OUTPUT_TOKENS = "tokenbatch_est_output_tokens"

#: policies the plug-in runs (fcfs and priority are vLLM's own: use its --scheduling-policy)
PLUGIN_POLICIES = policy_names(in_plugin=True)   # the registry's
_PIDS = {"index": _s.P_INDEX, "edf": _s.P_EDF, "sjf": _s.P_SJF, "llf": _s.P_LLF,
         "srpt-oracle": _s.P_SJF}
#: vLLM's own policies, which the plug-in runs unranked with a budget rule (its queues, its victim rule)
VLLM_POLICIES = vllm_modes()   # the registry's: fcfs, priority
_KEYS = ("policy", "policy_file", "shed", "profile", "t_ref_ms", "default_ttft_slo_ms",
         "default_est_output_tokens", "log_steps", "budget_rule", "budget_u", "budget_bmin",
         "default_tpot_slo_ms")


class TokenBatchPluginError(ConfigError):
    """The plug-in's configuration is invalid (raised at scheduler construction)."""


# --------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class PluginConfig:
    """Everything the plug-in needs besides vLLM's own config; validated on construction."""

    policy: str = "index"
    index_params: object = None           # IndexParams (index only)
    shed_margin: Optional[float] = None   # None = no shedding
    profile: str = "llama2-7b-a100"
    t_ref_ms: float = 1000.0
    default_ttft_slo_ms: float = 1000.0
    default_est_output_tokens: Optional[float] = None
    policy_file: Optional[str] = None
    log_steps: Optional[str] = None       # samples CSV appended per step (None: off)
    budget_rule: str = "none"             # none | tpot-guard (docs/design.md section 11)
    budget_u: float = 0.0                 # tpot-guard's u
    budget_bmin: float = 0.0              # tpot-guard's B_min
    default_tpot_slo_ms: Optional[float] = None   # None: a request without a TPOT SLO is not guarded

    @classmethod
    def resolve(cls, explicit: Optional[dict] = None, additional_config: Optional[dict] = None,
                environ=None) -> "PluginConfig":
        """Settings from ``explicit`` > ``additional_config["tokenbatch"]`` > ``TOKENBATCH_*``."""
        environ = os.environ if environ is None else environ
        src: dict = {}
        for k in _KEYS:
            v = environ.get(f"TOKENBATCH_{k.upper()}")
            if v not in (None, ""):
                src[k] = (v, f"environment variable TOKENBATCH_{k.upper()}")
        add = (additional_config or {}).get("tokenbatch") if additional_config else None
        for layer, where in ((add, "--additional-config tokenbatch"), (explicit, "tokenbatch_config")):
            if layer is None:
                continue
            if not isinstance(layer, dict):
                raise TokenBatchPluginError(f"{where}: expected an object of settings {list(_KEYS)}")
            unknown = sorted(set(layer) - set(_KEYS))
            if unknown:
                raise TokenBatchPluginError(f"{where}: unknown setting(s) {unknown}; valid: {list(_KEYS)}")
            for k, v in layer.items():
                if v is not None:
                    src[k] = (v, f"{where}.{k}")
        return cls._build(src)

    @classmethod
    def _build(cls, src: dict) -> "PluginConfig":
        from ..engine.levers import GUARD_LEVERS, GUARD_SUFFIX
        from ..params import GUARD_KEY, load_guard_params, load_params_file
        from ..policies import IndexParams, check_shed_margin

        def get(k, default=None):
            return src[k] if k in src else (default, f"default {k}")

        rule, rwhere = get("budget_rule", "none")
        rule = rule.strip().lower() if isinstance(rule, str) else rule
        if rule not in BUDGET_RULES:
            raise TokenBatchPluginError(f"{rwhere}: unknown budget_rule {rule!r}; valid: {', '.join(BUDGET_RULES)}")
        guard = rule == "tpot-guard"
        policy, where = get("policy", "index")
        if policy in VLLM_POLICIES and not guard:
            raise TokenBatchPluginError(
                f"{where}: policy {policy!r} is vLLM's own --scheduling-policy: the plug-in runs it only with "
                f"budget_rule tpot-guard (its TokenBatch policies: {', '.join(PLUGIN_POLICIES)})")
        if policy not in PLUGIN_POLICIES and policy not in VLLM_POLICIES:
            raise TokenBatchPluginError(
                f"{where}: unknown policy {policy!r}; the plug-in runs {', '.join(PLUGIN_POLICIES)} "
                "(fcfs and priority are vLLM's own --scheduling-policy; the plug-in runs them only with "
                "budget_rule tpot-guard)")
        path, pwhere = get("policy_file")
        params, margins, meta = IndexParams(), {}, {}
        if path is not None:
            path = str(path)
            try:
                params, margin_items = load_params_file(path)
                margins = dict(margin_items)
                doc = json.loads(Path(path).read_text())
                g = load_guard_params(path) if guard else None
            except Exception as e:  # noqa: BLE001 - whatever the file's fault (ConfigError, PolicyError...): reported
                raise TokenBatchPluginError(f"{pwhere}: bad TokenBatch policy file {path!r}: {e}") from None
            if g is not None:   # the +tpot-guard twins' own parameters (tuned with u and B_min)
                if "index" in doc[GUARD_KEY]:
                    params = g[0]
                margins.update(dict(g[1]))
            meta = doc.get("meta") or {}
            if not isinstance(meta, dict):
                meta = {}
        elif policy == "index":
            logger.warning("TokenBatch plug-in: no policy file (TOKENBATCH_POLICY_FILE); the index "
                           "runs with default parameters")

        shed, swhere = get("shed", "off")
        margin = None
        if isinstance(shed, str) and shed.strip().lower() in ("off", "false", "no", "none"):
            margin = None
        elif isinstance(shed, str) and shed.strip().lower() in ("on", "true", "yes"):
            margin = margins.get(policy, 0.0)
            if margin is not None and math.isinf(margin):
                margin = None
        else:
            try:
                v = float(shed)
                if math.isnan(v):
                    raise ValueError("NaN")
                margin = check_shed_margin(v if math.isfinite(v) else math.inf)
            except (TypeError, ValueError) as e:
                raise TokenBatchPluginError(f"{swhere}: shed must be off, on or a margin in [0, 2], "
                                            f"got {shed!r} ({e})") from None
        if margin is not None and policy in VLLM_POLICIES:
            raise TokenBatchPluginError(f"{swhere}: shedding needs a TokenBatch policy ({', '.join(PLUGIN_POLICIES)}); "
                                        f"policy {policy} is vLLM's own, run unranked")

        guard_levers: dict = {}
        if path is not None:   # levers tuned with the parameters: vLLM's own flags, set when it starts
            from ..params import load_levers
            row = policy + ("+shed" if margin is not None else "")
            levers = dict(load_levers(path))
            lv = levers.get(row)
            if guard:
                guard_levers = {k: v for k, v in levers.get(row + GUARD_SUFFIX, ()) if k in GUARD_LEVERS}
                own = [(k, v) for k, v in levers.get(row + GUARD_SUFFIX, ()) if k not in GUARD_LEVERS]
                if own:   # (a +tpot-guard row keeps its row's flags unless it has its own)
                    row, lv = row + GUARD_SUFFIX, own
            if lv:
                flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in lv)
                logger.warning("TokenBatch plug-in: %s's parameters in %s were tuned with the vLLM flags %s "
                               "(docs/design.md section 11): start vLLM with them", row, path, flags)

        def num(k, default, *, positive=True, allow_none=False):
            v, w = get(k, default)
            if allow_none and (v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "off"))):
                return None
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise TokenBatchPluginError(f"{w}: expected a number, got {v!r}") from None
            if not math.isfinite(x) or (positive and x <= 0):
                raise TokenBatchPluginError(f"{w}: expected a finite number > 0, got {v!r}")
            return x

        guard_values = {}
        for k, (lo, hi) in GUARD_LEVERS.items():   # budget_u, budget_bmin
            if not guard:
                if k in src:
                    raise TokenBatchPluginError(f"{src[k][1]}: {k} is a parameter of budget_rule tpot-guard "
                                                f"(budget_rule is {rule!r})")
                guard_values[k] = 0.0
                continue
            default = guard_levers.get(k, 0.0)
            v, w = get(k, default)
            if w == f"default {k}" and k in guard_levers:
                w = f"{pwhere} ({path!r}), levers[{policy + ('+shed' if margin is not None else '') + GUARD_SUFFIX!r}]"
            try:
                x = float(v)
            except (TypeError, ValueError):
                x = math.nan
            if isinstance(v, bool) or not lo <= x <= hi:
                raise TokenBatchPluginError(f"{w}: {k} must be a number in [{lo:g}, {hi:g}], got {v!r}")
            guard_values[k] = x

        t_ref_default = meta.get("t_ref_ms", 1000.0)
        t_ref = num("t_ref_ms", t_ref_default)
        profile, prwhere = get("profile", meta.get("profile", "llama2-7b-a100"))
        if prwhere == "default profile" and "profile" in meta:
            prwhere = f"{pwhere} ({path!r}), meta.profile"
        try:
            from ..engine.profiles import load_profile
            load_profile(str(profile))
        except Exception as e:  # noqa: BLE001 - any failure to load it: reported as the setting's error
            raise TokenBatchPluginError(f"{prwhere}: {e}") from None
        cfg = cls(policy=policy, index_params=params if policy == "index" else None,
                  shed_margin=margin, profile=str(profile), t_ref_ms=t_ref,
                  default_ttft_slo_ms=num("default_ttft_slo_ms", 1000.0),
                  default_est_output_tokens=num("default_est_output_tokens", None, allow_none=True),
                  policy_file=path, log_steps=_log_steps_path(*get("log_steps")),
                  budget_rule=rule, budget_u=guard_values["budget_u"], budget_bmin=guard_values["budget_bmin"],
                  default_tpot_slo_ms=num("default_tpot_slo_ms", None, allow_none=True))
        if policy == "index":
            try:
                params.theta_vector(t_ref)
            except Exception as e:  # noqa: BLE001 - any failure: reported as the setting's error
                raise TokenBatchPluginError(f"t_ref_ms: {e}") from None
        return cfg

    @property
    def label(self) -> str:
        lab = self.policy if self.shed_margin is None else f"{self.policy}+shed({self.shed_margin:g})"
        return lab + ("+tpot-guard" if self.budget_rule == "tpot-guard" else "")

    @property
    def ranked(self) -> bool:
        """Whether the plug-in ranks the requests (a TokenBatch policy) or keeps vLLM's own order."""
        return self.policy not in VLLM_POLICIES


def _log_steps_path(v, where) -> Optional[str]:
    """``log_steps``: a file that can be appended to and, if not empty, holds samples already."""
    from .._io import check_writable
    from ..engine.fit import SAMPLES_COLUMNS
    from ..errors import OutputError

    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "off", "none")):
        return None
    path = Path(str(v))
    header = ",".join(SAMPLES_COLUMNS)
    try:
        if path.is_file() and path.stat().st_size > 0:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = f.readline().strip()
            if first != header:
                raise TokenBatchPluginError(f"{where}: {path} exists and is not a samples file (first line "
                                            f"{first[:80]!r}, expected {header!r}): give a new path")
        check_writable(path, where)
    except OutputError as e:
        raise TokenBatchPluginError(str(e)) from None
    except OSError as e:
        raise TokenBatchPluginError(f"{where}: {path}: {e.strerror or e}") from None
    return str(path)


# --------------------------------------------------------------------------------------- mixin
@dataclasses.dataclass
class _ReqInfo:
    t1_ns: int
    t2_ns: Optional[int]
    est: float                  # NaN: no estimate


class _TokenBatchMixin:
    """The plug-in's behaviour; mixed into vLLM's Scheduler / AsyncScheduler."""

    def __init__(self, *args, tokenbatch_config: Optional[dict] = None, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        add = getattr(vllm_config, "additional_config", None)
        # validated before vLLM builds anything: a bad file fails start-up, not serving
        self.tokenbatch = PluginConfig.resolve(tokenbatch_config, add if isinstance(add, dict) else None)
        super().__init__(*args, **kwargs)
        # vLLM's priority policy: a heap ordered by (priority, arrival, id) and the priority victim
        # rule; the queues are still empty here, so they can be replaced regardless of the flag.
        # (fcfs / priority with a budget rule: that vLLM policy, unranked.)
        want = {"fcfs": SchedulingPolicy.FCFS}.get(self.tokenbatch.policy, SchedulingPolicy.PRIORITY)
        if self.policy != want:
            self.policy = want
            self.waiting = create_request_queue(want)
            self.kv_holding_waiting = create_request_queue(want)
        if (self.vllm_config.scheduler_config.async_scheduling
                and not isinstance(self, AsyncScheduler)):
            logger.warning("TokenBatch plug-in: async scheduling is on; use TokenBatchAsyncScheduler")
        from ..engine.profiles import load_profile
        from ..policies import engine_policy
        prof = load_profile(self.tokenbatch.profile)
        self._tb_budget = int(self.max_num_scheduled_tokens)
        self._tb_ps = np.ascontiguousarray(np.asarray(prof.cost.ps, np.int64)[:4])
        self._tb_u_p, self._tb_u_d = prof.cost.per_token_ms(self._tb_budget)
        self._tb_ranked = self.tokenbatch.ranked
        self._tb_pid, self._tb_theta = 0, np.zeros(_s.N_THETA)
        if self._tb_ranked:
            ep = engine_policy(self.tokenbatch.policy, params=self.tokenbatch.index_params,
                               shed_margin=self.tokenbatch.shed_margin, t_ref_ms=self.tokenbatch.t_ref_ms)
            self._tb_pid = _PIDS[self.tokenbatch.policy]
            if ep.theta is not None:
                self._tb_theta = np.ascontiguousarray(ep.theta, np.float64)
        # the tpot-guard rule (docs/design.md section 11): the six cost terms in integer ps (c0,
        # c_prefill, c_c2, c_attn, c_decode, c_kv) and each request's first-token time (ns)
        self._tb_guard = self.tokenbatch.budget_rule == "tpot-guard"
        self._tb_gps = tuple(int(x) for x in prof.cost.ps)
        self._tb_first: dict[str, int] = {}
        pool = self.kv_cache_manager.block_pool
        self._tb_usable = float(pool.num_gpu_blocks - 1)   # block 0 is the null block
        self._tb_info: dict[str, _ReqInfo] = {}
        self._tb_shed_out: list = []                       # aborted requests not yet reported
        self._tb_now_ns: Callable[[], int] = time.time_ns
        self._tb_arrival_scale = 1e9                       # Request.arrival_time is in seconds
        #: counters: schedules ranked, requests shed (aborted), invalid per-request extra_args,
        #: schedules whose token budget the tpot-guard rule lowered
        self.tokenbatch_stats = {"schedules": 0, "shed": 0, "bad_extra_args": 0, "budget_lowered": 0}
        #: the token budget of the last schedule() (B_t under the tpot-guard rule, else B)
        self.tokenbatch_last_budget = self._tb_budget
        #: request id -> clock (ns) at which the shed rule aborted it
        self.tokenbatch_shed: dict[str, int] = {}
        #: the last ranking: request id -> (tier, score)
        self.tokenbatch_last: dict[str, tuple] = {}
        self._tb_step_ns: Callable[[], int] = time.perf_counter_ns   # log_steps' step timer
        self._tb_pending: dict[int, tuple] = {}     # id(SchedulerOutput) -> (schedule() start, features)
        self._tb_last_update_ns: Optional[int] = None
        self._tb_log = None
        if self.tokenbatch.log_steps is not None:
            self._tb_open_log()
        cfg = self.tokenbatch
        rule = (f"tpot-guard (u {cfg.budget_u:g}, B_min {cfg.budget_bmin:g}, default TPOT SLO "
                + ("none" if cfg.default_tpot_slo_ms is None else f"{cfg.default_tpot_slo_ms:g} ms") + ")"
                if self._tb_guard else "none")
        logger.info("TokenBatch plug-in: policy %s%s, profile %s, T_ref %g ms, file %s, budget rule %s",
                    cfg.label, "" if self._tb_ranked else " (vLLM's own order, unranked)", cfg.profile,
                    cfg.t_ref_ms, cfg.policy_file, rule)

    # ------------------------------------------------------------------ clock (for replays)
    def set_clock(self, now_ns: Callable[[], int], arrival_unit_ns: float = 1e9) -> None:
        """Replace the wall clock: ``now_ns()`` gives the current time in ns and
        ``Request.arrival_time * arrival_unit_ns`` a request's arrival in ns (a simulated clock)."""
        self._tb_now_ns = now_ns
        self._tb_step_ns = now_ns
        self._tb_arrival_scale = float(arrival_unit_ns)

    # ------------------------------------------------------------------ log_steps
    def _tb_open_log(self) -> None:
        from ..engine.fit import SAMPLES_COLUMNS
        path = self.tokenbatch.log_steps
        try:
            f = open(path, "a", encoding="utf-8", newline="")
            if f.tell() == 0:
                f.write(",".join(SAMPLES_COLUMNS) + "\n")
                f.flush()
        except OSError as e:
            raise TokenBatchPluginError(f"log_steps: {path}: cannot write: {e.strerror or e}") from None
        self._tb_log = f
        self.tokenbatch_stats["logged_steps"] = 0
        sc, cc = self.scheduler_config, self.cache_config
        cmd = (f"tokenbatch profiles fit --samples {shlex.quote(path)} --name NAME --num-blocks "
               f"{self.kv_cache_manager.block_pool.num_gpu_blocks} --max-model-len {self.max_model_len} "
               f"--block-size {self.block_size} --max-num-batched-tokens {self._tb_budget} "
               f"--max-num-seqs {sc.max_num_seqs} "
               f"--{'' if isinstance(self, AsyncScheduler) else 'no-'}async-scheduling")
        logger.info("TokenBatch plug-in: logging steps to %s (prefix caching %s); fit with: %s", path,
                    "on" if cc.enable_prefix_caching else "off", cmd)

    def _tb_step_features(self, so) -> tuple:
        """(kind, P, D, K, sum_c2, sum_kv_c) of a scheduled step, by the engine's cost model rule
        (docs/design.md section 3): read after ``schedule()`` advanced num_computed_tokens."""
        placeholder = 1 if isinstance(self, AsyncScheduler) else 0   # already added for this step
        from ..engine.cost_model import batch_features
        items = []
        for rid, new in so.num_scheduled_tokens.items():
            req = self.requests[rid]
            mid_prefill = req.is_prefill_chunk
            gen_before = len(req.output_token_ids) + req.num_output_placeholders
            if not mid_prefill:
                gen_before -= placeholder
            items.append((new, req.num_computed_tokens - new, new == 1 and not mid_prefill and gen_before > 0))
        pre, c2, attn, dec, kv = batch_features(items)
        kind = 0 if dec == 0 else (1 if pre == 0 else 2)
        return kind, pre, dec, kv, c2, attn

    def _tb_log_step(self, so) -> None:
        t = int(self._tb_step_ns())
        item = self._tb_pending.pop(id(so), None)
        last, self._tb_last_update_ns = self._tb_last_update_ns, t
        if item is None or self._tb_log is None:
            return
        t0, feats = item
        ns = t - (t0 if last is None or last < t0 else last)
        if ns <= 0:
            return   # (a clock that did not move: no time to fit)
        try:
            self._tb_log.write(",".join(map(str, feats)) + f",{ns // 1_000_000}.{ns % 1_000_000:06d}\n")
            self._tb_log.flush()
        except OSError as e:   # a full disk must not stop the server: stop logging, say so once
            logger.warning("TokenBatch plug-in: log_steps %s: %s; step logging stopped",
                           self.tokenbatch.log_steps, e.strerror or e)
            self._tb_log = None
            return
        self.tokenbatch_stats["logged_steps"] += 1

    # ------------------------------------------------------------------ per request
    def _tb_request_info(self, req) -> _ReqInfo:
        info = self._tb_info.get(req.request_id)
        if info is not None:
            return info
        cfg = self.tokenbatch
        t1_ms, t2_ms, est = cfg.default_ttft_slo_ms, cfg.default_tpot_slo_ms, cfg.default_est_output_tokens
        xa = getattr(req.sampling_params, "extra_args", None) if req.sampling_params else None
        if xa:
            try:
                if EXTRA_TTFT_SLO_MS in xa:
                    t1_ms = _positive(xa[EXTRA_TTFT_SLO_MS], EXTRA_TTFT_SLO_MS)
                if EXTRA_TPOT_SLO_MS in xa:
                    t2_ms = _positive(xa[EXTRA_TPOT_SLO_MS], EXTRA_TPOT_SLO_MS)
                if EXTRA_EST_OUTPUT_TOKENS in xa:
                    est = _positive(xa[EXTRA_EST_OUTPUT_TOKENS], EXTRA_EST_OUTPUT_TOKENS)
            except ValueError as e:
                self.tokenbatch_stats["bad_extra_args"] += 1
                logger.warning("TokenBatch plug-in: request %s: %s; using the defaults",
                               req.request_id, e)
                t1_ms, t2_ms, est = cfg.default_ttft_slo_ms, cfg.default_tpot_slo_ms, cfg.default_est_output_tokens
        info = _ReqInfo(int(round(t1_ms * 1e6)), None if t2_ms is None else int(round(t2_ms * 1e6)),
                        float("nan") if est is None else float(est))
        self._tb_info[req.request_id] = info
        return info

    def _tb_held_blocks(self, req) -> int:
        ids = self.kv_cache_manager.get_block_ids(req.request_id)
        return len(ids[0]) if ids else 0

    # ------------------------------------------------------------------ the ranking
    def _tb_rank(self) -> None:
        """docs/design.md section 4, exactly as the engine's kernel ("In-engine scores"): features and
        scores from the state at the iteration's start, the common shed rule, then ranks."""
        t_now = int(self._tb_now_ns())
        bs = self.block_size
        pool = self.kv_cache_manager.block_pool
        kvf = pool.get_num_free_blocks() / self._tb_usable
        usable = self._tb_usable
        sm = self.tokenbatch.shed_margin
        pid, theta, budget, ps = self._tb_pid, self._tb_theta, self._tb_budget, self._tb_ps
        u_p, u_d = self._tb_u_p, self._tb_u_d
        scale = self._tb_arrival_scale
        prefix_on = bool(self.cache_config.enable_prefix_caching)

        waiting = list(self.waiting) + list(self.kv_holding_waiting)
        keyed = []
        shed = []
        for waiting_flag, reqs in ((True, waiting), (False, list(self.running))):
            for req in reqs:
                info = self._tb_request_info(req)
                prompt = req.num_prompt_tokens
                gen = len(req.output_token_ids) + req.num_output_placeholders
                num_tokens = prompt + gen
                if waiting_flag:
                    hits = 0
                    if prefix_on and req.num_computed_tokens == 0:
                        hits = self.kv_cache_manager.get_computed_blocks(req)[1] // bs
                    done = hits * bs
                    p_left = num_tokens - done
                    blocks_needed = (num_tokens + bs - 1) // bs - hits
                    ratio = hits * bs / prompt
                else:
                    done = req.num_computed_tokens
                    p_left = num_tokens - done
                    if gen > 0 and p_left == 1:
                        p_left = 0  # decoding
                    blocks_needed = self._tb_held_blocks(req)
                    ratio = (done if done < prompt else prompt) / prompt
                first_out = gen > 0
                arrival = int(round(req.arrival_time * scale))
                to_deadline_ms = (arrival + info.t1_ns - t_now) / 1e6
                slack_ms = to_deadline_ms
                if not first_out:
                    slack_ms -= _s.prefill_time_ns(p_left, done, budget, ps) / 1e6
                if (waiting_flag and not first_out and sm is not None
                        and slack_ms < -sm * (info.t1_ns / 1e6)):
                    shed.append(req)
                    continue
                e = info.est
                if e != e:
                    d_left = 1.0  # no estimate and no residual-life table: the engine's default
                else:
                    d_left = e - gen
                    if d_left < 1.0:
                        d_left = 1.0
                s_ms = _s.service_ms(float(p_left), d_left, u_p, u_d)
                tier = -1 if (not first_out and slack_ms < 0.0) else 0
                sc = _s.policy_score(pid, theta, ratio, s_ms, d_left, slack_ms, info.t1_ns / 1e6,
                                     first_out, kvf, float(blocks_needed), usable, to_deadline_ms,
                                     float(arrival + info.t1_ns), float(bs), 0.0)   # (the kernel's types)
                if sc != sc:
                    from ..errors import PolicyError
                    raise PolicyError(f"TokenBatch plug-in: policy {self.tokenbatch.label} produced a "
                                      f"NaN score for request {req.request_id}")
                keyed.append(((-tier, -sc, req.arrival_time, req.request_id), req, tier, sc))
        if shed:
            self._tb_shed(shed, t_now)
        keyed.sort(key=lambda k: k[0])
        last = {}
        for rank, (_, req, tier, sc) in enumerate(keyed):
            req.priority = rank
            last[req.request_id] = (tier, sc)
        self.tokenbatch_last = last
        for q in (self.waiting, self.kv_holding_waiting):
            if isinstance(q, PriorityRequestQueue):
                heapq.heapify(q._heap)
        self.tokenbatch_stats["schedules"] += 1

    # ------------------------------------------------------------------ the tpot-guard rule
    def _tb_guard_budget(self) -> int:
        """B_t of the tpot-guard rule (docs/design.md section 11), exactly as the engine's kernel
        (``guard_slack``, then ``guard_budget`` with the waiting queue head's cached tokens): one pass
        over the running requests, then one over the decoding ones with a TPOT SLO."""
        B = self._tb_budget
        n_wait = len(self.waiting) + len(self.kv_holding_waiting)
        pending = n_wait > 0
        D = ctx = cb = 0
        cands = []
        max_len = self.max_model_len
        info = self._tb_request_info
        for req in self.running:
            prompt = req.num_prompt_tokens
            gen = len(req.output_token_ids) + req.num_output_placeholders
            if gen >= req.max_tokens or prompt + gen >= max_len:
                continue   # async: finished by the step in flight, not schedulable (the engine's ENDED)
            comp = req.num_computed_tokens
            if gen > 0 and comp == prompt + gen - 1:   # its next step is a decode
                D += 1
                ctx += comp
                t2 = info(req).t2_ns
                if t2 is not None and t2 < NO_TPOT_SLO_NS:
                    cands.append((req.request_id, t2, gen))
            else:   # mid-prefill or mid-recompute
                pending = True
                if comp > cb:
                    cb = comp
        if not pending or not cands:
            return B
        ps0, ps_pre, ps_c2, ps_attn, ps_dec, ps_kv = self._tb_gps
        tau_dec = ps0 + ps_dec * D + ps_kv * ctx   # ps
        t_now = int(self._tb_now_ns())
        first = self._tb_first
        min_credit = None
        for rid, t2, gen in cands:
            if t2 * 1000 <= tau_dec:
                continue
            ft = first.get(rid)   # None: its first token is in flight (async): emitted at t_now
            credit = (float(t2) * float(gen) - float(0 if ft is None else t_now - ft)) * 1000.0   # ps
            if min_credit is None or credit < min_credit:
                min_credit = credit
        if min_credit is None:
            return B
        slack = (1.0 + self.tokenbatch.budget_u) * min_credit - float(tau_dec)
        slack_ps = 0 if slack <= 0.0 else (int(slack) if slack < 4e18 else 4 * 10**18)
        bs = self.block_size
        if slack_ps > 0 and n_wait > 0 and ps_attn != 0 and self.cache_config.enable_prefix_caching:
            # the waiting queue head's cached tokens (vLLM drains kv_holding_waiting first; with no
            # slack p_t is 0 whatever they are)
            q = self.kv_holding_waiting if len(self.kv_holding_waiting) else self.waiting
            head = q.peek_request()
            if head.num_computed_tokens == 0:
                hb = self.kv_cache_manager.get_computed_blocks(head)[1] // bs * bs
                if hb > cb:
                    cb = hb
        p = int(guard_chunk(slack_ps, ps_pre + ps_attn * cb, ps_c2, B))
        x = D + (p if p > bs else bs)
        floor = math.ceil(self.tokenbatch.budget_bmin * B)
        if x < floor:
            x = floor
        return x if x < B else B

    def _tb_note_first_tokens(self, scheduler_output) -> None:
        """Record the first-token time (the clock now, at the step's output) of every request of
        ``scheduler_output`` whose first output token just arrived."""
        first = self._tb_first
        reqs = self.requests
        now = None
        for rid in scheduler_output.num_scheduled_tokens:
            if rid in first:
                continue
            req = reqs.get(rid)
            if req is not None and req.num_output_tokens > 0:
                if now is None:
                    now = int(self._tb_now_ns())
                first[rid] = now

    def _tb_shed(self, reqs, t_now: int) -> None:
        ids = [r.request_id for r in reqs]
        done = self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for r in done:
            self.tokenbatch_shed[r.request_id] = t_now
            self._tb_shed_out.append(r)
            self._tb_info.pop(r.request_id, None)
        self.tokenbatch_stats["shed"] += len(done)

    # ------------------------------------------------------------------ vLLM hooks
    def schedule(self, *args, **kwargs):
        t0 = int(self._tb_step_ns()) if self._tb_log is not None else 0
        if self._tb_ranked:
            self._tb_rank()
        if self._tb_guard:
            # vLLM's schedule() reads its step's token budget from max_num_scheduled_tokens
            bt = self._tb_guard_budget()
            self.tokenbatch_last_budget = bt
            prev = self.max_num_scheduled_tokens
            if bt < prev:
                self.tokenbatch_stats["budget_lowered"] += 1
                self.max_num_scheduled_tokens = bt
                try:
                    out = super().schedule(*args, **kwargs)
                finally:
                    self.max_num_scheduled_tokens = prev
            else:
                out = super().schedule(*args, **kwargs)
        else:
            out = super().schedule(*args, **kwargs)
        if self._tb_log is not None and out.total_num_scheduled_tokens > 0:
            try:
                self._tb_pending[id(out)] = (t0, self._tb_step_features(out))
            except (KeyError, AttributeError) as e:   # (a vLLM whose requests look otherwise)
                logger.warning("TokenBatch plug-in: log_steps: cannot read a step (%r); step logging "
                               "stopped", e)
                self._tb_log = None
                return out
            if len(self._tb_pending) > 64:   # outputs never updated (cannot happen in vLLM's loops)
                self._tb_pending.pop(next(iter(self._tb_pending)))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        outs = super().update_from_output(scheduler_output, model_runner_output)
        if self._tb_shed_out:
            # report the shed requests to their clients as finished (reason: abort)
            for r in self._tb_shed_out:
                eco = outs.get(r.client_index)
                if eco is None:
                    eco = outs[r.client_index] = EngineCoreOutputs()
                eco.outputs.append(EngineCoreOutput(
                    request_id=r.request_id, new_token_ids=[], finish_reason=r.get_finished_reason(),
                    events=r.take_events(), trace_headers=r.trace_headers))
            self._tb_shed_out = []
        if self._tb_guard:
            self._tb_note_first_tokens(scheduler_output)
        # forget requests that have left the scheduler
        if len(self._tb_info) > 2 * len(self.requests) + 64:
            self._tb_info = {k: v for k, v in self._tb_info.items() if k in self.requests}
        if len(self._tb_first) > 2 * len(self.requests) + 64:
            self._tb_first = {k: v for k, v in self._tb_first.items() if k in self.requests}
        if self._tb_log is not None:
            self._tb_log_step(scheduler_output)
        return outs


def _positive(v, key) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"extra_args {key}={v!r} is not a number") from None
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"extra_args {key}={v!r} must be a finite number > 0")
    return x


class TokenBatchScheduler(_TokenBatchMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` ordered by a TokenBatch policy (``--scheduler-cls``)."""


class TokenBatchAsyncScheduler(_TokenBatchMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (the GPU default) ordered by a TokenBatch policy."""


def scheduler_class(async_scheduling: bool):
    return TokenBatchAsyncScheduler if async_scheduling else TokenBatchScheduler
