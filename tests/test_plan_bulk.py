"""The plan verifier's fast path (msc.verification.plan_fast.accepts) against its executor.

accepts() may only say True where the executor (execute, then check_outputs)
succeeds, at the capacity asked. On library plans (every algorithm, several
rank counts, both forms, protocols and instances) it must agree exactly, at
the plan's own capacity and at one slot; on mutants of library plans (from
test_plan_verify's mutants: deleted steps, moved slices, dropped
dependencies, swapped receives and steps, changed peers; plus one slot) a
True must mean the executor succeeds, and most correct mutants must be
accepted, so the test cannot pass by declining everything.

fewest_slots() must be the executor's first deadlock-free capacity, on the
same plans and mutants; Layout.expected_list (built-ins read it in bulk, rows
shared between ranks) must equal the per-chunk postcondition.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest
from library import algorithms
from test_plan_verify import KINDS, S, allgather2, mutants

import msc
from msc.dsl.collectives import BUILTIN, AllReduce, get_collective
from msc.errors import DeadlockError, MscError, PlanError, RaceError, VerificationError
from msc.lower.pipeline import MAX_SLOTS, LowerOptions, lower
from msc.verification.plan_fast import accepts, fewest_slots, prepare
from msc.verification import crosscheck
from msc.verification.plan_values import check_plan
from msc.verification.plan import _Execution, check_races, plan_collective, verify_plan

ALGORITHMS = algorithms(switch=False)
RANKS = (3, 4, 8)
OPTIONS = (LowerOptions(), LowerOptions(protocol="LL", instances=2))


def layout_of(plan):
    return plan_collective(plan).layout(plan.num_ranks, plan.chunk_factor, plan.inplace, plan.root)


def executor_accepts(plan, slots: int) -> bool:
    run = _Execution(plan, layout_of(plan), slots)
    try:
        run.execute()
        run.check_outputs()
    except MscError:
        return False
    return True


def executor_fewest_slots(plan, most: int = MAX_SLOTS):
    """The first capacity 1, 2, 4.. <= most the executor runs the plan to the
    end at (most * 2: none); None where it stops on another error first (it
    cannot tell then whether the plan would have deadlocked)."""
    slots = 1
    while slots <= most:
        try:
            _Execution(plan, layout_of(plan), slots).execute()
            return slots
        except DeadlockError:
            slots *= 2
        except Exception:            # a verification error, or a malformed plan's crash
            return None
    return most * 2


def library_plans():
    """(description, plan) for every algorithm at the rank counts it supports."""
    for key, alg in sorted(ALGORITHMS.items()):
        for n in RANKS:
            if not alg.supports(n):
                continue
            for inplace in (False, True):
                for options in OPTIONS:
                    program = msc.trace(alg, n, inplace=inplace)
                    yield f"{key} n={n} inplace={inplace} {options.protocol}x{options.instances}", \
                        lower(program, options)


def test_agrees_with_the_executor_on_every_library_plan():
    seen, fewest = Counter(), Counter()
    for what, plan in library_plans():
        prepared = prepare(plan)
        for slots in sorted({plan.slots, 1}):
            expected = executor_accepts(plan, slots)
            assert accepts(plan, layout_of(plan), slots) == expected, f"{what} slots={slots}"
            assert prepared.accepts(plan, layout_of(plan), slots) == expected, f"{what} slots={slots} (prepared)"
            seen[expected] += 1
        slots = executor_fewest_slots(plan)
        assert prepared.fewest_slots(MAX_SLOTS) == fewest_slots(plan, MAX_SLOTS) == slots == plan.slots, what
        fewest[slots] += 1
    assert seen[True] > 100 and seen[False] > 0, seen     # the lowered plans, and some at one slot deadlock
    assert fewest[1] > 0 and fewest[2] > 0, fewest


def test_fewest_slots_agrees_with_the_executor_on_mutants():
    stats = Counter()
    for key in MUTATED:
        params = {"gpus_per_node": 2} if "hierarchical" in key else {}
        plan = lower(msc.trace(ALGORITHMS[key], 4, **params))
        for kind in KINDS:
            for what, mutant in mutants(plan, kind, random.Random(f"{key}:fewest:{kind}")):
                slow = executor_fewest_slots(mutant, 4)
                if slow is None:
                    stats["stops on another error"] += 1
                    continue
                fast = fewest_slots(mutant, 4)
                if fast is None:                  # it cannot tell: only on a plan check_plan rejects
                    with pytest.raises(PlanError):
                        check_plan(mutant)
                    stats["malformed"] += 1
                    continue
                assert fast == slow, f"{key} {kind}: {what}"
                stats[slow] += 1
    # some mutants run at one slot, some need more, some deadlock at every capacity
    assert stats[1] >= 50 and stats[2] >= 5 and stats[8] >= 5, stats


def test_fewest_slots_of_hand_built_plans():
    def sends_first(r, sends):
        steps = [S("send", [("input", j)]) for j in range(sends)]
        steps += [S("recv", dst=("output", sends * (1 - r) + j)) for j in range(sends)]
        return [(1 - r, 1 - r, steps), (None, None, [S("copy", [("input", j)], ("output", sends * r + j))
                                                    for j in range(sends)])]

    for sends in (1, 2, 3, 5):   # both ranks send all, then receive: one slot per message in flight
        plan = allgather2({r: sends_first(r, sends) for r in range(2)}, k=sends)
        want = 1 << (sends - 1).bit_length()
        assert fewest_slots(plan, 8) == want == executor_fewest_slots(plan, 8)
        if want > 1:
            with pytest.raises(DeadlockError):
                verify_plan(plan, slots=want // 2)
        verify_plan(plan, slots=want, prepared=prepare(plan))
    assert fewest_slots(plan, 4) == 8                       # more than ``most``: ``most * 2``
    receive_first = allgather2({r: [(1 - r, 1 - r, [S("recv", dst=("output", 1 - r)), S("send", [("input", 0)])]),
                                    (None, None, [S("copy", [("input", 0)], ("output", r))])] for r in range(2)})
    assert fewest_slots(receive_first, 8) == 16 == executor_fewest_slots(receive_first, 8)
    # a receive no one sends for waits at every capacity; a plan it cannot read: None
    lonely = allgather2({0: [(None, 1, [S("recv", dst=("output", 1))]), (None, None, [S("copy", [("input", 0)],
                                                                                          ("output", 0))])],
                         1: [(None, None, [S("copy", [("input", 0)], ("output", 1))])]})
    assert fewest_slots(lonely, 8) == 16 == executor_fewest_slots(lonely, 8)
    # a send no one receives holds its slot for good: the third send waits forever with one slot
    extra = allgather2({0: [(1, None, [S("send", [("input", 0)])] * 3),
                            (None, None, [S("copy", [("input", 0)], ("output", 0))])],
                        1: [(None, 0, [S("recv", dst=("output", 0))]),
                            (None, None, [S("copy", [("input", 0)], ("output", 1))])]})
    assert fewest_slots(extra, 8) == 2 == executor_fewest_slots(extra, 8)
    rp = receive_first.ranks[0]
    twice = replace(receive_first, ranks=(replace(rp, threadblocks=rp.threadblocks + (
        replace(rp.threadblocks[0], id=len(rp.threadblocks)),)),) + receive_first.ranks[1:])
    assert fewest_slots(twice, 8) is None


def test_verify_plan_takes_only_its_own_prepared_plan():
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 4))
    other = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 4))
    verify_plan(replace(plan, slots=4), prepared=prepare(plan))
    with pytest.raises(ValueError):
        verify_plan(plan, prepared=prepare(other))


def test_lowering_takes_the_fewest_slots_without_the_executor(monkeypatch):
    """The bulk path finds the capacity: the executor never runs (outside
    the cross_checks fixture's double check of accepted plans)."""
    import msc.verification.plan_fast
    import msc.verification.plan

    ran = []
    monkeypatch.setattr(crosscheck, "ENABLED", False)
    monkeypatch.setattr(msc.verification.plan._Execution, "execute", lambda self: ran.append(self.capacity))
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 8))
    assert plan.slots == 2 and ran == []


def test_the_cross_check_catches_a_fast_path_that_accepts_a_wrong_plan(monkeypatch):
    """The cross_checks fixture (tests/conftest.py) is on, and it is what
    would expose a fast path vouching for a plan the executor rejects."""
    import msc.verification.plan

    assert crosscheck.ENABLED
    # each rank sends its input but keeps its own output unwritten: wrong results, no deadlock
    wrong = allgather2({r: [(1 - r, 1 - r, [S("send", [("input", 0)]), S("recv", dst=("output", 1 - r))])]
                        for r in range(2)})
    monkeypatch.setattr(type(prepare(wrong)), "accepts", lambda self, plan, layout, capacity: True)
    with pytest.raises(AssertionError, match="accepted a plan the executor rejects"):
        verify_plan(wrong)
    monkeypatch.setattr(crosscheck, "ENABLED", False)
    assert verify_plan(wrong).steps == 4          # without it, the lie is believed: why tests turn it on


# -- expectations in bulk --------------------------------------------------------------
class RankedAllReduce(AllReduce):
    """A subclass that changes the postcondition, not the row sharing: must not share rows."""

    def postcondition(self, rank, index, n, k, root):
        return self._expect((n, index, rank), lambda: [(r, index) for r in range(n) if r != rank or n == 1])


CUSTOM = msc.CustomCollective("shift", input_chunks=lambda n, k: k, output_chunks=lambda n, k: k,
                              postcondition=lambda r, i, n, k: None if i % 3 == 2 else [((r + i) % n, i % k)] * 2)


@pytest.mark.parametrize("name", [*BUILTIN, "ranked", "custom"])
def test_expected_list_equals_the_postcondition_per_chunk(name):
    coll = {"ranked": RankedAllReduce(), "custom": CUSTOM}.get(name) or get_collective(name)
    per_call = {"ranked": RankedAllReduce(), "custom": CUSTOM}.get(name) or get_collective(name)   # a fresh cache
    for n, k, inplace, root in ((1, 1, False, 0), (3, 2, False, 1), (4, 3, True, 2), (5, 1, True, 4)):
        layout = coll.layout(n, k, inplace, root)
        rows = []                                            # kept alive: their ids stay distinct
        for rank in range(n):
            buf, off, got = layout.expected_list(rank)
            want = [per_call.postcondition(rank, i, n, k, root) for i in range(layout.logical_sizes["output"])]
            assert (buf, off) == layout.alias(rank, "output")
            assert type(got) is list and len(got) == len(want)
            assert [None if e is None else e.counts for e in got] == [None if e is None else e.counts for e in want]
            assert [e is None for e in got] == [e is None for e in want]
            got.clear()                                      # a list of the caller's: the next call is unchanged
            assert len(layout.expected_list(rank)[2]) == len(want)
            rows.append(layout.expected_row(rank)[2])
        if name in ("allreduce", "allgather", "broadcast") and n > 1:
            assert len(set(map(id, rows))) == 1, name      # one row for all ranks: read once in bulk
        if name in ("ranked", "alltoall", "reducescatter") and n > 1:
            assert len(set(map(id, rows))) == n, name


def test_bulk_outputs_reject_what_the_executor_rejects():
    """A ring allreduce checked against a collective whose expectations differ
    by one label, or by a multiplicity: declined, and the executor says why."""
    plan = lower(msc.trace(ALGORITHMS["allreduce/ring:ring"], 4))
    n, k = plan.num_ranks, plan.chunk_factor
    wrong = (lambda r, i, n, k: [(j, i) for j in range(n) if j != 1],            # a label missing
             lambda r, i, n, k: [(j, i) for j in range(n)] + [(0, i)],           # one counted twice
             lambda r, i, n, k: [(j, i) for j in range(n - 1)] + [(n - 1, (i + 1) % k)])   # another chunk's
    for post in wrong:
        coll = msc.CustomCollective("almost", input_chunks=k, output_chunks=k, postcondition=post)
        layout = coll.layout(n, k, plan.inplace, plan.root)
        assert not accepts(plan, layout, plan.slots)
        with pytest.raises(VerificationError, match="output"):
            verify_plan(plan, collective=coll)
    right = msc.CustomCollective("same", input_chunks=k, output_chunks=k,
                                 postcondition=lambda r, i, n, k: [(j, i) for j in range(n)])
    assert accepts(plan, right.layout(n, k, plan.inplace, plan.root), plan.slots)


MUTATED = ("allreduce/ring:ring", "allreduce/allpairs:allpairs", "allreduce/tree:binomial",
           "alltoall/hierarchical:hierarchical", "broadcast/chain:chain", "reducescatter/ring:ring",
           "allgather/recursive_doubling:recursive_doubling")


def test_never_accepts_a_mutant_the_executor_rejects():
    stats = Counter()
    for key in MUTATED:
        params = {"gpus_per_node": 2} if "hierarchical" in key else {}
        for inplace in (False, True):
            plan = lower(msc.trace(ALGORITHMS[key], 4, inplace=inplace, **params))
            for kind in (*KINDS, "one_slot"):
                if kind == "one_slot":
                    found = [("slots=1", replace(plan, slots=1))]
                else:
                    found = mutants(plan, kind, random.Random(f"{key}:{inplace}:{kind}"))
                for what, mutant in found:
                    try:
                        check_plan(mutant)
                        check_races(mutant)      # verify_plan asks accepts() only about race-free plans
                    except (PlanError, RaceError):
                        stats["malformed or racy"] += 1
                        continue
                    fast = accepts(mutant, layout_of(mutant), mutant.slots)
                    slow = executor_accepts(mutant, mutant.slots)
                    assert slow or not fast, f"{key} inplace={inplace}: accepted a bad mutant ({kind}: {what})"
                    stats[("good" if slow else "bad", "accepted" if fast else "declined")] += 1
    # Every correct, race-free mutant is accepted today; fewer would make the fast path useless.
    assert stats[("good", "declined")] == 0, stats
    assert stats[("good", "accepted")] >= 20 and stats[("bad", "declined")] >= 200, stats


def test_declines_what_it_cannot_judge():
    alg = ALGORITHMS["allreduce/ring:ring"]
    plan = lower(msc.trace(alg, 4))
    layout = layout_of(plan)
    assert accepts(plan, layout, plan.slots)
    # a capacity it cannot use, a slice outside its buffer (check_plan skipped), a second sending threadblock
    assert not accepts(plan, layout, 0)
    rp = plan.ranks[0]
    tb = rp.threadblocks[0]
    far = replace(tb.steps[0], srcs=(replace(tb.steps[0].srcs[0], index=10 ** 6),)) if tb.steps[0].srcs else None
    if far is not None:
        bad = replace(plan, ranks=(replace(rp, threadblocks=(replace(tb, steps=(far,) + tb.steps[1:]),)
                                         + rp.threadblocks[1:]),) + plan.ranks[1:])
        assert not accepts(bad, layout, plan.slots)
    twice = replace(plan, ranks=(replace(rp, threadblocks=rp.threadblocks + (replace(tb, id=len(rp.threadblocks)),)),)
                    + plan.ranks[1:])
    assert not accepts(twice, layout, plan.slots)


def python_race_check(plan) -> RaceError | None:
    """The race check's happens-before walk alone (msc.verification.plan), without the fast path."""
    run = _Execution(plan, layout_of(plan), plan.slots)
    try:
        if run.static_order():
            run.check_races()
    except RaceError as err:
        return err
    return None


def test_race_free_vouches_only_for_plans_without_races():
    """PlanReading.race_free against the happens-before walk: on library plans
    of several threadblocks per rank (instances) it vouches for every one; on
    their mutants (dropped dependencies, swapped steps, ...) a True must mean
    the walk finds no race, and it must vouch for most race-free mutants."""
    stats = Counter()
    for key in MUTATED:
        params = {"gpus_per_node": 2} if "hierarchical" in key else {}
        for inplace in (False, True):
            plan = lower(msc.trace(ALGORITHMS[key], 4, inplace=inplace, **params), LowerOptions(instances=2))
            assert prepare(plan).race_free() and python_race_check(plan) is None, key
            for kind in KINDS:
                for what, mutant in mutants(plan, kind, random.Random(f"{key}:{inplace}:race:{kind}")):
                    try:
                        check_plan(mutant)
                    except PlanError:
                        continue
                    fast, slow = prepare(mutant).race_free(), python_race_check(mutant)
                    assert slow is None or not fast, f"{key} inplace={inplace}: vouched for a race ({kind}: {what})"
                    stats[("racy" if slow else "race-free", "vouched" if fast else "declined")] += 1
    assert stats[("racy", "declined")] >= 20, stats
    assert stats[("race-free", "vouched")] >= 10 * stats[("race-free", "declined")], stats


def test_a_reading_that_dropped_its_arrays_answers_as_a_fresh_one():
    """accepts() drops the static edges (and its own arrays) once used; a
    later question at another capacity reads them again, with the answers
    and edges of a fresh reading."""
    compared = 0
    for what, alg in sorted(ALGORITHMS.items()):
        if not alg.supports(8):
            continue
        plan = lower(msc.trace(alg, 8))
        fresh = prepare(plan)
        edges = [a.copy() for a in fresh.edges]
        used = prepare(plan)
        assert used.accepts(plan, layout_of(plan), 8) is True, what
        assert used._edges is None, what
        for slots in (1, 2, 4):
            assert used.accepts(plan, layout_of(plan), slots) == fresh.accepts(plan, layout_of(plan), slots), what
        assert used.fewest_slots(MAX_SLOTS) == fresh.fewest_slots(MAX_SLOTS) == plan.slots, what
        assert used.race_free() == fresh.race_free(), what
        assert all((a == b).all() for a, b in zip(used.edges, edges)), what
        compared += 1
    assert compared > 20


@pytest.mark.parametrize("setting", ["pieces of 1", "pieces of 5", "wide"])
def test_pieces_of_accesses_and_narrow_indices_answer_as_the_plain_run(monkeypatch, setting):
    """The race check and the dataflow work a piece of chunks at a time
    (msc.ir.accesses.PIECE), on int32 indices where they fit (NARROW_BELOW):
    with pieces of one to a few accesses, and with every index int64 (the
    path past the int32 range), on plans and their mutants, race_free() and
    accepts() answer as in one piece on int32, and the dataflow's values are
    equal array for array; and the dataflow from the race check's sorted
    events equals the one that sorts its own."""
    import numpy as np

    import msc.ir.accesses as accesses
    from msc.verification.plan_fast import PlanReading

    flows, lane_types = [], set()
    real_flow, real_lanes = PlanReading._dataflow, PlanReading._lanes

    def recorded(self, *args):
        try:
            flows.append(real_flow(self, *args))
        except Exception:
            flows.append(None)
            raise
        return flows[-1]

    def lanes(self):
        got = real_lanes(self)
        lane_types.update(a.dtype for a in (got.read_lane, got.write_row, got.write_lane))
        return got

    monkeypatch.setattr(PlanReading, "_dataflow", recorded)
    monkeypatch.setattr(PlanReading, "_lanes", lanes)
    plans = []
    for key in ("allreduce/ring:ring", "allreduce/hierarchical:hierarchical", "reducescatter/ring:ring"):
        params = {"gpus_per_node": 2} if "hierarchical" in key else {}
        plan = lower(msc.trace(ALGORITHMS[key], 4, **params), LowerOptions(instances=2))
        plans.append(plan)
        for kind in ("drop_dependency", "slice_offset"):
            plans += [m for _, m in mutants(plan, kind, random.Random(f"{key}:pieces:{kind}"))[:2]]

    def answers():
        got = []
        for plan in plans:
            flows.clear()
            try:
                check_plan(plan)
            except PlanError:
                continue
            fresh = prepare(plan).accepts(plan, layout_of(plan), plan.slots)    # its own sort of the events
            fresh_flow = flows[:]
            flows.clear()
            reading = prepare(plan)                 # as lowering asks: the dataflow reuses the race check's sort
            reading.fewest_slots(MAX_SLOTS)
            got.append((reading.race_free(), reading.accepts(plan, layout_of(plan), plan.slots), flows[:]))
            assert got[-1][1] == fresh and _equal_flows(got[-1][2], fresh_flow)
        return got

    plain = answers()
    assert sum(race for race, _, _ in plain) >= 3
    assert lane_types == {np.dtype(np.int32)}
    assert sum(ok for _, ok, _ in plain) >= 3 and any(flow for _, _, flow in plain)
    lane_types.clear()
    if setting == "wide":
        monkeypatch.setattr(accesses, "NARROW_BELOW", 0)
    else:
        monkeypatch.setattr(accesses, "PIECE", int(setting.split()[-1]))
    for (race, ok, flow), got in zip(plain, answers(), strict=True):
        assert got[:2] == (race, ok) and _equal_flows(got[2], flow)
    assert lane_types == {np.dtype(np.int32 if setting != "wide" else np.int64)}


def _equal_flows(got, expected) -> bool:
    """Dataflow results (read values, final values; None: declined), array for array."""
    import numpy as np

    return len(got) == len(expected) and all(
        (a is None) == (b is None) and (a is None or all(np.array_equal(x, y) for x, y in zip(a, b)))
        for a, b in zip(got, expected))
