"""All-pairs allgather: every rank sends its chunk straight to every rank."""
import msc


@msc.algorithm("allgather", chunk_factor=1)
def allpairs(p: msc.Program):
    """Each rank sends its chunk to every rank in one step.

    Rank r copies its input to output[r] of every rank (itself
    included; that copy is a no-op in place). Works in both forms.
    """
    n = p.num_ranks
    for r in range(n):
        for dst in range(n):
            p.chunk(r, "input", 0).copy(dst, "output", r)
