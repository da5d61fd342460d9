"""MSCCLang on msc: port an msccl-tools program by changing its imports
(``msccl.language``, ``msccl.topologies``, ``msccl.language.collectives``)
to ``from msc.compat.msccl import *``.

A ``with MSCCLProgram(...)`` block traces into a native ``msc.Program``;
``chunk()`` and the returned references record native copies and reduces,
each with the user's source line, and ``Check()`` runs ``msc.verify``.
Collectives live in ``msccl_collectives``, topologies in
``msccl_topology``, what buffers hold in ``msccl_chunks``, and how a custom
collective's ``check()`` is run in ``msccl_check``.

Where this layer follows MSCCLang:

- References point at *physical* chunks, as MSCCLang's do: in-place
  ``chunk(r, Buffer.input, i)`` of an allgather is output chunk ``r*k+i``,
  and a ``copy`` with no buffer goes to that same physical place on the
  destination rank.
- A ``copy`` to an explicit buffer is placed with the *source* rank's
  layout (MSCCLang's ``get_buffer_index(self.rank, ...)``): in place,
  ``copy(dst, Buffer.input, i)`` from rank r lands in allgather output
  ``r*k+i`` of ``dst``, and ``copy(dst, Buffer.output, i)`` from rank r in
  reduce-scatter input ``r*k+i`` of ``dst``.
- The chunks' contents are tracked while tracing, so ``chunk()`` on a slot
  that holds nothing returns None (an unwritten output slot of an
  out-of-place collective, a scratch slot nothing wrote) and
  ``get_origin_rank``/``get_dst_index``/... work as in MSCCLang. Only the
  first slot decides, as in MSCCLang.
- ``copy(dst, buffer, index=-1)``: no buffer means the source's buffer and
  index; a scratch buffer with index -1 appends after the last chunk that
  buffer has on ``dst``. Hints of -1 mean "no hint"; ``ch`` is the channel.
  Under ``ThreadblockPolicy.manual`` the sends and receives without a hint
  share one more threadblock of their rank (MSCCLang's threadblock -1).
- Any hashable names a scratch buffer (MSCCLang keys a dict by it:
  ``(n1, n2)`` tuples, ints, strings). msc calls a non-string by its repr
  (``(0, 1)``) in operations and errors; a default repr that would differ
  from run to run (``<T object at 0x..>``) becomes ``<T #n>``.
- Collectives: ``AllReduce``, ``AllGather``, ``ReduceScatter``, ``AllToAll``
  and ``Collective`` subclasses with MSCCLang's API: ``init_buffers()`` (per
  rank, ``{Buffer.input: [Chunk or None, ...], Buffer.output: [...]}``),
  ``check(prog)`` (reads ``prog.buffers``, prints what is wrong, returns a
  bool) and ``get_buffer_index``; ``Chunk``, ``ReduceChunk`` and
  ``prog.buffers`` as in MSCCLang. The built-ins answer the three methods
  too, so a subclass may override any of them.
- Topologies: ``fully_connected``, ``ring``, ``line``, ``star``,
  ``hub_and_spoke``, ``dgx1``, ``dgx_a100``, ``distributed_fully_connected``,
  ``distributed_hub_and_spoke``; copies and reduces across ranks need a
  link (bandwidths and switches are kept, not modelled).
- ``create_scratch(rank, name)`` and ``Print()`` exist (MSCCLang's own
  raised AttributeError); ``Print()`` lists the operations with their lines.
- A copy of a chunk onto itself (in-place aliasing) is dropped.

Where it differs (each an error where MSCCLang would misbehave quietly, or a
convenience where MSCCLang returns nothing):

- ``Check()`` raises ``msc.VerificationError`` naming the rank, index,
  expected and found contributions and the user's line (the operation that
  last wrote the chunk; where nothing did, the ``Check()`` or ``XML()``
  line); MSCCLang printed and returned False. It returns True on success.
  Under ``msc verify``/``msc compile`` each program is verified as its
  block ends, and an error no operation explains names the
  ``MSCCLProgram(...)`` line.
- A custom collective's ``check()`` is its postcondition. Check() runs it on
  the chunks as traced; where it says no, the error carries what it printed
  and the chunk its first "Rank R chunk C" line names. Where it says yes,
  the output chunks it read become an ``msc`` postcondition (each must hold
  exactly the contributions it held), which ``msc.verify`` and the plan
  verifier of ``XML()``/``msc compile`` hold the program and its plan to.
  ``Check()`` on a collective without ``check()`` is an error (MSCCLang:
  None).
- A custom collective is in place only where its buffers alias
  (``get_buffer_index`` moves one buffer into the other at a fixed offset
  per rank, or one list is both), whatever its ``inplace`` flag says;
  ``get_buffer_index`` must be such a shift and is not applied to scratch
  buffers; only the input (and an output that is the input) may start with
  chunks. Plans name it by its class; XML says ``coll="custom"``.
- ``copy`` onto the chunk itself returns the reference (MSCCLang: None), and
  ``with MSCCLProgram(...) as p`` binds the program (MSCCLang: None).
- ``index=-1`` with ``Buffer.input``/``Buffer.output`` means the source's
  own place in that buffer (MSCCLang kept -1: a Python negative index, the
  last chunk, or in place the chunk just before the rank's window).
- ``XML()`` lowers through msc, which verifies the plan (MSCCLang lowered
  without checking); a program whose plan is wrong raises there.
- The out-of-place input buffer is read-only (native msc rule; NCCL's send
  buffer is const); MSCCLang allowed writing it.
- ``group`` refuses a gap between the two references (MSCCLang silently
  covered it); sizes of a reduce must match.
- Misuse (``chunk()`` outside a program, nested programs) raises
  ``msc.AlgorithmError`` at the user's line instead of RuntimeError;
  invalid ranks and indices raise ``msc.OperationError``.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from enum import Enum
from typing import Iterator

from msc.dsl import program as _dsl
from msc.compat.msccl_check import buffer_views, run_check
from msc.compat.msccl_chunks import Buffer, Chunk, ReduceChunk, Sum, as_mscclang
from msc.compat.msccl_collectives import (AllGather, AllReduce, AllToAll, Collective, PortedCollective,
                                          ReduceScatter, native_collective)
from msc.compat.msccl_topology import (Topology, dgx1, dgx_a100, distributed_fully_connected,
                                       distributed_hub_and_spoke, fully_connected, hub_and_spoke, line, ring, star)
from msc.dsl.program import user_line
from msc.errors import AlgorithmError, OperationError, VerificationError
from msc.ir.ops import PROTOCOL_NAMES
from msc.verification.program_verifier import verify

# (operations verified, report) of each program's last Check(): `msc verify` reuses it for the
# sealed program. Kept here, not on the Program: the core DSL knows nothing of MSCCLang.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checked_report(program):
    """The report of the script's own Check() if it saw every operation of
    the finished (sealed, immutable) program, else None."""
    done = _CHECKED.get(program)
    if done is not None and isinstance(program.ops, tuple) and done[0] == len(program.ops):
        return done[1]
    return None

__all__ = [
    "MSCCLProgram", "chunk", "create_scratch", "Check", "XML", "Print", "Ref",
    "Buffer", "Chunk", "ReduceChunk", "ThreadblockPolicy",
    "Topology", "fully_connected", "ring", "line", "star", "hub_and_spoke",
    "dgx1", "dgx_a100", "distributed_fully_connected", "distributed_hub_and_spoke",
    "Collective", "AllReduce", "AllGather", "ReduceScatter", "AllToAll",
]


class ThreadblockPolicy(Enum):
    """Who assigns threadblocks at lowering: msc (auto) or the user's
    ``sendtb``/``recvtb`` hints (manual)."""

    auto = "auto"
    manual = "manual"

    def __str__(self) -> str:
        return self.value


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
    ``msc.Program`` (built on entering the block, sealed on leaving it);
    ``buffers`` is MSCCLang's view of what every rank's buffers hold.
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
        if protocol not in PROTOCOL_NAMES:
            raise AlgorithmError(f"MSCCLProgram {name!r}: protocol must be one of {', '.join(PROTOCOL_NAMES)}, "
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
        self._where = user_line()                # where errors with no better line point
        self._link = getattr(topo, "link", None)
        self._slots: dict[tuple[int, str], list] = {}
        self._names: dict[object, str] = {}       # the user's scratch name -> msc's
        self._spelled: dict[str, object] = {}     # msc's scratch name -> the user's
        self._judged: int | None = None           # ops when check() last ran (ported collectives)
        self._post: dict[tuple[int, int], list] = {}
        # MSCCLang runs init_buffers() here: so does a ported collective.
        self._native = native_collective(collective, self._expected)

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
        c, native = self.collective, self._native
        # A ported collective is in place where its buffers alias, whatever its flag says.
        inplace = native.inplace if isinstance(native, PortedCollective) else c.inplace
        layout = native.layout(self.num_ranks, c.chunk_factor, inplace)
        self.program = _dsl.Program(self.name, layout, self.options())
        _programs.set(stack + (self,))
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack = _programs.get()
        if stack and stack[-1] is self:
            _programs.set(stack[:-1])
        self.program.ops = self._final_ops()
        self.program.seal()
        if exc_type is None:
            sink = _collector.get()
            if sink is not None:
                # Verified here, where the program's own line is known (`msc verify`
                # and `msc compile` reuse the report): an output nothing wrote is
                # reported at the MSCCLProgram(...) line.
                self._verify(self._where)
                sink.append(self.program)
        return False

    def options(self) -> dict:
        """The lowering options, as plain values."""
        return {"instances": self.instances, "protocol": self.protocol,
                "threadblock_policy": self.threadblock_policy.value,
                "interleaved_replication": self.interleaved_replication, "instr_fusion": self.instr_fusion,
                "check_xml": self.check_xml, "dependence_nop": self.dependence_nop}

    def _final_ops(self) -> list:
        """The operations as lowering takes them. MSCCLang's manual policy puts
        every send and receive that has no threadblock hint in one more
        threadblock of its rank (its threadblock -1): here the hint one past
        the highest the rank uses."""
        ops = self.program.ops
        if self.threadblock_policy is not ThreadblockPolicy.manual:
            return ops
        top: dict[int, int] = {}
        for op in ops:
            for rank, hint in ((op.src_rank, op.sendtb), (op.dst_rank, op.recvtb)):
                if hint is not None and hint > top.get(rank, -1):
                    top[rank] = hint
        return [op if op.src_rank == op.dst_rank or (op.sendtb is not None and op.recvtb is not None) else
                op._replace(sendtb=top.get(op.src_rank, -1) + 1 if op.sendtb is None else op.sendtb,
                            recvtb=top.get(op.dst_rank, -1) + 1 if op.recvtb is None else op.recvtb)
                for op in ops]

    # -- MSCCLang's program methods -------------------------------------------------
    def check(self) -> bool:
        """Verify the operations so far (raises ``msc.VerificationError``)."""
        where = user_line()
        if isinstance(self._native, PortedCollective) and type(self.collective).check is Collective.check:
            raise AlgorithmError(f"Check(): collective {type(self.collective).__name__} defines no check(prog) "
                                 f"saying what the program must end with", where=where)
        self._verify(where)
        return True

    def _verify(self, where) -> None:
        """Verify unless a report covers every operation; an error no
        operation explains points at ``where``."""
        done = _CHECKED.get(self.program)
        if done is not None and done[0] == len(self.program.ops):
            return
        if isinstance(self._native, PortedCollective):
            self._judge(where)
        with _located(where):
            report = verify(self.program)
        _CHECKED[self.program] = (len(self.program.ops), report)

    def generate_xml(self) -> str:
        """The MSCCL-IR XML of the program (lowered as msc compile lowers it, for the MSCCL runtime)."""
        return _xml_string(self)

    @property
    def buffers(self) -> list[dict]:
        """Per rank, MSCCLang's dict of buffers (input, output, scratch by the
        user's names): read-only lists of what each chunk holds now (None, a
        Chunk or a ReduceChunk)."""
        return buffer_views(self, None)

    # -- a ported collective's postcondition: what its check() read --------------------
    def _expected(self, rank: int, index: int) -> list | None:
        """What output ``index`` of ``rank`` must hold: what it holds where
        check() read it (the program is then right by MSCCLang's check), None
        where check() did not look."""
        self._judge(self._where)
        return self._post.get((rank, index))

    def _judge(self, where) -> None:
        """Run the collective's check() on the chunks as traced, once per
        operation count (raises VerificationError where it says no)."""
        count = len(self.program.ops)
        if self._judged != count:
            self._post = run_check(self, where, echo=_collector.get() is None)
            self._judged = count

    # -- buffer names ------------------------------------------------------------------
    def _name(self, buffer, what: str) -> str:
        """msc's name for a buffer: input, output, or a scratch buffer named
        by any hashable, as in MSCCLang (a non-string is spelled by its repr)."""
        if isinstance(buffer, Buffer):
            return buffer.value
        try:
            known = self._names.get(buffer)
        except TypeError:     # MSCCLang keys a dict by it
            raise OperationError(f"{what}: a scratch buffer name must be hashable (a string, a number, a tuple, "
                                 f"...), got {buffer!r}", where=user_line()) from None
        if known is not None:
            return known
        if buffer is None or buffer == "":
            raise OperationError(f"{what}: buffer must be Buffer.input, Buffer.output, Buffer.scratch or the name of "
                                 f"a scratch buffer, got {buffer!r}", where=user_line())
        if isinstance(buffer, str):
            name = str(buffer)
        else:
            name = repr(buffer)
            if " at 0x" in name:      # a default repr: not the same from run to run
                name = f"<{type(buffer).__name__} #{sum(1 for k in self._names if type(k) is type(buffer)) + 1}>"
        other = self._spelled.get(name, buffer)
        if other is not buffer and not (type(other) is type(buffer) and other == buffer):
            raise AlgorithmError(f"{what}: scratch buffers {other!r} and {buffer!r} would both be called {name!r} in "
                                 f"msc; rename one", where=user_line())
        if not isinstance(buffer, str) and name in ("input", "output"):
            raise AlgorithmError(f"{what}: scratch buffer {buffer!r} would be called {name!r}, the name of a user "
                                 f"buffer; rename it", where=user_line())
        self._names[buffer] = name
        self._spelled[name] = buffer
        return name

    # -- tracing helpers used by chunk() and Ref ----------------------------------------
    def _chunk(self, rank, buffer, index, size) -> Ref | None:
        name = self._name(buffer, "chunk")
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
            buf, off, starts = layout.initial_labels(rank)
            if buf == buffer:
                native = self._native
                if isinstance(native, PortedCollective):
                    for i in range(len(starts)):
                        slots[off + i] = native.start(rank, i)
                else:
                    dest = self.collective.destination
                    for i, label in enumerate(starts):
                        if label is not None:
                            slots[off + i] = Chunk(*label, *dest(*label))
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
                value = Sum(dst_rank, old, value) if old is not None and value is not None else None
            target[dst_index + j] = value

    def _check_link(self, src: int, dst, what: str) -> None:
        if self._link is None or src == dst or type(dst) is not int or not 0 <= dst < self.num_ranks:
            return  # a bad rank is reported by the native API
        if not self._link(src, dst):
            raise OperationError(f"{what}: topology {getattr(self.topo, 'name', self.topo)!r} has no link from "
                                 f"rank {src} to rank {dst}", rank=dst, where=user_line())


@contextlib.contextmanager
def _located(where):
    """A VerificationError with no line of its own (an output nothing wrote)
    points at ``where``, the user's Check() or XML() line."""
    try:
        yield
    except VerificationError as err:
        if err.where is not None or type(err) is not VerificationError:
            raise
        raise VerificationError(err.detail, rank=err.rank, buffer=err.buffer, index=err.index,
                                expected=err.expected, found=err.found, where=where) from None


def _topology_ranks(topo, name: str) -> int:
    count = topo.num_nodes() if callable(getattr(topo, "num_nodes", None)) else getattr(topo, "num_ranks", None)
    if type(count) is not int or count < 1:
        raise AlgorithmError(f"MSCCLProgram {name!r}: topology must be a Topology (e.g. fully_connected(n)), "
                             f"got {topo!r}", where=user_line())
    return count


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
        local copy); returns the reference to the copy.

        As in MSCCLang, an explicit buffer is placed with the *source* rank's
        layout: in-place allgather's ``copy(dst, Buffer.input, i)`` from rank
        r lands in output ``r*k+i`` of ``dst``, where rank r's input lives."""
        owner = self._owner
        if buffer is None:
            phys, at = self.buffer, self.index if index in (-1, None) else index
        else:
            name = owner._name(buffer, "copy")
            target, off = owner.program.layout.alias(self.rank, name)
            if index in (-1, None):
                if name in ("input", "output"):   # the source's own place in that buffer
                    index = self.index - off if target == self.buffer else self.index
                else:
                    index = owner._next_free(dst, name)
            owner.program._check_location(dst, name, index, self.size, "copy")
            phys, at = target, index + off
        owner._check_link(self.rank, dst, "copy")
        out = _dsl.Ref.copy(self, dst, phys, at, channel=_hint(ch), sendtb=_hint(sendtb), recvtb=_hint(recvtb))
        owner._moved(self, out.rank, out.buffer, out.index, reduce=False)
        return Ref(owner, out.rank, out.buffer, out.index, out.size)

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
    def _input_chunk(self, i: int, what: str) -> Chunk:
        held = self._owner._held(self.rank, self.buffer, self.index + i)
        if type(held) is not Chunk:
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
        print(as_mscclang(self._owner._held(self.rank, self.buffer, self.index + index)))


# -- module functions acting on the current program --------------------------------------
def chunk(rank, buffer, index, size=1) -> Ref | None:
    """A reference to ``size`` chunks of ``buffer`` on ``rank`` from
    ``index``, or None when that slot holds no chunk (as in MSCCLang)."""
    return _current("chunk")._chunk(rank, buffer, index, size)


def create_scratch(rank, name):
    """Declare an empty scratch buffer ``name`` (any hashable) on ``rank``;
    returns ``name``. Scratch buffers also appear on first use."""
    prog = _current("create_scratch")
    native = prog._name(name, "create_scratch")
    if native in ("input", "output"):
        raise OperationError(f"create_scratch: {name!r} is a user buffer, not a scratch buffer", where=user_line())
    prog.program.chunk(rank, native, 0)  # validates the rank
    prog._contents(rank, native)
    return name


def Check() -> bool:
    """Verify the current program; raises ``msc.VerificationError`` on failure."""
    return _current("Check").check()


def XML() -> None:
    """Print the current program's MSCCL-IR XML; nothing when ``msc verify``
    runs the script (under ``collecting()``)."""
    program = _current("XML")
    if _collector.get() is None:
        _print_xml(program)


def Print() -> None:
    """Print the operations traced so far, one a line with the user's line
    (MSCCLang's Print() drew its chunk DAG)."""
    for i, op in enumerate(_current("Print").program.ops):
        print(f"{i}: {op.describe()}" + (f"  @ {op.where}" if op.where else ""))


def _print_xml(msccl_program: MSCCLProgram) -> None:
    print(_xml_string(msccl_program))


def _xml_string(msccl_program: MSCCLProgram) -> str:
    """The program lowered as msccl-tools' XML() lowers it, exported for the MSCCL runtime."""
    from msc.formats.xml_export import plan_to_xml
    from msc.lower.pipeline import LowerOptions, lower

    native = msccl_program.program
    snapshot = native.with_ops(msccl_program._final_ops())  # XML() runs inside the block: lower a sealed copy
    options = LowerOptions(protocol=msccl_program.protocol, instances=msccl_program.instances,
                           threadblocks=msccl_program.threadblock_policy.value, fuse=msccl_program.instr_fusion,
                           runtime="msccl")
    with _located(user_line()):
        plan = lower(snapshot, options, collective=snapshot.layout.collective)
        return plan_to_xml(plan, name=msccl_program.name, runtime="msccl")


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """Collect the native ``Program`` of every MSCCLProgram completed while
    active (``msc verify`` runs scripts under it), each verified as its block
    ends (``checked_report``); XML() prints nothing."""
    programs: list = []
    token = _collector.set(programs)
    try:
        yield programs
    finally:
        _collector.reset(token)
