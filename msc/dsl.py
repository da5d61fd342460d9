"""The user-facing DSL: ``@msc.algorithm``, ``Program``, ``Ref``, ``group``.

Tracing runs the user's function once against a ``Program`` that records
every copy and reduce as an ``ir.Op`` with the user's source line. Static
mistakes (a rank that does not exist, an index out of range, mismatched
sizes) raise ``OperationError`` at once, at the user's line; what chunks
end up holding is the verifier's business (``msc.verify``).
"""
from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable

from msc.collectives import Collective, Layout, get_collective
from msc.errors import AlgorithmError, MscError, OperationError, SourceLine, UsageError
from msc.ir import Op, OpKind
from msc.perf import pause_gc

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIR = _PACKAGE_DIR + "algorithms" + os.sep   # where a wheel puts the algorithm library


def _internal(filename: str) -> bool:
    """Frames of msc itself (not the algorithm library a wheel ships inside it)."""
    return filename.startswith(_PACKAGE_DIR) and not filename.startswith(_LIBRARY_DIR)
_lines: dict[tuple[str, int], SourceLine] = {}


def user_line(depth: int = 2) -> SourceLine | None:
    """The first frame outside the msc package: the user's line."""
    frame = sys._getframe(depth)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    key = (frame.f_code.co_filename, frame.f_lineno)
    hit = _lines.get(key)
    if hit is None:
        hit = _lines[key] = SourceLine(_display_path(key[0]), key[1])
    return hit


def _display_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith(".." + os.sep + "..") else rel


class Program:
    """The program being traced: ranks, buffers and the operations so far.

    ``num_ranks``, ``chunk_factor``, ``root`` and ``params`` describe the
    instance; ``ops`` is the trace (a tuple once tracing has finished).
    """

    def __init__(self, name: str, layout: Layout, params: dict[str, Any] | None = None):
        self.name = name
        self.layout = layout
        self.params = dict(params or {})
        self.ops: list[Op] | tuple[Op, ...] = []
        self.scratch_sizes: dict[tuple[int, str], int] = {}
        self._sealed = False
        # (ops verified, report) of the last MSCCLang Check(): `msc verify` reuses it for the sealed program
        self.check_report = None
        self._columns = None              # (ops, OpColumns): the sealed ops as arrays, read once
        self._physical = layout.physical_sizes
        self._logical = layout.logical_sizes
        self._alias = layout.alias_table

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

    def chunk_ops(self) -> int:
        return sum(map(attrgetter("size"), self.ops))      # in C: millions of ops at scale

    def columns(self):
        """The operations as numpy columns (msc.columns.OpColumns), for the
        bulk passes; a sealed program reads them once for the verifier and
        lowering both."""
        from msc.columns import OpColumns      # numpy: only where a pass runs in bulk

        if self._columns is not None and self._columns[0] is self.ops:
            return self._columns[1]
        columns = OpColumns(self.ops)
        if self._sealed:
            self._columns = (self.ops, columns)
        return columns

    def __repr__(self) -> str:
        return (f"Program({self.name!r}, {self.collective}, ranks={self.num_ranks}, "
                f"chunk_factor={self.chunk_factor}, inplace={self.inplace}, ops={len(self.ops)})")

    # -- the DSL ----------------------------------------------------------
    def chunk(self, rank: int, buffer: str, index: int, size: int = 1) -> Ref:
        """A reference to ``size`` chunks of ``buffer`` on ``rank`` from ``index``."""
        self._check_location(rank, buffer, index, size, "chunk")
        return Ref(self, rank, buffer, index, size)

    def _check_location(self, rank, buffer, index, size, what) -> None:
        if self._sealed:
            raise OperationError(f"{what}: program {self.name!r} has finished tracing; it can no longer change",
                                 where=user_line(3))
        n = self.layout.num_ranks
        if type(rank) is not int or not 0 <= rank < n:
            raise OperationError(f"{what}: rank {rank!r} does not exist (ranks are 0..{n - 1})",
                                 rank=rank if isinstance(rank, int) else None, buffer=buffer, index=index,
                                 where=user_line(3))
        if type(buffer) is not str or not buffer:
            buffer = getattr(buffer, "value", buffer)  # MSCCLang-style Buffer enums
            if type(buffer) is not str or not buffer:
                raise OperationError(f"{what}: buffer must be a name, got {buffer!r}", rank=rank, where=user_line(3))
        if type(index) is not int or index < 0:
            raise OperationError(f"{what}: index {index!r} on rank {rank} {buffer} must be an int >= 0",
                                 rank=rank, buffer=buffer, where=user_line(3))
        if type(size) is not int or size < 1:
            raise OperationError(f"{what}: size {size!r} must be an int >= 1",
                                 rank=rank, buffer=buffer, index=index, where=user_line(3))
        limit = self._logical.get(buffer)
        if limit is not None and index + size > limit:
            span = f"[{index}]" if size == 1 else f"[{index}:{index + size}]"
            raise OperationError(f"{what}: index out of range: rank {rank} {buffer}{span}, "
                                 f"but {buffer} has {limit} chunks", rank=rank, buffer=buffer, index=index,
                                 where=user_line(3))

    def _record(self, kind: OpKind, src: Ref, dst: Ref, channel, sendtb, recvtb) -> None:
        if channel is not None or sendtb is not None or recvtb is not None:
            for hint, value in (("channel", channel), ("sendtb", sendtb), ("recvtb", recvtb)):
                if value is not None and (type(value) is not int or value < 0):
                    raise OperationError(f"{kind.value}: hint {hint}={value!r} must be an int >= 0 or None",
                                         rank=dst.rank, buffer=dst.buffer, index=dst.index, where=user_line(3))
        sbuf, soff, dbuf, doff = src.buffer, 0, dst.buffer, 0
        if self._alias is not None:
            alias, target, offsets = self._alias
            if sbuf == alias:
                sbuf, soff = target, offsets[src.rank]
            if dbuf == alias:
                dbuf, doff = target, offsets[dst.rank]
        si, di, size = src.index + soff, dst.index + doff, src.size
        if dbuf == "input" and self._alias is None:
            raise OperationError(f"{kind.value}: writes rank {dst.rank} input[{dst.index}], but the input buffer is "
                                 f"read-only in the out-of-place form (write to 'output' or a scratch buffer)",
                                 rank=dst.rank, buffer="input", index=dst.index, where=user_line(3))
        if src.rank == dst.rank and sbuf == dbuf and si < di + size and di < si + size:
            if kind is OpKind.COPY and si == di:
                return  # copying a chunk onto itself (in-place aliasing): nothing to do
            raise OperationError(f"{kind.value}: source rank {src.rank} {src.buffer}[{src.index}] and destination "
                                 f"{dst.buffer}[{dst.index}] (size {size}) overlap", rank=dst.rank,
                                 buffer=dst.buffer, index=dst.index, where=user_line(3))
        if dbuf not in self._physical:
            key = (dst.rank, dbuf)
            if self.scratch_sizes.get(key, 0) < di + size:
                self.scratch_sizes[key] = di + size
        self.ops.append(Op(kind, src.rank, sbuf, si, dst.rank, dbuf, di, size,
                           channel, sendtb, recvtb, user_line(3)))

    def seal(self) -> None:
        self.ops = tuple(self.ops)
        self._sealed = True

    def with_ops(self, ops) -> Program:
        """A sealed copy of this program with other operations (for tests and tools)."""
        other = Program(self.name, self.layout, self.params)
        other.ops = tuple(ops)
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
        p._check_location(dst_rank, buffer, index, self.size, "copy")
        dst = Ref(p, dst_rank, getattr(buffer, "value", buffer), index, self.size)
        p._record(OpKind.COPY, self, dst, channel, sendtb, recvtb)
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
        p._record(OpKind.REDUCE, src, self, channel, sendtb, recvtb)
        return self

    def split(self, parts: int) -> list[Ref]:
        """``parts`` references of equal size that together cover this one."""
        if type(parts) is not int or parts < 1 or self.size % parts:
            raise OperationError(f"split: cannot split {self.size} chunks into {parts!r} equal parts",
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
@dataclass(frozen=True)
class Algorithm:
    """A collective algorithm: a function of a ``Program`` plus how to size it.

    ``params`` are the function's extra keyword parameters with their
    defaults; ``ranks`` (optional) says which rank counts it supports.
    """

    fn: Callable
    name: str
    collective: Collective
    chunk_factor: int | Callable
    inplace: bool
    params: dict[str, Any]
    ranks: Callable | None = None
    doc: str = ""

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
        if self.ranks is None:
            return True
        return bool(_call_with(self.ranks, num_ranks, self.bind(params)))

    def chunks(self, num_ranks: int, **params) -> int:
        k = self.chunk_factor
        k = _call_with(k, num_ranks, self.bind(params)) if callable(k) else k
        if type(k) is not int or k < 1:
            raise AlgorithmError(f"algorithm {self.name!r}: chunk_factor must be an int >= 1, got {k!r}")
        return k


def _call_with(fn: Callable, n: int, params: dict[str, Any]):
    """Call ``fn(n, **the params it names)``."""
    sig = inspect.signature(fn)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return fn(n, **params)
    return fn(n, **{k: v for k, v in params.items() if k in sig.parameters})


def algorithm(collective: str | Collective, chunk_factor: int | Callable = 1, inplace: bool = True,
              ranks: Callable | None = None, **defaults):
    """Declare a collective algorithm.

    ``chunk_factor``: chunks per rank (per buffer for allreduce, per input for
    allgather, per output for reduce-scatter), an int or a function of the
    rank count (and of the algorithm's parameters it names). ``ranks``: an
    optional predicate of the rank count (and parameters) saying which rank
    counts are supported. Other keywords override the defaults of the
    function's own keyword parameters.
    """
    coll = get_collective(collective)

    def wrap(fn: Callable) -> Algorithm:
        sig = inspect.signature(fn)
        names = list(sig.parameters)
        if not names:
            raise UsageError(f"algorithm {fn.__name__!r} must take the program as its first parameter")
        params = {}
        for p in list(sig.parameters.values())[1:]:
            params[p.name] = p.default if p.default is not p.empty else None
        unknown = set(defaults) - set(params)
        if unknown:
            raise UsageError(f"algorithm {fn.__name__!r}: defaults for unknown parameters {sorted(unknown)}")
        params.update(defaults)
        if coll.has_root:
            params.setdefault("root", 0)
        return Algorithm(fn, fn.__name__, coll, chunk_factor, bool(inplace), params, ranks,
                         inspect.getdoc(fn) or "")

    return wrap


@pause_gc
def trace(alg: Algorithm, num_ranks: int, *, inplace: bool | None = None, **params) -> Program:
    """Run ``alg`` at ``num_ranks`` ranks and return the traced ``Program``."""
    if not isinstance(alg, Algorithm):
        raise UsageError(f"trace needs an @msc.algorithm, got {alg!r}")
    if type(num_ranks) is not int or num_ranks < 1:
        raise UsageError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    bound = alg.bind(params)
    shown = f" with {params}" if params else ""
    supported = _user_call(alg, "its ranks= predicate", lambda: alg.supports(num_ranks, **params))
    if not supported:
        sample = [n for n in range(1, 65) if _quiet(lambda n=n: alg.supports(n, **params))]
        hint = f" (it supports {_compact(sample)} up to 64)" if sample else ""
        raise AlgorithmError(f"algorithm {alg.name!r} does not support {num_ranks} ranks{shown}{hint}")
    root = bound.get("root", 0) if alg.collective.has_root else 0
    if alg.collective.has_root and (type(root) is not int or not 0 <= root < num_ranks):
        raise AlgorithmError(f"algorithm {alg.name!r}: root {root!r} is not a rank (0..{num_ranks - 1})")
    k = _user_call(alg, "its chunk_factor", lambda: alg.chunks(num_ranks, **params))
    layout = alg.collective.layout(num_ranks, k, alg.inplace if inplace is None else bool(inplace), root)
    program = Program(alg.name, layout, bound)
    call_params = {k: v for k, v in bound.items() if k in inspect.signature(alg.fn).parameters}
    try:
        alg.fn(program, **call_params)
    except MscError:
        raise
    except Exception as exc:
        raise AlgorithmError(f"{type(exc).__name__} in algorithm {alg.name!r}: {exc}",
                             where=_innermost_user_line(exc, alg.fn.__code__.co_filename)) from exc
    program.seal()
    return program


def _user_call(alg: Algorithm, what: str, fn):
    """Call the user's sizing code; its exceptions become AlgorithmError."""
    try:
        return fn()
    except MscError:
        raise
    except Exception as exc:
        raise AlgorithmError(f"{type(exc).__name__} in {what} of algorithm {alg.name!r}: {exc}",
                             where=_innermost_user_line(exc, alg.fn.__code__.co_filename)) from exc


def _quiet(fn) -> bool:
    try:
        return bool(fn())
    except Exception:
        return False


def _compact(values: list[int]) -> str:
    from msc.verify import _ranges

    return _ranges(values).replace(",", ", ")


def _innermost_user_line(exc: BaseException, prefer: str | None = None) -> SourceLine | None:
    """The innermost traceback line in the file ``prefer`` (the algorithm's
    own file) if any, else the innermost line outside msc."""
    tb, last, preferred = exc.__traceback__, None, None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not _internal(name):
            last = SourceLine(_display_path(name), tb.tb_lineno)
            if name == prefer:
                preferred = last
        tb = tb.tb_next
    return preferred or last
