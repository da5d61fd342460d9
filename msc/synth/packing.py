"""Tree packing on a topology's cost model: spanning trees that carry the
pieces of every shard, chosen so that no shared link carries much more than
its share (msc.synth's docstring says why trees, and why this way).

A tree of the packing is rooted at a rank and spans every rank. An *out*
tree carries a piece from its root to everyone (allgather, broadcast); an
*in* tree carries everyone's contribution to its root, each rank adding its
children's partial sums to its own before passing the sum on to its parent
(reduce-scatter, reduce). Either way a tree edge moves one piece once, over
the route between its two ranks (msc.sim.topology.Route), and loads every
shared link of that route by the piece's size.

The trees are chosen one at a time, round-robin over the pieces, each the
cheapest spanning tree under link prices that grow exponentially with how
loaded the link already is relative to its capacity (the multiplicative
weights method for fractional packing, as in Garg and Koenemann's algorithm
for multicommodity flow); the whole packing is made at several sharpnesses
of that growth and the one whose busiest link carries least is kept. A tree
is grown greedily from its root (Prim's rule on the directed graph: join
the rank whose cheapest edge from the tree, or to it, costs least): the
cheapest tree where a pair's price is the same both ways, a heuristic where
it is not.

Up to PER_EDGE_UP_TO ranks the prices follow every edge a tree adds (with
its images under the symmetry), not only every tree: a tree then sees the
load it puts on a link itself. Priced per tree, a symmetric tree is all or
nothing: on nodes of GPUs joined by NICs, once a piece has crossed to the
other node every rank there is cheaper to reach over NVLink, so each piece
crossed once and a rank's NIC brought it only 1/16 of the data on two nodes
of 8, where the cut bound wants NVLink and NIC both full (95% of the cut
bound on dgx-h100:2, 99.6% priced per edge, 8 pieces); on a ring and a
torus per-edge prices send pieces both ways round from 1 and 2 pieces on
(ring:8 at 2 pieces: 87.5% -> 100%). Above PER_EDGE_UP_TO ranks a tree is
priced once: per edge it costs n^2 prices per edge added.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from msc.errors import UsageError
from msc.sim.topology import Topology

# How sharply a link's price rises with its load, relative to the most loaded
# link's: higher spreads load more evenly, lower keeps trees shallow. Each tree
# packing is made at every one of these and the best kept (pack).
SHARPNESS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
PER_EDGE_UP_TO = 64          # ranks: up to here a tree's prices follow each edge it adds (the docstring says why)


@dataclass(frozen=True)
class Tree:
    """One piece's tree: ``root``, ``piece`` (0..pieces-1), ``kind`` "out"
    or "in", and ``edges`` as (parent, child) in the order the tree grew, so
    a parent appears before its children (an in tree runs them backwards:
    children send to parents, leaves first)."""

    root: int
    piece: int
    kind: str
    edges: tuple[tuple[int, int], ...]

    def depth(self) -> int:
        level = {self.root: 0}
        for parent, child in self.edges:
            level[child] = level[parent] + 1
        return max(level.values())


@dataclass(frozen=True)
class LinkLoads:
    """The load a schedule puts on each link (bytes per byte of a piece)
    next to its capacity (bytes/s): ``seconds_per_piece_byte`` is the
    bandwidth time of the busiest link per byte of one piece."""

    load: np.ndarray
    capacity: np.ndarray
    link_names: tuple[str, ...]

    @property
    def seconds_per_piece_byte(self) -> float:
        return float(np.max(self.load / self.capacity)) if len(self.load) else 0.0

    def busiest(self) -> str:
        if not len(self.load):
            return "none"
        return self.link_names[int(np.argmax(self.load / self.capacity))]


@dataclass(frozen=True)
class Packing(LinkLoads):
    """The trees, and the load they put on the links (LinkLoads)."""

    trees: tuple[Tree, ...] = ()


class EdgeLinks:
    """Every ordered rank pair's route as the links it loads: the
    topology's shared links, plus a link of the pair's own for a route whose
    unshared links cap its rate (each transfer over it is capped, and the
    pieces sent over one pair share that transfer's rate)."""

    def __init__(self, topology: Topology):
        n = topology.num_ranks
        self.num_ranks = n
        rows: list[tuple[int, ...]] = []
        pairs, routes = [], []
        for u in range(n):
            for v in range(n):
                if u != v:
                    try:
                        routes.append(topology.route(u, v))      # registers the shared links
                    except UsageError:                           # no path: that pair has no edge
                        continue
                    pairs.append((u, v))
        self.connected = np.zeros((n, n), dtype=bool)
        for u, v in pairs:
            self.connected[u, v] = True
        capacity, names = list(topology.capacity), list(topology.resource_names)
        own = len(capacity)
        for (u, v), route in zip(pairs, routes):
            links = tuple(route.resources)
            if math.isfinite(route.bandwidth):
                links += (own,)
                capacity.append(route.bandwidth)
                names.append(f"{u}->{v} (unshared links)")
                own += 1
            rows.append(links)
        width = max((len(r) for r in rows), default=1)
        self.capacity = np.array(capacity, dtype=np.float64)
        self.names = tuple(names)
        self.nlinks = len(capacity)
        # links[u, v, i]: the i-th link of pair (u, v)'s route; a padding link of weight 0 (index nlinks)
        self.links = np.full((n, n, width), self.nlinks, dtype=np.int64)
        for (u, v), links in zip(pairs, rows):
            self.links[u, v, :len(links)] = links

    def prices(self, weight: np.ndarray) -> np.ndarray:
        """price[u, v]: the summed weight of pair (u, v)'s links (inf on the diagonal)."""
        padded = np.append(weight, 0.0)
        price = padded[self.links].sum(axis=2)
        price[~self.connected] = np.inf                 # the diagonal, and pairs without a route
        return price


def pack(topology: Topology, roots: list[tuple[int, str]], pieces: int, *, edges: EdgeLinks | None = None,
         symmetry=None, sharpness: tuple[float, ...] = SHARPNESS, per_edge: bool | None = None) -> Packing:
    """``pieces`` trees for each (root, kind) of ``roots``, packed together
    (an allreduce packs its in trees and its out trees at once: both load
    the same links).

    ``symmetry`` (msc.synth.symmetry.Symmetry), for collectives whose roots
    are every rank: rank 0's trees are chosen, priced as the sum of their
    images, and rank s's trees are their images under the symmetry taking 0
    to s. Every rank then does the same work in the same order, which the
    runtime's threadblocks, looping over their steps in lockstep, need to
    stream without waiting on each other (msc.synth's docstring).
    ``per_edge``: price the trees after every edge (None: up to
    PER_EDGE_UP_TO ranks; the module's docstring says why)."""
    edges = edges or EdgeLinks(topology)
    if per_edge is None:
        per_edge = edges.num_ranks <= PER_EDGE_UP_TO
    if symmetry is not None:
        maps = symmetry.link_maps
        roots = sorted({(0, kind) for _, kind in roots})
    else:
        maps = np.arange(edges.nlinks + 1)[None, :]
    # The whole packing at each sharpness; the one whose busiest link is least loaded (then
    # the most even) wins: no one sharpness suits every topology.
    runs = (_pack_at(edges, roots, pieces, maps, sharp, per_edge) for sharp in sharpness)
    chosen, load = most_even(edges.capacity, runs)
    perms = symmetry.perms if symmetry is not None else [None]
    trees = [Tree(root if perm is None else int(perm[root]), piece, kind,
                  tuple(tree_edges if perm is None else ((int(perm[a]), int(perm[b])) for a, b in tree_edges)))
             for perm in perms for root, piece, kind, tree_edges in chosen]
    return Packing(load[:-1], edges.capacity, edges.names, trees=tuple(trees))


def _pack_at(edges: EdgeLinks, roots, pieces: int, maps: np.ndarray, sharpness: float, per_edge: bool):
    """(root, piece, kind, edges) of every chosen tree, and the links' load (padding last)."""
    load = np.zeros(edges.nlinks + 1)
    chosen = []
    for piece in range(pieces):
        for root, kind in roots:
            if per_edge:
                tree_edges = grow_priced(edges, maps, load, sharpness, root, kind)
            else:
                price = edges.prices(orbit_weights(load, edges.capacity, maps, sharpness)[:-1])
                tree_edges = grow(price if kind == "out" else price.T, root)
            chosen.append((root, piece, kind, tree_edges))
            load += _tree_load(edges, maps, tree_edges, kind)
    return chosen, load


def orbit_weights(load: np.ndarray, capacity: np.ndarray, maps: np.ndarray, sharpness: float) -> np.ndarray:
    """Each link's price per byte (link_weights) summed over its images under
    the symmetry (``load`` and the result with the padding link last, 0)."""
    weight = link_weights(load[:-1], capacity, sharpness)
    return np.append(weight, 0.0)[maps].sum(axis=0)


def grow_priced(edges: EdgeLinks, maps: np.ndarray, load: np.ndarray, sharpness: float, root: int,
                kind: str) -> tuple[tuple[int, int], ...]:
    """A spanning tree from ``root`` by Prim's rule, as grow, but priced
    again after every edge with that edge's load (and its images') added,
    so that the tree's own edges make a link dearer (module docstring)."""
    n = edges.num_ranks
    load = load.copy()
    # route[u, v]: the links a piece crosses going from parent u to child v (an in tree sends child -> parent)
    route = edges.links if kind == "out" else edges.links.transpose(1, 0, 2)
    reach = edges.connected if kind == "out" else edges.connected.T
    members, joined, out = [root], np.zeros(n, dtype=bool), []
    joined[root] = True
    padded = np.zeros(edges.nlinks + 1)                  # the weights, and 0 for the padding link
    for _ in range(n - 1):
        padded[:-1] = link_weights(load[:-1], edges.capacity, sharpness)
        orbit = padded if len(maps) == 1 else padded[maps].sum(axis=0)
        price = orbit[route[members]].sum(axis=2)
        price[~reach[members] | joined[None, :]] = np.inf
        at = int(np.argmin(price))
        if not np.isfinite(price.flat[at]):
            lost = np.flatnonzero(~joined).tolist()
            raise UsageError(f"no route reaches rank(s) {', '.join(map(str, lost))} from the ranks rank {root}'s "
                             f"tree spans ({', '.join(map(str, np.flatnonzero(joined).tolist()))}): the topology "
                             f"is not connected that way")
        parent, child = members[at // n], at % n
        out.append((parent, child))
        members.append(child)
        joined[child] = True
        np.add.at(load, maps[:, route[parent, child]].ravel(), 1.0)
        load[-1] = 0.0
    return tuple(out)


def _tree_load(edges: EdgeLinks, maps: np.ndarray, tree_edges, kind: str) -> np.ndarray:
    """The load (per link, padding last) a tree and its images add."""
    add = np.zeros(edges.nlinks + 1)
    senders = [(p, c) if kind == "out" else (c, p) for p, c in tree_edges]
    if senders:
        links = edges.links[tuple(np.array(senders).T)].ravel()
        np.add.at(add, maps[:, links].ravel(), 1.0)
    add[-1] = 0.0
    return add


def load_score(util: np.ndarray) -> tuple[float, float]:
    """How good a set of link utilisations (s per byte) is: the busiest link's
    to 9 significant digits (so that float noise does not decide), then the
    sum of squares (the most even). Utilisations are about 1e-10 s per byte:
    rounding to 9 decimal places, as this once did, made every busiest link 0."""
    return (float(f"{util.max():.9g}") if len(util) else 0.0, float((util ** 2).sum()))


def most_even(capacity: np.ndarray, runs):
    """Of ``runs``, (result, load with the padding link last) pairs, the first
    with the best load_score."""
    return min(runs, key=lambda run: load_score(run[1][:-1] / capacity))


def link_weights(load: np.ndarray, capacity: np.ndarray, sharpness: float) -> np.ndarray:
    """Each link's price per byte: exponential in its utilisation relative to the busiest link's."""
    util = load / capacity
    top = float(util.max()) if len(util) else 0.0
    return np.exp(sharpness * (util / top - 1.0) if top > 0 else np.zeros_like(util)) / capacity


def grow(price: np.ndarray, root: int) -> tuple[tuple[int, int], ...]:
    """A spanning tree from ``root`` under ``price[parent, child]``: Prim's
    rule, joining next the rank that the tree reaches most cheaply."""
    n = price.shape[0]
    best = price[root].copy()                 # cheapest edge from the tree to each rank
    parent = np.full(n, root)
    joined = np.zeros(n, dtype=bool)
    joined[root] = True
    best[root] = np.inf
    out = []
    for _ in range(n - 1):
        child = int(np.argmin(np.where(joined, np.inf, best)))
        if not np.isfinite(best[child]):
            lost = np.flatnonzero(~joined).tolist()
            raise UsageError(f"no route reaches rank(s) {', '.join(map(str, lost))} from the ranks rank {root}'s "
                             f"tree spans ({', '.join(map(str, np.flatnonzero(joined).tolist()))}): the topology "
                             f"is not connected that way")
        out.append((int(parent[child]), child))
        joined[child] = True
        cheaper = price[child] < best
        best = np.where(cheaper, price[child], best)
        parent = np.where(cheaper, child, parent)
    return tuple(out)
