"""Recursive halving-doubling (Rabenseifner) allreduce, for any rank count."""
import msc


def _core(n: int) -> int:
    """The largest power of two <= n: the ranks that run halving-doubling."""
    return 1 << (n.bit_length() - 1)


@msc.algorithm("allreduce", chunk_factor=_core)
def halving_doubling(p: msc.Program):
    """Reduce-scatter by recursive halving, then allgather by recursive doubling.

    With m = 2^floor(log2 n) core ranks and m chunks: (fold) each extra rank
    m+i adds its whole buffer into rank i; (halving, log2 m rounds, distance
    d = m/2 .. 1) rank r keeps the block of d chunks at r//d*d and adds the
    partner r^d's copy of it, ending with chunk r fully reduced; (doubling,
    log2 m rounds, d = 1 .. m/2) rank r sends its reduced block of d chunks to
    r^d; (unfold) rank i sends the result back to rank m+i. Every round moves
    one op per rank, of d chunks. Works in place and out of place: all
    partial sums live in the output.
    """
    n = p.num_ranks
    m = _core(n)
    for r in range(m):
        p.chunk(r, "input", 0, m).copy(r, "output", 0)
    for r in range(m, n):
        p.chunk(r - m, "output", 0, m).reduce(p.chunk(r, "input", 0, m))
    d = m // 2
    while d:
        for r in range(m):
            block = r // d * d
            p.chunk(r, "output", block, d).reduce(p.chunk(r ^ d, "output", block, d))
        d //= 2
    d = 1
    while d < m:
        for r in range(m):
            block = r // d * d
            p.chunk(r, "output", block, d).copy(r ^ d, "output", block)
        d *= 2
    for r in range(m, n):
        p.chunk(r - m, "output", 0, m).copy(r, "output", 0)
