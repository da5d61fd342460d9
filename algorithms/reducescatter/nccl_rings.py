"""NCCL-grade ring reduce-scatters: several rings at once, each summing a
share of every chunk on a channel of its own, laid out as NCCL lays them on
the machine (rank orders: msc.dsl.nccl_orders)."""
import msc
from msc.dsl import nccl_orders


def _ring_reducescatters(p: msc.Program, orders: list[list[int]], slices: int = 1) -> None:
    """Ring c sums pieces c*slices .. c*slices+slices-1 of every rank's chunk
    around ``orders[c]`` on channel c, the slices one after the other at
    every step (as NCCL sends a chunk in slices).

    Rank r's result piece j is input chunk r * width + j of every rank
    (width: pieces per rank): it starts at the rank after r on the ring,
    each rank adds its own, and r adds the arriving sum into its output
    chunk j. Partial sums in transit live in scratch, so the input is
    read-only and in place works too.
    """
    width = len(orders) * slices
    for c, order in enumerate(orders):
        n = len(order)
        for i, r in enumerate(order):
            mine = [c * slices + s for s in range(slices)]
            outs = [p.chunk(r, "input", r * width + j).copy(r, "output", j) for j in mine]
            if n == 1:
                continue
            accs = [p.chunk(order[(i + 1) % n], "input", r * width + j) for j in mine]
            for k in range(2, n):
                rank = order[(i + k) % n]
                accs = [p.chunk(rank, "input", r * width + j).copy(rank, "scratch", r * width + j).reduce(a, channel=c)
                        for j, a in zip(mine, accs)]
            for out, a in zip(outs, accs):
                out.reduce(a, channel=c)


@msc.algorithm("reducescatter", chunk_factor=lambda n, rings, slices: rings * slices,
               ranks=lambda n, rings, gpus_per_node, slices: rings >= 1 and gpus_per_node >= 1 and slices >= 1
               and n % gpus_per_node == 0)
def rail_rings(p: msc.Program, rings=8, gpus_per_node=8, slices=1):
    """Rail-aligned rings across nodes, one per channel, as NCCL runs on DGX-class machines.

    Ranks are nodes of ``gpus_per_node`` GPUs (rank = node * g + local),
    each GPU with its own NIC. Every rank's result is cut into ``rings``
    pieces and piece c is summed around ring c (n-1 steps, channel c). Ring
    c visits the nodes in order and leaves each node through the NIC of a
    different local GPU than the other rings (local c+1 or c, alternating
    node by node: nccl_orders.rail_rings), entering the next node on the
    same rail: with rings = g every NIC carries one ring each way, where
    a single ring (reducescatter/ring) is held to one NIC. On one node the
    rings are the node's ring, each on its own channel.

    NCCL: src/graph/search.cc builds one ring per channel, "NET n -> GPU a
    -> .. -> GPU x -> NET n", each channel on another NIC and rail
    (crossNic 0); connect.cc joins the nodes' rings in node order. NCCL's
    last GPU reaches NIC n over PXN or PCIe; in msc's model a GPU sends
    only through its own NIC, so a ring leaves from the GPU whose NIC it
    uses. ``slices``: each ring's chunk is cut in that many pieces sent one
    after the other at every step, as NCCL sends a Simple chunk in two
    slices (msc simulate --nccl uses 2). Works in place and out of place.
    """
    _ring_reducescatters(p, nccl_orders.rail_rings(p.num_ranks, gpus_per_node, rings), slices)


@msc.algorithm("reducescatter", chunk_factor=2)
def bidir_rings(p: msc.Program):
    """Two rings in opposite directions, each summing half of every chunk.

    Ring 0 runs 0 -> 1 -> .. -> n-1 -> 0 on channel 0, ring 1 the other
    way on channel 1: on a bidirectional ring fabric (ring:N) both
    directions of every link carry data, where reducescatter/ring uses one.
    NCCL's ring search (src/graph/search.cc) takes each channel's bandwidth
    off the links its ring uses and tries a GPU's next neighbour, then its
    previous one, so on point-to-point links its later channels run the
    other way. Works in place and out of place.
    """
    _ring_reducescatters(p, nccl_orders.bidirectional_rings(p.num_ranks))


@msc.algorithm("reducescatter", chunk_factor=4, ranks=lambda n, rows: nccl_orders.torus_grid(n, rows) is not None)
def torus_rings(p: msc.Program, rows=None):
    """Four Hamiltonian rings of a 2D torus, every directed link in exactly one.

    Ranks form a ``rows`` x cols torus (rank = row * cols + col, rows and
    cols >= 3; rows default: the largest divisor of n <= sqrt(n), the grid
    ``--topology torus`` makes). Two edge-disjoint Hamiltonian cycles of
    the torus (nccl_orders.torus_rings), each walked both ways, make four
    rings; ring c sums piece c of every chunk on channel c, so each of a
    rank's four links carries a quarter of the data each way. NCCL's search
    finds rings one link bandwidth at a time (search.cc); these four are
    constructed. Works in place and out of place.
    """
    _ring_reducescatters(p, nccl_orders.torus_rings(*nccl_orders.torus_grid(p.num_ranks, rows)))
