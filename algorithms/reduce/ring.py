"""Chain reduce toward the root, chunked for pipelining."""
import msc


@msc.algorithm("reduce", chunk_factor=lambda n, chunks: chunks)
def ring(p: msc.Program, chunks=4):
    """Pipelined chain toward the root: n-1 hops per chunk.

    Each of the ``chunks`` chunks is summed along root+1 -> root+2 -> ...
    -> root+n-1 -> root (n-1 hops), each rank adding its own part.

    Every rank first copies its input to its output (one op; nothing in
    place), so partial sums live in the output: works in both forms.
    """
    n, root = p.num_ranks, p.root
    for r in range(n):
        p.chunk(r, "input", 0, chunks).copy(r, "output", 0)
    for c in range(chunks):
        for k in range(1, n):
            p.chunk((root + k + 1) % n, "output", c).reduce(p.chunk((root + k) % n, "output", c))
