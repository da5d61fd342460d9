"""Binomial-tree broadcast from the root, chunked for pipelining."""
import msc


@msc.algorithm("broadcast", chunk_factor=lambda n, chunks: chunks)
def binomial_tree(p: msc.Program, chunks=4):
    """Binomial tree from the root: ceil(log2 n) rounds per chunk.

    With v = (rank - root) mod n, the parent of v is v with its lowest set
    bit cleared: in each round (distance d = 2^(ceil(log2 n)-1) down to 1)
    every v that is a multiple of 2d sends to v + d. Each of the ``chunks``
    chunks runs the tree on its own. The root first copies its input to its
    output. Works in both forms.
    """
    n, root = p.num_ranks, p.root
    p.chunk(root, "input", 0, chunks).copy(root, "output", 0)
    parents_first = sorted(range(1, n), key=lambda v: v & -v, reverse=True)
    for c in range(chunks):
        for v in parents_first:
            p.chunk((root + (v & (v - 1))) % n, "output", c).copy((root + v) % n, "output", c)
