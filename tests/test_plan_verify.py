"""The plan verifier (msc.verification.plan.verify_plan) against independent checks.

Library plans at 4 ranks are mutated (dataclasses.replace on the plan IR):
steps deleted (with the steps they exchange messages with, so connections
stay paired, and alone), a slice moved by one chunk, a dependency dropped,
two receives of a threadblock reordered, two steps swapped, a peer changed,
and an unordered write added on another threadblock. Each mutant is judged
here without the verifier:

- malformed: msc.verification.plan_values.check_plan raises PlanError;
- deadlock: ``Simulator`` below (FIFO connections of ``plan.slots``
  messages, every threadblock stepped round-robin) gets stuck;
- bad data: the simulator reads a chunk nothing wrote, or mixes chunk
  classes (a chunk's position in its data unit; see ir.Plan);
- race: ``races`` below finds two steps of a rank touching one chunk, one
  writing, not ordered by program order, dependencies and messages;
- wrong: the reference executor (msc.executor) on random integers, in
  several threadblock orders and element counts, disagrees with
  msc.verification.reference (or stops with an ExecutionError);
- equivalent: none of these.

The verifier must reject the first five with the right error class and
accept the equivalent ones; the verdict must not depend on the order the
threadblocks of a rank are listed in. ``python tests/test_plan_verify.py``
prints the mutant statistics.
"""
from __future__ import annotations

import random
import sys
from collections import Counter, defaultdict, deque
from dataclasses import replace

import numpy as np
import pytest

import msc
from msc.dsl.collectives import get_collective
from msc.errors import DeadlockError, PlanError, RaceError, VerificationError
from msc.ir import Plan, RankPlan, Slice, Step, StepOp, Threadblock
from msc.lower.pipeline import LowerOptions, lower
from msc.verification.plan_values import check_plan
from msc.verification.plan import verify_plan

try:
    from msc.executor import ExecutionError, run_collective
    from msc.verification.reference import check as reference_check
except ImportError:                      # another engineer is finishing the executor
    run_collective = None

N = 4
PLANS = {
    "allreduce/ring": ("allreduce/ring", {}),
    "allreduce/allpairs": ("allreduce/allpairs", {}),
    "allreduce/tree:binomial": ("allreduce/tree", {"name": "binomial"}),
    "alltoall/hierarchical": ("alltoall/hierarchical", {"gpus_per_node": 2}),
    "broadcast/chain": ("broadcast/chain", {}),
}
KINDS = ("delete_paired", "delete_unpaired", "slice_offset", "drop_dependency", "reorder_receives",
         "swap_steps", "change_peer", "unordered_write")
PER_KIND = 25            # mutants per kind, plan and form


def library_plan(key: str, inplace: bool) -> Plan:
    path, params = PLANS[key]
    params = dict(params)
    name = params.pop("name", None)
    algs = msc.load_algorithms(path)
    alg = next(a for a in algs if name is None or a.name == name)
    program = msc.trace(alg, N, inplace=inplace, **params)
    msc.verify(program)
    return lower(program, LowerOptions())


# -- an independent simulator ---------------------------------------------------
class Simulator:
    """Runs a plan abstractly: every threadblock in turn tries its next step
    (round-robin, one step per turn); a step runs when its dependencies have
    run, a message is waiting (receives) and fewer than ``slots`` messages
    are in flight on its outgoing connection (sends). Tracks, per chunk,
    whether it was written and its class (index within its data unit)."""

    def __init__(self, plan: Plan, slots: int | None = None):
        self.plan, self.slots = plan, slots or plan.slots
        k = plan.chunk_factor
        layout = get_collective(plan.collective).layout(plan.num_ranks, k, plan.inplace, plan.root)
        self.k = k
        self.chunks = []
        for r, rp in enumerate(plan.ranks):
            sizes = dict(layout.physical_sizes, scratch=rp.scratch)
            bufs = {b: [None] * c for b, c in sizes.items()}
            for buf, index, _ in layout.initial(r):
                bufs[buf][index] = index % k        # physical offsets of aliases are whole units
            self.chunks.append(bufs)
        self.problems: list[str] = []
        self.order: list[tuple] = []

    def run(self) -> bool:
        """True when every threadblock finished; False when stuck (deadlock)."""
        plan = self.plan
        pcs = {(rp.rank, tb.id): 0 for rp in plan.ranks for tb in rp.threadblocks}
        queues = defaultdict(deque)
        tbs = [(rp.rank, tb) for rp in plan.ranks for tb in rp.threadblocks]
        while True:
            moved = False
            for rank, tb in tbs:
                s = pcs[(rank, tb.id)]
                if s == len(tb.steps):
                    continue
                step = tb.steps[s]
                if any(pcs[(rank, dt)] <= ds for dt, ds in step.deps):
                    continue
                inbox = queues[(tb.recv, rank, tb.channel)]
                outbox = queues[(rank, tb.send, tb.channel)]
                if step.op.receives and not inbox:
                    continue
                if step.op.sends and len(outbox) >= self.slots:
                    continue
                got = inbox.popleft() if step.op.receives else None
                out = self._execute(rank, tb, s, step, got)
                if step.op.sends:
                    outbox.append(out)
                pcs[(rank, tb.id)] = s + 1
                self.order.append((rank, tb.id, s))
                moved = True
            if not moved:
                return all(pcs[(rank, tb.id)] == len(tb.steps) for rank, tb in tbs)

    def _read(self, rank, where, sl):
        values = self.chunks[rank][sl.buffer][sl.index:sl.index + sl.count]
        if any(v is None for v in values):
            self.problems.append(f"{where} reads unwritten {sl}")
        return values

    def _add(self, where, xs, ys):
        if any(x is not None and y is not None and x != y for x, y in zip(xs, ys)):
            self.problems.append(f"{where} reduces chunks of different classes")
        return [x if x is not None else y for x, y in zip(xs, ys)]

    def _execute(self, rank, tb, s, step, got):
        where = f"rank {rank} tb {tb.id} step {s} ({step.op.value})"
        srcs = [self._read(rank, where, sl) for sl in step.srcs]
        op = step.op
        if op in (StepOp.RECV, StepOp.RCS):
            value = got
        elif op in (StepOp.RRS, StepOp.RRC, StepOp.RRCS):
            value = self._add(where, srcs[0], got)
        elif op is StepOp.COPY or op is StepOp.SEND:
            value = srcs[0]
        elif op is StepOp.REDUCE:
            value = srcs[0]
            for more in srcs[1:]:
                value = self._add(where, value, more)
        else:
            value = None
        if step.dst is not None:
            sl = step.dst
            if sl.buffer != "scratch":
                for j, v in enumerate(value):
                    if v is not None and v != (sl.index + j) % self.k:
                        self.problems.append(f"{where} writes class {v} into {sl.buffer}[{sl.index + j}]")
            self.chunks[rank][sl.buffer][sl.index:sl.index + sl.count] = value
        return value


def message_pairs(plan: Plan):
    """(sending (rank, tb, step), receiving (rank, tb, step)) of every message."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, tb, s, step in plan.steps():
        if step.op.sends:
            sends[(rank, tb.send, tb.channel)].append((rank, tb.id, s))
        if step.op.receives:
            recvs[(tb.recv, rank, tb.channel)].append((rank, tb.id, s))
    return [pair for conn in sends for pair in zip(sends[conn], recvs.get(conn, []))]


def races(plan: Plan) -> list[tuple]:
    """Pairs of steps of one rank that touch one chunk, one writing, with no
    happens-before path (program order, dependencies, send -> receive)
    between them, in either direction. None when happens-before has a cycle."""
    nodes = [(rank, tb.id, s) for rank, tb, s, _ in plan.steps()]
    index = {x: i for i, x in enumerate(nodes)}
    preds = [[] for _ in nodes]
    for rank, tb, s, step in plan.steps():
        me = index[(rank, tb.id, s)]
        if s:
            preds[me].append(index[(rank, tb.id, s - 1)])
        preds[me].extend(index[(rank, dt, ds)] for dt, ds in step.deps)
    for a, b in message_pairs(plan):
        preds[index[b]].append(index[a])
    succ = [[] for _ in nodes]
    for b, ps in enumerate(preds):
        for a in ps:
            succ[a].append(b)
    indeg = [len(p) for p in preds]
    topo, queue = [], deque(i for i, d in enumerate(indeg) if not d)
    while queue:
        i = queue.popleft()
        topo.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if not indeg[j]:
                queue.append(j)
    if len(topo) != len(nodes):
        return None
    before = [0] * len(nodes)           # bitset of every step that happens before
    for i in topo:
        bits = 0
        for p in preds[i]:
            bits |= before[p] | (1 << p)
        before[i] = bits
    access = defaultdict(list)           # (rank, buffer, chunk) -> [(node, writes)]
    for rank, tb, s, step in plan.steps():
        me = index[(rank, tb.id, s)]
        for sl in step.srcs:
            for x in range(sl.index, sl.index + sl.count):
                access[(rank, sl.buffer, x)].append((me, False))
        if step.dst is not None:
            for x in range(step.dst.index, step.dst.index + step.dst.count):
                access[(rank, step.dst.buffer, x)].append((me, True))
    found = []
    for key, uses in access.items():
        for (a, wa), (b, wb) in _pairs(uses):
            if (wa or wb) and a != b and not (before[b] >> a & 1) and not (before[a] >> b & 1):
                found.append((nodes[a], nodes[b], key))
    return found


def _pairs(uses):
    for i in range(len(uses)):
        for j in range(i + 1, len(uses)):
            yield uses[i], uses[j]


def numeric_problem(plan: Plan, seed: int) -> str | None:
    """What the reference executor finds wrong, in several orders and counts (None: right)."""
    rng = np.random.default_rng(seed)
    k = plan.chunk_factor
    units = plan.input_chunks // k
    # counts 1..k give every pair of chunk classes different lengths somewhere; 2k+1 has a tail
    for count in [*range(1, k + 1), 2 * k + 1]:
        for order in (None, seed, seed + 1):
            inputs = [rng.integers(-2 ** 20, 2 ** 20, units * count).astype(np.int64) for _ in range(plan.num_ranks)]
            try:
                outputs = run_collective(plan, inputs, "sum", count=count, seed=order)
            except ExecutionError as exc:
                return f"count {count}: {exc}"
            wrong = reference_check(plan.collective, inputs, outputs, op="sum", root=plan.root)
            if any(wrong):
                return f"count {count}: wrong elements per rank {wrong}"
    return None


# -- editing plans ------------------------------------------------------------------
class Editable:
    """A plan as lists of step keys (rank, tb, step index in the original),
    edited freely, then rebuilt with dense ids and dependencies renumbered
    to follow the steps they named. A dependency on a deleted step moves to
    the closest earlier surviving step of that threadblock (or is dropped)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.step = {}
        self.ranks = []                 # per rank: [[tb header, [keys]]]
        for rp in plan.ranks:
            row = []
            for tb in rp.threadblocks:
                keys = []
                for s, step in enumerate(tb.steps):
                    self.step[(rp.rank, tb.id, s)] = step
                    keys.append((rp.rank, tb.id, s))
                row.append([tb, keys])
            self.ranks.append(row)
        self.extra = 0

    def add(self, rank: int, step: Step) -> tuple:
        self.extra += 1
        key = (rank, "new", self.extra)
        self.step[key] = step
        return key

    def delete(self, keys) -> None:
        keys = set(keys)
        for row in self.ranks:
            for entry in row:
                entry[1] = [k for k in entry[1] if k not in keys]

    def build(self) -> Plan:
        position = {}
        for r, row in enumerate(self.ranks):
            for t, (_, keys) in enumerate(row):
                for s, key in enumerate(keys):
                    position[key] = (t, s)
        ranks = []
        for r, row in enumerate(self.ranks):
            built = []
            for t, (tb, keys) in enumerate(row):
                steps = []
                for key in keys:
                    step = self.step[key]
                    deps = {}
                    for dt, ds in step.deps:
                        target = next(((r, dt, d) for d in range(ds, -1, -1) if (r, dt, d) in position), None)
                        if target is None:
                            continue
                        nt, ns = position[target]
                        if nt == t:
                            continue      # now on its own threadblock: program order
                        deps[nt] = max(ns, deps.get(nt, -1))
                    steps.append(replace(step, deps=tuple(sorted(deps.items()))))
                built.append(replace(tb, id=t, steps=tuple(steps)))
            ranks.append(replace(self.plan.ranks[r], threadblocks=tuple(built)))
        return replace(self.plan, ranks=tuple(ranks))


def permuted(plan: Plan, rng: random.Random) -> Plan:
    """The same plan with every rank's threadblocks listed in a random order."""
    ed = Editable(plan)
    for row in ed.ranks:
        rng.shuffle(row)
    return ed.build()


def _slices(step):
    return list(step.srcs) + ([step.dst] if step.dst is not None else [])


def mutants(plan: Plan, kind: str, rng: random.Random):
    """Up to PER_KIND (description, mutant) pairs of one kind."""
    steps = [(rank, tb, s, step) for rank, tb, s, step in plan.steps()]
    pairs = message_pairs(plan)
    partner = defaultdict(set)
    for a, b in pairs:
        partner[a].add(b)
        partner[b].add(a)
    out, seen = [], set()
    for _ in range(PER_KIND * 6):
        if len(out) >= PER_KIND:
            break
        ed = Editable(plan)
        rank, tb, s, step = rng.choice(steps)
        key = (rank, tb.id, s)
        if kind == "delete_paired":
            victims, todo = set(), [key]
            while todo:
                x = todo.pop()
                if x not in victims:
                    victims.add(x)
                    todo.extend(partner[x])
            ed.delete(victims)
            what = f"delete {sorted(victims)}"
        elif kind == "delete_unpaired":
            if not (step.op.sends or step.op.receives):
                continue
            ed.delete([key])
            what = f"delete {key} alone"
        elif kind == "slice_offset":
            choices = _slices(step)
            if not choices:
                continue
            i = rng.randrange(len(choices))
            delta = rng.choice((-1, 1))
            moved = replace(choices[i], index=choices[i].index + delta)
            if i < len(step.srcs):
                new = replace(step, srcs=step.srcs[:i] + (moved,) + step.srcs[i + 1:])
            else:
                new = replace(step, dst=moved)
            ed.step[key] = new
            what = f"{key}: {choices[i]} -> {moved}"
        elif kind == "drop_dependency":
            if not step.deps:
                continue
            dep = rng.choice(step.deps)
            ed.step[key] = replace(step, deps=tuple(d for d in step.deps if d != dep))
            what = f"{key}: drop dependency {dep}"
        elif kind in ("reorder_receives", "swap_steps"):
            entry = ed.ranks[rank][tb.id]
            idx = [i for i, k in enumerate(entry[1]) if kind == "swap_steps" or ed.step[k].op.receives]
            if len(idx) < 2:
                continue
            i, j = sorted(rng.sample(idx, 2))
            if kind == "swap_steps" and rng.random() < 0.5 and i + 1 < len(entry[1]):
                j = i + 1                                      # adjacent steps half the time
            entry[1][i], entry[1][j] = entry[1][j], entry[1][i]
            what = f"rank {rank} tb {tb.id}: swap steps {i} and {j}"
        elif kind == "change_peer":
            sides = [side for side in ("send", "recv") if getattr(tb, side) is not None]
            if not sides:
                continue
            side = rng.choice(sides)
            peer = rng.choice([p for p in range(plan.num_ranks) if p not in (rank, getattr(tb, side))])
            entry = ed.ranks[rank][tb.id]
            entry[0] = replace(entry[0], **{side: peer})
            what = f"rank {rank} tb {tb.id}: {side} peer {getattr(tb, side)} -> {peer}"
        elif kind == "unordered_write":
            if step.dst is None or len(plan.ranks[rank].threadblocks) < 2:
                continue
            other = rng.choice([t for t in plan.ranks[rank].threadblocks if t.id != tb.id])
            dst = step.dst
            src = Slice("input", dst.index % plan.chunk_factor, dst.count) if dst.buffer != "input" else \
                Slice(dst.buffer, (dst.index + plan.chunk_factor) % plan.input_chunks, dst.count)
            if src.index + src.count > plan.input_chunks or src == dst:
                continue
            new = ed.add(rank, Step(StepOp.COPY, (src,), dst, dst.count))
            ed.ranks[rank][other.id][1].append(new)
            what = f"rank {rank} tb {other.id}: copy {src} -> {dst} at the end, unordered with {key}"
        else:
            raise AssertionError(kind)
        if what in seen:
            continue
        seen.add(what)
        out.append((what, ed.build()))
    return out


# -- judging ---------------------------------------------------------------------
def judge(plan: Plan, seed: int = 0) -> tuple[str, str]:
    """(category, detail) from the independent checks alone, in this order:
    malformed, deadlock, race, wrong (the executor), bad data (only the
    simulator objects: the result is right at these sizes, but not for every
    size or not with every initial content), equivalent."""
    try:
        check_plan(plan)
    except PlanError as exc:
        return "malformed", str(exc)
    sim = Simulator(plan)
    if not sim.run():
        return "deadlock", "; ".join(sim.problems[:1])
    found = races(plan)
    if found:
        return "race", str(found[0])
    if run_collective is None:
        return ("bad data", sim.problems[0]) if sim.problems else ("unknown", "no reference executor")
    problem = numeric_problem(plan, seed)
    if problem:
        return "wrong", problem + (f" (simulator: {sim.problems[0]})" if sim.problems else "")
    if sim.problems:
        return "bad data", sim.problems[0]
    return "equivalent", ""


def verdict(plan: Plan):
    try:
        verify_plan(plan)
    except (PlanError, VerificationError) as exc:
        return exc
    return None


def assert_consistent(category: str, detail: str, error, what: str) -> None:
    context = f"{what}: independent verdict {category} ({detail}); verifier: {type(error).__name__}: {error}"
    if category == "malformed":
        assert isinstance(error, PlanError), context
    elif category == "deadlock":
        assert isinstance(error, VerificationError), context
        if not detail:                              # nothing read garbage before it got stuck
            assert isinstance(error, DeadlockError), context
    elif category == "bad data":
        assert isinstance(error, VerificationError) and not isinstance(error, DeadlockError), context
    elif category == "race":
        # the race itself, or, in the verifier's order, a symptom of it met first while executing
        assert isinstance(error, RaceError) or (type(error) is VerificationError and _data_error(error)), context
    elif category == "wrong":
        assert isinstance(error, VerificationError), context
        assert not isinstance(error, (DeadlockError, RaceError)), context
    elif category == "equivalent":
        assert error is None, context
    else:
        assert category == "unknown"
        assert error is None or isinstance(error, VerificationError), context


def _data_error(error) -> bool:
    text = str(error)
    return "which nothing has written" in text or "class" in text


STATS: Counter = Counter()
STATS_COVER: set = set()            # (key, inplace) pairs whose mutants are in STATS


def check_plan_mutants(key: str, inplace: bool, stats: Counter) -> None:
    plan = library_plan(key, inplace)
    assert judge(plan)[0] in ("equivalent", "unknown"), judge(plan)
    assert verdict(plan) is None
    rng = random.Random(f"{key}:{inplace}")
    for kind in KINDS:
        for what, mutant in mutants(plan, kind, random.Random(f"{key}:{inplace}:{kind}")):
            category, detail = judge(mutant, seed=len(stats))
            error = verdict(mutant)
            assert_consistent(category, detail, error, f"{key} inplace={inplace} {kind} {what}")
            # the verdict does not depend on the order of threadblocks: the same error class, except
            # that a racy plan may show a symptom of its race first (counted as "race order-dependent")
            again = verdict(permuted(mutant, rng))
            assert (again is None) == (error is None), f"{what}: {error!r} vs {again!r} after permuting"
            if type(again) is not type(error):
                assert category == "race", f"{what}: {error!r} vs {again!r} after permuting threadblocks"
                assert_consistent(category, detail, again, f"{key} inplace={inplace} {kind} {what} (permuted)")
                stats[kind, "race order-dependent"] += 1
            stats[kind, category] += 1


@pytest.mark.parametrize("inplace", [False, True], ids=["outofplace", "inplace"])
@pytest.mark.parametrize("key", sorted(PLANS))
def test_verifier_agrees_with_independent_checks_on_mutants(key, inplace):
    stats = Counter()
    check_plan_mutants(key, inplace, stats)
    STATS.update(stats)
    STATS_COVER.add((key, inplace))
    assert sum(stats.values()) >= 5 * len(KINDS)
    caught = sum(c for (_, cat), c in stats.items() if cat not in ("equivalent", "unknown"))
    assert caught > sum(stats.values()) // 2, stats


def test_every_mutant_kind_is_caught_somewhere():
    # under xdist this worker may have run only some of the tests above: check the plans it missed
    for key in sorted(PLANS):
        if (key, False) not in STATS_COVER and (key, True) not in STATS_COVER:
            check_plan_mutants(key, False, STATS)
            STATS_COVER.add((key, False))
    for kind in KINDS:
        assert sum(c for (k, cat), c in STATS.items() if k == kind and cat not in ("equivalent", "unknown")), kind
    assert STATS["unordered_write", "race"] > 0 and STATS["drop_dependency", "race"] > 0
    assert sum(c for (k, cat), c in STATS.items() if cat == "deadlock") > 0


# -- hand-built plans ------------------------------------------------------------------
def S(op: str, srcs=(), dst=None, deps=()) -> Step:
    """A one-chunk step: srcs/dst as (buffer, index)."""
    srcs = tuple(Slice(b, i, 1) for b, i in srcs)
    return Step(StepOp(op), srcs, Slice(*dst, 1) if dst else None, 1, tuple(deps))


def allgather2(ranks: dict, k: int = 1, slots: int = 1) -> Plan:
    """A 2-rank out-of-place allgather plan from {rank: [(send, recv, [steps])]}."""
    return Plan("hand", "allgather", 2, k, False, k, 2 * k, tuple(
        RankPlan(r, 0, tuple(Threadblock(t, send, recv, 0, tuple(steps))
                             for t, (send, recv, steps) in enumerate(ranks[r]))) for r in range(2)), slots=slots)


def _local(r):
    return (None, None, [S("copy", [("input", 0)], ("output", r))])


def test_receive_first_on_both_ranks_deadlocks_at_any_capacity():
    plan = allgather2({r: [(1 - r, 1 - r, [S("recv", dst=("output", 1 - r)), S("send", [("input", 0)])]),
                           _local(r)] for r in range(2)})
    assert not Simulator(plan).run()
    for slots in (1, 2, 8):
        with pytest.raises(DeadlockError) as info:
            verify_plan(plan, slots=slots)
        cycle = info.value.cycle
        assert {entry[0] for entry in cycle} == {0, 1}
        assert {(entry[0], entry[1], entry[2]) for entry in cycle} == {(0, 0, 0), (1, 0, 0)}
        assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
        assert "waits for a message" in str(info.value)


def test_send_first_on_both_ranks_does_not_deadlock_with_one_slot():
    """A send completes into the connection while fewer than ``slots``
    messages are in flight: both ranks send, then both receive."""
    plan = allgather2({r: [(1 - r, 1 - r, [S("send", [("input", 0)]), S("recv", dst=("output", 1 - r))]),
                           _local(r)] for r in range(2)})
    assert Simulator(plan, slots=1).run()
    verify_plan(plan, slots=1)


def test_two_sends_before_receiving_deadlock_with_one_slot_only():
    k = 2
    steps = {r: [(1 - r, 1 - r, [S("send", [("input", 0)]), S("send", [("input", 1)]),
                                 S("recv", dst=("output", 2 * (1 - r))), S("recv", dst=("output", 2 * (1 - r) + 1))]),
                 (None, None, [S("copy", [("input", 0)], ("output", 2 * r)),
                               S("copy", [("input", 1)], ("output", 2 * r + 1))])] for r in range(2)}
    plan = allgather2(steps, k=k)
    assert not Simulator(plan, slots=1).run()
    with pytest.raises(DeadlockError) as info:
        verify_plan(plan, slots=1)
    assert {entry[0] for entry in info.value.cycle} == {0, 1}
    assert "space" in str(info.value)
    assert Simulator(plan, slots=2).run()
    verify_plan(plan, slots=2)


def test_deadlock_through_a_dependency_names_the_cycle():
    """rank 0 tb 0 waits for a message rank 1 only sends after its tb 1 got one
    from rank 0 tb 1, which waits (dependency) for rank 0 tb 0."""
    plan = allgather2({
        0: [(None, 1, [S("recv", dst=("output", 1))]),
            (1, None, [S("send", [("input", 0)], deps=[(0, 0)])]), _local(0)],
        1: [(0, None, [S("send", [("input", 0)], deps=[(1, 0)])]),
            (None, 0, [S("recv", dst=("output", 0))]), _local(1)],
    })
    assert not Simulator(plan).run()
    with pytest.raises(DeadlockError) as info:
        verify_plan(plan)
    assert {(r, t) for r, t, _, _ in info.value.cycle} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_receive_without_a_send_is_a_plan_error():
    plan = allgather2({0: [(1, 1, [S("send", [("input", 0)]), S("recv", dst=("output", 1))]), _local(0)],
                       1: [(None, 0, [S("recv", dst=("output", 0))]), _local(1)]})
    with pytest.raises(PlanError, match=r"rank 1 -> rank 0 channel 0: 0 sends but 1 receives"):
        check_plan(plan)
    with pytest.raises(PlanError):
        verify_plan(plan)


def test_two_threadblocks_writing_one_chunk_race():
    good = allgather2({r: [(1 - r, 1 - r, [S("send", [("input", 0)]), S("recv", dst=("output", 1 - r))]),
                           _local(r)] for r in range(2)})
    verify_plan(good)
    # rank 0's tb 1 also writes output[1] (with its own input: a wrong value too) with no dependency
    racy = Editable(good)
    racy.ranks[0][1][1].append(racy.add(0, S("copy", [("input", 0)], ("output", 1))))
    racy = racy.build()
    assert races(racy)
    with pytest.raises(RaceError) as info:
        verify_plan(racy)
    assert set(info.value.steps) == {(0, 0, 1), (0, 1, 1)}
    assert "output[1]" in str(info.value) and "threadblock 0 step 1" in str(info.value) \
        and "threadblock 1 step 1" in str(info.value)
    # ordered by a dependency it is no race, and the later write decides (wrongly here)
    ordered = replace(racy, ranks=(replace(racy.ranks[0], threadblocks=(
        racy.ranks[0].threadblocks[0],
        replace(racy.ranks[0].threadblocks[1], steps=(
            racy.ranks[0].threadblocks[1].steps[0], replace(racy.ranks[0].threadblocks[1].steps[1],
                                                            deps=((0, 1),)))))),
        racy.ranks[1]))
    assert not races(ordered)
    with pytest.raises(VerificationError) as info:
        verify_plan(ordered)
    assert not isinstance(info.value, RaceError) and "rank 0 output[1]" in str(info.value)


def test_race_through_another_rank_is_ordered_by_messages():
    """Two threadblocks of rank 0 ordered only by a round trip through rank 1: no race."""
    plan = allgather2({
        0: [(1, None, [S("copy", [("input", 0)], ("output", 1)), S("send", [("input", 0)])]),
            (None, 1, [S("recv", dst=("output", 1))]), (None, None, [S("copy", [("input", 0)], ("output", 0))])],
        1: [(0, 0, [S("recv", dst=("output", 0)), S("send", [("input", 0)])]), _local(1)],
    })
    assert not races(plan)
    verify_plan(plan)


@pytest.mark.parametrize("key", sorted(PLANS))
def test_verdict_does_not_depend_on_threadblock_order(key):
    rng = random.Random(key)
    plan = library_plan(key, False)
    for _ in range(5):
        other = permuted(plan, rng)
        check_plan(other)
        verify_plan(other)
    # a deadlocking and a racing variant keep their verdicts too
    for kind, expected in (("drop_dependency", RaceError), ("swap_steps", DeadlockError)):
        for what, mutant in mutants(plan, kind, random.Random(key + kind)):
            error = verdict(mutant)
            if isinstance(error, expected):
                for _ in range(4):
                    assert type(verdict(permuted(mutant, rng))) is type(error), what
                break


def test_racy_read_is_rejected_in_every_threadblock_order():
    """A send of a chunk another threadblock writes with no dependency: a race,
    whichever order the threadblocks are listed in (races are checked on a
    static happens-before order, before anything executes)."""
    writer = (None, None, [S("copy", [("input", 0)], ("output", 0))])
    reader = (1, None, [S("send", [("output", 0)])])
    rest = {1: [(None, 0, [S("recv", dst=("output", 0))]), (None, None, [S("copy", [("input", 0)], ("output", 1))])]}
    for tbs_of_0 in ([writer, reader], [reader, writer]):
        plan = allgather2({0: tbs_of_0 + [(None, None, [])], **rest})
        assert races(plan)
        with pytest.raises(RaceError):
            verify_plan(plan)


def test_simulator_and_race_check_accept_every_library_plan():
    """The independent checks themselves: no false alarms on verified plans."""
    for key in PLANS:
        for inplace in (False, True):
            plan = library_plan(key, inplace)
            sim = Simulator(plan)
            assert sim.run() and not sim.problems, key
            assert races(plan) == [], key
            if plan.slots > 1:
                assert not Simulator(plan, slots=plan.slots - 1).run()


def test_huge_scratch_is_a_plan_error():
    # a plan file with 'scratch 99999999999999999999' once crashed msc verify (OverflowError)
    plan = allgather2({r: [(1 - r, 1 - r, [S("send", [("input", 0)]), S("recv", dst=("output", 1 - r))]),
                           _local(r)] for r in range(2)})
    huge = replace(plan, ranks=(replace(plan.ranks[0], scratch=10 ** 20), plan.ranks[1]))
    with pytest.raises(PlanError, match="scratch must be"):
        check_plan(huge)
    with pytest.raises(PlanError, match="scratch must be"):
        verify_plan(huge)


def main() -> int:
    stats = Counter()
    for key in sorted(PLANS):
        for inplace in (False, True):
            check_plan_mutants(key, inplace, stats)
    cats = ("malformed", "deadlock", "race", "wrong", "bad data", "equivalent", "unknown", "race order-dependent")
    labels = [c if c != "race order-dependent" else "race/order" for c in cats]
    print(f"{'mutant kind':18}" + "".join(f"{c:>11}" for c in labels) + f"{'total':>7}")
    for kind in KINDS:
        row = [stats[kind, c] for c in cats]
        print(f"{kind:18}" + "".join(f"{x:>11}" for x in row) + f"{sum(row[:-1]):>7}")
    print("(race/order: racy mutants whose error class changed when threadblocks were permuted; "
          "total excludes it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def test_step_facts_of_a_deadlocking_plan_raise_unless_partial():
    """A plan that deadlocks: step_facts raises DeadlockError; partial=True
    gives the facts of the steps reached before it sticks, and no others."""
    from msc.verification.plan import step_facts

    plan = allgather2({r: [(1 - r, 1 - r, [S("recv", dst=("output", 1 - r)), S("send", [("input", 0)])]),
                           _local(r)] for r in range(2)})
    with pytest.raises(DeadlockError):
        step_facts(plan)
    facts = step_facts(plan, partial=True)
    every = {(rank, tb.id, i) for rank, tb, i, _ in plan.steps()}
    assert set(facts) < every
