"""NCCL's tree allreduce across nodes: a double binary tree over the nodes
with a chain through the GPUs of each node (rank orders:
msc.dsl.nccl_orders)."""
import msc
from msc.dsl import nccl_orders


@msc.algorithm("allreduce", chunk_factor=lambda n, channels, chunks: 2 * channels * chunks,
               ranks=lambda n, gpus_per_node, channels, chunks:
                   gpus_per_node >= 1 and n % gpus_per_node == 0 and channels >= 1 and chunks >= 1)
def nccl_tree(p: msc.Program, gpus_per_node=8, channels=8, chunks=2):
    """Double binary tree over nodes, a chain inside each node, pipelined in chunks.

    Ranks are nodes of ``gpus_per_node`` GPUs (rank = node * g + local).
    Channel c's head in every node is local GPU c mod g; the node's GPUs
    form a chain from the head (head, head+1, .., mod g), and the heads are
    joined by a binary tree over the nodes: tree 0 (leaves: the odd nodes)
    on channel c, tree 1 (its mirror, or its shift for an odd node count)
    on channel channels + c, so every node is interior in at most one tree
    (node 0 in both for an odd node count) and each tree carries half of
    the data. Each of the 2 * ``channels``
    trees takes ``chunks`` chunks; each chunk is summed up the chains and
    the tree to the root node's head (children before parents) and sent
    back down the same way. With channels = g every NIC carries one
    channel's tree traffic.

    NCCL: src/graph/trees.cc (ncclGetBtree, ncclGetDtree: the two trees
    over nodes), src/graph/connect.cc (connectTrees: channel c on tree 0
    and channel c + nChannels on tree 1, both through the channel's head;
    ncclTopoPreset: the chain treeIntra[0] -> treeIntra[1] -> .. inside
    the node), src/graph/search.cc (the tree pattern "NET n -> GPU a -> GPU
    b -> .. -> GPU x", each channel on another NIC). As NCCL's kernel does
    (src/device/all_reduce.h, runTreeSplit), a leaf sends from its input
    and a parent adds what it receives to its own input on the way into
    its output, chunk by chunk on the chunk's channel: no rank copies its
    whole input first, so a channel's chunks pipeline up the tree while
    earlier ones come down. Works in place and out of place.
    """
    n, g = p.num_ranks, gpus_per_node
    trees = [(c, t, nccl_orders.node_tree(n, g, c % g, t)) for t in (0, 1) for c in range(channels)]
    for k in range(chunks):
        for c, t, edges in trees:
            channel = t * channels + c
            index = channel * chunks + k
            if not edges:            # one rank: nothing to reduce; out of place the output still needs the input
                p.chunk(0, "input", index).copy(0, "output", index)
                continue
            partial = {}             # rank -> its partial sum of the chunk so far (in its output)
            for child, parent in edges:
                sent = partial[child] if child in partial else p.chunk(child, "input", index)
                mine = (partial[parent] if parent in partial
                        else p.chunk(parent, "input", index).copy(parent, "output", index))
                partial[parent] = mine.reduce(sent, channel=channel)
            for child, parent in reversed(edges):
                p.chunk(parent, "output", index).copy(child, "output", index, channel=channel)
