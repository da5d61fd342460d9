"""Symbolic values in bulk: the numpy form of ``msc.verify``'s labels and
``Sum`` nodes, shared by the verifiers' fast paths.

Values are numbered: leaves (input labels) first, then nodes of ``kind`` 1,
an alias of value ``a`` (a copy), or 2, the sum ``a (+) b``.
"""
from __future__ import annotations

import numpy as np

# Multiplicities are counted in float64 (np.bincount): exact below this.
_EXACT = float(1 << 52)


class Decline(Exception):
    """A fast path cannot vouch for its input (the caller runs the slow one)."""


def follow(ptr: np.ndarray) -> np.ndarray:
    """Pointer jumping: for every entry, the end of its chain (an entry that
    points at itself ends one)."""
    while True:
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            return ptr
        ptr = nxt


def resolve(kind: np.ndarray, a: np.ndarray, b: np.ndarray):
    """Every value's representative (an alias goes to what it copies), and
    per value the representatives of its operands (-1 where it has none)."""
    rep = follow(np.where(kind == 1, a, np.arange(kind.size, dtype=np.int64)))
    ca = rep[np.maximum(a, 0)]
    cb = np.where(b >= 0, rep[np.maximum(b, 0)], -1)
    return rep, ca, cb


def contributions(roots: np.ndarray, kind: np.ndarray, ca: np.ndarray, cb: np.ndarray) -> dict:
    """Per root value, its leaves (ascending) and their multiplicities (two arrays), a
    shared node counted once per path to it. All roots expand together, one
    depth of their sums at a time."""
    total = np.int64(kind.size)
    fr_root = np.arange(roots.size, dtype=np.int64)   # frontier: (root, node, multiplicity)
    fr_node = np.asarray(roots, dtype=np.int64)
    fr_mult = np.ones(roots.size)
    got_root, got_node, got_mult = [], [], []
    while fr_node.size:
        leaf = kind[fr_node] == 0
        got_root.append(fr_root[leaf])
        got_node.append(fr_node[leaf])
        got_mult.append(fr_mult[leaf])
        inner = ~leaf
        r, node, mult = fr_root[inner], fr_node[inner], fr_mult[inner]
        key = np.concatenate([r * total + ca[node], r * total + cb[node]])
        fr_key, inverse = np.unique(key, return_inverse=True)
        fr_mult = np.bincount(inverse, weights=np.concatenate([mult, mult]))
        fr_root, fr_node = fr_key // total, fr_key % total
        if fr_mult.size and fr_mult.max() >= _EXACT:
            raise Decline
    if not got_root:
        return {}
    key = np.concatenate(got_root) * total + np.concatenate(got_node)
    leaf_key, inverse = np.unique(key, return_inverse=True)
    mult = np.bincount(inverse, weights=np.concatenate(got_mult))
    if mult.size and mult.max() >= _EXACT:
        raise Decline
    which, leaves, mult = leaf_key // total, leaf_key % total, mult.astype(np.int64)
    cuts = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), leaves.size]
    return {int(roots[which[lo]]): (leaves[lo:hi], mult[lo:hi]) for lo, hi in zip(cuts, cuts[1:])}
