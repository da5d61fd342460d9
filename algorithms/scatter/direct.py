"""Direct scatter: the root sends each rank its unit."""
import msc


@msc.algorithm("scatter", chunk_factor=lambda n, chunks: chunks)
def direct(p: msc.Program, chunks=1):
    """The root sends each rank its unit, in one step.

    Unit r of the root's input (``chunks`` pieces) goes to rank r's output
    (the root's own is a local copy, a no-op in place): what nccl-tests'
    scatter runs (n sends from the root, a receive at each rank). Works in
    both forms.
    """
    n, root = p.num_ranks, p.root
    for r in range(n):
        p.chunk(root, "input", r * chunks, chunks).copy(r, "output", 0)
