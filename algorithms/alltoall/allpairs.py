"""All-pairs all-to-all: every rank sends each peer its chunk directly."""
import msc


@msc.algorithm("alltoall", chunk_factor=1)
def allpairs(p: msc.Program):
    """Each rank sends every peer its chunk directly, in one step.

    Rank r sends input[j] to rank j, landing at index r.

    Out of place the chunks land in the output directly. In place the
    output is the input, and a landing chunk would overwrite one not yet
    sent, so they land in a scratch buffer and each rank then copies it
    into its output (two ops: the chunks before and after its own).
    """
    n = p.num_ranks
    landing = "scratch" if p.inplace else "output"
    for r in range(n):
        p.chunk(r, "input", r).copy(r, "output", r)
        for dst in range(n):
            if dst != r:
                p.chunk(r, "input", dst).copy(dst, landing, r)
    if p.inplace:
        for r in range(n):
            if r > 0:
                p.chunk(r, "scratch", 0, r).copy(r, "output", 0)
            if r < n - 1:
                p.chunk(r, "scratch", r + 1, n - 1 - r).copy(r, "output", r + 1)
