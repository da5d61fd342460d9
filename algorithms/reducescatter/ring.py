"""Ring reduce-scatter: each chunk is summed around the ring toward its owner."""
import msc


@msc.algorithm("reducescatter", chunk_factor=1)
def ring(p: msc.Program):
    """Each chunk is summed around the ring toward its owner: n-1 steps.

    Chunk r starts at rank r+1 and travels r+2, ..., r+n-1, each rank
    adding its own input[r], and ends at rank r, which adds the partial sum
    into its output (n-1 steps, one chunk per rank per step).

    The output holds only the rank's own chunk, so partial sums in transit
    live in a scratch buffer: works in place and out of place.
    """
    n = p.num_ranks
    for r in range(n):
        out = p.chunk(r, "input", r).copy(r, "output", 0)
        if n == 1:
            continue
        acc = p.chunk((r + 1) % n, "input", r)
        for k in range(2, n):
            rank = (r + k) % n
            acc = p.chunk(rank, "input", r).copy(rank, "scratch", r).reduce(acc)
        out.reduce(acc)
