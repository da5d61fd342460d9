"""Tree allreduces: reduce each chunk up a tree, then broadcast it back down.

Both are chunked (parameter ``chunks``) so that consecutive chunks can
pipeline through the tree. Every rank first copies its input to its output
(one op; nothing in place), so all partial sums live in the output and
both forms work.
"""
import msc


def _lowbit(x: int) -> int:
    return x & -x


def _start_from_inputs(p: msc.Program) -> None:
    for r in range(p.num_ranks):
        p.chunk(r, "input", 0, p.chunk_factor).copy(r, "output", 0)


def _up_then_down(p: msc.Program, edges: list[tuple[int, int]], chunk: int) -> None:
    """Allreduce ``chunk`` over a tree of (child, parent) edges listed children first."""
    for child, parent in edges:
        p.chunk(parent, "output", chunk).reduce(p.chunk(child, "output", chunk))
    for child, parent in reversed(edges):
        p.chunk(parent, "output", chunk).copy(child, "output", chunk)


@msc.algorithm("allreduce", chunk_factor=lambda n, chunks: chunks)
def binomial(p: msc.Program, chunks=4):
    """Binomial-tree reduce to rank 0, then binomial broadcast from rank 0.

    The parent of rank x is x with its lowest set bit cleared; in round j
    (j = 0 .. ceil(log2 n)-1) ranks with lowest bit 2^j send their partial
    sum up, then the broadcast runs the rounds in reverse. Each of the
    ``chunks`` chunks goes up and down the tree on its own.
    """
    n = p.num_ranks
    edges = [(x, x & (x - 1)) for x in sorted(range(1, n), key=_lowbit)]
    _start_from_inputs(p)
    for c in range(chunks):
        _up_then_down(p, edges, c)


def _btree_parent(x: int, n: int) -> int:
    """Parent of position x > 0 in a binary tree over positions 0..n-1 whose
    leaves are exactly the odd positions (NCCL's btree; root 0, one child)."""
    bit = _lowbit(x)
    up = (x ^ bit) | (bit << 1)
    return up if up < n else x ^ bit


@msc.algorithm("allreduce", chunk_factor=lambda n, chunks: chunks)
def double_binary(p: msc.Program, chunks=4):
    """Two complementary binary trees; even chunks use tree A, odd chunks tree B.

    Tree A places rank x at position x, so its leaves are the odd ranks.
    Tree B mirrors it (rank n-1-x, n even) or shifts it (rank x+1 mod n,
    n odd), so its leaves are the even ranks: every rank is a leaf in one
    tree, except rank 0 for odd n. Each chunk is reduced up its tree
    (children before parents, about log2 n rounds) and broadcast back down.
    """
    n = p.num_ranks
    order = sorted(range(1, n), key=_lowbit)
    tree_a = [(x, _btree_parent(x, n)) for x in order]
    flip = (lambda x: n - 1 - x) if n % 2 == 0 else (lambda x: (x + 1) % n)
    tree_b = [(flip(x), flip(y)) for x, y in tree_a]
    _start_from_inputs(p)
    for c in range(chunks):
        _up_then_down(p, tree_b if c % 2 else tree_a, c)
