"""Traces: the columnar request table, readers and writers, generators, suites, digests."""

from .trace import Trace, block_hash

__all__ = ["Trace", "block_hash"]
