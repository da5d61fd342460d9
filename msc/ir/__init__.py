"""The intermediate representations of msc, as frozen dataclasses.

Stage 1, the trace: what a DSL program did, one ``Op`` per copy or reduce,
with buffers already resolved to the physical buffers of a rank (in-place
aliases applied). Later stages (the plan) add their records here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from msc.errors import SourceLine
from msc.ir.ops import DEFAULT_PROTOCOL


class OpKind(Enum):
    COPY = "copy"      # dst <- src
    REDUCE = "reduce"  # dst <- dst (+) src
    # switch ops of rank src_rank over the ranks of ``group`` (NVLS): see StepOp
    SWITCH_REDUCE = "switch reduce"           # dst (on src_rank) <- src of every member, reduced in member order
    SWITCH_STORE = "switch store"             # dst of every member <- src (on src_rank)
    SWITCH_REDUCE_STORE = "switch allreduce"  # dst of every member <- src of every member, reduced


class Op(NamedTuple):
    """One chunk operation of a traced program (immutable).

    A NamedTuple rather than a frozen dataclass: a 1024-rank ring traces two
    million of these, and a tuple is built five times faster.

    ``size`` chunks starting at ``src_index`` of ``src_buffer`` on
    ``src_rank`` are copied to, or reduced into, ``size`` chunks starting at
    ``dst_index`` of ``dst_buffer`` on ``dst_rank``. When the ranks differ the
    operation is a send and a receive. ``channel``, ``sendtb`` and ``recvtb``
    are the user's optional placement hints.
    """

    kind: OpKind
    src_rank: int
    src_buffer: str
    src_index: int
    dst_rank: int
    dst_buffer: str
    dst_index: int
    size: int
    channel: int | None = None
    sendtb: int | None = None
    recvtb: int | None = None
    where: SourceLine | None = None
    group: tuple[int, ...] = ()       # a switch op's ranks (src_rank issues it; dst_rank is src_rank)

    def describe(self) -> str:
        src = f"rank {self.src_rank} {self.src_buffer}[{_span(self.src_index, self.size)}]"
        dst = f"rank {self.dst_rank} {self.dst_buffer}[{_span(self.dst_index, self.size)}]"
        if self.kind is OpKind.COPY:
            return f"copy {src} -> {dst}"
        if self.kind is OpKind.REDUCE:
            return f"reduce {src} into {dst}"
        every = f"ranks {','.join(map(str, self.group))}"
        src_all = f"{every} {self.src_buffer}[{_span(self.src_index, self.size)}]"
        dst_all = f"{every} {self.dst_buffer}[{_span(self.dst_index, self.size)}]"
        if self.kind is OpKind.SWITCH_REDUCE:
            return f"rank {self.src_rank}: switch reduce of {src_all} -> {dst}"
        if self.kind is OpKind.SWITCH_STORE:
            return f"rank {self.src_rank}: switch store of {src} -> {dst_all}"
        return f"rank {self.src_rank}: switch reduce of {src_all} -> {dst_all}"


def _span(index: int, size: int) -> str:
    return str(index) if size == 1 else f"{index}:{index + size}"


# -- Stage 2: the plan ---------------------------------------------------------
# A plan is what backends execute: per rank, threadblocks; per threadblock, an
# ordered list of steps. Offsets and counts are in chunks; a chunk's byte size
# is only known at run time, so one plan serves every data type and size.


class StepOp(Enum):
    """What a step does. ``srcs`` are local operands, ``dst`` the local chunks
    written; the threadblock's ``recv``/``send`` peers are the remote ends.

    send   SRC           send SRC to the send peer
    recv   -> DST        receive into DST
    rcs    -> DST        receive into DST and forward it to the send peer
    rrs    SRC           receive x, send SRC + x (nothing stored)
    rrc    SRC -> DST    receive x, DST = SRC + x
    rrcs   SRC -> DST    receive x, DST = SRC + x, send DST
    copy   SRC -> DST    local copy
    reduce S1, S2.. -> DST   DST = S1 + S2 + ... (DST may be one of the sources)
    nop                  only waits for its dependencies

    The switch ops act on the threadblock's ``group``: ranks on one NVSwitch
    domain whose buffers are bound to one multicast object (NVLS). They read
    and write other members' memory directly, so nothing but a barrier orders
    them against the members' own steps.

    swred   SRC -> DST   DST = SRC(m0) + SRC(m1) + ..., the group's copies of SRC,
                         reduced in the switch in member order (multimem.ld_reduce)
    swst    SRC -> DST   every member's DST = SRC (multimem.st: a multicast store)
    swrs    SRC -> DST   every member's DST = SRC(m0) + SRC(m1) + ... (both at once)
    barrier              waits until every member of the group has reached its
                         matching barrier: the k-th barrier of the threadblock of
                         the group and channel on each member
    """

    SEND = "send"
    RECV = "recv"
    RCS = "rcs"
    RRS = "rrs"
    RRC = "rrc"
    RRCS = "rrcs"
    COPY = "copy"
    REDUCE = "reduce"
    NOP = "nop"
    SWRED = "swred"
    SWST = "swst"
    SWRS = "swrs"
    BARRIER = "barrier"

    # Set from _STEP_OPS below, as plain attributes: hashing an Enum member is slow in hot loops.
    receives: bool   # takes a message from the receive peer
    sends: bool      # gives one to the send peer
    reduces: bool    # combines values with the reduce op
    nsrc: str        # local sources it takes: "0", "1" or "2+"
    has_dst: bool    # writes a local destination
    xml: str | None  # its MSCCL-IR <step> type; None: MSCCL has none (such plans do not export)
    color: str       # how msc show and msc simulate --timeline draw it (a matplotlib colour)
    group_reads: bool   # reads its source on every member of the group (through the switch)
    group_writes: bool  # writes its destination on every member of the group
    switch: bool        # needs the threadblock's group: the two above and the group barrier


# The step ops' registry: every other list of them derives from this table (plan_lines' reader,
# the CUDA enum and masks, the XML types, the pictures' colours) or is tested against it
# (grammars/plan.lark's OP).
# MSCCL-IR has no switch ops: plans with them do not export to XML.
#            receives sends  reduces nsrc  has_dst xml     color         group_reads group_writes
_STEP_OPS = {
    "SEND":   (False,   True,  False,  "1",  False,  "s",    "tab:blue",    False, False),
    "RECV":   (True,    False, False,  "0",  True,   "r",    "tab:green",   False, False),
    "RCS":    (True,    True,  False,  "0",  True,   "rcs",  "tab:cyan",    False, False),
    "RRS":    (True,    True,  True,   "1",  False,  "rrs",  "tab:purple",  False, False),
    "RRC":    (True,    False, True,   "1",  True,   "rrc",  "tab:olive",   False, False),
    "RRCS":   (True,    True,  True,   "1",  True,   "rrcs", "tab:pink",    False, False),
    "COPY":   (False,   False, False,  "1",  True,   "cpy",  "tab:gray",    False, False),
    "REDUCE": (False,   False, True,   "2+", True,   "re",   "tab:orange",  False, False),   # XML re: a source at a time (xml_export)
    "NOP":    (False,   False, False,  "0",  False,  "nop",  "lightgray",   False, False),
    "SWRED":  (False,   False, True,   "1",  True,   None,   "tab:red",     True,  False),
    "SWST":   (False,   False, False,  "1",  True,   None,   "tab:brown",   False, True),
    "SWRS":   (False,   False, True,   "1",  True,   None,   "darkred",     True,  True),
    "BARRIER": (False,  False, False,  "0",  False,  None,   "black",       False, False),
}
for _op in StepOp:
    (_op.receives, _op.sends, _op.reduces, _op.nsrc, _op.has_dst, _op.xml, _op.color, _op.group_reads,
     _op.group_writes) = _STEP_OPS[_op.name]
    _op.switch = _op.group_reads or _op.group_writes or _op.name == "BARRIER"

# Which operands each op takes: (number of sources, has a destination).
STEP_SHAPE = {op: (op.nsrc, op.has_dst) for op in StepOp}


def step_values(op: StepOp, srcs: list, got, reduce):
    """What a step computes, in any value domain (numpy chunks in the
    executor, symbolic sums in the plan verifier): ``(stored, sent)``, the
    value written to its destination and the message it sends, None where
    it has none. ``srcs`` are its sources' values (for an op that reads the
    group's copies, one per member in member order), ``got`` the message it
    received, ``reduce(xs, ys)`` combines two values chunk by chunk."""
    if op is StepOp.REDUCE or op.group_reads:      # swred, swrs: the members' copies in member order
        acc = srcs[0]
        for more in srcs[1:]:
            acc = reduce(acc, more)
        return acc, None
    if op.reduces:                                  # rrs, rrc, rrcs: SRC + the message
        out = reduce(srcs[0], got)
        return out, out
    if op.receives:                                 # recv, rcs: the message itself
        return got, got
    if op is StepOp.SEND:
        return None, srcs[0]
    if op is StepOp.COPY or op is StepOp.SWST:
        return srcs[0], None
    return None, None                               # nop, barrier


@dataclass(frozen=True, slots=True)   # slots: plans hold millions of these
class Slice:
    """``count`` chunks of a rank's ``buffer`` (input, output, scratch) from ``index``."""

    buffer: str
    index: int
    count: int

    def __str__(self) -> str:
        if self.count == 1:
            return f"{self.buffer}[{self.index}]"
        return f"{self.buffer}[{self.index}:{self.index + self.count}]"


@dataclass(frozen=True, slots=True)   # slots: plans hold millions of these
class Step:
    """One step of a threadblock. ``deps`` are (threadblock, step) pairs of the
    same rank that must finish first; ``where`` is the user's line it came from."""

    op: StepOp
    srcs: tuple[Slice, ...]
    dst: Slice | None
    count: int
    deps: tuple[tuple[int, int], ...] = ()
    where: SourceLine | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Threadblock:
    """A sequence of steps on one channel with at most one send peer and one
    receive peer (the MSCCL rule: a connection (sender, receiver, channel)
    belongs to exactly one threadblock at each end). ``group``: the ranks
    its switch ops act on (increasing, its own rank among them), () for
    none; a (group, channel) belongs to one threadblock on each member."""

    id: int
    send: int | None
    recv: int | None
    channel: int
    steps: tuple[Step, ...]
    group: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankPlan:
    rank: int
    scratch: int                      # scratch chunks this rank uses
    threadblocks: tuple[Threadblock, ...]


@dataclass(frozen=True)
class Contract:
    """What a collective that is not built in requires, as data, for one
    plan's rank count and chunk factor (msc.dsl.collectives.CustomCollective
    tabulated): a plan carries it so that every reader can verify and run
    the plan with no definition at hand.

    ``post[r][i]``: the labels ``(origin_rank, origin_index)`` output chunk
    i of rank r must hold, sorted (a label twice: reduced in twice), or None
    for "anything". ``pre[r][i]``: the label input chunk i of rank r starts
    with, or None for "starts empty"; ``pre`` None: every input chunk starts
    as its own position, (r, i).
    """

    post: tuple[tuple[tuple[tuple[int, int], ...] | None, ...], ...]
    pre: tuple[tuple[tuple[int, int] | None, ...], ...] | None = None


@dataclass(frozen=True)
class Plan:
    """A lowered schedule for every rank.

    ``chunk_factor`` is chunks per data unit (the count a collective call
    passes: allreduce count, allgather sendcount, ...); the logical input and
    output buffers hold ``input_chunks``/``output_chunks`` chunks.
    ``slots`` is the connection capacity (messages in flight per connection)
    the plan was verified deadlock-free with; a runtime must provide at least
    that many. ``tile`` is the pipelining tile in bytes per chunk and
    iteration (0: the runtime's default).
    """

    name: str
    collective: str
    num_ranks: int
    chunk_factor: int
    inplace: bool
    input_chunks: int
    output_chunks: int
    ranks: tuple[RankPlan, ...]
    root: int = 0
    protocol: str = DEFAULT_PROTOCOL
    instances: int = 1
    slots: int = 1
    tile: int = 0
    contract: Contract | None = None      # a custom collective's requirements (None: built in)

    @property
    def scratch_chunks(self) -> int:
        return max((r.scratch for r in self.ranks), default=0)

    def steps(self):
        """Every (rank, threadblock, step index, step)."""
        for rp in self.ranks:
            for tb in rp.threadblocks:
                for i, step in enumerate(tb.steps):
                    yield rp.rank, tb, i, step

    def num_steps(self) -> int:
        return sum(len(tb.steps) for rp in self.ranks for tb in rp.threadblocks)

    def first_switch_step(self):
        """(rank, threadblock, step index, step) of the first switch op
        (NVLS), None where the plan has none."""
        for rp in self.ranks:
            for tb in rp.threadblocks:
                if tb.group:
                    for i, step in enumerate(tb.steps):
                        if step.op.switch:
                            return rp.rank, tb.id, i, step
        return None

