"""Engine configuration and the construction of the batched state from traces (one per copy)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

from ..errors import ConfigError
from ..traces.trace import Trace
from . import kernel as K
from ._jit import guard_stale_cache, njit
from .profiles import Profile

NEVER = np.iinfo(np.int64).max // 4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine options beyond the profile. vLLM V1 behaviour by default (docs/design.md section 3).

    ``async_scheduling=None`` takes the profile's setting. Options marked beyond-vLLM are off by
    default and every report names them.
    """

    prefix_caching: bool = True
    async_scheduling: Optional[bool] = None
    max_wait_ms: Optional[float] = None       # rule 12: client time-out for a first token
    timeout_running: bool = False             # rule 12: also time out running requests
    skip_hol: bool = False                    # beyond vLLM: skip head-of-line blocking
    waiting_preempts: bool = False            # beyond vLLM: waiting requests preempt lower-score running ones
    admission_control: bool = False           # beyond vLLM: refuse at arrival a request that cannot make T1
    swap: bool = False                        # beyond vLLM: swap preemption (V0), recompute as fallback
    swap_space_gib: float = 4.0               # host memory for swapped blocks (vLLM V0's default)
    resume_first: bool = False                # score policies: preempted requests resume first
    max_iterations: int = 50_000_000          # iteration cap per copy (truncation)
    record_iterations: int = 0                # per-iteration records kept per copy (0 = none)
    # with an iteration sink (``EngineRun(iteration_sink=...)``), record_iterations is the size of a
    # buffer that is flushed to the sink whenever it fills: bounded memory for any trace length
    jumps: bool = True                        # advance decode-only stretches at once (same results)
    max_num_batched_tokens: Optional[int] = None  # override the profile's B
    max_num_seqs: Optional[int] = None
    num_blocks: Optional[int] = None
    # vLLM's --block-size: without num_blocks, the pool keeps the profile's KV token capacity
    # (vLLM sizes it from memory): usable blocks = floor(usable x profile block size / block_size)
    block_size: Optional[int] = None
    max_model_len: Optional[int] = None       # vLLM's --max-model-len (the model's context limit)
    # vLLM's --long-prefill-token-threshold (docs/design.md section 11): None or 0 = off
    long_prefill_token_threshold: Optional[int] = None
    # beyond vLLM (docs/design.md section 11): the token budget of each iteration, "none" (B) or
    # "tpot-guard" (B_t from the running requests' TPOT credits), with its u in [-0.5, 2] (default 0)
    # and B_min in [0, 1] (default 0; 1 = the budget is never lowered)
    budget_rule: Optional[str] = None
    budget_u: Optional[float] = None
    budget_bmin: Optional[float] = None

    #: fields added after evidence ids were first published: they enter ``to_dict`` only when set,
    #: so that every earlier configuration keeps its id
    OPTIONAL_FIELDS = ("block_size", "max_model_len", "long_prefill_token_threshold", "budget_rule", "budget_u",
                       "budget_bmin")

    def __post_init__(self):
        if self.max_wait_ms is not None and not (np.isfinite(self.max_wait_ms) and self.max_wait_ms > 0):
            raise ConfigError(f"max_wait_ms must be a positive number or None, got {self.max_wait_ms!r}")
        if not (isinstance(self.swap_space_gib, (int, float)) and np.isfinite(self.swap_space_gib)
                and self.swap_space_gib >= 0):
            raise ConfigError(f"swap_space_gib must be a finite number >= 0, got {self.swap_space_gib!r}")
        for f in ("max_iterations", "record_iterations"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"{f} must be a non-negative integer, got {v!r}")
        for f in ("max_num_batched_tokens", "max_num_seqs", "num_blocks", "block_size", "max_model_len"):
            v = getattr(self, f)
            lo = 2 if f == "num_blocks" else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise ConfigError(f"{f} must be an integer >= {lo}"
                                  + (" (block 0 is reserved)" if f == "num_blocks" else "") + f" or None, got {v!r}")
        t = self.long_prefill_token_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0 (0: off) or None, got {t!r}")
        if self.budget_rule is not None and self.budget_rule not in K.BUDGET_RULES:
            raise ConfigError(f"budget_rule: unknown {self.budget_rule!r}; valid: {', '.join(K.BUDGET_RULES)}")
        from .levers import GUARD_LEVERS
        for f, (lo, hi) in GUARD_LEVERS.items():
            v = getattr(self, f)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo <= float(v) <= hi):
                raise ConfigError(f"{f} must be a number in [{lo:g}, {hi:g}], got {v!r}")
            if self.budget_rule != "tpot-guard":
                raise ConfigError(f"{f}: a parameter of budget_rule tpot-guard (budget_rule is {self.budget_rule!r})")

    def resolve(self, profile: Profile) -> Profile:
        """The profile with this config's overrides applied."""
        ch = {}
        if self.max_num_batched_tokens is not None:
            ch["max_num_batched_tokens"] = self.max_num_batched_tokens
            if profile.b_max is not None and profile.b_max < self.max_num_batched_tokens:
                ch["b_max"] = self.max_num_batched_tokens   # (an explicit budget is within its own range)
        if self.max_num_seqs is not None:
            ch["max_num_seqs"] = self.max_num_seqs
        if self.block_size is not None:
            ch["block_size"] = self.block_size
            if self.num_blocks is None:
                usable = profile.usable_blocks * profile.block_size // self.block_size
                if usable < 1:
                    raise ConfigError(f"block_size {self.block_size}: larger than the profile's whole KV pool "
                                      f"({profile.usable_blocks * profile.block_size} tokens)")
                ch["num_blocks"] = usable + 1
                ch["watermark_blocks"] = min(profile.watermark_blocks * profile.block_size // self.block_size,
                                             usable - 1)
        if self.num_blocks is not None:
            ch["num_blocks"] = self.num_blocks
            ch["watermark_blocks"] = min(profile.watermark_blocks, self.num_blocks - 2)
        if self.max_model_len is not None:
            ch["max_model_len_limit"] = self.max_model_len
        if self.async_scheduling is not None:
            ch["async_scheduling"] = self.async_scheduling
        out = dataclasses.replace(profile, **ch) if ch else profile
        if self.max_model_len is not None and out.max_model_len < self.max_model_len:
            # (vLLM refuses to start when one request of max_model_len cannot fit the KV pool)
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the KV pool: {out.usable_blocks} usable "
                              f"blocks x {out.block_size} tokens = {out.usable_blocks * out.block_size}")
        return out

    @property
    def guard(self) -> tuple:
        """(rule id, u, B_min) of the budget rule in force (``kernel.BUDGET_*``)."""
        if self.budget_rule != "tpot-guard":
            return K.BUDGET_NONE, 0.0, 1.0
        return (K.BUDGET_TPOT_GUARD, 0.0 if self.budget_u is None else float(self.budget_u),
                0.0 if self.budget_bmin is None else float(self.budget_bmin))

    @property
    def threshold(self) -> int:
        """The long-prefill threshold in force (0: off)."""
        return int(self.long_prefill_token_threshold or 0)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for f in self.OPTIONAL_FIELDS:
            if d[f] is None:
                del d[f]
        return d


def make_fcfg(profile: Profile, threshold: int = 0) -> np.ndarray:
    """u_p and u_d (ms per token at a full batch, docs/design.md section 4): B tokens, and for u_p a
    long-prefill threshold below B (the largest chunk one prefill gets)."""
    fcfg = np.zeros(K.N_FCFG, np.float64)
    B = profile.max_num_batched_tokens
    fcfg[K.F_U_P], fcfg[K.F_U_D] = profile.cost.per_token_ms(B)
    if 0 < threshold < B:   # a prefill's chunks are at most the threshold; decodes still share B
        fcfg[K.F_U_P] = profile.cost.per_token_ms(threshold)[0]
    return fcfg


def make_cfg(profile: Profile, config: EngineConfig, mode: int, pid: int = 0,
             stream_records: bool = False) -> np.ndarray:
    cfg = np.zeros(K.N_CFG, np.int64)
    ps = profile.cost.ps
    cfg[K.C_BUDGET] = profile.max_num_batched_tokens
    cfg[K.C_MAX_SEQS] = profile.max_num_seqs
    cfg[K.C_BS] = profile.block_size
    cfg[K.C_USABLE] = profile.usable_blocks
    cfg[K.C_WATERMARK] = profile.watermark_blocks
    cfg[K.C_MAX_LEN] = profile.max_model_len
    cfg[K.C_PREFIX] = int(config.prefix_caching)
    cfg[K.C_ASYNC] = int(profile.async_scheduling)
    cfg[K.C_MODE] = mode
    cfg[K.C_MAX_WAIT] = -1 if config.max_wait_ms is None else int(round(config.max_wait_ms * 1e6))
    cfg[K.C_TIMEOUT_RUNNING] = int(config.timeout_running)
    cfg[K.C_SKIP_HOL] = int(config.skip_hol)
    cfg[K.C_MAX_ITERS] = config.max_iterations
    cfg[K.C_PS0:K.C_PS_KV + 1] = ps
    cfg[K.C_RESUME_FIRST] = int(config.resume_first)
    cfg[K.C_PID] = pid
    cfg[K.C_JUMPS] = int(config.jumps)
    cfg[K.C_WAIT_PREEMPT] = int(config.waiting_preempts)
    cfg[K.C_ADMISSION] = int(config.admission_control)
    cfg[K.C_SWAP] = int(config.swap)
    cfg[K.C_REC_STREAM] = int(stream_records)
    if config.threshold > profile.max_model_len:   # (vLLM refuses it too)
        raise ConfigError(f"long_prefill_token_threshold {config.threshold} exceeds max_model_len "
                          f"{profile.max_model_len}")
    cfg[K.C_THRESHOLD] = config.threshold
    cfg[K.C_BUDGET_RULE] = config.guard[0]
    block_bytes = profile.block_size * profile.kv_bytes_per_token
    cfg[K.C_HOST_BLOCKS] = host_blocks(profile, config)
    # copy time at the profile's PCIe bandwidth: bytes / (GB/s) = ns, in ps per block
    cfg[K.C_SWAP_PS_PER_BLOCK] = int(round(block_bytes / profile.pcie_gb_per_s * 1000))
    return cfg


def host_blocks(profile: Profile, config: EngineConfig) -> int:
    """Host-memory blocks for swapped KV blocks: ``config.swap_space_gib`` at the profile's block bytes."""
    return int(config.swap_space_gib * 2**30 // (profile.block_size * profile.kv_bytes_per_token))


def copies_of(value, n: int, kind: type, what: str) -> list:
    """One ``kind`` per copy: ``value`` itself for every copy, or a sequence of exactly ``n``."""
    if isinstance(value, kind):
        return [value] * n
    if isinstance(value, (list, tuple)) and len(value) == n and all(isinstance(v, kind) for v in value):
        return list(value)
    got = f"{len(value)} values" if isinstance(value, (list, tuple)) else type(value).__name__
    raise ConfigError(f"{what}: expected one {kind.__name__} or one per copy ({n}), got {got}")


def check_batch(profiles: Sequence[Profile], configs: Sequence[EngineConfig]) -> None:
    """What the copies of one engine batch must share (docs/design.md section 11): the block size (a
    trace's prefix chains are laid out at one) and the iteration-record buffer."""
    sizes = sorted({p.block_size for p in profiles})
    if len(sizes) > 1:
        raise ConfigError(f"one block size per engine batch: the copies' profiles have {sizes}")
    recs = sorted({c.record_iterations for c in configs})
    if len(recs) > 1:
        raise ConfigError(f"one record_iterations per engine batch: the copies' configs have {recs}")


def make_cfg_rows(profiles: Sequence[Profile], configs: Sequence[EngineConfig], mode: int, pid: int = 0,
                  stream_records: bool = False) -> tuple:
    """The kernel's configuration, one row per copy (docs/design.md section 11): ``(cfg [C, N_CFG],
    fcfg [C, N_FCFG])`` for resolved ``profiles[c]`` and ``configs[c]``. Copies that share a profile
    and config share a row's computation."""
    check_batch(profiles, configs)
    C = len(profiles)
    cfg = np.empty((C, K.N_CFG), np.int64)
    fcfg = np.empty((C, K.N_FCFG), np.float64)
    done: dict = {}
    for c, (p, e) in enumerate(zip(profiles, configs)):
        key = (id(p), id(e))
        if key not in done:
            f = make_fcfg(p, e.threshold)
            f[K.F_GUARD_U], f[K.F_GUARD_BMIN] = e.guard[1:]
            done[key] = (make_cfg(p, e, mode, pid, stream_records), f)
        cfg[c], fcfg[c] = done[key]
    return cfg, fcfg


@njit
def capped_outputs(prompt, output, max_model_len):
    """Rule 8: output capped at max_model_len - prompt (recorded length_capped). Compiled: the env
    calls it from its compiled window layout (``envs._window_columns``)."""
    room = np.maximum(max_model_len - prompt, 1)
    return np.minimum(output, room), output > room


#: the T1 and T2 (ns) the engine gives a request without SLOs: deadlines that never bind
NO_SLO_NS = NEVER // 4


def slo_deadlines(trace: Trace) -> tuple:
    """(T1, T2) per request of ``trace`` as the engine holds them (ns): its SLOs, or ``NO_SLO_NS``
    for a trace without SLOs (in-engine scores and shedding need a T1)."""
    if trace.has_slos:
        return trace.ttft_slo_ns, trace.tpot_slo_ns
    none = np.full(len(trace), NO_SLO_NS, np.int64)
    return none, none


def length_denied(prompt, output, max_model_len) -> tuple:
    """Rule 8 as masks over requests: (rejected at arrival, prompt >= max_model_len; length-capped,
    admitted but prompt + output > max_model_len), as ``capped_outputs`` and the kernel decide."""
    p, o = np.asarray(prompt, np.int64), np.asarray(output, np.int64)
    rejected = p >= max_model_len
    return rejected, ~rejected & (p + o > max_model_len)


def admitted_uncapped(prompt, output, max_model_len) -> np.ndarray:
    """The requests rule 8 neither rejects nor length-caps (the denominator of the goodput no policy
    is denied by the context limit, docs/design.md section 10)."""
    return ~np.logical_or(*length_denied(prompt, output, max_model_len))


@njit
def unique_block_bases(prompt, out_len, prefix_lengths, n_uniq, bs):
    """Ids of the blocks past each request's prefix chain (1-D, one entry per request): request i's
    unique blocks are numbered from ``base[i]``, after the ``n_uniq`` chain ids and the earlier
    requests' room (its whole sequence's blocks plus one, less its chain). Returns ``(base, ids)``,
    ``ids`` the size of the id space."""
    base = np.empty(prompt.shape[0], np.int64)
    ids = np.int64(n_uniq)
    for i in range(prompt.shape[0]):
        base[i] = ids
        ids += (prompt[i] + out_len[i] + bs - 1) // bs + 1 - prefix_lengths[i]
    return base, ids


def build_arrays(traces: Sequence[Trace], profile: Union[Profile, Sequence[Profile]],
                 config: Union[EngineConfig, Sequence[EngineConfig]],
                 estimates: Optional[Sequence[np.ndarray]] = None, *, block_table: bool = True,
                 with_kv: Optional[Sequence[np.ndarray]] = None,
                 kv_src: Optional[Sequence[np.ndarray]] = None, hold_width: int = 0) -> K.EngineArrays:
    """Lay N traces out as the struct of arrays, one copy each, padded to the longest.

    ``profile`` and ``config`` (resolved: ``EngineConfig.resolve``) are the batch's, or one per copy
    (docs/design.md section 11): the per-copy arrays are then padded to the largest copy (running
    slots, KV blocks, table width); one block size per batch (``check_batch``).
    ``estimates[c]`` are copy c's output-length estimates (a predictor's, never the truth unless
    labelled oracle); NaN or absent means "use the family's mean residual life".
    ``with_kv[c]`` (bool per request of trace c; default none): requests that arrive with their
    prompt's KV and first token (engine rule 13, docs/design.md section 13); ``kv_src[c]`` (int per
    request, default 0) the link each one's KV comes over (FIFO per link). ``hold_width``: entries
    of each copy's hold store (block ids of the requests whose KV a prefill replica holds,
    ``EngineArrays.hold_kv``, set by the caller; 0: none hold).
    ``block_table=False`` leaves ``table`` empty ([C, 0, 0]): for callers that write these copies
    into rows of an existing batch, whose table rows need no reset (the kernel reads a request's
    table entries only below its held blocks, all written when claimed)."""
    if len(traces) == 0:
        raise ConfigError("need at least one trace (one per copy)")
    C = len(traces)
    profiles = copies_of(profile, C, Profile, "profile")
    configs = copies_of(config, C, EngineConfig, "engine config")
    check_batch(profiles, configs)
    bs = profiles[0].block_size
    if any(t.block_size != bs for t in traces):   # (vLLM's --block-size: chains at the engine's blocks)
        from ..traces.blocks import at_block_size
        traces = [at_block_size(t, bs) for t in traces]
    R = max(1, max(len(t) for t in traces))
    # table slots: running requests, plus (async) finished ones whose blocks free one iteration later
    seqs = np.array([p.max_num_seqs for p in profiles], np.int64)
    slots_c = seqs * np.array([2 if p.async_scheduling else 1 for p in profiles], np.int64)
    slots_c = np.minimum(slots_c, R)   # (a request holds at most one slot: never more slots than rows)
    S, slots = int(seqs.max()), int(slots_c.max())
    nb_c = np.array([p.usable_blocks for p in profiles], np.int64)
    NB = int(nb_c.max())
    mml = np.array([p.max_model_len for p in profiles], np.int64)
    maxb = (int(mml.max()) + bs - 1) // bs + 1
    i64 = np.int64

    def pad(col, fill=0, dtype=i64):
        out = np.full((C, R), fill, dtype)
        for c, t in enumerate(traces):
            out[c, :len(t)] = col(t)
        return out

    arrival = pad(lambda t: t.arrival_ns, NEVER)
    prompt = pad(lambda t: t.prompt_tokens, 1)
    output = pad(lambda t: t.output_tokens, 1)
    if (mml == mml[0]).all():
        out_len, capped = capped_outputs(prompt, output, int(mml[0]))
    else:
        out_len, capped = np.empty_like(output), np.empty(output.shape, np.bool_)
        for c in range(C):
            out_len[c:c + 1], capped[c:c + 1] = capped_outputs(prompt[c:c + 1], output[c:c + 1], int(mml[c]))
    prio = pad(lambda t: t.priority)
    # traces without SLOs: deadlines never bind (in-engine scores and shedding need T1)
    t1 = pad(lambda t: slo_deadlines(t)[0], NO_SLO_NS)
    t2 = pad(lambda t: slo_deadlines(t)[1], NO_SLO_NS)
    est = np.full((C, R), np.nan)
    if estimates is not None:
        if len(estimates) != C:
            raise ConfigError(f"got {len(estimates)} estimate arrays for {C} traces")
        for c, (t, e) in enumerate(zip(traces, estimates)):
            e = np.asarray(e, np.float64)
            if e.shape != (len(t),):
                raise ConfigError(f"estimates for trace {c} have shape {e.shape}, expected ({len(t)},)")
            est[c, :len(t)] = e

    kv = np.zeros((C, R), np.bool_)
    if with_kv is not None:
        if len(with_kv) != C:
            raise ConfigError(f"got {len(with_kv)} with_kv arrays for {C} traces")
        for c, (t, w) in enumerate(zip(traces, with_kv)):
            w = np.asarray(w)
            if w.shape != (len(t),) or w.dtype != np.bool_:
                raise ConfigError(f"with_kv for trace {c}: expected a bool array of shape ({len(t)},), got "
                                  f"{w.dtype} {w.shape}")
            kv[c, :len(t)] = w
    src = np.zeros((C, R), i64)
    if kv_src is not None:
        if with_kv is None or len(kv_src) != C:
            raise ConfigError(f"kv_src: one int array per trace, with with_kv; got {len(kv_src)} for {C} traces")
        for c, (t, w) in enumerate(zip(traces, kv_src)):
            w = np.asarray(w)
            if w.shape != (len(t),) or w.dtype.kind not in "iu" or (len(w) and w.min() < 0):
                raise ConfigError(f"kv_src for trace {c}: expected link indices >= 0 of shape ({len(t)},), got "
                                  f"{w.dtype} {w.shape}")
            src[c, :len(t)] = w
    n_links = int(src.max()) + 1 if src.size else 1

    # prefix chains -> dense per-copy ids; blocks past a chain get unique ids
    H = max(1, max(len(t.prefix_hashes) for t in traces))
    chain_off = np.zeros((C, R + 1), i64)
    chain_val = np.zeros((C, H), i64)
    uniq_base = np.zeros((C, R), i64)
    U = 1
    for c, t in enumerate(traces):
        n = len(t)
        chain_off[c, :n + 1] = t.prefix_offsets
        chain_off[c, n + 1:] = t.prefix_offsets[-1]
        n_uniq, inv = t.prefix_ids()   # dense ids by first appearance, cached
        chain_val[c, :len(inv)] = inv
        if configs[c].prefix_caching and n:
            uniq_base[c, :n], ids = unique_block_bases(prompt[c, :n], out_len[c, :n], t.prefix_lengths, n_uniq, bs)
            U = max(U, int(ids))
    n_req = np.array([len(t) for t in traces], i64)

    z = lambda *shape, dtype=i64, fill=0: np.full(shape, fill, dtype)  # noqa: E731
    # free queue: sentinels head=NB, tail=NB+1 (the largest copy's), copy c's blocks 0..nb_c[c]-1 in
    # order between them; the blocks past a smaller copy's pool are never linked (-1)
    fq_next = np.full((C, NB + 2), -1, np.int32)
    fq_prev = np.full((C, NB + 2), -1, np.int32)
    for n_b in np.unique(nb_c):
        rows = np.flatnonzero(nb_c == n_b)[:, None]
        order = np.concatenate([[NB], np.arange(n_b), [NB + 1]])
        fq_next[rows, order[:-1]] = order[1:]
        fq_prev[rows, order[1:]] = order[:-1]
    slot_free = np.zeros((C, slots), i64)
    for c in range(C):
        slot_free[c, :slots_c[c]] = np.arange(slots_c[c] - 1, -1, -1)
    rec = max(configs[0].record_iterations, 1)
    return K.EngineArrays(
        n_req=n_req, arrival=arrival, prompt=prompt, out_len=out_len, prio=prio, capped=capped, t1=t1, t2=t2, est=est,
        with_kv=kv, kv_src=src, chain_off=chain_off, chain_val=chain_val, uniq_base=uniq_base,
        now=np.where(n_req > 0, arrival[:, 0], 0).astype(i64), it=z(C), next_arr=z(C), n_ended=z(C),
        key_hi=z(C, fill=1), key_lo=z(C, fill=-1), n_run=z(C), n_wait=z(C),
        n_free=nb_c.copy(), n_slot_free=slots_c.copy(), n_pend=z(C),
        n_iter_rec=z(C, fill=0 if configs[0].record_iterations else rec),
        status=z(C, R, dtype=np.int8), end_state=z(C, R, dtype=np.int8), computed=z(C, R),
        gen=z(C, R), qkey=z(C, R), slot_of=z(C, R, fill=-1), held=z(C, R), n_cached=z(C, R),
        first_sched=z(C, R, fill=-1), first_token=z(C, R, fill=-1), first_token_it=z(C, R, fill=-1),
        finish=z(C, R, fill=-1), finish_it=z(C, R, fill=-1), n_preempt=z(C, R), recomputed=z(C, R),
        resumed=z(C, R, dtype=np.bool_),
        run_ids=z(C, S), wait_ids=z(C, R), slot_free=slot_free,
        pend_ids=z(C, S),
        table=z(*((C, slots, maxb) if block_table else (C, 0, 0)), dtype=np.int32),  # int32: one compilation
        ref=z(C, NB, dtype=np.int32), bhash=z(C, NB, fill=-1), hnext=z(C, NB, fill=-1, dtype=np.int32),
        fq_prev=fq_prev, fq_next=fq_next, hash_head=z(C, U, fill=-1, dtype=np.int32),
        sched_r=z(C, S), sched_new=z(C, S), sched_cb=z(C, S),
        iter_rec=z(C, rec, K.N_ITER_COLS),
        jump_ids=z(C, S), jump_off=z(C, bs + 1), emit_it=z(C, R, fill=-1),
        swapped=z(C, R), swap_ids=z(C, R), n_swap=z(C),
        host_free=np.array([host_blocks(p, e) for p, e in zip(profiles, configs)], i64),
        epoch=z(C, K.N_EP),
        kv_ready=z(C, R, fill=-1), kv_first=z(C, R, fill=-1), link_free=z(C, n_links), xfer_ids=z(C, S), n_xfer=z(C),
        hold_kv=z(C, R, dtype=np.bool_), hold_blk=z(C, 1, max(1, int(hold_width)), dtype=np.int32),
        hold_at=z(C, R, fill=-1), hold_ids=z(C, R), n_hold=z(C), hold_top=z(C),
    )


# (defined after the kernel module ran its guard: this module imports it): flushed likewise
guard_stale_cache([capped_outputs, unique_block_bases], tag="state")
