"""Two-step all-to-all: gather by local index inside the node, then cross nodes."""
import msc


@msc.algorithm("alltoall", chunk_factor=1,
               ranks=lambda n, gpus_per_node: gpus_per_node >= 1 and n % gpus_per_node == 0)
def hierarchical(p: msc.Program, gpus_per_node=4):
    """Two steps: aggregate by local index inside the node, then cross nodes.

    Rank = node * g + local (g = gpus_per_node).

    1. Inside each node, rank (a, l) sends rank (a, m) every chunk destined
       for a rank (b, m); it lands in scratch[b*g + l] (one chunk per op).
    2. Across nodes, rank (a, m) sends rank (b, m) the g chunks
       scratch[b*g : b*g+g] (one op), which land in output[a*g : a*g+g].

    Works in place and out of place: step 1 reads every input before step
    2 writes any output.
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    for a in range(nodes):
        for l in range(g):
            for m in range(g):
                for b in range(nodes):
                    p.chunk(a * g + l, "input", b * g + m).copy(a * g + m, "scratch", b * g + l)
    for a in range(nodes):
        for m in range(g):
            for b in range(nodes):
                p.chunk(a * g + m, "scratch", b * g, g).copy(b * g + m, "output", a * g)
