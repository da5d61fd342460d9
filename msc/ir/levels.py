"""Topological levels of a DAG given as edge arrays, in bulk (numpy).

The level of a node is the length of the longest path that ends at it (0
for a node with no predecessor): Kahn's algorithm run one level at a time,
where a node becomes free one level after its last predecessor. Sorting by
level then gives a topological order, and nodes of one level are unordered
among themselves. Used where millions of steps make a Python walk too slow
(the plan verifier, step order in bulk lowering, the simulator's fast engine).
"""
from __future__ import annotations

import numpy as np

# A level of fewer nodes than this is done in Python: a numpy call costs
# microseconds however small its array, and a long chain of single steps
# would pay a dozen of them per node.
_SMALL = 24


def levels(num_nodes: int, src, dst, *, partial: bool = False) -> np.ndarray | None:
    """Per node its level (int64), for edges ``src[i] -> dst[i]`` (repeats
    allowed); None when the edges have a cycle, or with ``partial`` the
    levels with -1 for every node on or behind a cycle."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    indeg = np.bincount(dst, minlength=num_nodes).astype(np.int64)
    outdeg = np.bincount(src, minlength=num_nodes)
    starts = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(outdeg, out=starts[1:])
    targets = dst[np.argsort(src, kind="stable")]
    level = np.full(num_nodes, -1, dtype=np.int64)
    frontier = np.flatnonzero(indeg == 0)
    done, depth = 0, 0
    py = None                        # starts, targets and indeg as memoryviews, made on first need
    while frontier.size:
        if frontier.size < _SMALL:     # narrow levels: stay in Python while they last
            if py is None:             # (views, not lists: millions of edges would be 100s of MB of ints)
                py = (memoryview(starts), memoryview(targets), memoryview(indeg))
            todo, nodes, depths = frontier.tolist(), [], []
            while todo and len(todo) < _SMALL:
                nodes += todo
                depths += [depth] * len(todo)
                todo = _small_step(todo, py)
                depth += 1
            level[nodes] = depths
            done += len(nodes)
            frontier = np.asarray(todo, dtype=np.int64)
            continue
        level[frontier] = depth
        done += frontier.size
        counts = outdeg[frontier]
        total = int(counts.sum())
        first = np.repeat(starts[frontier], counts)
        offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        hit, times = np.unique(targets[first + offsets], return_counts=True)
        indeg[hit] -= times
        frontier = hit[indeg[hit] == 0]
        depth += 1
    if done != num_nodes and not partial:
        return None
    return level


def _small_step(frontier: list, py) -> list:
    """One level in Python: the next frontier, in increasing order."""
    starts, targets, indeg = py
    nxt = []
    for v in frontier:
        for e in range(starts[v], starts[v + 1]):
            t = targets[e]
            indeg[t] -= 1
            if indeg[t] == 0:
                nxt.append(t)
    nxt.sort()
    return nxt
