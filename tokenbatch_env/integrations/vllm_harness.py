"""Replay a Trace through vLLM's real V1 scheduler on CPU, with no model and no GPU.

vLLM (the ``vllm`` extra, ``docs/fidelity.md``) is imported only when this module's functions run.
The harness builds a ``VllmConfig`` from a tiny llama-like ``config.json`` written to a temporary
directory (no weights, no tokenizer, no hub), gives vLLM's ``Scheduler`` (or ``AsyncScheduler``) a
``KVCacheConfig`` with one full-attention group of ``num_blocks`` blocks, and drives it the way
vLLM's ``EngineCore`` does (``step`` for sync, ``step_with_batch_queue`` with a queue of 2 for async),
fabricating a ``ModelRunnerOutput`` with one sampled token for every scheduled request that is not
left mid-prefill.

Clocks are identical on both sides: iteration times follow the engine profile's cost model from
the tokens vLLM scheduled, and a request arriving at ``t`` is added before the first ``schedule()``
whose iteration starts at or after ``t``. Iterations are numbered like the engine's: only
``schedule()`` calls that scheduled tokens count. A scheduler with ``set_clock`` (the TokenBatch
plug-in) reads the iteration's start in ``schedule()`` and, in ``update_from_output``, the end of the
iteration whose output it processes (under async scheduling that runs after the next iteration was
scheduled, as in vLLM's ``EngineCore``: on a server, about when the output arrives).

Prefix caching: token ids are derived from the trace's block-hash chains (one chain hash -> 16
deterministic token ids, the same for every request sharing it); blocks past the chain, and every
generated token, get ids unique to the request, so vLLM's own block hashing finds exactly the hits
the engine models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections import deque
from typing import Optional

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace

#: Request-record columns compared with the engine, request by request.
COMPARED_FIELDS = ("first_token_iteration", "finish_iteration", "preemptions")
#: Further columns reported (the clocks agree whenever the iteration contents agree).
EXTRA_FIELDS = ("first_scheduled_ns", "first_token_ns", "finish_ns")

_UNIQUE_TOKEN_BASE = 1 << 40     # unique (per request) token ids start here; chain tokens below


def vllm_import_error() -> Optional[str]:
    """None if vLLM's scheduler can be imported here, else the reason it cannot."""
    try:
        _vllm()
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising something else
        return f"{type(e).__name__}: {e}"
    return None


def _vllm():
    """Import the parts of vLLM the harness uses (CPU platform, offline)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm  # noqa: F401
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    return dict(CacheConfig=CacheConfig, ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig,
                VllmConfig=VllmConfig, SamplingParams=SamplingParams,
                get_hash_fn_by_name=get_hash_fn_by_name,
                get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash,
                AsyncScheduler=AsyncScheduler, Scheduler=Scheduler,
                FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
                KVCacheGroupSpec=KVCacheGroupSpec, ModelRunnerOutput=ModelRunnerOutput,
                Request=Request, RequestStatus=RequestStatus,
                StructuredOutputManager=StructuredOutputManager)


def vllm_version() -> str:
    import vllm
    return getattr(vllm, "__version__", "?")


# ---------------------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    """The budgets both sides run with (resolved from an engine profile plus overrides)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    num_blocks: int                 # total blocks including vLLM's null block 0
    block_size: int = 16
    max_model_len: int = 4096
    prefix_caching: bool = True
    async_scheduling: bool = False
    policy: str = "fcfs"            # one of policies.vllm_modes()
    watermark: float = 0.0          # vLLM's SchedulerConfig.watermark (a fraction of the blocks)
    long_prefill_token_threshold: int = 0   # vLLM's SchedulerConfig.long_prefill_token_threshold (0: off)

    def __post_init__(self):
        from ..policies import vllm_modes
        if self.policy not in vllm_modes():
            raise ConfigError(f"vLLM policy must be {' or '.join(map(repr, vllm_modes()))}, got {self.policy!r}")
        if self.num_blocks < 2:
            raise ConfigError("num_blocks must be >= 2 (block 0 is vLLM's null block)")


def resolve_config(profile="linear", policy="fcfs", *, num_blocks=None, max_num_batched_tokens=None,
                   max_num_seqs=None, prefix_caching=True, async_scheduling=None, long_prefill_token_threshold=0):
    """(HarnessConfig, engine Profile, EngineConfig) for one comparison, from an engine profile."""
    from ..engine.profiles import load_profile
    from ..engine.state import EngineConfig
    ecfg = EngineConfig(prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        num_blocks=num_blocks, record_iterations=1_000_000,
                        long_prefill_token_threshold=long_prefill_token_threshold or None)
    prof = ecfg.resolve(load_profile(profile) if isinstance(profile, str) else profile)
    if prof.watermark_blocks:
        raise ConfigError("the harness does not model a non-zero watermark yet (profile "
                          f"{prof.name!r} has watermark_blocks={prof.watermark_blocks})")
    hc = HarnessConfig(max_num_batched_tokens=prof.max_num_batched_tokens,
                       max_num_seqs=prof.max_num_seqs, num_blocks=prof.num_blocks,
                       block_size=prof.block_size, max_model_len=prof.max_model_len,
                       prefix_caching=prefix_caching, async_scheduling=prof.async_scheduling,
                       policy=policy, long_prefill_token_threshold=ecfg.threshold)
    return hc, prof, ecfg


def _write_model_dir(path: str, max_model_len: int) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 32000,
        "max_position_embeddings": max(max_model_len, 16), "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def make_scheduler(hc: HarnessConfig, model_dir: str, scheduler_cls=None, scheduler_kwargs=None):
    """vLLM's real Scheduler (or AsyncScheduler) for ``hc`` -- or ``scheduler_cls`` (a class or a
    dotted path, as vLLM's ``--scheduler-cls``) built with ``scheduler_kwargs`` -- returns
    (scheduler, block_hasher)."""
    V = _vllm()
    import torch
    model_config = V["ModelConfig"](model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                                    dtype="float32", seed=0, max_model_len=hc.max_model_len)
    sched_config = V["SchedulerConfig"](
        max_num_seqs=hc.max_num_seqs, max_num_batched_tokens=hc.max_num_batched_tokens,
        max_model_len=hc.max_model_len, enable_chunked_prefill=True,
        long_prefill_token_threshold=hc.long_prefill_token_threshold, policy=hc.policy,
        async_scheduling=hc.async_scheduling,
        watermark=hc.watermark, is_encoder_decoder=False)
    cache_config = V["CacheConfig"](block_size=hc.block_size, cache_dtype="auto",
                                    enable_prefix_caching=hc.prefix_caching)
    vllm_config = V["VllmConfig"](model_config=model_config, scheduler_config=sched_config,
                                  cache_config=cache_config)
    cache_config.num_gpu_blocks = hc.num_blocks
    spec = V["FullAttentionSpec"](block_size=hc.block_size, num_kv_heads=1, head_size=1,
                                  dtype=torch.float32)
    kv_cache_config = V["KVCacheConfig"](
        num_blocks=hc.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[V["KVCacheGroupSpec"](["layer.0"], spec)])
    if scheduler_cls is None:
        cls = V["AsyncScheduler"] if hc.async_scheduling else V["Scheduler"]
    else:  # resolved the way vLLM's EngineCore does (SchedulerConfig.get_scheduler_cls)
        sched_config.scheduler_cls = scheduler_cls
        cls = sched_config.get_scheduler_cls()
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=V["StructuredOutputManager"](vllm_config),
                block_size=hc.block_size, log_stats=False, **(scheduler_kwargs or {}))
    hash_fn = V["get_hash_fn_by_name"](cache_config.prefix_caching_hash_algo)
    V["init_none_hash"](hash_fn)
    hasher = V["get_request_block_hasher"](hc.block_size, hash_fn)
    return sched, hasher


# ---------------------------------------------------------------------------------------- tokens
def prompt_token_ids(trace: Trace, block_size: int = 16) -> list[list[int]]:
    """Token ids whose shared prefixes are equal exactly where the trace's chains are equal.

    Chain hash -> ``block_size`` token ids (the k-th distinct chain hash gets ``k*bs+1 ..``);
    tokens past the chain are unique to the request."""
    ids: dict[int, int] = {}
    out = []
    uniq = _UNIQUE_TOKEN_BASE
    for i in range(len(trace)):
        p = int(trace.prompt_tokens[i])
        toks = []
        for h in trace.prefix_chain(i):
            base = ids.setdefault(int(h), len(ids) * block_size + 1)
            toks.extend(range(base, base + block_size))
        rest = p - len(toks)
        toks.extend(range(uniq, uniq + rest))
        uniq += rest
        out.append(toks)
    return out


# ---------------------------------------------------------------------------------------- result
@dataclasses.dataclass
class VllmRun:
    """What vLLM's scheduler did with a trace (columns like the engine's ``SimResult.records``)."""

    config: HarnessConfig
    records: dict           # per request: request, first_scheduled_ns, first_token_iteration, ...
    iterations: dict        # per counted iteration: iteration, start_ns, end_ns, prefill_tokens, ...
    vllm_version: str
    truncated: bool = False


def _cost_ns(cost, now, items):
    """The engine's cost model (``CostModel.iteration_ns``, exact integers) for ``items`` =
    [(new, computed_before, is_decode)]. Returns (end_ns, prefill_tokens, decodes)."""
    from ..engine.cost_model import batch_features
    pre, c2, attn, dec, kv = batch_features(items)
    return now + int(cost.iteration_ns(pre, c2, attn, dec, kv)), pre, dec


def replay(trace: Trace, profile="linear", policy="fcfs", *, num_blocks=None,
           max_num_batched_tokens=None, max_num_seqs=None, prefix_caching=True,
           async_scheduling=None, max_iterations: int = 1_000_000, scheduler_cls=None,
           scheduler_kwargs=None, extra_args=None, long_prefill_token_threshold=0) -> VllmRun:
    """Drive vLLM's scheduler over ``trace`` with the budgets of engine ``profile`` (+ overrides).

    ``scheduler_cls``/``scheduler_kwargs``: run that scheduler class instead of vLLM's (e.g. the
    TokenBatch plug-in; a scheduler with ``set_clock`` is given the replay's clock, in ns);
    ``extra_args``: one ``SamplingParams.extra_args`` dict (or None) per request."""
    hc, prof, _ = resolve_config(profile, policy, num_blocks=num_blocks,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs, prefix_caching=prefix_caching,
                                 async_scheduling=async_scheduling,
                                 long_prefill_token_threshold=long_prefill_token_threshold)
    if trace.block_size != hc.block_size:
        raise ConfigError(f"trace block size {trace.block_size} != profile block size {hc.block_size}")
    return _replay(trace, hc, prof.cost, max_iterations, scheduler_cls, scheduler_kwargs,
                   extra_args)


def _replay(trace: Trace, hc: HarnessConfig, cost, max_iterations: int, scheduler_cls=None,
            scheduler_kwargs=None, extra_args=None) -> VllmRun:
    V = _vllm()
    Request, SamplingParams = V["Request"], V["SamplingParams"]
    MRO = V["ModelRunnerOutput"]
    n = len(trace)
    arrival = trace.arrival_ns.astype(np.int64)
    prompt = trace.prompt_tokens.astype(np.int64)
    # rule 8 of docs/design.md section 3: output capped at max_model_len - prompt
    out_len = np.minimum(trace.output_tokens, np.maximum(hc.max_model_len - prompt, 1)).astype(np.int64)
    toks = prompt_token_ids(trace, hc.block_size)
    rid = [f"r{i:09d}" for i in range(n)]          # lexical order == index order (Request.__lt__)
    index = {r: i for i, r in enumerate(rid)}

    neg = lambda: np.full(n, -1, np.int64)  # noqa: E731
    rec = {"request": np.arange(n), "arrival_ns": arrival.copy(), "prompt_tokens": prompt.copy(),
           "output_tokens": out_len.copy(), "first_scheduled_ns": neg(),
           "first_scheduled_iteration": neg(), "first_token_ns": neg(),
           "first_token_iteration": neg(), "finish_ns": neg(), "finish_iteration": neg(),
           "preemptions": np.zeros(n, np.int64), "rejected": np.zeros(n, bool),
           "shed": np.zeros(n, bool)}
    it_cols = {k: [] for k in ("iteration", "start_ns", "end_ns", "prefill_tokens", "decodes",
                               "scheduled_reqs", "scheduled", "preempted", "preempted_ids", "blocks_used",
                               "running", "waiting")}
    next_uniq = [_UNIQUE_TOKEN_BASE // 2 + i * 1_000_000 for i in range(n)]  # generated token ids
    usable = hc.num_blocks - 1

    with tempfile.TemporaryDirectory(prefix="tokenbatch-vllm-") as d:
        _write_model_dir(d, hc.max_model_len)
        sched, hasher = make_scheduler(hc, d, scheduler_cls, scheduler_kwargs)
        out_clock = None   # while an output is processed: the end of its iteration
        if hasattr(sched, "set_clock"):
            # arrival_time below is in ns
            sched.set_clock(lambda: now if out_clock is None else out_clock, 1.0)
        shed_at = getattr(sched, "tokenbatch_shed", {})
        pool = sched.kv_cache_manager.block_pool
        batch_queue: deque = deque()
        queue_size = 2 if hc.async_scheduling else 1
        now = 0
        nxt = 0
        it = 0
        ended = 0
        truncated = False
        stall = 0

        def end_time_of(k):
            return it_cols["end_ns"][k]

        def process(so, mro, n_it):
            nonlocal ended, out_clock
            # the scheduler's clock reads the end of the iteration whose output this is (async: the
            # next one is scheduled already and `now` is its end)
            out_clock = None if n_it is None else end_time_of(n_it)
            try:
                outs = sched.update_from_output(so, mro)
            finally:
                out_clock = None
            for eco in outs.values():
                for o in eco.outputs:
                    i = index[o.request_id]
                    if o.request_id in shed_at:  # aborted by the plug-in's shed rule
                        rec["shed"][i] = True
                        rec["finish_ns"][i] = shed_at[o.request_id]
                        ended += 1
                        continue
                    if o.new_token_ids and rec["first_token_iteration"][i] < 0:
                        rec["first_token_iteration"][i] = n_it
                        rec["first_token_ns"][i] = end_time_of(n_it)
                    if o.finish_reason is not None:
                        rec["finish_iteration"][i] = n_it
                        rec["finish_ns"][i] = end_time_of(n_it)
                        ended += 1

        while ended < n:
            if it >= max_iterations:
                truncated = True
                break
            idle = not sched.has_requests() and not batch_queue
            if idle and nxt < n and arrival[nxt] > now:
                now = int(arrival[nxt])  # idle engine: jump to the next arrival
            while nxt < n and arrival[nxt] <= now:
                i = nxt
                nxt += 1
                if prompt[i] >= hc.max_model_len:       # rule 8: rejected at arrival
                    rec["rejected"][i] = True
                    rec["finish_ns"][i] = int(arrival[i])
                    ended += 1
                    continue
                sp = SamplingParams(max_tokens=int(out_len[i]), ignore_eos=True, temperature=0.0,
                                    extra_args=None if extra_args is None else extra_args[i])
                req = Request(request_id=rid[i], prompt_token_ids=list(toks[i]), sampling_params=sp,
                              pooling_params=None, arrival_time=float(arrival[i]),
                              priority=int(trace.priority[i]), block_hasher=hasher)
                sched.add_request(req)
            if ended >= n:
                break
            just = None  # the counted iteration scheduled in this pass, if any
            if sched.has_requests():
                so = sched.schedule()
                tot = so.total_num_scheduled_tokens
                n_it = None
                sampled_ids, sampled = [], []
                if tot > 0:
                    items = []
                    for r, new in so.num_scheduled_tokens.items():
                        req = sched.requests[r]
                        i = index[r]
                        mid_prefill = req.is_prefill_chunk
                        # tokens the engine counts as generated before this iteration
                        gen_before = len(req.output_token_ids) + req.num_output_placeholders
                        if hc.async_scheduling and not mid_prefill:
                            gen_before -= 1  # AsyncScheduler already added this step's placeholder
                        cb = req.num_computed_tokens - new
                        is_dec = (new == 1 and not mid_prefill and gen_before > 0)
                        items.append((new, cb, is_dec))
                        if rec["first_scheduled_ns"][i] < 0:
                            rec["first_scheduled_ns"][i] = now
                            rec["first_scheduled_iteration"][i] = it
                        sampled_ids.append(r)
                        if mid_prefill:
                            sampled.append([])
                        else:
                            sampled.append([next_uniq[i]])
                            next_uniq[i] += 1
                    end, pre, dec = _cost_ns(cost, now, items)
                    pre_ids = sorted(index[r] for r in (so.preempted_req_ids or ()))
                    for r in (so.preempted_req_ids or ()):
                        rec["preemptions"][index[r]] += 1
                    it_cols["iteration"].append(it)
                    it_cols["start_ns"].append(now)
                    it_cols["end_ns"].append(end)
                    it_cols["prefill_tokens"].append(pre)
                    it_cols["decodes"].append(dec)
                    it_cols["scheduled_reqs"].append(len(items))
                    it_cols["scheduled"].append([(index[r], int(k)) for r, k in so.num_scheduled_tokens.items()])
                    it_cols["preempted"].append(len(pre_ids))
                    it_cols["preempted_ids"].append(pre_ids)
                    it_cols["blocks_used"].append(usable - pool.get_num_free_blocks())
                    it_cols["running"].append(len(sched.running))
                    it_cols["waiting"].append(len(sched.waiting))
                    n_it = it
                    just = it
                    it += 1
                    now = end
                    stall = 0
                else:
                    pre_ids = list(so.preempted_req_ids or ())
                    for r in pre_ids:  # (a zero-token step cannot preempt, but count it if it did)
                        rec["preemptions"][index[r]] += 1
                mro = MRO(req_ids=sampled_ids, req_id_to_index={r: k for k, r in enumerate(sampled_ids)},
                          sampled_token_ids=sampled)
                batch_queue.appendleft((so, mro, n_it))
                if tot == 0:
                    stall += 1
                    # nothing ran: with nothing running, jump to the next arrival (as the engine)
                    if not sched.running and not batch_queue_pending_work(batch_queue) and nxt < n:
                        now = max(now, int(arrival[nxt]))
                    elif not sched.running and not batch_queue_pending_work(batch_queue):
                        # nothing running, nothing in flight, nothing arriving: the head of the
                        # queue can never fit -- the engine rejects it; vLLM would spin.
                        if stall > 2:
                            head = _queue_head(sched)
                            if head is not None:
                                i = index[head.request_id]
                                sched.finish_requests(head.request_id, _aborted(V))
                                rec["rejected"][i] = True
                                rec["finish_ns"][i] = now
                                ended += 1
                                stall = 0
                if len(batch_queue) < queue_size and (tot > 0 or sched.has_requests()):
                    continue
            elif not batch_queue:
                if nxt < n:
                    now = max(now, int(arrival[nxt]))
                    continue
                break
            so, mro, n_it = batch_queue.pop()
            process(so, mro, n_it)
            if just is not None:
                # blocks held once this iteration's finished requests are freed (sync) or once
                # the previous iteration's are (async): the engine's end-of-iteration count
                it_cols["blocks_used"][just] = usable - pool.get_num_free_blocks()
        while batch_queue:  # drain (async): outputs of the last scheduled steps
            so, mro, n_it = batch_queue.pop()
            process(so, mro, n_it)

    iters = {k: (v if k in ("preempted_ids", "scheduled") else np.asarray(v, np.int64)) for k, v in it_cols.items()}
    return VllmRun(hc, rec, iters, vllm_version(), truncated)


def batch_queue_pending_work(batch_queue) -> bool:
    """True if a step in flight scheduled tokens (its output may still change the state)."""
    return any(so.total_num_scheduled_tokens > 0 for so, _, _ in batch_queue)


def _queue_head(sched):
    q = sched.waiting
    if len(q) == 0:
        return None
    return q.peek_request()


def _aborted(V):
    return V["RequestStatus"].FINISHED_ABORTED


# ---------------------------------------------------------------------------------------- compare
@dataclasses.dataclass
class Comparison:
    """Request-by-request agreement of vLLM and the engine on one trace."""

    n: int
    agreement: dict                 # field -> share of requests identical
    divergences: list               # [(request, field, vllm value, engine value)] in request order
    vllm: VllmRun
    engine_records: dict
    engine_iterations: dict

    @property
    def identical(self) -> bool:
        return not self.divergences

    def first_divergent_iteration(self) -> Optional[int]:
        """First iteration whose contents (prefill tokens, decodes, preemptions) differ."""
        a, b = self.vllm.iterations, self.engine_iterations
        m = min(len(a["iteration"]), len(b["iteration"]))
        for k in range(m):
            for f in ("start_ns", "prefill_tokens", "decodes", "scheduled_reqs", "preempted",
                      "blocks_used"):
                if int(a[f][k]) != int(b[f][k]):
                    return k
        if len(a["iteration"]) != len(b["iteration"]):
            return m
        return None


def engine_run(trace: Trace, profile="linear", policy="fcfs", *, engine_policy=None, estimates=None,
               engine_config=None, **kw):
    """Simulate ``trace`` with the engine under the budgets ``replay`` gives vLLM, so that the two
    runs can be compared request by request (``compare`` does). Needs no vLLM.

    Args:
        trace: the trace to simulate.
        profile: an engine profile name or ``Profile``, whose budgets both sides use.
        policy: the engine policy name (``"fcfs"`` or ``"priority"``, vLLM's two).
        engine_policy: an ``EnginePolicy`` to run instead of ``policy`` (e.g. the index policy
            the plug-in runs in vLLM).
        estimates: per-request output-length estimates for ``engine_policy`` (None: none).
        engine_config: further ``EngineConfig`` fields for the engine only (e.g. ``{"budget_rule":
            "tpot-guard", "budget_u": 0.5}``, which the plug-in runs from its own settings).
        **kw: budget overrides, as ``resolve_config`` takes them (``num_blocks``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``prefix_caching``, ``async_scheduling``,
            ``long_prefill_token_threshold``).

    Returns:
        The engine's ``SimResult`` for the one trace, iterations recorded.

    Raises:
        ConfigError: a bad override, or a profile with a watermark (not modelled by the harness).
        ProfileError: an unknown or malformed profile.
    """
    from ..engine.simulate import simulate
    _, prof, ecfg = resolve_config(profile, policy, **kw)
    if engine_config:
        ecfg = dataclasses.replace(ecfg, **engine_config)
    return simulate(trace, prof, policy if engine_policy is None else engine_policy, ecfg,
                    estimates=None if estimates is None else [np.asarray(estimates, np.float64)])


def compare(trace: Trace, profile="linear", policy="fcfs", *, fields=None, engine_policy=None,
            estimates=None, scheduler_cls=None, scheduler_kwargs=None, extra_args=None,
            engine_config=None, **kw) -> Comparison:
    """Run ``trace`` through vLLM and the engine with identical budgets and compare them.

    With ``scheduler_cls`` (e.g. the TokenBatch plug-in) vLLM runs that class and the engine runs
    ``engine_policy`` with ``estimates`` and ``engine_config`` (``engine_run``'s); the field
    ``shed`` is compared too."""
    if fields is None:
        fields = COMPARED_FIELDS + EXTRA_FIELDS + (("shed",) if scheduler_cls is not None else ())
    v = replay(trace, profile, policy, scheduler_cls=scheduler_cls, scheduler_kwargs=scheduler_kwargs,
               extra_args=extra_args, **kw)
    res = engine_run(trace, profile, policy, engine_policy=engine_policy, estimates=estimates,
                     engine_config=engine_config, **kw)
    from ..engine.kernel import E_SHED
    e = res.records(0)
    ei = res.iterations(0)
    n = len(trace)
    engine_first_sched = e["first_scheduled_ns"]
    ev = {"first_token_iteration": e["first_token_iteration"], "finish_iteration": e["finish_iteration"],
          "preemptions": e["preemptions"], "first_scheduled_ns": engine_first_sched,
          "first_token_ns": e["first_token_ns"], "finish_ns": e["finish_ns"],
          "shed": e["end_state"] == E_SHED}
    vv = {k: v.records[k] for k in ev}
    # normalise "never" markers: both sides use negative or huge values for never
    agreement, divs = {}, []
    for f in fields:
        a = _norm(vv[f])
        b = _norm(ev[f])
        same = a == b
        agreement[f] = float(same.mean()) if n else 1.0
        for i in np.flatnonzero(~same):
            divs.append((int(i), f, int(a[i]), int(b[i])))
    divs.sort()
    return Comparison(n, agreement, divs, v, e, ei)


def _norm(a) -> np.ndarray:
    a = np.asarray(a, np.int64).copy()
    a[(a < 0) | (a >= np.iinfo(np.int64).max // 8)] = -1
    return a
