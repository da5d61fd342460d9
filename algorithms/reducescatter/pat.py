"""NCCL's PAT reduce-scatter (Parallel Aggregated Trees, NCCL 2.23+): log2 n
steps, the nearest peer first with half of the data, the far ones last with
little (rank arithmetic: msc.dsl.pat)."""
import msc
from msc.dsl import pat as pat_ranks


@msc.algorithm("reducescatter", chunk_factor=1,
               ranks=lambda n, gpus_per_node: gpus_per_node >= 1 and n % gpus_per_node == 0)
def pat(p: msc.Program, gpus_per_node=1):
    """Reversed-dimension Bruck reduce-scatter across nodes, as NCCL's PAT runs it.

    With one GPU per node (NCCL's case): rank r keeps its partial sum of
    rank r + s's block at position bit_reversed(s) of its scratch,
    starting from its input. At dimension d = 0 .. D-1 (2^D >= n) it sends
    rank r + 2^d, in one message (one contiguous range, msc.dsl.pat), the
    partial sums of the blocks whose offset s has d as its lowest set bit,
    complete by then; rank r + 2^d adds them to its own at offsets s - 2^d.
    After the D steps position 0 holds the sum of rank r's block. Each
    rank sends n - 1 blocks in ceil(log2 n) steps: the transpose of
    allgather/pat's trees.

    With ``gpus_per_node`` g > 1 (rank = node * g + local), each GPU first
    stages the blocks of every other local index l in that one's order and
    sends them to it in one message, which adds them to its own: then the
    GPUs of local index l run the same across the nodes (their own NICs).

    NCCL: src/include/collectives.h (PatRSAlgorithm), src/device/
    reduce_scatter.h (RunWorkColl for NCCL_ALGO_PAT), src/device/
    prims_simple.h (peers r +- 2^d). Works in place and out of place.
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    D = pat_ranks.dimensions(nodes)
    span = 1 << D
    for r in range(n):
        node, local = divmod(r, g)
        for other in range(g):
            region = local if other == local else g + other       # staging for another local index
            for s in range(nodes):
                block = ((node + s) % nodes) * g + other
                p.chunk(r, "input", block).copy(r, "scratch", region * span + pat_ranks.bit_reversed(s, D))
    for r, peer, other in pat_ranks.node_peers(n, g):  # another local index's blocks to their GPU
        for pos, length in pat_ranks.region(nodes):
            p.chunk(peer, "scratch", other * span + pos, length).reduce(
                p.chunk(r, "scratch", (g + other) * span + pos, length))
    for d in range(D):
        offsets, shift = pat_ranks.reduce_step(nodes, d)
        for r in range(n):
            node, local = divmod(r, g)
            dst = ((node + (1 << d)) % nodes) * g + local
            base = local * span
            for pos, length in pat_ranks.runs(offsets, D):
                p.chunk(dst, "scratch", base + pos - shift, length).reduce(p.chunk(r, "scratch", base + pos, length))
    for r in range(n):
        local = r % g
        p.chunk(r, "scratch", local * span).copy(r, "output", 0)
