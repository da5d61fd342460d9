"""The DSL verifier's fast path: is a traced program certainly right?
Answered in bulk (numpy), without running the trace one operation at a time.

``checked_outputs(program)`` is the number of output chunks checked when
``msc.verification.program_verifier``'s symbolic run would succeed, None on anything else. It never
words an error: on None, ``verify`` runs the trace in Python, which finds
the error and names it.

How. An operation of ``size`` chunks is ``size`` lanes run in order, each
reading a source chunk (and, for a reduce, its destination) and then writing
the destination. Sorted by chunk, then lane, every read finds the last write
before it, or the chunk's initial label: the trace in SSA form. A copy's
value is the value it read (an alias); a reduce's is a new sum of its two
reads. Then every output chunk's final value must hold its expected
multiset of contributions, counted once per distinct (value, expectation),
as ``verify`` counts them.
"""
from __future__ import annotations

import numpy as np

from msc.ir.accesses import last_of_each, pieces, writes_around
from msc.verification.multisets import Decline, Leaves, expectations, holds, need, resolve


def checked_outputs(program) -> int | None:
    """The output chunks ``msc.verify(program)`` checks, if it succeeds; None
    where this cannot vouch for the program (see the module docstring)."""
    try:
        return _checked_outputs(program)
    except Decline:
        return None


def _lookup(keys: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``values`` at each of ``wanted`` in the sorted ``keys``; -1 where absent."""
    if not keys.size:
        return np.full(wanted.size, -1, dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return np.where(keys[at] == wanted, values[at], -1)


def _checked_outputs(program) -> int:
    layout = program.layout
    need(program.num_ops)            # nothing to gain
    c = program.columns()
    need((c.size >= 1).all())
    lane_op, lane_in_op = _lanes(c)
    chunks, src_cell, dst_cell = _lane_cells(layout, c, lane_op, lane_in_op)
    reduce = c.reduce[lane_op]
    del lane_op, lane_in_op          # (freed as soon as done with: at scale each is 100s of MB)

    # -- initial labels: one leaf per distinct label ----------------------------
    leaves = Leaves(layout, 1, chunks.of_named)
    # a chunk labelled twice keeps the last label, as the Python run does
    init_cells, last = np.unique(leaves.cells[::-1], return_index=True)
    init_leaf = leaves.leaf_ids[::-1][last]
    n_leaves = leaves.count

    code = _access_codes(src_cell, dst_cell, reduce)
    del src_cell, dst_cell
    value_src, value_dst, final_cells, final_value = _read_and_final_values(code, reduce.size, init_cells,
                                                                            init_leaf, n_leaves)
    del code

    # -- values: leaves, then per lane an alias (copy) or a sum (reduce) --------------
    kind = np.concatenate([np.zeros(n_leaves, np.int8), np.where(reduce, 2, 1).astype(np.int8)])
    a = np.concatenate([np.arange(n_leaves, dtype=np.int64), np.where(reduce, value_dst, value_src)])
    b = np.concatenate([np.full(n_leaves, -1, np.int64), np.where(reduce, value_src, -1)])
    del value_src, value_dst, reduce
    rep, ca, cb = resolve(kind, a, b)
    del a, b

    # -- outputs -------------------------------------------------------------------------
    out_cells, out_exp, exps = expectations(layout, chunks.of_named)
    if not out_cells.size:
        return 0
    value = _lookup(final_cells, final_value, out_cells)
    value = np.where(value >= 0, value, _lookup(init_cells, init_leaf, out_cells))   # a chunk never touched
    need((value >= 0).all())                        # else the chunk was never written nor labelled
    need(holds(rep[value], out_exp, exps, leaves, kind, ca, cb))
    return out_cells.size


def _lanes(c) -> tuple[np.ndarray, np.ndarray | int]:
    """Per lane its operation and its index within that operation (0 for
    all when every operation is one chunk)."""
    if (c.size == 1).all():
        return np.arange(c.count, dtype=np.int64), 0
    lane_op = np.repeat(np.arange(c.count, dtype=np.int64), c.size)
    lane_in_op = np.arange(lane_op.size, dtype=np.int64) - np.repeat(np.cumsum(c.size) - c.size, c.size)
    return lane_op, lane_in_op


class _Chunks:
    """Chunks as ints: (rank, buffer number, index) is (rank * buffers +
    buffer) * stride + index."""

    def __init__(self, names: list, stride: int):
        self.buffers, self.stride = len(names), stride
        self.number = {b: i for i, b in enumerate(names)}

    def cell(self, rank, buf, index):
        return (rank * self.buffers + buf) * self.stride + index

    def of_named(self, rank, buf, off, count, index):   # for Leaves and expectations: a physical buffer by name
        return self.cell(rank, self.number[buf], index)


def _lane_cells(layout, c, lane_op, lane_in_op) -> tuple[_Chunks, np.ndarray, np.ndarray]:
    """The chunk numbering, and each lane's source and destination chunk."""
    names = c.names + [b for b in layout.physical_sizes if b not in c.names]
    s_idx, d_idx = c.sidx[lane_op] + lane_in_op, c.didx[lane_op] + lane_in_op
    need((s_idx >= 0).all() and (d_idx >= 0).all())
    chunks = _Chunks(names, 1 + max(int(s_idx.max()), int(d_idx.max()), *layout.physical_sizes.values()))
    return (chunks, chunks.cell(c.srank[lane_op], c.sbuf[lane_op], s_idx),
            chunks.cell(c.drank[lane_op], c.dbuf[lane_op], d_idx))


def _access_codes(src_cell, dst_cell, reduce) -> np.ndarray:
    """Every access of a chunk as one int, sorted: (chunk * lanes + lane) *
    3 + kind, kind the order within a lane: read the source (0), read the
    destination (1, a reduce), write it (2). Distinct ints: by chunk, then
    lane, then read before write."""
    lanes = src_cell.size
    need(max(int(src_cell.max()), int(dst_cell.max())) < (1 << 62) // (3 * lanes + 3))
    # built in place, one part after another (at scale these arrays are hundreds of MB each)
    reducing = np.flatnonzero(reduce)
    code = np.empty(2 * lanes + reducing.size, dtype=np.int64)
    lane3 = np.arange(0, 3 * lanes, 3, dtype=np.int64)
    for part, cells, at, kind in ((code[:lanes], src_cell, lane3, 0),
                                  (code[lanes:lanes + reducing.size], dst_cell[reducing], lane3[reducing], 1),
                                  (code[lanes + reducing.size:], dst_cell, lane3, 2)):
        np.multiply(cells, 3 * lanes, out=part)
        part += at
        part += kind
    del lane3, reducing
    code.sort()
    return code


def _read_and_final_values(code, lanes: int, init_cells, init_leaf, n_leaves: int):
    """The trace in SSA form: every access (``code``, _access_codes), by
    chunk then lane, finds the write before it. Returns the value each lane
    read from its source and (reduces; else -1) its destination, and each
    touched chunk with its final value (its last write, else its initial
    label). A value is a leaf (< n_leaves) or n_leaves + the lane that wrote
    it. Done a piece of chunks at a time (msc.ir.accesses.pieces)."""
    value_src = np.empty(lanes, dtype=np.int64)        # every lane reads its source
    value_dst = np.full(lanes, -1, dtype=np.int64)
    final_cells, final_value = [], []
    for start, stop in pieces(code, 3 * lanes):
        s_lane = code[start:stop] // 3
        s_kind = code[start:stop] - 3 * s_lane
        s_cell = s_lane // lanes
        s_lane -= lanes * s_cell
        written = s_kind == 2
        before, _ = writes_around(s_cell, written, following=False)   # the write each access sees
        # a chunk's initial label (-1 where it starts empty), looked up only where no write comes before
        initial = np.full(len(s_cell), -1, dtype=np.int64)
        unwritten = np.flatnonzero(before < 0)
        initial[unwritten] = _lookup(init_cells, init_leaf, s_cell[unwritten])
        del unwritten
        seen = np.where(before >= 0, n_leaves + s_lane[np.maximum(before, 0)], initial)
        need((seen[~written] >= 0).all())             # a read of a chunk nothing wrote
        is_src = s_kind == 0
        value_src[s_lane[is_src]] = seen[is_src]
        is_dst = s_kind == 1
        value_dst[s_lane[is_dst]] = seen[is_dst]
        # each chunk's final value: its last write, else its initial label
        last = last_of_each(s_cell)
        final_write = np.where(written[last], last, before[last])
        final_value.append(np.where(final_write >= 0, n_leaves + s_lane[np.maximum(final_write, 0)], initial[last]))
        final_cells.append(s_cell[last])
    return value_src, value_dst, np.concatenate(final_cells), np.concatenate(final_value)
