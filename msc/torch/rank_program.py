"""One rank's part of a plan at one element count, as element ranges.

Torch-free: ``compile_rank(rounds, rank, count, layout)`` turns the global
rounds (msc.torch.rounds) into a ``RankProgram``: per round, the local tensor
operations of the compute phase and the messages of the communication
phase, every operand a *piece* ``(buffer, lo, hi)`` of elements. Buffers are
``IN``/``OUT`` (the rank's physical buffers, as the collective's layout names
them) and ``ARENA``, one workspace tensor holding the scratch chunks (slot i
at [i*q, i*q + length), q = ceil(count / chunk_factor)) and after them the
staging areas of received messages and the copies of sent ones.

Chunk geometry is msc.executor's: chunk p of a user buffer is
``chunk_bounds(p, count, k)``; a chunk's length follows its class.

Two copies are avoided, both only where provably harmless:

- A message is sent straight from the buffer (a *view*) when its data is one
  contiguous range that nothing writes before the round's batch completes
  (no later step of the round writes it, and no receive of the batch lands
  on it); otherwise it is first copied to the arena.
- A received message lands straight in its destination (a *direct* receive)
  when the destination is contiguous and no step that runs before the
  receiving step touches it after the message's batch starts (that batch is
  earlier than the receiving step's round, so the data arrives early;
  it must not be seen, or overwritten, by steps that come before).
  Otherwise it lands in a staging area and is copied when its step runs.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from msc.units import chunk_bounds
from msc.ir import StepOp
from msc.torch.rounds import Rounds, Scheduled

IN, OUT, ARENA = 0, 1, 2
BUFFER = {"input": IN, "output": OUT}

Piece = tuple[int, int, int]          # (buffer, lo, hi): elements [lo, hi) of a buffer


@dataclass
class Round:
    """``ops``: compute-phase operations in order, each ("copy", dst, src)
    or ("op", dst, a, b) (dst = a (op) b); then ``sends``/``recvs``: (peer,
    piece) in the order both ends post them (by channel, then sequence).
    With the alltoall transport (and in the mixed one's dense rounds),
    ``alltoall`` = (input piece, input splits,
    output piece, output splits) replaces them: one all_to_all_single per
    round, which every rank calls (empty splits when it has nothing)."""

    t: int
    ops: list = field(default_factory=list)
    sends: list = field(default_factory=list)
    recvs: list = field(default_factory=list)
    alltoall: tuple | None = None


@dataclass
class RankProgram:
    """One rank's part of a plan at one element count: its rounds of local operations and messages."""

    rank: int
    count: int
    sizes: dict[str, int]               # physical buffer -> elements
    arena: int                          # workspace elements
    rounds: list[Round]                 # rounds where this rank does something, ascending
    averaged: list[tuple[Piece, int]]   # avg: (piece, divisor) of output ranges with >= 2 contributions
    views: int = 0                      # messages sent without a copy (statistics)
    direct: int = 0                     # messages received without a copy
    transport: str = "p2p"
    workspace: dict = field(default_factory=dict, repr=False)   # (dtype, device) -> arena tensor, for reuse

    @property
    def messages(self) -> int:
        return sum(len(r.sends) for r in self.rounds)


def overlaps(a: Piece, b: Piece) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def merge(pieces) -> list[Piece]:
    """Non-empty pieces, adjacent ones joined."""
    out: list[Piece] = []
    for b, lo, hi in pieces:
        if hi == lo:
            continue
        if out and out[-1][0] == b and out[-1][2] == lo:
            out[-1] = (b, out[-1][1], hi)
        else:
            out.append((b, lo, hi))
    return out


def segments(*operands) -> list[tuple[Piece, ...]]:
    """Operands given chunk by chunk (equal lengths per chunk), cut into the
    fewest ranges that are contiguous in every operand; empty chunks dropped."""
    out: list[list[Piece]] = []
    for ps in zip(*operands):
        if ps[0][2] == ps[0][1]:
            continue
        if out and all(c[0] == p[0] and c[2] == p[1] for c, p in zip(out[-1], ps)):
            out[-1] = [(c[0], c[1], p[2]) for c, p in zip(out[-1], ps)]
        else:
            out.append(list(ps))
    return [tuple(s) for s in out]


def split(piece: Piece, lengths) -> list[Piece]:
    """A contiguous piece cut into consecutive chunks of ``lengths``."""
    b, lo, _ = piece
    out = []
    for n in lengths:
        out.append((b, lo, lo + n))
        lo += n
    return out


def _stores_message(op: StepOp) -> bool:
    """The op writes the message it received, unchanged, to its destination (recv, rcs)."""
    return op.receives and not op.reduces and op.has_dst


class _Item:
    """A scheduled step of this rank with its operands resolved to pieces."""

    __slots__ = ("s", "pos", "srcs", "dst", "in_len", "in_lengths", "out_len", "candidate", "view",
                 "direct", "reads", "writes")

    def __init__(self, s: Scheduled, pos: int):
        self.s, self.pos = s, pos
        self.view = self.direct = False
        self.candidate = None


TRANSPORTS = ("p2p", "alltoall", "mixed")


def compile_rank(rounds: Rounds, rank: int, count: int, layout, transport: str = "p2p") -> RankProgram:
    """``transport``: "p2p" (a batch of point-to-point messages per round),
    "alltoall" (one all_to_all_single per round with a message: several
    messages to (from) different peers are packed into one send (receive)
    area; the receive area is the staging of those messages), or "mixed"
    (alltoall for the dense rounds, where at least half of all n(n-1) pairs
    talk, p2p for the others; every rank decides the same from the same
    rounds)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return _Compiler(rounds, rank, count, layout, transport).build()


class _Compiler:
    def __init__(self, rounds: Rounds, rank: int, count: int, layout, transport: str = "p2p"):
        plan = rounds.plan
        self.rounds, self.rank, self.count, self.layout = rounds, rank, count, layout
        self.transport = transport
        self.k = k = plan.chunk_factor
        self.q = q = -(-count // k) if count else 0
        self.lens = [max(0, min((c + 1) * q, count) - min(c * q, count)) for c in range(k)]
        self.cursor = plan.ranks[rank].scratch * q          # the arena starts with the scratch slots
        self.sizes = {name: chunk_bounds(chunks - 1, count, k)[1] if chunks else 0
                      for name, chunks in layout.physical_sizes.items()}

    def alloc(self, n: int) -> Piece:
        piece = (ARENA, self.cursor, self.cursor + n)
        self.cursor += n
        return piece

    def pieces(self, sl, classes) -> list[Piece]:
        if sl.buffer == "scratch":
            q = self.q
            return [(ARENA, i * q, i * q + self.lens[c]) for i, c in zip(range(sl.index, sl.index + sl.count), classes)]
        b, k, n = BUFFER[sl.buffer], self.k, self.count
        return [(b, *chunk_bounds(p, n, k)) for p in range(sl.index, sl.index + sl.count)]

    # -- passes -----------------------------------------------------------------------------------
    def build(self) -> RankProgram:
        items = [self._resolve(s, pos) for pos, s in enumerate(self.rounds.ranks[self.rank])]
        self.comm_rounds: set[int] = set()        # rounds that run one all_to_all_single
        self.packed: dict[tuple, tuple[int, int]] = {}
        if self.transport != "p2p":
            self._plan_alltoall()
        self._views(items)
        self._directs(items)
        return self._emit(items)

    def _length(self, msg) -> int:
        return sum(self.lens[c] for c in msg.classes)

    def _plan_alltoall(self) -> None:
        """Every round in which any rank sends a non-empty message (all
        ranks call the collective then), and where several messages reach
        this rank in one round: their packed receive area, in the order
        the collective lays them out (source, channel, sequence)."""
        n = self.rounds.plan.num_ranks
        messages: dict[int, int] = {}
        incoming: dict[int, list] = {}
        for sched in self.rounds.ranks:
            for s in sched:
                if s.send is not None and self._length(s.send):
                    messages[s.round] = messages.get(s.round, 0) + 1
                    if s.send.dst == self.rank:
                        incoming.setdefault(s.round, []).append(s.send)
        # "mixed": the collective only for dense rounds (at least half of all n(n-1) pairs talk);
        # a sparse round (a ring's n messages) goes point to point instead of waking every rank
        dense = 1 if self.transport == "alltoall" else max(1, n * (n - 1) // 2)
        self.comm_rounds = {t for t, m in messages.items() if m >= dense}
        incoming = {t: msgs for t, msgs in incoming.items() if t in self.comm_rounds}
        self.pack_size: dict[int, int] = {}
        for t, msgs in incoming.items():
            if len(msgs) < 2:
                continue
            at = 0
            for m in sorted(msgs, key=lambda m: (m.src, m.channel, m.seq)):
                self.packed[(m.src, m.channel, m.seq)] = (t, at)
                at += self._length(m)
            self.pack_size[t] = at
        self.packs: dict[int, Piece] = {}

    def _staging(self, msg, n: int) -> Piece:
        """Where a message that is not received directly lands."""
        hit = self.packed.get((msg.src, msg.channel, msg.seq))
        if not hit:
            return self.alloc(n)
        t, offset = hit
        if t not in self.packs:
            self.packs[t] = self.alloc(self.pack_size[t])
        b, lo, _ = self.packs[t]
        return (b, lo + offset, lo + offset + n)

    def _resolve(self, s: Scheduled, pos: int) -> _Item:
        it = _Item(s, pos)
        step = s.step
        it.srcs = [self.pieces(sl, c) for sl, c in zip(step.srcs, s.src_classes)]
        op = step.op
        dst_classes = None
        if step.dst is not None:       # it stores the message itself, or a value shaped like its source
            dst_classes = s.recv.classes if _stores_message(op) else s.src_classes[0]
        it.dst = self.pieces(step.dst, dst_classes) if step.dst is not None else None
        it.in_lengths = [self.lens[c] for c in s.recv.classes] if s.recv else []
        it.in_len = sum(it.in_lengths)
        it.out_len = sum(self.lens[c] for c in s.send.classes) if s.send else 0
        # what a view-send would read: the data as it sits in a buffer (what the step stores,
        # or its source when it only forwards that); a reduce-and-send without a destination
        # (rrs) sends what it computed in the staging area
        if s.send is not None and it.out_len:
            region = it.dst if op.has_dst else it.srcs[0] if not op.receives else None
            merged = merge(region) if region else []
            if len(merged) == 1:
                it.candidate = merged[0]
        it.reads = [p for src in it.srcs for p in src]
        it.writes = list(it.dst or ())
        return it

    def _views(self, items) -> None:
        """A candidate view is safe when no later step of its round writes it."""
        by_round: dict[int, list[_Item]] = {}
        for it in items:
            by_round.setdefault(it.s.round, []).append(it)
        for group in by_round.values():
            for i, it in enumerate(group):
                if it.candidate is None:
                    continue
                v = it.candidate
                later = (w for other in group[i + 1:] for w in other.writes)
                it.view = not any(overlaps(v, w) for w in later)

    def _directs(self, items) -> None:
        """Decide direct receives in execution order (earlier decisions are final)."""
        rounds_of = [it.s.round for it in items]
        for it in items:
            op = it.s.step.op
            if not _stores_message(op) or not it.in_len:
                continue
            dst = merge(it.dst)
            ok = len(dst) == 1 and (not op.sends or it.view)
            if (it.s.recv.src, it.s.recv.channel, it.s.recv.seq) in self.packed:
                ok = False                # lands in its round's packed receive area
            if ok:
                d, t_s = dst[0], it.s.recv.round
                for other in items[bisect_left(rounds_of, t_s):it.pos]:
                    late = other.s.round > t_s
                    if any(overlaps(d, p) for p in other.reads + other.writes) and late:
                        ok = False
                        break
                    if other.view and other.candidate is not None and overlaps(d, other.candidate):
                        ok = False        # read by the batch of round t_s, or later
                        break
            it.direct = ok
            if op.sends:
                it.view = ok              # it forwards from its destination only if it received there

    def _emit(self, items) -> RankProgram:
        rounds: dict[int, Round] = {}

        def at(t: int) -> Round:
            r = rounds.get(t)
            if r is None:
                r = rounds[t] = Round(t)
            return r

        views = directs = 0
        for it in items:
            s = it.s
            ops = at(s.round).ops
            staged = None
            if s.recv is not None and it.in_len:
                if it.direct:
                    target = merge(it.dst)[0]
                    directs += 1
                else:
                    target = staged = self._staging(s.recv, it.in_len)
                at(s.recv.round).recvs.append(((s.recv.src, s.recv.channel, s.recv.seq), target))
            payload = self._step_ops(it, ops, staged)
            if s.send is not None and it.out_len:
                if payload == it.candidate and it.view:
                    views += 1
                at(s.round).sends.append(((s.send.dst, s.send.channel, s.send.seq), payload))
        for t in self.comm_rounds:
            at(t)
        ordered = self._ordered(rounds)       # first: packing a round's messages allocates (self.cursor)
        return RankProgram(self.rank, self.count, self.sizes, self.cursor, ordered, self._averaged(), views, directs,
                       self.transport)

    def _step_ops(self, it: _Item, ops: list, staged: Piece | None) -> Piece | None:
        """Append step ``it``'s local work to its round's ``ops`` (``staged``:
        where its message landed, if not directly); returns what it sends
        (None: nothing). Decided by the op's registry properties (msc.ir's
        _STEP_OPS), as msc.ir.step_values defines what a step computes."""
        op = it.s.step.op
        if op.receives and op.reduces:
            return self._reduce_received(it, ops, staged)
        if op.receives:                                     # the message itself, stored and/or forwarded
            if op.has_dst and staged is not None:
                self._copy(ops, it.dst, split(staged, it.in_lengths))
            if op.sends and it.out_len:
                return it.candidate if it.view else staged
            return None
        if op.reduces:                                      # its sources combined
            self._reduce(ops, it.dst, it.srcs)
        elif op.has_dst:                                    # its source copied
            self._copy(ops, it.dst, it.srcs[0])
        if op.sends and it.out_len:
            return it.candidate if it.view else self._copy_to_new(ops, it.srcs[0], it.out_len)
        return None

    def _reduce_received(self, it: _Item, ops: list, staged: Piece | None) -> Piece | None:
        """SRC (+) the message: combined into the destination when nothing is
        sent or the send can read it there, else in the staging area (then
        copied to the destination, if any, and sent from there)."""
        op = it.s.step.op
        got = split(staged, it.in_lengths) if staged is not None else [(ARENA, 0, 0)] * it.s.step.count
        if op.has_dst and (not op.sends or it.view):
            self._combine(ops, it.dst, it.srcs[0], got)
            return it.candidate if op.sends else None
        self._combine(ops, got, it.srcs[0], got)
        if op.has_dst:
            self._copy(ops, it.dst, got)
        return staged if op.sends else None

    def _ordered(self, rounds: dict[int, Round]) -> list[Round]:
        """The rounds that do anything, in order, each's sends and receives
        sorted by message (a dense round as one all_to_all_single)."""
        ordered = []
        for t in sorted(rounds):
            r = rounds[t]
            r.sends = [(key[0], p) for key, p in sorted(r.sends, key=lambda x: x[0])]
            r.recvs = [(key[0], p) for key, p in sorted(r.recvs, key=lambda x: x[0])]
            if t in self.comm_rounds:
                r.alltoall = self._collective(r)
                r.sends, r.recvs = [], []
            if r.ops or r.sends or r.recvs or r.alltoall:
                ordered.append(r)
        return ordered

    def _collective(self, r: Round) -> tuple:
        """One round's all_to_all_single: input = this rank's messages by
        destination (one message: itself; several: packed by copies at the
        end of the compute phase), output = its receive target or pack."""
        n = self.rounds.plan.num_ranks
        in_splits, out_splits = [0] * n, [0] * n
        for peer, p in r.sends:
            in_splits[peer] += p[2] - p[1]
        for peer, p in r.recvs:
            out_splits[peer] += p[2] - p[1]
        empty = (ARENA, 0, 0)
        if len(r.sends) == 1:
            inp = r.sends[0][1]
        elif r.sends:
            inp = self.alloc(sum(in_splits))
            at = inp[1]
            for _, p in r.sends:
                r.ops.append(("copy", (ARENA, at, at + p[2] - p[1]), p))
                at += p[2] - p[1]
        else:
            inp = empty
        if len(r.recvs) == 1:
            out = r.recvs[0][1]
        elif r.recvs:
            out = self.packs[r.t]
            assert merge([p for _, p in r.recvs]) == [out], "a packed receive area out of order"
        else:
            out = empty
        return inp, in_splits, out, out_splits

    # -- operations -------------------------------------------------------------------------------
    def _copy(self, ops, dst, src) -> None:
        for d, s in segments(dst, src):
            if d == s:
                continue
            if overlaps(d, s):                       # never in a verified plan; kept correct anyway
                tmp = self.alloc(d[2] - d[1])
                ops.append(("copy", tmp, s))
                s = tmp
            ops.append(("copy", d, s))

    def _copy_to_new(self, ops, src, n) -> Piece:
        new = self.alloc(n)
        self._copy(ops, split(new, [p[2] - p[1] for p in src]), src)
        return new

    def _combine(self, ops, dst, a, b) -> None:
        """dst = a (op) b, chunk by chunk; dst may be exactly a or b."""
        for d, x, y in segments(dst, a, b):
            if (overlaps(d, x) and d != x) or (overlaps(d, y) and d != y):
                tmp = self.alloc(d[2] - d[1])
                ops.append(("op", tmp, x, y))
                ops.append(("copy", d, tmp))
            else:
                ops.append(("op", d, x, y))

    def _reduce(self, ops, dst, srcs) -> None:
        """dst = ((s0 (op) s1) (op) s2) ...: the executor's left fold."""
        for seg in segments(dst, *srcs):
            d, xs = seg[0], seg[1:]
            clean = all(not overlaps(d, x) or (d == x and i < 2) for i, x in enumerate(xs))
            acc = d if clean else self.alloc(d[2] - d[1])
            ops.append(("op", acc, xs[0], xs[1]))
            for x in xs[2:]:
                ops.append(("op", acc, acc, x))
            if acc != d:
                ops.append(("copy", d, acc))

    def _averaged(self) -> list[tuple[Piece, int]]:
        spans: dict[int, list[Piece]] = {}
        for _, buf, index, exp in self.layout.expected(self.rank):
            if exp is None:
                continue
            m = sum(exp.counts.values())
            if m >= 2:
                spans.setdefault(m, []).append((BUFFER[buf], *chunk_bounds(index, self.count, self.k)))
        return [(p, m) for m, ps in sorted(spans.items()) for p in merge(sorted(ps))]


def comm_conflicts(prog: RankProgram) -> list[str]:
    """Pieces of one round's communication that touch the same memory with
    at least one writing (a receive target against a payload or another
    target): the round moves them concurrently, so there must be none."""
    found = []
    for r in prog.rounds:
        if r.alltoall is not None:
            inp, _, out, _ = r.alltoall
            sends, recvs = [("all", inp)], [("all", out)]
        else:
            sends, recvs = r.sends, r.recvs
        for i, (peer, target) in enumerate(recvs):
            others = [("send to", p, x) for p, x in sends] + [("receive from", p, x) for p, x in recvs[i + 1:]]
            for what, p, x in others:
                if overlaps(target, x):
                    found.append(f"rank {prog.rank} round {r.t}: receive from {peer} into {target} overlaps "
                                 f"{what} {p} at {x}")
    return found
