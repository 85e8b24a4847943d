"""Output-length predictors (docs/design.md section 3, "Output-length estimates").

Policies never see true output lengths, except the labelled oracles. A predictor turns a trace into
one estimate per request, fixed at arrival, and a rule for the remaining decode tokens after g:

- ``oracle``: est = O (reference only).
- ``noisy``: est = O * exp(sigma * Z), Z ~ N(0, 1) drawn by a counter-based generator keyed by
  (trace digest, request index, predictor seed): a request's estimate does not depend on which other
  requests, copies or policies share the run. Remaining = max(1, est - g).
- ``prior``: the family's output-length distribution; remaining = mean residual life
  E[L - g | L > g] (no per-request information).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from .errors import ConfigError
from .traces.trace import Trace, splitmix64

KINDS = ("oracle", "noisy", "prior")
_TWO53 = float(2 ** 53)


def _key64(digest: str, seed: int) -> np.uint64:
    h = hashlib.sha256(f"tokenbatch-predictor|{digest}|{int(seed)}".encode()).digest()
    return np.uint64(int.from_bytes(h[:8], "little"))


def counter_normals(digest: str, seed: int, n: int) -> np.ndarray:
    """Standard normals Z_0..Z_{n-1}, each a pure function of (digest, seed, index) (Box-Muller
    over two splitmix64 streams)."""
    key = _key64(digest, seed)
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = splitmix64(key ^ (i * np.uint64(2)))
        b = splitmix64(key ^ (i * np.uint64(2) + np.uint64(1)))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 1.0) / (_TWO53 + 1.0)  # (0, 1]
    u2 = (b >> np.uint64(11)).astype(np.float64) / _TWO53                 # [0, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


@dataclasses.dataclass(frozen=True)
class PredictorSpec:
    """Which output-length predictor the deployable policies get: part of a suite's definition, so
    that every policy is compared on the same information. Validated on construction.

    Attributes:
        kind: ``"noisy"`` (the true length times a log-normal error), ``"oracle"`` (the true length;
            reference only) or ``"prior"`` (no per-request estimate).
        sigma: the log-normal error's standard deviation (``noisy``), >= 0.
        seed: the error draws' seed (``noisy``).

    Raises:
        ConfigError: an unknown kind, a negative or non-finite sigma, a non-integer seed.
    """

    kind: str = "noisy"
    sigma: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"unknown predictor {self.kind!r}; valid: {', '.join(KINDS)}")
        if not (isinstance(self.sigma, (int, float)) and np.isfinite(self.sigma) and self.sigma >= 0):
            raise ConfigError(f"predictor sigma must be a finite number >= 0, got {self.sigma!r}")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ConfigError(f"predictor seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_dict(cls, d) -> "PredictorSpec":
        """A spec from its JSON form (a suite file's ``predictor``): a dict, a kind name, or a spec.

        Raises:
            ConfigError: an unknown field or a bad value.
        """
        if isinstance(d, PredictorSpec):
            return d
        if isinstance(d, str):
            return cls(kind=d)
        unknown = set(d) - {"kind", "sigma", "seed"}
        if unknown:
            raise ConfigError(f"predictor: unknown field(s) {sorted(unknown)}; valid: kind, sigma, seed")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def estimates(trace: Trace, spec: PredictorSpec) -> np.ndarray:
    """Each request's output-length estimate, fixed at arrival: what the deployable policies see
    instead of the true lengths.

    A request's ``noisy`` estimate depends only on the trace's digest, its index and ``spec.seed``,
    so it is the same whichever requests, copies or policies share the run.

    Args:
        trace: the trace.
        spec: the predictor.

    Returns:
        float64 array, one estimate per request (NaN for ``prior``: no estimate).
    """
    o = trace.output_tokens.astype(np.float64)
    if spec.kind == "oracle":
        return o.copy()
    if spec.kind == "noisy":
        return o * np.exp(spec.sigma * counter_normals(trace.digest, spec.seed, len(trace)))
    return np.full(len(trace), np.nan)


def remaining_from_estimate(est: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """The decode tokens left after ``generated`` of them, by a per-request estimate (``noisy``,
    ``oracle``): ``max(1, est - g)``, never below one since the request is still running.

    Args:
        est: the estimates (``estimates``).
        generated: tokens generated so far, per request.

    Returns:
        float64 array of the remaining tokens.
    """
    return np.maximum(1.0, est - generated)


@dataclasses.dataclass(frozen=True)
class ResidualLife:
    """Mean residual life table of an output-length distribution: ``table[g] = E[L - g | L > g]``."""

    table: np.ndarray

    @classmethod
    def from_lengths(cls, lengths) -> "ResidualLife":
        """The table of a sample of output lengths (e.g. a suite's train split), entries >= 1.

        Raises:
            ConfigError: an empty sample or a length < 1.
        """
        L = np.asarray(lengths, np.int64)
        if L.size == 0 or (L < 1).any():
            raise ConfigError("residual life needs a non-empty sample of output lengths >= 1")
        m = int(L.max())
        counts = np.bincount(L, minlength=m + 1).astype(np.float64)
        # survivors S(g) = #{L > g}; sum_{L > g} (L - g) = sum_{k > g} S(k - 1)... use suffix sums
        surv = counts[::-1].cumsum()[::-1]          # #{L >= g}
        tot = (counts * np.arange(m + 1))[::-1].cumsum()[::-1]  # sum of L over L >= g
        g = np.arange(m + 1, dtype=np.float64)
        n_gt = np.append(surv[1:], 0.0)             # #{L > g}
        s_gt = np.append(tot[1:], 0.0)              # sum of L over L > g
        with np.errstate(invalid="ignore", divide="ignore"):
            mrl = np.where(n_gt > 0, s_gt / n_gt - g, 1.0)
        return cls(np.maximum(mrl, 1.0))

    def remaining(self, generated) -> np.ndarray:
        """The expected decode tokens left after ``generated`` (``prior``: no per-request estimate);
        past the table's end, its last entry."""
        g = np.asarray(generated, np.int64)
        return self.table[np.clip(g, 0, self.table.size - 1)]
