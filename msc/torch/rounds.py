"""A plan as global *rounds*: the schedule every rank computes for itself.

Torch-free: this module turns a plan into, per rank, the order its steps run
in and the round each runs in. Every rank computes the same schedule from
the same plan, so the ranks agree on which messages travel in which round
without talking about it.

Round t is a compute phase (steps whose operands are ready run, in a fixed
order) followed by a communication phase (every message sent by a step of
round t travels, as one batch of isend/irecv). A step that receives runs in a
round after the one its message was sent in. So round t's batch only needs
messages that were produced before it, and no rank ever waits for a message
that the sender has not posted: the rounds cannot deadlock.

Connections are unbounded here (a message waits in a staging buffer until
its step runs): a plan verified deadlock-free with ``plan.slots`` slots runs
with more, and its results do not depend on the capacity (a Kahn network).

The same pass tracks each chunk's *class* (c = index % chunk_factor of the
user-buffer chunk it came from): a chunk's length depends only on its class
and the run-time count, so lengths are known before any data moves and both
ends of a message agree on its size (empty messages are skipped by both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from msc.errors import ExecutionError
from msc.ir import Plan, Slice, Step, step_values
from msc.perf import pause_gc
from msc.verification.plan_values import check_plan


class Message(NamedTuple):
    """The ``seq``-th message on connection (src, dst, channel), sent in
    round ``round``; ``classes``: the class of each chunk it carries.
    (NamedTuples: a large plan makes millions of these and the next.)"""

    src: int
    dst: int
    channel: int
    seq: int
    round: int
    classes: tuple[int, ...]


class Scheduled(NamedTuple):
    """One step as it runs: its round, where it is, the classes of its
    source operands (per source, per chunk) and the messages it takes and
    makes."""

    round: int
    tb: int
    index: int
    step: Step
    src_classes: tuple[tuple[int, ...], ...]
    recv: Message | None
    send: Message | None


@dataclass(frozen=True)
class Rounds:
    """A plan's schedule: ``ranks[r]`` lists rank r's steps in execution
    order (rounds ascending); ``num_rounds`` counts rounds 0..num_rounds-1."""

    plan: Plan
    ranks: tuple[tuple[Scheduled, ...], ...]
    num_rounds: int


@pause_gc
def schedule(plan: Plan) -> Rounds:
    """Simulate the plan round by round (all ranks, no data, only classes)."""
    check_plan(plan)
    return _Sim(plan).run()


class _Sim:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.k = plan.chunk_factor
        self.pcs = [[0] * len(rp.threadblocks) for rp in plan.ranks]
        self.scratch: list[list[int | None]] = [[None] * rp.scratch for rp in plan.ranks]
        self.sent: dict[tuple, list[Message]] = {}     # connection -> messages in order
        self.taken: dict[tuple, int] = {}              # connection -> messages received
        self.out: list[list[Scheduled]] = [[] for _ in plan.ranks]

    def run(self) -> Rounds:
        """Event-driven: a threadblock is looked at again only when what it
        waits for happens (a dependency moves on: this round; a message is
        sent: next round), so the work is linear in the plan's size."""
        plan = self.plan
        now = [(rp.rank, tb.id) for rp in plan.ranks for tb in rp.threadblocks]
        waiting: dict[tuple, list] = {}
        left, t = plan.num_steps(), 0
        while left:
            later: list = []
            queued = set(now)
            while now:
                rank, b = now.pop()
                queued.discard((rank, b))
                tb = plan.ranks[rank].threadblocks[b]
                pcs = self.pcs[rank]
                while pcs[b] < len(tb.steps):
                    step = tb.steps[pcs[b]]
                    blocker = self._blocker(rank, tb, step, t)
                    if blocker is not None:
                        if blocker == "next round":
                            later.append((rank, b))
                        else:
                            waiting.setdefault(blocker, []).append((rank, b))
                        break
                    self._execute(rank, tb, pcs[b], step, t)
                    pcs[b] += 1
                    left -= 1
                    for w in waiting.pop(("tb", rank, b), ()):
                        if w not in queued:
                            queued.add(w)
                            now.append(w)
                    if step.op.sends:          # its message can be taken next round
                        later.extend(waiting.pop(("msg", (rank, tb.send, tb.channel)), ()))
            if left and not later:
                self._stuck(t)
            now = list(dict.fromkeys(later))
            t += 1
        return Rounds(plan, tuple(tuple(x) for x in self.out), t)

    def _blocker(self, rank, tb, step, t):
        """None if the step can run in round t, else what it waits for."""
        pcs = self.pcs[rank]
        for dt, ds in step.deps:
            if pcs[dt] <= ds:
                return ("tb", rank, dt)
        if step.op.receives:
            conn = (tb.recv, rank, tb.channel)
            sent, seq = self.sent.get(conn, ()), self.taken.get(conn, 0)
            if seq >= len(sent):
                return ("msg", conn)
            if sent[seq].round >= t:
                return "next round"
        return None

    def _fail(self, rank, tb, s, what):
        step = tb.steps[s]
        raise ExecutionError(f"rank {rank} threadblock {tb.id} step {s} ({step.op.value}): {what}",
                             rank=rank, tb=tb.id, step=s, where=step.where)

    def _classes(self, rank, tb, s, sl: Slice) -> tuple[int, ...]:
        if sl.buffer == "scratch":
            got = self.scratch[rank][sl.index:sl.index + sl.count]
            for j, c in enumerate(got):
                if c is None:
                    self._fail(rank, tb, s, f"reads scratch[{sl.index + j}], which nothing has written")
            return tuple(got)
        return tuple(p % self.k for p in range(sl.index, sl.index + sl.count))

    def _store(self, rank, tb, s, sl: Slice, classes) -> None:
        if sl.buffer == "scratch":
            self.scratch[rank][sl.index:sl.index + sl.count] = classes
            return
        for p, c in zip(range(sl.index, sl.index + sl.count), classes):
            if p % self.k != c:
                self._fail(rank, tb, s, f"writes a chunk of class {c} into {sl.buffer}[{p}] (class "
                                        f"{p % self.k} of {self.k}): its length differs at some counts")

    def _same(self, rank, tb, s, a, b):
        if a != b:
            self._fail(rank, tb, s, f"reduces chunks of classes {list(a)} and {list(b)}: the plan mixes chunk classes")
        return a

    def _execute(self, rank, tb, s, step, t) -> None:
        op = step.op
        srcs = tuple(self._classes(rank, tb, s, sl) for sl in step.srcs)
        recv = send = None
        got = None
        if op.receives:
            conn = (tb.recv, rank, tb.channel)
            seq = self.taken.get(conn, 0)
            recv = self.sent[conn][seq]
            self.taken[conn] = seq + 1
            got = recv.classes
            if len(got) != step.count:
                self._fail(rank, tb, s, f"receives a message of {len(got)} chunks, the step takes {step.count}")
        stored, sent = step_values(op, srcs, got, lambda a, b: self._same(rank, tb, s, a, b))
        if step.dst is not None:
            self._store(rank, tb, s, step.dst, stored)
        if op.sends:
            conn = (rank, tb.send, tb.channel)
            queue = self.sent.setdefault(conn, [])
            send = Message(rank, tb.send, tb.channel, len(queue), t, tuple(sent))
            queue.append(send)
        self.out[rank].append(Scheduled(t, tb.id, s, step, srcs, recv, send))

    def _stuck(self, t) -> None:
        stuck = [(rp.rank, tb.id, self.pcs[rp.rank][tb.id]) for rp in self.plan.ranks for tb in rp.threadblocks
                 if self.pcs[rp.rank][tb.id] < len(tb.steps)]
        text = "; ".join(f"rank {r} threadblock {b} step {s}" for r, b, s in stuck[:8])
        r, b, s = stuck[0]
        raise ExecutionError(f"the plan is stuck in round {t} even with unbounded connections: {len(stuck)} "
                             f"threadblock(s) cannot go on: {text}", rank=r, tb=b, step=s)
