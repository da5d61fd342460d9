"""NVLS inside each node, a tree across nodes (after NCCL's NVLSTree)."""
import msc
from msc.dsl import nccl_orders

# The switch channels: the reduce-loads on one threadblock, the multicast stores on another, so that
# across tiles the switch reduces tile t + 1 while the network carries tile t and the store of
# tile t - 1 runs (the tree's copies get threadblocks of their own when lowered).
REDUCE_CHANNEL, STORE_CHANNEL = 0, 1
# Tree k's transfers on a channel of its own: where a rank is the root of one tree and a leaf of the
# other beside the same peer (two nodes), one threadblock would otherwise carry both trees' steps and
# wait out a round trip per tile (NCCL runs each tree on channels of its own, src/graph/connect.cc).
TREE_CHANNEL = 2


def tree_parent(position: int) -> int:
    """The parent of a node's position in a binary tree (0 is the root)."""
    return (position - 1) // 2


def tree_order(nodes: int, tree: int) -> list[int]:
    """The nodes by position in tree ``tree``: tree 0 is 0, 1, ..., tree 1
    its mirror, so the leaves of one are the inner nodes of the other (as
    NCCL's double binary tree: no NIC carries an inner node's load twice)."""
    order = list(range(nodes))
    return order if tree % 2 == 0 else order[::-1]


def node_edges(nodes: int, tree: int, btree: bool) -> list[tuple[int, int]]:
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


@msc.algorithm("allreduce", chunk_factor=lambda n, gpus_per_node, trees, btree: gpus_per_node * trees,
               ranks=lambda n, gpus_per_node, trees, btree: gpus_per_node >= 2 and n % gpus_per_node == 0
               and trees >= 1)
def nvls_tree(p: msc.Program, gpus_per_node=8, trees=2, btree=False):
    """NVLS reduce in each node, binary trees across nodes, NVLS multicast.

    Rank = node * g + local (g = gpus_per_node, one NVSwitch domain per
    node); local index l owns chunks l*trees ... l*trees + trees - 1, one
    per tree, and sends them over its own NIC.

    1. In each node, rank l reads the node's sum of its chunks through the
       switch (one reduce-load) into its output.
    2. Across nodes, the ranks of local index l reduce chunk l*trees + k up
       binary tree k of nodes and send the total back down (tree 1 is tree
       0 mirrored, so each node's NIC carries an inner node's load in at
       most one of the two).
    3. In each node, rank l writes its chunks to every rank of its node in
       one multicast store.

    The reduce-loads and the stores run on two switch threadblocks, the
    tree on others: the three phases overlap across tiles, as NCCL's
    NVLSTree pipelines them. With one node it is NVLS with the load and
    the store as two steps. ``btree``: NCCL's double binary tree across the
    nodes instead (as NCCL's NVLSTree connects its heads; an inner node's
    NIC then carries four chunks each way where the heap's carries three).
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    node_ranks = [range(j * g, (j + 1) * g) for j in range(nodes)]
    reducing = [p.switch(ranks, channel=REDUCE_CHANNEL) for ranks in node_ranks]
    storing = [p.switch(ranks, channel=STORE_CHANNEL) for ranks in node_ranks]
    for j in range(nodes):
        for l in range(g):
            reducing[j].reduce(j * g + l, "input", l * trees, trees).to("output", l * trees)
    for k in range(trees):
        edges = node_edges(nodes, k, btree)
        for l in range(g):
            chunk = l * trees + k
            for child, parent in edges:                # leaves first: a child is complete before it is sent
                p.chunk(parent * g + l, "output", chunk).reduce(p.chunk(child * g + l, "output", chunk),
                                                                channel=TREE_CHANNEL + k)
            for child, parent in reversed(edges):      # root first: a parent is final before it is sent
                p.chunk(parent * g + l, "output", chunk).copy(child * g + l, "output", chunk, channel=TREE_CHANNEL + k)
    for j in range(nodes):
        for l in range(g):
            storing[j].store(p.chunk(j * g + l, "output", l * trees, trees))
