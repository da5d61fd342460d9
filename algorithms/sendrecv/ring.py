"""Ring sendrecv: each rank sends its input to the next rank, in one step."""
import msc


@msc.algorithm("sendrecv", chunk_factor=lambda n, chunks: chunks)
def ring(p: msc.Program, chunks=1):
    """Rank r's input goes to rank r+1's output, in one step.

    Every link of the ring is busy at once (``chunks`` pieces pipeline it
    over the protocol's slots).

    In place, each rank's buffer is both what it sends and what it receives
    into, so every rank first copies its input to scratch (a local copy) and
    sends from there; out of place the input is sent directly.
    """
    n = p.num_ranks
    sources = [[p.chunk(r, "input", c) for c in range(chunks)] for r in range(n)]
    if p.inplace:
        sources = [[src.copy(r, "scratch", c) for c, src in enumerate(row)] for r, row in enumerate(sources)]
    for r, row in enumerate(sources):
        for c, src in enumerate(row):
            src.copy((r + 1) % n, "output", c)
