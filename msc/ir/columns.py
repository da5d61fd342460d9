"""A trace's operations as numpy arrays, one entry per operation: what the
bulk passes (bulk lowering, the DSL verifier's fast path) work on instead of
millions of ``Op`` tuples. Each column is read in one pass in C, from Op
tuples or from the rows a trace records (msc.ir.trace); the columns can give
the rows back (``rows()``), so a trace read into columns keeps only them.
"""
from __future__ import annotations

from itertools import repeat
from operator import is_not, itemgetter

import numpy as np

from msc.ir import Op, OpKind

_FIELD = {name: i for i, name in enumerate(Op._fields)}
# where each field is in a trace row (msc.ir.trace): the Op's first eight, then its source line
_ROW = {**{name: i for i, name in enumerate(Op._fields[:8])}, "where": 8}
_KINDS = tuple(OpKind)
_KIND_CODE = {id(kind): i for i, kind in enumerate(_KINDS)}       # by id(): hashing an Enum member is slow
_REDUCE = _KINDS.index(OpKind.REDUCE)


class OpColumns:
    """``srank``, ``sidx``, ``drank``, ``didx``, ``size`` (int64), ``sbuf``,
    ``dbuf`` (numbers into ``names``, the buffer names sorted), ``kind``
    (int8, an index into OpKind's members), ``reduce`` (bool), ``channel``
    (0 for none), ``line_id`` (numbers into ``lines``, the distinct
    source-line objects in order of first use); ``extra``: per operation
    number, its (channel, sendtb, recvtb, group) where not all unset (None
    for columns made by a pass that keeps only ``channel``: no rows())."""

    def __init__(self, ops):
        self._read(ops, _FIELD)
        self.extra = {}
        if any(any(map(is_not, map(itemgetter(_FIELD[f]), ops), repeat(None))) for f in ("channel", "sendtb", "recvtb")) \
                or any(map(itemgetter(_FIELD["group"]), ops)):         # in C: millions of ops at scale
            self.extra = {i: (op.channel, op.sendtb, op.recvtb, op.group) for i, op in enumerate(ops)
                          if op.channel is not None or op.sendtb is not None or op.recvtb is not None or op.group}
        self._channels()

    @classmethod
    def from_rows(cls, rows: list, extra: dict) -> OpColumns:
        """The columns of a trace's rows (msc.ir.trace) and its ``extra`` fields."""
        self = cls.__new__(cls)
        self._read(rows, _ROW)
        self.extra = dict(extra)
        self._channels()
        return self

    def _read(self, seq, field: dict) -> None:
        self.count = n = len(seq)

        def ints(name):
            return np.fromiter(map(itemgetter(field[name]), seq), np.int64, n)

        self.srank, self.sidx = ints("src_rank"), ints("src_index")
        self.drank, self.didx = ints("dst_rank"), ints("dst_index")
        self.size = ints("size")
        src_names, dst_names = map(itemgetter(field["src_buffer"]), seq), map(itemgetter(field["dst_buffer"]), seq)
        self.names = sorted(set(src_names) | set(dst_names))
        number = {name: b for b, name in enumerate(self.names)}.__getitem__
        self.sbuf = np.fromiter(map(number, map(itemgetter(field["src_buffer"]), seq)), np.int64, n)
        self.dbuf = np.fromiter(map(number, map(itemgetter(field["dst_buffer"]), seq)), np.int64, n)
        self.kind = np.fromiter(map(_KIND_CODE.__getitem__, map(id, map(itemgetter(field["kind"]), seq))), np.int8, n)
        self.reduce = self.kind == _REDUCE
        # the trace shares one SourceLine object per line: number them by identity, in order of first use
        where = list(map(itemgetter(field["where"]), seq))
        objs = dict(zip(map(id, where), where))
        code = dict(zip(objs, range(len(objs))))
        self.line_id = np.fromiter(map(code.__getitem__, map(id, where)), np.int64, n)
        self.lines = list(objs.values())

    def _channels(self) -> None:
        self.channel = np.zeros(self.count, dtype=np.int64)
        hinted = [(i, ch) for i, (ch, _, _, _) in self.extra.items() if ch]
        if hinted:
            at, ch = zip(*hinted)
            self.channel[list(at)] = ch

    def buffer_number(self, name: str) -> int:
        """The number of buffer ``name``, -1 where no operation names it."""
        return self.names.index(name) if name in self.names else -1

    def rows(self) -> list:
        """The trace rows (msc.ir.trace) these columns were read from."""
        if self.extra is None:
            raise ValueError("these columns do not keep the operations' threadblock hints: no rows")
        names, lines = self.names, self.lines
        return list(zip(map(_KINDS.__getitem__, self.kind.tolist()), self.srank.tolist(),
                        map(names.__getitem__, self.sbuf.tolist()), self.sidx.tolist(), self.drank.tolist(),
                        map(names.__getitem__, self.dbuf.tolist()), self.didx.tolist(), self.size.tolist(),
                        map(lines.__getitem__, self.line_id.tolist())))
