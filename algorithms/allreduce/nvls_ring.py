"""NVLS inside each node, rings of nodes across (each NIC carries 2(N-1)/N of its shard)."""
import msc
from msc.dsl.nvls import node_switches, reduce_in_nodes, store_in_nodes


def ring_order(nodes: int, ring: int) -> list[int]:
    """The nodes in the order ring ``ring`` visits them: ring 0 goes 0, 1,
    ..., ring 1 the other way, so each NIC sends and receives on both."""
    order = list(range(nodes))
    return order if ring % 2 == 0 else order[::-1]


def ring_allreduce(p: msc.Program, ranks: list[int], first_chunk: int, channel: int) -> None:
    """Allreduce ``output[first_chunk : first_chunk + len(ranks)]`` in place
    over the ring ``ranks`` (in visiting order): piece i is summed around
    the ring from position i + 1 to position i, then passed on around it.
    Each ring has a channel of its own: with two nodes both rings join the
    same two ranks, and on one connection they would need 4 slots, not 2."""
    m = len(ranks)
    for i in range(m):
        chunk = first_chunk + i
        acc = p.chunk(ranks[(i + 1) % m], "output", chunk)
        for step in range(2, m + 1):
            acc = p.chunk(ranks[(i + step) % m], "output", chunk).reduce(acc, channel=channel)
        for step in range(1, m):
            acc = acc.copy(ranks[(i + step) % m], "output", chunk, channel=channel)


@msc.algorithm("allreduce", chunk_factor=lambda n, gpus_per_node, rings: n * rings,
               ranks=lambda n, gpus_per_node, rings: gpus_per_node >= 2 and n % gpus_per_node == 0 and rings >= 1)
def nvls_ring(p: msc.Program, gpus_per_node=8, rings=2):
    """NVLS reduce in each node, rings of nodes across, NVLS multicast.

    Rank = node * g + local (g = gpus_per_node, one NVSwitch domain per
    node, N nodes); local index l owns shard l, chunks l*S ... l*S + S - 1
    (S = rings * N: one piece per ring and node), and sends it over its own
    NIC.

    1. In each node, rank l reads the node's sum of its shard through the
       switch (one reduce-load) into its output.
    2. Across nodes, the ranks of local index l allreduce the shard with
       ``rings`` rings of nodes (a reduce-scatter, then an allgather; ring
       1 runs the other way round), so each NIC carries 2(N-1)/N of the
       shard each way, where a tree's inner nodes carry it three times.
    3. In each node, rank l writes its shard to every rank of its node in
       one multicast store.

    The reduce-loads and the stores run on two switch threadblocks, each
    ring on others: the three phases overlap across tiles. With one node
    it is NVLS with the load and the store as two steps.
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    shard = rings * nodes
    reducing, storing = node_switches(p, g)
    reduce_in_nodes(reducing, g, shard)
    if nodes > 1:
        for k in range(rings):
            for l in range(g):
                ring_allreduce(p, [j * g + l for j in ring_order(nodes, k)], l * shard + k * nodes, k)
    store_in_nodes(p, storing, g, shard)
