"""Chunk accesses in bulk: sorted by chunk, the writes around each access.

Bulk lowering, the DSL verifier's fast path and the plan verifier's each
sort the reads and writes of every chunk into one array (by chunk, then in
execution order) and ask of every access which write it sees and which
write comes next: read-after-write and write-after-read edges, SSA values.
"""
from __future__ import annotations

import numpy as np

# Sorted accesses are worked through in pieces of about this many (a chunk's accesses never split): a
# piece's temporaries are tens of MB where the whole trace's are GBs at scale (the 4096-rank hierarchical
# allreduce has 84 million), each first touched and all alive at once
PIECE = 1 << 22
# Per-access index arrays (steps, lanes, slices) whose entries stay below this are int32, half the bytes
# of int64 (msc.ir.limits keeps them far below it); past it, int64
NARROW_BELOW = 1 << 31


def writes_around(keys: np.ndarray, write: np.ndarray, following: bool = True):
    """For accesses sorted by ``keys`` (each key's accesses together, in
    order) and ``write`` marking the writes: per access, the position of the
    last write strictly before it among its key's accesses (-1: none), and,
    with ``following``, of the first write strictly after it (len: none);
    int32 below NARROW_BELOW accesses, else int64."""
    m = keys.size
    if not m:
        return np.zeros(0, np.int64), (np.zeros(0, np.int64) if following else None)
    # (each array filled and accumulated in place: at scale every one is hundreds of MB; positions int32
    # where they fit, index_type)
    at = index_type(m + 1)
    pos = np.arange(m, dtype=at)
    new = np.ones(m, dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    start = np.zeros(m, dtype=at)                       # the first access of each one's key
    np.copyto(start, pos, where=new)
    np.maximum.accumulate(start, out=start)
    before = np.full(m, -1, dtype=at)                   # the last write at or before the access before
    np.copyto(before[1:], pos[:-1], where=write[:-1])
    np.maximum.accumulate(before, out=before)
    before[before < start] = -1
    del start
    if not following:
        return before, None
    after = np.full(m, m, dtype=at)                    # the first write at or after the access after
    np.copyto(after[:-1], pos[1:], where=write[1:])
    backwards = after[::-1]
    np.minimum.accumulate(backwards, out=backwards)
    end = np.full(m, m, dtype=at)                       # the first access of the next key
    np.copyto(end[:-1], pos[1:], where=new[1:])
    backwards = end[::-1]
    np.minimum.accumulate(backwards, out=backwards)
    after[after >= end] = m
    return before, after


def last_of_each(keys: np.ndarray) -> np.ndarray:
    """The position of each key's last access (keys sorted)."""
    return np.flatnonzero(np.append(keys[1:] != keys[:-1], True)) if keys.size else np.zeros(0, np.int64)


def pieces(codes: np.ndarray, per_key: int, size: int = 0) -> list[tuple[int, int]]:
    """(start, stop) of consecutive pieces of the sorted non-negative
    ``codes``, each about ``size`` (default PIECE) long and cut only where
    the key ``code // per_key`` changes: every key's accesses lie in one piece."""
    m, size = codes.size, size or PIECE
    if m <= size:
        return [(0, m)]
    at = np.arange(size, m, size)
    cut = np.searchsorted(codes, codes[at] // per_key * per_key)      # the first access of that key
    cut = np.unique(np.concatenate([[0], cut, [m]]))
    return list(zip(cut[:-1].tolist(), cut[1:].tolist()))


def index_type(bound: int):
    """The dtype for indices below ``bound``: int32 under NARROW_BELOW, else int64."""
    return np.int32 if bound < NARROW_BELOW else np.int64
