"""NCCL-grade broadcast: chains from the root along several rail-aligned
rings at once, each carrying a share of the data on a channel of its own
(rank orders: msc.dsl.nccl_orders)."""
import msc
from msc.dsl import nccl_orders


@msc.algorithm("broadcast", chunk_factor=lambda n, rings, chunks: rings * chunks,
               ranks=lambda n, rings, gpus_per_node, chunks:
                   rings >= 1 and chunks >= 1 and gpus_per_node >= 1 and n % gpus_per_node == 0)
def rail_rings(p: msc.Program, rings=8, gpus_per_node=8, chunks=1):
    """Chains from the root along rail-aligned rings, one per channel, as NCCL broadcasts.

    Ranks are nodes of ``gpus_per_node`` GPUs (rank = node * g + local),
    each GPU with its own NIC. The root's data is cut into ``rings`` shares
    of ``chunks`` chunks; share c follows ring c (nccl_orders.rail_rings)
    from the root through every other rank (n-1 hops, channel c). The rings
    cross between nodes on different rails, so with rings = g the shares
    leave each node through all g NICs where broadcast/chain uses one.

    NCCL: its broadcast runs the ring of each channel as a chain from the
    root (src/device/broadcast.h); the rings are search.cc's, one per
    channel and NIC. As there, the root sends each chunk from its input
    (and copies it to its own output) on the chunk's channel, so no
    channel waits for a copy of the whole buffer. Works in place and out of
    place.
    """
    n, root = p.num_ranks, p.root
    for c, order in enumerate(nccl_orders.rail_rings(n, gpus_per_node, rings)):
        start = order.index(root)
        chain = order[start:] + order[:start]
        for k in range(chunks):
            index = c * chunks + k
            p.chunk(root, "input", index).copy(root, "output", index)
            for hop in range(1, n):
                src = p.chunk(chain[hop - 1], "input" if hop == 1 else "output", index)
                src.copy(chain[hop], "output", index, channel=c)
