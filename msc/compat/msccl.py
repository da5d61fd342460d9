"""MSCCLang on msc: port an msccl-tools program by changing its imports to
``from msc.compat.msccl import *``.

A ``with MSCCLProgram(...)`` block traces into a native ``msc.Program``;
``chunk()`` and the returned references record native copies and reduces,
each with the user's source line, and ``Check()`` runs ``msc.verify``.

Where this layer follows MSCCLang:

- References point at *physical* chunks, as MSCCLang's do: in-place
  ``chunk(r, Buffer.input, i)`` of an allgather is output chunk ``r*k+i``,
  and a ``copy`` with no buffer goes to that same physical place on the
  destination rank.
- The chunk's contents are tracked while tracing, so ``chunk()`` on a slot
  that holds nothing returns None (MSCCLang: an unwritten output slot of an
  out-of-place collective, a scratch slot nothing wrote) and
  ``get_origin_rank``/``get_dst_index``/... work as in MSCCLang. Only the
  first slot decides, as in MSCCLang.
- ``copy(dst, buffer, index=-1)``: no buffer means the source's buffer and
  index; a scratch buffer with index -1 appends after the last chunk that
  buffer has on ``dst``. Hints of -1 mean "no hint"; ``ch`` is the channel.
- Copies and reduces across ranks need a link in the topology.
- A copy of a chunk onto itself (in-place aliasing) is dropped.

Where it differs (each an error where MSCCLang would misbehave quietly, or a
convenience where MSCCLang returns nothing):

- ``Check()`` raises ``msc.VerificationError`` naming the rank, index,
  expected and found contributions and the user's line; MSCCLang printed
  and returned False. It returns True on success.
- ``copy`` onto the chunk itself returns the reference (MSCCLang: None), and
  ``with MSCCLProgram(...) as p`` binds the program (MSCCLang: None).
- An explicit destination buffer is aliased with the *destination* rank's
  layout (MSCCLang used the source rank's offsets, which lands in-place
  allgather/reduce-scatter copies in the wrong place). ``index=-1`` with
  ``Buffer.input``/``Buffer.output`` means the source's index.
- The out-of-place input buffer is read-only (native msc rule; NCCL's send
  buffer is const); MSCCLang allowed writing it.
- ``group`` refuses a gap between the two references (MSCCLang silently
  covered it); sizes of a reduce must match.
- Misuse (``chunk()`` outside a program, nested programs) raises
  ``msc.AlgorithmError`` at the user's line instead of RuntimeError;
  invalid ranks and indices raise ``msc.OperationError``.
- Custom collectives written as MSCCLang ``Collective`` subclasses with
  ``init_buffers``/``check`` are not supported; a subclass can instead set
  ``native`` to an ``msc.CustomCollective``.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
from enum import Enum
from typing import Iterator, NamedTuple

from msc import dsl as _dsl
from msc.collectives import Collective as _NativeCollective
from msc.collectives import get_collective
from msc.dsl import user_line
from msc.errors import AlgorithmError, MscError, OperationError
from msc.verify import verify

__all__ = [
    "MSCCLProgram", "chunk", "Check", "XML", "Ref",
    "Buffer", "ThreadblockPolicy",
    "Topology", "fully_connected", "ring", "line", "star", "hub_and_spoke",
    "Collective", "AllReduce", "AllGather", "ReduceScatter", "AllToAll",
]

PROTOCOLS = ("Simple", "LL", "LL128")


class Buffer(str, Enum):
    """MSCCLang's buffer names; any other string names a scratch buffer.

    A ``str`` enum, so ``ref.buffer == Buffer.input`` holds for a reference
    to the input buffer (references carry plain names)."""

    input = "input"
    output = "output"
    scratch = "scratch"

    def __str__(self) -> str:
        return self.value


class ThreadblockPolicy(Enum):
    """Who assigns threadblocks at lowering: msc (auto) or the user's
    ``sendtb``/``recvtb`` hints (manual)."""

    auto = "auto"
    manual = "manual"

    def __str__(self) -> str:
        return self.value


# -- topologies -------------------------------------------------------------
class Topology:
    """Ranks and links: ``links[dst][src]`` is the bandwidth from ``src`` to
    ``dst`` (0: no link), MSCCLang's convention."""

    def __init__(self, name: str, links, switches=()):
        rows = [list(row) for row in links]
        if not rows or any(len(row) != len(rows) for row in rows):
            raise AlgorithmError(f"topology {name!r}: links must be a non-empty square matrix", where=user_line())
        self.name = name
        self.links = rows
        self.switches = list(switches)

    @property
    def num_ranks(self) -> int:
        return len(self.links)

    ngpus = num_ranks

    def num_nodes(self) -> int:
        return len(self.links)

    def nodes(self) -> range:
        return range(len(self.links))

    def link(self, src: int, dst: int):
        return self.links[dst][src]

    def sources(self, dst: int) -> Iterator[int]:
        return (src for src, bw in enumerate(self.links[dst]) if bw > 0)

    def destinations(self, src: int) -> Iterator[int]:
        return (dst for dst, row in enumerate(self.links) if row[src] > 0)

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, {self.num_ranks} ranks)"


def _rank_count(num_nodes, what: str) -> int:
    if type(num_nodes) is not int or num_nodes < 1:
        raise AlgorithmError(f"{what}: the number of ranks must be an int >= 1, got {num_nodes!r}",
                             where=user_line())
    return num_nodes


def fully_connected(num_nodes: int) -> Topology:
    """Every rank linked to every other rank."""
    n = _rank_count(num_nodes, "fully_connected")
    return Topology(f"FullyConnected(n={n})", [[int(s != d) for s in range(n)] for d in range(n)])


def ring(num_nodes: int) -> Topology:
    """Each rank linked (both ways) to its two neighbours on a ring."""
    n = _rank_count(num_nodes, "ring")
    return Topology(f"Ring(n={n})", [[int(n > 1 and (s - d) % n in (1, n - 1)) for s in range(n)]
                                     for d in range(n)])


def line(num_nodes: int) -> Topology:
    """Each rank linked (both ways) to its neighbours on a line."""
    n = _rank_count(num_nodes, "line")
    return Topology(f"Line(n={n})", [[int(abs(s - d) == 1) for s in range(n)] for d in range(n)])


def star(num_nodes: int, non_blocking: bool = True) -> Topology:
    """Rank 0 linked (both ways) to every other rank."""
    n = _rank_count(num_nodes, "star")
    return Topology(f"Star(n={n})", [[int(s != d and 0 in (s, d)) for s in range(n)] for d in range(n)])


def hub_and_spoke(num_nodes: int) -> Topology:
    """Every rank linked to every other through a switch (links as fully connected)."""
    n = _rank_count(num_nodes, "hub_and_spoke")
    return Topology(f"HubAndSpoke(n={n})", [[int(s != d) for s in range(n)] for d in range(n)])


# -- collectives ------------------------------------------------------------
class Collective:
    """A collective at a rank count: ``num_ranks``, ``chunk_factor`` (chunks
    per rank, as in msc), ``inplace``; ``native`` is the msc collective.

    A subclass may describe its own collective by setting ``native`` to an
    ``msc.CustomCollective``."""

    name = "custom"
    _native_name: str | None = None

    def __init__(self, num_ranks: int, chunk_factor: int, inplace: bool):
        for label, value in (("num_ranks", num_ranks), ("chunk_factor", chunk_factor)):
            if type(value) is not int or value < 1:
                raise AlgorithmError(f"{type(self).__name__}: {label} must be an int >= 1, got {value!r}",
                                     where=user_line())
        self.num_ranks = num_ranks
        self.chunk_factor = chunk_factor
        self.inplace = bool(inplace)
        self._native = get_collective(self._native_name) if self._native_name else None

    @property
    def native(self) -> _NativeCollective:
        if self._native is None:
            raise AlgorithmError(
                f"collective {type(self).__name__}: MSCCLang custom collectives (init_buffers/check) are not "
                f"supported; set `native` on the class to an msc.CustomCollective describing it",
                where=user_line())
        return self._native

    def destination(self, rank: int, index: int) -> tuple[int, int]:
        """(rank, index) where input chunk ``index`` of ``rank`` must end up;
        -1 where it goes to every rank (MSCCLang's ``dst_rank``/``dst_index``)."""
        return (-1, -1)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_ranks={self.num_ranks}, chunk_factor={self.chunk_factor}, "
                f"inplace={self.inplace})")


class AllReduce(Collective):
    name = "allreduce"
    _native_name = "allreduce"

    def destination(self, rank, index):
        return (-1, index)


class AllGather(Collective):
    name = "allgather"
    _native_name = "allgather"

    def destination(self, rank, index):
        return (-1, rank * self.chunk_factor + index)


class ReduceScatter(Collective):
    name = "reduce_scatter"
    _native_name = "reducescatter"

    def destination(self, rank, index):
        return divmod(index, self.chunk_factor)


class AllToAll(Collective):
    name = "alltoall"
    _native_name = "alltoall"

    def destination(self, rank, index):
        k = self.chunk_factor
        return (index // k, rank * k + index % k)


# -- what chunks hold while tracing -------------------------------------------
class _Chunk(NamedTuple):
    """An input chunk: where it started and where the collective sends it."""

    origin_rank: int
    origin_index: int
    dst_rank: int
    dst_index: int


class _Reduction:
    """A slot holding a reduction of several chunks (no single origin)."""

    def __repr__(self) -> str:
        return "<reduction of several chunks>"


_REDUCED = _Reduction()


# -- programs -------------------------------------------------------------------
# The program being traced, per context (thread or task): a stack so that
# nesting can be detected and named. ``_collector`` is the list collecting()
# fills, or None.
_programs: contextvars.ContextVar[tuple] = contextvars.ContextVar("msc_msccl_programs", default=())
_collector: contextvars.ContextVar[list | None] = contextvars.ContextVar("msc_msccl_collector", default=None)


def _current(what: str) -> MSCCLProgram:
    stack = _programs.get()
    if not stack:
        raise AlgorithmError(f"{what}() needs a program: call it inside a `with MSCCLProgram(...):` block",
                             where=user_line())
    return stack[-1]


class MSCCLProgram:
    """An MSCCLang program; use it as a ``with`` block.

    The lowering options (``instances``, ``protocol``,
    ``threadblock_policy``, ``interleaved_replication``, ``instr_fusion``,
    ``check_xml``, ``dependence_nop``) are kept as attributes and copied
    into the native program's ``params``; ``program`` is the native
    ``msc.Program`` (built on entering the block, sealed on leaving it).
    """

    def __init__(self, name, topo, collective, instances, protocol="Simple",
                 threadblock_policy=ThreadblockPolicy.auto, interleaved_replication=True,
                 instr_fusion=True, check_xml=True, dependence_nop=False):
        if type(name) is not str or not name:
            raise AlgorithmError(f"MSCCLProgram: name must be a non-empty string, got {name!r}", where=user_line())
        if not isinstance(collective, Collective):
            raise AlgorithmError(f"MSCCLProgram {name!r}: collective must be AllReduce, AllGather, ReduceScatter, "
                                 f"AllToAll or another Collective, got {collective!r}", where=user_line())
        num_ranks = _topology_ranks(topo, name)
        if num_ranks != collective.num_ranks:
            raise AlgorithmError(f"MSCCLProgram {name!r}: the topology has {num_ranks} ranks but the collective "
                                 f"has {collective.num_ranks}", where=user_line())
        if type(instances) is not int or instances < 1:
            raise AlgorithmError(f"MSCCLProgram {name!r}: instances must be an int >= 1, got {instances!r}",
                                 where=user_line())
        if protocol not in PROTOCOLS:
            raise AlgorithmError(f"MSCCLProgram {name!r}: protocol must be one of {', '.join(PROTOCOLS)}, "
                                 f"got {protocol!r}", where=user_line())
        try:
            threadblock_policy = ThreadblockPolicy(threadblock_policy)
        except ValueError:
            raise AlgorithmError(f"MSCCLProgram {name!r}: threadblock_policy must be ThreadblockPolicy.auto or "
                                 f".manual, got {threadblock_policy!r}", where=user_line()) from None
        self.name = name
        self.topo = topo
        self.collective = collective
        self.num_ranks = num_ranks
        self.instances = instances
        self.protocol = protocol
        self.threadblock_policy = threadblock_policy
        self.interleaved_replication = bool(interleaved_replication)
        self.instr_fusion = bool(instr_fusion)
        self.check_xml = bool(check_xml)
        self.dependence_nop = bool(dependence_nop)
        self.program: _dsl.Program | None = None
        self._link = getattr(topo, "link", None)
        self._slots: dict[tuple[int, str], list] = {}

    def __repr__(self) -> str:
        return (f"MSCCLProgram({self.name!r}, {self.collective!r}, instances={self.instances}, "
                f"protocol={self.protocol!r})")

    # -- the with block ---------------------------------------------------------
    def __enter__(self) -> MSCCLProgram:
        stack = _programs.get()
        if stack:
            raise AlgorithmError(f"MSCCLProgram {self.name!r} is opened inside MSCCLProgram {stack[-1].name!r}; "
                                 f"programs cannot be nested (finish one `with` block before the next)",
                                 where=user_line())
        if self.program is not None:
            raise AlgorithmError(f"MSCCLProgram {self.name!r} was already traced; create a new MSCCLProgram",
                                 where=user_line())
        c = self.collective
        layout = c.native.layout(self.num_ranks, c.chunk_factor, c.inplace)
        self.program = _dsl.Program(self.name, layout, self.options())
        _programs.set(stack + (self,))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack = _programs.get()
        if stack and stack[-1] is self:
            _programs.set(stack[:-1])
        self.program.seal()
        if exc_type is None:
            sink = _collector.get()
            if sink is not None:
                sink.append(self.program)
        return False

    def options(self) -> dict:
        """The lowering options, as plain values."""
        return {"instances": self.instances, "protocol": self.protocol,
                "threadblock_policy": self.threadblock_policy.value,
                "interleaved_replication": self.interleaved_replication, "instr_fusion": self.instr_fusion,
                "check_xml": self.check_xml, "dependence_nop": self.dependence_nop}

    # -- MSCCLang's program methods -------------------------------------------------
    def check(self) -> bool:
        """Verify the operations so far (raises ``msc.VerificationError``)."""
        self.program.check_report = (len(self.program.ops), verify(self.program))
        return True

    def generate_xml(self) -> str:
        """The MSCCL-IR XML of the program (needs ``msc.xml_export``)."""
        return _xml_string(self)

    # -- tracing helpers used by chunk() and Ref ----------------------------------------
    def _chunk(self, rank, buffer, index, size) -> Ref | None:
        name = _buffer_name(buffer, "chunk")
        self.program.chunk(rank, name, index, size)  # validates rank, index and size
        phys, at = self._physical(rank, name, index)
        if self._held(rank, phys, at) is None:
            return None  # MSCCLang: no chunk there (yet)
        return Ref(self, rank, phys, at, size)

    def _physical(self, rank: int, buffer: str, index: int) -> tuple[str, int]:
        phys, offset = self.program.layout.alias(rank, buffer)
        return phys, index + offset

    def _contents(self, rank: int, buffer: str) -> list:
        """What each chunk of ``buffer`` on ``rank`` holds (built on first use)."""
        key = (rank, buffer)
        slots = self._slots.get(key)
        if slots is None:
            layout = self.program.layout
            slots = self._slots[key] = [None] * layout.physical_sizes.get(buffer, 0)
            if buffer in layout.physical_sizes:
                dest = self.collective.destination
                for buf, index, (origin_rank, origin_index) in layout.initial(rank):
                    if buf == buffer:
                        slots[index] = _Chunk(origin_rank, origin_index, *dest(origin_rank, origin_index))
        return slots

    def _held(self, rank: int, buffer: str, index: int):
        slots = self._contents(rank, buffer)
        return slots[index] if index < len(slots) else None

    def _next_free(self, rank, buffer: str) -> int:
        """Where index -1 puts a chunk in a scratch buffer: after its last one."""
        slots = self._slots.get((rank, buffer))
        return 0 if slots is None else len(slots)

    def _moved(self, src: Ref, dst_rank: int, dst_buffer: str, dst_index: int, reduce: bool) -> None:
        """Track a copy or reduce of ``src`` into the given physical place."""
        held = self._contents(src.rank, src.buffer)
        values = [held[i] if i < len(held) else None for i in range(src.index, src.index + src.size)]
        target = self._contents(dst_rank, dst_buffer)
        end = dst_index + src.size
        if len(target) < end:
            target.extend([None] * (end - len(target)))
        for j, value in enumerate(values):
            if reduce:
                old = target[dst_index + j]
                # Reducing with an empty chunk leaves nothing usable (Check() reports the op).
                value = _REDUCED if old is not None and value is not None else None
            target[dst_index + j] = value

    def _check_link(self, src: int, dst, what: str) -> None:
        if self._link is None or src == dst or type(dst) is not int or not 0 <= dst < self.num_ranks:
            return  # a bad rank is reported by the native API
        if not self._link(src, dst):
            raise OperationError(f"{what}: topology {getattr(self.topo, 'name', self.topo)!r} has no link from "
                                 f"rank {src} to rank {dst}", rank=dst, where=user_line())


def _topology_ranks(topo, name: str) -> int:
    count = topo.num_nodes() if callable(getattr(topo, "num_nodes", None)) else getattr(topo, "num_ranks", None)
    if type(count) is not int or count < 1:
        raise AlgorithmError(f"MSCCLProgram {name!r}: topology must be a Topology (e.g. fully_connected(n)), "
                             f"got {topo!r}", where=user_line())
    return count


def _buffer_name(buffer, what: str) -> str:
    if isinstance(buffer, Buffer):
        return buffer.value
    if type(buffer) is str and buffer:
        return buffer
    raise OperationError(f"{what}: buffer must be Buffer.input, Buffer.output, Buffer.scratch or the name of a "
                         f"scratch buffer, got {buffer!r}", buffer=None, where=user_line())


def _hint(value):
    """MSCCLang's -1 ("no hint") is msc's None."""
    return None if value is None or value == -1 else value


class Ref(_dsl.Ref):
    """A reference to ``size`` chunks at a physical place, with MSCCLang's
    methods. ``prog`` is the MSCCLProgram."""

    __slots__ = ("_owner",)

    def __init__(self, owner: MSCCLProgram, rank: int, buffer: str, index: int, size: int = 1):
        super().__init__(owner.program, rank, buffer, index, size)
        self._owner = owner

    @property
    def prog(self) -> MSCCLProgram:
        return self._owner

    def copy(self, dst, buffer=None, index=-1, sendtb=-1, recvtb=-1, ch=-1) -> Ref:
        """Copy these chunks to rank ``dst`` (a send and a receive, or a
        local copy); returns the reference to the copy."""
        owner = self._owner
        if buffer is None:
            name = self.buffer
            index = self.index if index in (-1, None) else index
        else:
            name = _buffer_name(buffer, "copy")
            if index in (-1, None):
                index = self.index if name in ("input", "output") else owner._next_free(dst, name)
        owner._check_link(self.rank, dst, "copy")
        out = _dsl.Ref.copy(self, dst, name, index, channel=_hint(ch), sendtb=_hint(sendtb), recvtb=_hint(recvtb))
        phys, at = owner._physical(out.rank, out.buffer, out.index)
        owner._moved(self, out.rank, phys, at, reduce=False)
        return Ref(owner, out.rank, phys, at, out.size)

    def reduce(self, other_chunkref, sendtb=-1, recvtb=-1, ch=-1) -> Ref:
        """Accumulate ``other_chunkref`` into these chunks; returns this reference."""
        owner = self._owner
        if isinstance(other_chunkref, _dsl.Ref):
            owner._check_link(other_chunkref.rank, self.rank, "reduce")
        _dsl.Ref.reduce(self, other_chunkref, channel=_hint(ch), sendtb=_hint(sendtb), recvtb=_hint(recvtb))
        owner._moved(other_chunkref, self.rank, self.buffer, self.index, reduce=True)
        return self

    def split(self, num: int) -> list[Ref]:
        """``num`` equal references that together cover this one."""
        return [Ref(self._owner, r.rank, r.buffer, r.index, r.size) for r in _dsl.Ref.split(self, num)]

    def group(self, other: Ref) -> Ref:
        """This reference joined with ``other`` (same rank and buffer, adjacent or overlapping)."""
        if not isinstance(other, _dsl.Ref) or other.program is not self.program:
            raise OperationError(f"group: needs a chunk reference of the same program, got {other!r}",
                                 rank=self.rank, buffer=self.buffer, index=self.index, where=user_line())
        if other.rank != self.rank or other.buffer != self.buffer:
            raise OperationError(f"group: rank {other.rank} {other.buffer}[{other.index}] is not on rank {self.rank} "
                                 f"{self.buffer}", rank=other.rank, buffer=other.buffer, index=other.index,
                                 where=user_line())
        first, second = (self, other) if self.index <= other.index else (other, self)
        if second.index > first.index + first.size:
            raise OperationError(f"group: rank {self.rank} {self.buffer}[{first.index}:{first.index + first.size}] "
                                 f"and [{second.index}:{second.index + second.size}] leave a gap",
                                 rank=self.rank, buffer=self.buffer, index=second.index, where=user_line())
        end = max(first.index + first.size, second.index + second.size)
        return Ref(self._owner, self.rank, self.buffer, first.index, end - first.index)

    # -- what the chunks hold (MSCCLang's chunk metadata) -----------------------------
    def _input_chunk(self, i: int, what: str) -> _Chunk:
        held = self._owner._held(self.rank, self.buffer, self.index + i)
        if held is None or held is _REDUCED:
            state = "holds no chunk" if held is None else "holds a reduction of several chunks"
            raise OperationError(f"{what}: rank {self.rank} {self.buffer}[{self.index + i}] {state}, so it has no "
                                 f"single origin", rank=self.rank, buffer=self.buffer, index=self.index + i,
                                 where=user_line())
        return held

    def get_origin_rank(self, index: int = 0) -> int:
        return self._input_chunk(index, "get_origin_rank").origin_rank

    def get_origin_index(self, index: int = 0) -> int:
        return self._input_chunk(index, "get_origin_index").origin_index

    def get_dst_rank(self, index: int = 0) -> int:
        return self._input_chunk(index, "get_dst_rank").dst_rank

    def get_dst_index(self, index: int = 0) -> int:
        return self._input_chunk(index, "get_dst_index").dst_index

    def print_chunk_info(self, index: int = 0) -> None:
        print(self._owner._held(self.rank, self.buffer, self.index + index))


# -- module functions acting on the current program --------------------------------------
def chunk(rank, buffer, index, size=1) -> Ref | None:
    """A reference to ``size`` chunks of ``buffer`` on ``rank`` from
    ``index``, or None when that slot holds no chunk (as in MSCCLang)."""
    return _current("chunk")._chunk(rank, buffer, index, size)


def Check() -> bool:
    """Verify the current program; raises ``msc.VerificationError`` on failure."""
    return _current("Check").check()


def XML() -> None:
    """Print the current program's MSCCL-IR XML; nothing when ``msc verify``
    runs the script (under ``collecting()``)."""
    program = _current("XML")
    if _collector.get() is None:
        _print_xml(program)


def _print_xml(msccl_program: MSCCLProgram) -> None:
    print(_xml_string(msccl_program))


def _xml_string(msccl_program: MSCCLProgram) -> str:
    try:
        xml_export = importlib.import_module("msc.xml_export")
    except ModuleNotFoundError as exc:
        if exc.name != "msc.xml_export":
            raise
        raise MscError("XML() needs the lowering stage (msc.xml_export), which this msc does not have yet; "
                       "check the script with `msc verify FILE.py -- ARGS` instead") from None
    native = msccl_program.program
    snapshot = native.with_ops(native.ops)  # XML() runs inside the block: lower a sealed copy
    return xml_export.program_to_xml(
        snapshot, instances=msccl_program.instances, protocol=msccl_program.protocol,
        threadblock_policy=msccl_program.threadblock_policy.value, instr_fusion=msccl_program.instr_fusion,
        name=msccl_program.name)


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """Collect the native ``Program`` of every MSCCLProgram completed while
    active (``msc verify`` runs scripts under it); XML() prints nothing."""
    programs: list = []
    token = _collector.set(programs)
    try:
        yield programs
    finally:
        _collector.reset(token)
