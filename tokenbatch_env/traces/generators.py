"""Seeded synthetic trace generators (docs/design.md section 2).

A generator spec (``TraceSpec``, a frozen dataclass that round-trips through a JSON-able dict) plus an
integer seed gives one ``Trace``; the same spec and seed give the same content digest on every
machine. How that is achieved:

* Randomness comes only from ``numpy.random.Generator(PCG64(SeedSequence([seed, stream])))``, one
  independent stream per component (arrivals, lengths, prefix groups, SLA classes), so changing one
  component of a spec never changes the draws of another. PCG64 and SeedSequence are pure integer
  arithmetic and identical on every platform.
* Floats are turned into integers once, by a documented rule, at a resolution far coarser than a
  last-bit difference between math libraries could move:

  - inter-arrival gaps are rounded (half to even) to whole **microseconds**, then summed as integers
    (so arrivals are exact int64 ns multiples of 1000; the first request arrives at t = 0);
  - token lengths are ``max(1, rint(exp(mu + sigma * z)))``.

Spec sections (all validated; a bad value raises ``ConfigError`` naming the field, e.g.
``generator.arrivals.cv``):

``arrivals``
    ``{"process": "poisson", "rate_rps": r}``;
    ``{"process": "gamma", "rate_rps": r, "cv": c}`` (Gamma-renewal: gaps Gamma(k = 1/c^2,
    scale = c^2/r), so mean gap 1/r and coefficient of variation c; c = 1 is Poisson);
    ``{"process": "mmpp", "rate_rps": r, "states": [{"rate_mult": m, "mean_dwell_s": d}, ...],
    "transitions": [[...], ...]}`` (Markov-modulated Poisson, >= 2 states; state k holds for an
    exponential time of mean d_k, then jumps to state j with probability ``transitions[k][j]``
    (zero diagonal, rows sum to 1; default: uniformly to another state); arrivals are Poisson at
    rate ``c * m_k`` in state k, with c chosen so that the long-run mean rate is exactly r; the
    process starts in its time-stationary state distribution).
``lengths``
    ``{"dist": "lognormal", "prompt": {"mu", "sigma"}, "output": {"mu", "sigma"}, "corr": rho,
    "max_model_len": L, "truncation": "resample" | "clip"}``: ``(ln P, ln O)`` bivariate normal with
    correlation rho. Truncation so that every request fits the engine (``P + O <= L``):
    ``resample`` (default) rejects a pair that does not fit and draws again (the distribution is
    the log-normal *conditioned* on fitting; pairs are drawn in vectorised batches and accepted in
    order); ``clip`` sets ``P = min(P, L - 1)`` then ``O = min(O, L - P)`` (atoms at the limit).
    ``max_model_len: null`` means no truncation.
    ``{"dist": "pairs", "path": FILE, "max_model_len": L}``: resample real (prompt, output) pairs
    uniformly with replacement from a trace file (read with ``traces.io.load_trace``), after
    dropping the pairs that do not fit ``L`` (``resample``) or clipping them (``clip``). Arrivals
    stay synthetic. ``resample_pairs`` does the same for arrays already in memory.
``prefix`` (optional)
    ``{"share_fraction": f, "num_groups": G, "zipf": a, "ratio": R, "common_prefix_tokens": C}``.
    Each request joins a prefix group with probability f; its group g in 1..G is drawn with
    weights ``1 / g**a`` (a = 0: uniform). A grouped request's prefix length is
    ``k = floor(u * prompt)`` with u drawn from R: a number (fixed), ``{"dist": "uniform", "low",
    "high"}`` or ``{"dist": "beta", "a", "b"}``. Its chain is ``block_hash(NS_PREFIX_GROUP, g, j)``
    for ``j = 0 .. floor(k / bs) - 1``. Optionally every request shares a common first
    ``C`` tokens (a system prompt; key 0 is reserved for it): chain positions ``j < floor(min(C,
    prompt) / bs)`` use key 0, grouped requests continue with key g. A partial last block is
    unique (not in the chain).
``sla`` (optional)
    see ``tokenbatch_env.traces.sla``: classes drawn per request with weights; ``T1 = s *
    TTFT_idle(prompt)`` on the named profile; ``T2`` absolute per class; ``priority`` per class.
    Without it the trace has no SLOs.

``NS_PREFIX_GROUP`` (= 1) is defined once, with the other hash namespaces, in ``traces/trace.py``
and re-exported here.

Bump ``GENERATOR_VERSION`` whenever the output for an existing spec and seed changes; suite
manifests record it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Optional

import numpy as np

from ..errors import ConfigError
from .checks import check_keys, choice, num
from .sla import STREAM_CLASSES, SlaSpec, assign_arrays
from .trace import MAX_TOKENS, NS_PREFIX_GROUP, Trace, block_hash

__all__ = [
    "GENERATOR_VERSION", "NS_PREFIX_GROUP", "ARRIVAL_RESOLUTION_NS", "ArrivalSpec", "LengthSpec",
    "PrefixSpec", "TraceSpec", "generate_trace", "rng_stream", "poisson_arrivals", "gamma_arrivals",
    "mmpp_arrivals", "generate_arrivals", "lognormal_lengths", "resample_pairs", "generate_lengths",
    "prefix_chains", "resample_trace",
]

#: Bump when the output of ``generate_trace`` for an existing (spec, seed) changes.
GENERATOR_VERSION = 1
#: Inter-arrival gaps are rounded to this many ns (1 us) before being summed as integers.
ARRIVAL_RESOLUTION_NS = 1000

# Independent random streams per component (part of the reproducibility contract: never renumber).
STREAM_ARRIVALS, STREAM_LENGTHS, STREAM_PREFIX = 1, 2, 3  # STREAM_CLASSES = 4 lives in sla.py

def rng_stream(seed: int, stream: int) -> np.random.Generator:
    """The PCG64 generator for component ``stream`` of trace seed ``seed`` (both ints >= 0)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(stream)])))


# ---------------------------------------------------------------------------------------- arrivals
@dataclasses.dataclass(frozen=True)
class ArrivalSpec:
    process: str = "poisson"                  # poisson | gamma | mmpp
    rate_rps: float = 1.0                     # long-run mean arrival rate (nominal)
    cv: Optional[float] = None                # gamma: coefficient of variation of the gaps
    states: tuple = ()                        # mmpp: ((rate_mult, mean_dwell_s), ...)
    transitions: Optional[tuple] = None       # mmpp: jump-chain matrix (rows), default uniform

    PROCESSES = ("poisson", "gamma", "mmpp")

    @classmethod
    def from_dict(cls, d: Any, path: str = "arrivals") -> "ArrivalSpec":
        check_keys(d, path, ["process", "rate_rps"], ["cv", "states", "transitions"])
        process = choice(d, "process", path, cls.PROCESSES)
        rate = num(d, "rate_rps", path, lo=0, lo_open=True, hi=1e9)
        if process != "gamma" and "cv" in d:
            raise ConfigError(f"{path}.cv: only valid for process 'gamma'")
        if process != "mmpp" and ("states" in d or "transitions" in d):
            raise ConfigError(f"{path}.states: only valid for process 'mmpp'")
        if process == "gamma":
            cv = num(d, "cv", path, lo=0.01, hi=100.0)
            return cls("gamma", rate, cv=cv)
        if process == "poisson":
            return cls("poisson", rate)
        states = d.get("states")
        if not isinstance(states, list) or len(states) < 2:
            raise ConfigError(f"{path}.states: an mmpp needs a list of >= 2 states")
        st = []
        for i, s in enumerate(states):
            p = f"{path}.states[{i}]"
            check_keys(s, p, ["rate_mult", "mean_dwell_s"])
            st.append((num(s, "rate_mult", p, lo=0), num(s, "mean_dwell_s", p, lo=0, lo_open=True)))
        if not any(m > 0 for m, _ in st):
            raise ConfigError(f"{path}.states: at least one state needs rate_mult > 0")
        trans = None
        if d.get("transitions") is not None:
            t = d["transitions"]
            k = len(st)
            if (not isinstance(t, list) or len(t) != k
                    or not all(isinstance(r, list) and len(r) == k for r in t)):
                raise ConfigError(f"{path}.transitions: must be a {k}x{k} list of lists")
            rows = []
            for i, r in enumerate(t):
                row = tuple(num({"x": x}, "x", f"{path}.transitions[{i}][{j}]", lo=0, hi=1)
                            for j, x in enumerate(r))
                if row[i] != 0:
                    raise ConfigError(f"{path}.transitions[{i}][{i}]: diagonal must be 0 "
                                      f"(dwell times are given by mean_dwell_s)")
                if abs(sum(row) - 1.0) > 1e-9:
                    raise ConfigError(f"{path}.transitions[{i}]: row must sum to 1, got {sum(row)!r}")
                rows.append(row)
            trans = tuple(rows)
        return cls("mmpp", rate, states=tuple(st), transitions=trans)

    def to_dict(self) -> dict:
        d: dict = {"process": self.process, "rate_rps": self.rate_rps}
        if self.process == "gamma":
            d["cv"] = self.cv
        if self.process == "mmpp":
            d["states"] = [{"rate_mult": m, "mean_dwell_s": w} for m, w in self.states]
            if self.transitions is not None:
                d["transitions"] = [list(r) for r in self.transitions]
        return d

    # -- derived mmpp quantities
    def mmpp_matrices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(state rates in req/s normalised to ``rate_rps``, jump matrix, time-stationary probs)."""
        k = len(self.states)
        mult = np.array([m for m, _ in self.states], float)
        dwell = np.array([w for _, w in self.states], float)
        if self.transitions is None:
            jump = (np.ones((k, k)) - np.eye(k)) / (k - 1)
        else:
            jump = np.array(self.transitions, float)
        # stationary distribution of the jump chain: left eigenvector for eigenvalue 1
        a = np.vstack([jump.T - np.eye(k), np.ones(k)])
        b = np.zeros(k + 1)
        b[-1] = 1.0
        pi_jump = np.linalg.lstsq(a, b, rcond=None)[0]
        pi_time = np.clip(pi_jump, 0, None) * dwell
        pi_time /= pi_time.sum()
        rates = mult * (self.rate_rps / float(pi_time @ mult))
        return rates, jump, pi_time


def _gaps_to_arrivals(gaps_s: np.ndarray) -> np.ndarray:
    """Arrivals (int64 ns, first at 0) from n-1 gaps in seconds, rounded to whole microseconds."""
    gaps_us = np.rint(gaps_s * 1e6).astype(np.int64)
    out = np.zeros(gaps_us.size + 1, np.int64)
    np.cumsum(gaps_us, out=out[1:])
    return out * ARRIVAL_RESOLUTION_NS


def poisson_arrivals(rng: np.random.Generator, n: int, rate_rps: float) -> np.ndarray:
    """n Poisson arrivals (int64 ns, the first at 0) at ``rate_rps``."""
    return _gaps_to_arrivals(rng.exponential(1.0 / rate_rps, size=max(n - 1, 0)))


def gamma_arrivals(rng: np.random.Generator, n: int, rate_rps: float, cv: float) -> np.ndarray:
    """n Gamma-renewal arrivals: gaps Gamma(1/cv^2, cv^2/rate), mean 1/rate, CV ``cv``."""
    shape = 1.0 / (cv * cv)
    return _gaps_to_arrivals(rng.gamma(shape, 1.0 / (shape * rate_rps), size=max(n - 1, 0)))


def mmpp_arrivals(rng: np.random.Generator, n: int, spec: ArrivalSpec) -> np.ndarray:
    """n arrivals of a Markov-modulated Poisson process (see ``ArrivalSpec``), int64 ns, first at 0.

    Sojourns are drawn in vectorised batches: per batch the next states (jump chain), exponential
    dwell times, Poisson counts per sojourn, then uniform positions inside each sojourn (given its
    count, a Poisson process's points are uniform order statistics).
    """
    if n <= 0:
        return np.zeros(0, np.int64)
    rates, jump, pi_time = spec.mmpp_matrices()
    k = rates.size
    dwell = np.array([w for _, w in spec.states], float)
    per_sojourn = float(pi_time @ (rates * dwell)) if k else 1.0
    cum = np.cumsum(jump, axis=1)
    state = int(np.searchsorted(np.cumsum(pi_time), rng.random() * np.cumsum(pi_time)[-1], side="right"))
    state = min(state, k - 1)
    t0 = 0.0
    times: list[np.ndarray] = []
    total = 0
    batch = int(min(max(64, math.ceil(1.5 * n / max(per_sojourn, 1e-12))), 1_000_000))
    for _ in range(10_000):
        u_state = rng.random(batch)
        seq = np.empty(batch, np.int64)
        if k == 2:  # two states simply alternate
            seq[0::2] = state
            seq[1::2] = 1 - state
            state = 1 - int(seq[-1])
        else:
            s = state
            rows = [list(r) for r in cum]
            for i, u in enumerate(u_state.tolist()):
                seq[i] = s
                s = min(bisect.bisect_right(rows[s], u * rows[s][-1]), k - 1)
            state = s  # the state after the batch's last sojourn
        dur = rng.standard_exponential(batch) * dwell[seq]
        starts = t0 + np.concatenate([[0.0], np.cumsum(dur)[:-1]])
        t0 = float(starts[-1] + dur[-1])
        counts = rng.poisson(rates[seq] * dur)
        m = int(counts.sum())
        u = rng.random(m)
        owner = np.repeat(np.arange(batch), counts)
        times.append(starts[owner] + u * dur[owner])
        total += m
        if total >= n:
            break
    else:  # pragma: no cover - guarded by validation (some state has a positive rate)
        raise ConfigError("arrivals.states: the mmpp produced too few arrivals")
    t = np.sort(np.concatenate(times))[:n]
    rel_us = np.rint((t - t[0]) * 1e6).astype(np.int64)
    return np.maximum.accumulate(rel_us) * ARRIVAL_RESOLUTION_NS


def generate_arrivals(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    if spec.process == "poisson":
        return poisson_arrivals(rng, n, spec.rate_rps)
    if spec.process == "gamma":
        return gamma_arrivals(rng, n, spec.rate_rps, spec.cv)
    return mmpp_arrivals(rng, n, spec)


# ---------------------------------------------------------------------------------------- lengths
@dataclasses.dataclass(frozen=True)
class LengthSpec:
    dist: str = "lognormal"                  # lognormal | pairs
    prompt_mu: float = 6.6
    prompt_sigma: float = 1.0
    output_mu: float = 5.0
    output_sigma: float = 0.9
    corr: float = 0.0
    max_model_len: Optional[int] = None
    truncation: str = "resample"            # resample | clip
    path: Optional[str] = None              # pairs: trace file to resample from

    @classmethod
    def from_dict(cls, d: Any, path: str = "lengths") -> "LengthSpec":
        check_keys(d, path, ["dist"], ["prompt", "output", "corr", "max_model_len", "truncation",
                                       "path"])
        dist = choice(d, "dist", path, ("lognormal", "pairs"))
        L = num(d, "max_model_len", path, lo=2, hi=MAX_TOKENS, integer=True, default=None,
                allow_none=True)
        trunc = choice(d, "truncation", path, ("resample", "clip"), default="resample")
        if dist == "pairs":
            for k in ("prompt", "output", "corr"):
                if k in d:
                    raise ConfigError(f"{path}.{k}: not valid for dist 'pairs'")
            p = d.get("path")
            if not isinstance(p, str) or not p:
                raise ConfigError(f"{path}.path: dist 'pairs' needs the path of a trace file")
            return cls("pairs", max_model_len=L, truncation=trunc, path=p)
        if "path" in d:
            raise ConfigError(f"{path}.path: only valid for dist 'pairs'")
        pr = check_keys(d.get("prompt"), f"{path}.prompt", ["mu", "sigma"])
        ou = check_keys(d.get("output"), f"{path}.output", ["mu", "sigma"])
        kw = dict(prompt_mu=num(pr, "mu", f"{path}.prompt", lo=-5, hi=16),
                  prompt_sigma=num(pr, "sigma", f"{path}.prompt", lo=0, hi=5),
                  output_mu=num(ou, "mu", f"{path}.output", lo=-5, hi=16),
                  output_sigma=num(ou, "sigma", f"{path}.output", lo=0, hi=5),
                  corr=num(d, "corr", path, lo=-1, hi=1, lo_open=True, hi_open=True, default=0.0))
        return cls("lognormal", max_model_len=L, truncation=trunc, **kw)

    def to_dict(self) -> dict:
        if self.dist == "pairs":
            return {"dist": "pairs", "path": self.path, "max_model_len": self.max_model_len,
                    "truncation": self.truncation}
        return {"dist": "lognormal", "prompt": {"mu": self.prompt_mu, "sigma": self.prompt_sigma},
                "output": {"mu": self.output_mu, "sigma": self.output_sigma}, "corr": self.corr,
                "max_model_len": self.max_model_len, "truncation": self.truncation}


def _to_tokens(x: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(x, 1.0, float(MAX_TOKENS))).astype(np.int64)


def _clip_to_fit(prompt: np.ndarray, output: np.ndarray, L: Optional[int]):
    if L is None:
        return prompt, output
    prompt = np.minimum(prompt, L - 1)
    return prompt, np.minimum(output, L - prompt)


def lognormal_lengths(rng: np.random.Generator, n: int, *, prompt_mu: float, prompt_sigma: float,
                      output_mu: float, output_sigma: float, corr: float = 0.0,
                      max_model_len: Optional[int] = None, truncation: str = "resample"
                      ) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) pairs, ``(ln P, ln O)`` bivariate normal, truncated to fit (see module doc)."""
    L = max_model_len
    if truncation == "clip" or L is None:
        z1, z2 = rng.standard_normal(n), rng.standard_normal(n)
        zo = corr * z1 + math.sqrt(1.0 - corr * corr) * z2
        p = _to_tokens(np.exp(prompt_mu + prompt_sigma * z1))
        o = _to_tokens(np.exp(output_mu + output_sigma * zo))
        return _clip_to_fit(p, o, L)
    ps: list[np.ndarray] = []
    os_: list[np.ndarray] = []
    got = drawn = 0
    batch = max(64, n + n // 4)
    while got < n:
        z1, z2 = rng.standard_normal(batch), rng.standard_normal(batch)
        zo = corr * z1 + math.sqrt(1.0 - corr * corr) * z2
        p = _to_tokens(np.exp(prompt_mu + prompt_sigma * z1))
        o = _to_tokens(np.exp(output_mu + output_sigma * zo))
        ok = p + o <= L
        drawn += batch
        ps.append(p[ok])
        os_.append(o[ok])
        got += int(ok.sum())
        if got < n:
            acc = got / drawn
            if drawn >= 64 * max(n, 64) and acc < 1e-3:
                raise ConfigError(f"lengths.max_model_len: only {acc:.2%} of the log-normal pairs fit "
                                  f"max_model_len={L}; use truncation 'clip' or change mu/sigma")
            batch = int(min(max(64, 1.25 * (n - got) / max(acc, 1e-3)), 10_000_000))
    return np.concatenate(ps)[:n], np.concatenate(os_)[:n]


def resample_pairs(rng: np.random.Generator, n: int, prompts, outputs, *,
                   max_model_len: Optional[int] = None, truncation: str = "resample"
                   ) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) pairs drawn uniformly with replacement from real pairs.

    ``resample``: pairs with ``P + O > max_model_len`` are removed from the pool first;
    ``clip``: drawn pairs are clipped to fit (``P <= L - 1``, ``O <= L - P``).
    """
    p = np.asarray(prompts, np.int64)
    o = np.asarray(outputs, np.int64)
    if p.shape != o.shape or p.ndim != 1:
        raise ConfigError("lengths: prompts and outputs must be 1-D arrays of equal length")
    if max_model_len is not None and truncation == "resample":
        keep = p + o <= max_model_len
        p, o = p[keep], o[keep]
    if p.size == 0:
        raise ConfigError(f"lengths.max_model_len: no real pair fits max_model_len={max_model_len}")
    idx = rng.integers(0, p.size, size=n)
    return _clip_to_fit(p[idx], o[idx], max_model_len)


def generate_lengths(spec: LengthSpec, n: int, rng: np.random.Generator, pairs=None):
    if spec.dist == "lognormal":
        return lognormal_lengths(rng, n, prompt_mu=spec.prompt_mu, prompt_sigma=spec.prompt_sigma,
                                 output_mu=spec.output_mu, output_sigma=spec.output_sigma,
                                 corr=spec.corr, max_model_len=spec.max_model_len,
                                 truncation=spec.truncation)
    if pairs is None:
        from .io import load_trace  # lazy: the readers are only needed for this dist

        real = load_trace(spec.path).trace
        pairs = (real.prompt_tokens, real.output_tokens)
    return resample_pairs(rng, n, pairs[0], pairs[1], max_model_len=spec.max_model_len,
                          truncation=spec.truncation)


# ---------------------------------------------------------------------------------------- prefixes
@dataclasses.dataclass(frozen=True)
class PrefixSpec:
    share_fraction: float = 0.0
    num_groups: int = 1
    zipf: float = 0.0
    ratio: tuple = ("fixed", 0.5)            # ("fixed", v) | ("uniform", lo, hi) | ("beta", a, b)
    common_prefix_tokens: int = 0

    @classmethod
    def from_dict(cls, d: Any, path: str = "prefix") -> "PrefixSpec":
        check_keys(d, path, ["share_fraction", "num_groups", "ratio"], ["zipf", "common_prefix_tokens"])
        f = num(d, "share_fraction", path, lo=0, hi=1)
        g = num(d, "num_groups", path, lo=1, hi=10_000_000, integer=True)
        a = num(d, "zipf", path, lo=0, hi=10, default=0.0)
        c = num(d, "common_prefix_tokens", path, lo=0, hi=MAX_TOKENS, integer=True, default=0)
        r = d["ratio"]
        rp = f"{path}.ratio"
        if isinstance(r, (int, float)) and not isinstance(r, bool):
            ratio = ("fixed", num({"ratio": r}, "ratio", path, lo=0, hi=1))
        else:
            kind = choice(check_keys(r, rp, ["dist"], ["value", "low", "high", "a", "b"]), "dist", rp,
                          ("fixed", "uniform", "beta"))
            need = {"fixed": ["value"], "uniform": ["low", "high"], "beta": ["a", "b"]}[kind]
            check_keys(r, rp, ["dist", *need])
            if kind == "fixed":
                ratio = ("fixed", num(r, "value", rp, lo=0, hi=1))
            elif kind == "uniform":
                lo, hi = num(r, "low", rp, lo=0, hi=1), num(r, "high", rp, lo=0, hi=1)
                if hi < lo:
                    raise ConfigError(f"{rp}.high: must be >= low ({lo}), got {hi}")
                ratio = ("uniform", lo, hi)
            else:
                ratio = ("beta", num(r, "a", rp, lo=0, lo_open=True, hi=1e4),
                         num(r, "b", rp, lo=0, lo_open=True, hi=1e4))
        return cls(f, g, a, ratio, c)

    def to_dict(self) -> dict:
        kind = self.ratio[0]
        names = {"fixed": ["value"], "uniform": ["low", "high"], "beta": ["a", "b"]}[kind]
        ratio = {"dist": kind, **dict(zip(names, self.ratio[1:]))}
        return {"share_fraction": self.share_fraction, "num_groups": self.num_groups, "zipf": self.zipf,
                "ratio": ratio, "common_prefix_tokens": self.common_prefix_tokens}


def prefix_chains(spec: Optional[PrefixSpec], prompt_tokens: np.ndarray, block_size: int,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, hashes, group, prefix_tokens): CSR chains per request (see module doc).

    ``group`` is the prefix group (1..G) or 0 for an ungrouped request; ``prefix_tokens`` the
    request's shared-prefix length in tokens (before flooring to blocks).
    """
    prompt = np.asarray(prompt_tokens, np.int64)
    n = prompt.size
    if spec is None:
        return np.zeros(n + 1, np.int64), np.zeros(0, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    # fixed consumption: three draws per request whatever the parameters
    joins = rng.random(n) < spec.share_fraction
    w = 1.0 / np.arange(1, spec.num_groups + 1, dtype=float) ** spec.zipf
    cdf = np.cumsum(w)
    group = 1 + np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"),
                           spec.num_groups - 1)
    kind = spec.ratio[0]
    if kind == "fixed":
        u = np.full(n, spec.ratio[1])
        rng.random(n)
    elif kind == "uniform":
        u = spec.ratio[1] + (spec.ratio[2] - spec.ratio[1]) * rng.random(n)
    else:
        u = rng.beta(spec.ratio[1], spec.ratio[2], size=n)
    group = np.where(joins, group, 0).astype(np.int64)
    k_group = np.where(joins, np.floor(u * prompt).astype(np.int64), 0)
    k_common = np.minimum(prompt, spec.common_prefix_tokens)
    k = np.maximum(k_group, k_common)
    bs = int(block_size)
    counts = k // bs
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    j = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
    common_blocks = np.repeat(k_common // bs, counts)
    keys = np.where(j < common_blocks, 0, np.repeat(group, counts))
    hashes = block_hash(NS_PREFIX_GROUP, keys, j) if j.size else np.zeros(0, np.int64)
    return offsets, np.asarray(hashes, np.int64), group, k


# ---------------------------------------------------------------------------------------- trace spec
@dataclasses.dataclass(frozen=True)
class TraceSpec:
    num_requests: int
    arrivals: ArrivalSpec
    lengths: LengthSpec
    prefix: Optional[PrefixSpec] = None
    sla: Optional[SlaSpec] = None
    block_size: int = 16
    name: str = "synthetic"

    @classmethod
    def from_dict(cls, d: Any, path: str = "generator") -> "TraceSpec":
        check_keys(d, path, ["num_requests", "arrivals", "lengths"], ["prefix", "sla", "block_size",
                                                                      "name"])
        n = num(d, "num_requests", path, lo=1, hi=100_000_000, integer=True)
        bs = num(d, "block_size", path, lo=1, hi=4096, integer=True, default=16)
        name = d.get("name", "synthetic")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{path}.name: must be a non-empty string, got {name!r}")
        arr = ArrivalSpec.from_dict(d["arrivals"], f"{path}.arrivals")
        lens = LengthSpec.from_dict(d["lengths"], f"{path}.lengths")
        prefix = None if d.get("prefix") is None else PrefixSpec.from_dict(d["prefix"], f"{path}.prefix")
        sla = None if d.get("sla") is None else SlaSpec.from_dict(d["sla"], f"{path}.sla")
        return cls(n, arr, lens, prefix, sla, bs, name)

    def to_dict(self) -> dict:
        return {"name": self.name, "num_requests": self.num_requests, "block_size": self.block_size,
                "arrivals": self.arrivals.to_dict(), "lengths": self.lengths.to_dict(),
                "prefix": None if self.prefix is None else self.prefix.to_dict(),
                "sla": None if self.sla is None else self.sla.to_dict()}


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or int(seed) < 0:
        raise ConfigError(f"seed: must be an integer >= 0, got {seed!r}")
    return int(seed)


def generate_trace(spec: TraceSpec | dict, seed: int, *, name: Optional[str] = None,
                   pairs=None) -> Trace:
    """One trace from ``spec`` and ``seed``: the same inputs give the same digest everywhere.

    ``pairs``: optional ``(prompts, outputs)`` arrays for ``lengths.dist == "pairs"`` (instead of
    reading ``lengths.path``).
    """
    if isinstance(spec, dict):
        spec = TraceSpec.from_dict(spec)
    seed = _check_seed(seed)
    n = spec.num_requests
    arrivals = generate_arrivals(spec.arrivals, n, rng_stream(seed, STREAM_ARRIVALS))
    prompt, output = generate_lengths(spec.lengths, n, rng_stream(seed, STREAM_LENGTHS), pairs=pairs)
    return _assemble(spec, seed, arrivals, prompt, output, name)


def _assemble(spec: TraceSpec, seed: int, arrivals, prompt, output, name) -> Trace:
    offsets, hashes, _, _ = prefix_chains(spec.prefix, prompt, spec.block_size,
                                          rng_stream(seed, STREAM_PREFIX))
    kw: dict = {}
    name = name or f"{spec.name}-s{seed}"
    if spec.sla is not None:
        cls_id, t1, t2, prio = assign_arrays(prompt, spec.sla, rng_stream(seed, STREAM_CLASSES), name)
        kw = dict(ttft_slo_ns=t1, tpot_slo_ns=t2, priority=prio, class_id=cls_id)
    return Trace.build(arrival_ns=arrivals, prompt_tokens=prompt, output_tokens=output,
                       prefix_offsets=offsets, prefix_hashes=hashes, block_size=spec.block_size,
                       name=name,
                       source=f"tokenbatch generator v{GENERATOR_VERSION}, seed {seed}", **kw)


def resample_trace(real: Trace, spec: TraceSpec | dict, seed: int, *, name: Optional[str] = None) -> Trace:
    """Resample ``real``'s (prompt, output) pairs under ``spec``'s synthetic arrivals (and its
    prefix and SLA sections); ``spec.lengths`` supplies ``max_model_len`` and the truncation rule
    (its ``dist`` is ignored)."""
    if isinstance(spec, dict):
        spec = TraceSpec.from_dict(spec)
    seed = _check_seed(seed)
    n = spec.num_requests
    arrivals = generate_arrivals(spec.arrivals, n, rng_stream(seed, STREAM_ARRIVALS))
    prompt, output = resample_pairs(rng_stream(seed, STREAM_LENGTHS), n, real.prompt_tokens,
                                    real.output_tokens, max_model_len=spec.lengths.max_model_len,
                                    truncation=spec.lengths.truncation)
    return _assemble(spec, seed, arrivals, prompt, output, name)
