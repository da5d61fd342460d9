"""All-to-all on a topology's cost model: every rank's piece for every other
rank travels straight (the topology's route between the two) or through one
relay rank, the path chosen so that no shared link carries much more than
its share.

Alltoall moves every pair's own data, so nothing is shared down a tree: it is
a multicommodity flow. Straight routes already reach msc bound where the
topology's routes spread the load (NVSwitch, PCIe switches, one NIC per GPU:
the library's all-pairs is within 3% there), but a ring or a torus routes
every pair one shortest way, and the pairs half-way round all load the same
direction. A relay sends some of them the other way.

Paths are chosen by multiplicative weights, as the trees are
(msc.synth.packing): each piece in turn, round-robin over the pieces and
then the pairs, takes the cheapest of its paths (straight, or through any
other rank) under link prices exponential in their load, at several
sharpnesses of that growth, keeping the most even. No solver: each choice is
one pass over the n relays. One relay reaches both ways round a ring and
every dimension order on a torus; it costs a second transfer and a hop of
latency, so a piece goes straight unless a relay is strictly cheaper, and
the relays are dropped unless they take more than RELAY_GAIN off the
busiest link's load of straight routes alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from msc.errors import UsageError
from msc.synth.packing import SHARPNESS, EdgeLinks, LinkLoads, link_weights, most_even


@dataclass(frozen=True)
class Flows(LinkLoads):
    """``relays[src, dst]``: per piece of src's chunk for dst, the rank it is
    relayed through, or None (straight); and the links' load per byte of a
    piece (LinkLoads)."""

    relays: dict = field(default_factory=dict)

    def relayed(self) -> int:
        return sum(r is not None for pieces in self.relays.values() for r in pieces)

    def max_hops(self) -> int:
        return 2 if self.relayed() else (1 if self.relays else 0)


# Relays are kept only where they take more than this off the busiest link's load: where straight
# routes balance already (one NIC per GPU), relaying a piece only adds a transfer and a hop.
RELAY_GAIN = 0.02


def route_flows(edges: EdgeLinks, pieces: int, *, floor: float = 0.0,
                sharpness: tuple[float, ...] = SHARPNESS) -> Flows:
    """Every ordered pair's ``pieces`` pieces routed (see the module doc).
    ``floor``: the least busiest-link time per piece byte any routing can
    have (msc bound's cut); where straight routes come within RELAY_GAIN of
    it, they are taken without searching for relays (n^2 pieces x n relays
    each: minutes at 256 ranks)."""
    straight = _flows(edges, *_straight(edges, pieces))
    if straight.seconds_per_piece_byte <= floor * (1 + RELAY_GAIN):
        return straight
    routed = _flows(edges, *most_even(edges.capacity, (_route_at(edges, pieces, sharp) for sharp in sharpness)))
    if routed.seconds_per_piece_byte >= straight.seconds_per_piece_byte * (1 - RELAY_GAIN):
        return straight
    return routed


def _flows(edges: EdgeLinks, relays: dict, load: np.ndarray) -> Flows:
    return Flows(load[:-1], edges.capacity, edges.names, relays={pair: tuple(r) for pair, r in sorted(relays.items())})


def _straight(edges: EdgeLinks, pieces: int):
    """Every piece straight: (relays per pair, the links' load with the padding link last)."""
    n = edges.num_ranks
    load = np.zeros(edges.nlinks + 1)
    relays = {}
    for src in range(n):
        for dst in range(n):
            if src != dst and edges.connected[src, dst]:
                relays[(src, dst)] = [None] * pieces
                np.add.at(load, edges.links[src, dst], float(pieces))
    load[-1] = 0.0
    return relays, load


def _route_at(edges: EdgeLinks, pieces: int, sharpness: float):
    """(relays per pair, the links' load with the padding link last) at one sharpness."""
    n = edges.num_ranks
    load = np.zeros(edges.nlinks + 1)
    relays: dict[tuple[int, int], list] = {}
    reach = edges.connected
    for _ in range(pieces):
        for src in range(n):
            for dst in range(n):
                if src == dst:
                    continue
                weight = np.append(link_weights(load[:-1], edges.capacity, sharpness), 0.0)
                straight = weight[edges.links[src, dst]].sum() if reach[src, dst] else np.inf
                via = weight[edges.links[src]].sum(axis=1) + weight[edges.links[:, dst]].sum(axis=1)
                via[~(reach[src] & reach[:, dst])] = np.inf       # src and dst themselves too
                relay = int(np.argmin(via))
                if straight <= via[relay]:
                    relays.setdefault((src, dst), []).append(None)
                    np.add.at(load, edges.links[src, dst], 1.0)
                elif np.isfinite(via[relay]):
                    relays.setdefault((src, dst), []).append(relay)
                    np.add.at(load, edges.links[src, relay], 1.0)
                    np.add.at(load, edges.links[relay, dst], 1.0)
                else:
                    raise UsageError(f"no route from rank {src} to rank {dst}, straight or through another rank: "
                                     "the topology is not connected that way")
                load[-1] = 0.0
    return relays, load
