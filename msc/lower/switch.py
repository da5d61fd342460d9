"""Lowering programs with switch ops (NVLS, msc.dsl.switch).

A switch op reaches other ranks' memory with no message, so only a barrier
of its group orders it against what those ranks do. Lowering cuts the trace
into epochs: a new epoch starts at the first op that touches a chunk which
an op of the current epoch touched, one of them writing it, one of them a
switch op, unless both are switch ops of one threadblock (one rank, group
and channel: program order keeps them in order). Then

- every switch op goes, in trace order, to its rank's threadblock of its
  (group, channel), which passes a barrier before the first epoch, after
  the last, and before each epoch with an access that conflicts with one of
  another rank since the last barrier: so each remote access lies between
  two barriers every member passes (an epoch cut for a conflict within one
  rank needs only that rank's dependencies); a rank in several groups
  passes them in one order, twice between epochs (see _open_epoch);
- the copies and reductions of each epoch are lowered alone by the usual
  passes (DAG, fusion, placement, order), on channels of their own, so no
  connection spans two epochs; their stores are all kept, since a later
  epoch may read them;
- on each rank, the first steps of an epoch wait for the last steps of the
  epochs before it (through the barrier on a rank of a group), and a switch
  threadblock's for the rank's other switch threadblocks (another channel
  or group) so far.

The plan is then verified like any other (msc.verification.plan).
"""
from __future__ import annotations

from msc.ir import Op, OpKind, Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.dag import build_dag
from msc.lower.fusion import forwarding_pairs, fuse_forwarding, fuse_local
from msc.lower.placement import assign, place_auto, place_manual, spread_channels
from msc.lower.schedule import build_plan, order
from msc.lower.switch_expand import latest_deps

# The protocols switch ops run with: multimem loads and stores with barriers, no LL flags (NCCL's NVLS too).
SWITCH_PROTOCOLS = ("Simple",)

_STEP = {OpKind.SWITCH_REDUCE: StepOp.SWRED, OpKind.SWITCH_STORE: StepOp.SWST,
         OpKind.SWITCH_REDUCE_STORE: StepOp.SWRS}


def has_switch_ops(ops) -> bool:
    return any(op.group for op in ops)


def epochs(ops: list[Op]) -> list[list[Op]]:
    """The trace cut where a switch op meets a conflicting access (see the
    module docstring)."""
    out: list[list[Op]] = [[]]
    seen: dict[tuple, list[tuple]] = {}       # (rank, buffer, index) -> accesses (writes, switch key or None)
    for op in ops:
        touches = list(_accesses(op))
        if any(_conflict(a, b) for key, a in touches for b in seen.get(key, ())):
            out.append([])
            seen = {}
        out[-1].append(op)
        for key, access in touches:
            seen.setdefault(key, []).append(access)
    return out


def barriers_needed(parts: list[list[Op]]) -> list[bool]:
    """Per epoch, whether a barrier must precede it: the first does; a later
    one where it touches a chunk that an op of another rank touched since
    the last barrier, one of the two writing (only a switch op reaches
    another rank's chunk, so only those can)."""
    out, since = [], {}
    for e, part in enumerate(parts):
        touches = [(key, access, rank) for op in part for key, access, rank in _issued(op)]
        needed = e == 0 or any(rank != r and (access[0] or a[0])
                               for key, access, rank in touches for a, r in since.get(key, ()))
        if needed:
            since = {}
        for key, access, rank in touches:
            since.setdefault(key, []).append((access, rank))
        out.append(needed)
    return out


def _issued(op: Op):
    """_accesses of ``op`` with the rank whose step makes each (a copy's
    read by its sender, its write by its receiver; a switch op's by its rank)."""
    for key, access in _accesses(op):
        yield key, access, op.src_rank if op.group or key[0] == op.src_rank and not access[0] else op.dst_rank


def _accesses(op: Op):
    """((rank, buffer, index), (writes, tb key)) of every chunk ``op``
    touches; the tb key is (rank, group, channel) for a switch op, None else."""
    if not op.group:
        for x in range(op.size):
            yield (op.src_rank, op.src_buffer, op.src_index + x), (False, None)
            yield (op.dst_rank, op.dst_buffer, op.dst_index + x), (True, None)
        return
    tb = (op.src_rank, op.group, op.channel or 0)
    readers = (op.src_rank,) if op.kind is OpKind.SWITCH_STORE else op.group
    writers = (op.dst_rank,) if op.kind is OpKind.SWITCH_REDUCE else op.group
    for x in range(op.size):
        for m in readers:
            yield (m, op.src_buffer, op.src_index + x), (False, tb)
        for m in writers:
            yield (m, op.dst_buffer, op.dst_index + x), (True, tb)


def _conflict(a, b) -> bool:
    (wa, ta), (wb, tb) = a, b
    return (wa or wb) and (ta is not None or tb is not None) and (ta is None or ta != tb)


def lower_switch(ops: list[Op], scratch: list[int], n: int, options, fields: dict, priority: str) -> Plan:
    """The plan of a program with switch ops (see the module docstring);
    LoweringError where an epoch has no step order of ``priority``."""
    parts = epochs(ops)
    groups = sorted({(op.group, op.channel or 0) for op in ops if op.group})
    switch = {(m, g, c): _SwitchTb() for g, c in groups for m in g}   # (rank, group, channel) -> its steps
    rank_tbs: list[list[Threadblock]] = [[] for _ in range(n)]       # the epochs' threadblocks, renumbered later
    channel_base = 1 + max((c for _, c in groups), default=-1)
    done: list[list[tuple[int, int]]] = [[] for _ in range(n)]      # per rank: (tb index, last step) of past epochs
    by_rank: dict[int, list] = {}                                     # rank -> its switch threadblocks' keys, in order
    for key in switch:
        by_rank.setdefault(key[0], []).append(key)
    # a rank in groups of different members (pairs, then cross pairs) orders them through both: see _open_epoch
    mixed = any(len({key[1] for key in keys}) > 1 for keys in by_rank.values())
    for e, (part, barrier) in enumerate(zip(parts, barriers_needed(parts))):
        _open_epoch(switch, by_rank, done, barrier, rounds=2 if mixed and e > 0 else 1)
        # (a threadblock past its first barrier only: that barrier is passed once per call, and waiting
        # for it would wait, tile by tile, for the threadblock's previous tile)
        gates = {key: ("switch", key, len(tb.steps) - 1) for key, tb in switch.items() if len(tb.steps) > 1}
        for op in part:
            if op.group:
                switch[(op.src_rank, op.group, op.channel or 0)].add(_switch_step(op))
        two_sided = [op for op in part if not op.group]
        if two_sided:
            sub = _epoch_plan(two_sided, scratch, n, options, fields, priority)
            channel_base = _append_epoch(sub, rank_tbs, done, gates, channel_base)
    for tb in switch.values():
        # the last barrier orders only the threadblock's own switch accesses before every member's return:
        # waiting for the rank's copies too would hold its switch steps to their pace tile by tile
        tb.pending = ()
        tb.add(Step(StepOp.BARRIER, (), None, 1, ()))
    return _assemble(fields, scratch, n, groups, {key: tb.steps for key, tb in switch.items()}, rank_tbs)


def _open_epoch(switch: dict, by_rank: dict, done, barrier: bool, rounds: int) -> None:
    """Start an epoch on every switch threadblock. With a barrier, a rank
    arrives at its groups' barriers once all its earlier steps are done (its
    other threadblocks' too). Where a rank is in groups of different members,
    every rank passes its barriers twice, one after another in the plan's
    group order, and starts the epoch's switch ops only after the last; every
    rank takes its groups in the same order, so no barrier waits on a later
    one. Without one (a cut within ranks), each threadblock's
    next step waits for the rank's past epochs and its other switch
    threadblocks' last steps."""
    # An op of group G after one of group F that touched a member m of both (F's issuer a, G's issuer b)
    # is ordered by a -> F's barrier -> m -> G's barrier -> b: m must pass F's barrier before arriving
    # at G's. One round in a fixed order gives that only where F comes first, a second round always.
    # (Before the first epoch nothing is ordered: the barrier only says every member has started its call.)
    for rank, keys in sorted(by_rank.items()):
        past = tuple(("epoch", t, s) for t, s in done[rank])
        last = {key: ("switch", key, len(switch[key].steps) - 1) for key in keys if len(switch[key].steps) > 1}
        if barrier:
            previous = ()
            for key in keys * rounds:
                mine = tuple(gate for k, gate in last.items() if k != key)
                switch[key].add(Step(StepOp.BARRIER, (), None, 1, past + mine + previous))
                if rounds > 1:          # chained: one group's barrier after the other's
                    previous = (("switch", key, len(switch[key].steps) - 1),)
            for key in keys[:-1]:
                switch[key].pending += previous
        else:
            for key in keys:
                switch[key].pending += past + tuple(gate for k, gate in last.items() if k != key)


class _SwitchTb:
    """The steps of one switch threadblock so far, and the dependencies its
    next step takes on (the rank's past epochs, where no barrier came between)."""

    def __init__(self):
        self.steps: list[Step] = []
        self.pending: tuple = ()

    def add(self, step: Step) -> None:
        if self.pending:
            step = Step(step.op, step.srcs, step.dst, step.count, step.deps + self.pending, step.where)
            self.pending = ()
        self.steps.append(step)


def _switch_step(op: Op) -> Step:
    return Step(_STEP[op.kind], (Slice(op.src_buffer, op.src_index, op.size),),
                Slice(op.dst_buffer, op.dst_index, op.size), op.size, (), op.where)


def _epoch_plan(ops, scratch, n, options, fields, priority) -> Plan:
    """The usual passes over one epoch's copies and reductions (no dead-store
    dropping, no scratch compaction: later epochs may read what it stores)."""
    dag = build_dag(ops)
    if options.threadblocks == "auto":
        dag = spread_channels(dag, n)
    if options.fuse:
        dag = fuse_local(dag)
    pairs = forwarding_pairs(dag) if options.fuse else []
    placement = place_manual(dag, n) if options.threadblocks == "manual" else place_auto(dag, pairs, n)
    if options.fuse:
        dag = fuse_forwarding(dag, placement.allows, pairs)
    tb_of, placement = assign(dag, placement, n)
    return build_plan(dag, order(dag, priority), tb_of, placement, num_ranks=n, scratch=scratch, **fields)


def _append_epoch(sub: Plan, rank_tbs, done, gates, channel_base: int) -> int:
    """Add one epoch's threadblocks to every rank: channels moved past the
    ones used so far, dependencies renumbered, the first step of each
    waiting for the rank's switch threadblocks (their barrier, or their
    last step) and its past epochs. Returns the next free channel."""
    width = 1 + max((tb.channel for rp in sub.ranks for tb in rp.threadblocks), default=-1)
    for rp in sub.ranks:
        r, start = rp.rank, len(rank_tbs[rp.rank])
        before = tuple(gate for key, gate in gates.items() if key[0] == r) + \
            tuple(("epoch", t, s) for t, s in done[r])
        for tb in rp.threadblocks:
            steps = []
            for i, st in enumerate(tb.steps):
                deps = tuple(("epoch", start + t, s) for t, s in st.deps)
                steps.append(Step(st.op, st.srcs, st.dst, st.count, deps + (before if i == 0 else ()), st.where))
            rank_tbs[r].append(Threadblock(start + tb.id, tb.send, tb.recv, channel_base + tb.channel, tuple(steps)))
        done[r] = [(t, len(rank_tbs[r][t].steps) - 1) for t in range(len(rank_tbs[r])) if rank_tbs[r][t].steps]
    return channel_base + width


def _assemble(fields, scratch, n, groups, switch_tbs, rank_tbs) -> Plan:
    """Per rank: its switch threadblocks first, then the epochs'; symbolic
    dependencies (("switch", key, step), ("epoch", tb, step)) resolved."""
    ranks = []
    for r in range(n):
        mine = [(g, c) for g, c in groups if r in g]
        number = {(r, g, c): i for i, (g, c) in enumerate(mine)}
        offset = len(mine)

        def resolve(dep):
            if dep[0] == "switch":
                return number[dep[1]], dep[2]
            return offset + dep[1], dep[2]

        def resolved(steps):
            return tuple(Step(st.op, st.srcs, st.dst, st.count, latest_deps(map(resolve, st.deps)), st.where)
                         for st in steps)

        tbs = [Threadblock(i, None, None, c, resolved(switch_tbs[(r, g, c)]), g) for i, (g, c) in enumerate(mine)]
        tbs += [Threadblock(len(tbs) + i, tb.send, tb.recv, tb.channel, resolved(tb.steps))
                for i, tb in enumerate(rank_tbs[r])]
        ranks.append(RankPlan(r, scratch[r], tuple(tbs)))
    return Plan(fields["name"], fields["collective"], n, fields["chunk_factor"], fields["inplace"],
                fields["input_chunks"], fields["output_chunks"], tuple(ranks), fields["root"], fields["protocol"],
                fields["instances"], fields["slots"], fields["tile"])
