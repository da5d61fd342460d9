"""NCCL-grade ring allreduces: several rings at once, each reducing and
then gathering a share of the buffer on a channel of its own, laid out as
NCCL lays them on the machine (rank orders: msc.dsl.nccl_orders)."""
import msc
from msc.dsl import nccl_orders


def _ring_allreduces(p: msc.Program, orders: list[list[int]], slices: int = 1) -> None:
    """Ring c allreduces chunks c*n*slices .. (c+1)*n*slices-1 around ``orders[c]`` on channel c.

    Chunk (c*n+i)*slices+s is summed from the rank after order[i] around to
    order[i] (each rank copies its input chunk to its output and adds the
    arriving sum there), then passed on to every other rank: the ring
    allreduce of allreduce/ring, along the given order, the ``slices`` of a
    chunk one after the other at every step (as NCCL sends a chunk in
    slices). Works in place and out of place.
    """
    for c, order in enumerate(orders):
        n = len(order)
        for i in range(n):
            mine = [(c * n + i) * slices + s for s in range(slices)]
            if n == 1:       # nothing to reduce; out of place the output still needs the input
                for j in mine:
                    p.chunk(order[0], "input", j).copy(order[0], "output", j)
                continue
            accs = [p.chunk(order[(i + 1) % n], "input", j) for j in mine]
            for k in range(2, n + 1):
                rank = order[(i + k) % n]
                accs = [p.chunk(rank, "input", j).copy(rank, "output", j).reduce(a, channel=c)
                        for j, a in zip(mine, accs)]
            for k in range(1, n):
                accs = [a.copy(order[(i + k) % n], "output", j, channel=c) for j, a in zip(mine, accs)]


@msc.algorithm("allreduce", chunk_factor=lambda n, rings, slices: rings * n * slices,
               ranks=lambda n, rings, gpus_per_node, slices: rings >= 1 and gpus_per_node >= 1 and slices >= 1
               and n % gpus_per_node == 0)
def rail_rings(p: msc.Program, rings=8, gpus_per_node=8, slices=1):
    """Rail-aligned rings across nodes, one per channel, as NCCL runs on DGX-class machines.

    Ranks are nodes of ``gpus_per_node`` GPUs (rank = node * g + local),
    each GPU with its own NIC. The buffer is cut into ``rings`` shares and
    ring c runs a ring allreduce (reduce-scatter then allgather, 2(n-1)
    steps) of share c on channel c. Ring c visits the nodes in order and
    leaves each node through the NIC of a different local GPU than the
    other rings (local c+1 or c, alternating node by node:
    nccl_orders.rail_rings), entering the next node on the same rail: with
    rings = g every NIC carries one ring each way, where a single ring
    (allreduce/ring) is held to one NIC. On one node the rings are the
    node's ring, each on its own channel.

    NCCL: src/graph/search.cc builds one ring per channel, "NET n -> GPU a
    -> .. -> GPU x -> NET n", each channel on another NIC and rail
    (crossNic 0); connect.cc joins the nodes' rings in node order. NCCL's
    last GPU reaches NIC n over PXN or PCIe; in msc's model a GPU sends
    only through its own NIC, so a ring leaves from the GPU whose NIC it
    uses. ``slices``: each ring's chunk is cut in that many pieces sent one
    after the other at every step, as NCCL sends a Simple chunk in two
    slices (msc simulate --nccl uses 2).
    """
    _ring_allreduces(p, nccl_orders.rail_rings(p.num_ranks, gpus_per_node, rings), slices)


@msc.algorithm("allreduce", chunk_factor=lambda n: 2 * n)
def bidir_rings(p: msc.Program):
    """Two rings in opposite directions, each allreducing half of the buffer.

    Ring 0 runs 0 -> 1 -> .. -> n-1 -> 0 on channel 0, ring 1 the other
    way on channel 1: on a bidirectional ring fabric (ring:N) both
    directions of every link carry data, where allreduce/ring uses one.
    NCCL's ring search (src/graph/search.cc) takes each channel's bandwidth
    off the links its ring uses and tries a GPU's next neighbour, then its
    previous one, so on point-to-point links its later channels run the
    other way.
    """
    _ring_allreduces(p, nccl_orders.bidirectional_rings(p.num_ranks))


@msc.algorithm("allreduce", chunk_factor=lambda n: 4 * n,
               ranks=lambda n, rows: nccl_orders.torus_grid(n, rows) is not None)
def torus_rings(p: msc.Program, rows=None):
    """Four Hamiltonian rings of a 2D torus, every directed link in exactly one.

    Ranks form a ``rows`` x cols torus (rank = row * cols + col, rows and
    cols >= 3; rows default: the largest divisor of n <= sqrt(n), the grid
    ``--topology torus`` makes). Two edge-disjoint Hamiltonian cycles of
    the torus (nccl_orders.torus_rings), each walked both ways, make four
    rings; ring c allreduces a quarter of the buffer on channel c, so each
    of a rank's four links carries a quarter of the data each way. NCCL's
    search finds rings one link bandwidth at a time (search.cc); these four
    are constructed.
    """
    _ring_allreduces(p, nccl_orders.torus_rings(*nccl_orders.torus_grid(p.num_ranks, rows)))
