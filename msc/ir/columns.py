"""A trace's operations as numpy arrays, one entry per operation: what the
bulk passes (bulk lowering, the DSL verifier's fast path) work on instead of
millions of ``Op`` tuples. Each column is read from the tuples in one pass
in C; the ones a pass may not need are read on first use.
"""
from __future__ import annotations

from functools import cached_property
from itertools import repeat
from operator import is_, itemgetter

import numpy as np

from msc.ir import Op, OpKind

_FIELD = {name: i for i, name in enumerate(Op._fields)}


class OpColumns:
    """``srank``, ``sidx``, ``drank``, ``didx``, ``size`` (int64), ``sbuf``,
    ``dbuf`` (numbers into ``names``, the buffer names sorted), ``reduce``
    (bool), and on demand ``channel`` (0 for none), ``line_id`` (numbers into
    ``lines``, the distinct source-line objects)."""

    def __init__(self, ops):
        self._ops = ops
        self.count = len(ops)
        self.srank, self.sidx = self._ints("src_rank"), self._ints("src_index")
        self.drank, self.didx = self._ints("dst_rank"), self._ints("dst_index")
        self.size = self._ints("size")
        src_names, dst_names = map(itemgetter(_FIELD["src_buffer"]), ops), map(itemgetter(_FIELD["dst_buffer"]), ops)
        self.names = sorted(set(src_names) | set(dst_names))
        number = {name: b for b, name in enumerate(self.names)}.__getitem__
        self.sbuf = np.fromiter(map(number, map(itemgetter(_FIELD["src_buffer"]), ops)), np.int64, self.count)
        self.dbuf = np.fromiter(map(number, map(itemgetter(_FIELD["dst_buffer"]), ops)), np.int64, self.count)
        kinds = map(itemgetter(_FIELD["kind"]), ops)
        self.reduce = np.fromiter(map(is_, kinds, repeat(OpKind.REDUCE)), bool, self.count)

    def _ints(self, field: str) -> np.ndarray:
        return np.fromiter(map(itemgetter(_FIELD[field]), self._ops), np.int64, self.count)

    def buffer_number(self, name: str) -> int:
        """The number of buffer ``name``, -1 where no operation names it."""
        return self.names.index(name) if name in self.names else -1

    @cached_property
    def channel(self) -> np.ndarray:
        hints = map(itemgetter(_FIELD["channel"]), self._ops)
        if not any(hints):
            return np.zeros(self.count, dtype=np.int64)
        return np.fromiter((c or 0 for c in map(itemgetter(_FIELD["channel"]), self._ops)), np.int64, self.count)

    @cached_property
    def _line_table(self) -> tuple[np.ndarray, list]:
        # the trace shares one SourceLine object per line: number them by identity
        where = list(map(itemgetter(_FIELD["where"]), self._ops))
        _, first, ids = np.unique(np.fromiter(map(id, where), np.int64, self.count),
                                  return_index=True, return_inverse=True)
        return ids, [where[i] for i in first.tolist()]

    @property
    def line_id(self) -> np.ndarray:
        return self._line_table[0]

    @property
    def lines(self) -> list:
        return self._line_table[1]
