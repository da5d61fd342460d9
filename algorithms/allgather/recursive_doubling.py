"""Recursive-doubling allgather, for powers of two."""
import msc


@msc.algorithm("allgather", chunk_factor=1, ranks=lambda n: n & (n - 1) == 0)
def recursive_doubling(p: msc.Program):
    """Recursive doubling: log2 n rounds, each doubling the gathered block.

    In round j (distance d = 2^j, log2 n rounds) rank r sends the d chunks
    it has gathered so far (output[r//d*d : r//d*d + d]) to rank r^d, as one
    op. Needs a power-of-two rank count.

    Works in place and out of place (the first copy is a no-op in place).
    """
    n = p.num_ranks
    for r in range(n):
        p.chunk(r, "input", 0).copy(r, "output", r)
    d = 1
    while d < n:
        for r in range(n):
            block = r // d * d
            p.chunk(r, "output", block, d).copy(r ^ d, "output", block)
        d *= 2
