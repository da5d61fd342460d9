"""Symmetries of a topology that take rank 0 to every rank: with them the
packing chooses rank 0's trees and maps them to every other rank, so that
every rank does the same work in the same order (msc.synth.packing.pack).

A permutation p of the ranks is a symmetry when it maps routes onto routes
link for link: there is a bijection m of the links with capacity[m(l)] =
capacity[l] such that the route from p(u) to p(v) crosses m(l) wherever the
route from u to v crosses l, at the same latency. Candidates come from the
topology's structure (rotations of a ring or of any rank order; translations
of a torus; shifts of nodes, switches and GPUs within a switch); each is
checked against the routes themselves, so a TOML topology gets a symmetry
exactly when one of these shapes fits it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msc.sim.topology import Nodes, Topology, Torus


@dataclass(frozen=True)
class Symmetry:
    """``perms[s]``: a symmetry taking rank 0 to rank s (rank r -> perms[s][r]);
    ``link_maps[s]``: its bijection of the links (of msc.synth.packing.EdgeLinks,
    the padding link last, mapped to itself)."""

    perms: np.ndarray
    link_maps: np.ndarray
    shape: str


def find_symmetry(topology: Topology, edges) -> Symmetry | None:
    """A transitive set of symmetries of ``topology`` (one per rank), or None."""
    n = topology.num_ranks
    latency = np.full((n, n), np.inf)                 # inf: no route (the diagonal, unconnected pairs)
    for u, v in zip(*np.nonzero(edges.connected)):
        latency[u, v] = topology.route(int(u), int(v)).alpha
    for shape, perms in _candidates(topology):
        maps = [_link_map(edges, latency, perm) for perm in perms]
        if all(m is not None for m in maps):
            return Symmetry(np.array(perms), np.array(maps), shape)
    return None


def _candidates(topology: Topology):
    n = topology.num_ranks
    if isinstance(topology, Torus):
        rows, cols = topology.rows, topology.cols
        yield "translations of the torus", [_torus_shift(rows, cols, s // cols, s % cols) for s in range(n)]
    if isinstance(topology, Nodes):
        yield "shifts of nodes, switches and GPUs", [_nodes_shift(topology, s) for s in range(n)]
    g = topology.gpus_per_node
    if g and n % g == 0 and g < n:
        yield f"shifts of nodes of {g} and of GPUs within a node", [
            np.array([((r // g + s // g) % (n // g)) * g + (r % g + s % g) % g for r in range(n)]) for s in range(n)]
    yield "rotations of the rank order", [np.array([(r + s) % n for r in range(n)]) for s in range(n)]


def _torus_shift(rows: int, cols: int, dr: int, dc: int) -> np.ndarray:
    r = np.arange(rows * cols)
    return ((r // cols + dr) % rows) * cols + (r % cols + dc) % cols


def _nodes_shift(t: Nodes, s: int) -> np.ndarray:
    """Rank (node, switch, gpu) -> (node + s's node, switch + s's, gpu + s's), each cyclic."""
    g, per = t.g, t.g // t.switches
    nodes = t.num_ranks // g
    r = np.arange(t.num_ranks)
    node, switch, gpu = r // g, r % g // per, r % per
    s_node, s_switch, s_gpu = s // g, s % g // per, s % per
    return ((node + s_node) % nodes) * g + ((switch + s_switch) % t.switches) * per + (gpu + s_gpu) % per


def _link_map(edges, latency: np.ndarray, perm: np.ndarray) -> np.ndarray | None:
    """The links' bijection under ``perm``, or None when ``perm`` is no symmetry."""
    if not np.array_equal(latency[perm][:, perm], latency):
        return None
    before, after = edges.links, edges.links[perm][:, perm]
    nlinks = edges.nlinks
    mapping = np.full(nlinks + 1, -1, dtype=np.int64)
    mapping[before.ravel()] = after.ravel()
    if (mapping[before] != after).any():            # one link would map to two
        return None
    used = mapping >= 0
    mapped = mapping[used]
    if len(np.unique(mapped)) != len(mapped):        # two links would map to one
        return None
    capacity = np.append(edges.capacity, np.inf)
    if not np.array_equal(capacity[mapped], capacity[np.flatnonzero(used)]):
        return None
    mapping[~used] = np.flatnonzero(~used)           # links no route uses stay put
    return mapping
