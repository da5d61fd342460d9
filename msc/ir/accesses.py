"""Chunk accesses in bulk: sorted by chunk, the writes around each access.

Bulk lowering, the DSL verifier's fast path and the plan verifier's each
sort the reads and writes of every chunk into one array (by chunk, then in
execution order) and ask of every access which write it sees and which
write comes next: read-after-write and write-after-read edges, SSA values.
"""
from __future__ import annotations

import numpy as np


def writes_around(keys: np.ndarray, write: np.ndarray, following: bool = True):
    """For accesses sorted by ``keys`` (each key's accesses together, in
    order) and ``write`` marking the writes: per access, the position of the
    last write strictly before it among its key's accesses (-1: none), and,
    with ``following``, of the first write strictly after it (len: none)."""
    m = keys.size
    pos = np.arange(m, dtype=np.int64)
    new = np.ones(m, dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    start = np.maximum.accumulate(np.where(new, pos, 0))
    last = np.maximum.accumulate(np.where(write, pos, -1))
    before = np.full(m, -1, dtype=np.int64)
    before[1:] = last[:-1]
    before[before < start] = -1
    if not following:
        return before, None
    starts = np.flatnonzero(new)
    end = np.repeat(np.append(starts[1:], m), np.diff(np.append(starts, m)))
    after = np.full(m, m, dtype=np.int64)
    after[:-1] = np.minimum.accumulate(np.where(write, pos, m)[::-1])[::-1][1:]
    after[after >= end] = m
    return before, after


def last_of_each(keys: np.ndarray) -> np.ndarray:
    """The position of each key's last access (keys sorted)."""
    return np.flatnonzero(np.append(keys[1:] != keys[:-1], True)) if keys.size else np.zeros(0, np.int64)
