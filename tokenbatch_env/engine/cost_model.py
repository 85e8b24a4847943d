"""Iteration-time model (docs/design.md section 3), in exact integer arithmetic.

``t = c0 + c_prefill*P + c_c2*sum(chunk^2) + c_attn*sum(chunk*computed_before) + c_decode*D
      + c_kv*sum(decode_context) + swap_time``

Coefficients are given in milliseconds and converted once to integer **picoseconds**; an
iteration's time is the exact integer sum in ps, rounded up to whole ns. Every later sum of times
is therefore exact, and a change of evaluation order cannot change a result.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import ProfileError

#: Field order is the order of terms in the formula (and of columns in fitting tools).
TERMS = ("c0", "c_prefill", "c_c2", "c_attn", "c_decode", "c_kv")


def _ps(ms: float) -> int:
    return int(round(float(ms) * 1e9))


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The six non-negative coefficients (ms, ms/token, ...) and their integer-ps forms."""

    c0: float
    c_prefill: float
    c_c2: float = 0.0
    c_attn: float = 0.0
    c_decode: float = 0.0
    c_kv: float = 0.0

    def __post_init__(self):
        for name in TERMS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ProfileError(f"cost coefficient {name} must be a finite number >= 0, got {v!r}")
        if self.c0 <= 0:
            raise ProfileError("cost coefficient c0 must be > 0 (an iteration takes time)")

    @property
    def ps(self) -> np.ndarray:
        """Coefficients in integer picoseconds, in ``TERMS`` order (int64)."""
        return np.array([_ps(getattr(self, n)) for n in TERMS], dtype=np.int64)

    def iteration_ns(self, prefill_tokens, sum_chunk_sq, sum_chunk_ctx, decodes, sum_decode_ctx,
                     swap_ns=0):
        """Iteration time in integer ns (vectorised over any broadcastable int arrays)."""
        c = self.ps
        total = (c[0] + c[1] * np.asarray(prefill_tokens, np.int64) + c[2] * np.asarray(sum_chunk_sq, np.int64)
                 + c[3] * np.asarray(sum_chunk_ctx, np.int64) + c[4] * np.asarray(decodes, np.int64)
                 + c[5] * np.asarray(sum_decode_ctx, np.int64))
        return (total + 999) // 1000 + np.asarray(swap_ns, np.int64)

    def idle_prefill_ns(self, prompt_tokens, budget: int) -> np.ndarray:
        """Idle-engine time to prefill ``prompt_tokens`` chunked at ``budget`` (= TTFT_idle).

        A lower bound on any real TTFT of the same remaining prefill, since every coefficient
        is non-negative and the engine cannot do better than running the prompt alone.
        """
        if budget < 1:
            raise ProfileError(f"token budget must be >= 1, got {budget}")
        from .scoring import idle_prefill_ns_array  # the engine's own formula (numba)

        p = np.array(prompt_tokens, np.int64)   # (a writable copy: one compiled variant)
        return idle_prefill_ns_array(p.ravel(), int(budget), self.ps).reshape(p.shape)

    def per_token_ms(self, budget: int) -> tuple[float, float]:
        """(u_p, u_d): ms per prefill / decode token at a full batch (docs/design.md section 4)."""
        return self.c0 / budget + self.c_prefill, self.c0 / budget + self.c_decode

    def to_dict(self) -> dict:
        return {n: float(getattr(self, n)) for n in TERMS}


def batch_features(items) -> tuple:
    """(prefill tokens, sum of chunk^2, sum of chunk x computed-before, decodes, sum of decode
    contexts) of one iteration's ``items`` = [(new tokens, computed before, is_decode)]: the
    arguments of ``CostModel.iteration_ns`` (docs/design.md section 3, the cost model)."""
    pre = dec = c2 = attn = kv = 0
    for new, cb, is_dec in items:
        if is_dec:
            dec += 1
            kv += cb
        else:
            pre += new
            c2 += new * new
            attn += new * cb
    return pre, c2, attn, dec, kv
