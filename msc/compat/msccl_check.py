"""Running an MSCCLang collective's ``check(prog)`` on a traced program
(``msc.compat.msccl``), and what it read.

A custom collective states its postcondition as Python that reads
``prog.buffers`` and prints what is wrong. ``run_check`` runs it on the
chunks as traced, with buffers that record every read; where it says yes,
the output chunks it read become the msc collective's postcondition (what
each holds, by contributions), so ``msc.verify`` and the plan verifier hold
the program, and its lowered plan, to what check() accepted.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Sequence

from msc.compat.msccl_chunks import Buffer, as_mscclang, labels
from msc.compat.msccl_collectives import Collective
from msc.dsl.program import PASS_THROUGH, _innermost_user_line, describe
from msc.errors import AlgorithmError, MscError, VerificationError


def run_check(owner, where, echo: bool) -> dict[tuple[int, int], list]:
    """``owner.collective.check`` on ``owner``'s chunks now: the labels each
    output chunk it read holds, by (rank, index). Raises VerificationError
    (with what check() printed) where it returns something false;
    ``echo``: print what it printed when it says yes."""
    c = owner.collective
    if type(c).check is Collective.check:
        return {}                      # no check(): nothing is required
    reads: set = set()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            verdict = c.check(_Judged(owner, buffer_views(owner, reads)))
    except (MscError, *PASS_THROUGH):
        raise
    except BaseException as exc:
        raise AlgorithmError(describe(exc, f"in check() of collective {type(c).__name__}"),
                             where=_innermost_user_line(exc) or where) from exc
    text = printed.getvalue()
    if not verdict:
        raise _failed(owner, verdict, text, where)
    if text and echo:
        sys.stdout.write(text)
    return _read_outputs(owner, reads)


def _read_outputs(owner, reads: set) -> dict[tuple[int, int], list]:
    layout = owner.program.layout
    size = layout.logical_sizes["output"]
    post = {}
    for rank, buf, at in reads:
        target, off = layout.alias(rank, "output")
        held = owner._held(rank, buf, at)
        if buf == target and 0 <= at - off < size and held is not None:
            post[(rank, at - off)] = labels(held)
    return post


def _failed(owner, verdict, text: str, where) -> VerificationError:
    """check() said no: its words, and (where it names a chunk in MSCCLang's
    words, "Rank R chunk C") that chunk and the line that last wrote it."""
    lines = text.strip().splitlines()
    shown = "\n  ".join(lines[:6] + ([f"... {len(lines) - 6} more lines"] if len(lines) > 6 else []))
    detail = (f"check() of collective {type(owner.collective).__name__} returned {verdict!r}"
              + (f"; it printed:\n  {shown}" if lines else " and printed nothing"))
    named = re.search(r"\b[Rr]ank (\d+),? chunk (\d+)", text)
    if named is None:
        return VerificationError(detail, where=where)
    rank, index = int(named[1]), int(named[2])
    return VerificationError(detail, rank=rank, buffer="output", index=index,
                             where=_last_writer(owner, rank, index) or where)


def _last_writer(owner, rank: int, index: int):
    if not 0 <= rank < owner.num_ranks:
        return None
    buf, off = owner.program.layout.alias(rank, "output")
    at = index + off
    for op in reversed(owner.program.ops):
        if op.dst_rank == rank and op.dst_buffer == buf and op.dst_index <= at < op.dst_index + op.size:
            return op.where
    return None


def buffer_views(owner, reads: set | None) -> list[dict]:
    """Per rank, MSCCLang's dict of buffers: input and output (each where
    the layout puts it) and every scratch buffer, under the user's names."""
    layout = owner.program.layout
    sizes = layout.logical_sizes
    views = []
    for rank in range(owner.num_ranks):
        row = {}
        for name in (Buffer.input, Buffer.output):
            buf, off = layout.alias(rank, name.value)
            row[name] = _BufferView(owner, rank, buf, off, sizes[name.value], reads)
        views.append(row)
    for (rank, buf) in list(owner._slots):
        if buf not in layout.physical_sizes:
            views[rank][owner._spelled.get(buf, buf)] = _BufferView(owner, rank, buf, 0, None, reads)
    return views


class _Judged:
    """The program as a collective's check() sees it: ``buffers`` record
    what it reads; everything else is the MSCCLProgram's."""

    def __init__(self, owner, buffers: list[dict]):
        self._owner = owner
        self.buffers = buffers

    def __getattr__(self, name):
        return getattr(self._owner, name)


class _BufferView(Sequence):
    """One buffer of one rank as MSCCLang's list: what its chunks hold now
    (read-only). ``length`` None: a scratch buffer, as long as it has grown.
    Reads are recorded in ``reads`` as (rank, physical buffer, index)."""

    def __init__(self, owner, rank: int, buffer: str, offset: int, length: int | None, reads):
        self._owner, self._rank, self._buffer, self._offset = owner, rank, buffer, offset
        self._length, self._reads = length, reads

    def __len__(self) -> int:
        if self._length is None:
            return len(self._owner._contents(self._rank, self._buffer))
        return self._length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        size = len(self)
        if i < 0:
            i += size
        if not 0 <= i < size:
            raise IndexError(f"rank {self._rank} buffer index {i} out of range ({size} chunks)")
        at = self._offset + i
        if self._reads is not None:
            self._reads.add((self._rank, self._buffer, at))
        return as_mscclang(self._owner._held(self._rank, self._buffer, at))

    def __setitem__(self, i, value):
        raise TypeError("a program's buffers are read-only here: change them with copy() and reduce()")

    def __repr__(self) -> str:
        return repr(list(self))
