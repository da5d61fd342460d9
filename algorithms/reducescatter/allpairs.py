"""All-pairs reduce-scatter: each rank sums its chunk straight from every peer."""
import msc


@msc.algorithm("reducescatter", chunk_factor=1)
def allpairs(p: msc.Program):
    """Each rank sums its chunk straight from every peer, in one step.

    Rank r copies its own input[r] to its output (a no-op in
    place) and adds input[r] of each of the n-1 peers. Works in both forms.
    """
    n = p.num_ranks
    for r in range(n):
        out = p.chunk(r, "input", r).copy(r, "output", 0)
        for peer in range(n):
            if peer != r:
                out.reduce(p.chunk(peer, "input", r))
