"""Schedules synthesized from a topology (``msc synthesize``): an msc DSL
program for the topology, verified and lowered like a hand-written one.

Method: throughput-optimal spanning-tree packing, ForestColl's approach. Each
rank's shard (allgather, reduce-scatter), or the root's buffer (broadcast,
reduce), is cut into ``pieces`` equal pieces, and every piece gets a spanning
tree of its own: down the tree for data that spreads (allgather, broadcast),
up it, summing, for data that combines (reduce-scatter, reduce). Allreduce is
the composition: each piece is summed up one tree into its owner, then sent
down another. Why trees: for these collectives a tree moves each piece over
every cut exactly as often as it must (once into each side that lacks it), so
a packing whose busiest link is at the cut bound's rate is optimal at large
sizes, and Edmonds' theorem says such a fractional packing exists; the
remaining design freedom is which trees, which msc.synth.packing chooses by
multiplicative weights on msc's own cost model (msc.sim.topology routes and
shared links), in time polynomial in the ranks (no solver: each tree is one
greedy pass over the n x n route prices).

Pieces are equal (they are chunks of the DSL), so the packing's fractions are
multiples of 1/pieces: more pieces balance better and cost more messages;
``choose_pieces`` takes the fewest within PIECES_SLACK of the best. Not
covered: alltoall (every pair's own data: a flow problem, not a tree
packing), and latency-bound sizes (a tree's depth is not minimized).
"""
from __future__ import annotations

from dataclasses import dataclass

from msc.errors import UsageError

COLLECTIVES = ("allgather", "reducescatter", "allreduce", "broadcast", "reduce")
PIECE_CHOICES = (1, 2, 4, 8)
PIECES_SLACK = 0.02        # fewer pieces are chosen while the busiest link carries at most 2% more


@dataclass(frozen=True)
class Synthesis:
    """The program's text, and what it predicts: ``bandwidth_s_per_byte``,
    the busiest link's time per byte of the collective's size (nccl-tests
    size, msc.units) under the packing, and which link that is."""

    collective: str
    text: str
    pieces: int
    trees: int
    max_depth: int
    bandwidth_s_per_byte: float
    busiest: str


def synthesize(collective: str, topology, *, pieces: int | None = None, spread: int = 1, root: int = 0,
               name: str = "synthesized", command: str = "") -> Synthesis:
    """The synthesized program for ``collective`` on ``topology`` (a
    msc.sim.topology.Topology); ``pieces`` None: choose_pieces()."""
    from msc.synth.emit import program_text
    from msc.synth.packing import EdgeLinks, pack
    from msc.synth.symmetry import find_symmetry

    if collective not in COLLECTIVES:
        raise UsageError(f"msc synthesize makes {', '.join(COLLECTIVES)}, not {collective!r}"
                         + (" (alltoall moves every pair's own data: a flow, not trees)"
                            if collective == "alltoall" else ""))
    n = topology.num_ranks
    if collective in ("broadcast", "reduce") and not (type(root) is int and 0 <= root < n):
        raise UsageError(f"root {root!r} is not a rank of topology {topology.name!r} (0..{n - 1})")
    if not name.isidentifier():
        raise UsageError(f"the algorithm's name must be a Python identifier, got {name!r}")
    edges = EdgeLinks(topology)
    roots = _roots(collective, n, root)
    symmetry = find_symmetry(topology, edges) if collective not in ("broadcast", "reduce") and n > 1 else None
    if pieces is None:
        pieces, packing = choose_pieces(topology, roots, edges, symmetry)
    else:
        if type(pieces) is not int or pieces < 1:
            raise UsageError(f"pieces must be an int >= 1, got {pieces!r}")
        packing = pack(topology, roots, pieces, edges=edges, symmetry=symmetry)
    per_byte = packing.seconds_per_piece_byte / (pieces * _shards(collective, n))
    depth = max((t.depth() for t in packing.trees), default=0)
    header = _header(collective, topology, pieces, packing, per_byte, depth, command)
    if type(spread) is not int or spread < 1:
        raise UsageError(f"spread must be an int >= 1, got {spread!r}")
    text = program_text(collective, packing, num_ranks=n, pieces=pieces, spread=spread, name=name, header=header,
                        root=root)
    return Synthesis(collective, text, pieces, len(packing.trees), depth, per_byte, packing.busiest())


def choose_pieces(topology, roots, edges, symmetry=None):
    """(pieces, packing): the fewest of PIECE_CHOICES whose busiest link's time
    per byte of shard is within PIECES_SLACK of the best's."""
    from msc.synth.packing import pack

    packed = {k: pack(topology, roots, k, edges=edges, symmetry=symmetry) for k in PIECE_CHOICES}
    per_shard = {k: p.seconds_per_piece_byte / k for k, p in packed.items()}
    best = min(per_shard.values())
    k = min(k for k, v in per_shard.items() if v <= best * (1 + PIECES_SLACK))
    return k, packed[k]


def _roots(collective: str, n: int, root: int) -> list[tuple[int, str]]:
    if collective == "allgather":
        return [(r, "out") for r in range(n)]
    if collective == "reducescatter":
        return [(r, "in") for r in range(n)]
    if collective == "allreduce":
        return [(r, kind) for r in range(n) for kind in ("in", "out")]
    return [(root, "out" if collective == "broadcast" else "in")]


def _shards(collective: str, n: int) -> int:
    """Shards the nccl-tests size splits into (a piece is 1/pieces of one)."""
    return n if collective in ("allgather", "reducescatter", "allreduce") else 1


def _header(collective, topology, pieces, packing, per_byte, depth, command) -> str:
    gbps = 1 / per_byte / 1e9 if per_byte > 0 else float("inf")
    return f"""{collective} for {topology.summary()}: synthesized by msc synthesize.

{"Regenerate: " + command if command else ""}
Every shard is cut into {pieces} piece(s), and each piece has a spanning tree of its
own ({len(packing.trees)} trees, at most {depth} hops deep), chosen so that the links share
the load: at large sizes the busiest link ({packing.busiest()}) limits the
collective to {gbps:.1f} GB/s of size per second in msc's cost model, before
latencies and the threadblocks' rates (msc simulate says more; msc bound gives
the least time any schedule can take). Edit freely: msc verifies what it traces."""
