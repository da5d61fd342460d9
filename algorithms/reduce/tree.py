"""Binomial-tree reduce toward the root, chunked for pipelining."""
import msc


@msc.algorithm("reduce", chunk_factor=lambda n, chunks: chunks)
def tree(p: msc.Program, chunks=4):
    """Binomial tree toward the root: ceil(log2 n) rounds per chunk.

    With v = (rank - root) mod n, the parent of v is v with its lowest set
    bit cleared: in round j (ceil(log2 n) rounds) ranks whose lowest set bit
    is 2^j add their partial sum into their parent. Each of the ``chunks``
    chunks runs the tree on its own.

    Every rank first copies its input to its output (one op; nothing in
    place), so partial sums live in the output: works in both forms.
    """
    n, root = p.num_ranks, p.root
    for r in range(n):
        p.chunk(r, "input", 0, chunks).copy(r, "output", 0)
    children_first = sorted(range(1, n), key=lambda v: v & -v)
    for c in range(chunks):
        for v in children_first:
            p.chunk((root + (v & (v - 1))) % n, "output", c).reduce(p.chunk((root + v) % n, "output", c))
