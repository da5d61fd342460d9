"""The user-facing DSL: ``@msc.algorithm``, ``Program``, ``Ref``, ``group``.

Tracing runs the user's function once against a ``Program`` that records
every copy and reduce as an ``ir.Op`` with the user's source line. Static
mistakes (a rank that does not exist, an index out of range, mismatched
sizes) raise ``OperationError`` at once, at the user's line; what chunks
end up holding is the verifier's business (``msc.verification.program_verifier``).

Tracing runs the user's Python as it is, with no time limit (``msc verify``
and ``msc compile`` take ``--timeout``). Whatever the user's code raises or
does to leave (``sys.exit``, any ``BaseException`` but ``KeyboardInterrupt``)
becomes an ``AlgorithmError`` at the user's line; ``KeyboardInterrupt`` and
``TimeLimitExceeded`` pass through untouched.
"""
from __future__ import annotations

import inspect
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from msc.dsl.collectives import Collective, CustomCollective, Layout, get_collective
from msc.errors import AlgorithmError, MscError, OperationError, SourceLine, UsageError
from msc.ir import Op, OpKind
from msc.ir.trace import OpTable, table_of
from msc.ir.limits import MAX_BUFFER_CHUNKS, MAX_CHUNK_MOVES, MAX_RANKS, MAX_TOTAL_CHUNKS
from msc.perf import pause_gc
from msc.dsl.source_lines import (_LIBRARY_DIR, _PACKAGE_DIR, _display_path, _integer, _internal,  # noqa: F401
                                   _lines, _not_int, line_at, user_codes, user_line)

_getframe = sys._getframe          # (a global lookup, not an attribute one, per traced operation)
_COPY, _REDUCE = OpKind.COPY, OpKind.REDUCE     # (an Enum member's attribute lookup is ~60 ns)



class Program:
    """The program being traced: ranks, buffers and the operations so far.

    ``num_ranks``, ``chunk_factor``, ``root`` and ``params`` describe the
    instance; ``ops`` is the trace as Op tuples (a tuple once tracing has
    finished), built on first use from the table tracing records
    (msc.ir.trace), which the bulk passes read as columns (``columns()``).
    """

    def __init__(self, name: str, layout: Layout, params: dict[str, Any] | None = None):
        self.name = name
        self.layout = layout
        self.params = dict(params or {})
        self._table = OpTable()
        self._rows = self._table.rows     # appended to by every copy and reduce
        self._sealed_ops: tuple[Op, ...] | None = None
        self.scratch_sizes: dict[tuple[int, str], int] = {}
        self._sealed = False
        self._physical = layout.physical_sizes
        self._logical = layout.logical_sizes
        self._alias = layout.alias_table
        self._ranks = layout.num_ranks
        # chunks of every buffer of every rank, and chunks moved: bounded as the trace grows (msc.ir.limits)
        self._chunks = layout.num_ranks * sum(self._physical.values())
        self._moves = 0
        # in place, per op (aligned with ops) whether its source (bit 1) and destination (bit 2) were
        # named by the aliased buffer: errors name what the user wrote, not the physical buffer it
        # maps to (one byte per op: a 1024-rank ring in place renames two million)
        self._renamed = bytearray()
        self.has_switch = False           # some op is a switch op (NVLS): the bulk passes do not take it

    # -- description ------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    @property
    def chunk_factor(self) -> int:
        return self.layout.chunk_factor

    @property
    def collective(self) -> str:
        return self.layout.name

    @property
    def inplace(self) -> bool:
        return self.layout.inplace

    @property
    def root(self) -> int:
        return self.layout.root

    def buffer_size(self, buffer: str) -> int | None:
        """Chunks in logical ``buffer`` (None for a scratch buffer: it grows)."""
        return self.layout.logical_sizes.get(buffer)

    @property
    def ops(self) -> list[Op] | tuple[Op, ...]:
        """The operations so far (a list while tracing; the caller must not
        change it), a tuple once tracing has finished."""
        if self._sealed:
            if self._sealed_ops is None:
                self._sealed_ops = tuple(self._table.ops())
            return self._sealed_ops
        return self._table.ops()

    @ops.setter
    def ops(self, ops) -> None:
        self._table = table_of(ops)
        self._rows = self._table.rows
        self._sealed_ops = None
        self.has_switch = any(op.group for op in ops)

    @property
    def num_ops(self) -> int:
        """len(ops), without building the Op tuples."""
        return len(self._table)

    def chunk_ops(self) -> int:
        return self._table.chunk_ops()

    def columns(self):
        """The operations as numpy columns (msc.ir.columns.OpColumns), for the
        bulk passes; a sealed program reads them once for the verifier and
        lowering both (and keeps only them: its table's rows are dropped)."""
        from msc.ir.columns import OpColumns      # numpy: only where a pass runs in bulk

        if self._sealed:
            columns = self._table.columns()
            self._rows = self._table.rows             # (the rows read are dropped)
            return columns
        return OpColumns.from_rows(self._rows, self._table.extra)

    def __repr__(self) -> str:
        return (f"Program({self.name!r}, {self.collective}, ranks={self.num_ranks}, "
                f"chunk_factor={self.chunk_factor}, inplace={self.inplace}, ops={self.num_ops})")

    # -- the DSL ----------------------------------------------------------
    def chunk(self, rank: int, buffer: str, index: int, size: int = 1) -> Ref:
        """A reference to ``size`` chunks of ``buffer`` on ``rank`` from ``index``.

        Ranks, indices and sizes are ints or other integers (numpy's), never
        bools or floats; so are the hints and ``split``'s parts below."""
        if not (type(rank) is int and type(index) is int and type(size) is int and type(buffer) is str
                and 0 <= rank < self._ranks and index >= 0 and size >= 1
                and index + size <= self._logical.get(buffer, -1) and not self._sealed):
            # not the common case (ints in range of a user buffer): coerce, check and say what is wrong
            if type(rank) is not int or type(index) is not int or type(size) is not int:
                rank, index, size = _integer(rank), _integer(index), _integer(size)
            self._check_location(rank, buffer, index, size, "chunk")
        return Ref(self, rank, buffer, index, size)

    def _check_location(self, rank, buffer, index, size, what) -> None:
        if self._sealed:
            raise OperationError(f"{what}: program {self.name!r} has finished tracing; it can no longer change",
                                 where=user_line(3))
        n = self.layout.num_ranks
        if type(rank) is not int or not 0 <= rank < n:
            problem = f"is a {type(rank).__name__}, not an int" if type(rank) is not int else "does not exist"
            raise OperationError(f"{what}: rank {rank!r} {problem} (ranks are 0..{n - 1})",
                                 rank=rank if type(rank) is int else None, buffer=buffer,
                                 index=index if type(index) is int else None, where=user_line(3))
        if type(buffer) is not str or not buffer:
            buffer = getattr(buffer, "value", buffer)  # MSCCLang-style Buffer enums
            if type(buffer) is not str or not buffer:
                raise OperationError(f"{what}: buffer must be a name, got {buffer!r}", rank=rank, where=user_line(3))
        if type(index) is not int or index < 0:
            raise OperationError(f"{what}: index {index!r}{_not_int(index)} on rank {rank} {buffer} must be an "
                                 f"int >= 0", rank=rank, buffer=buffer, where=user_line(3))
        if type(size) is not int or size < 1:
            raise OperationError(f"{what}: size {size!r}{_not_int(size)} must be an int >= 1",
                                 rank=rank, buffer=buffer, index=index, where=user_line(3))
        limit = self._logical.get(buffer)
        if limit is None and index + size > MAX_BUFFER_CHUNKS:      # a scratch buffer grows to what is named
            raise AlgorithmError(f"{what}: rank {rank} {buffer}[{index}:{index + size}] would grow scratch buffer "
                                 f"{buffer!r} past msc's limit of {MAX_BUFFER_CHUNKS} chunks", where=user_line(3))
        if limit is not None and index + size > limit:
            span = f"[{index}]" if size == 1 else f"[{index}:{index + size}]"
            raise OperationError(f"{what}: index out of range: rank {rank} {buffer}{span}, "
                                 f"but {buffer} has {limit} chunks", rank=rank, buffer=buffer, index=index,
                                 where=user_line(3))

    def _record_hinted(self, kind: OpKind, src: Ref, dst: Ref, channel, sendtb, recvtb) -> None:
        """_record for an operation with placement hints (checked here; kept in the table's ``extra``)."""
        channel, sendtb, recvtb = _integer(channel), _integer(sendtb), _integer(recvtb)
        for hint, value in (("channel", channel), ("sendtb", sendtb), ("recvtb", recvtb)):
            if value is not None and (type(value) is not int or value < 0):
                raise OperationError(f"{kind.value}: hint {hint}={value!r}{_not_int(value)} must be an int "
                                     f">= 0 or None", rank=dst.rank, buffer=dst.buffer, index=dst.index,
                                     where=user_line(3))
        if self._record(kind, src.rank, src.buffer, src.index, dst.rank, dst.buffer, dst.index, src.size, 3):
            self._table.extra[len(self._rows) - 1] = (channel, sendtb, recvtb, ())

    def _record(self, kind: OpKind, srank: int, sname: str, sidx: int, drank: int, dname: str, didx: int,
                size: int, depth: int = 2) -> bool:
        """Record an operation of ``size`` chunks (the names and indices the
        user wrote) made by the caller ``depth`` frames up; False where it
        is a copy onto itself (in-place aliasing), which records nothing."""
        # (locals, plain values, no Ref: this runs millions of times)
        # (an unmoved index is the user's own int object: millions of ops keep one copy, not two)
        sbuf, si, dbuf, di = sname, sidx, dname, didx
        alias_table = self._alias
        if alias_table is not None:
            alias, target, offsets = alias_table
            if sbuf == alias:
                sbuf, soff = target, offsets[srank]
                if soff:
                    si += soff
            if dbuf == alias:
                dbuf, doff = target, offsets[drank]
                if doff:
                    di += doff
        elif dbuf == "input":
            raise OperationError(f"{kind.value}: writes rank {drank} input[{didx}], but the input buffer is "
                                 f"read-only in the out-of-place form (write to 'output' or a scratch buffer)",
                                 rank=drank, buffer="input", index=didx, where=user_line(depth + 1))
        if srank == drank and sbuf == dbuf and si < di + size and di < si + size:
            if kind is _COPY and si == di:
                return False  # copying a chunk onto itself (in-place aliasing): nothing to do
            raise OperationError(f"{kind.value}: source rank {srank} {sname}[{sidx}] and destination "
                                 f"{dname}[{didx}] (size {size}) overlap", rank=drank,
                                 buffer=dname, index=didx, where=user_line(depth + 1))
        moves = self._moves + size
        if moves <= MAX_CHUNK_MOVES and dbuf in self._physical:     # _account's common case, inline
            self._moves = moves
        else:
            self._account(kind.value, size, Ref(self, drank, dname, didx, size), dbuf, di + size)
        self._renamed.append((sbuf != sname) | (dbuf != dname) << 1)
        # the user's line: user_line(depth + 1), looked up directly where the caller of copy/reduce is user code
        # (by instruction offset: f_lineno decodes the line table on every read, f_lasti does not)
        frame = _getframe(depth)
        code = frame.f_code
        entry = user_codes.get(id(code))
        where = entry[1].get(frame.f_lasti) if entry is not None and entry[0] is code else None
        if where is None:
            where = line_at(frame)
        self._rows.append((kind, srank, sbuf, si, drank, dbuf, di, size, where))
        return True

    def switch(self, ranks: Iterable[int] | None = None, *, channel: int | None = None):
        """The ranks ``ranks`` (default: all) as one switch domain: NVLS
        reduce and multicast over their buffers (msc.dsl.switch)."""
        from msc.dsl.switch import switch_group

        return switch_group(self, ranks, channel)

    def _record_switch(self, kind: OpKind, rank: int, sbuf: str, si: int, dbuf: str, di: int, size: int,
                       group) -> None:
        """A switch op of ``rank`` over ``group`` (msc.dsl.switch). Its switch
        side (what it reads on every member, what it writes on every member)
        must be the same physical chunks on every member."""
        what = kind.value
        reads_all = kind is not OpKind.SWITCH_STORE
        writes_all = kind is not OpKind.SWITCH_REDUCE
        members = group.ranks
        for r in members if reads_all else (rank,):
            self._check_location(r, sbuf, si, size, what)
        for r in members if writes_all else (rank,):
            self._check_location(r, dbuf, di, size, what)
        src = self._switch_side(kind, rank, sbuf, si, members if reads_all else (rank,), "reads")
        dst = self._switch_side(kind, rank, dbuf, di, members if writes_all else (rank,), "writes")
        if dst[0] == "input" and self._alias is None:
            raise OperationError(f"{what}: writes {dbuf}[{di}], but the input buffer is read-only in the "
                                 f"out-of-place form (write to 'output')", rank=rank, buffer=dbuf, index=di,
                                 where=user_line(3))
        if writes_all and dst[0] not in self._physical or reads_all and src[0] not in self._physical:
            side, buf = ("writes", dbuf) if writes_all and dst[0] not in self._physical else ("reads", sbuf)
            raise OperationError(f"{what}: {side} {buf} on every member of the switch group, but only the input and "
                                 f"output buffers are laid out alike on every rank (not scratch buffers)",
                                 rank=rank, buffer=buf, where=user_line(3))
        self._account(what, size * len(members), Ref(self, rank, dbuf, di, size), dst[0], dst[1] + size)
        self.has_switch = True
        self._renamed.append(0)
        self._table.add(Op(kind, rank, src[0], src[1], rank, dst[0], dst[1], size, group.channel, None, None,
                           user_line(3), members))
        self._rows = self._table.rows

    def _switch_side(self, kind: OpKind, rank: int, buffer: str, index: int, ranks, how: str) -> tuple[str, int]:
        """(physical buffer, index) of ``buffer[index]`` on each of ``ranks``:
        in place, a buffer aliased at offsets that differ by rank is refused."""
        buffer = getattr(buffer, "value", buffer)
        if self._alias is None or buffer != self._alias[0]:
            return buffer, index
        alias, target, offsets = self._alias
        spots = {offsets[r] for r in ranks}
        if len(spots) > 1:
            raise OperationError(f"{kind.value}: {how} {buffer}[{index}] on every member, but in place {buffer} "
                                 f"lies at a different offset of {target} on each rank; name {target} chunks "
                                 f"instead", rank=rank, buffer=buffer, index=index, where=user_line(4))
        return target, index + spots.pop()

    def _account(self, what: str, moved: int, dst: Ref, buffer: str, end: int) -> None:
        """An op moving ``moved`` chunks into ``dst`` (physical ``buffer`` up
        to chunk ``end``): msc's limit on chunks moved, and a scratch buffer
        grown to what is named."""
        self._moves += moved
        if self._moves > MAX_CHUNK_MOVES:
            raise AlgorithmError(f"{what}: the operations so far move {self._moves} chunks, over msc's limit "
                                 f"of {MAX_CHUNK_MOVES}", where=user_line(3))
        if buffer not in self._physical:
            key = (dst.rank, buffer)
            had = self.scratch_sizes.get(key, 0)
            if had < end:
                self._grow_scratch(what, dst, key, had, end)

    def _grow_scratch(self, what: str, dst: Ref, key: tuple, had: int, size: int) -> None:
        """Scratch buffer ``key`` now holds ``size`` chunks: the verifiers hold
        every chunk up to the highest index named, so the total is bounded."""
        self._chunks += size - had
        if self._chunks > MAX_TOTAL_CHUNKS:
            raise AlgorithmError(f"{what}: rank {dst.rank} {dst.buffer}[{dst.index}:{dst.index + dst.size}] "
                                 f"grows the buffers of all ranks to {self._chunks} chunks, over msc's limit of "
                                 f"{MAX_TOTAL_CHUNKS}", where=user_line(4))
        self.scratch_sizes[key] = size

    def seal(self) -> None:
        self._sealed = True

    def describe_op(self, index: int) -> str:
        """Operation ``index`` in the words the algorithm wrote it (in place:
        ``output[0]`` where that is what it named, not the input it aliases)."""
        op = self.ops[index]
        renamed = self._renamed[index] if index < len(self._renamed) else 0
        if renamed:
            alias, _, offsets = self._alias
            if renamed & 1:
                op = op._replace(src_buffer=alias, src_index=op.src_index - offsets[op.src_rank])
            if renamed & 2:
                op = op._replace(dst_buffer=alias, dst_index=op.dst_index - offsets[op.dst_rank])
        return op.describe()

    def with_ops(self, ops) -> Program:
        """A sealed copy of this program with other operations (for tests and tools)."""
        other = Program(self.name, self.layout, self.params)
        other.ops = tuple(ops)
        other.has_switch = any(op.group for op in ops)
        for op in other.ops:
            if op.dst_buffer not in self.layout.physical_sizes:
                key = (op.dst_rank, op.dst_buffer)
                other.scratch_sizes[key] = max(other.scratch_sizes.get(key, 0), op.dst_index + op.size)
        other._sealed = True
        return other


class Ref:
    """A reference to ``size`` consecutive chunks of a buffer on a rank.

    Treat it as immutable (a plain slots class: tracing builds millions).
    """

    __slots__ = ("program", "rank", "buffer", "index", "size")

    def __init__(self, program: Program, rank: int, buffer: str, index: int, size: int = 1):
        self.program = program
        self.rank = rank
        self.buffer = buffer
        self.index = index
        self.size = size

    def __repr__(self) -> str:
        return f"Ref(rank={self.rank}, buffer={self.buffer!r}, index={self.index}, size={self.size})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, Ref) and self.program is other.program and self.rank == other.rank
                and self.buffer == other.buffer and self.index == other.index and self.size == other.size)

    def __hash__(self) -> int:
        return hash((id(self.program), self.rank, self.buffer, self.index, self.size))

    def copy(self, dst_rank: int, buffer: str | None = None, index: int | None = None, *,
             channel: int | None = None, sendtb: int | None = None, recvtb: int | None = None) -> Ref:
        """Copy these chunks to ``dst_rank``'s ``buffer`` at ``index`` (default:
        same buffer and index): a send and a receive across ranks, a local copy
        on the same rank. Returns the reference to the copy."""
        p = self.program
        buffer = self.buffer if buffer is None else buffer
        index = self.index if index is None else index
        size = self.size
        if not (type(dst_rank) is int and type(index) is int and type(buffer) is str
                and 0 <= dst_rank < p._ranks and index >= 0 and size >= 1
                and index + size <= p._logical.get(buffer, -1) and not p._sealed):
            # not the common case (ints in range of a user buffer): coerce, check and say what is wrong
            if type(dst_rank) is not int or type(index) is not int:
                dst_rank, index = _integer(dst_rank), _integer(index)
            p._check_location(dst_rank, buffer, index, size, "copy")
            buffer = getattr(buffer, "value", buffer)
        dst = Ref(p, dst_rank, buffer, index, size)
        if channel is None and sendtb is None and recvtb is None:
            p._record(_COPY, self.rank, self.buffer, self.index, dst_rank, buffer, index, size)
        else:
            p._record_hinted(_COPY, self, dst, channel, sendtb, recvtb)
        return dst

    def reduce(self, src: Ref, *, channel: int | None = None, sendtb: int | None = None,
               recvtb: int | None = None) -> Ref:
        """Accumulate ``src`` into these chunks; returns this reference."""
        p = self.program
        if not isinstance(src, Ref) or src.program is not p:
            raise OperationError(f"reduce: source must be a chunk reference of the same program, got {src!r}",
                                 rank=self.rank, buffer=self.buffer, index=self.index, where=user_line(2))
        if src.size != self.size:
            raise OperationError(f"reduce: sizes differ: rank {self.rank} {self.buffer}[{self.index}] has size "
                                 f"{self.size}, source rank {src.rank} {src.buffer}[{src.index}] has size {src.size}",
                                 rank=self.rank, buffer=self.buffer, index=self.index, where=user_line(2))
        if p._sealed:
            p._check_location(self.rank, self.buffer, self.index, self.size, "reduce")
        if channel is None and sendtb is None and recvtb is None:
            p._record(_REDUCE, src.rank, src.buffer, src.index, self.rank, self.buffer, self.index, self.size)
        else:
            p._record_hinted(_REDUCE, src, self, channel, sendtb, recvtb)
        return self

    def split(self, parts: int) -> list[Ref]:
        """``parts`` references of equal size that together cover this one."""
        parts = _integer(parts)
        if type(parts) is not int or parts < 1 or self.size % parts:
            raise OperationError(f"split: cannot split {self.size} chunks into {parts!r}{_not_int(parts)} equal parts",
                                 rank=self.rank, buffer=self.buffer, index=self.index, where=user_line(2))
        step = self.size // parts
        return [Ref(self.program, self.rank, self.buffer, self.index + j * step, step) for j in range(parts)]

    def group(self, other: Ref) -> Ref:
        """This reference joined with the one right after it."""
        return group([self, other])


def group(refs) -> Ref:
    """Join references to contiguous chunks of one buffer on one rank."""
    refs = sorted(refs, key=lambda r: r.index)
    if not refs:
        raise OperationError("group: needs at least one reference", where=user_line(2))
    first = refs[0]
    end = first.index + first.size
    for ref in refs[1:]:
        if (ref.program is not first.program or ref.rank != first.rank or ref.buffer != first.buffer
                or ref.index != end):
            raise OperationError(f"group: rank {ref.rank} {ref.buffer}[{ref.index}] does not continue rank "
                                 f"{first.rank} {first.buffer}[{first.index}:{end}]",
                                 rank=ref.rank, buffer=ref.buffer, index=ref.index, where=user_line(2))
        end += ref.size
    return Ref(first.program, first.rank, first.buffer, first.index, end - first.index)


# -- algorithms -----------------------------------------------------------
class TimeLimitExceeded(BaseException):
    """Raised wherever the running code stood when ``--timeout`` expired.

    A ``BaseException``, so that a user's ``except Exception`` does not
    swallow it; tracing and loading pass it through untouched."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"did not finish in {seconds:g} s")


# What the user's code may raise that is not the user's error: passed on as it is.
PASS_THROUGH = (KeyboardInterrupt, TimeLimitExceeded)


def describe(exc: BaseException, context: str) -> str:
    """``TypeName CONTEXT: message`` for an exception from user code (context:
    ``"in algorithm 'ring'"``, ``"while loading ring.py"``); says
    ``sys.exit(...)`` as such, and survives a ``__str__`` that raises."""
    name = type(exc).__name__
    try:
        if isinstance(exc, SystemExit):
            text = f"it called sys.exit({exc.code!r})"
        else:
            text = str(exc)
    except PASS_THROUGH:
        raise
    except BaseException:
        text = f"(the {name} could not be shown: its __str__ raised)"
    return f"{name} {context}: {text}" if text else f"{name} {context}"


@dataclass(frozen=True)
class Algorithm:
    """A collective algorithm: a function of a ``Program`` plus how to size it.

    ``params`` are the function's extra keyword parameters with their
    defaults; ``chunk_factor`` an int or a function (see ``algorithm``);
    ``ranks`` which rank counts it supports: None (all), a predicate, or the
    rank counts (a frozenset or range). ``where`` is the line of the
    ``@msc.algorithm`` decorator, where errors of the sizing functions are
    reported.
    """

    fn: Callable
    name: str
    collective: Collective
    chunk_factor: int | Callable
    inplace: bool
    params: dict[str, Any]
    ranks: Callable | frozenset | range | None = None
    doc: str = ""
    where: SourceLine | None = None

    def __call__(self, program: Program, **params):
        return self.fn(program, **params)

    def bind(self, overrides: dict[str, Any]) -> dict[str, Any]:
        unknown = set(overrides) - set(self.params)
        if unknown:
            known = ", ".join(sorted(self.params)) or "none"
            raise UsageError(f"algorithm {self.name!r} has no parameter {', '.join(sorted(unknown))} (parameters: {known})")
        return {**self.params, **overrides}

    def supports(self, num_ranks: int, **params) -> bool:
        """Whether this algorithm works at ``num_ranks`` with these parameters."""
        if num_ranks < 1:
            return False
        allowed = self.ranks
        if allowed is None:
            return True
        if not callable(allowed):
            return num_ranks in allowed
        bound = self.bind(params)
        verdict = self._call(allowed, "ranks= predicate", num_ranks, bound)
        if isinstance(verdict, bool) or type(verdict).__name__ in ("bool", "bool_"):
            return bool(verdict)
        if type(_integer(verdict)) is int:       # lambda n: n % 2 (truth as an int)
            return bool(verdict)
        raise AlgorithmError(f"algorithm {self.name!r}: its ranks= predicate must return True or False, but "
                             f"{_shown_call('ranks', allowed, num_ranks, bound)} returned {_safe_repr(verdict)} "
                             f"(a {type(verdict).__name__})", where=self.where)

    def chunks(self, num_ranks: int, **params) -> int:
        """Chunks per rank at ``num_ranks`` with these parameters (an int >= 1)."""
        k = self.chunk_factor
        if not callable(k):
            return k
        bound = self.bind(params)
        got = self._call(k, "chunk_factor", num_ranks, bound)
        value = _integer(got)
        if type(value) is not int or value < 1:
            raise AlgorithmError(f"algorithm {self.name!r}: chunk_factor must be an int >= 1, but "
                                 f"{_shown_call('chunk_factor', k, num_ranks, bound)} gave {_safe_repr(got)}",
                                 where=self.where)
        return value

    def _call(self, fn: Callable, what: str, num_ranks: int, bound: dict[str, Any]):
        """Call one of the user's sizing functions; what it raises becomes an
        AlgorithmError at its line in the algorithm's file, else at the
        decorator."""
        try:
            return _call_with(fn, num_ranks, bound)
        except (MscError, *PASS_THROUGH):
            raise
        except BaseException as exc:
            where = _innermost_user_line(exc, self.fn.__code__.co_filename, only_preferred=True)
            raise AlgorithmError(describe(exc, f"in the {what} of algorithm {self.name!r}"),
                                 where=where or self.where) from exc


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):      # builtins without one
        return None


def _call_with(fn: Callable, n: int, params: dict[str, Any]):
    """Call ``fn(n, **the params it names)``."""
    sig = _signature(fn)
    if sig is None:
        return fn(n)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return fn(n, **params)
    return fn(n, **{k: v for k, v in params.items() if k in sig.parameters})


def _shown_call(label: str, fn: Callable, n: int, params: dict[str, Any]) -> str:
    """``chunk_factor(n=8, pieces=-1)``: the call, with the parameter values
    the function reads, for messages."""
    sig = _signature(fn)
    named = {} if sig is None else {k: v for k, v in params.items() if k in sig.parameters or any(
        p.kind is p.VAR_KEYWORD for p in sig.parameters.values())}
    return f"{label}(" + ", ".join([f"n={n}", *(f"{k}={_safe_repr(v)}" for k, v in named.items())]) + ")"


def _safe_repr(value) -> str:
    try:
        return repr(value)
    except PASS_THROUGH:
        raise
    except BaseException:
        return f"<{type(value).__name__}>"


def _rank_counts(ranks) -> Callable | frozenset | range | None:
    """``ranks=`` as the decorator keeps it: a predicate, or the rank counts
    (a range, or a frozenset of ints >= 1); raises ValueError saying why not."""
    if ranks is None or callable(ranks):
        return ranks
    if isinstance(ranks, range):          # arithmetic: min() and len() would walk or overflow a long one
        if not ranks or (ranks[0] if ranks.step > 0 else ranks[-1]) < 1:
            raise ValueError(f"ranks={ranks!r} must hold rank counts >= 1 (and at least one)")
        return ranks
    if isinstance(ranks, (str, bytes, dict)):
        raise ValueError(f"ranks= must be a predicate of the rank count (lambda n: ...), the rank counts "
                         f"(a list, tuple, set or range of ints) or one int; got {ranks!r}")
    one = _integer(ranks)
    if type(one) is int:
        values = [one]
    else:
        try:
            values = list(itertools.islice(ranks, MAX_RANKS + 1))    # an endless iterator stops here
        except TypeError:
            raise ValueError(f"ranks= must be a predicate of the rank count (lambda n: ...), the rank counts "
                             f"(a list, tuple, set or range of ints) or one int; got {_safe_repr(ranks)} "
                             f"(a {type(ranks).__name__})") from None
    if len(values) > MAX_RANKS:
        raise ValueError(f"ranks= lists over {MAX_RANKS} rank counts (msc's limit of ranks; a range or a predicate "
                         f"can say more)")
    counts = [_integer(v) for v in values]
    for value, count in zip(values, counts):
        if type(count) is not int or count < 1:
            raise ValueError(f"ranks= lists rank counts, each an int >= 1; {value!r}{_not_int(count)} is not one")
    if not counts:
        raise ValueError("ranks= lists no rank count: the algorithm would support none")
    return frozenset(counts)


def _check_sizing_function(fn, what: str, params: dict[str, Any], name: str) -> None:
    """A chunk_factor or ranks= function must take the rank count first and
    name only the algorithm's parameters after it (or give them defaults)."""
    sig = _signature(fn)
    if sig is None:
        return
    ps = list(sig.parameters.values())
    if not ps or ps[0].kind not in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD, ps[0].VAR_POSITIONAL):
        raise ValueError(f"{what} must take the rank count as its first parameter (lambda n: ...)")
    for p in ps[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in params or p.default is not p.empty:
            continue
        known = ", ".join(sorted(params)) or "none"
        raise ValueError(f"{what} takes a parameter {p.name!r} that algorithm {name!r} does not have "
                         f"(its parameters: {known})")


def algorithm(collective: str | Collective, chunk_factor: int | Callable = 1, inplace: bool = True,
              ranks: Callable | Iterable[int] | int | None = None, **defaults):
    """Declare a collective algorithm (a decorator of ``fn(program, **params)``).

    ``collective``: a name (``"allreduce"``, ``"allgather"``, ``"reducescatter"``,
    ``"alltoall"``, ``"broadcast"``, ``"reduce"``) or a ``Collective`` object.

    The function's keyword parameters after the program are the algorithm's
    parameters (``--param name=value`` on the command line, where a value is
    read as the type of the parameter's default); other keywords given here
    override their defaults. Rooted collectives get a ``root`` parameter.

    ``chunk_factor``: chunks per rank (per buffer for allreduce, per input for
    allgather, per output for reduce-scatter): an int >= 1, or a function
    called as ``chunk_factor(n, **params)`` with the rank count and those of
    the algorithm's parameters its signature names, e.g. ``lambda n: n`` or
    ``lambda n, pieces: 2 * pieces`` (a default there, ``lambda n, pieces=4:``,
    is only used where the algorithm has no such parameter). It must return
    an int >= 1.

    ``ranks``: which rank counts the algorithm supports (default: every one):
    a predicate called like ``chunk_factor`` that returns True or False
    (``lambda n: n % 2 == 0``, ``lambda n, rows: n % rows == 0``), or the rank
    counts themselves: a list, tuple, set or range (``[8, 64]``,
    ``range(2, 65, 2)``), or one int.

    Mistakes in these arguments are reported at the decorator's line; an
    exception raised inside these functions, or a return value of the wrong
    kind, when they run, at the line of this file where it was raised, else
    at the decorator's line. The functions (and the algorithm) run as plain
    Python with no time limit (``msc verify --timeout`` sets one).
    """
    where = user_line(2)

    def bad(message: str) -> UsageError:
        return UsageError(f"{where}: {message}" if where else message)

    try:
        coll = get_collective(collective)
        rank_counts = _rank_counts(ranks)
    except (UsageError, ValueError) as exc:
        raise bad(str(exc)) from None
    chunk_factor = _checked_chunk_factor(chunk_factor, bad)

    def wrap(fn: Callable) -> Algorithm:
        params = _algorithm_params(fn, coll, defaults, bad)
        try:
            if callable(chunk_factor):
                _check_sizing_function(chunk_factor, "chunk_factor", params, fn.__name__)
            if callable(rank_counts):
                _check_sizing_function(rank_counts, "ranks=", params, fn.__name__)
        except ValueError as exc:
            raise bad(str(exc)) from None
        return Algorithm(fn, fn.__name__, coll, chunk_factor, bool(inplace), params, rank_counts,
                         inspect.getdoc(fn) or "", where)

    return wrap


def _checked_chunk_factor(chunk_factor, bad: Callable[[str], UsageError]):
    """The decorator's ``chunk_factor``: a function as given, else an int >=
    1 (an integer of another type becomes an int); ``bad`` words the error."""
    if callable(chunk_factor):
        return chunk_factor
    k = _integer(chunk_factor)
    if type(k) is not int or k < 1:
        raise bad(f"chunk_factor must be an int >= 1 or a function of the rank count, got "
                  f"{chunk_factor!r}{_not_int(k)}")
    return k


def _algorithm_params(fn: Callable, coll: Collective, defaults: dict, bad: Callable[[str], UsageError]) -> dict:
    """The algorithm's parameters and their defaults: ``fn``'s keyword
    parameters after the program, overridden by the decorator's
    ``defaults``, plus ``root`` for a rooted collective."""
    sig = inspect.signature(fn)
    names = list(sig.parameters)
    if not names:
        raise bad(f"algorithm {fn.__name__!r} must take the program as its first parameter")
    params = {}
    for p in list(sig.parameters.values())[1:]:
        params[p.name] = p.default if p.default is not p.empty else None
    unknown = set(defaults) - set(params)
    if unknown:
        raise bad(f"algorithm {fn.__name__!r}: defaults for unknown parameters {sorted(unknown)}")
    params.update(defaults)
    if coll.has_root:
        params.setdefault("root", 0)
    return params


@pause_gc
def trace(alg: Algorithm, num_ranks: int, *, inplace: bool | None = None, **params) -> Program:
    """Run ``alg`` at ``num_ranks`` ranks and return the traced ``Program``.

    The user's function runs as plain Python, with no time limit. What it
    raises (any exception, ``sys.exit``) becomes an ``AlgorithmError`` at the
    innermost line of the algorithm's file; ``KeyboardInterrupt`` and
    ``TimeLimitExceeded`` pass through."""
    if not isinstance(alg, Algorithm):
        raise UsageError(f"trace needs an @msc.algorithm, got {alg!r}")
    num_ranks = _integer(num_ranks)
    if type(num_ranks) is not int or num_ranks < 1:
        raise UsageError(f"num_ranks must be an int >= 1, got {num_ranks!r}{_not_int(num_ranks)}")
    bound = alg.bind(params)
    shown = " with " + ", ".join(f"{k}={_safe_repr(v)}" for k, v in params.items()) if params else ""
    if not alg.supports(num_ranks, **params):
        raise AlgorithmError(f"algorithm {alg.name!r} does not support {num_ranks} ranks{shown} "
                             f"({_supported(alg, params)})")
    root = bound.get("root", 0) if alg.collective.has_root else 0
    if alg.collective.has_root and (type(root) is not int or not 0 <= root < num_ranks):
        raise AlgorithmError(f"algorithm {alg.name!r}: root {root!r} is not a rank (0..{num_ranks - 1})")
    k = alg.chunks(num_ranks, **params)
    collective = alg.collective
    if isinstance(collective, CustomCollective):      # its functions may ask for the algorithm's parameters
        collective = collective.with_params(bound)
    layout = collective.layout(num_ranks, k, alg.inplace if inplace is None else bool(inplace), root)
    program = Program(alg.name, layout, bound)
    call_params = {k: v for k, v in bound.items() if k in inspect.signature(alg.fn).parameters}
    try:
        alg.fn(program, **call_params)
    except (MscError, *PASS_THROUGH):
        raise
    except BaseException as exc:
        raise AlgorithmError(describe(exc, f"in algorithm {alg.name!r}"),
                             where=_innermost_user_line(exc, alg.fn.__code__.co_filename)) from exc
    program.seal()
    return program


def _supported(alg: Algorithm, params: dict[str, Any]) -> str:
    """The rank counts an algorithm supports, for a message: all of them
    where ``ranks=`` lists them, else those from 1 to 64."""
    allowed = alg.ranks
    if allowed is not None and not callable(allowed):
        if isinstance(allowed, range) and allowed[4096:]:
            return f"supported rank counts: {allowed.start} to {allowed[-1]} in steps of {allowed.step}"
        return f"supported rank counts: {_counts(sorted(allowed))}"
    sample = [n for n in range(1, 65) if _quiet(lambda n=n: alg.supports(n, **params))]
    if not sample:
        return "it supports no rank count from 1 to 64"
    return f"supported rank counts from 1 to 64: {_counts(sample)}"


def _quiet(fn) -> bool:
    try:
        return bool(fn())
    except PASS_THROUGH:
        raise
    except BaseException:
        return False


def _counts(values: list[int]) -> str:
    """``8, 64``; ``2-9``; ``2, 4, ..., 64``: a list of rank counts that
    cannot be misread as a range where it is not one."""
    if len(values) >= 4:
        step = values[1] - values[0]
        if all(b - a == step for a, b in zip(values, values[1:])):
            return f"{values[0]}-{values[-1]}" if step == 1 else f"{values[0]}, {values[1]}, ..., {values[-1]}"
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out += [f"{values[i]}-{values[j]}"] if j - i >= 2 else [str(v) for v in values[i:j + 1]]
        i = j + 1
    return ", ".join(out)


def _innermost_user_line(exc: BaseException, prefer: str | None = None,
                         only_preferred: bool = False) -> SourceLine | None:
    """The innermost traceback line in the file ``prefer`` (the algorithm's
    own file) if any, else (unless ``only_preferred``) the innermost line
    outside msc."""
    tb, last, preferred = exc.__traceback__, None, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not _internal(name):
            last = SourceLine(_display_path(name), tb.tb_lineno)
            if name == prefer:
                preferred = last
        tb = tb.tb_next
    return preferred if only_preferred else preferred or last
