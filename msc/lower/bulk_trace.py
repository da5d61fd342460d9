"""replicate and allocate_scratch (msc.lower.dag) over a trace's columns
(msc.ir.columns.OpColumns), for bulk lowering: the same operations, built
in numpy instead of as one Op tuple per chunk and instance (a 256-rank ring
at 32 instances has four million). tests/test_bulk.py checks that the
columns equal those of the Op-by-Op passes.
"""
from __future__ import annotations

import numpy as np

from msc.ir.columns import OpColumns


def replicate_columns(c: OpColumns, instances: int, scratch_sizes: dict) -> tuple[OpColumns, dict]:
    """msc.lower.dag.replicate on columns: chunk i of instance j is chunk
    i*instances + j and channel c of instance j is j*channels + c;
    operations of several chunks split into one per chunk (operation by
    operation, then instance, then chunk)."""
    if instances == 1:
        return c, dict(scratch_sizes)
    k = instances
    hints = list(c.extra.values())        # a trace's columns keep every hint
    channels = 1 + max((ch or 0 for ch, _, _, _ in hints), default=0)
    per_op = c.size * k
    op = np.repeat(np.arange(c.count, dtype=np.int64), per_op)
    within = np.arange(op.size, dtype=np.int64) - np.repeat(np.cumsum(per_op) - per_op, per_op)
    j, t = np.divmod(within, c.size[op])
    out = OpColumns.__new__(OpColumns)
    out.count = int(op.size)
    out.srank, out.drank = c.srank[op], c.drank[op]
    out.sidx, out.didx = c.sidx[op] * k + j + t * k, c.didx[op] * k + j + t * k
    out.size = np.ones(out.count, dtype=np.int64)
    out.names, out.sbuf, out.dbuf = c.names, c.sbuf[op], c.dbuf[op]
    out.kind, out.reduce, out.line_id, out.lines = c.kind[op], c.reduce[op], c.line_id[op], c.lines
    out.channel = j * channels + c.channel[op]
    out.extra = None       # the threadblock hints are not kept (bulk lowering places threadblocks itself)
    return out, {key: size * k for key, size in scratch_sizes.items()}


def allocate_scratch_columns(c: OpColumns, physical: set[str], scratch_sizes: dict,
                             num_ranks: int) -> tuple[OpColumns, list[int]]:
    """msc.lower.dag.allocate_scratch on columns: every named scratch buffer
    of a rank onto one ``scratch`` buffer, in order of first use (an
    operation's source before its destination)."""
    used = [0] * num_ranks
    named = [b for b, name in enumerate(c.names) if name not in physical]
    if not named:
        return c, used
    is_named = np.zeros(len(c.names), dtype=bool)
    is_named[named] = True
    # accesses in order: (operation, source 0 / destination 1), keyed by (rank, buffer)
    nb = len(c.names)
    key = np.concatenate([c.srank * nb + c.sbuf, c.drank * nb + c.dbuf])
    when = np.concatenate([np.arange(c.count, dtype=np.int64) * 2, np.arange(c.count, dtype=np.int64) * 2 + 1])
    pick = np.concatenate([is_named[c.sbuf], is_named[c.dbuf]])
    key, when = key[pick], when[pick]
    keys, first = np.unique(key, return_index=True)
    base = {}
    for code in keys[np.argsort(when[first], kind="stable")].tolist():
        rank, buf = divmod(code, nb)
        name = c.names[buf]
        base[code] = used[rank]
        used[rank] += scratch_sizes.get((rank, name), 0)
    names = sorted({c.names[b] for b in range(nb) if not is_named[b]} | {"scratch"})
    number = np.array([names.index("scratch" if is_named[b] else c.names[b]) for b in range(nb)], dtype=np.int64)
    codes = np.array(sorted(base), dtype=np.int64)
    offsets = np.array([base[x] for x in codes.tolist()], dtype=np.int64)

    def shifted(rank, buf, index):
        code = rank * nb + buf
        at = np.minimum(np.searchsorted(codes, code), codes.size - 1)
        return np.where(is_named[buf], index + offsets[at], index)

    out = OpColumns.__new__(OpColumns)
    out.__dict__.update(c.__dict__)
    out.sidx, out.didx = shifted(c.srank, c.sbuf, c.sidx), shifted(c.drank, c.dbuf, c.didx)
    out.names, out.sbuf, out.dbuf = names, number[c.sbuf], number[c.dbuf]
    return out, used
