"""A trace's prefix chains at a coarser KV block size (docs/design.md section 2): vLLM's
``--block-size`` changes what a cache hit is, and a trace stores its chains at one granularity.

A chain entry commits to every token before the end of its block (each hash chains its
predecessor's), so the chain at block size ``m x bs`` is the entry at every ``m``-th block of the
chain at ``bs``: the two agree exactly on which prompts share which full blocks. A size that is not
a multiple of the stored one would need the tokens themselves, which traces do not carry."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

__all__ = ["at_block_size", "check_block_size"]


def check_block_size(trace, block_size: int) -> None:
    """A ConfigError unless ``trace``'s chains can be re-chained at ``block_size`` (a multiple of its
    own block size), naming the trace and both sizes."""
    bs = int(trace.block_size)
    if block_size < bs or block_size % bs:
        raise ConfigError(f"trace {trace.name!r} stores its prefix chains at block size {bs}; an engine block size "
                          f"must be a multiple of it, got {block_size}")


def at_block_size(trace, block_size: int):
    """``trace`` with its prefix chains at ``block_size`` (a multiple of ``trace.block_size``)."""
    bs = int(trace.block_size)
    if block_size == bs:
        return trace
    check_block_size(trace, block_size)
    m = block_size // bs
    off = np.asarray(trace.prefix_offsets, np.int64)
    lens = np.diff(off) // m
    new_off = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=new_off[1:])
    # entry j of request i's new chain: old entry (j + 1) * m - 1
    starts = np.repeat(off[:-1], lens)
    j = np.arange(int(new_off[-1]), dtype=np.int64) - np.repeat(new_off[:-1], lens)
    hashes = np.asarray(trace.prefix_hashes)[starts + (j + 1) * m - 1]
    return trace.replace(prefix_offsets=new_off, prefix_hashes=hashes, block_size=int(block_size))
