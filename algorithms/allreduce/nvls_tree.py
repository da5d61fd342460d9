"""NVLS inside each node, a tree across nodes (after NCCL's NVLSTree)."""
import msc


def _parent(node: int) -> int:
    return (node - 1) // 2


@msc.algorithm("allreduce", chunk_factor=lambda n, gpus_per_node: gpus_per_node,
               ranks=lambda n, gpus_per_node: gpus_per_node >= 2 and n % gpus_per_node == 0)
def nvls_tree(p: msc.Program, gpus_per_node=8):
    """NVLS reduce in each node, a binary tree across nodes, NVLS multicast.

    Rank = node * g + local (g = gpus_per_node, one NVSwitch domain per
    node); local index l owns chunk l.

    1. In each node, rank l reads the node's sum of chunk l through the
       switch (one reduce-load) into its output.
    2. Across nodes, the ranks of local index l reduce their chunk up a
       binary tree of nodes (node j's parent is (j - 1) // 2) and send the
       total back down.
    3. In each node, rank l writes chunk l to every rank of its node in one
       multicast store.

    With one node it is NVLS with the load and the store as two steps.
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    groups = [p.switch(range(j * g, (j + 1) * g)) for j in range(nodes)]
    for j in range(nodes):
        for l in range(g):
            groups[j].reduce(j * g + l, "input", l).to("output", l)
    for l in range(g):
        for j in reversed(range(1, nodes)):       # leaves first: a child is complete before it is sent
            p.chunk(_parent(j) * g + l, "output", l).reduce(p.chunk(j * g + l, "output", l))
        for j in range(1, nodes):                 # root first: a parent is final before it is sent
            p.chunk(_parent(j) * g + l, "output", l).copy(j * g + l, "output", l)
    for j in range(nodes):
        for l in range(g):
            groups[j].store(p.chunk(j * g + l, "output", l))
