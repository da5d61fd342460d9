"""Direct gather: every rank sends its input straight to the root."""
import msc


@msc.algorithm("gather", chunk_factor=lambda n, chunks: chunks)
def direct(p: msc.Program, chunks=1):
    """Every rank sends its input to the root, in one step.

    Rank r's ``chunks`` pieces go to unit r of the root's output (the
    root's own is a local copy, a no-op in place): what nccl-tests' gather
    runs (a send to the root, n receives there). Works in both forms.
    """
    n, root = p.num_ranks, p.root
    for r in range(n):
        p.chunk(r, "input", 0, chunks).copy(root, "output", r * chunks)
