"""MSCCLang's topologies (``msccl.topologies``) for ``msc.compat.msccl``.

A topology only says which ranks may talk: copies and reduces across ranks
need a link (bandwidth > 0). Bandwidths and switches are kept for scripts
that read them; msc does not model them.
"""
from __future__ import annotations

from typing import Iterator

from msc.dsl.program import user_line
from msc.errors import AlgorithmError

__all__ = [
    "Topology", "fully_connected", "ring", "line", "star", "hub_and_spoke",
    "dgx1", "dgx_a100", "distributed_fully_connected", "distributed_hub_and_spoke",
]


class Topology:
    """Ranks and links: ``links[dst][src]`` is the bandwidth from ``src`` to
    ``dst`` (0: no link), MSCCLang's convention. ``switches`` are
    ``(srcs, dsts, bandwidth, name)`` tuples."""

    def __init__(self, name: str, links, switches=()):
        rows = [list(row) for row in links]
        if not rows or any(len(row) != len(rows) for row in rows):
            raise AlgorithmError(f"topology {name!r}: links must be a non-empty square matrix", where=user_line())
        for srcs, dsts, bw, switch in switches:
            if not bw > 0:      # MSCCLang's rule: connectedness goes in links
                raise AlgorithmError(f"topology {name!r}: switch {switch!r} has bandwidth {bw!r}; it must be > 0",
                                     where=user_line())
        self.name = name
        self.links = rows
        self.switches = list(switches)

    @property
    def num_ranks(self) -> int:
        return len(self.links)

    ngpus = num_ranks

    def num_nodes(self) -> int:
        return len(self.links)

    def nodes(self) -> range:
        return range(len(self.links))

    def link(self, src: int, dst: int):
        return self.links[dst][src]

    def sources(self, dst: int) -> Iterator[int]:
        return (src for src, bw in enumerate(self.links[dst]) if bw > 0)

    def destinations(self, src: int) -> Iterator[int]:
        return (dst for dst, row in enumerate(self.links) if row[src] > 0)

    def bandwidth_constraints(self) -> Iterator[tuple]:
        """Every link as ``([src], [dst], bw, "src→dst")``, then the switches."""
        for dst, row in enumerate(self.links):
            for src, bw in enumerate(row):
                if bw > 0:
                    yield ([src], [dst], bw, f"{src}→{dst}")
        yield from self.switches

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, {self.num_ranks} ranks)"


def _rank_count(num_nodes, what: str, label: str = "the number of ranks") -> int:
    if type(num_nodes) is not int or num_nodes < 1:
        raise AlgorithmError(f"{what}: {label} must be an int >= 1, got {num_nodes!r}",
                             where=user_line())
    return num_nodes


def _symmetric(n: int, bandwidth: dict[tuple[int, int], int]) -> list[list[int]]:
    """Links both ways for each ``(a, b): bw`` pair."""
    links = [[0] * n for _ in range(n)]
    for (a, b), bw in bandwidth.items():
        links[a][b] = links[b][a] = bw
    return links


def fully_connected(num_nodes: int) -> Topology:
    """Every rank linked to every other rank."""
    n = _rank_count(num_nodes, "fully_connected")
    return Topology(f"FullyConnected(n={n})", [[int(s != d) for s in range(n)] for d in range(n)])


def ring(num_nodes: int) -> Topology:
    """Each rank linked (both ways) to its two neighbours on a ring."""
    n = _rank_count(num_nodes, "ring")
    return Topology(f"Ring(n={n})", [[int(n > 1 and (s - d) % n in (1, n - 1)) for s in range(n)]
                                     for d in range(n)])


def line(num_nodes: int) -> Topology:
    """Each rank linked (both ways) to its neighbours on a line."""
    n = _rank_count(num_nodes, "line")
    return Topology(f"Line(n={n})", [[int(abs(s - d) == 1) for s in range(n)] for d in range(n)])


def star(num_nodes: int, non_blocking: bool = True) -> Topology:
    """Rank 0 linked (both ways) to every other rank; blocking adds a
    switch each way between rank 0 and the others."""
    n = _rank_count(num_nodes, "star")
    points = list(range(1, n))
    switches = [] if non_blocking else [([0], points, 1, "to_points"), (points, [0], 1, "from_points")]
    return Topology(f"Star(n={n})", [[int(s != d and 0 in (s, d)) for s in range(n)] for d in range(n)],
                    switches)


def hub_and_spoke(num_nodes: int) -> Topology:
    """Every rank linked to every other through a switch (links as fully
    connected, one switch into and one out of each rank)."""
    n = _rank_count(num_nodes, "hub_and_spoke")
    switches = []
    for node in range(n):
        others = [o for o in range(n) if o != node]
        switches += [([node], others, 1, f"node_{node}_out"), (others, [node], 1, f"node_{node}_in")]
    return Topology(f"HubAndSpoke(n={n})", [[int(s != d) for s in range(n)] for d in range(n)], switches)


# NVLink pairs of a DGX-1 (V100): two sockets (0-3, 4-7); each GPU has six
# links, doubled on the high-bandwidth chains 0-1-3-2 and 4-5-7-6 and on
# the socket bridges 0-4 and 2-6.
_DGX1_NVLINKS = {
    (0, 1): 2, (1, 3): 2, (2, 3): 2, (4, 5): 2, (5, 7): 2, (6, 7): 2, (0, 4): 2, (2, 6): 2,
    (0, 2): 1, (0, 3): 1, (1, 2): 1, (1, 5): 1, (3, 7): 1, (4, 6): 1, (4, 7): 1, (5, 6): 1,
}


def dgx1() -> Topology:
    """A DGX-1's 8 GPUs and their NVLinks (bandwidth: links per pair)."""
    return Topology("DGX1", _symmetric(8, _DGX1_NVLINKS))


def dgx_a100() -> Topology:
    """A DGX A100's 8 GPUs, all pairs through NVSwitch (12 links each)."""
    return Topology("DGX_A100", [[0 if s == d else 12 for s in range(8)] for d in range(8)])


def _copies(local: Topology, num_copies, remote_bw, what: str) -> tuple[int, list[list]]:
    if not isinstance(local, Topology):
        raise AlgorithmError(f"{what}: the local topology must be a Topology (e.g. dgx1()), got {local!r}",
                             where=user_line())
    _rank_count(num_copies, what, "num_copies")
    if isinstance(remote_bw, bool) or not isinstance(remote_bw, (int, float)) or not remote_bw > 0:
        raise AlgorithmError(f"{what}: remote_bw must be a bandwidth > 0, got {remote_bw!r}", where=user_line())
    m = local.num_ranks
    n = m * num_copies
    # Ranks on one copy keep the local links; ranks on different copies get remote_bw.
    links = [[local.links[dst % m][src % m] if src // m == dst // m else remote_bw for src in range(n)]
             for dst in range(n)]
    return m, links


def _local_switches(local: Topology, num_copies: int) -> list[tuple]:
    m = local.num_ranks
    return [([s + i * m for s in srcs], [d + i * m for d in dsts], bw, f"copy_{i}_{name}_local")
            for srcs, dsts, bw, name in local.switches for i in range(num_copies)]


def distributed_fully_connected(local_topology: Topology, num_copies: int, remote_bw) -> Topology:
    """``num_copies`` nodes of ``local_topology``; rank ``c*m + g`` is local
    rank ``g`` of node ``c``, and every pair of ranks on different nodes is
    linked with ``remote_bw``."""
    _, links = _copies(local_topology, num_copies, remote_bw, "distributed_fully_connected")
    return Topology(f"DistributedFullyConnected(local={local_topology.name},copies={num_copies},bw={remote_bw})",
                    links, _local_switches(local_topology, num_copies))


def distributed_hub_and_spoke(local_topology: Topology, num_copies: int, remote_bw) -> Topology:
    """As ``distributed_fully_connected``, plus one switch out of and one into
    each node that its remote traffic shares."""
    m, links = _copies(local_topology, num_copies, remote_bw, "distributed_hub_and_spoke")
    switches = _local_switches(local_topology, num_copies)
    n = m * num_copies
    for i in range(num_copies):
        here = list(range(i * m, (i + 1) * m))
        remote = [r for r in range(n) if r // m != i]
        switches += [(here, remote, remote_bw, f"copy_{i}_out_remote"),
                     (remote, here, remote_bw, f"copy_{i}_in_remote")]
    return Topology(f"DistributedHubAndSpoke(local={local_topology.name},copies={num_copies},bw={remote_bw})",
                    links, switches)
