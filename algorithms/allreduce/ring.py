"""Ring allreduce: a reduce-scatter around the ring, then an allgather."""
import msc


@msc.algorithm("allreduce", chunk_factor=lambda n: n)
def ring(p: msc.Program):
    """Chunk i is summed around the ring starting at rank i+1, then passed on.

    Works in place and out of place: each rank first copies its input chunk
    to its output (a no-op in place) and reduces the arriving partial sum
    into it, so the input stays untouched out of place.
    """
    n = p.num_ranks
    if n == 1:  # nothing to reduce; out of place the output still needs the input
        p.chunk(0, "input", 0).copy(0, "output", 0)
        return
    for i in range(n):
        acc = p.chunk((i + 1) % n, "input", i)
        for k in range(2, n + 1):
            rank = (i + k) % n
            acc = p.chunk(rank, "input", i).copy(rank, "output", i).reduce(acc)
        for k in range(1, n):
            acc = acc.copy((i + k) % n, "output", i)
