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
greedy pass over the n x n route prices, priced again after every edge up to
64 ranks).

Pieces are equal (they are chunks of the DSL), so the packing's fractions are
multiples of 1/pieces: more pieces balance better and cost more messages;
``Synthesizer.fewest_good_pieces`` takes the fewest within PIECES_SLACK of the
best. ``Synthesizer.piece_choices`` are the counts worth simulating: 1, 2, 4
and 8, and 16 only where its packing beats 8's by more than PIECES_SLACK (a
large torus, priced once per tree, whose best fractions are not eighths;
elsewhere 16 pieces only add messages). Not covered: latency-bound sizes (a tree's depth is not minimized). Alltoall
moves every pair's own data, which no tree shares: msc.synth.flows routes
each piece straight or through a relay instead.
"""
from __future__ import annotations


from msc.dsl.collectives import COLLECTIVES as SPECS, ROOTED
from msc.errors import UsageError, did_you_mean
from msc.synth.result import Synthesis

COLLECTIVES = tuple(name for name, spec in SPECS.items() if spec.synthesizes)
SUMS = tuple(name for name in COLLECTIVES if SPECS[name].reduces)      # the collectives whose programs sum up trees
PIECE_CHOICES = (1, 2, 4, 8)
MORE_PIECES = 16           # tried where the packing at 8 pieces is more than PIECES_SLACK from it
SPREADS = (1, 2, 4, 8, 16)
PIECES_SLACK = 0.02        # fewer pieces are chosen while the busiest link carries at most 2% more


def spread_choices(pieces: int) -> tuple[int, ...]:
    """The spreads worth simulating for ``pieces`` pieces: piece j moves on
    channel j % spread, so a spread above the pieces changes nothing."""
    return tuple(s for s in SPREADS if s <= max(pieces, 1))


def default_spread(pieces: int) -> int:
    """A program's default spread for msc tune, whose variations of an int
    parameter d (d, d/2, 2d, 4d) then cover spread_choices(pieces)' middle."""
    return max(1, pieces // 4)


def check_collective(collective: str) -> None:
    """UsageError unless msc synthesize makes ``collective``."""
    if collective in SPECS and collective not in COLLECTIVES:     # a built-in it has no synthesizer for
        baseline = SPECS[collective].baseline
        raise UsageError(f"msc synthesize makes {', '.join(COLLECTIVES)}, not {collective!r}: write its algorithm"
                         + (f" (the library has {baseline.split(':')[0]})" if baseline else ""))
    if collective not in COLLECTIVES:
        raise UsageError(f"msc synthesize makes {', '.join(COLLECTIVES)}, not {collective!r}"
                         + did_you_mean(collective, COLLECTIVES))


class Synthesizer:
    """One collective on one topology: checked, and its routes' links and
    symmetry found, once; then packed for any number of pieces (each packing
    kept) and written out with any spread, name and command."""

    def __init__(self, collective: str, topology, *, root: int = 0):
        from msc.synth.packing import EdgeLinks
        from msc.synth.symmetry import find_symmetry

        check_collective(collective)
        n = topology.num_ranks
        if collective in ROOTED and not (type(root) is int and 0 <= root < n):
            raise UsageError(f"root {root!r} is not a rank of topology {topology.name!r} (0..{n - 1})")
        self.collective, self.topology, self.root = collective, topology, root
        self.links = topology.view("Simple")    # the links as the protocol synthesized plans use sees them
        self.edges = EdgeLinks(self.links)
        self.roots = _roots(collective, n, root)
        rooted = collective in ROOTED
        trees = collective != "alltoall"
        self.symmetry = find_symmetry(self.links, self.edges) if trees and not rooted and n > 1 else None
        self._packings: dict[int, object] = {}

    def packing(self, pieces: int):
        """The trees (msc.synth.packing.Packing), for alltoall the paths
        (msc.synth.flows.Flows), of ``pieces`` pieces; made once."""
        if type(pieces) is not int or pieces < 1:
            raise UsageError(f"pieces must be an int >= 1, got {pieces!r}")
        if pieces not in self._packings:
            self._check_pieces(pieces)
            self._packings[pieces] = self._pack(pieces)
        return self._packings[pieces]

    def _check_pieces(self, pieces: int) -> None:
        """The program of ``pieces`` pieces within msc's limits (chunk factor,
        buffers), checked before packing: --pieces 100000 packed for 50 s
        before its trace met the limit."""
        from msc.dsl.collectives import get_collective

        n = self.topology.num_ranks
        factor = n * pieces if self.collective == "allreduce" else pieces     # as msc.synth.emit writes it
        try:
            get_collective(self.collective).layout(n, factor, False, self.root)
        except UsageError as exc:
            raise UsageError(f"{pieces} pieces on {n} ranks: {exc}") from None

    def _pack(self, pieces: int):
        if self.collective == "alltoall":
            from msc.synth.flows import route_flows

            return route_flows(self.edges, pieces, floor=self._alltoall_floor(pieces))
        from msc.synth.packing import pack

        return pack(self.links, self.roots, pieces, edges=self.edges, symmetry=self.symmetry)

    def _alltoall_floor(self, pieces: int) -> float:
        """msc bound's cut term for alltoall as the busiest link's seconds per
        byte of one piece (a piece is 1 / (ranks x pieces) of the size)."""
        from msc.sim.cut_bound import lower_bound

        big = 1 << 40                                   # the cuts' latency is negligible against this
        [b] = lower_bound("alltoall", self.links, [big], protocols=("Simple",))
        return b.bandwidth / big * self.topology.num_ranks * pieces

    def piece_choices(self) -> tuple[int, ...]:
        """PIECE_CHOICES, and MORE_PIECES where its packing's busiest link
        takes more than PIECES_SLACK less time per byte of shard than at 8
        (not for alltoall)."""
        if self.collective == "alltoall":          # n (n - 1) pieces per piece count: 16 make huge plans
            return PIECE_CHOICES
        per_shard = {k: self.packing(k).seconds_per_piece_byte / k for k in (PIECE_CHOICES[-1], MORE_PIECES)}
        more = per_shard[MORE_PIECES] * (1 + PIECES_SLACK) < per_shard[PIECE_CHOICES[-1]]
        return PIECE_CHOICES + ((MORE_PIECES,) if more else ())

    def fewest_good_pieces(self) -> int:
        """The fewest of piece_choices() whose busiest link's time per byte of
        shard is within PIECES_SLACK of the best's."""
        per_shard = {k: self.packing(k).seconds_per_piece_byte / k for k in self.piece_choices()}
        best = min(per_shard.values())
        return min(k for k, v in per_shard.items() if v <= best * (1 + PIECES_SLACK))

    def program(self, pieces: int, *, spread: int = 1, add_on_arrival: bool = True, name: str = "synthesized",
                command: str = "") -> Synthesis:
        from msc.synth.emit import program_text

        _check_program_args(name, spread, add_on_arrival)
        packing = self.packing(pieces)
        n = self.topology.num_ranks
        per_byte = packing.seconds_per_piece_byte / (pieces * _shards(self.collective, n))
        if self.collective == "alltoall":
            trees, depth = packing.relayed(), packing.max_hops()
            header = _alltoall_header(self.topology, pieces, packing, per_byte, command)
        else:
            trees, depth = len(packing.trees), max((t.depth() for t in packing.trees), default=0)
            header = _header(self.collective, self.topology, pieces, packing, per_byte, depth, command)
        sums = self.collective in SUMS
        text = program_text(self.collective, packing, num_ranks=n, pieces=pieces, spread=spread, name=name,
                            header=header, root=self.root, sums=sums, add_on_arrival=add_on_arrival)
        return Synthesis(self.collective, text, pieces, spread, add_on_arrival if sums else None, trees, depth,
                         per_byte, packing.busiest())


def synthesize(collective: str, topology, *, pieces: int | None = None, spread: int | None = None,
               add_on_arrival: bool = True, root: int = 0, name: str = "synthesized", command: str = "") -> Synthesis:
    """The synthesized program for ``collective`` on ``topology`` (a
    msc.sim.topology.Topology); ``pieces`` None: the fewest good pieces
    (Synthesizer.fewest_good_pieces); ``spread`` None: default_spread(pieces)."""
    synth = Synthesizer(collective, topology, root=root)
    _check_program_args(name, 1 if spread is None else spread, add_on_arrival)   # before packing: cheap
    if pieces is None:
        pieces = synth.fewest_good_pieces()
    if spread is None:
        spread = default_spread(pieces) if type(pieces) is int else 1
    return synth.program(pieces, spread=spread, add_on_arrival=add_on_arrival, name=name, command=command)


def check_name(name) -> str:
    """``name`` if it can name the program's algorithm: a Python identifier,
    no keyword, none of the names the program itself looks up."""
    import keyword

    from msc.synth.emit import global_names as tree_names
    from msc.synth.switch import global_names as switch_names

    def global_names():
        return tree_names() | switch_names()

    if not isinstance(name, str) or not name.isidentifier():
        raise UsageError(f"the algorithm's name must be a Python identifier, got {name!r}")
    if keyword.iskeyword(name):
        raise UsageError(f"the algorithm's name {name!r} is a Python keyword: pick another")
    if name in global_names():
        raise UsageError(f"the algorithm's name {name!r} is a name the synthesized program uses itself "
                         f"({', '.join(sorted(global_names()))}): pick another")
    return name


def _check_program_args(name: str, spread: int, add_on_arrival: bool) -> None:
    check_name(name)
    if type(spread) is not int or spread < 1:
        raise UsageError(f"spread must be an int >= 1, got {spread!r}")
    if type(add_on_arrival) is not bool:
        raise UsageError(f"add_on_arrival must be True or False, got {add_on_arrival!r}")


def _roots(collective: str, n: int, root: int) -> list[tuple[int, str]]:
    if collective == "alltoall":
        return []
    if collective == "allgather":
        return [(r, "out") for r in range(n)]
    if collective == "reducescatter":
        return [(r, "in") for r in range(n)]
    if collective == "allreduce":
        return [(r, kind) for r in range(n) for kind in ("in", "out")]
    return [(root, "out" if collective == "broadcast" else "in")]


def _shards(collective: str, n: int) -> int:
    """Shards the nccl-tests size splits into (a piece is 1/pieces of one)."""
    return n if collective in ("allgather", "reducescatter", "allreduce", "alltoall") else 1


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


def _alltoall_header(topology, pieces, flows, per_byte, command) -> str:
    gbps = 1 / per_byte / 1e9 if per_byte > 0 else float("inf")
    total = sum(len(r) for r in flows.relays.values())
    return f"""alltoall for {topology.summary()}: synthesized by msc synthesize.

{"Regenerate: " + command if command else ""}
Every rank's chunk for each other rank is cut into {pieces} piece(s), and each piece goes
straight over the route between the two or through one relay rank ({flows.relayed()} of {total}
relayed), chosen so that the links share the load: at large sizes the busiest link
({flows.busiest()}) limits the collective to {gbps:.1f} GB/s of size per second in msc's cost model,
before latencies and the threadblocks' rates (msc simulate says more; msc bound gives the least
time any schedule can take). Edit freely: msc verifies what it traces."""
