"""Ring allreduce: a reduce-scatter around the ring, then an allgather."""
import msc


@msc.algorithm("allreduce", chunk_factor=lambda n: n)
def ring(p: msc.Program):
    """Chunk i is summed around the ring starting at rank i+1, then passed on."""
    n = p.num_ranks
    for i in range(n):
        acc = p.chunk((i + 1) % n, "input", i)
        for k in range(2, n + 1):
            acc = p.chunk((i + k) % n, "input", i).reduce(acc)
        for k in range(1, n):
            acc = acc.copy((i + k) % n, "input", i)
