"""Running a plan's threadblocks as far as they can go: the blocking
semantics every executor of a plan shares (the plan verifier on symbolic
data, the reference executor on numpy arrays). Each threadblock runs its
steps in order until one is blocked (a dependency not done, no message, no
space on a connection); it then waits on that reason until a step that may
release it runs. Callers supply what blocks a step and how to run it.
"""
from __future__ import annotations

import bisect
from typing import Callable

from msc.ir import Plan, StepOp


def drive(plan: Plan, pcs: list[list[int]], blocker: Callable, run: Callable, rng=None) -> None:
    """Advance ``pcs[rank][tb]`` until nothing can move.

    ``blocker(rank, tb, step)``: None when the step can run, else a hashable
    reason. ``run(rank, tb, s, step)``: runs step ``s`` and returns the
    reasons it may have released (("tb", rank, t) is released by every step
    of threadblock t). ``rng``: take runnable threadblocks in random order.
    The caller checks which threadblocks did not finish.
    """
    waiting: dict = {}                # reason -> threadblocks waiting on it
    # Waits on a threadblock's progress, per rank and threadblock: every step
    # releases them, and a list lookup is cheaper than building a key for a dict.
    on_tb = [[None] * len(rp.threadblocks) for rp in plan.ranks]
    work = [(rp.rank, tb.id) for rp in plan.ranks for tb in rp.threadblocks]
    work.reverse()
    while work:
        if rng is not None:
            i = rng.randrange(len(work))
            work[i], work[-1] = work[-1], work[i]
        rank, t = work.pop()
        tb = plan.ranks[rank].threadblocks[t]
        steps, pc, mine = tb.steps, pcs[rank], on_tb[rank]
        while pc[t] < len(steps):
            s = pc[t]
            step = steps[s]
            reason = blocker(rank, tb, step)
            if reason is not None:
                if reason[0] == "tb":
                    _, r, dt = reason
                    if on_tb[r][dt] is None:
                        on_tb[r][dt] = []
                    on_tb[r][dt].append((rank, t))
                else:
                    waiting.setdefault(reason, []).append((rank, t))
                break
            released = run(rank, tb, s, step)
            pc[t] = s + 1
            for key in released:
                if key[0] == "tb":
                    _, r, dt = key
                    if on_tb[r][dt] is not None:
                        work.extend(on_tb[r][dt])
                        on_tb[r][dt] = None
                else:
                    work.extend(waiting.pop(key, ()))
            if mine[t] is not None:
                work.extend(mine[t])
                mine[t] = None


class GroupBarriers:
    """The barriers of a plan's switch groups, as every executor blocks on
    them: the k-th barrier step of a (group, channel) threadblock completes
    when every member's threadblock of that (group, channel) has reached its
    own k-th barrier with that step's dependencies done, or passed it.

    ``blocker`` gives a blocked barrier's reason, ("bar", member, tb): it is
    released by every step that member threadblock runs (``released``)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.tb_of: dict[tuple, dict[int, int]] = {}               # (group, channel) -> member -> its threadblock
        self.steps: dict[tuple[int, int], list[int]] = {}          # (rank, tb) -> indices of its barrier steps
        for rp in plan.ranks:
            for tb in rp.threadblocks:
                if tb.group:
                    self.tb_of.setdefault((tb.group, tb.channel), {})[rp.rank] = tb.id
                    self.steps[(rp.rank, tb.id)] = [s for s, st in enumerate(tb.steps) if st.op is StepOp.BARRIER]

    def index(self, rank: int, t: int, s: int) -> int:
        """Which barrier of its threadblock step ``s`` is (k)."""
        return bisect.bisect_left(self.steps[(rank, t)], s)

    def peers(self, rank: int, tb, s: int) -> list[tuple[int, int, int]]:
        """(member, its threadblock, its matching barrier step) of every other
        member, for barrier step ``s`` of ``tb`` on ``rank``."""
        k = self.index(rank, tb.id, s)
        mine = self.tb_of[(tb.group, tb.channel)]
        return [(m, mine[m], self.steps[(m, mine[m])][k]) for m in tb.group if m != rank]

    def blocker(self, pcs: list[list[int]], rank: int, tb, s: int):
        """None when barrier step ``s`` of ``tb`` may complete, else ("bar", member, tb)."""
        for m, t, b in self.peers(rank, tb, s):
            pc = pcs[m][t]
            if pc < b or pc == b and any(pcs[m][dt] <= ds for dt, ds in
                                         self.plan.ranks[m].threadblocks[t].steps[b].deps):
                return ("bar", m, t)
        return None

    @staticmethod
    def released(rank: int, tb) -> tuple:
        """What a step of ``tb`` releases: members waiting at a barrier for it."""
        return (("bar", rank, tb.id),) if tb.group else ()


class Fifo:
    """One connection: its messages in send order, how many were received,
    and the two reasons to wait on it (built once: they key the waits)."""

    __slots__ = ("items", "head", "msg", "space")

    def __init__(self, conn: tuple):
        self.items, self.head = [], 0
        self.msg, self.space = ("msg", conn), ("space", conn)

    def take(self):
        """The oldest message not yet received (the step that receives has checked there is one)."""
        item = self.items[self.head]
        self.items[self.head] = None          # received: nothing keeps it alive
        self.head += 1
        return item


class Connections:
    """What blocks a step, as every executor of a plan decides it: a
    dependency not done, no message on the connection it receives from, no
    free slot of ``capacity`` on the one it sends to, a switch barrier not
    reached by every member. Holds each connection's Fifo; ``fifo_in`` and
    ``fifo_out`` give, per rank and threadblock, the one it receives from and
    sends to (None: none). ``pcs``: the executor's program counters, read by
    ``blocker``."""

    def __init__(self, plan: Plan, capacity: int, pcs: list[list[int]]):
        self.capacity, self.pcs = capacity, pcs
        self.queues: dict[tuple, Fifo] = {}
        self.fifo_in = [[None] * len(rp.threadblocks) for rp in plan.ranks]
        self.fifo_out = [[None] * len(rp.threadblocks) for rp in plan.ranks]
        for rp in plan.ranks:
            for tb in rp.threadblocks:
                if tb.send is not None:
                    self.fifo_out[rp.rank][tb.id] = self._fifo((rp.rank, tb.send, tb.channel))
                if tb.recv is not None:
                    self.fifo_in[rp.rank][tb.id] = self._fifo((tb.recv, rp.rank, tb.channel))
        self.barriers = GroupBarriers(plan)

    def _fifo(self, conn: tuple) -> Fifo:
        if conn not in self.queues:
            self.queues[conn] = Fifo(conn)
        return self.queues[conn]

    def blocker(self, rank: int, tb, step):
        """None when ``step`` of ``tb`` on ``rank`` can run, else the reason it waits (drive's)."""
        pcs = self.pcs[rank]
        for dt, ds in step.deps:
            if pcs[dt] <= ds:
                return ("tb", rank, dt)
        if step.op.receives:
            fifo = self.fifo_in[rank][tb.id]
            if fifo.head >= len(fifo.items):
                return fifo.msg
        if step.op.sends:
            fifo = self.fifo_out[rank][tb.id]
            if len(fifo.items) - fifo.head >= self.capacity:
                return fifo.space
        if step.op is StepOp.BARRIER:
            return self.barriers.blocker(self.pcs, rank, tb, pcs[tb.id])
        return None
