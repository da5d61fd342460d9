"""Switch ops as messages: a plan with the same results and no switch ops,
for executors that have no switch (the torch executor over gloo or NCCL).

Each switch threadblock keeps its place and its steps' positions (other
threadblocks' dependencies on it stay valid); its steps become:

- barrier: a nop that waits for the rank's own side of the epoch before it
  (the rank's messages for the switch ops of that epoch); nothing crosses
  ranks, since every access to another rank's memory becomes that rank's
  own send or receive;
- swred X -> D of rank r: a reduce of the members' copies of X in member
  order into D: r's own X, and for each other member a scratch copy it
  received from that member, which sends its X once its epoch has begun;
- swst S -> D: a copy S -> D, and S sent to every other member, which
  receives it into its D;
- swrs X -> D: the reduce of swred, then D sent to every other member
  (which receives it after it has sent its own X: in place X is D).

Messages travel on connections of their own: one threadblock per member
pair and direction, on a channel past the plan's, in the order of the
issuing rank's steps. The result is verified like any plan (the tests
verify the expansion of every library plan with switch ops).
"""
from __future__ import annotations

from dataclasses import replace

from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.ir.worklist import GroupBarriers


def expand_switch_ops(plan: Plan) -> Plan:
    """``plan`` with its switch ops as messages (see the module docstring);
    a plan without switch ops is returned as it is."""
    if plan.first_switch_step() is None:
        return plan
    return _Expansion(plan).plan()


class _Expansion:
    def __init__(self, plan: Plan):
        self.old = plan
        self.n = plan.num_ranks
        self.base = 1 + max(tb.channel for rp in plan.ranks for tb in rp.threadblocks)
        self.scratch = [rp.scratch for rp in plan.ranks]
        self.tbs = [list(rp.threadblocks) for rp in plan.ranks]
        self.links: dict[tuple, int] = {}            # (rank, peer, channel, "send"/"recv") -> its tb index
        self.switch_tb = GroupBarriers(plan).tb_of   # (group, channel) -> member -> its switch threadblock
        self.epoch_start: dict[tuple, int | None] = {}     # (rank, group, channel) -> its current barrier step
        self.epoch_steps: dict[tuple, list[tuple[int, int]]] = {}    # (rank, group, channel) -> helper steps since
        self.sent_x: dict[tuple, tuple[int, int]] = {}     # (member, rank, tb, step) -> the member's send of its copy

    def plan(self) -> Plan:
        for rank, t in self._switch_tbs():
            self._begin(self._key(rank, self.old.ranks[rank].threadblocks[t]), None)
        for rank, t, s, phase in self._ops_in_order():
            self._expand(rank, t, s, phase)
        ranks = tuple(RankPlan(r, self.scratch[r], tuple(self.tbs[r])) for r in range(self.n))
        return replace(self.old, ranks=ranks)

    def _switch_tbs(self):
        return [(rp.rank, tb.id) for rp in self.old.ranks for tb in rp.threadblocks if tb.group]

    def _ops_in_order(self):
        """(rank, threadblock, step, phase) of every switch step, epoch by
        epoch (the k-th barrier of every member before any step after it);
        in an epoch, every member's copies travel (phase 0) before any
        result does (phase 1), so no reduce waits behind another's result."""
        steps = []
        for rank, t in self._switch_tbs():
            tb = self.old.ranks[rank].threadblocks[t]
            k = 0
            for s, step in enumerate(tb.steps):
                k += step.op is StepOp.BARRIER
                steps.append((k, step.op is not StepOp.BARRIER, 0, rank, t, s))
                if step.op.group_writes:
                    steps.append((k, True, 1, rank, t, s))
        return [(rank, t, s, phase) for _, _, phase, rank, t, s in sorted(steps)]

    # -- threadblocks and scratch ------------------------------------------------------
    def _key(self, rank: int, tb: Threadblock) -> tuple:
        return rank, tb.group, tb.channel

    def _begin(self, key, step_index) -> None:
        self.epoch_start[key] = step_index
        self.epoch_steps[key] = []

    def _link(self, rank: int, peer: int, channel: int, side: str) -> int:
        """The threadblock of ``rank`` that sends to (receives from) ``peer`` on ``channel``."""
        key = (rank, peer, channel, side)
        if key not in self.links:
            t = len(self.tbs[rank])
            send, recv = (peer, None) if side == "send" else (None, peer)
            self.tbs[rank].append(Threadblock(t, send, recv, self.base + channel, ()))
            self.links[key] = t
        return self.links[key]

    def _add(self, rank: int, t: int, step: Step) -> tuple[int, int]:
        tb = self.tbs[rank][t]
        self.tbs[rank][t] = replace(tb, steps=tb.steps + (step,))
        return t, len(tb.steps)

    def _temp(self, rank: int, count: int) -> Slice:
        sl = Slice("scratch", self.scratch[rank], count)
        self.scratch[rank] += count
        return sl

    def _gate(self, key) -> tuple:
        """The dependency a helper step of ``key``'s epoch takes: its barrier (as a nop)."""
        at = self.epoch_start[key]
        rank, group, channel = key
        return () if at is None else ((self.switch_tb[(group, channel)][rank], at),)

    # -- one switch step ---------------------------------------------------------------
    def _expand(self, rank: int, t: int, s: int, phase: int) -> None:
        tb = self.old.ranks[rank].threadblocks[t]
        step = tb.steps[s]
        key = self._key(rank, tb)
        if phase == 1:
            self._multicast(rank, t, s, step, tb.group)
            return
        if step.op is StepOp.BARRIER:
            waits = tuple(self.epoch_steps[key])
            self._replace(rank, t, s, Step(StepOp.NOP, (), None, 1, latest_deps(step.deps + waits), step.where))
            self._begin(key, s)
            return
        group = tb.group
        if step.op.group_reads:
            self._reduce(rank, t, s, step, group)
        else:
            same = step.srcs[0] == step.dst
            op = Step(StepOp.NOP, (), None, 1, step.deps, step.where) if same else \
                Step(StepOp.COPY, step.srcs, step.dst, step.count, step.deps, step.where)
            self._replace(rank, t, s, op)

    def _reduce(self, rank, t, s, step, group) -> None:
        """The members' copies of the source, in member order, into the destination."""
        x = step.srcs[0]
        channel = self.old.ranks[rank].threadblocks[t].channel
        sources, deps = [], list(step.deps)
        for m in group:
            if m == rank:
                sources.append(x)
                continue
            mkey = (m, group, channel)
            st = self._link(m, rank, channel, "send")
            sent = self._add(m, st, Step(StepOp.SEND, (x,), None, step.count, self._gate(mkey), step.where))
            self.epoch_steps[mkey].append(sent)
            temp = self._temp(rank, step.count)
            rt = self._link(rank, m, channel, "recv")
            got = self._add(rank, rt, Step(StepOp.RECV, (), temp, step.count, self._gate((rank, group, channel)),
                                           step.where))
            self.epoch_steps[(rank, group, channel)].append(got)
            sources.append(temp)
            deps.append(got)
            self.sent_x[(m, rank, t, s)] = sent
        self._replace(rank, t, s, Step(StepOp.REDUCE, tuple(sources), step.dst, step.count, latest_deps(deps), step.where))

    def _multicast(self, rank, t, s, step, group) -> None:
        """The destination (as this step left it) to every other member's destination."""
        d = step.dst
        channel = self.old.ranks[rank].threadblocks[t].channel
        for m in group:
            if m == rank:
                continue
            st = self._link(rank, m, channel, "send")
            sent = self._add(rank, st, Step(StepOp.SEND, (d,), None, step.count, ((t, s),), step.where))
            self.epoch_steps[(rank, group, channel)].append(sent)
            rt = self._link(m, rank, channel, "recv")
            mkey = (m, group, channel)
            after = self._gate(mkey)
            mine = self.sent_x.get((m, rank, t, s))
            if mine is not None:              # in place its source is this destination: send it first
                after = after + (mine,)
            got = self._add(m, rt, Step(StepOp.RECV, (), d, step.count, latest_deps(after), step.where))
            self.epoch_steps[mkey].append(got)

    def _replace(self, rank: int, t: int, s: int, step: Step) -> None:
        tb = self.tbs[rank][t]
        steps = list(tb.steps)
        steps[s] = step
        self.tbs[rank][t] = replace(tb, steps=tuple(steps), group=())


def latest_deps(deps) -> tuple[tuple[int, int], ...]:
    """One dependency per threadblock: on its latest step named (sorted)."""
    latest: dict[int, int] = {}
    for t, s in deps:
        latest[t] = max(s, latest.get(t, -1))
    return tuple(sorted(latest.items()))
