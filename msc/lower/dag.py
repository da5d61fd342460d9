"""The instruction DAG: a traced program as per-rank instructions.

A copy or reduce across ranks becomes a send on the source rank and a
receive (``recv``, or ``rrc`` for a reduce) on the destination rank, joined
by a message. A local copy or reduce stays one instruction. Local edges order
the instructions of one rank that touch the same chunk: read-after-write,
write-after-read and write-after-write, found from the last writer and the
readers since, per (buffer, index).

The DAG is the working state of lowering; a pass takes one and returns a
new one (``Dag.copy``) and never changes its input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from typing import NamedTuple

from msc.errors import SourceLine
from msc.ir import Op, OpKind, Slice, StepOp


class Instr(NamedTuple):
    """One instruction of one rank (immutable; lowering replaces, never edits)."""

    id: int
    rank: int
    op: StepOp
    srcs: tuple[Slice, ...]
    dst: Slice | None
    count: int
    recv_peer: int | None = None
    send_peer: int | None = None
    msg_in: int | None = None        # message received
    msg_out: int | None = None       # message sent
    channel: int = 0
    recvtb: int | None = None
    sendtb: int | None = None
    where: SourceLine | None = None
    store: Slice | None = None       # rrs: where the value would be stored (dead)


# An Instr from all 15 fields in order, in C: three times faster than the
# namedtuple's own constructor (which parses keywords in Python), and lowering
# builds millions of them.
instr_from_fields = partial(tuple.__new__, Instr)


@dataclass
class Dag:
    """Instructions (``None`` where fusion removed one), their local
    predecessors and successors, and per instruction the instructions that
    read the value it wrote (``readers``) and that later overwrite chunks it
    read or wrote (``overwriters``): each a tuple of ids without repeats."""

    instrs: list
    preds: list
    succs: list
    readers: list
    overwriters: list
    overwritten: list               # every chunk it wrote is written again later
    messages: list                  # message id -> [sender id, receiver id]

    def copy(self) -> Dag:
        """A copy whose tables are new lists sharing their (immutable) tuples:
        a pass replaces a cell it changes, so its input stays whole."""
        return Dag(list(self.instrs), list(self.preds), list(self.succs), list(self.readers),
                   list(self.overwriters), list(self.overwritten), list(self.messages))

    def live(self):
        return (i for i in self.instrs if i is not None)


def replicate(ops, instances: int, scratch_sizes: dict) -> tuple[list[Op], dict]:
    """The trace ``instances`` times over interleaved chunks and new channels:
    chunk i of instance j is chunk i*instances + j of every buffer, channel c
    of instance j is channel j*channels + c, and a threadblock hint t of
    instance j is t + j*threadblocks (as MSCCLang replicates)."""
    if instances == 1:
        return list(ops), dict(scratch_sizes)
    channels = 1 + max((op.channel or 0 for op in ops), default=0)
    tbs = 1 + max((max(op.sendtb or 0, op.recvtb or 0) for op in ops), default=0)

    def shift(tb, j):
        return None if tb is None else tb + j * tbs

    # Ops built by tuple.__new__ from their fields (NamedTuple._replace is a Python-level call per
    # op, millions here); an op of size s at index i covers i*K+j .. (i+s-1)*K+j with stride K:
    # split into size-1 ops
    new = tuple.__new__
    flat = []
    for (kind, srank, sbuf, sidx, drank, dbuf, didx, size, channel, sendtb, recvtb, where, group) in ops:
        for j in range(instances):
            si, di, ch = sidx * instances + j, didx * instances + j, j * channels + (channel or 0)
            stb, rtb = shift(sendtb, j), shift(recvtb, j)
            for t in range(size):
                flat.append(new(Op, (kind, srank, sbuf, si + t * instances, drank, dbuf, di + t * instances, 1, ch,
                                     stb, rtb, where, group)))
    return flat, {key: size * instances for key, size in scratch_sizes.items()}


_SRC_BUFFER, _DST_BUFFER = itemgetter(Op._fields.index("src_buffer")), itemgetter(Op._fields.index("dst_buffer"))


def allocate_scratch(ops, physical: set[str], scratch_sizes: dict, num_ranks: int):
    """Map every named scratch buffer of a rank onto one ``scratch`` buffer,
    in order of first use. Returns the rewritten ops and chunks per rank."""
    base: dict[tuple[int, str], int] = {}
    used = [0] * num_ranks
    if physical.issuperset(map(_SRC_BUFFER, ops)) and physical.issuperset(map(_DST_BUFFER, ops)):
        return list(ops), used        # no named scratch (checked in C: a large ring has millions of ops)
    for op in ops:
        for rank, buf in ((op.src_rank, op.src_buffer), (op.dst_rank, op.dst_buffer)):
            if buf not in physical and (rank, buf) not in base:
                base[(rank, buf)] = used[rank]
                used[rank] += scratch_sizes.get((rank, buf), 0)
    if not base:
        return list(ops), used
    out = []
    for op in ops:
        if op.src_buffer not in physical:
            op = op._replace(src_buffer="scratch", src_index=base[(op.src_rank, op.src_buffer)] + op.src_index)
        if op.dst_buffer not in physical:
            op = op._replace(dst_buffer="scratch", dst_index=base[(op.dst_rank, op.dst_buffer)] + op.dst_index)
        out.append(op)
    return out, used


def compact_scratch(dag: Dag, scratch: list[int]) -> tuple[Dag, list[int]]:
    """Drop the scratch chunks no instruction touches any more (fusion and
    dead stores leave some: a reduce-scatter ring that forwards partial
    sums with rrs stores none) and renumber the rest in order, so a plan
    declares, and a runtime allocates, only scratch it uses. Renumbering
    keeps every slice contiguous: its chunks are all used, so no gap opens
    inside it. Returns the new DAG and scratch chunks per rank."""
    if not any(scratch):
        return dag, scratch
    used: list[set[int]] = [set() for _ in scratch]
    for instr in dag.live():
        for sl in (*instr.srcs, instr.dst):
            if sl is not None and sl.buffer == "scratch":
                used[instr.rank].update(range(sl.index, sl.index + sl.count))
    if all(len(u) == size for u, size in zip(used, scratch)):
        return dag, scratch
    new_index = [{old: new for new, old in enumerate(sorted(u))} for u in used]

    def moved(sl, rank):
        if sl is None or sl.buffer != "scratch":
            return sl
        start = new_index[rank].get(sl.index)
        return None if start is None else Slice("scratch", start, sl.count)

    dag = dag.copy()
    for instr in dag.live():
        r = instr.rank
        srcs = tuple(moved(sl, r) for sl in instr.srcs)
        dst, store = moved(instr.dst, r), moved(instr.store, r)
        if srcs != instr.srcs or dst != instr.dst or store != instr.store:
            dag.instrs[instr.id] = instr._replace(srcs=srcs, dst=dst, store=store)
    return dag, [len(u) for u in used]


def build_dag(ops: list[Op]) -> Dag:
    """Instructions and their local dependencies from a trace whose buffers
    are physical (input, output, scratch)."""
    make_slice = _slice_maker()
    instrs, messages = [], []
    edges = _Edges()
    add = _instruction_adder(ops, instrs, edges)
    # Instr fields: id rank op srcs dst count recv_peer send_peer msg_in msg_out channel recvtb sendtb where store
    for op in ops:
        src = make_slice(op.src_buffer, op.src_index, op.size)
        dst = make_slice(op.dst_buffer, op.dst_index, op.size)
        reduce = op.kind is OpKind.REDUCE
        channel = op.channel or 0
        if op.src_rank == op.dst_rank:
            reads = (dst, src) if reduce else (src,)
            add(instr_from_fields((len(instrs), op.dst_rank, StepOp.REDUCE if reduce else StepOp.COPY, reads, dst,
                                   op.size, None, None, None, None, channel, op.recvtb, op.sendtb, op.where, None)),
                reads, dst)
            continue
        m = len(messages)
        sender = len(instrs)
        reads = (src,)
        add(instr_from_fields((sender, op.src_rank, StepOp.SEND, reads, None, op.size, None, op.dst_rank, None, m,
                               channel, None, op.sendtb, op.where, None)), reads, None)
        receiver = len(instrs)
        reads = (dst,) if reduce else ()
        add(instr_from_fields((receiver, op.dst_rank, StepOp.RRC if reduce else StepOp.RECV, reads, dst, op.size,
                               op.src_rank, None, m, None, channel, op.recvtb, None, op.where, None)), reads, dst)
        messages.append((sender, receiver))
    return Dag(instrs, edges.preds, _tuples(edges.succs), _tuples(edges.readers), _tuples(edges.overwriters),
               edges.overwritten, messages)


def _slice_maker():
    """``make_slice(buffer, index, count)``: one shared Slice per distinct
    value (a large trace repeats the same few slices millions of times)."""
    slices: dict[tuple, Slice] = {}

    def make_slice(buffer, index, count):
        key = (buffer, index, count)
        sl = slices.get(key)
        if sl is None:
            sl = slices[key] = Slice(buffer, index, count)
        return sl

    return make_slice


@dataclass
class _Edges:
    """build_dag's per-instruction edge tables as they grow: ``preds`` of
    tuples; ``succs``, ``readers`` and ``overwriters`` of lists or None
    (tuples at the end); ``overwritten`` as in Dag."""

    preds: list = field(default_factory=list)
    succs: list = field(default_factory=list)
    readers: list = field(default_factory=list)
    overwriters: list = field(default_factory=list)
    overwritten: list = field(default_factory=list)


def _chunk_tables(ops):
    """How chunks are numbered, and the per-chunk tables over them:
    ``(offset, per_rank, last_writer, readers_since)``.

    Chunk (rank, buffer, index) is the int rank * per_rank + offset[buffer]
    + index: cheaper than a tuple key. ``last_writer``: chunk -> last
    writer's id; ``readers_since``: chunk -> ids that read it since. Lists
    where the chunks are few enough (indexing a list beats hashing, and the
    table stays compact), else dicts that answer None for a chunk never
    touched."""
    stride = 1 + max((max(op.src_index, op.dst_index) + op.size for op in ops), default=0)
    names = sorted({op.src_buffer for op in ops} | {op.dst_buffer for op in ops})
    offset = {name: position * stride for position, name in enumerate(names)}
    per_rank = len(names) * stride
    chunks = per_rank * (1 + max((max(op.src_rank, op.dst_rank) for op in ops), default=0))
    dense = chunks <= 4 * len(ops) + 4096
    last_writer = [None] * chunks if dense else _NoneIfAbsent()
    readers_since = [None] * chunks if dense else _NoneIfAbsent()
    return offset, per_rank, last_writer, readers_since


def _grow(table, i, x):
    """Add ``x`` to cell ``i`` of an edge table, once.

    Edge tables grow as lists (appends are cheap) and become tuples at the
    end: millions of instructions, most with one or two neighbours, and a
    small tuple is a quarter the size of a set (the empty one is shared)."""
    cell = table[i]
    if cell is None:
        table[i] = [x]
    elif x not in cell:
        cell.append(x)


def _instruction_adder(ops, instrs: list, edges: _Edges):
    """``add(instr, reads, writes)``: append ``instr`` (whose id is
    ``len(instrs)``) to ``instrs`` and its edges to ``edges``, from the last
    writer and the readers since of each chunk it reads or writes."""
    offset, per_rank, last_writer, readers_since = _chunk_tables(ops)
    preds, succs, readers, overwriters, overwritten = (edges.preds, edges.succs, edges.readers, edges.overwriters,
                                                       edges.overwritten)
    pending_overwrite: list[int] = []  # per instr: chunks written and not yet overwritten
    grow = _grow

    def add(instr: Instr, reads: tuple, writes: Slice | None):
        iid = instr.id
        instrs.append(instr)
        succs.append(None)
        readers.append(None)
        overwriters.append(None)
        overwritten.append(False)
        pending_overwrite.append(0)
        block = instr.rank * per_rank
        mine = []                     # this instruction's predecessors, in the order found
        for sl in reads:
            first = block + offset[sl.buffer] + sl.index
            for key in range(first, first + sl.count):
                writer = last_writer[key]
                if writer is not None and writer != iid and writer not in mine:
                    mine.append(writer)
                    grow(readers, writer, iid)
                since = readers_since[key]
                if since is None:
                    readers_since[key] = [iid]
                else:
                    since.append(iid)
        if writes is not None:
            pending_overwrite[iid] = writes.count
            first = block + offset[writes.buffer] + writes.index
            for key in range(first, first + writes.count):
                since = readers_since[key]
                if since is not None:
                    readers_since[key] = None
                    for reader in since:
                        if reader != iid:
                            if reader not in mine:
                                mine.append(reader)
                            grow(overwriters, reader, iid)
                writer = last_writer[key]
                if writer is not None and writer != iid:
                    if writer not in mine:
                        mine.append(writer)
                    grow(overwriters, writer, iid)
                    pending_overwrite[writer] -= 1
                    if pending_overwrite[writer] == 0:
                        overwritten[writer] = True
                last_writer[key] = iid
        preds.append(tuple(mine))
        for pred in mine:
            grow(succs, pred, iid)

    return add


class _NoneIfAbsent(dict):
    """A dict read like a list of Nones: a key never stored reads as None."""

    def __missing__(self, key):
        return None


def _tuples(table: list) -> list:
    return [() if cell is None else tuple(cell) for cell in table]
