"""The rank arithmetic of PAT (Parallel Aggregated Trees, NCCL 2.23+), shared
by the library's PAT allgather and reduce-scatter (algorithms/*/pat.py).

PAT is the Bruck algorithm with its dimensions reversed (S. Jeaugey, "PAT: a
new algorithm for all-gather and reduce-scatter operations at scale", arXiv
2506.20252; NCCL src/include/collectives.h PatAGAlgorithm, PatRSAlgorithm):
rank r's data spreads over a binomial tree shifted to start at r, the far
dimension first, so the one step that moves half the data goes to the
nearest peer. A rank talks to ranks r +- 2^d only (src/device/prims_simple.h:
"Connect to all ranks +/- 2^n").

Rank r keeps the block of rank r + s (mod n) at position ``bit_reversed(s)``
of its staging buffer: then at every dimension a rank sends one contiguous
range of positions and its peer receives one (``runs`` splits a range where
ranks past n leave holes, for rank counts other than powers of two).
"""
from __future__ import annotations


def dimensions(n: int) -> int:
    """D with 2^D >= n: PAT's steps across ``n`` ranks."""
    return max(0, (n - 1).bit_length())


def bit_reversed(s: int, bits: int) -> int:
    """``s``'s lowest ``bits`` bits in reverse order."""
    out = 0
    for _ in range(bits):
        out = (out << 1) | (s & 1)
        s >>= 1
    return out


def runs(offsets: list[int], bits: int) -> list[tuple[int, int]]:
    """(first position, length) of the contiguous runs that ``offsets``'
    positions (bit_reversed, ``bits`` bits) make, in position order."""
    positions = sorted(bit_reversed(s, bits) for s in offsets)
    out: list[tuple[int, int]] = []
    for pos in positions:
        if out and out[-1][0] + out[-1][1] == pos:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((pos, 1))
    return out


def gather_step(n: int, d: int) -> tuple[list[int], int]:
    """At dimension ``d`` of the allgather: the offsets s (multiples of
    2^(d+1)) whose blocks a rank sends to rank - 2^d, which holds them at
    s + 2^d, and that shift in positions (2^(D-1-d))."""
    D = dimensions(n)
    return [s for s in range(0, n, 2 << d) if s + (1 << d) < n], 1 << (D - 1 - d)


def reduce_step(n: int, d: int) -> tuple[list[int], int]:
    """At dimension ``d`` of the reduce-scatter: the offsets s (lowest set bit
    d) whose partial sums a rank sends to rank + 2^d, which holds them at
    s - 2^d, and that shift in positions (2^(D-1-d))."""
    D = dimensions(n)
    return [s for s in range(1 << d, n, 2 << d)], 1 << (D - 1 - d)


def node_peers(n: int, g: int):
    """(rank, its node peer, the peer's local index) for every rank of nodes of ``g`` GPUs (rank = node * g + local)."""
    for r in range(n):
        node, local = divmod(r, g)
        for other in range(g):
            if other != local:
                yield r, node * g + other, other


def region(nodes: int) -> list[tuple[int, int]]:
    """The runs of positions a node's ``nodes`` blocks take in a staging region."""
    return runs(list(range(nodes)), dimensions(nodes))
