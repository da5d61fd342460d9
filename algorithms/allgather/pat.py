"""NCCL's PAT allgather (Parallel Aggregated Trees, NCCL 2.23+): log2 n
steps, the far peers first with little data, the nearest last with half of
it (rank arithmetic: msc.dsl.pat)."""
import msc
from msc.dsl import pat as pat_ranks


@msc.algorithm("allgather", chunk_factor=1,
               ranks=lambda n, gpus_per_node: gpus_per_node >= 1 and n % gpus_per_node == 0)
def pat(p: msc.Program, gpus_per_node=1):
    """Reversed-dimension Bruck allgather across nodes, as NCCL's PAT runs it.

    With one GPU per node (NCCL's case): at dimension d = D-1 .. 0 (2^D >=
    n) rank r sends rank r - 2^d, in one message, the blocks of ranks r + s
    it holds (s a multiple of 2^(d+1), s + 2^d < n); rank r keeps rank r +
    s's block at position bit_reversed(s) of its scratch, so that message is
    one contiguous range (msc.dsl.pat). After the D steps it copies the
    blocks to their places in its output. Each rank sends n - 1 blocks in
    ceil(log2 n) steps, a ring's data in a log of its steps.

    With ``gpus_per_node`` g > 1 (rank = node * g + local), the GPUs of
    local index l run the same across the nodes (their own NICs), each on
    its own scratch region, and then send their region to the node's other
    GPUs, which copy every region out.

    NCCL: src/include/collectives.h (PatAGAlgorithm: the steps and their
    aggregation into NCCL's buffers), src/device/all_gather.h (RunWorkColl
    for NCCL_ALGO_PAT), src/device/prims_simple.h (peers r +- 2^d). Works
    in place and out of place.
    """
    n, g = p.num_ranks, gpus_per_node
    nodes = n // g
    D = pat_ranks.dimensions(nodes)
    span = 1 << D                                   # a region's positions (holes past the node count)
    for r in range(n if n > 1 else 0):               # one rank: its output is its input
        node, local = divmod(r, g)
        p.chunk(r, "input", 0).copy(r, "scratch", local * span)
    for d in reversed(range(D)):
        offsets, shift = pat_ranks.gather_step(nodes, d)
        for r in range(n):
            node, local = divmod(r, g)
            dst = ((node - (1 << d)) % nodes) * g + local
            base = local * span
            for pos, length in pat_ranks.runs(offsets, D):
                p.chunk(r, "scratch", base + pos, length).copy(dst, "scratch", base + pos + shift)
    for r, peer, _ in pat_ranks.node_peers(n, g):    # a rail's blocks to the node's other GPUs
        base = r % g * span
        for pos, length in pat_ranks.region(nodes):
            p.chunk(r, "scratch", base + pos, length).copy(peer, "scratch", base + pos)
    for r in range(n):
        node = r // g
        p.chunk(r, "input", 0).copy(r, "output", r)         # a no-op in place
        for local in range(g):
            for s in range(nodes):
                block = ((node + s) % nodes) * g + local
                if block != r:
                    p.chunk(r, "scratch", local * span + pat_ranks.bit_reversed(s, D)).copy(r, "output", block)
