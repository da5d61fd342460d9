"""What the switch (NVLS) allreduces share: the library's allreduce/nvls_tree.py
and nvls_ring.py, and the switch program msc synthesize writes
(msc.synth.switch). Ranks are node * g + local on nodes of g GPUs, each node
one switch domain; local index l owns ``per`` consecutive chunks from l * per.

The reduce-loads run on one switch threadblock and the multicast stores on
another (REDUCE_CHANNEL, STORE_CHANNEL), so that across tiles the switch
reduces tile t + 1 while the network carries tile t and the store of tile
t - 1 runs; what crosses the nodes gets threadblocks of its own when lowered.
"""
from __future__ import annotations

from msc.dsl import nccl_orders

REDUCE_CHANNEL, STORE_CHANNEL = 0, 1


def node_switches(p, g: int) -> tuple[list, list]:
    """Each node's switch group for the reduce-loads and for the stores."""
    nodes = [range(j * g, (j + 1) * g) for j in range(p.num_ranks // g)]
    return ([p.switch(ranks, channel=REDUCE_CHANNEL) for ranks in nodes],
            [p.switch(ranks, channel=STORE_CHANNEL) for ranks in nodes])


def reduce_in_nodes(reducing: list, g: int, per: int) -> None:
    """In each node, rank l reads the node's sum of its chunks through the switch (one reduce-load)
    into its output."""
    for j, switch in enumerate(reducing):
        for l in range(g):
            switch.reduce(j * g + l, "input", l * per, per).to("output", l * per)


def store_in_nodes(p, storing: list, g: int, per: int) -> None:
    """In each node, rank l writes its chunks to every rank of its node in one multicast store."""
    for j, switch in enumerate(storing):
        for l in range(g):
            switch.store(p.chunk(j * g + l, "output", l * per, per))


def tree_parent(position: int) -> int:
    """The parent of a node's position in a binary tree (0 is the root)."""
    return (position - 1) // 2


def tree_order(nodes: int, tree: int) -> list[int]:
    """The nodes by position in tree ``tree``: tree 0 is 0, 1, ..., tree 1
    its mirror, so the leaves of one are the inner nodes of the other (as
    NCCL's double binary tree: no NIC carries an inner node's load twice)."""
    order = list(range(nodes))
    return order if tree % 2 == 0 else order[::-1]


def node_edges(nodes: int, tree: int, btree: bool = False) -> list[tuple[int, int]]:
    """Tree ``tree``'s (child, parent) node pairs, leaves first: the heap-ordered
    binary tree (tree_order), or with ``btree`` NCCL's double binary tree
    (tree % 2 of msc.dsl.nccl_orders.node_parent, src/graph/trees.cc)."""
    if btree:
        parents = {x: nccl_orders.node_parent(x, nodes, tree % 2) for x in range(nodes)}
        depth = {}
        for x in range(nodes):
            d, y = 0, x
            while parents[y] is not None:
                d, y = d + 1, parents[y]
            depth[x] = d
        return [(x, parents[x]) for x in sorted(range(nodes), key=lambda x: -depth[x]) if parents[x] is not None]
    order = tree_order(nodes, tree)
    return [(order[pos], order[tree_parent(pos)]) for pos in reversed(range(1, nodes))]


def trees_across_nodes(p, g: int, trees: int, *, btree: bool = False, first_channel: int | None = None) -> None:
    """The ranks of local index l reduce chunk l * trees + k up tree k of the nodes (node_edges) and
    send the total back down. ``first_channel``: tree k's transfers on channel first_channel + k
    (where a rank is the root of one tree and a leaf of the other beside the same peer, one
    threadblock would otherwise carry both trees' steps and wait out a round trip per tile; NCCL
    runs each tree on channels of its own, src/graph/connect.cc); None: the DSL's default."""
    nodes = p.num_ranks // g
    for k in range(trees):
        on = {} if first_channel is None else {"channel": first_channel + k}
        edges = node_edges(nodes, k, btree)
        for l in range(g):
            chunk = l * trees + k
            for child, parent in edges:                # leaves first: a child is complete before it is sent
                p.chunk(parent * g + l, "output", chunk).reduce(p.chunk(child * g + l, "output", chunk), **on)
            for child, parent in reversed(edges):      # root first: a parent is final before it is sent
                p.chunk(parent * g + l, "output", chunk).copy(child * g + l, "output", chunk, **on)
