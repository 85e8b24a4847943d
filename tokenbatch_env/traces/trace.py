"""The Trace: one row per request, columnar, with a content digest every result cites.

docs/design.md section 2. Times are int64 nanoseconds; SLOs are stored in integer nanoseconds too, so the
digest is a hash of integer arrays only. Prefix sharing is a CSR array of block-hash chains at
``block_size`` granularity: request ``i`` owns ``prefix_hashes[prefix_offsets[i]:prefix_offsets[i+1]]``,
the hashes of its leading *shared* full blocks. Blocks past its chain are unique to the request.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional

import numpy as np

from ..errors import TraceError

#: Digest format version: bump when the canonical byte layout changes.
DIGEST_VERSION = b"tokenbatch-trace-v1"
#: Largest token count we accept in any single field (guards against absurd sizes).
MAX_TOKENS = 10_000_000
#: Largest arrival time we accept (ns).
MAX_ARRIVAL_NS = np.iinfo(np.int64).max // 4
#: Largest SLO we accept: one day.
MAX_SLO_NS = 86_400 * 10**9

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's next output from the state ``x`` (uint64, scalar or array; arithmetic mod 2**64): the
    mixer behind ``block_hash`` and the predictors' counter-based normals."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


#: Hash namespaces for ``block_hash``: keys from different sources never collide by construction.
NS_PREFIX_GROUP = 1  # generators: key = prefix group id, index = block index in the group's prefix
NS_MOONCAKE = 2  # Mooncake traces: key = hash id (one 512-token block), index = engine block in it
NS_UNIQUE = 3  # per-request unique blocks, where a generator needs explicit hashes for them


def _splitmix64_inplace(x: np.ndarray) -> np.ndarray:
    """``splitmix64`` on a uint64 array, overwriting it (uint64 array arithmetic wraps mod 2**64)."""
    x += np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def block_hash_runs(namespace: int, keys, per_key: int) -> np.ndarray:
    """``block_hash(namespace, k, 0..per_key-1)`` for each ``k`` in ``keys``, concatenated.

    Equal to ``block_hash(namespace, np.repeat(keys, per_key), np.tile(np.arange(per_key), len(keys)))``
    but computes each distinct key's run once: fast for long chains of repeated keys (Mooncake).
    """
    per_key = int(per_key)
    k = np.asarray(keys, dtype=np.int64).reshape(-1)
    if k.size == 0 or per_key <= 0:
        return np.zeros(0, np.int64)
    uniq, inverse = np.unique(k, return_inverse=True)
    with np.errstate(over="ignore"):
        h0 = splitmix64(np.uint64(namespace) * np.uint64(0x100000001B3) + np.uint64(1))
        hk = _splitmix64_inplace(uniq.astype(np.uint64) ^ h0)
        table = hk[:, None] ^ np.arange(per_key, dtype=np.uint64)[None, :]
        _splitmix64_inplace(table)
        table >>= np.uint64(1)
    return table.view(np.int64)[inverse.reshape(-1)].reshape(-1)


def block_hash(namespace: int, key, index) -> np.ndarray:
    """H(namespace, key, index) as non-negative int64: the hash of shared block ``index`` of ``key``.

    Deterministic on every machine (pure integer arithmetic). ``namespace`` separates the sources
    of keys (prefix groups vs. Mooncake hash ids) so they never collide by construction.
    """
    with np.errstate(over="ignore"):
        k = np.asarray(key, dtype=np.int64).astype(np.uint64)
        j = np.asarray(index, dtype=np.int64).astype(np.uint64)
        h = splitmix64(np.uint64(namespace) * np.uint64(0x100000001B3) + np.uint64(1))
        h = splitmix64(h ^ k)
        h = splitmix64(h ^ j)
        return (h >> np.uint64(1)).astype(np.int64)


def _as_int64(name: str, values, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise TraceError(f"must be one-dimensional, got shape {arr.shape}", column=name)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr)
        if bad.any():
            raise TraceError("NaN or infinite value", row=int(np.argmax(bad)), column=name)
        if (arr != np.round(arr)).any():
            raise TraceError("non-integer value", row=int(np.argmax(arr != np.round(arr))), column=name)
    elif arr.dtype.kind not in "iub" and arr.size:
        raise TraceError(f"must be integers, got dtype {arr.dtype}", column=name)
    out = arr.astype(np.int64, copy=True)
    if n is not None and out.shape[0] != n:
        raise TraceError(f"has {out.shape[0]} rows, expected {n}", column=name)
    out.setflags(write=False)
    return out


def _check_range(name: str, arr: np.ndarray, lo: int, hi: int, what: str) -> None:
    bad = (arr < lo) | (arr > hi)
    if bad.any():
        row = int(np.argmax(bad))
        raise TraceError(f"{what} (got {int(arr[row])}, allowed {lo}..{hi})", row=row, column=name)


def first_appearance_ids(values: np.ndarray) -> tuple:
    """``(n, ids)``: the number of distinct values and each entry's rank by first appearance (the
    first value seen gets 0, the next new one 1, ...)."""
    uniq, first, inv = np.unique(np.asarray(values), return_index=True, return_inverse=True)
    remap = np.empty(len(uniq), np.int64)
    remap[np.argsort(first)] = np.arange(len(uniq))
    return int(len(uniq)), remap[inv.reshape(-1)]


def subset_prefix_ids(n_ids: int, ids: np.ndarray, a: int, b: int) -> tuple:
    """``prefix_ids`` of the chain entries ``[a, b)`` of a trace whose ids are ``(n_ids, ids)``: the
    parent's ids of the entries present, re-ranked by first appearance (no sorting)."""
    from .prefix import window_prefix_ids   # (compiled; imported here: ``import`` stays light)
    out, n_uniq = np.zeros((1, b - a), np.int64), np.zeros(1, np.int64)
    # (the window's entries copied: a read-only view of the parent's would compile a second variant)
    window_prefix_ids(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([b - a], np.int64),
                      np.array([n_ids], np.int64), np.array(ids[a:b], np.int64)[None, :], out, n_uniq)
    return int(n_uniq[0]), out[0]


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A validated, immutable request trace: the input of every simulation, identified by ``digest``.

    One row per request, in arrival order, as read-only int64 columns (see the module docstring for
    units and the prefix-chain layout). Build one with ``Trace.build(...)``, which validates and
    copies; ``load_trace`` / ``save_trace`` read and write files; ``replace`` and ``subset`` derive
    new traces. Immutable so that a digest computed once stays true.

    Attributes:
        arrival_ns: arrival times, ns, non-decreasing.
        prompt_tokens: prompt lengths (tokens, >= 1).
        output_tokens: output lengths (tokens, >= 1).
        ttft_slo_ns: time-to-first-token SLOs (ns), or None for a trace without SLOs.
        tpot_slo_ns: time-per-output-token SLOs (ns), None exactly when ``ttft_slo_ns`` is.
        priority: per-request priority (vLLM's priority policy).
        class_id: per-request SLA class.
        prefix_offsets: CSR offsets (``len + 1``) into ``prefix_hashes``.
        prefix_hashes: each request's chain of shared full-block hashes, concatenated.
        block_size: tokens per KV-cache block, the chains' granularity.
        name: a label (not part of the digest).
        source: where the trace came from (not part of the digest).
        has_priority: whether ``priority`` is the trace's own (a file's column, or set by a rule or
            a caller) rather than the all-zero default; not part of the digest, so that recording it
            changed no digest. SLO rules fill only what a trace lacks (docs/design.md section 2).
    """

    arrival_ns: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft_slo_ns: Optional[np.ndarray]
    tpot_slo_ns: Optional[np.ndarray]
    priority: np.ndarray
    class_id: np.ndarray
    prefix_offsets: np.ndarray
    prefix_hashes: np.ndarray
    block_size: int = 16
    name: str = "trace"
    source: str = ""
    has_priority: bool = True

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, *, arrival_ns, prompt_tokens, output_tokens, ttft_slo_ns=None, tpot_slo_ns=None,
              priority=None, class_id=None, prefix_offsets=None, prefix_hashes=None,
              block_size: int = 16, name: str = "trace", source: str = "",
              file: Optional[str] = None, has_priority: Optional[bool] = None) -> "Trace":
        """Validate and freeze. Errors name ``file`` (if given), the row and the column.
        ``has_priority`` defaults to whether ``priority`` was given."""
        try:
            arrival = _as_int64("arrival_ns", arrival_ns)
            n = arrival.shape[0]
            prompt = _as_int64("prompt_tokens", prompt_tokens, n)
            output = _as_int64("output_tokens", output_tokens, n)
            _check_range("arrival_ns", arrival, 0, MAX_ARRIVAL_NS, "arrival time out of range")
            dec = np.flatnonzero(np.diff(arrival) < 0)
            if dec.size:
                raise TraceError("timestamps decrease", row=int(dec[0]) + 1, column="arrival_ns")
            _check_range("prompt_tokens", prompt, 1, MAX_TOKENS, "token count must be >= 1 and not absurd")
            _check_range("output_tokens", output, 1, MAX_TOKENS, "token count must be >= 1 and not absurd")
            if (ttft_slo_ns is None) != (tpot_slo_ns is None):
                raise TraceError("give both SLO columns or neither", column="ttft_slo_ns")
            t1 = t2 = None
            if ttft_slo_ns is not None:
                t1 = _as_int64("ttft_slo_ns", ttft_slo_ns, n)
                t2 = _as_int64("tpot_slo_ns", tpot_slo_ns, n)
                _check_range("ttft_slo_ns", t1, 1, MAX_SLO_NS, "SLO must be > 0 and at most a day")
                _check_range("tpot_slo_ns", t2, 1, MAX_SLO_NS, "SLO must be > 0 and at most a day")
            prio = _as_int64("priority", np.zeros(n, np.int64) if priority is None else priority, n)
            cls_ = _as_int64("class_id", np.zeros(n, np.int64) if class_id is None else class_id, n)
            _check_range("class_id", cls_, 0, 1_000_000, "class id out of range")
            if prefix_offsets is None:
                offsets = np.zeros(n + 1, np.int64)
                hashes = np.zeros(0, np.int64)
            else:
                offsets = _as_int64("prefix_offsets", prefix_offsets, n + 1)
                hashes = _as_int64("prefix_hashes", np.zeros(0, np.int64) if prefix_hashes is None
                                   else prefix_hashes)
                if offsets[0] != 0 or offsets[-1] != hashes.shape[0]:
                    raise TraceError("CSR offsets must start at 0 and end at len(prefix_hashes)",
                                     column="prefix_offsets")
                lens = np.diff(offsets)
                if (lens < 0).any():
                    raise TraceError("CSR offsets decrease", row=int(np.argmax(lens < 0)),
                                     column="prefix_offsets")
                over = lens > prompt // int(block_size)
                if over.any():
                    raise TraceError("prefix chain longer than the prompt's full blocks",
                                     row=int(np.argmax(over)), column="prefix_hashes")
            if not isinstance(block_size, (int, np.integer)) or int(block_size) < 1:
                raise TraceError(f"block_size must be a positive integer, got {block_size!r}")
            if has_priority is None:
                has_priority = priority is not None
            elif not isinstance(has_priority, (bool, np.bool_)):
                raise TraceError(f"has_priority must be a bool, got {has_priority!r}")
        except TraceError as e:
            if file is not None and e.file is None:
                raise TraceError(e.reason, file=file, row=e.row, column=e.column) from None
            raise
        return cls(arrival, prompt, output, t1, t2, prio, cls_, offsets, hashes, int(block_size),
                   str(name), str(source), bool(has_priority))

    @classmethod
    def _derived(cls, parent: "Trace", **columns) -> "Trace":
        """A trace made of ``parent``'s metadata and int64 columns derived from a validated trace
        such that every ``build`` check holds by construction (e.g. rows of it in order): skips
        the re-validation, freezes the columns. Internal: user input goes through ``build``."""
        fields = {f.name: getattr(parent, f.name) for f in dataclasses.fields(parent)}
        for name, arr in columns.items():
            if arr is not None:
                assert arr.dtype == np.int64 and arr.ndim == 1, name
                arr.setflags(write=False)
            fields[name] = arr
        return cls(**fields)

    def _with_arrivals(self, arrival_ns) -> "Trace":
        """``replace(arrival_ns=...)`` validating only the new column (the others are unchanged)."""
        arrival = _as_int64("arrival_ns", arrival_ns)
        n = arrival.shape[0]
        if n != len(self):
            return self.replace(arrival_ns=arrival_ns)  # build names the mismatched columns
        if n and (arrival[0] < 0 or arrival[-1] > MAX_ARRIVAL_NS or (arrival[1:] < arrival[:-1]).any()):
            # build's checks, in its order, for its messages (sorted and in range otherwise)
            _check_range("arrival_ns", arrival, 0, MAX_ARRIVAL_NS, "arrival time out of range")
            dec = np.flatnonzero(np.diff(arrival) < 0)
            raise TraceError("timestamps decrease", row=int(dec[0]) + 1, column="arrival_ns")
        out = Trace._derived(self, arrival_ns=arrival)
        if "_prefix_ids" in self.__dict__:   # same chains
            object.__setattr__(out, "_prefix_ids", self.__dict__["_prefix_ids"])
        return out

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return int(self.arrival_ns.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self)

    @property
    def has_slos(self) -> bool:
        return self.ttft_slo_ns is not None

    @property
    def ttft_slo_ms(self) -> Optional[np.ndarray]:
        return None if self.ttft_slo_ns is None else self.ttft_slo_ns / 1e6

    @property
    def tpot_slo_ms(self) -> Optional[np.ndarray]:
        return None if self.tpot_slo_ns is None else self.tpot_slo_ns / 1e6

    @property
    def prefix_lengths(self) -> np.ndarray:
        return np.diff(self.prefix_offsets)

    def prefix_ids(self) -> tuple:
        """``(n, ids)``: the number of distinct prefix hashes and each entry's dense id, the rank of
        its hash by first appearance in ``prefix_hashes`` (``first_appearance_ids``). The engine's
        hash map is indexed by these ids (they are only keys: any numbering gives the same
        schedule); numbered in chain order, a chain's ids are mostly neighbours, so its prefix-hit
        walks touch fewer cache lines than with ids numbered by hash value.
        Cached; a subset of a trace whose ids are cached derives its own from them."""
        cached = self.__dict__.get("_prefix_ids")
        if cached is None:
            n, inv = first_appearance_ids(self.prefix_hashes)
            inv.setflags(write=False)
            cached = (n, inv)
            object.__setattr__(self, "_prefix_ids", cached)
        return cached

    def prefix_chain(self, i: int) -> np.ndarray:
        return self.prefix_hashes[self.prefix_offsets[i]:self.prefix_offsets[i + 1]]

    def replace(self, **changes) -> "Trace":
        """A copy with some columns or metadata changed, validated like ``build`` (the trace itself
        is immutable).

        Args:
            **changes: field names (those of ``build``, e.g. ``name=``, ``ttft_slo_ns=``) and their
                new values.

        Returns:
            The new ``Trace``.

        Raises:
            TraceError: the changed trace is invalid (names the column and row).
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields.update(changes)
        if "priority" in changes and "has_priority" not in changes:   # (a new priority column is the trace's own)
            fields["has_priority"] = changes["priority"] is not None
        return Trace.build(**fields)

    def subset(self, index) -> "Trace":
        """Rows ``index`` (a slice or sorted int array), keeping their prefix chains."""
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step == 1:
                return self._rows(lo, max(lo, hi))
        idx = np.arange(len(self))[index] if isinstance(index, slice) else np.asarray(index, np.int64)
        if idx.size and (np.diff(idx) < 0).any():
            raise TraceError("subset indices must be sorted (arrival order)")
        lens = self.prefix_lengths[idx]
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        if idx.size:
            starts = self.prefix_offsets[idx]
            pos = np.repeat(starts - offsets[:-1], lens) + np.arange(offsets[-1])
            hashes = self.prefix_hashes[pos]
        else:
            hashes = np.zeros(0, np.int64)
        take = lambda a: None if a is None else a[idx]  # noqa: E731
        return Trace.build(arrival_ns=self.arrival_ns[idx], prompt_tokens=self.prompt_tokens[idx],
                           output_tokens=self.output_tokens[idx], ttft_slo_ns=take(self.ttft_slo_ns),
                           tpot_slo_ns=take(self.tpot_slo_ns), priority=self.priority[idx],
                           class_id=self.class_id[idx], prefix_offsets=offsets, prefix_hashes=hashes,
                           block_size=self.block_size, name=self.name, source=self.source,
                           has_priority=self.has_priority)

    def _rows(self, lo: int, hi: int) -> "Trace":
        """``subset(slice(lo, hi))`` for 0 <= lo <= hi <= len: rows of a validated trace in order
        satisfy every check of ``build``, so they are copied without re-validation; the prefix ids
        (``prefix_ids``) are derived from the parent's when it has them."""
        take = lambda a: None if a is None else a[lo:hi].copy()  # noqa: E731
        off = self.prefix_offsets
        a, b = int(off[lo]), int(off[hi])
        sub = Trace._derived(self, arrival_ns=take(self.arrival_ns), prompt_tokens=take(self.prompt_tokens),
                             output_tokens=take(self.output_tokens), ttft_slo_ns=take(self.ttft_slo_ns),
                             tpot_slo_ns=take(self.tpot_slo_ns), priority=take(self.priority),
                             class_id=take(self.class_id), prefix_offsets=off[lo:hi + 1] - a,
                             prefix_hashes=self.prefix_hashes[a:b].copy())
        parent_ids = self.__dict__.get("_prefix_ids")
        if parent_ids is not None:
            n_ids, inv = subset_prefix_ids(*parent_ids, a, b)
            inv.setflags(write=False)
            object.__setattr__(sub, "_prefix_ids", (n_ids, inv))
        return sub

    # ------------------------------------------------------------------ identity
    @property
    def digest(self) -> str:
        """The trace's identity, cited by every result: same requests, same digest.

        A SHA-256 hex string over the integer columns and ``block_size``; ``name``, ``source`` and
        ``has_priority`` are excluded, so a renamed copy keeps it. Computed once, then cached.
        """
        cached = self.__dict__.get("_digest")
        if cached is None:
            h = hashlib.sha256(DIGEST_VERSION)
            h.update(np.int64(len(self)).tobytes())
            h.update(np.int64(self.block_size).tobytes())
            cols = [("arrival_ns", self.arrival_ns), ("prompt_tokens", self.prompt_tokens),
                    ("output_tokens", self.output_tokens), ("ttft_slo_ns", self.ttft_slo_ns),
                    ("tpot_slo_ns", self.tpot_slo_ns), ("priority", self.priority),
                    ("class_id", self.class_id), ("prefix_offsets", self.prefix_offsets),
                    ("prefix_hashes", self.prefix_hashes)]
            for name, arr in cols:
                h.update(name.encode() + b"\0")
                if arr is None:
                    h.update(b"none\0")
                else:
                    h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
            cached = h.hexdigest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def equals(self, other: "Trace") -> bool:
        return isinstance(other, Trace) and self.digest == other.digest

    def __repr__(self) -> str:
        return (f"Trace(name={self.name!r}, requests={len(self)}, slos={self.has_slos}, "
                f"digest={self.digest[:12]})")
