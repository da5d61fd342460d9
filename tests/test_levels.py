"""msc.ir.levels: longest-path levels of a DAG from edge arrays, against a
plain Python walk on random DAGs (nodes shuffled so ids say nothing)."""
import random

import numpy as np
import pytest

from msc.ir.levels import levels


def _reference(n, edges):
    preds = [[] for _ in range(n)]
    for a, b in edges:
        preds[b].append(a)
    order, indeg = [], [0] * n
    for _, b in edges:
        indeg[b] += 1
    ready = [v for v in range(n) if indeg[v] == 0]
    succs = [[] for _ in range(n)]
    for a, b in edges:
        succs[a].append(b)
    while ready:
        v = ready.pop()
        order.append(v)
        for t in succs[v]:
            indeg[t] -= 1
            if indeg[t] == 0:
                ready.append(t)
    depth = [0] * n
    for v in order:
        for p in preds[v]:
            depth[v] = max(depth[v], depth[p] + 1)
    return depth


@pytest.mark.parametrize("seed", range(40))
def test_levels_match_a_python_walk(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 400)
    perm = list(range(n))
    rng.shuffle(perm)
    edges = []
    for _ in range(rng.randint(0, 3 * n)):
        a, b = sorted(rng.sample(range(n), 2)) if n > 1 else (0, 0)
        if a != b:
            edges.append((perm[a], perm[b]))
    if rng.random() < 0.3 and n > 1:             # a wide band, so some levels run in bulk
        edges += [(perm[i], perm[j]) for i in range(min(n, 60)) for j in range(60, min(n, 120))]
    got = levels(n, [a for a, _ in edges], [b for _, b in edges])
    assert got.tolist() == _reference(n, edges)
    if edges:                                    # one back edge closes a cycle
        a, b = edges[rng.randrange(len(edges))]
        assert levels(n, [a for a, _ in edges] + [b], [b for _, b in edges] + [a]) is None


def test_levels_of_no_edges_and_a_chain():
    assert levels(3, [], []).tolist() == [0, 0, 0]
    assert levels(0, [], []).tolist() == []
    n = 1000
    assert levels(n, np.arange(n - 1)[::-1], np.arange(1, n)[::-1]).tolist() == list(range(n))


def test_partial_levels_mark_what_a_cycle_holds_back():
    # 0 -> 1 -> 2 -> 1 (a cycle), 2 -> 3; 4 free, 4 -> 5
    src, dst = [0, 1, 2, 2, 4], [1, 2, 1, 3, 5]
    assert levels(6, src, dst) is None
    assert levels(6, src, dst, partial=True).tolist() == [0, -1, -1, -1, 0, 1]
    assert levels(3, [0, 1], [1, 2], partial=True).tolist() == [0, 1, 2]   # no cycle: the same as without
