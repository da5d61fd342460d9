"""All-pairs allreduce: every rank reduces its own shard from all peers, then sends it to all."""
import msc


@msc.algorithm("allreduce", chunk_factor=lambda n: n)
def allpairs(p: msc.Program):
    """Each rank reduces its own shard from all peers, then sends it to all.

    Rank r owns chunk r: it reads chunk r of every peer's input and sums it
    into its output (step 1, reduce-scatter), then copies the sum to every
    other rank (step 2, allgather). Two steps, each one op per rank pair.

    Works in place and out of place: rank r only writes its own chunk r in
    step 1, which no peer reads.
    """
    n = p.num_ranks
    for r in range(n):
        mine = p.chunk(r, "input", r).copy(r, "output", r)
        for peer in range(n):
            if peer != r:
                mine.reduce(p.chunk(peer, "input", r))
    for r in range(n):
        for peer in range(n):
            if peer != r:
                p.chunk(r, "output", r).copy(peer, "output", r)
