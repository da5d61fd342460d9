"""2D-torus allreduce: rings along the rows, then along the columns, then the rows again."""
import math

import msc


def _default_rows(n: int) -> int:
    """The largest divisor of n that is <= sqrt(n): the squarest grid."""
    return max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)


@msc.algorithm("allreduce", chunk_factor=lambda n: n,
               ranks=lambda n, rows: rows is None or (type(rows) is int and rows >= 1 and n % rows == 0))
def torus2d(p: msc.Program, rows=None):
    """Row reduce-scatter, column allreduce, row allgather on a 2D grid.

    Ranks form a rows x cols grid, rank = row * cols + col (rows default:
    the largest divisor of n <= sqrt(n)). Column c owns shard c, the
    ``rows`` chunks from c * rows.

    1. Ring reduce-scatter along each row: shard c is summed around the row
       ending at column c (cols - 1 steps of one op of ``rows`` chunks).
    2. Ring allreduce along each column on its shard, one chunk per row
       (2 * (rows - 1) steps).
    3. Ring allgather along each row (cols - 1 steps of ``rows`` chunks).

    Every rank first copies its input to its output (one op; nothing in
    place), so all partial sums live in the output and both forms work.
    """
    n = p.num_ranks
    rows = _default_rows(n) if rows is None else rows
    cols = n // rows

    def at(row: int, col: int) -> int:
        return row % rows * cols + col % cols

    for r in range(n):
        p.chunk(r, "input", 0, n).copy(r, "output", 0)
    for row in range(rows):
        for c in range(cols):
            acc = p.chunk(at(row, c + 1), "output", c * rows, rows)
            for k in range(2, cols + 1):
                acc = p.chunk(at(row, c + k), "output", c * rows, rows).reduce(acc)
    for c in range(cols):
        for j in range(rows):
            index = c * rows + j
            acc = p.chunk(at(j + 1, c), "output", index)
            for k in range(2, rows + 1):
                acc = p.chunk(at(j + k, c), "output", index).reduce(acc)
            for k in range(1, rows):
                acc = acc.copy(at(j + k, c), "output", index)
    for row in range(rows):
        for c in range(cols):
            acc = p.chunk(at(row, c), "output", c * rows, rows)
            for k in range(1, cols):
                acc = acc.copy(at(row, c + k), "output", c * rows)
