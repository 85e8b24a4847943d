"""The link a request's KV cache crosses from a prefill replica to a decode replica (docs/design.md
section 13): ``N x kv_bytes_per_token`` bytes at ``gb_per_s``, after ``latency_us``, FIFO per link.

The presets are line rates (what a transfer engine approaches, never exceeds); their latencies are
assumptions, said so. A deployment's own link: ``KVLink("mine", gb_per_s=..., latency_us=...)``.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class KVLink:
    name: str
    gb_per_s: float            # bytes per ns: 1 GB/s = 1e9 B/s
    latency_us: float
    source: str = ""

    def __post_init__(self):
        for f in ("gb_per_s", "latency_us"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (f == "gb_per_s" and v == 0):
                raise ConfigError(f"KV link {self.name!r}: {f} must be a finite number "
                                  f"{'> 0' if f == 'gb_per_s' else '>= 0'}, got {v!r}")

    def ps_per_token(self, kv_bytes_per_token: int) -> int:
        """Picoseconds to move one token's KV (the kernel's integer clock: ``C_XFER_PS_PER_TOKEN``)."""
        return int(round(kv_bytes_per_token / self.gb_per_s * 1000))

    def describe(self) -> str:
        """``nvlink (450 GB/s, 5 us)``; ``none (free)`` for a link without cost."""
        if self.gb_per_s >= 1e20 and self.latency_us == 0:
            return f"{self.name} (free)"
        return f"{self.name} ({self.gb_per_s:g} GB/s, {self.latency_us:g} us)"

    @property
    def latency_ns(self) -> int:
        return int(round(self.latency_us * 1000))

    def transfer_ns(self, tokens: int, kv_bytes_per_token: int) -> int:
        """One transfer of ``tokens`` tokens on an idle link, as the kernel prices it."""
        return (tokens * self.ps_per_token(kv_bytes_per_token) + 999) // 1000 + self.latency_ns


#: the presets (``--kv-link NAME``)
KV_LINKS = {
    "nvlink": KVLink("nvlink", 450.0, 5.0,
                     "NVLink 4 (H100 SXM): 900 GB/s bidirectional, 450 GB/s per direction (NVIDIA H100 "
                     "datasheet); the 5 us latency is an assumption"),
    "rdma": KVLink("rdma", 50.0, 10.0,
                   "InfiniBand NDR / ConnectX-7: 400 Gb/s = 50 GB/s per port (NVIDIA ConnectX-7 datasheet); "
                   "the 10 us latency is an assumption"),
    "none": KVLink("none", 1e30, 0.0, "no transfer cost (the equivalence tests)"),
}


def resolve_kv_link(link) -> KVLink:
    """A ``KVLink`` or a preset's name; one line listing the presets otherwise."""
    if isinstance(link, KVLink):
        return link
    if isinstance(link, str) and link in KV_LINKS:
        return KV_LINKS[link]
    raise ConfigError(f"unknown KV link {link!r}; valid: {', '.join(KV_LINKS)}")
