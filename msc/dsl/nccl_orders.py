"""Rank orders for the library's NCCL-grade baselines (algorithms/*/nccl_*.py).

How NCCL lays its rings and trees over real machines, as rank sequences the
library's algorithms walk; the algorithms themselves (which chunk goes where)
stay in the library files. Facts from NVIDIA/nccl src/graph: search.cc
(ring pattern "NET n -> GPU a -> .. -> GPU x -> NET n", rings one per
channel, each through a different NIC), connect.cc (rings joined node to
node, trees as a chain through each node's GPUs under a tree over nodes,
channel c and c + nChannels on the two trees) and trees.cc (ncclGetBtree,
ncclGetDtree: two binary trees over nodes, every node interior in at most
one). Our own code.

- ``rail_rings``: rings over nodes of ``g`` GPUs whose channels cross
  between nodes on different rails (local GPU indices).
- ``bidirectional_rings``: a ring fabric's two directions.
- ``torus_rings``, ``torus_grid``: four directed Hamiltonian rings of a
  rows x cols torus, every directed link in exactly one.
- ``node_tree``: NCCL's tree for one channel: a chain through each node
  under one of the two binary trees over nodes.
"""
from __future__ import annotations

import math
import random
from functools import lru_cache

from msc.errors import UsageError


def rail_rings(num_ranks: int, gpus_per_node: int, rings: int) -> list[list[int]]:
    """``rings`` ring orders (rank sequences, each closing back to its
    first) over nodes of ``gpus_per_node`` GPUs, rank = node * g + local.

    Ring c visits the nodes in order 0, 1, .., N-1. It enters node k on
    rail e_k = (c + t_k) mod g and leaves it on rail e_{k+1}: the next node is
    entered on the rail it left by (rail-aligned), and inside a node the ring
    runs from its entry GPU through the others (ascending, cyclically) to
    its exit GPU. The offsets t_k alternate 0, 1, 0, 1, .. so that entry and
    exit differ (an odd node count ends on 2, or, with g = 2, leaves the last
    node on rail c + 1 and enters node 0 on rail c: one cross-rail hop). For
    every node the rings' exits are c + t_{k+1} mod g: with rings = g each
    NIC is left by one ring and entered by one ring; more rings than GPUs
    repeat the rails (ring c + g follows ring c). On one node the rings are
    the node's ring 0 -> 1 -> .. -> g-1 -> 0, ring c starting at local c.
    """
    _check_nodes(num_ranks, gpus_per_node)
    if type(rings) is not int or rings < 1:
        raise UsageError(f"rings must be an int >= 1, got {rings!r}")
    g, nodes = gpus_per_node, num_ranks // gpus_per_node
    if nodes == 1:
        return [[(c + i) % g for i in range(g)] for c in range(rings)]
    offsets = _rail_offsets(nodes, g)
    orders = []
    for c in range(rings):
        order = []
        for k in range(nodes):
            entry = (c + offsets[k]) % g
            leave = (c + offsets[(k + 1) % nodes]) % g
            if leave == entry and g > 1:          # g = 2, odd node count: the wrap hop crosses rails
                leave = (entry + 1) % g
            order += [k * g + local for local in _chain(entry, leave, g)]
        orders.append(order)
    return orders


def _check_nodes(num_ranks: int, gpus_per_node: int) -> None:
    if type(gpus_per_node) is not int or gpus_per_node < 1 or num_ranks % gpus_per_node:
        raise UsageError(f"gpus_per_node must be an int >= 1 dividing the rank count ({num_ranks}), "
                         f"got {gpus_per_node!r}")


def _rail_offsets(nodes: int, g: int) -> list[int]:
    """t_0 .. t_{N-1}: neighbours (cyclically) differ where g allows it."""
    offsets = [k % 2 for k in range(nodes)]
    if nodes % 2 and g >= 3:
        offsets[-1] = 2
    return offsets


def _chain(entry: int, leave: int, g: int) -> list[int]:
    """The local GPUs from ``entry`` to ``leave``, the others ascending between."""
    if g == 1:
        return [0]
    middle = [(entry + i) % g for i in range(1, g) if (entry + i) % g != leave]
    return [entry, *middle, leave]


def bidirectional_rings(num_ranks: int) -> list[list[int]]:
    """The ring 0 -> 1 -> .. -> n-1 -> 0 and its reverse 0 -> n-1 -> .. -> 1 -> 0:
    on a bidirectional ring fabric each direction of every link carries one."""
    if type(num_ranks) is not int or num_ranks < 1:
        raise UsageError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    forward = list(range(num_ranks))
    return [forward, [0, *reversed(forward[1:])]]


def torus_rings(rows: int, cols: int) -> list[list[int]]:
    """Four directed Hamiltonian rings of the rows x cols torus (rank = row
    * cols + col, neighbours one step along a row or column, cyclically)
    that together use every directed link exactly once: two edge-disjoint
    undirected Hamiltonian cycles (Kotzig: the product of two cycles always
    has them), each in both directions. Needs rows, cols >= 3 (below that
    the torus has doubled links); UsageError where ``torus_has_rings`` is
    False."""
    cycles = _hamiltonian_pair(rows, cols)
    if cycles is None:
        raise UsageError(f"torus {rows}x{cols}: no pair of edge-disjoint Hamiltonian rings found "
                         "(it needs rows >= 3 and cols >= 3)")
    return [order for cycle in cycles for order in (list(cycle), [cycle[0], *reversed(cycle[1:])])]


def torus_has_rings(rows: int, cols: int) -> bool:
    """Whether ``torus_rings(rows, cols)`` has its four rings."""
    return _hamiltonian_pair(rows, cols) is not None


def torus_grid(num_ranks: int, rows: int | None = None) -> tuple[int, int] | None:
    """(rows, cols) of ``num_ranks`` ranks as a torus with its four rings, or
    None where there is none. ``rows`` None: the largest divisor of n that
    is <= sqrt(n), the grid ``--topology torus`` makes of n ranks."""
    if rows is None:
        rows = max(d for d in range(1, math.isqrt(num_ranks) + 1) if num_ranks % d == 0)
    if type(rows) is not int or rows < 1 or num_ranks % rows or not torus_has_rings(rows, num_ranks // rows):
        return None
    return rows, num_ranks // rows


# The search below has found the pair for every size from 3x3 to 20x20 (at
# most 1.2 s, 18x19) and for 3x100, 4x64, 16x64, 32x32, 5x200 and 8x128 (6.8
# s); the budget only bounds a miss.
_SEARCH_STEPS = 200_000


@lru_cache(maxsize=64)
def _hamiltonian_pair(rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Two edge-disjoint Hamiltonian cycles covering the torus's edges, or
    None. Start from rows (factor 0) and columns (factor 1); switching a
    unit square whose top and bottom are in one factor and sides in the
    other keeps every degree at 2 and joins two cycles of each factor when
    they differ. The squares on the diagonal join all rows and, on a square
    torus, all columns; the rest is a seeded search over squares that keeps
    a switch unless it raises the number of cycles."""
    if type(rows) is not int or type(cols) is not int or rows < 3 or cols < 3:
        return None
    factors = _Factors(rows, cols)
    for i in range(min(rows, cols) - 1):
        factors.switch(i, i)
    cycles = factors.cycle_count()
    rng = random.Random(rows * 1009 + cols)
    for _ in range(_SEARCH_STEPS):
        if cycles == 2:
            return factors.cycle(0), factors.cycle(1)
        i, j = rng.randrange(rows), rng.randrange(cols)
        if factors.switch(i, j):
            now = factors.cycle_count()
            if now <= cycles:
                cycles = now
            else:
                factors.switch(i, j)
    return None


class _Factors:
    """Two 2-factors of a torus: per factor, each vertex's two neighbours."""

    def __init__(self, rows: int, cols: int):
        self.rows, self.cols = rows, cols
        at = self.at
        self.adj = [[{at(i, j - 1), at(i, j + 1)} for i in range(rows) for j in range(cols)],
                    [{at(i - 1, j), at(i + 1, j)} for i in range(rows) for j in range(cols)]]

    def at(self, i: int, j: int) -> int:
        return i % self.rows * self.cols + j % self.cols

    def switch(self, i: int, j: int) -> bool:
        """Swap the square at (i, j) between the factors where one holds its
        top and bottom and the other its sides; False where neither does."""
        tl, tr, bl, br = self.at(i, j), self.at(i, j + 1), self.at(i + 1, j), self.at(i + 1, j + 1)
        across, down = ((tl, tr), (bl, br)), ((tl, bl), (tr, br))
        for f in (0, 1):
            a, b = self.adj[f], self.adj[1 - f]
            if all(v in a[u] for u, v in across) and all(v in b[u] for u, v in down):
                for u, v in across:
                    a[u].remove(v), a[v].remove(u), b[u].add(v), b[v].add(u)
                for u, v in down:
                    b[u].remove(v), b[v].remove(u), a[u].add(v), a[v].add(u)
                return True
        return False

    def cycle_count(self) -> int:
        return sum(self._components(f) for f in (0, 1))

    def _components(self, f: int) -> int:
        seen, count = bytearray(len(self.adj[f])), 0
        for start in range(len(seen)):
            if not seen[start]:
                count += 1
                seen[start], stack = 1, [start]
                while stack:
                    for v in self.adj[f][stack.pop()]:
                        if not seen[v]:
                            seen[v] = 1
                            stack.append(v)
        return count

    def cycle(self, f: int) -> tuple[int, ...]:
        """Factor f (one cycle) walked from vertex 0 toward its lower neighbour."""
        order, prev, here = [0], 0, min(self.adj[f][0])
        while here != 0:
            order.append(here)
            prev, here = here, next(v for v in self.adj[f][here] if v != prev)
        return tuple(order)


def node_tree(num_ranks: int, gpus_per_node: int, head: int, tree: int) -> list[tuple[int, int]]:
    """NCCL's tree for one channel as (child, parent) edges, children before
    their parents (the order a reduction goes up).

    Inside node k the channel is a chain from its head, local GPU ``head``,
    through head+1, head+2, .. (mod g): each GPU's parent is the one before
    it. The heads are joined by ``tree`` (0 or 1) of NCCL's double binary
    tree over the nodes (``node_parent``); the root node's head is the root.
    """
    _check_nodes(num_ranks, gpus_per_node)
    if tree not in (0, 1):
        raise UsageError(f"tree must be 0 or 1, got {tree!r}")
    g, nodes = gpus_per_node, num_ranks // gpus_per_node
    chain = [(head + i) % g for i in range(g)]
    edges = []
    for depth, node in sorted(((_node_depth(x, nodes, tree), x) for x in range(nodes)), reverse=True):
        base = node * g
        edges += [(base + chain[i], base + chain[i - 1]) for i in range(g - 1, 0, -1)]
        parent = node_parent(node, nodes, tree)
        if parent is not None:
            edges.append((base + chain[0], parent * g + chain[0]))
    return edges


def node_parent(node: int, nodes: int, tree: int) -> int | None:
    """The parent of ``node`` in tree 0 or 1 of NCCL's double binary tree over
    ``nodes`` nodes (trees.cc): tree 0 is the binary tree whose leaves are
    the odd nodes, rooted at 0; tree 1 mirrors it (node n-1-x, n even) or
    shifts it (node x+1, n odd), so every node is interior in at most one
    tree (node 0 in both, for odd n). None for a root."""
    if tree == 0:
        return _btree_parent(node, nodes)
    if nodes % 2 == 0:
        up = _btree_parent(nodes - 1 - node, nodes)
        return None if up is None else nodes - 1 - up
    up = _btree_parent((node - 1) % nodes, nodes)
    return None if up is None else (up + 1) % nodes


def _btree_parent(x: int, n: int) -> int | None:
    """ncclGetBtree's parent: clear the lowest set bit and set the next one
    up (xx01[0] -> xx10[0]), or just clear it where that is out of range."""
    if x == 0:
        return None
    bit = x & -x
    up = (x ^ bit) | (bit << 1)
    return up if up < n else x ^ bit


def _node_depth(node: int, nodes: int, tree: int) -> int:
    depth = 0
    while (node := node_parent(node, nodes, tree)) is not None:
        depth += 1
    return depth
