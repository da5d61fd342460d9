"""Ring allgather: every rank's chunk travels once around the ring."""
import msc


@msc.algorithm("allgather", chunk_factor=1)
def ring(p: msc.Program):
    """Each chunk travels once around the ring: n-1 steps.

    Rank r puts its input into output[r], which is passed on from rank to
    rank r+1, r+2, ... (n-1 steps, one chunk per rank per step).

    Works in place and out of place (the first copy is a no-op in place).
    """
    n = p.num_ranks
    for r in range(n):
        acc = p.chunk(r, "input", 0).copy(r, "output", r)
        for k in range(1, n):
            acc = acc.copy((r + k) % n, "output", r)
