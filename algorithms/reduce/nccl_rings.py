"""NCCL-grade reduce: chains toward the root along several rail-aligned
rings at once, each summing a share of the data on a channel of its own
(rank orders: msc.dsl.nccl_orders)."""
import msc
from msc.dsl import nccl_orders


@msc.algorithm("reduce", chunk_factor=lambda n, rings, chunks: rings * chunks,
               ranks=lambda n, rings, gpus_per_node, chunks:
                   rings >= 1 and chunks >= 1 and gpus_per_node >= 1 and n % gpus_per_node == 0)
def rail_rings(p: msc.Program, rings=8, gpus_per_node=8, chunks=1):
    """Chains toward the root along rail-aligned rings, one per channel, as NCCL reduces.

    Ranks are nodes of ``gpus_per_node`` GPUs (rank = node * g + local),
    each GPU with its own NIC. The data is cut into ``rings`` shares of
    ``chunks`` chunks; share c is summed along ring c
    (nccl_orders.rail_rings) from the rank after the root around to the
    root (n-1 hops, channel c), each rank adding its own. The rings cross
    between nodes on different rails, so with rings = g the shares use all
    g NICs of each node where reduce/ring uses one.

    NCCL: its reduce runs the ring of each channel as a chain ending at the
    root (src/device/reduce.h); the rings are search.cc's, one per channel
    and NIC. As there, the chain's first rank sends from its input and each
    next one adds what it receives to its own input on the way into its
    output, chunk by chunk on the chunk's channel (no rank copies its whole
    input first, which would hold every channel's next tile behind the
    first channel's): works in both forms.
    """
    n, root = p.num_ranks, p.root
    for c, order in enumerate(nccl_orders.rail_rings(n, gpus_per_node, rings)):
        start = order.index(root) + 1
        chain = order[start:] + order[:start]          # ends at the root
        for k in range(chunks):
            index = c * chunks + k
            if n == 1:          # nothing to reduce; out of place the output still needs the input
                p.chunk(root, "input", index).copy(root, "output", index)
                continue
            partial = p.chunk(chain[0], "input", index)
            for hop in range(1, n):
                rank = chain[hop]
                partial = p.chunk(rank, "input", index).copy(rank, "output", index).reduce(partial, channel=c)
