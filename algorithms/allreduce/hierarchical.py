"""Hierarchical allreduce: inside the node, across nodes, inside the node again."""
import msc


@msc.algorithm("allreduce", chunk_factor=lambda n: n,
               ranks=lambda n, gpus_per_node: gpus_per_node >= 1 and n % gpus_per_node == 0)
def hierarchical(p: msc.Program, gpus_per_node=4):
    """Intra-node reduce-scatter, inter-node ring allreduce, intra-node allgather.

    Rank = node * g + local (g = gpus_per_node); local index l owns shard l,
    the ``nodes`` chunks from l * nodes.

    1. Intra-node all-pairs reduce-scatter: each rank adds shard l of its
       g-1 node peers into its output (one op of ``nodes`` chunks per peer).
    2. Inter-node ring allreduce of shard l among the ranks with local index
       l: 2 * (nodes - 1) steps of one chunk.
    3. Intra-node allgather: each rank copies its shard to its g-1 peers.

    Works in place and out of place: step 1 writes only the rank's own
    shard, which its peers do not read.
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    for a in range(nodes):
        for l in range(g):
            shard = p.chunk(a * g + l, "input", l * nodes, nodes).copy(a * g + l, "output", l * nodes)
            for peer in range(g):
                if peer != l:
                    shard.reduce(p.chunk(a * g + peer, "input", l * nodes, nodes))
    for l in range(g):
        for i in range(nodes):
            index = l * nodes + i
            acc = p.chunk((i + 1) % nodes * g + l, "output", index)
            for k in range(2, nodes + 1):
                acc = p.chunk((i + k) % nodes * g + l, "output", index).reduce(acc)
            for k in range(1, nodes):
                acc = acc.copy((i + k) % nodes * g + l, "output", index)
    for a in range(nodes):
        for l in range(g):
            for peer in range(g):
                if peer != l:
                    p.chunk(a * g + l, "output", l * nodes, nodes).copy(a * g + peer, "output", l * nodes)
