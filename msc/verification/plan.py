"""The plan verifier: independent of the DSL verifier, it executes a plan
abstractly, threadblock by threadblock, with symbolic chunks and FIFO
connections that hold at most ``slots`` messages.

- Postcondition: every output chunk holds exactly the contributions the
  collective requires (the DSL verifier's multisets, ``msc.verification.program_verifier``).
- Size independence: a chunk's *class* is its index within its data unit
  (index mod chunk factor). Data may only land in a user-buffer chunk of its
  own class and only same-class chunks are reduced together; then any element
  count works, tail chunks included (each class has one length at run time).
- Deadlock: when no threadblock can move, the waits (dependency, message,
  space on a connection) are followed to a cycle, which the error lists.
- Races: two steps of one rank that touch the same chunk, one writing, must
  be ordered by happens-before: program order, dependencies and
  send -> receive. Checked on the happens-before relation, not on the order
  this executor happened to pick, so the verdict does not depend on it.
- Switch ops (NVLS) read and write the memory of every member of their
  threadblock's group; only group barriers order them against the members'
  steps: the k-th barrier of a (group, channel) on each member completes
  when every member has reached its own (and that barrier's dependencies are
  done), so whatever precedes one member's barrier happens before whatever
  follows any member's. An access of a switch op to another rank's chunk
  must be ordered with every conflicting access to that chunk.

Deadlock-freedom and the symbolic result do not depend on the execution
order either: each threadblock is sequential and connections are FIFO with
blocking ends (a Kahn network), so every order reaches the same state.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from functools import lru_cache

from msc.verification import plan_fast
from msc.dsl.collectives import Collective, get_collective
from msc.errors import DeadlockError, PlanError, RaceError, UsageError, VerificationError
from msc.ir import Plan, step_values
from msc.perf import pause_gc
from msc.verification import crosscheck
from msc.verification.plan_values import check_plan
from msc.verification.program_verifier import Sum, contribution_error, contributions
from msc.ir.worklist import Connections, drive


@dataclass(frozen=True)
class PlanReport:
    name: str
    collective: str
    num_ranks: int
    threadblocks: int
    steps: int
    connections: int
    slots: int
    seconds: float
    results_checked: bool = True      # False: a custom collective nothing states, checked structurally

    def to_dict(self) -> dict:
        return {"plan": self.name, "collective": self.collective, "ranks": self.num_ranks,
                "threadblocks": self.threadblocks, "steps": self.steps, "connections": self.connections,
                "slots": self.slots, "seconds": round(self.seconds, 6), "verified": True,
                "results_checked": self.results_checked}


@pause_gc
def check_races(plan: Plan, *, collective: Collective | None = None,
                prepared: plan_fast.PlanReading | None = None) -> None:
    """Only the race check of verify_plan (RaceError); the plan must be checked.
    ``prepared``: as for verify_plan."""
    coll = collective or plan_collective(plan)
    if not _may_race(plan):
        return
    _race_check(plan, _Execution(plan, coll.layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root),
                                 plan.slots), prepared)


def _race_check(plan: Plan, run: _Execution, prepared: plan_fast.PlanReading | None) -> None:
    """RaceError where two steps race: the bulk path vouches for most plans
    (msc.verification.plan_fast.PlanReading.race_free); where it cannot, the
    happens-before walk below decides and words the race."""
    fast = (prepared if prepared is not None and prepared.ranks is plan.ranks else plan_fast.prepare(plan)).race_free()
    if fast and not crosscheck.ENABLED:
        return
    try:
        if run.static_order():       # a cycle: a deadlock, execute() reports it
            run.check_races()
    except RaceError as err:
        if fast:                     # cross-checking only: the fast path must never vouch for a race
            raise AssertionError(f"msc.verification.plan_fast vouched for a plan that races: {err}") from err
        raise


def _may_race(plan: Plan) -> bool:
    """Whether some rank has two threadblocks, or some threadblock switch ops:
    a rank with one runs its steps in program order, so no two of them can
    race (a ring's ranks, for one), unless other ranks reach its memory."""
    return any(len(rp.threadblocks) > 1 or any(tb.group for tb in rp.threadblocks) for rp in plan.ranks)


def plan_collective(plan: Plan, collective: Collective | str | None = None) -> Collective:
    """The collective a plan is checked against: ``collective`` where given
    (a Collective, or a built-in's name), else the built-in the plan names,
    else the custom collective its contract states (msc.ir.Contract)."""
    if collective is not None:
        return get_collective(collective)
    try:
        return get_collective(plan.collective)
    except UsageError:
        if plan.contract is not None:
            return stated_collective(plan)
        raise PlanError(f"the plan is for collective {plan.collective!r}, which is not built in, and does not state "
                        f"what it requires: pass its definition (--collective FILE.py:NAME, or collective= the "
                        f"CustomCollective it was made for, from Python)") from None


def stated_collective(plan: Plan) -> Collective:
    """The custom collective ``plan.contract`` states, for the plan's rank count and chunk factor."""
    return _stated(plan.collective, plan.num_ranks, plan.chunk_factor, plan.input_chunks, plan.output_chunks,
                   plan.contract)


@lru_cache(maxsize=16)      # one per plan read: its expectations are built once
def _stated(name: str, n: int, k: int, input_chunks: int, output_chunks: int, contract) -> Collective:
    from msc.dsl.collectives import StatedCollective

    return StatedCollective(name, n, k, input_chunks, output_chunks, contract)


@dataclass(frozen=True)
class StepFacts:
    """Per step: ``classes[j]``, the class of its chunk j (position within a
    data unit, which fixes its length at run time); ``fresh[o][j]``, whether
    chunk j of source operand o is an input read where it started, never
    written since (where an average scales inputs by 1/n, exactly once)."""

    classes: tuple[int, ...]
    fresh: tuple[tuple[bool, ...], ...]


@pause_gc
def step_facts(plan: Plan, *, collective: Collective | None = None,
               partial: bool = False) -> dict[tuple[int, int, int], StepFacts]:
    """StepFacts of every (rank, threadblock, step), from one symbolic run
    (the plan must be valid: verify it first). ``partial``: a plan that
    deadlocks gives the facts of the steps it reaches before it sticks,
    instead of DeadlockError (for putting a deadlock on a GPU on purpose)."""
    coll = collective or plan_collective(plan)
    run = _Execution(plan, coll.layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root), plan.slots)
    run.facts = {}
    try:
        run.execute()
    except DeadlockError:
        if not partial:
            raise
    return run.facts


def _cls(value, k, start_class):
    """A chunk's class: where its data started within a unit (a label's
    physical starting position, which a custom precondition may choose)."""
    return value.c if type(value) is Sum else start_class.get(value, value[1] % k)


@pause_gc
def verify_plan(plan: Plan, *, collective: Collective | None = None, slots: int | None = None,
                check_races: bool = True, checked: bool = False,
                prepared: plan_fast.PlanReading | None = None) -> PlanReport:
    """Verify ``plan``; raise VerificationError (DeadlockError, RaceError) or
    PlanError. ``slots`` overrides the plan's connection capacity.
    ``prepared``: ``msc.verification.plan_fast.prepare`` of a plan with the same ranks, so
    that verifying one plan at several capacities reads it once."""
    start = time.perf_counter()
    if not checked:
        check_plan(plan)
    coll = collective or plan_collective(plan)
    layout = coll.layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root)
    capacity = slots or plan.slots
    run = None
    if prepared is None:
        prepared = plan_fast.prepare(plan)
    if check_races and _may_race(plan):
        run = _Execution(plan, layout, capacity)
        _race_check(plan, run, prepared)
    # Race-free from here (checked above, or one threadblock per rank, or the
    # caller checked: lowering), so the bulk path's verdict is the executor's.
    # When it declines, the executor runs and words the error.
    accepted = prepared.accepts(plan, layout, capacity)
    if not accepted or crosscheck.ENABLED:
        run = run or _Execution(plan, layout, capacity)
        try:
            run.execute()
            run.check_outputs()
        except VerificationError as err:
            if accepted:             # cross-checking only: the fast path must never accept a bad plan
                raise AssertionError(f"msc.verification.plan_fast accepted a plan the executor rejects: {err}") from err
            raise
    return PlanReport(plan.name, plan.collective, plan.num_ranks,
                      sum(len(r.threadblocks) for r in plan.ranks), plan.num_steps(),
                      plan_fast.connections(plan), capacity, time.perf_counter() - start)


class _Execution:
    def __init__(self, plan: Plan, layout, capacity: int):
        self.plan, self.layout, self.capacity = plan, layout, capacity
        self.k = plan.chunk_factor
        self.start_class: dict = {}
        self.facts: dict | None = None
        self.bufs, self.writer = [], []   # filled by execute(): the race check needs no data
        # global step ids: base[rank][tb] + step
        self.base, gid = [], 0
        for rp in plan.ranks:
            row = []
            for tb in rp.threadblocks:
                row.append(gid)
                gid += len(tb.steps)
            self.base.append(row)
        self.total_steps = gid
        self.when = [-1] * gid            # execution order of each step
        self.sender = [None] * gid        # receiving gid -> sending gid
        self.sync_preds: dict[int, list[int]] = {}    # barrier gid -> what the other members did before theirs
        self._starts = None               # _reaches: first gid of each threadblock -> (rank, tb), sorted gids
        self.pcs = [[0] * len(rp.threadblocks) for rp in plan.ranks]
        self.connections = Connections(plan, capacity, self.pcs)
        self.barriers = self.connections.barriers
        self.fifo_in, self.fifo_out = self.connections.fifo_in, self.connections.fifo_out
        self.tb_of_end = {}               # (src, dst, ch, "send"/"recv") -> (rank, tb)
        for rp in plan.ranks:
            for tb in rp.threadblocks:
                if tb.send is not None:
                    self.tb_of_end[(rp.rank, tb.send, tb.channel, "send")] = (rp.rank, tb.id)
                if tb.recv is not None:
                    self.tb_of_end[(tb.recv, rp.rank, tb.channel, "recv")] = (rp.rank, tb.id)

    # -- running ------------------------------------------------------------
    def _load_inputs(self) -> None:
        """Every rank's buffers holding the collective's initial labels."""
        plan, layout = self.plan, self.layout
        for rank in range(plan.num_ranks):
            sizes = dict(layout.physical_sizes)
            sizes["scratch"] = plan.ranks[rank].scratch
            bufs = {b: [None] * c for b, c in sizes.items()}
            for buf, index, label in layout.initial(rank):
                bufs[buf][index] = label
                self.start_class[label] = index % self.k
            self.bufs.append(bufs)
            self.writer.append({b: [None] * c for b, c in sizes.items()})

    def execute(self) -> None:
        self._load_inputs()
        self.clock = 0                    # execution order, for ``when``
        drive(self.plan, self.pcs, self.connections.blocker, self._run)
        self._check_finished()

    def _read(self, rank, tb, s, sl, mem=None):
        """Slice ``sl`` as step ``s`` of ``rank`` reads it, in the memory of
        rank ``mem`` (default: its own)."""
        mem = rank if mem is None else mem
        out = self.bufs[mem][sl.buffer][sl.index:sl.index + sl.count]
        if None in out:               # one scan in C; the error names the first unwritten chunk
            j = out.index(None)
            step = self.plan.ranks[rank].threadblocks[tb.id].steps[s]
            raise VerificationError(
                f"rank {rank} threadblock {tb.id} step {s} ({step.op.value}) reads rank {mem} "
                f"{sl.buffer}[{sl.index + j}], which nothing has written",
                rank=mem, buffer=sl.buffer, index=sl.index + j, where=step.where)
        return out

    def _add(self, rank, tb, s, a, b):
        k, start_class = self.k, self.start_class
        ca = a.c if type(a) is Sum else start_class.get(a, a[1] % k)     # _cls, inlined: once per chunk
        cb = b.c if type(b) is Sum else start_class.get(b, b[1] % k)
        if ca != cb:
            step = self.plan.ranks[rank].threadblocks[tb.id].steps[s]
            raise VerificationError(
                f"rank {rank} threadblock {tb.id} step {s} ({step.op.value}) reduces chunks of different "
                f"classes ({ca} and {cb}: positions within a data unit of {k} chunks); the plan would only be "
                f"right when the element count is a multiple of {k}", rank=rank, where=step.where)
        node = Sum(a, b)
        node.c = ca
        return node

    def _write(self, rank, tb, s, sl, values, mem=None):
        mem = rank if mem is None else mem
        buf = self.bufs[mem][sl.buffer]
        wr = self.writer[mem][sl.buffer]
        gid = self.base[rank][tb.id] + s
        x = sl.index
        if sl.buffer != "scratch":    # a user buffer: each chunk must land in its own class
            k, start_class = self.k, self.start_class
            for j, v in enumerate(values):
                c = v.c if type(v) is Sum else start_class.get(v, v[1] % k)
                if c != (x + j) % k:
                    step = self.plan.ranks[rank].threadblocks[tb.id].steps[s]
                    into = "" if mem == rank else f"rank {mem} "
                    raise VerificationError(
                        f"rank {rank} threadblock {tb.id} step {s} ({step.op.value}) writes a chunk of class "
                        f"{c} into {into}{sl.buffer}[{x + j}] (class {(x + j) % k}); the plan would only be right "
                        f"when the element count is a multiple of {k}", rank=mem, buffer=sl.buffer, index=x + j,
                        where=step.where)
        buf[x:x + len(values)] = values
        wr[x:x + len(values)] = [gid] * len(values)

    def _run(self, rank, tb, s, step) -> tuple:
        op = step.op
        gid = self.base[rank][tb.id] + s
        self.when[gid] = self.clock
        self.clock += 1
        got = None
        if op.receives:
            fifo_in = self.fifo_in[rank][tb.id]
            sender_gid, got = fifo_in.take()
            self.sender[gid] = sender_gid
        if op.group_reads:                            # every member's copy, in member order
            srcs = [self._read(rank, tb, s, step.srcs[0], m) for m in tb.group]
        else:
            srcs = [self._read(rank, tb, s, sl) for sl in step.srcs]
        if self.facts is not None:
            self._record(rank, tb, s, step, srcs, got)
        stored, out = step_values(op, srcs, got,
                                  lambda xs, ys: [self._add(rank, tb, s, a, b) for a, b in zip(xs, ys)])
        if op.group_writes:
            for m in tb.group:
                self._write(rank, tb, s, step.dst, stored, m)
        elif step.dst is not None:                    # the ops that have one (check_plan)
            self._write(rank, tb, s, step.dst, stored)
        # every ``out`` is a list of its own (a slice, a message, new sums): it is sent as is
        released = ()
        if op.sends:
            fifo_out = self.fifo_out[rank][tb.id]
            fifo_out.items.append((gid, out))
            released = (fifo_in.space, fifo_out.msg) if op.receives else (fifo_out.msg,)
        elif op.receives:
            released = (fifo_in.space,)
        return released + self.barriers.released(rank, tb)

    def _record(self, rank, tb, s, step, srcs, got) -> None:
        """What a backend needs to know about a step that the plan does not
        say: the class of each chunk it moves, and which source chunks are
        inputs read where they started (never written since)."""
        values = srcs[0] if srcs else got or ()
        classes = tuple(_cls(v, self.k, self.start_class) for v in values)
        fresh = tuple(tuple(type(v) is not Sum and self.writer[rank][sl.buffer][sl.index + j] is None
                            for j, v in enumerate(vals)) for sl, vals in zip(step.srcs, srcs))
        self.facts[(rank, tb.id, s)] = StepFacts(classes, fresh)

    # -- deadlock -----------------------------------------------------------
    def _check_finished(self) -> None:
        plan = self.plan
        stuck = {}
        for rp in plan.ranks:
            for tb in rp.threadblocks:
                s = self.pcs[rp.rank][tb.id]
                if s < len(tb.steps):
                    stuck[(rp.rank, tb.id)] = (s, self.connections.blocker(rp.rank, tb, tb.steps[s]))
        if not stuck:
            return
        start = min(stuck)
        chain, seen, node = [], {}, start
        while node in stuck and node not in seen:
            seen[node] = len(chain)
            s, why = stuck[node]
            nxt, text = self._waits_on(node, s, why)
            chain.append((node[0], node[1], s, text))
            node = nxt
        if node in seen:
            cycle = chain[seen[node]:]
            head = "deadlock: every threadblock in this cycle waits for the next"
        else:
            cycle = chain
            rank, t = node
            head = (f"deadlock: the wait ends at rank {rank} threadblock {t}, which has finished "
                    f"(a message or step that never comes)")
        lines = [f"  rank {r} threadblock {t} step {s}: {text}" for r, t, s, text in cycle]
        where = plan.ranks[cycle[0][0]].threadblocks[cycle[0][1]].steps[cycle[0][2]].where
        err = DeadlockError(head + f" ({len(stuck)} threadblocks stuck)\n" + "\n".join(lines), cycle)
        err.where = where
        raise err

    def _waits_on(self, node, s, why):
        kind = why[0]
        if kind == "bar":
            _, member, t = why
            tb = self.plan.ranks[node[0]].threadblocks[node[1]]
            k = self.barriers.index(node[0], node[1], s)
            return (member, t), (f"waits at barrier {k} of switch group {','.join(map(str, tb.group))} "
                                 f"(channel {tb.channel}) for rank {member} threadblock {t}")
        if kind == "tb":
            _, rank, dt = why
            step = self.plan.ranks[node[0]].threadblocks[node[1]].steps[s]
            ds = max(d for t, d in step.deps if t == dt)
            return (rank, dt), f"waits for threadblock {dt} step {ds} of its rank"
        conn = why[1]
        src, dst, ch = conn
        if kind == "msg":
            return self.tb_of_end.get((src, dst, ch, "send"), (src, -1)), \
                f"waits for a message from rank {src} (channel {ch})"
        return self.tb_of_end.get((src, dst, ch, "recv"), (dst, -1)), \
            f"waits for space to send to rank {dst} (channel {ch}, {self.capacity} slot(s) full)"

    # -- races ----------------------------------------------------------------
    def static_order(self) -> bool:
        """A happens-before order of all steps that needs no execution:
        program order, dependencies, and the k-th send of a connection before
        its k-th receive. Sets ``when`` and ``sender`` for the race check, so
        its verdict cannot depend on the order an execution picks. False when
        the relation has a cycle (then the plan deadlocks at any capacity)."""
        plan = self.plan
        sends: dict[tuple, list[int]] = {}
        recvs: dict[tuple, list[int]] = {}
        for rp in plan.ranks:
            base = self.base[rp.rank]
            for tb in rp.threadblocks:
                g = base[tb.id]
                sent = sends.setdefault((rp.rank, tb.send, tb.channel), []) if tb.send is not None else None
                received = recvs.setdefault((tb.recv, rp.rank, tb.channel), []) if tb.recv is not None else None
                for step in tb.steps:
                    if step.op.sends:
                        sent.append(g)
                    if step.op.receives:
                        received.append(g)
                    g += 1
        self.sender = sender = [None] * self.total_steps
        for conn, receivers in recvs.items():
            for g_send, g_recv in zip(sends.get(conn, ()), receivers):
                sender[g_recv] = g_send
        self.sync_preds = sync = self._barrier_edges()
        # Successors in increasing step id, each step's predecessors in the
        # order previous step, dependencies, sender (the order of ``when``,
        # and so which race is reported first, follows from it).
        self.succs = succs = [[] for _ in range(self.total_steps)]
        indeg = [0] * self.total_steps
        for rp in plan.ranks:
            base = self.base[rp.rank]
            for tb in rp.threadblocks:
                g = base[tb.id]
                for s, step in enumerate(tb.steps):
                    n_in = 0
                    if s:
                        succs[g - 1].append(g)
                        n_in = 1
                    for dt, ds in step.deps:
                        succs[base[dt] + ds].append(g)
                        n_in += 1
                    p = sender[g]
                    if p is not None:
                        succs[p].append(g)
                        n_in += 1
                    for p in sync.get(g, ()):
                        succs[p].append(g)
                        n_in += 1
                    indeg[g] = n_in
                    g += 1
        ready = [g for g, d in enumerate(indeg) if d == 0]
        clock = 0
        when = self.when
        while ready:
            g = ready.pop()
            when[g] = clock
            clock += 1
            for t in succs[g]:
                indeg[t] -= 1
                if indeg[t] == 0:
                    ready.append(t)
        return clock == self.total_steps

    def _barrier_edges(self) -> dict[int, list[int]]:
        """Per barrier step, the steps of the other members its completion
        waits for: the step before each one's matching barrier, and that
        barrier's dependencies."""
        plan, base, sync = self.plan, self.base, {}
        self.barrier_gids = set()
        for (rank, t), bars in self.barriers.steps.items():
            tb = plan.ranks[rank].threadblocks[t]
            for s in bars:
                self.barrier_gids.add(base[rank][t] + s)
                preds = []
                for m, tm, b in self.barriers.peers(rank, tb, s):
                    if b:
                        preds.append(base[m][tm] + b - 1)
                    preds.extend(base[m][dt] + ds for dt, ds in plan.ranks[m].threadblocks[tm].steps[b].deps)
                if preds:
                    sync[base[rank][t] + s] = preds
        return sync

    def check_switch_races(self) -> None:
        """Accesses of switch ops to other ranks' chunks against every
        conflicting access to those chunks (the per-rank check below covers
        a switch op's accesses to its own rank's memory)."""
        plan, when = self.plan, self.when
        remote: dict[tuple, list[tuple[int, bool]]] = {}        # (memory rank, buffer, index) -> (gid, writes)
        for (rank, t) in self.barriers.steps:
            tb = plan.ranks[rank].threadblocks[t]
            for s, step in enumerate(tb.steps):
                g = self.base[rank][t] + s
                reaches = ([(step.srcs[0], False)] if step.op.group_reads else []) + \
                    ([(step.dst, True)] if step.op.group_writes else [])
                for sl, writes in reaches:
                    for m in tb.group:
                        if m != rank:
                            for x in range(sl.index, sl.index + sl.count):
                                remote.setdefault((m, sl.buffer, x), []).append((g, writes))
        if not remote:
            return
        self._check_within_calls(remote)
        local: dict[tuple, list[tuple[int, bool]]] = {}
        for rp in plan.ranks:
            for tb in rp.threadblocks:
                g = self.base[rp.rank][tb.id]
                for step in tb.steps:
                    for sl, writes in [(sl, False) for sl in step.srcs] + ([(step.dst, True)] if step.dst else []):
                        for x in range(sl.index, sl.index + sl.count):
                            key = (rp.rank, sl.buffer, x)
                            if key in remote:
                                local.setdefault(key, []).append((g, writes))
                    g += 1
        for key, accesses in remote.items():
            others = accesses + local.get(key, [])
            for i, (ga, wa) in enumerate(accesses):
                for gb, wb in others[i + 1:]:
                    if gb != ga and (wa or wb):
                        first, second = (ga, gb) if when[ga] < when[gb] else (gb, ga)
                        if not self._reaches_gid(first, second):
                            self._switch_race(key, (ga, wa), (gb, wb))

    def _check_within_calls(self, remote) -> None:
        """A switch op reaching rank m's memory must come after a step of m
        and before one: else m's collective call may not have started (its
        stream may still use the buffer) or may have returned (the caller may
        reuse it) while the access happens."""
        checked = set()
        before, after = self._rank_reach()
        for (m, buf, x), accesses in remote.items():
            for g, writes in accesses:
                if (g, m) in checked:
                    continue
                checked.add((g, m))
                for forward, when_ in ((False, "started"), (True, "returned")):
                    if not ((after if forward else before)[g] >> m) & 1:
                        r, t, s = self._locate(g)
                        step = self.plan.ranks[r].threadblocks[t].steps[s]
                        origin = f", from {step.where}" if step.where is not None else ""
                        side = "before" if forward else "after"
                        raise RaceError(
                            f"race on rank {m} {buf}[{x}]: rank {r} threadblock {t} step {s} ({step.op.value}{origin}) "
                            f"{'writes' if writes else 'reads'} it through the switch, and nothing orders that {side} "
                            f"a step of rank {m}: rank {m}'s collective call may not have {when_} by then (a barrier "
                            f"of the switch group {'after' if forward else 'before'} it would)",
                            ((r, t, s),), rank=m, buffer=buf, index=x, where=step.where)

    def _rank_reach(self) -> tuple[list[int], list[int]]:
        """Per step id, as bit masks of ranks, what ``_meets_rank`` asks:
        ``before[g]``, the ranks with a step before g (or in the group of a
        barrier at or before g); ``after[g]``, the ranks with a step after g.
        One pass each way over ``when`` (a topological order) instead of one
        graph search per (switch step, rank): the searches made the check
        quadratic in the ranks of a switch group."""
        n = self.total_steps
        rank_bit, group_bit = [0] * n, {}
        for r, row in enumerate(self.base):
            for tb in self.plan.ranks[r].threadblocks:
                g0 = row[tb.id]
                rank_bit[g0:g0 + len(tb.steps)] = [1 << r] * len(tb.steps)
                group_bit[(r, tb.id)] = sum(1 << x for x in set(tb.group))
        order = sorted(range(n), key=self.when.__getitem__)
        before = [0] * n
        for g in self.barrier_gids:
            r, t, _ = self._locate(g)
            before[g] = group_bit[(r, t)]
        succs = self.succs
        for g in order:
            carry = before[g] | rank_bit[g]
            for h in succs[g]:
                before[h] |= carry
        after = [0] * n
        for g in reversed(order):
            acc = 0
            for h in succs[g]:
                acc |= after[h] | rank_bit[h]
            after[g] = acc
        return before, after

    def _meets_rank(self, g, m, forward: bool) -> bool:
        """Whether a step of rank ``m`` happens before (``forward``: after)
        step ``g``. Looking back, a barrier of a group holding m counts: m
        had reached its matching barrier when that one completed."""
        stack, seen = [g], {g}
        while stack:
            h = stack.pop()
            r, t, _ = self._locate(h)
            if h != g and r == m:
                return True
            if not forward and h in self.barrier_gids and m in self.plan.ranks[r].threadblocks[t].group:
                return True
            for p in self.succs[h] if forward else self._preds(h):
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        return False

    def _preds(self, g) -> list[int]:
        """Step ``g``'s happens-before predecessors."""
        r, t, s = self._locate(g)
        step = self.plan.ranks[r].threadblocks[t].steps[s]
        preds = [g - 1] if s else []
        preds.extend(self.base[r][dt] + ds for dt, ds in step.deps)
        if self.sender[g] is not None:
            preds.append(self.sender[g])
        preds.extend(self.sync_preds.get(g, ()))
        return preds

    def _locate(self, g):
        """(rank, threadblock, step) of step id ``g`` (a bisection over the
        threadblocks' first ids, built once: a plan can need many)."""
        if self._starts is None:      # an empty threadblock shares its id with the next: the later one wins
            loc = {}
            for r, row in enumerate(self.base):
                for t, g0 in enumerate(row):
                    loc[g0] = (r, t)
            self._starts = (loc, sorted(loc))
        loc, bases = self._starts
        g0 = bases[bisect.bisect_right(bases, g) - 1]
        r, t = loc[g0]
        return r, t, g - g0

    def _switch_race(self, key, a, b):
        m, buf, x = key
        (ra, ta, sa), (rb, tb_, sb) = self._locate(a[0]), self._locate(b[0])
        steps = [self.plan.ranks[r].threadblocks[t].steps[s] for r, t, s in ((ra, ta, sa), (rb, tb_, sb))]

        def who(r, t, s, st, writes):
            origin = f", from {st.where}" if st.where is not None else ""
            through = " through the switch" if r != m else ""
            return f"rank {r} threadblock {t} step {s} ({st.op.value}{origin}) {'writes' if writes else 'reads'} it{through}"
        raise RaceError(
            f"race on rank {m} {buf}[{x}]: {who(ra, ta, sa, steps[0], a[1])} and {who(rb, tb_, sb, steps[1], b[1])}, "
            f"and nothing orders the two (a barrier of the switch group between them would)",
            ((ra, ta, sa), (rb, tb_, sb)), rank=m, buffer=buf, index=x, where=steps[1].where)

    def check_races(self) -> None:
        """FastTrack over the observed order with a static happens-before:
        each access must follow the chunk's last write, and a write must also
        follow every read since. Local vector clocks (one entry per
        threadblock of the rank) answer most questions; the rest search the
        happens-before graph backwards, pruned by execution time."""
        self.check_switch_races()
        plan, when = self.plan, self.when
        for rp in plan.ranks:
            tbs = rp.threadblocks
            if len(tbs) < 2:          # program order orders all its steps: nothing can race
                continue
            nt = len(tbs)
            # this rank's steps by execution time (``when`` is a total order, so no ties)
            first = self.base[rp.rank][0]
            t_of = [tb.id for tb in tbs for _ in tb.steps]
            s_of = [s for tb in tbs for s in range(len(tb.steps))]
            order = sorted(range(first, first + len(t_of)), key=when.__getitem__)
            vcs = [[None] * len(tb.steps) for tb in tbs]
            # per buffer, chunk index -> last write / reads since: small int keys, no tuple per access
            last_write = {sl.buffer: {} for tb in tbs for step in tb.steps
                          for sl in step.srcs + ((step.dst,) if step.dst is not None else ())}
            reads = {buf: {} for buf in last_write}
            for g in order:
                t, s = t_of[g - first], s_of[g - first]
                step = tbs[t].steps[s]
                vc = list(vcs[t][s - 1]) if s else [0] * nt
                for dt, ds in step.deps:
                    dv = vcs[dt][ds]
                    for i in range(nt):
                        if dv[i] > vc[i]:
                            vc[i] = dv[i]
                    if ds + 1 > vc[dt]:
                        vc[dt] = ds + 1
                vc[t] = s
                vcs[t][s] = vc
                here = (t, s)
                for sl in step.srcs:
                    writes, since = last_write[sl.buffer], reads[sl.buffer]
                    for x in range(sl.index, sl.index + sl.count):
                        w = writes.get(x)
                        if w is not None and not self._before(rp.rank, w, here, vc):
                            self._race(rp.rank, w, here, (sl.buffer, x), "writes", "reads")
                        r = since.get(x)
                        if r is None:
                            since[x] = [here]
                        else:
                            r.append(here)
                if step.dst is not None:
                    sl = step.dst
                    writes, since = last_write[sl.buffer], reads[sl.buffer]
                    for x in range(sl.index, sl.index + sl.count):
                        w = writes.get(x)
                        if w is not None and not self._before(rp.rank, w, here, vc):
                            self._race(rp.rank, w, here, (sl.buffer, x), "writes", "writes")
                        for r in since.pop(x, ()):
                            if r != here and not self._before(rp.rank, r, here, vc):
                                self._race(rp.rank, r, here, (sl.buffer, x), "reads", "writes")
                        writes[x] = here

    def _before(self, rank, a, b, vc_b) -> bool:
        ta, sa = a
        tb, sb = b
        if ta == tb:
            return sa < sb
        if vc_b[ta] > sa:
            return True
        return self._reaches(rank, a, b)

    def _reaches(self, rank, a, b) -> bool:
        """Is there a happens-before path from step a to step b (both on
        ``rank``)? Searched backwards from b over steps that ran after a."""
        return self._reaches_gid(self.base[rank][a[0]] + a[1], self.base[rank][b[0]] + b[1])

    def _reaches_gid(self, target, start) -> bool:
        """Is there a happens-before path from step id ``target`` to ``start``?
        Searched backwards from ``start`` over steps that ran after ``target``."""
        floor, when = self.when[target], self.when
        stack, seen = [start], {start}
        while stack:
            g = stack.pop()
            if g == target:
                return True
            for p in self._preds(g):
                if p not in seen and when[p] >= floor:
                    seen.add(p)
                    stack.append(p)
        return False

    def _race(self, rank, a, b, key, how_a, how_b):
        tbs = self.plan.ranks[rank].threadblocks
        sa, sb = tbs[a[0]].steps[a[1]], tbs[b[0]].steps[b[1]]
        buf, x = key
        def origin(st):
            return f", from {st.where}" if st.where is not None else ""

        raise RaceError(
            f"race on rank {rank} {buf}[{x}]: threadblock {a[0]} step {a[1]} ({sa.op.value}{origin(sa)}) "
            f"{how_a} it and threadblock {b[0]} step {b[1]} ({sb.op.value}{origin(sb)}) {how_b} it, "
            f"and nothing orders the two (add a dependency)",
            ((rank, a[0], a[1]), (rank, b[0], b[1])), rank=rank, buffer=buf, index=x, where=sb.where)

    # -- postcondition --------------------------------------------------------
    def check_outputs(self) -> None:
        checked = set()
        for rank in range(self.plan.num_ranks):
            for index, buf, pidx, expected in self.layout.expected(rank):
                if expected is None:
                    continue
                value = self.bufs[rank][buf][pidx]
                if value is None:
                    raise VerificationError(f"rank {rank} output[{index}] is never written by the plan",
                                            rank=rank, buffer="output", index=index)
                key = (id(value), id(expected))
                if key in checked:
                    continue
                found = contributions(value)
                if found != expected.counts:
                    gid = self.writer[rank][buf][pidx]
                    how, where = "it still holds its initial value", None
                    if gid is not None:
                        r, t, s = self._locate(gid)
                        step = self.plan.ranks[r].threadblocks[t].steps[s]
                        how, where = f"last written by threadblock {t} step {s} ({step.op.value})", step.where
                    raise contribution_error(rank, index, expected.counts, found, how, where)
                checked.add(key)

