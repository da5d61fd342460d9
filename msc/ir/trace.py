"""A program's trace as a table: what ``msc.dsl.program.Program`` records.

Tracing appends one row per operation, a plain tuple of the ``Op`` fields
that every operation has: (kind, src_rank, src_buffer, src_index,
dst_rank, dst_buffer, dst_index, size, where). The rest (placement hints,
a switch op's group) is rare and kept apart, by operation number. A row is
a third of an ``Op`` to build, and the bulk passes read the table as numpy
columns (``columns()``: read once, after which the rows are dropped and the
columns are the table); ``ops()`` builds the ``Op`` tuples, once, for the
passes that work one operation at a time.
"""
from __future__ import annotations

from itertools import islice
from operator import itemgetter

from msc.ir import Op, OpKind

_EXTRA = tuple(Op._fields.index(f) for f in ("channel", "sendtb", "recvtb", "group"))
_NO_EXTRA = (None, None, None, ())
_new_op = tuple.__new__
KINDS = tuple(OpKind)                   # a kind's code in the columns is its index here


class OpTable:
    """The operations of a trace (see the module docstring)."""

    __slots__ = ("rows", "extra", "_built", "_columns")

    def __init__(self):
        self.rows: list[tuple] = []       # (kind, src_rank, src_buffer, src_index, dst_rank, dst_buffer, dst_index,
                                          #  size, where) per operation, until columns() reads them
        self.extra: dict[int, tuple] = {}   # operation number -> (channel, sendtb, recvtb, group) where not all unset
        self._built: list | None = None   # the Op tuples, where built
        self._columns = None              # msc.ir.columns.OpColumns, once read (the rows are dropped then)

    def __len__(self) -> int:
        return self._columns.count if self._columns is not None else len(self.rows)

    def add(self, op: Op) -> None:
        """Append an operation given as an Op."""
        if self._columns is not None:       # read into columns: rows again, to append to
            self.rows, self._columns = self._columns.rows(), None
        self.rows.append((*op[:8], op.where))
        extra = tuple(op[i] for i in _EXTRA)
        if extra != _NO_EXTRA:
            self.extra[len(self.rows) - 1] = extra

    def ops(self) -> list:
        """The operations as Op tuples, built once (and extended as the trace
        grows); callers must not change the list."""
        built = self._built
        if built is not None and len(built) == len(self):
            return built
        if built is None or self._columns is not None:
            built, start = [], 0
        else:
            start = len(built)
        rows = self.rows if self._columns is None else self._columns.rows()
        built.extend([_new_op(Op, (*row[:8], None, None, None, row[8], ())) for row in islice(rows, start, None)])
        for i, (channel, sendtb, recvtb, group) in self.extra.items():
            if i >= start:
                built[i] = built[i]._replace(channel=channel, sendtb=sendtb, recvtb=recvtb, group=group)
        self._built = built
        return built

    def chunk_ops(self) -> int:
        """Chunks the operations move, in all."""
        if self._columns is not None:
            return int(self._columns.size.sum())
        return sum(map(itemgetter(7), self.rows))

    def columns(self):
        """The table as msc.ir.columns.OpColumns (read once; the rows are then dropped)."""
        from msc.ir.columns import OpColumns

        if self._columns is None:
            self._columns = OpColumns.from_rows(self.rows, self.extra)
            self.rows = []
        return self._columns

    def sizes(self):
        """Each operation's size, in order."""
        if self._columns is not None:
            return self._columns.size.tolist()
        return list(map(itemgetter(7), self.rows))


def table_of(ops) -> OpTable:
    """An OpTable holding ``ops`` (Op tuples)."""
    table = OpTable()
    for op in ops:
        table.add(op)
    table._built = list(ops) if not isinstance(ops, list) else ops
    return table

