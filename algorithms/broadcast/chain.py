"""Pipelined chain broadcast: chunks flow from the root through every rank."""
import msc


@msc.algorithm("broadcast", chunk_factor=lambda n, chunks: chunks)
def chain(p: msc.Program, chunks=4):
    """Pipelined chain from the root through all ranks.

    The root copies its input to its output, then each of the ``chunks``
    chunks hops root -> root+1 -> ... -> root+n-1 (n-1 hops), so with
    pipelining the chain is busy after n-1 steps and finishes after
    n-2+chunks. Works in place and out of place.
    """
    n, root = p.num_ranks, p.root
    p.chunk(root, "input", 0, chunks).copy(root, "output", 0)
    for c in range(chunks):
        for k in range(1, n):
            p.chunk((root + k - 1) % n, "output", c).copy((root + k) % n, "output", c)
